//! Transfer engines (docs/spec.md §6, engine part): take validated [`CopyPlan`]s as jobs, move the bytes
//! asynchronously, and report [`JobResult`]s.
//!
//! Contract shared by every engine ([`TransferEngine`]):
//! - `submit` returns at once; jobs of one engine run and complete in submission order (so, in
//!   particular, per direction);
//! - a job id is *busy* from its submission until its result has been returned by `poll`; submitting a
//!   busy id is [`KvoffError::InvalidArgument`] and enqueues nothing;
//! - `poll` never blocks and returns finished results in submission order, each exactly once;
//! - `wait(ids)` blocks until those jobs finished (unknown or already-polled ids are ignored); their
//!   results stay available to `poll`;
//! - `shutdown` drains the queue (every submitted job finishes or is reported failed), is
//!   idempotent, and later submits are [`KvoffError::InvalidState`]; results stay pollable;
//! - a failure while copying (including a panic on a worker thread) becomes a `JobResult` with
//!   `success == false` and the error text; it never aborts the process.
//!
//! Safety model: engines dereference raw addresses, so [`TransferEngine::submit`] is `unsafe`; its
//! caller vouches for the memory (normally by building the plan with a
//! [`crate::plan::CopyPlanner`] from descriptors of live allocations it keeps alive).
//!
//! [`KvoffError::InvalidArgument`]: crate::KvoffError::InvalidArgument
//! [`KvoffError::InvalidState`]: crate::KvoffError::InvalidState
// Unsafe: only the declaration of `TransferEngine::submit`, whose caller vouches for the memory.
#![allow(unsafe_code)]

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host;
mod kind;
mod open;
mod order;

pub use host::HostEngine;
pub use kind::{CopyMethod, EngineKind};
pub use open::{
    budget_bp, cuda_usable, open, EngineOptions, EngineTensor, DEFAULT_COMPUTE_BUDGET_BP,
};
pub use order::ResultOrder;

use std::sync::Arc;

use crate::error::Result;
use crate::plan::{CopyPlan, Direction};

/// One transfer job.
#[derive(Debug, Clone)]
pub struct Job {
    /// Caller-chosen id, reported back in the [`JobResult`].
    pub job_id: i64,
    /// What to copy (its direction is the job's direction).
    pub plan: CopyPlan,
    /// Raw CUDA stream (`cudaStream_t` as an integer) whose queued work the transfer must follow;
    /// `None` for "no ordering". Ignored by the host engine.
    pub stream: Option<u64>,
    /// The point `stream` had reached when the caller asked for the job, recorded earlier by
    /// [`TransferEngine::stream_marks`]' marker: the job follows that point instead of the
    /// stream's state at `submit` (a submit made later, on another thread, must not wait for
    /// work the caller queued after asking). `stream` is then not used at all (it need not
    /// outlive the call that asked for the job): the point also tells whether the caller's work
    /// is still running.
    pub after: Option<Arc<dyn StreamMark>>,
}

/// A recorded point of a caller's stream ([`StreamMarks::mark`]); its driver event goes back to
/// the marker's pool when the last reference drops.
pub trait StreamMark: Send + Sync + std::fmt::Debug {
    /// The raw driver event (`CUevent` as an integer) recorded at the point.
    fn raw_event(&self) -> u64;
}

/// Records points of callers' streams for jobs submitted later ([`Job::after`]); shared with the
/// threads that ask for jobs, usable while the engine submits on another thread.
pub trait StreamMarks: Send + Sync {
    /// Records the point `stream` has reached now.
    ///
    /// # Errors
    /// The driver's, when the event cannot be created or recorded.
    ///
    /// # Safety
    /// `stream` is a live stream of the engine's device (as [`Job::stream`]).
    unsafe fn mark(&self, stream: u64) -> Result<Arc<dyn StreamMark>>;
}

impl Job {
    /// A job without stream ordering.
    #[must_use]
    pub const fn new(job_id: i64, plan: CopyPlan) -> Self {
        Self {
            job_id,
            plan,
            stream: None,
            after: None,
        }
    }

    /// Direction of the job (that of its plan).
    #[must_use]
    pub const fn direction(&self) -> Direction {
        self.plan.direction()
    }
}

/// The outcome of one job.
#[derive(Debug, Clone, PartialEq)]
pub struct JobResult {
    /// The job's id.
    pub job_id: i64,
    /// Whether every byte was copied.
    pub success: bool,
    /// Bytes of the job: its plan's total, whether or not it succeeded (every engine; check
    /// `success` before counting them as moved).
    pub bytes: u64,
    /// Time spent moving the bytes, in seconds.
    pub seconds: f64,
    /// Direction of the job.
    pub direction: Direction,
    /// What went wrong, when `success` is false.
    pub error: Option<String>,
}

