//! The host engine: `memcpy` of each job's copies on a background thread, large jobs split by bytes
//! across several threads.
//!
//! One dispatcher thread takes jobs from a FIFO queue and runs them one at a time (so jobs complete in
//! submission order). A thread in `wait` whose jobs are still queued while no job is being copied
//! copies the next queued jobs itself, still one at a time and in order (no hand-off to wake the
//! dispatcher). kvoff's threads go to the CPUs set by [`crate::affinity`], if any. A job of at least [`PARALLEL_MIN_BYTES`] is cut into equal byte ranges (cut
//! points may fall inside a copy) copied by scoped helper threads plus the dispatcher itself.
//!
//! Invariants: the shared state is only touched under its mutex; a job id is in `busy` from submit
//! until its result is polled and in `unfinished` until its result is queued; the dispatcher never
//! holds the lock while copying; every job it takes yields exactly one result, also when the copy
//! panics (caught with `catch_unwind`) or the dispatcher itself stops (a guard fails what is left).
// Unsafe: the memcpys of submitted plans, whose memory the submitter vouches for (TransferEngine::submit).
#![allow(unsafe_code)]

use std::collections::{HashSet, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use super::{Job, JobResult, SubmitStats, TransferEngine};
use crate::error::{KvoffError, Result};
use crate::plan::CopyOp;

/// Jobs smaller than this are copied by the dispatcher thread alone.
pub const PARALLEL_MIN_BYTES: u64 = 8 << 20;
/// Smallest byte range given to one thread of a split job.
const MIN_BYTES_PER_THREAD: u64 = 2 << 20;
/// Default upper bound on threads per job (memory bandwidth saturates well before this).
const DEFAULT_MAX_THREADS: usize = 8;

/// Copies `len` bytes from `src` to `dst`.
///
/// # Safety
/// 1. `[src, src+len)` is valid for reads and `[dst, dst+len)` valid for writes.
/// 2. The two ranges do not overlap, and no other thread writes either range or reads the
///    destination during the call.
type CopyFn = unsafe fn(src: u64, dst: u64, len: usize);

/// The real copier.
///
/// # Safety
/// As [`CopyFn`].
unsafe fn memcpy_raw(src: u64, dst: u64, len: usize) {
    // SAFETY: obligations 1 and 2 of `CopyFn` are exactly those of `copy_nonoverlapping`.
    unsafe {
        std::ptr::copy_nonoverlapping(
            crate::usize_from(src) as *const u8,
            crate::usize_from(dst) as *mut u8,
            len,
        );
    }
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    busy: HashSet<i64>,
    unfinished: HashSet<i64>,
    results: VecDeque<JobResult>,
    closing: bool,
    dispatcher_gone: bool,
    /// A job is being copied (by the dispatcher or by a thread in `wait`): jobs run one at a time.
    running: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a job is queued or the engine closes.
    work: Condvar,
    /// Signalled when a result is queued.
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The lock is never held across user code or copies, so poisoning cannot leave the state
        // half-updated; recover the guard.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Host `memcpy` engine. See the module docs.
pub struct HostEngine {
    shared: Arc<Shared>,
    dispatcher: Option<JoinHandle<()>>,
    threads: usize,
    copier: CopyFn,
    last_stats: SubmitStats,
}

impl std::fmt::Debug for HostEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostEngine")
            .field("threads", &self.threads)
            .field("running", &self.dispatcher.is_some())
            .finish_non_exhaustive()
    }
}

impl HostEngine {
    /// An engine using up to `min(available_parallelism, 8)` threads per job.
    ///
    /// # Errors
    /// [`KvoffError::InvalidState`] when the dispatcher thread cannot be started.
    pub fn new() -> Result<Self> {
        let n = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        Self::with_threads(n.min(DEFAULT_MAX_THREADS))
    }

