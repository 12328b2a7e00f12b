//! The transfer handler's submit thread (docs/performance.md, "The cost of a submit"). vLLM calls
//! `transfer_async` from the model's thread between forwards, so what a submit costs there is part
//! of every step: the caller's thread only checks the job (O(blocks)), records the point its stream
//! has reached (one event record) and queues the job; this thread builds the copies (O(pages)) and
//! hands them to the engine, whose method choice and driver calls run here too.
//!
//! Locks: the engine's (`Shared::engine`) is taken before the queue's (`Shared::queue`), never
//! the other way round; the queue's is only held briefly and never across a wait for the engine.
//! A failure after the job was queued (the engine refusing it, a panic) becomes the job's failed
//! result, as a failure while copying does.
// Unsafe: the one `TransferEngine::submit` call; the handler module's docs give its argument.
#![allow(unsafe_code)]

use std::collections::{HashSet, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use super::errors::panic_message;
use crate::engine::{Job, JobResult, ResultOrder, StreamMark, TransferEngine};
use crate::error::{KvoffError, Result};
use crate::plan::{CheckedSpec, CopyPlanner, Direction};

/// The engine, and the results of jobs it never took, kept in submission order with its own.
pub(super) struct EngineState {
    pub(super) engine: Box<dyn TransferEngine>,
    order: ResultOrder,
    /// The engine's results collected while shutting down, in order.
    drained: Vec<JobResult>,
}

impl EngineState {
    pub(super) fn new(engine: Box<dyn TransferEngine>) -> Self {
        Self {
            engine,
            order: ResultOrder::default(),
            drained: Vec::new(),
        }
    }

    /// Finished results in submission order (the engine's and the failed hand-overs').
    pub(super) fn poll(&mut self) -> Vec<JobResult> {
        let mut engine = std::mem::take(&mut self.drained);
        engine.extend(self.engine.poll());
        self.order.merge(engine)
    }

    /// Waits for the jobs `ids`, keeps their results, then stops the engine. The results are
    /// collected first because an engine may release in-flight bookkeeping when it stops.
    fn shutdown(&mut self, ids: &[i64]) {
        let _ = self.engine.wait(ids);
        let mut done = self.engine.poll();
        self.engine.shutdown();
        done.extend(self.engine.poll());
        self.drained.extend(done);
    }
}

/// A checked job on its way to the engine.
pub(super) struct Pending {
    pub(super) job_id: i64,
    pub(super) spec: CheckedSpec,
    pub(super) stream: Option<u64>,
    pub(super) after: Option<Arc<dyn StreamMark>>,
}

/// Jobs asked for and not yet handed to the engine, and the ids not yet reported.
#[derive(Default)]
pub(super) struct Queue {
    jobs: VecDeque<Pending>,
    /// Jobs accepted since the handler was made.
    asked: u64,
    /// Jobs handed to the engine (or failed on the way) since the handler was made.
    handed: u64,
    /// Shutting down: submits are refused.
    closed: bool,
    /// The thread ends once the queue is empty.
    stop: bool,
    /// The thread has ended: submits are refused.
    ended: bool,
    /// Ids accepted and not yet returned by `get_finished` (busy: a second submit is refused).
    pub(super) unreported: HashSet<i64>,
    /// Results the submit thread collected after its hand-overs, older than any still in the
    /// engine: `get_finished` returns them even while the engine's lock is busy (a hand-over may
    /// hold it while the engine waits for its feeder).
    ready: Vec<JobResult>,
}

impl Queue {
    /// Accepts `p`, or refuses it (shut down, a busy id) leaving nothing queued.
    pub(super) fn push(&mut self, p: Pending) -> Result<()> {
        if self.closed {
            return Err(KvoffError::state("the transfer handler was shut down"));
        }
        if self.ended {
            return Err(KvoffError::state(
                "the transfer handler's submit thread has ended (a kvoff bug: please report)",
            ));
        }
        if !self.unreported.insert(p.job_id) {
            return Err(KvoffError::arg(format!(
                "job id {} is already in flight",
                p.job_id
            )));
        }
        self.jobs.push_back(p);
        self.asked += 1;
        Ok(())
    }

    /// The count of jobs accepted so far (a flush target).
    pub(super) const fn asked(&self) -> u64 {
        self.asked
    }

    /// Takes `more` after the collected results and forgets their ids.
    pub(super) fn report(&mut self, more: Vec<JobResult>) -> Vec<JobResult> {
        let mut out = std::mem::take(&mut self.ready);
        out.extend(more);
        for r in &out {
            self.unreported.remove(&r.job_id);
        }
        out
    }
}

/// What the handler's calls and its submit thread share.
pub(super) struct Shared {
    pub(super) direction: Direction,
    pub(super) planner: CopyPlanner,
    pub(super) engine: Mutex<EngineState>,
    pub(super) queue: Mutex<Queue>,
    /// Signalled when a job is queued or the thread should stop.
    work: Condvar,
    /// Signalled when a job was handed over.
    handed: Condvar,
}

impl Shared {
    pub(super) fn new(direction: Direction, planner: CopyPlanner, engine: EngineState) -> Self {
        Self {
            direction,
            planner,
            engine: Mutex::new(engine),
            queue: Mutex::new(Queue::default()),
            work: Condvar::new(),
            handed: Condvar::new(),
        }
    }

    pub(super) fn lock_queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_engine(&self) -> MutexGuard<'_, EngineState> {
        self.engine.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes the thread for a queued job.
    pub(super) fn notify(&self) {
        self.work.notify_one();
    }

    /// Blocks until the first `target` jobs were handed to the engine. Call without the GIL.
    pub(super) fn flush(&self, target: u64) {
        let mut q = self.lock_queue();
        while q.handed < target {
            q = self.handed.wait(q).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Refuses later submits, hands over what is queued, stops the engine (its in-flight jobs
    /// finish first) and ends the thread (`thread`: its handle, for the one call that joins it).
    /// Idempotent; a second call at once waits for the queue too. Call without the GIL, in the
    /// process that made the handler, with the thread started (or nothing ever queued).
    pub(super) fn shutdown(&self, thread: Option<JoinHandle<()>>) {
        let target = {
            let mut q = self.lock_queue();
            q.closed = true;
            q.asked
        };
        self.flush(target);
        {
            let mut st = self.lock_engine();
            let ids: Vec<i64> = self.lock_queue().unreported.iter().copied().collect();
            let _ = catch_unwind(AssertUnwindSafe(|| st.shutdown(&ids)));
        }
        self.lock_queue().stop = true;
        self.work.notify_all();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }

    /// Plans `p` and hands it to the engine; a failure becomes its failed result.
    fn hand_over(&self, p: Pending) {
        let job_id = p.job_id;
        let mut bytes = 0;
        let r = catch_unwind(AssertUnwindSafe(|| -> Result<()> {
            let plan = self.planner.plan_checked(&p.spec)?;
            bytes = plan.total_bytes();
            let job = Job {
                job_id,
                plan,
                stream: p.stream,
                after: p.after,
            };
            let mut st = self.lock_engine();
            // SAFETY: obligation 1 — every copy was validated by the planner (`check` on the
            // caller's thread, on ids that cannot change since) against descriptors taken from
            // torch tensors whose extents lie inside their storages, and the handler keeps those
            // tensors until the engine is shut down (`shutdown` hands every queued job over
            // first); obligation 2 — the GPU-side and CPU-side tensors were each checked disjoint
            // and the planner rejects duplicate destinations and GPU/CPU overlap; concurrent use
            // of the same blocks by the caller is excluded by the offloading protocol.
            unsafe { st.engine.submit(job) }?;
            st.order.accepted();
            Ok(())
        }));
        let error = match r {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(payload) => Some(format!(
                "internal error in kvoff (please report): {}",
                panic_message(&*payload)
            )),
        };
        let mut st = self.lock_engine();
        if let Some(error) = error {
            st.order.failed(JobResult {
                job_id,
                success: false,
                bytes,
                seconds: 0.0,
                direction: self.direction,
                error: Some(error),
            });
        }
        // Collected here, under the engine's lock, so that they are older than anything polled
        // after it is released (`get_finished` keeps the order).
        let done = catch_unwind(AssertUnwindSafe(|| st.poll())).unwrap_or_default();
        if !done.is_empty() {
            self.lock_queue().ready.extend(done);
        }
    }
}

/// Starts the submit thread of `shared`.
///
/// # Errors
/// The operating system's, when the thread cannot be started.
pub(super) fn start(shared: &Arc<Shared>) -> Result<JoinHandle<()>> {
    let s = Arc::clone(shared);
    let name = match shared.direction {
        Direction::GpuToCpu => "kvoff-submit-store",
        Direction::CpuToGpu => "kvoff-submit-load",
    };
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _ended = Ended(&s);
            crate::affinity::place_current_thread();
            loop {
                let p = {
                    let mut q = s.lock_queue();
                    loop {
                        if let Some(p) = q.jobs.pop_front() {
                            break p;
                        }
                        if q.stop {
                            return;
                        }
                        q = s.work.wait(q).unwrap_or_else(PoisonError::into_inner);
                    }
                };
                s.hand_over(p);
                s.lock_queue().handed += 1;
                s.handed.notify_all();
            }
        })
        .map_err(|e| {
            KvoffError::state(format!(
                "cannot start the transfer handler's submit thread: {e}"
            ))
        })
}

/// Marks the thread ended however it ends: jobs still queued (only if it ended by a bug) fail, and
/// every flush returns, so that no `wait`, `shutdown` or drop hangs on a thread that is gone.
struct Ended<'a>(&'a Shared);

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        let mut q = self.0.lock_queue();
        q.ended = true;
        let left: Vec<Pending> = q.jobs.drain(..).collect();
        for p in left {
            q.ready.push(JobResult {
                job_id: p.job_id,
                success: false,
                bytes: 0,
                seconds: 0.0,
                direction: self.0.direction,
                error: Some(
                    "the transfer handler's submit thread ended before this job (a kvoff bug: please report)"
                        .to_owned(),
                ),
            });
        }
        q.handed = q.asked;
        drop(q);
        self.0.handed.notify_all();
    }
}
