//! The object tier behind the one tier interface ([`SecondaryTier`], docs/tier.md "Secondary
//! tiers"): the scheduler's side. Every method answers from the index and hands jobs to the
//! runtime (`Runtime::spawn` queues a task, it never waits); the mutex is never held by a job
//! across a request.
#![forbid(unsafe_code)]

use std::any::Any;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use super::{io, lock, now_ns, Entry, ObjectTier, Queue, Shared, INDEX_CAP};
use crate::key::ByteKey;
use crate::manager::BlockId;
use crate::tier::secondary::{Known, SecondaryCounters, SecondaryTier};
use crate::tier::Completion;

impl ObjectTier {
    /// Whether `entry` (of a present value) is past the TTL at `now` (Unix ns).
    fn expired(&self, born_ns: u64, now: u64) -> bool {
        self.shared.cfg.ttl.is_some_and(|t| {
            now.saturating_sub(born_ns) > u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)
        })
    }

    /// Spawns `fut` on the runtime (queued; never waits).
    fn spawn<F: std::future::Future<Output = ()> + Send + 'static>(&self, fut: F) {
        if let Some(rt) = &self.rt {
            rt.spawn(fut);
        }
    }

    /// Spawns `futs` as tasks of their own with one wake-up of the runtime from this thread: a
    /// task spawns the rest from a worker (queued there, stolen by idle workers), so the
    /// scheduler's thread makes one cross-thread hand-off per call, not one per key.
    fn spawn_all<F: std::future::Future<Output = ()> + Send + 'static>(&self, mut futs: Vec<F>) {
        match futs.len() {
            0 => {}
            1 => self.spawn(futs.remove(0)),
            _ => self.spawn(async move {
                for f in futs {
                    tokio::spawn(f);
                }
            }),
        }
    }
}