    /// An engine using up to `threads` threads per job (1 = the dispatcher alone).
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] when `threads` is 0; [`KvoffError::InvalidState`] when the
    /// dispatcher thread cannot be started.
    pub fn with_threads(threads: usize) -> Result<Self> {
        Self::start(threads, memcpy_raw)
    }

    fn start(threads: usize, copier: CopyFn) -> Result<Self> {
        if threads == 0 {
            return Err(KvoffError::arg("threads must be >= 1"));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            done: Condvar::new(),
        });
        let s = Arc::clone(&shared);
        let dispatcher = std::thread::Builder::new()
            .name("kvoff-host-engine".into())
            .spawn(move || dispatch(&s, threads, copier))
            .map_err(|e| KvoffError::state(format!("cannot start the host engine thread: {e}")))?;
        Ok(Self {
            shared,
            dispatcher: Some(dispatcher),
            threads,
            copier,
            last_stats: SubmitStats::default(),
        })
    }

    /// Threads used for one large job.
    #[must_use]
    pub const fn threads(&self) -> usize {
        self.threads
    }

    /// Number of submitted jobs whose result is not yet available.
    #[must_use]
    pub fn num_in_flight(&self) -> usize {
        self.shared.lock().unfinished.len()
    }
}

impl TransferEngine for HostEngine {
    unsafe fn submit(&mut self, job: Job) -> Result<()> {
        let t = Instant::now();
        let mut st = self.shared.lock();
        if st.closing || self.dispatcher.is_none() {
            return Err(KvoffError::state("the host engine is shut down"));
        }
        if st.dispatcher_gone {
            return Err(KvoffError::state("the host engine's worker thread stopped"));
        }
        if st.busy.contains(&job.job_id) {
            return Err(KvoffError::arg(format!(
                "job id {} is still in flight (or its result was not polled yet): use a new id",
                job.job_id
            )));
        }
        st.busy.insert(job.job_id);
        st.unfinished.insert(job.job_id);
        st.queue.push_back(job);
        drop(st);
        self.shared.work.notify_one();
        self.last_stats = SubmitStats {
            method: Some("host"),
            submit_ns: u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX),
            ..SubmitStats::default()
        };
        Ok(())
    }

    fn poll(&mut self) -> Vec<JobResult> {
        let mut st = self.shared.lock();
        let out: Vec<JobResult> = st.results.drain(..).collect();
        for r in &out {
            st.busy.remove(&r.job_id);
        }
        out
    }

    fn wait(&mut self, job_ids: &[i64]) -> Result<()> {
        let mut st = self.shared.lock();
        while job_ids.iter().any(|id| st.unfinished.contains(id)) {
            // While no job is being copied, the waiting thread copies the next queued one itself
            // (in order) rather than handing it to the dispatcher and sleeping until the OS runs
            // that thread: the hand-off cost a scheduler time slice on a busy CPU (docs/performance.md,
            // "kvoff's threads and the model's CPUs").
            if !st.running && !st.closing && !st.dispatcher_gone {
                if let Some(job) = st.queue.pop_front() {
                    st.running = true;
                    drop(st);
                    let result = execute(&job, self.threads, self.copier);
                    st = self.shared.lock();
                    finish(&mut st, &job, result);
                    drop(st);
                    self.shared.done.notify_all();
                    self.shared.work.notify_one();
                    st = self.shared.lock();
                    continue;
                }
            }
            st = self
                .shared
                .done
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
        Ok(())
    }

    fn last_submit_stats(&self) -> SubmitStats {
        self.last_stats
    }

    fn shutdown(&mut self) {
        self.shared.lock().closing = true;
        self.shared.work.notify_all();
        if let Some(h) = self.dispatcher.take() {
            // The dispatcher catches copy panics and its guard fails leftover jobs, so a join error
            // (a panic outside a job) has nothing left to report.
            let _ = h.join();
        }
    }
}

impl Drop for HostEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Fails whatever is left when the dispatcher exits, however it exits.
struct DispatcherGuard<'a>(&'a Shared);

impl Drop for DispatcherGuard<'_> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.dispatcher_gone = true;
        while let Some(job) = st.queue.pop_front() {
            st.unfinished.remove(&job.job_id);
            let r = failed(
                &job,
                0.0,
                "the host engine stopped before running this job".into(),
            );
            st.results.push_back(r);
        }
        st.unfinished.clear();
        drop(st);
        self.0.done.notify_all();
    }
}

