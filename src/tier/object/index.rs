//! The object tier's in-memory index (docs/tier.md "Object tier", index and budget): what the tier
//! knows of each key of its namespace — present (with the value's bytes, when it was last used and
//! when it was written), being written, being fetched, or absent until a deadline — and the
//! least-recently-used order over the values it holds, from which the byte budget evicts.
//!
//! Keys are the xxh3-64 of their stem ([`format::key_stem`](crate::tier::format::key_stem)), so
//! that a value found by listing (whose name may be a hashed stem) and a key asked for meet in
//! one entry. Only the scheduler's calls and the runtime's short critical sections touch it, under
//! the tier's one mutex; nothing here waits.
#![forbid(unsafe_code)]

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

/// What the index knows of one key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Entry {
    /// The store holds the value (as of `seen`).
    Present {
        /// The value's stem (its object name is made from it).
        stem: Box<str>,
        /// Bytes of the value (header + payload).
        bytes: u64,
        /// Recency stamp (its position in the LRU order).
        recency: u64,
        /// When it was written (Unix ns): the TTL counts from here.
        born_ns: u64,
        /// When this process last confirmed it (Unix ns): a listing that started after and did
        /// not find it forgets it.
        seen_ns: u64,
    },
    /// A write of it is queued or running.
    Writing {
        /// As in `Present`.
        stem: Box<str>,
        /// As in `Present`.
        bytes: u64,
        /// As in `Present`.
        recency: u64,
    },
    /// A fetch (HEAD) of it is running.
    Fetching,
    /// Not in the store (or the store could not say) until `until`.
    Absent {
        /// When the key is unknown again.
        until: Instant,
    },
}

/// The index. See the module docs.
#[derive(Debug, Default)]
pub(super) struct Index {
    map: HashMap<u64, Entry, foldhash::fast::RandomState>,
    /// `(recency, id)` of every `Present` and `Writing` entry (recency: a stamp of this process's
    /// use, or a listed value's modification time).
    lru: BTreeSet<(u64, u64)>,
    /// Bytes of the values `Present` or `Writing`.
    bytes: u64,
    /// The last recency stamp given.
    last: u64,
}

impl Index {
    /// A recency stamp after every one given, near `now_ns` (Unix ns) when that is later.
    pub(super) fn stamp(&mut self, now_ns: u64) -> u64 {
        self.last = (self.last + 1).max(now_ns);
        self.last
    }

    pub(super) fn get(&self, id: u64) -> Option<&Entry> {
        self.map.get(&id)
    }

    pub(super) fn get_mut(&mut self, id: u64) -> Option<&mut Entry> {
        self.map.get_mut(&id)
    }

    /// Entries (all kinds).
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    /// Bytes of the values present or being written.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Sets `id`'s entry, keeping the byte count and the LRU order.
    pub(super) fn set(&mut self, id: u64, e: Entry) {
        self.remove(id);
        match &e {
            Entry::Present { bytes, recency, .. } | Entry::Writing { bytes, recency, .. } => {
                self.bytes += bytes;
                self.lru.insert((*recency, id));
            }
            Entry::Fetching | Entry::Absent { .. } => {}
        }
        self.map.insert(id, e);
    }