impl SecondaryTier for ObjectTier {
    fn kind(&self) -> &'static str {
        super::INFO.kind
    }

    fn index(&self, key: &ByteKey) -> Known {
        let (id, _) = Shared::ident(key);
        let st = lock(&self.shared.state);
        match st.index.get(id) {
            None => Known::Unknown,
            Some(Entry::Present { born_ns, .. }) => {
                if self.expired(*born_ns, now_ns()) {
                    Known::Absent
                } else {
                    Known::Present
                }
            }
            Some(Entry::Writing { .. } | Entry::Fetching) => Known::Pending,
            Some(Entry::Absent { until }) => {
                if *until > Instant::now() {
                    Known::Absent
                } else {
                    Known::Unknown
                }
            }
        }
    }

    fn submit_fetch(&self, keys: &[ByteKey]) -> usize {
        if self.forked() || keys.is_empty() || self.rt.is_none() {
            return 0;
        }
        let sh = &self.shared;
        let now = Instant::now();
        let mut jobs = Vec::new();
        {
            let mut st = lock(&sh.state);
            if st.shutdown {
                return 0;
            }
            if st.index.len() >= INDEX_CAP {
                st.index.prune_absent(now);
            }
            let down = Shared::down(&st, now);
            for k in keys {
                let (id, _) = Shared::ident(k);
                let unknown = match st.index.get(id) {
                    None => true,
                    Some(Entry::Absent { until }) => *until <= now,
                    Some(_) => false,
                };
                if !unknown || st.index.len() >= INDEX_CAP {
                    continue;
                }
                if down {
                    // No request while the store is down: a miss until it may be up again.
                    sh.counters.fetch_errors.fetch_add(1, Relaxed);
                    let until = st.down_until.unwrap_or(now);
                    st.index.set(id, Entry::Absent { until });
                    continue;
                }
                st.index.set(id, Entry::Fetching);
                let guard = sh.started(&mut st, None, Queue::None);
                jobs.push((k.clone(), guard));
            }
        }
        let n = jobs.len();
        self.spawn_all(
            jobs.into_iter()
                .map(|(k, g)| io::fetch(Arc::clone(sh), g, k))
                .collect(),
        );
        n
    }

    fn read_ready(&self) -> bool {
        if self.forked() || self.rt.is_none() {
            return false;
        }
        let st = lock(&self.shared.state);
        !st.shutdown && !Shared::down(&st, Instant::now())
    }

    fn fetch_batch_max(&self) -> usize {
        // One HEAD per key: a prefix's first key decides (docs/tier.md "Object tier", lookups).
        1
    }

    fn may_read_unknown(&self, _key: &ByteKey) -> bool {
        // A GET of a key nobody wrote is a 404: a failed promotion, remembered as a miss.
        !self.forked()
    }

    fn has_or_writing(&self, key: &ByteKey) -> bool {
        let (id, _) = Shared::ident(key);
        let st = lock(&self.shared.state);
        match st.index.get(id) {
            Some(Entry::Present { born_ns, .. }) => !self.expired(*born_ns, now_ns()),
            Some(Entry::Writing { .. }) => true,
            _ => false,
        }
    }

    fn submit_writes(&self, items: &[(ByteKey, BlockId)]) -> Vec<bool> {
        let mut out = vec![false; items.len()];
        if self.forked() || self.rt.is_none() {
            return out;
        }
        let sh = &self.shared;
        let now = Instant::now();
        let now_ns = now_ns();
        let value = sh.value_len;
        let mut jobs = Vec::new();
        let mut orphans: Vec<Box<str>> = Vec::new();
        {
            let mut st = lock(&sh.state);
            if st.shutdown {
                return out;
            }
            let down = Shared::down(&st, now);
            for (i, (k, block)) in items.iter().enumerate() {
                let (id, stem) = Shared::ident(k);
                match st.index.get(id) {
                    Some(Entry::Writing { .. }) => continue,
                    Some(Entry::Present { born_ns, .. }) if !self.expired(*born_ns, now_ns) => {
                        continue
                    }
                    _ => {}
                }
                if down {
                    sh.counters.write_errors.fetch_add(1, Relaxed);
                    continue;
                }
                if st.queued_writes >= sh.cfg.max_queued_writes as u64
                    || st.inflight_bytes + value > sh.cfg.max_inflight_bytes
                    || value > sh.cfg.bytes_to_use
                {
                    sh.counters.writes_dropped.fetch_add(1, Relaxed);
                    continue;
                }
                // Make room: least-recently-used values go; this write deletes them before its
                // PUT (docs/tier.md "Object tier", budget).
                let mut victims = Vec::new();
                while st.index.bytes() + value > sh.cfg.bytes_to_use {
                    match st.index.evict_lru() {
                        Some((vid, vstem, _)) => {
                            sh.counters.evictions.fetch_add(1, Relaxed);
                            victims.push(sh.object_name(vid, &vstem).into_boxed_str());
                        }
                        None => break,
                    }
                }
                if st.index.bytes() + value > sh.cfg.bytes_to_use {
                    // Only values being written are left: no room now.
                    sh.counters.writes_dropped.fetch_add(1, Relaxed);
                    orphans.extend(victims);
                    continue;
                }
                let recency = st.index.stamp(now_ns);
                let stem: Box<str> = stem.into();
                st.index.set(
                    id,
                    Entry::Writing {
                        stem: stem.clone(),
                        bytes: value,
                        recency,
                    },
                );
                st.inflight_bytes += value;
                let done = Completion::Released {
                    key: k.clone(),
                    block: *block,
                };
                let guard = sh.started(&mut st, Some(done), Queue::Writes);
                jobs.push((guard, k.clone(), *block, id, stem, victims));
                out[i] = true;
            }
            if !orphans.is_empty() {
                // Victims of writes that found no room after all: deleted by a job of their own.
                let guard = sh.started(&mut st, None, Queue::None);
                self.spawn(io::delete_all(Arc::clone(sh), guard, orphans));
            }
        }
        self.spawn_all(
            jobs.into_iter()
                .map(|(guard, k, block, id, stem, victims)| {
                    io::write(Arc::clone(sh), guard, k, block, id, stem, victims)
                })
                .collect(),
        );
        out
    }

    fn submit_reads(&self, items: &[(ByteKey, BlockId)]) -> Vec<bool> {
        let mut out = vec![false; items.len()];
        if self.forked() || self.rt.is_none() {
            return out;
        }
        let sh = &self.shared;
        let now = Instant::now();
        let mut jobs = Vec::new();
        {
            let mut st = lock(&sh.state);
            if st.shutdown || Shared::down(&st, now) {
                return out;
            }
            let t = now_ns();
            for (i, (k, block)) in items.iter().enumerate() {
                let (id, _) = Shared::ident(k);
                let ok = match st.index.get(id) {
                    Some(Entry::Present { born_ns, .. }) => !self.expired(*born_ns, t),
                    // Readahead (`may_read_unknown`): the read finds out.
                    None => true,
                    Some(Entry::Absent { until }) => *until <= now,
                    Some(Entry::Writing { .. } | Entry::Fetching) => false,
                };
                if !ok {
                    continue;
                }
                st.index.touch(id, t);
                let done = Completion::Promoted {
                    key: k.clone(),
                    block: *block,
                    ok: false,
                };
                let guard = sh.started(&mut st, Some(done), Queue::Reads);
                jobs.push((guard, k.clone(), *block));
                out[i] = true;
            }
        }
        self.spawn_all(
            jobs.into_iter()
                .map(|(guard, k, block)| io::read(Arc::clone(sh), guard, k, block))
                .collect(),
        );
        out
    }

    fn poll(&self) -> Vec<Completion> {
        std::mem::take(&mut lock(&self.shared.state).completions)
    }

    fn busy(&self) -> bool {
        let st = lock(&self.shared.state);
        st.running > 0 || !st.completions.is_empty()
    }

    fn flush(&self) {
        ObjectTier::flush(self);
    }

    fn shutdown(&mut self) {
        ObjectTier::shutdown(self);
    }

    fn counters(&self) -> SecondaryCounters {
        ObjectTier::counters(self)
    }

    fn forked(&self) -> bool {
        ObjectTier::forked(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn extra_stats(&self) -> Vec<(&'static str, u64)> {
        let s = self.stats();
        vec![
            ("evictions", s.evictions),
            ("expired", s.expired),
            ("index_entries", s.index_entries),
            ("known_bytes", s.known_bytes),
            ("listings", s.listings),
            ("up", u64::from(s.up)),
        ]
    }
}