fn failed(job: &Job, seconds: f64, error: String) -> JobResult {
    JobResult {
        job_id: job.job_id,
        success: false,
        bytes: job.plan.total_bytes(),
        seconds,
        direction: job.direction(),
        error: Some(error),
    }
}

/// Records `job`'s result and frees the copying slot.
fn finish(st: &mut State, job: &Job, result: JobResult) {
    st.running = false;
    st.unfinished.remove(&job.job_id);
    st.results.push_back(result);
}

fn dispatch(shared: &Shared, threads: usize, copier: CopyFn) {
    crate::affinity::place_current_thread();
    let _guard = DispatcherGuard(shared);
    loop {
        let job = {
            let mut st = shared.lock();
            loop {
                if !st.running {
                    if let Some(j) = st.queue.pop_front() {
                        st.running = true;
                        break j;
                    }
                    if st.closing {
                        return;
                    }
                }
                st = shared.work.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
        };
        let result = execute(&job, threads, copier);
        let mut st = shared.lock();
        finish(&mut st, &job, result);
        drop(st);
        shared.done.notify_all();
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}

fn execute(job: &Job, threads: usize, copier: CopyFn) -> JobResult {
    let start = Instant::now();
    let copies = job.plan.copies();
    let total = job.plan.total_bytes();
    let r = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the submitter of `job` guaranteed (TransferEngine::submit, obligations 1-2) that
        // every copy's ranges are valid and non-overlapping and untouched by others until this job's
        // result is published, which happens after this call returns.
        unsafe { run_copies(copies, total, threads, copier) }
    }));
    let seconds = start.elapsed().as_secs_f64();
    match r {
        Ok(()) => JobResult {
            job_id: job.job_id,
            success: true,
            bytes: total,
            seconds,
            direction: job.direction(),
            error: None,
        },
        Err(p) => failed(
            job,
            seconds,
            format!("host copy panicked: {}", panic_text(p.as_ref())),
        ),
    }
}

/// A position in the byte stream of a copy list: copy `idx`, byte `off` inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pos {
    idx: usize,
    off: u64,
}

/// `n + 1` cut points splitting `copies` (of `total` bytes) into `n` byte ranges of near-equal size.
fn split_points(copies: &[CopyOp], total: u64, n: usize) -> Vec<Pos> {
    let mut pos = Vec::with_capacity(n + 1);
    pos.push(Pos { idx: 0, off: 0 });
    let (mut cum, mut i) = (0u64, 0usize);
    for k in 1..n {
        // Cut at multiples of 64 bytes (cache lines) where possible.
        #[allow(clippy::cast_possible_truncation)] // ≤ total, a u64
        let target = ((u128::from(total) * k as u128 / n as u128) as u64) & !63;
        while i < copies.len() && cum + copies[i].bytes <= target {
            cum += copies[i].bytes;
            i += 1;
        }
        pos.push(Pos {
            idx: i,
            off: target.saturating_sub(cum),
        });
    }
    pos.push(Pos {
        idx: copies.len(),
        off: 0,
    });
    pos
}

/// Copies the bytes of `copies` between positions `a` and `b`.
///
/// # Safety
/// As [`CopyFn`], for every copy of `copies` touched between `a` and `b`; and no other thread
/// touches these bytes (other ranges of one split are disjoint by construction).
unsafe fn copy_between(copies: &[CopyOp], a: Pos, b: Pos, copier: CopyFn) {
    let mut idx = a.idx;
    while idx < copies.len() && (idx < b.idx || (idx == b.idx && b.off > 0)) {
        let c = copies[idx];
        let lo = if idx == a.idx { a.off } else { 0 };
        let hi = if idx == b.idx { b.off } else { c.bytes };
        if hi > lo {
            // SAFETY: `[lo, hi)` is inside copy `c`, whose ranges meet obligations 1-2 (caller).
            // `hi - lo ≤ c.bytes`, and the copy lies in the address space, so it fits usize.
            unsafe { copier(c.src_ptr + lo, c.dst_ptr + lo, crate::usize_from(hi - lo)) };
        }
        idx += 1;
    }
}