/// What an engine's most recent [`TransferEngine::submit`] did: for benchmarks and metrics (how
/// much of the GPU and of the driver a job took, beside the model).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SubmitStats {
    /// The copy method the job ran with (`"dma"`, `"kernel"`, `"staged"`, `"loop"`, `"host"`);
    /// `None` before the first submit.
    pub method: Option<&'static str>,
    /// SMs the job's copy kernels can occupy at once: CTAs launched concurrently (one CTA of up to
    /// 1024 threads per SM as the scheduler spreads them); 0 when only the copy engines (DMA) or
    /// the CPU move the bytes.
    pub sms: u32,
    /// Which policy of `Auto` chose the method: `"serving"` (the model was seen computing: a
    /// method within the compute budget) or `"idle"` (the fastest method); `None` for an explicit
    /// method or the host engine.
    pub policy: Option<&'static str>,
    /// CPU time of the whole `submit` call, ns.
    pub submit_ns: u64,
    /// Wall-clock time of the longest single driver call made by it, ns (0 for the host engine);
    /// includes time the driver waited (for queue space, or for a lock another thread held).
    pub longest_call_ns: u64,
    /// Thread CPU time of the most CPU-hungry single driver call made by it, ns.
    pub longest_call_cpu_ns: u64,
    /// Driver calls made by it.
    pub driver_calls: u32,
    /// The driver entry point of the most CPU-hungry call (`longest_call_cpu_ns`), e.g.
    /// `"cuMemcpyBatchAsync"`; `None` without driver calls.
    pub longest_call: Option<&'static str>,
    /// Time the submit waited outside the driver for the device to drain the stream's queue (the
    /// CUDA engine's pacing of long DMA jobs, [`CudaEngineConfig::max_queued_copies`]), ns.
    ///
    /// [`CudaEngineConfig::max_queued_copies`]: crate::engine::cuda::CudaEngineConfig::max_queued_copies
    pub paced_ns: u64,
    /// The job's DMA was handed to the CUDA engine's feeder thread (a job too long to queue at
    /// once: the feeder enqueues it paced while `submit` returns; its calls are in
    /// `CudaEngine::last_feed_stats`).
    pub fed: bool,
    /// Which rule chose the method, e.g. `"serving: pitched runs"`, `"serving: small copies,
    /// feedback"` (the feedback then picked `method`), `"idle: calibration"`, `"explicit method"`;
    /// `None` for the host engine.
    pub reason: Option<&'static str>,
    /// The rate cap in MB/s the job's staged pipeline was paced at (the serving policy shares one
    /// per device between both directions, sized from the compute budget and the device's memory
    /// bandwidth: `CudaEngineConfig::serving_staged_cap_mb_s`, and paces jobs while they arrive
    /// near it); 0 when not paced.
    pub staged_cap_mb_s: u32,
    /// The device's copy calls were polite when the job was submitted: short, with waits outside
    /// the driver between them, because another thread (the model's) was seen launching
    /// (docs/performance.md, "Transfers beside an eager model").
    pub polite: bool,
    /// Shares (of 1024) of the device's recent copy calls that waited for another thread's
    /// driver call: by wall time, and by time spent off the CPU (blocked on the driver's lock);
    /// and the share of those calls' time spent off the CPU.
    pub driver_contention: (u32, u32, u32),
    /// The device's copy calls sampled for contention since it was opened (no other kvoff copy
    /// call overlapped them), and of those, the ones that spent more than 3 µs off the CPU by
    /// how long: 3–6, 6–12, 12–24, 24–48, 48–96, 96–192, 192–384 µs and longer (for telling a
    /// model's short launches from long waits in reports; docs/performance.md, "Transfers beside
    /// an eager model").
    pub driver_blocked: (u64, [u64; BLOCKED_BUCKETS]),
}

/// Buckets of [`SubmitStats::driver_blocked`].
pub const BLOCKED_BUCKETS: usize = 8;

/// An asynchronous byte mover. See the module docs for the ordering and error contract.
pub trait TransferEngine: Send {
    /// Enqueues `job` and returns at once.
    ///
    /// # Safety
    /// 1. Every copy of `job.plan` reads `[src_ptr, src_ptr+bytes)` and writes
    ///    `[dst_ptr, dst_ptr+bytes)`: these ranges must be valid for reads and writes respectively
    ///    (in the address space the engine works on: host memory for the host engine), from this
    ///    call until the job's result can be observed through `poll` or `wait` (or `shutdown`
    ///    returned). A plan from a [`crate::plan::CopyPlanner`] meets this when the planner's
    ///    descriptors describe live allocations that the caller keeps alive that long.
    /// 2. No destination range overlaps another destination range or any source range of the job
    ///    (a planner's plan guarantees this when its GPU-side and CPU-side descriptors each describe
    ///    disjoint memory), and nothing else writes the job's sources or reads or writes its
    ///    destinations until the job finished.
    ///
    /// # Errors
    /// [`crate::KvoffError::InvalidArgument`] when `job.job_id` is busy;
    /// [`crate::KvoffError::InvalidState`] after `shutdown` or when the engine is broken.
    /// Nothing is enqueued on error.
    unsafe fn submit(&mut self, job: Job) -> Result<()>;

    /// Results of finished jobs not returned before, in submission order. Never blocks.
    fn poll(&mut self) -> Vec<JobResult>;

    /// Blocks until the jobs `job_ids` finished (unknown ids are ignored).
    ///
    /// # Errors
    /// Engine-specific failures while waiting (the host engine never fails here).
    fn wait(&mut self, job_ids: &[i64]) -> Result<()>;

    /// Drains in-flight work and stops the engine. Idempotent.
    fn shutdown(&mut self);

    /// What the most recent successful `submit` did (all zero / `None` before the first).
    fn last_submit_stats(&self) -> SubmitStats {
        SubmitStats::default()
    }

    /// Streams on which the model computes, for engines that choose their method by whether the
    /// model is busy (the CUDA engine's serving policy); ignored by the others.
    ///
    /// # Safety
    /// 1. Every handle is a live stream of the engine's device and stays live until the list is
    ///    replaced or the engine is dropped.
    unsafe fn set_compute_streams(&mut self, _streams: &[u64]) {}

    /// A marker of callers' stream points for jobs submitted later ([`Job::after`]); `None` for
    /// engines that do not order jobs after streams (the host engine).
    fn stream_marks(&self) -> Option<Arc<dyn StreamMarks>> {
        None
    }
}
