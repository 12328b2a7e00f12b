//! The remote tier's [`SecondaryTier`] implementation (docs/tier.md "Secondary tiers"): the
//! scheduler's calls — lookups, fetch, write and promotion submissions, polls — on the index
//! (`Sched`), queuing jobs for the I/O threads and never waiting on them.
#![forbid(unsafe_code)]

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use super::index::{Entry, Index};
use super::shared::{lock, Job, ReadItem};
use super::{RemoteTier, GAUGES_TTL, INFO, LATE_JOB};

use crate::key::ByteKey;
use crate::manager::BlockId;
use crate::tier::secondary::{Known, SecondaryCounters, SecondaryTier};
use crate::tier::Completion;

/// The longest a flush waits for an I/O thread's result before it looks at the outstanding
/// work again (a fetch may end without one).
const FLUSH_LOOK: Duration = Duration::from_millis(1);

impl SecondaryTier for RemoteTier {
    fn kind(&self) -> &'static str {
        INFO.kind
    }

    fn index(&self, key: &ByteKey) -> Known {
        let mut st = self.sched();
        let e = st.resolve(&self.shared, Index::hash(key));
        let now = || st.index.tick(Instant::now());
        match e {
            None => Known::Unknown,
            // A fetch in flight answers later; a key being written is not readable yet.
            Some(Entry::Writing | Entry::Fetching { .. }) => Known::Pending,
            Some(Entry::Present { until, staged }) => {
                if staged || until > now() {
                    Known::Present
                } else {
                    Known::Unknown
                }
            }
            Some(Entry::Absent { until }) => {
                if until > now() {
                    Known::Absent
                } else {
                    Known::Unknown
                }
            }
        }
    }

    fn submit_fetch(&self, keys: &[ByteKey]) -> usize {
        if self.forked() || keys.is_empty() {
            return 0;
        }
        let sh = &self.shared;
        let now = Instant::now();
        if sh.shutdown.load(Acquire) {
            return 0;
        }
        let mut guard = self.sched();
        let st = &mut *guard;
        Self::expire(sh, st, now);
        // While every node is down, remember the keys as misses: no job, no network. (A node
        // down among live ones fails its own keys in the I/O thread, also without a network call.)
        let down_until = sh.router.all_down(now);
        let down = down_until.is_some();
        let down_until = st.index.tick(down_until.unwrap_or(now));
        let now = st.index.tick(now);
        // Staging room: a key needs room for its value among the staged and reserved bytes (so a
        // fetch never brings a value it cannot keep, and a readahead of many keys stops where
        // host memory would stop it), except a call's first key (below).
        let value = sh.fetch_unit();
        let most = sh.cfg.max_fetch_keys.max(1);
        let mut batch = Vec::with_capacity(keys.len().min(most));
        let mut tickets = Vec::with_capacity(keys.len().min(most));
        let hashes: Vec<u64> = keys.iter().take(most).map(Index::hash).collect();
        st.index.touch(&hashes);
        for (k, &h) in keys.iter().zip(&hashes) {
            // One probe of the index per key (a lookup's cost is mostly these probes; `touch`
            // brought their lines in, and the `set` below finds the same slot).
            let unknown = match st.resolve(sh, h) {
                None => true,
                Some(Entry::Absent { until }) => until <= now,
                Some(Entry::Present { until, staged }) => !staged && until <= now,
                Some(Entry::Fetching { .. } | Entry::Writing) => false,
            };
            if !unknown {
                continue;
            }
            if down {
                sh.counters.fetch_errors.fetch_add(1, Relaxed);
                st.index.set(h, Entry::Absent { until: down_until });
                continue;
            }
            // The first key goes while the fetches in flight alone leave room for it (staged
            // values waiting for promotions that may never come must not stop a new request);
            // when fetches in flight fill the room, not even the first key goes: the caller's
            // lookup stays pending until one ends, and a flood of lookups queues no more.
            let reserved = sh.fetch_reserved.load(Relaxed);
            let first = batch.is_empty() && reserved + value <= sh.cfg.max_staged_bytes;
            if !first && st.index.staged_bytes() + reserved + value > sh.cfg.max_staged_bytes {
                break;
            }
            let Some(ticket) = st.take_ticket(sh, h) else {
                break;
            };
            sh.fetch_reserved.fetch_add(value, Relaxed);
            st.index.set(h, Entry::Fetching { ticket });
            batch.push(k.clone());
            tickets.push(ticket);
        }
        let n = batch.len();
        if n > 0 {
            // Jobs of at most FETCH_JOB_BYTES each: the I/O threads fetch them side by side and
            // the first values are ready for promotion while the rest are on the wire.
            let per_job = sh.fetch_job_keys();
            let jobs = n.div_ceil(per_job);
            sh.fetches_out.fetch_add(n as u64, Relaxed);
            sh.queued_jobs.fetch_add(jobs, Release);
            st.unrung_since.get_or_insert_with(Instant::now);
            drop(guard);
            let mut rest = batch.into_iter();
            let mut rest_tickets = tickets.into_iter();
            for _ in 0..jobs {
                let _ = sh.queues.fetches.0.send(Job::Fetch(
                    rest.by_ref().take(per_job).collect(),
                    rest_tickets.by_ref().take(per_job).collect(),
                ));
            }
            sh.ring_from_caller();
        }
        n
    }

    fn may_read_unknown(&self, key: &ByteKey) -> bool {
        if self.forked() {
            return false;
        }
        let mut st = self.sched();
        let e = st.resolve(&self.shared, Index::hash(key));
        let now = st.index.tick(Instant::now());
        match e {
            None => true,
            Some(Entry::Absent { until }) => until <= now,
            Some(Entry::Present { until, staged }) => !staged && until <= now,
            Some(Entry::Fetching { .. } | Entry::Writing) => false,
        }
    }

    fn fetch_room(&self) -> usize {
        let sh = &self.shared;
        let st = self.sched();
        let used = st.index.staged_bytes() + sh.fetch_reserved.load(Relaxed);
        usize::try_from(sh.cfg.max_staged_bytes.saturating_sub(used) / sh.fetch_unit())
            .unwrap_or(usize::MAX)
    }

    fn has_or_writing(&self, key: &ByteKey) -> bool {
        self.index(key) == Known::Present
            || self.sched().index.get(Index::hash(key)) == Some(Entry::Writing)
    }

    fn submit_writes(&self, items: &[(ByteKey, BlockId)]) -> Vec<bool> {
        let sh = &self.shared;
        if self.forked() {
            return vec![false; items.len()];
        }
        let now = Instant::now();
        let mut st = self.sched();
        Self::expire(sh, &mut st, now);
        let down = sh.router.all_down(now).is_some();
        let stopped = sh.shutdown.load(Acquire);
        let mut queued = Vec::new();
        let out = items
            .iter()
            .map(|(k, b)| {
                if stopped {
                    return false;
                }
                let h = Index::hash(k);
                if st.index.get(h) == Some(Entry::Writing) {
                    return false;
                }
                if down {
                    // Counted as an error: the server is unreachable (its backoff runs).
                    sh.counters.write_errors.fetch_add(1, Relaxed);
                    return false;
                }
                if st.queued_writes >= sh.cfg.max_queued_writes
                    || st.inflight_bytes + sh.value_len as u64 > sh.cfg.max_inflight_bytes
                {
                    sh.counters.writes_dropped.fetch_add(1, Relaxed);
                    return false;
                }
                st.queued_writes += 1;
                st.inflight_bytes += sh.value_len as u64;
                st.index.set(h, Entry::Writing); // (a staged value goes)
                queued.push((k.clone(), *b));
                true
            })
            .collect();
        drop(st);
        let ring = !queued.is_empty();
        for w in queued {
            let _ = sh.queues.writes.0.send(w);
        }
        if ring {
            sh.ring_from_caller();
        }
        out
    }

    fn submit_reads(&self, items: &[(ByteKey, BlockId)]) -> Vec<bool> {
        let sh = &self.shared;
        if self.forked() {
            return vec![false; items.len()];
        }
        let stopped = sh.shutdown.load(Acquire);
        let mut st = self.sched();
        let now = st.index.tick(Instant::now());
        let per_job = sh.read_job_items();
        let mut jobs = Vec::new();
        let mut batch = Vec::new();
        // Promotions go before queued fetches (their own queue, taken first): the scheduler waits
        // for them, and their copies overlap the fetches still on the wire (docs/tier.md, remote
        // tier). A staged value goes with its job.
        let out = items
            .iter()
            .map(|(k, b)| {
                if stopped {
                    return false;
                }
                let h = Index::hash(k);
                let (staged, unknown) = match st.resolve(sh, h) {
                    Some(Entry::Present { staged: true, .. }) => (st.index.take_staged(h), false),
                    Some(Entry::Present { until, .. }) => (None, until <= now),
                    // A key the index does not know (see `may_read_unknown`): the read finds out.
                    None => (None, true),
                    Some(Entry::Absent { until }) if until <= now => (None, true),
                    Some(Entry::Absent { .. } | Entry::Fetching { .. } | Entry::Writing) => {
                        return false
                    }
                };
                batch.push(ReadItem {
                    key: k.clone(),
                    block: *b,
                    staged,
                    unknown,
                });
                if batch.len() == per_job {
                    jobs.push(Job::Read(std::mem::take(&mut batch)));
                }
                true
            })
            .collect();
        if !batch.is_empty() {
            jobs.push(Job::Read(batch));
        }
        st.reads_out += jobs
            .iter()
            .map(|j| match j {
                Job::Read(i) => i.len() as u64,
                _ => 0,
            })
            .sum::<u64>();
        if !jobs.is_empty() {
            sh.queued_jobs.fetch_add(jobs.len(), Release);
            st.unrung_since.get_or_insert_with(Instant::now);
        }
        drop(st);
        let ring = !jobs.is_empty();
        for j in jobs {
            let _ = sh.queues.reads.0.send(j);
        }
        if ring {
            sh.ring_from_caller();
        }
        out
    }

    fn poll(&self) -> Vec<Completion> {
        let sh = &self.shared;
        let mut st = self.sched();
        // Promotions or fetches queued with no wake-up and still waiting a while later (the
        // thread that was looking at the queues lost its CPU): one wake-up for another thread.
        if self.forked() || sh.queued_jobs.load(Acquire) == 0 {
            st.unrung_since = None;
        } else if let Some(t) = st.unrung_since {
            if t.elapsed() >= LATE_JOB {
                sh.ring();
                st.unrung_since = Some(Instant::now());
            }
        }
        std::mem::take(&mut st.completions)
    }

    fn busy(&self) -> bool {
        let st = self.sched();
        st.outstanding(&self.shared) || !st.completions.is_empty()
    }

    fn flush(&self) {
        if self.threads.is_empty() || self.forked() {
            return;
        }
        loop {
            let mut st = self.sched();
            if !st.outstanding(&self.shared) || self.shared.shutdown.load(Acquire) {
                return;
            }
            // Woken by the I/O threads' next result (every write and promotion hands one back):
            // a flush's caller (a benchmark's store, a shutdown) learns of the last
            // acknowledgement at once, and a long flush costs one wake-up per result, not one per
            // nap (naps of 0.1 ms took CPU from the server and the I/O threads on a 2-CPU
            // machine: docs/performance.md "Tier tuning table"). Fetches that end without a
            // result to hand back are seen at the next look, at most `FLUSH_LOOK` later. Only the
            // scheduler's calls take this lock, never an I/O thread.
            match st.done.recv_timeout(FLUSH_LOOK) {
                Ok(d) => st.apply_one(&self.shared, d),
                Err(RecvTimeoutError::Timeout) => {}
                // (The tier's `Shared` holds a sender: not while the tier lives.)
                Err(RecvTimeoutError::Disconnected) => {
                    drop(st);
                    std::thread::sleep(FLUSH_LOOK);
                }
            }
        }
    }

    fn forked(&self) -> bool {
        RemoteTier::forked(self)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn shutdown(&mut self) {
        if self.forked() {
            for t in self.threads.drain(..) {
                std::mem::forget(t);
            }
            // The parent's queues and channels are not this process's to touch (nor to drop).
            std::mem::forget(self.stop.take());
            let (_, idle) = std::sync::mpsc::channel();
            let st = self.sched.get_mut().unwrap_or_else(PoisonError::into_inner);
            std::mem::forget(std::mem::replace(&mut st.done, idle));
            self.shared.shutdown.store(true, Release);
            return;
        }
        self.flush();
        self.shared.shutdown.store(true, Release);
        drop(self.stop.take());
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                self.shared.set_error("a remote I/O thread panicked".into());
            }
        }
    }

    fn counters(&self) -> SecondaryCounters {
        let c = &self.shared.counters;
        let st = self.sched();
        #[allow(clippy::cast_precision_loss)]
        let secs = |ns: &AtomicU64| ns.load(Relaxed) as f64 * 1e-9;
        SecondaryCounters {
            writes: c.writes.load(Relaxed),
            bytes_written: c.bytes_written.load(Relaxed),
            write_seconds: secs(&c.write_ns),
            write_errors: c.write_errors.load(Relaxed),
            writes_dropped: c.writes_dropped.load(Relaxed),
            promotions: c.promotions.load(Relaxed),
            bytes_read: c.bytes_read.load(Relaxed),
            read_seconds: secs(&c.read_ns),
            read_errors: c.read_errors.load(Relaxed),
            rejected: c.rejected.load(Relaxed),
            fetch_hits: c.fetch_hits.load(Relaxed),
            fetch_misses: c.fetch_misses.load(Relaxed),
            fetch_errors: c.fetch_errors.load(Relaxed),
            reconnects: self.shared.router.reconnects.load(Relaxed),
            queued_reads: st.reads_out + self.shared.fetches_out.load(Relaxed),
            queued_writes: st.queued_writes as u64,
            last_error: lock(&self.shared.last_error).clone(),
        }
    }

    fn extra_stats(&self) -> Vec<(&'static str, u64)> {
        let (present, absent, staged) = self.index_gauges();
        let down = self.shared.router.all_down(Instant::now()).is_some();
        let st = self.sched();
        // In the order of `INFO.extra_stats` (its length checked at compile time).
        let values: [u64; INFO.extra_stats.len()] = [
            present,
            absent,
            staged,
            st.inflight_bytes,
            u64::from(!down),
            self.shared.counters.summed_ahead.load(Relaxed),
        ];
        INFO.extra_stats.iter().copied().zip(values).collect()
    }
}

impl RemoteTier {
    /// Gauges of the index (for metrics): keys known present, remembered misses, staged bytes;
    /// counted at most once per [`GAUGES_TTL`].
    fn index_gauges(&self) -> (u64, u64, u64) {
        let mut cache = self.gauges.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if let Some((at, g)) = *cache {
            if now.duration_since(at) < GAUGES_TTL {
                return (g.0, g.1, self.sched().index.staged_bytes());
            }
        }
        let g = self.count_index(now);
        *cache = Some((now, (g.0, g.1)));
        g
    }

    fn count_index(&self, now: Instant) -> (u64, u64, u64) {
        let st = self.sched();
        let mut present = 0;
        let mut absent = 0;
        let now = st.index.tick(now);
        for e in st.index.entries() {
            match e {
                Entry::Present { until, staged } if staged || until > now => present += 1,
                Entry::Absent { until } if until > now => absent += 1,
                _ => {}
            }
        }
        (present, absent, st.index.staged_bytes())
    }
}