/// Copies everything, splitting big jobs across threads.
///
/// # Safety
/// As [`CopyFn`], for every copy of `copies`.
unsafe fn run_copies(copies: &[CopyOp], total: u64, threads: usize, copier: CopyFn) {
    let n = if total < PARALLEL_MIN_BYTES {
        1
    } else {
        threads.min(usize::try_from(total / MIN_BYTES_PER_THREAD).unwrap_or(usize::MAX))
    }
    .max(1);
    let cuts = split_points(copies, total, n);
    if n == 1 {
        // SAFETY: forwarded from the caller.
        unsafe { copy_between(copies, cuts[0], cuts[1], copier) };
        return;
    }
    std::thread::scope(|s| {
        let mut inline = Vec::new();
        for k in 1..n {
            let (a, b) = (cuts[k], cuts[k + 1]);
            // SAFETY (inside the closure): forwarded from the caller; the ranges [cuts[k],
            // cuts[k+1]) of different k are disjoint, so no two threads touch the same bytes.
            let spawned = std::thread::Builder::new()
                .name("kvoff-host-copy".into())
                .spawn_scoped(s, move || {
                    crate::affinity::place_current_thread();
                    // SAFETY: as above: the caller's obligations cover these copies, and the
                    // byte ranges of different threads are disjoint.
                    unsafe { copy_between(copies, a, b, copier) }
                });
            if spawned.is_err() {
                inline.push((a, b));
            }
        }
        // SAFETY: as above, for range 0 and any range whose thread could not be started.
        unsafe { copy_between(copies, cuts[0], cuts[1], copier) };
        for (a, b) in inline {
            // SAFETY: as above.
            unsafe { copy_between(copies, a, b, copier) };
        }
    });
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;
    use crate::plan::{CopyPlan, Direction};

    fn plan_of(src: &[u8], dst: &mut [u8], pieces: &[(usize, usize, usize)]) -> CopyPlan {
        let copies = pieces
            .iter()
            .map(|&(s, d, n)| CopyOp {
                src_ptr: src.as_ptr() as u64 + s as u64,
                dst_ptr: dst.as_mut_ptr() as u64 + d as u64,
                bytes: n as u64,
            })
            .collect();
        CopyPlan::from_copies(Direction::GpuToCpu, copies).unwrap()
    }

    #[test]
    fn split_points_cover_everything() {
        let copies: Vec<CopyOp> = [100u64, 1, 5000, 64, 3]
            .iter()
            .map(|&b| CopyOp {
                src_ptr: 0,
                dst_ptr: 0,
                bytes: b,
            })
            .collect();
        let total = copies.iter().map(|c| c.bytes).sum::<u64>();
        for n in 1..7 {
            let cuts = split_points(&copies, total, n);
            assert_eq!(cuts.len(), n + 1);
            // Sum of bytes between consecutive cuts equals total.
            let abs = |p: Pos| copies[..p.idx].iter().map(|c| c.bytes).sum::<u64>() + p.off;
            for w in cuts.windows(2) {
                assert!(abs(w[0]) <= abs(w[1]));
            }
            assert_eq!(abs(cuts[n]), total);
        }
    }

    static RUNNING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    static OVERLAPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    static ON_WAITER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    /// memcpy that counts overlapping calls and calls made on the test's own (waiting) thread.
    unsafe fn watching_copier(src: u64, dst: u64, len: usize) {
        use std::sync::atomic::Ordering::SeqCst;
        if RUNNING.fetch_add(1, SeqCst) > 0 {
            OVERLAPS.fetch_add(1, SeqCst);
        }
        if std::thread::current().name() == Some("waiter") {
            ON_WAITER.fetch_add(1, SeqCst);
        }
        // SAFETY: forwarded (CopyFn's obligations).
        unsafe { memcpy_raw(src, dst, len) };
        RUNNING.fetch_sub(1, SeqCst);
    }

    /// `wait` copies still-queued jobs on the waiting thread: still one job at a time, results in
    /// submission order, every byte right.
    #[test]
    fn wait_runs_queued_jobs_in_order_one_at_a_time() {
        use std::sync::atomic::Ordering::SeqCst;
        std::thread::Builder::new()
            .name("waiter".into())
            .spawn(|| {
                let mut e = HostEngine::start(1, watching_copier).unwrap();
                let n = 4096;
                // Whether the waiting thread gets a job before the dispatcher depends on the OS
                // scheduler, so rounds go on (at least 200) until it has, within a deadline that
                // only a broken hand-over would reach.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
                let mut round = 0u64;
                while round < 200
                    || (ON_WAITER.load(SeqCst) == 0 && std::time::Instant::now() < deadline)
                {
                    round += 1;
                    let srcs: Vec<Vec<u8>> = (0..8)
                        .map(|j| {
                            (0..n)
                                .map(|i| (i as u64 * 31 + j * 7 + round) as u8)
                                .collect()
                        })
                        .collect();
                    let mut dsts = vec![vec![0u8; n]; 8];
                    for (j, (src, dst)) in srcs.iter().zip(dsts.iter_mut()).enumerate() {
                        let plan = plan_of(src, dst, &[(0, 0, n)]);
                        // SAFETY: src/dst live and disjoint until the wait below returns.
                        unsafe { e.submit(Job::new(j as i64, plan)).unwrap() };
                    }
                    e.wait(&[7]).unwrap();
                    let ids: Vec<i64> = e.poll().iter().map(|r| r.job_id).collect();
                    assert_eq!(ids, (0..8).collect::<Vec<_>>(), "round {round}");
                    assert_eq!(srcs, dsts, "round {round}");
                }
                assert_eq!(OVERLAPS.load(SeqCst), 0, "two jobs were copied at once");
                // Both threads copied some (the waiter, while the dispatcher slept).
                assert!(
                    ON_WAITER.load(SeqCst) > 0,
                    "the waiting thread never copied"
                );
            })
            .unwrap()
            .join()
            .unwrap();
    }

    #[test]
    fn parallel_split_copies_exactly() {
        let n = 20 << 20;
        let src: Vec<u8> = (0..n).map(|i| (i * 7 + i / 4093) as u8).collect();
        let mut dst = vec![0u8; n + 100];
        // Three copies, one of them huge and cut across threads, one reversed order.
        let plan = plan_of(
            &src,
            &mut dst,
            &[
                (0, 50, 12 << 20),
                (12 << 20, (12 << 20) + 50, n - (12 << 20)),
            ],
        );
        let mut e = HostEngine::with_threads(4).unwrap();
        // SAFETY: src/dst are live, disjoint Vecs that outlive the wait below.
        unsafe { e.submit(Job::new(1, plan)).unwrap() };
        e.wait(&[1]).unwrap();
        let r = e.poll();
        assert!(r[0].success, "{r:?}");
        assert_eq!(&dst[50..50 + n], &src[..]);
        assert!(dst[..50].iter().all(|&b| b == 0) && dst[50 + n..].iter().all(|&b| b == 0));
    }

    /// A copier that panics: stands in for any failure on a copy thread.
    unsafe fn panicking_copier(_: u64, _: u64, len: usize) {
        assert!(len == 0, "injected copy failure");
    }

    #[test]
    fn panic_becomes_failed_result_and_engine_keeps_working() {
        let src = vec![1u8; 32 << 20];
        let mut dst = vec![0u8; 32 << 20];
        for threads in [1, 4] {
            let mut e = HostEngine::start(threads, panicking_copier).unwrap();
            let p = plan_of(&src, &mut dst, &[(0, 0, 32 << 20)]);
            // SAFETY: the copier never touches memory.
            unsafe {
                e.submit(Job::new(5, p.clone())).unwrap();
                e.submit(Job::new(6, p)).unwrap();
            }
            e.wait(&[5, 6]).unwrap();
            let r = e.poll();
            assert_eq!(r.len(), 2);
            assert!(!r[0].success && !r[1].success);
            assert!(r[0].error.as_deref().unwrap().contains("injected"), "{r:?}");
            e.shutdown();
        }
    }
}
