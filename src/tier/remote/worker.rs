//! The remote tier's I/O threads (docs/tier.md "Remote tier", "Threads and bounds"): each takes
//! jobs from the queues in priority order (`Shared::next_job`, merging small ones), runs them
//! (the `run` module), hands the results back, and waits (spinning, napping, then on the bell)
//! when there is nothing to do.
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Select;

use super::index::Index;
use super::route::Conns;
use super::shared::{Answer, Checked, Done, Job, Shared, Wrote};
use super::{MIN_WRITE_BATCH, MSET_BATCH_BYTES, WRITE_BATCH_BYTES};

use crate::key::ByteKey;
use crate::tier::format;

/// What a job's run found (see `Shared::worker`).
enum Ran {
    Fetch(Vec<Checked>),
    Read(Vec<bool>),
    Write(Vec<Wrote>),
}

impl Shared {
    pub(super) fn worker(self: &Arc<Self>) {
        let mut conns = self.conns();
        // A job taken from a queue that did not fit in the last merged one (see `merge`).
        let mut stash = None;
        loop {
            // A failed node whose backoff is over is probed between jobs (one thread at a time);
            // jobs meanwhile fail its commands at once.
            if let Some(e) = self.router.probe(&mut conns) {
                self.set_error(e);
            }
            let Some(job) = self.next_job(&mut stash) else {
                if self.sum_ahead() {
                    continue;
                }
                if self.shutdown.load(Acquire) {
                    return;
                }
                let idle = Duration::from_millis(500);
                let wait = self
                    .router
                    .next_probe(Instant::now())
                    .map_or(idle, |d| d.min(idle));
                if !wait.is_zero() && !self.idle_spin(wait) {
                    self.wait_job(wait);
                }
                continue;
            };
            if self.jobs_waiting() {
                self.ring(); // the next idle thread takes the next job
            }
            // A panic inside a job (a bug in a dependency or a `BlockMemory`) must not leave the
            // job's accounting open, or `flush` and `shutdown` would wait for ever: the job fails
            // (its keys absent, its blocks released, counted as errors), the thread's connections
            // are dropped and the thread goes on (docs/tier.md, remote tier, Faults).
            let mut job = job;
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &mut job {
                Job::Fetch(keys, _) => Ran::Fetch(self.run_fetch(&mut conns, keys)),
                Job::Read(items) => Ran::Read(self.run_reads(&mut conns, items)),
                Job::Write(items, sums) => Ran::Write(self.run_writes(&mut conns, items, sums)),
            }));
            if matches!(job, Job::Write(..)) && self.header_fetch() {
                self.writes_running.fetch_sub(1, AcqRel);
            }
            let done = match (r, job) {
                (Ok(Ran::Fetch(results)), Job::Fetch(keys, tickets)) => {
                    self.answer_fetch(&keys, &tickets, results);
                    continue;
                }
                (Ok(Ran::Read(ok)), Job::Read(items)) => Done::Read { items, ok },
                (Ok(Ran::Write(wrote)), Job::Write(items, _)) => Done::Write { items, wrote },
                (r, job) => {
                    conns = self.conns();
                    let why = r.err().map_or_else(
                        || "job and result differ".into(),
                        |p| panic_text(p.as_ref()),
                    );
                    self.set_error(format!(
                        "a remote I/O thread panicked (its job failed): {why}"
                    ));
                    if let Job::Fetch(keys, tickets) = &job {
                        // Unanswered: remembered as absent, counted as errors.
                        let failed = keys.iter().map(|_| Checked::Failed).collect();
                        self.answer_fetch(keys, tickets, failed);
                        continue;
                    }
                    Done::Panicked(job)
                }
            };
            self.send(done);
        }
    }

    /// The next job: the one `stash` holds (taken from a queue by the last call), promotions, then
    /// fetches, then a batch of writes; `None` when there is none now. Promotion and fetch jobs
    /// queued one after another are merged up to a job's size (`merge`).
    fn next_job(&self, stash: &mut Option<Job>) -> Option<Job> {
        let q = &self.queues;
        if let Some(j) = stash
            .take()
            .or_else(|| q.reads.1.try_recv().ok().inspect(|_| self.took()))
            .or_else(|| q.fetches.1.try_recv().ok().inspect(|_| self.took()))
        {
            return Some(self.merge(j, stash));
        }
        // Large values: at most `large_write_jobs` write pipelines at once (a slot taken before
        // the queue is looked at, given back when there is no write or the job ends).
        let capped = self.header_fetch();
        if capped && self.writes_running.fetch_add(1, AcqRel) >= self.large_write_jobs {
            self.writes_running.fetch_sub(1, AcqRel);
            return None;
        }
        let batch_bytes = if self.cfg.ttl.is_none() && self.multi_key() {
            MSET_BATCH_BYTES
        } else {
            WRITE_BATCH_BYTES
        };
        let fewest = if capped {
            self.large_write_batch
        } else {
            MIN_WRITE_BATCH
        };
        let by_bytes = (batch_bytes / self.value_len.max(1)).max(fewest);
        let n = self.cfg.max_write_batch.max(1).min(by_bytes);
        let mut batch = Vec::with_capacity(n.min(1024));
        let mut sums = Vec::with_capacity(n.min(1024));
        // Writes checksummed ahead were queued before those still in `writes`.
        while batch.len() < n {
            match q.summed.1.try_recv() {
                Ok((w, sum)) => {
                    self.summing.fetch_sub(1, AcqRel);
                    batch.push(w);
                    sums.push(sum);
                }
                Err(_) => break,
            }
        }
        while batch.len() < n {
            match q.writes.1.try_recv() {
                Ok(w) => {
                    batch.push(w);
                    sums.push(None);
                }
                Err(_) => break,
            }
        }
        if batch.is_empty() {
            if capped {
                self.writes_running.fetch_sub(1, AcqRel);
            }
            return None;
        }
        Some(Job::Write(batch, sums))
    }

    /// With nothing else to do, an I/O thread computes the payload checksum of the next queued
    /// write of a large value while the writers (at most `large_write_jobs`) are busy, and
    /// queues the write with its sum in `summed`, at most `sum_ahead` ahead: a writer then
    /// sends the value without first reading 2 MiB through its cache, so the server is not left
    /// idle between one value and the next (docs/performance.md "Tier tuning table"). The block
    /// is not written while its write is queued or running, so the sum is the one the writer
    /// would compute (and a load checks it in any case). Returns whether it took a write.
    fn sum_ahead(&self) -> bool {
        if self.sum_ahead == 0 || !self.header_fetch() || self.queues.writes.1.is_empty() {
            return false;
        }
        if self.summing.fetch_add(1, AcqRel) >= self.sum_ahead {
            self.summing.fetch_sub(1, AcqRel);
            return false;
        }
        let Ok((key, block)) = self.queues.writes.1.try_recv() else {
            self.summing.fetch_sub(1, AcqRel);
            return false;
        };
        // A panic in a `BlockMemory` leaves the sum to the writer (whose job then fails, see
        // `worker`); the write itself is never dropped here.
        let sum = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut sum = None;
            let read = self.memory.with_block(block, &mut |payload| {
                sum = Some(format::payload_sum(payload));
            });
            sum.filter(|_| read.is_ok())
        }))
        .ok()
        .flatten();
        if sum.is_some() {
            self.counters.summed_ahead.fetch_add(1, Relaxed);
        }
        // (If a writer's slot came free meanwhile, this thread takes it next: see `worker`.)
        let _ = self.queues.summed.0.send(((key, block), sum));
        true
    }

    /// `job` with the promotion or fetch jobs queued behind it, while they fit in one job
    /// (`read_job_items`, `fetch_job_keys`); a job that does not fit goes to `stash`, for the next
    /// call. A scheduler that looks keys up one at a time (vLLM's connector asks for each block
    /// of a request in turn) queues a job per key; its keys then still share commands (an
    /// `MGET`), as those of one lookup of a prefix do.
    fn merge(&self, mut job: Job, stash: &mut Option<Job>) -> Job {
        let q = &self.queues;
        match &mut job {
            Job::Read(items) => {
                let cap = self.read_job_items();
                while items.len() < cap {
                    let got = q.reads.1.try_recv();
                    if got.is_ok() {
                        self.took();
                    }
                    match got {
                        Ok(Job::Read(more)) if items.len() + more.len() <= cap => {
                            items.extend(more);
                        }
                        Ok(other) => {
                            *stash = Some(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
            }
            Job::Fetch(keys, tickets) => {
                let cap = self.fetch_job_keys();
                while keys.len() < cap {
                    let got = q.fetches.1.try_recv();
                    if got.is_ok() {
                        self.took();
                    }
                    match got {
                        Ok(Job::Fetch(more, more_tickets)) if keys.len() + more.len() <= cap => {
                            keys.extend(more);
                            tickets.extend(more_tickets);
                        }
                        Ok(other) => {
                            *stash = Some(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
            }
            Job::Write(..) => {}
        }
        job
    }

    /// A promotion or fetch job was taken from its queue (see [`Shared::queued_jobs`]).
    fn took(&self) {
        self.queued_jobs.fetch_sub(1, Release);
    }

    /// An I/O thread with nothing to do looks at the queues for up to `cfg.idle_spin` before it
    /// waits on the bell (docs/tier.md, remote tier, "Threads and bounds"): a job queued
    /// meanwhile is taken with no wake-up. Returns whether a job
    /// is waiting.
    fn idle_spin(&self, wait: Duration) -> bool {
        let (spin, nap) = (self.cfg.idle_spin, self.cfg.idle_nap);
        if spin.is_zero() && nap.is_zero() {
            return false;
        }
        self.spinning.fetch_add(1, SeqCst);
        let t0 = Instant::now();
        let mut found = false;
        let mut i = 0u32;
        while !spin.is_zero() && !self.shutdown.load(Acquire) {
            if self.jobs_waiting() {
                found = true;
                break;
            }
            i = i.wrapping_add(1);
            if i % 64 == 0 && t0.elapsed() >= spin {
                break;
            }
            std::hint::spin_loop();
        }
        // Then one thread at a time naps between looks, while it still counts as looking (so
        // the scheduler's side queues with no wake-up), up to `idle_nap_for` after its last job
        // and never past `wait` (a node's probe may be due).
        if !found && !nap.is_zero() && !self.napping.swap(true, AcqRel) {
            let until = self.cfg.idle_nap_for.min(wait);
            while !self.shutdown.load(Acquire) && t0.elapsed() < until {
                std::thread::sleep(nap);
                if self.jobs_waiting() {
                    found = true;
                    break;
                }
            }
            self.napping.store(false, Release);
        }
        self.spinning.fetch_sub(1, SeqCst);
        std::sync::atomic::fence(SeqCst);
        found || self.jobs_waiting()
    }

    /// Whether a job this thread may take is queued: a write of large values counts only while
    /// fewer than `large_write_jobs` run (a writer that ends takes the next one itself, or
    /// rings for it after taking another job). Counting them regardless kept every other idle
    /// thread spinning at full speed on a queue it could not take from.
    fn jobs_waiting(&self) -> bool {
        let q = &self.queues;
        let write_room =
            !self.header_fetch() || self.writes_running.load(Acquire) < self.large_write_jobs;
        !(q.reads.1.is_empty() && q.fetches.1.is_empty())
            || (write_room && !(q.writes.1.is_empty() && q.summed.1.is_empty()))
            || (!write_room
                && self.sum_ahead > 0
                && !q.writes.1.is_empty()
                && self.summing.load(Acquire) < self.sum_ahead)
    }

    /// Waits until the bell rings, the tier stops, or `wait` passes.
    fn wait_job(&self, wait: Duration) {
        let q = &self.queues;
        let mut sel = Select::new();
        let bell = sel.recv(&q.bell.1);
        sel.recv(&q.stop);
        if let Ok(op) = sel.select_timeout(wait) {
            // A selected operation must be completed on its own channel.
            let _ = if op.index() == bell {
                op.recv(&q.bell.1)
            } else {
                op.recv(&q.stop)
            };
        }
    }

    /// Hands a fetch's answers back (see [`Answers`]): each key's answer goes to its ticket's
    /// cell, the values found go to the scheduler's side to be staged (a cell that says `Staged`
    /// has its value in the channel or about to be), then the job's reservations and count end.
    fn answer_fetch(&self, keys: &[ByteKey], tickets: &[u32], results: Vec<Checked>) {
        let now = u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX >> 2);
        let (mut hits, mut misses, mut rejected, mut errors) = (0u64, 0u64, 0u64, 0u64);
        let mut answers = Vec::with_capacity(keys.len());
        let (mut hashes, mut staged_tickets, mut values) = (Vec::new(), Vec::new(), Vec::new());
        for ((k, &t), c) in keys.iter().zip(tickets).zip(results) {
            let a = match c {
                Checked::Ok(v) if !v.is_empty() => {
                    hashes.push(Index::hash(k));
                    staged_tickets.push(t);
                    values.push(v);
                    hits += 1;
                    Answer::Staged
                }
                Checked::Ok(_) => {
                    hits += 1;
                    Answer::Present
                }
                Checked::Missing => {
                    misses += 1;
                    Answer::Absent
                }
                Checked::Rejected => {
                    rejected += 1;
                    misses += 1;
                    Answer::Absent
                }
                // Unanswered (its node down, failing or redirected away) too: remembered as
                // absent for a while (no refetch storm).
                Checked::Failed => {
                    errors += 1;
                    Answer::Absent
                }
            };
            answers.push((t, a));
        }
        let n_staged = values.len() as u64;
        // Cells first: the scheduler's side, once it applied a staged value, writes its cell
        // `Present` (which frees the ticket); a `Staged` written after that would keep the ticket
        // taken for ever, and every later fetch would wait for it (`Sched::take_ticket`).
        for (t, a) in answers {
            self.answers.write(t, a, now);
        }
        if !values.is_empty() {
            self.send(Done::Fetch {
                hashes,
                tickets: staged_tickets,
                values,
            });
        }
        let c = &self.counters;
        for (counter, n) in [
            (&c.fetch_hits, hits),
            (&c.fetch_misses, misses),
            (&c.rejected, rejected),
            (&c.fetch_errors, errors),
        ] {
            if n > 0 {
                counter.fetch_add(n, Relaxed);
            }
        }
        let n = keys.len() as u64;
        self.fetch_reserved
            .fetch_sub((n - n_staged) * self.fetch_unit(), Relaxed);
        self.fetches_out.fetch_sub(n, Release);
    }

    /// A thread's (empty) set of connections.
    fn conns(&self) -> Conns {
        let mut c = Conns::default();
        c.pool = Some(Arc::clone(&self.pool));
        c
    }
}

pub(super) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}
