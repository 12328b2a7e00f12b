//! The remote tier's in-memory index (docs/tier.md "Remote tier", the scheduler's path): what the
//! tier knows of each key, probed on the scheduler's thread once per key of a lookup that starts a
//! fetch (to mark it fetching, with the ticket of its answer: `jobs::Answers`), and again when
//! the key is looked at again (its answer, once it came, then replaces the ticket).
//!
//! A probe's cost is its cache misses: a scheduler calls after a pause, and by then the index's
//! lines are out of the CPU's caches. So an entry is one 16-byte slot — a 64-bit hash of the key
//! and one word holding the state and its deadline — in an open-addressed table with linear
//! probing at most half full: a probe reads one cache line, mostly. (A `HashMap<ByteKey, _>` read
//! a group of control bytes and a 72-byte bucket, three lines.) Fetched values staged for a
//! promotion are kept beside it, by the same hash.
//!
//! Keys are known by their 64-bit hash (xxh3, seeded at random per process): two keys with one hash share an entry. That costs
//! a fetch or a failed promotion, never a wrong block: a staged value is checked against the key
//! it is promoted for (`Shared::run_reads`), and a value read from the server against the key it
//! was read for.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::hash::BuildHasher;
use std::sync::OnceLock;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::key::ByteKey;

/// A deadline: microseconds since the index's epoch (56 bits: 2284 years).
pub(in crate::tier::remote) type Tick = u64;

const TICK_MAX: Tick = (1 << 56) - 1;

/// What the index knows of a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::tier::remote) enum Entry {
    /// A fetch is asking the server; its answer goes to cell `ticket` of `jobs::Answers`.
    Fetching { ticket: u32 },
    /// Being written by this instance.
    Writing,
    /// Found or written (known until `until`); `staged`: a fetched, checked value is kept for
    /// its promotion ([`Index::take_staged`]), and the entry does not go stale while it is.
    Present { until: Tick, staged: bool },
    /// Not found (remembered until `until`).
    Absent { until: Tick },
}

impl Entry {
    fn pack(self) -> u64 {
        match self {
            Entry::Fetching { ticket } => u64::from(ticket) << 8,
            Entry::Writing => 1,
            Entry::Present { until, staged } => 2 | (u64::from(staged) << 2) | (until << 8),
            Entry::Absent { until } => 3 | (until << 8),
        }
    }

    fn unpack(w: u64) -> Self {
        let until = w >> 8;
        match w & 3 {
            #[allow(clippy::cast_possible_truncation)]
            0 => Entry::Fetching {
                ticket: until as u32,
            },
            1 => Entry::Writing,
            2 => Entry::Present {
                until,
                staged: w & 4 != 0,
            },
            _ => Entry::Absent { until },
        }
    }
}

/// One slot: the key's hash (0: empty) and its packed [`Entry`]. Aligned to 16 bytes, so a slot
/// never straddles two cache lines.
#[derive(Clone, Copy, Default)]
#[repr(C, align(16))]
struct Slot {
    hash: u64,
    word: u64,
}

/// The index. See the module docs.
pub(in crate::tier::remote) struct Index {
    slots: Vec<Slot>,
    len: usize,
    staged: HashMap<u64, Arc<Vec<u8>>, foldhash::fast::RandomState>,
    staged_bytes: u64,
    epoch: Instant,
}

impl Index {
    /// An index that holds `n` entries before it grows.
    pub(in crate::tier::remote) fn with_capacity(n: usize, epoch: Instant) -> Self {
        Self {
            slots: vec![Slot::default(); Self::slots_for(n)],
            len: 0,
            staged: HashMap::default(),
            staged_bytes: 0,
            epoch,
        }
    }

    /// Slots for `n` entries: a power of two, at most half full.
    fn slots_for(n: usize) -> usize {
        n.max(8).saturating_mul(2).next_power_of_two()
    }