    /// Removes `id`'s entry; returns it.
    pub(super) fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.map.remove(&id)?;
        if let Entry::Present { bytes, recency, .. } | Entry::Writing { bytes, recency, .. } = &e {
            self.bytes = self.bytes.saturating_sub(*bytes);
            self.lru.remove(&(*recency, id));
        }
        Some(e)
    }

    /// Records a value found (by a fetch or a read): present, most recently used, born at
    /// `born_ns`, confirmed at `now_ns`.
    pub(super) fn found(&mut self, id: u64, stem: Box<str>, bytes: u64, born_ns: u64, now_ns: u64) {
        let recency = self.stamp(now_ns);
        self.set(
            id,
            Entry::Present {
                stem,
                bytes,
                recency,
                born_ns,
                seen_ns: now_ns,
            },
        );
    }

    /// Moves a present value to the most-recent end.
    pub(super) fn touch(&mut self, id: u64, now_ns: u64) {
        let stamp = self.stamp(now_ns);
        if let Some(Entry::Present { recency, .. }) = self.map.get_mut(&id) {
            self.lru.remove(&(*recency, id));
            *recency = stamp;
            self.lru.insert((stamp, id));
        }
    }

    /// Takes the least-recently-used present value (not one being written) out of the index:
    /// `(id, stem, bytes)`.
    pub(super) fn evict_lru(&mut self) -> Option<(u64, Box<str>, u64)> {
        let id = self
            .lru
            .iter()
            .map(|&(_, id)| id)
            .find(|id| matches!(self.map.get(id), Some(Entry::Present { .. })))?;
        match self.remove(id) {
            Some(Entry::Present { stem, bytes, .. }) => Some((id, stem, bytes)),
            _ => None,
        }
    }

    /// Drops absent entries past their deadline (keeps the index bounded by what it holds).
    pub(super) fn prune_absent(&mut self, now: Instant) {
        self.map
            .retain(|_, e| !matches!(e, Entry::Absent { until } if *until <= now));
    }

    /// Present values not confirmed since `since_ns` and not in `seen`: `(id, stem)`, for the
    /// listing that started at `since_ns` to forget (another engine or a lifecycle rule removed
    /// them).
    pub(super) fn unseen_since(
        &self,
        since_ns: u64,
        seen: &std::collections::HashSet<u64, foldhash::fast::RandomState>,
    ) -> Vec<u64> {
        self.map
            .iter()
            .filter(|(id, e)| {
                matches!(e, Entry::Present { seen_ns, .. } if *seen_ns < since_ns)
                    && !seen.contains(id)
            })
            .map(|(id, _)| *id)
            .collect()
    }

    /// Present values born before `cutoff_ns`: `(id, stem)`.
    pub(super) fn born_before(&self, cutoff_ns: u64) -> Vec<(u64, Box<str>)> {
        self.map
            .iter()
            .filter_map(|(id, e)| match e {
                Entry::Present { stem, born_ns, .. } if *born_ns < cutoff_ns => {
                    Some((*id, stem.clone()))
                }
                _ => None,
            })
            .collect()
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)]
mod tests {
    use super::*;

    fn present(ix: &mut Index, id: u64, bytes: u64, now: u64) {
        let recency = ix.stamp(now);
        ix.set(
            id,
            Entry::Present {
                stem: format!("{id:x}").into(),
                bytes,
                recency,
                born_ns: now,
                seen_ns: now,
            },
        );
    }

    #[test]
    fn bytes_and_lru_follow_the_entries() {
        let mut ix = Index::default();
        present(&mut ix, 1, 10, 100);
        present(&mut ix, 2, 20, 100);
        let r = ix.stamp(0);
        ix.set(
            3,
            Entry::Writing {
                stem: "3".into(),
                bytes: 5,
                recency: r,
            },
        );
        assert_eq!((ix.bytes(), ix.lru.len()), (35, 3));
        ix.touch(1, 0); // 2 is now the least recent
        assert_eq!(ix.evict_lru().map(|v| v.0), Some(2));
        assert_eq!(ix.evict_lru().map(|v| v.0), Some(1));
        // A value being written is never evicted.
        assert_eq!(ix.evict_lru(), None);
        assert_eq!(ix.bytes(), 5);
        ix.set(
            3,
            Entry::Absent {
                until: Instant::now(),
            },
        );
        assert_eq!((ix.bytes(), ix.lru.len(), ix.len()), (0, 0, 1));
        ix.prune_absent(Instant::now());
        assert_eq!(ix.len(), 0);
    }

    #[test]
    fn listings_forget_what_they_did_not_see() {
        let mut ix = Index::default();
        present(&mut ix, 1, 1, 100);
        present(&mut ix, 2, 1, 300);
        let mut seen = std::collections::HashSet::default();
        assert_eq!(ix.unseen_since(200, &seen), vec![1]);
        seen.insert(1);
        assert!(ix.unseen_since(200, &seen).is_empty());
        assert_eq!(ix.born_before(200).len(), 1);
    }
}