    /// The hash by which the index knows `key` (never 0, the empty slot's), seeded at random
    /// once per process: keys whose bytes a client chooses cannot be made to share a home slot
    /// (long probe runs on the scheduler's thread) or a hash, as they could with a fixed seed.
    pub(in crate::tier::remote) fn hash(key: &ByteKey) -> u64 {
        static SEED: OnceLock<u64> = OnceLock::new();
        let seed =
            *SEED.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(0u64));
        xxh3_64_with_seed(key.as_bytes(), seed).max(1)
    }

    /// `t` as a deadline of this index.
    pub(in crate::tier::remote) fn tick(&self, t: Instant) -> Tick {
        u64::try_from(t.saturating_duration_since(self.epoch).as_micros())
            .unwrap_or(TICK_MAX)
            .min(TICK_MAX)
    }

    /// `now` + `d` as a deadline.
    pub(in crate::tier::remote) fn after(now: Tick, d: Duration) -> Tick {
        now.saturating_add(u64::try_from(d.as_micros()).unwrap_or(TICK_MAX))
            .min(TICK_MAX)
    }

    pub(in crate::tier::remote) fn len(&self) -> usize {
        self.len
    }

    /// Bytes of the staged values.
    pub(in crate::tier::remote) fn staged_bytes(&self) -> u64 {
        self.staged_bytes
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// The slot of `h`, or of the empty slot where it would go.
    fn find(&self, h: u64) -> (usize, bool) {
        let mask = self.mask();
        // The low bits of xxh3 are as good as its high ones.
        #[allow(clippy::cast_possible_truncation)]
        let mut i = h as usize & mask;
        loop {
            let s = self.slots[i];
            if s.hash == h {
                return (i, true);
            }
            if s.hash == 0 {
                return (i, false);
            }
            i = (i + 1) & mask;
        }
    }

    /// Reads the home slot of each of `hashes` before they are probed one by one. The loads do
    /// not depend on each other, so the CPU overlaps their cache misses (about the latency of
    /// one for a batch); the probes that follow find their lines in the cache. A scheduler's
    /// call probes the slots of a batch of keys after a pause, when most lines are out of the
    /// caches (docs/tier.md "Remote tier", the scheduler's path).
    pub(in crate::tier::remote) fn touch(&self, hashes: &[u64]) {
        let mask = self.mask();
        let mut acc = 0u64;
        for &h in hashes {
            #[allow(clippy::cast_possible_truncation)]
            let s = self.slots[h as usize & mask];
            acc ^= s.hash;
        }
        std::hint::black_box(acc);
    }

    pub(in crate::tier::remote) fn get(&self, h: u64) -> Option<Entry> {
        match self.find(h) {
            (i, true) => Some(Entry::unpack(self.slots[i].word)),
            _ => None,
        }
    }

    /// Sets `h`'s entry (`e` not staged: see [`Index::stage`]) and returns the one it replaces; a
    /// value staged for it is dropped.
    pub(in crate::tier::remote) fn set(&mut self, h: u64, e: Entry) -> Option<Entry> {
        debug_assert!(!matches!(e, Entry::Present { staged: true, .. }));
        let e = match e {
            Entry::Present { until, .. } => Entry::Present {
                until,
                staged: false,
            },
            e => e,
        };
        let (i, found) = self.find(h);
        if found {
            let old = Entry::unpack(self.slots[i].word);
            self.drop_staged(h, old);
            self.slots[i].word = e.pack();
            return Some(old);
        }
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
            return self.set(h, e);
        }
        self.slots[i] = Slot {
            hash: h,
            word: e.pack(),
        };
        self.len += 1;
        None
    }

    /// Keeps `value`, fetched and checked, for `h`'s promotion: `h` becomes present until
    /// `until`.
    pub(in crate::tier::remote) fn stage(&mut self, h: u64, until: Tick, value: Vec<u8>) {
        self.set(
            h,
            Entry::Present {
                until,
                staged: false,
            },
        );
        let (i, _) = self.find(h);
        self.slots[i].word = Entry::Present {
            until,
            staged: true,
        }
        .pack();
        self.staged_bytes += value.len() as u64;
        self.staged.insert(h, Arc::new(value));
    }

    /// Takes the value staged for `h`, if any (the entry stays present, not staged).
    pub(in crate::tier::remote) fn take_staged(&mut self, h: u64) -> Option<Arc<Vec<u8>>> {
        let (i, found) = self.find(h);
        if !found {
            return None;
        }
        let Entry::Present {
            until,
            staged: true,
        } = Entry::unpack(self.slots[i].word)
        else {
            return None;
        };
        self.slots[i].word = Entry::Present {
            until,
            staged: false,
        }
        .pack();
        let v = self.staged.remove(&h);
        if let Some(v) = &v {
            self.staged_bytes -= v.len() as u64;
        }
        v
    }

    fn drop_staged(&mut self, h: u64, old: Entry) {
        if matches!(old, Entry::Present { staged: true, .. }) {
            if let Some(v) = self.staged.remove(&h) {
                self.staged_bytes -= v.len() as u64;
            }
        }
    }

    /// Removes `h`'s entry (and its staged value) and returns it.
    pub(in crate::tier::remote) fn remove(&mut self, h: u64) -> Option<Entry> {
        let (mut i, found) = self.find(h);
        if !found {
            return None;
        }
        let old = Entry::unpack(self.slots[i].word);
        self.drop_staged(h, old);
        // Backward-shift deletion: each entry after the hole that may move into it does, so
        // every entry stays reachable from its home slot without tombstones.
        let mask = self.mask();
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s.hash == 0 {
                break;
            }
            #[allow(clippy::cast_possible_truncation)]
            let home = s.hash as usize & mask;
            // `s` may move to `i` unless its home lies cyclically in (i, j].
            let stays = if i <= j {
                i < home && home <= j
            } else {
                i < home || home <= j
            };
            if !stays {
                self.slots[i] = s;
                i = j;
            }
        }
        self.slots[i] = Slot::default();
        self.len -= 1;
        Some(old)
    }

    /// Every entry.
    pub(in crate::tier::remote) fn entries(&self) -> impl Iterator<Item = Entry> + '_ {
        self.iter().map(|(_, e)| e)
    }

    /// Every entry with its hash.
    pub(in crate::tier::remote) fn iter(&self) -> impl Iterator<Item = (u64, Entry)> + '_ {
        self.slots
            .iter()
            .filter(|s| s.hash != 0)
            .map(|s| (s.hash, Entry::unpack(s.word)))
    }

    /// Replaces each fetching entry by `f(hash, ticket)` (in place: no entry moves).
    pub(in crate::tier::remote) fn map_fetching(&mut self, f: impl Fn(u64, u32) -> Entry) {
        for s in &mut self.slots {
            if s.hash != 0 {
                if let Entry::Fetching { ticket } = Entry::unpack(s.word) {
                    let e = f(s.hash, ticket);
                    debug_assert!(!matches!(e, Entry::Present { staged: true, .. }));
                    s.word = e.pack();
                }
            }
        }
    }

    /// Keeps the entries for which `keep` returns an entry — that one: a staged entry kept as
    /// it was keeps its value, a fetching one may become its answer — in a fresh table that holds
    /// `room(survivors)` entries (at least the survivors) before it grows, and returns that room;
    /// the others go with their staged values.
    pub(in crate::tier::remote) fn rebuild(
        &mut self,
        keep: impl Fn(u64, Entry) -> Option<Entry>,
        room: impl FnOnce(usize) -> usize,
    ) -> usize {
        let survivors = self.iter().filter(|&(h, e)| keep(h, e).is_some()).count();
        let room = room(survivors).max(survivors);
        let slots = vec![Slot::default(); Self::slots_for(room)];
        let old = std::mem::replace(&mut self.slots, slots);
        self.len = 0;
        for s in old {
            if s.hash == 0 {
                continue;
            }
            let e = Entry::unpack(s.word);
            match keep(s.hash, e) {
                Some(k) => {
                    if k != e {
                        self.drop_staged(s.hash, e);
                    }
                    let (i, _) = self.find(s.hash);
                    self.slots[i] = Slot {
                        hash: s.hash,
                        word: k.pack(),
                    };
                    self.len += 1;
                }
                None => self.drop_staged(s.hash, e),
            }
        }
        room
    }

    fn grow(&mut self) {
        let old = std::mem::take(&mut self.slots);
        self.slots = vec![Slot::default(); old.len() * 2];
        for s in old {
            if s.hash != 0 {
                let (i, _) = self.find(s.hash);
                self.slots[i] = s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Set(u8, Entry),
        Stage(u8, u8),
        Take(u8),
        Remove(u8),
        Rebuild(bool),
        MapFetching,
    }

    fn entry() -> impl Strategy<Value = Entry> {
        prop_oneof![
            (0u32..4).prop_map(|ticket| Entry::Fetching { ticket }),
            Just(Entry::Writing),
            (0u64..1000).prop_map(|until| Entry::Present {
                until,
                staged: false
            }),
            (0u64..1000).prop_map(|until| Entry::Absent { until }),
        ]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (any::<u8>(), entry()).prop_map(|(k, e)| Op::Set(k, e)),
            2 => (any::<u8>(), 1u8..8).prop_map(|(k, n)| Op::Stage(k, n)),
            1 => any::<u8>().prop_map(Op::Take),
            3 => any::<u8>().prop_map(Op::Remove),
            1 => any::<bool>().prop_map(Op::Rebuild),
            1 => Just(Op::MapFetching),
        ]
    }

    /// Hashes that collide in the low bits (the home slot), so that probing, wrap-around and the
    /// backward shift are exercised in a small table.
    fn h(k: u8) -> u64 {
        (u64::from(k) << 40) | u64::from(k % 5) | 1
    }

    proptest! {
        /// The index against a `HashMap` model: every entry, staged value and byte count.
        #[test]
        fn index_matches_a_map(ops in proptest::collection::vec(op(), 1..400)) {
            let mut ix = Index::with_capacity(4, Instant::now());
            let mut model: HashMap<u64, (Entry, Option<Vec<u8>>)> = HashMap::new();
            for op in ops {
                match op {
                    Op::Set(k, e) => {
                        let old = ix.set(h(k), e);
                        let m = model.insert(h(k), (e, None)).map(|(e, _)| e);
                        prop_assert_eq!(old, m);
                    }
                    Op::Stage(k, n) => {
                        let v = vec![k; usize::from(n)];
                        ix.stage(h(k), 7, v.clone());
                        model.insert(h(k), (Entry::Present { until: 7, staged: true }, Some(v)));
                    }
                    Op::Take(k) => {
                        let got = ix.take_staged(h(k)).map(|v| v.to_vec());
                        let want = match model.get_mut(&h(k)) {
                            Some((Entry::Present { until, staged: true }, v)) => {
                                let u = *until;
                                let v = v.take();
                                model.insert(h(k), (Entry::Present { until: u, staged: false }, None));
                                v
                            }
                            _ => None,
                        };
                        prop_assert_eq!(got, want);
                    }
                    Op::MapFetching => {
                        // Ticket 2's answer came: present until its ticket's number.
                        let f = |_: u64, t: u32| if t == 2 {
                            Entry::Present { until: 2, staged: false }
                        } else {
                            Entry::Fetching { ticket: t }
                        };
                        ix.map_fetching(f);
                        for (k, (e, _)) in &mut model {
                            if let Entry::Fetching { ticket } = *e {
                                *e = f(*k, ticket);
                            }
                        }
                    }
                    Op::Remove(k) => {
                        prop_assert_eq!(ix.remove(h(k)), model.remove(&h(k)).map(|(e, _)| e));
                    }
                    Op::Rebuild(fetching_only) => {
                        // Fetching entries of ticket 3 become absent (an answer applied).
                        let keep = |_: u64, e: Entry| match e {
                            Entry::Fetching { ticket: 3 } => Some(Entry::Absent { until: 5 }),
                            Entry::Fetching { .. } => Some(e),
                            _ => (!fetching_only).then_some(e),
                        };
                        prop_assert!(ix.rebuild(keep, |_| 8) >= 8);
                        model.retain(|k, (e, _)| keep(*k, *e).is_some());
                        for (e, v) in model.values_mut() {
                            if let Some(k) = keep(0, *e) {
                                if k != *e {
                                    *e = k;
                                    *v = None;
                                }
                            }
                        }
                    }
                }
                prop_assert_eq!(ix.len(), model.len());
                for (k, (e, _)) in &model {
                    prop_assert_eq!(ix.get(*k), Some(*e));
                }
                let bytes: u64 = model.values().filter_map(|(_, v)| v.as_ref()).map(|v| v.len() as u64).sum();
                prop_assert_eq!(ix.staged_bytes(), bytes);
                prop_assert_eq!(ix.entries().count(), model.len());
                prop_assert!(ix.len() * 2 <= ix.slots.len());
            }
            for k in 0..=255u8 {
                if !model.contains_key(&h(k)) {
                    prop_assert_eq!(ix.get(h(k)), None);
                }
            }
        }
    }

    #[test]
    fn deadlines_pack_with_the_state() {
        for e in [
            Entry::Fetching { ticket: 0 },
            Entry::Fetching { ticket: u32::MAX },
            Entry::Writing,
            Entry::Present {
                until: TICK_MAX,
                staged: true,
            },
            Entry::Present {
                until: 0,
                staged: false,
            },
            Entry::Absent { until: TICK_MAX },
        ] {
            assert_eq!(Entry::unpack(e.pack()), e);
        }
        assert_eq!(Index::after(TICK_MAX - 1, Duration::from_secs(9)), TICK_MAX);
        assert_eq!(Index::after(5, Duration::from_micros(7)), 12);
        assert_eq!(std::mem::size_of::<Slot>(), 16);
    }
}
