//! The engine of one direction: its state (stream, event pool, in-flight FIFO, the resources of each
//! copy method), its construction and accessors, and the per-submit [`JobCtx`]. What a job does is
//! in the files above this one: `choose` (which method), `dma`, `launch`, `pipeline` (the methods),
//! `submit` (`submit`, `poll`, `wait`, `shutdown`).
// Unsafe: driver calls through `ffi` on handles this engine owns (each block says why it is sound).
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::sync::Arc;

use super::calibration::Calibration;
use super::config::{CopyMethod, CudaEngineConfig};
use super::device::CudaDevice;
use super::feed::{DmaBufs, DmaHelper, Feeder, Pace};
use super::ffi;
use super::handles::{Event, Stream};
use super::kernel::{DescBuf, MAX_KERNEL_THREADS};
use super::pitched::{AllocRanges, MIN_ROWS};
use super::scores::{ScoreKey, Scores};
use super::staged::Staging;
use crate::engine::{JobResult, SubmitStats};
use crate::error::{KvoffError, Result};
use crate::plan::Direction;

/// CPU-side preparation of a job (see `CudaEngine::prepare`).
pub(super) enum Prepared {
    /// Nothing to prepare (DMA, loop, empty job).
    Nothing,
    /// Kernel descriptors in a pinned buffer sized for the whole job; those of the first `head`
    /// copies (`head_n` descriptors) are written, the rest are written at issue time while the
    /// device already copies the head.
    Kernel {
        buf: DescBuf,
        head: usize,
        head_n: usize,
    },
    /// A staged job: a pinned descriptor buffer sized for the whole job; the chunks are packed
    /// and enqueued one by one at issue time, so the device starts on the first chunk while the
    /// CPU packs the next.
    Staged {
        buf: DescBuf,
        n_chunks: usize,
        first_slot: usize,
        /// Bytes of the job.
        total: u64,
    },
}

/// Resources of one submitted job.
pub(super) struct InFlight {
    pub(super) job_id: i64,
    pub(super) bytes: u64,
    pub(super) direction: Direction,
    pub(super) start: Event,
    pub(super) end: Event,
    pub(super) desc: Option<DescBuf>,
    pub(super) method: CopyMethod,
    /// The serving policy's feedback cell when the method was chosen by measured speed.
    pub(super) score: Option<ScoreKey>,
    /// Error at submission: the job is reported failed in its turn.
    pub(super) failed: Option<String>,
}

/// What `submit` decided about the job being submitted, passed through `choose` → `prepare` →
/// `issue` (per-submit state; the engine keeps only what outlives a job).
#[derive(Clone, Debug)]
pub(super) struct JobCtx {
    /// Id of the job.
    pub(super) id: i64,
    /// Whether the job uses the serving policy (the budget is set and the model was seen
    /// computing recently).
    pub(super) serving: bool,
    /// Copies of the job that form pitched runs in order (see `pitched`; counted only for `Auto`).
    pub(super) pitched: usize,
    /// Whether the job's DMA groups copies into pitched runs (see `submit`).
    pub(super) group_pitched: bool,
    /// Whether the job went to the feeder (which records its end event).
    pub(super) fed: bool,
    /// Which rule of `choose` decided the job's method (`SubmitStats::reason`).
    pub(super) reason: &'static str,
    /// The job's staged-pipeline cap in MB/s (0: not paced; see the `pace` module).
    pub(super) staged_cap_mb_s: u32,
    /// Largest grid the job launched (for [`SubmitStats::sms`]).
    pub(super) grid: u32,
    /// The job's copies, for work handed to the feeder (which packs a staged job itself).
    pub(super) plan: Option<std::sync::Arc<crate::plan::CopyPlan>>,
}

impl JobCtx {
    /// A context for job `id` before `submit` decides anything.
    pub(super) fn new(id: i64) -> Self {
        Self {
            id,
            serving: false,
            pitched: 0,
            group_pitched: true,
            fed: false,
            reason: "",
            staged_cap_mb_s: 0,
            grid: 0,
            plan: None,
        }
    }

    /// Whether at least half of the job's `n` copies form pitched runs (in order) of at least
    /// [`choice_min_run_bytes`](super::pitched::choice_min_run_bytes) each (`dma_pitched`: the
    /// engine groups pitched runs at all).
    pub(super) fn mostly_pitched(&self, dma_pitched: bool, n: usize) -> bool {
        dma_pitched && n >= MIN_ROWS && 2 * self.pitched >= n
    }
}

/// Jobs per copy method an engine ran, keyed by method (one count per [`CopyMethod::RUN`]; `Dma`
/// counts jobs of batched DMA, a DMA job where the driver lacks the batch API counts as `Loop`).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct MethodCounts([u64; CopyMethod::RUN.len()]);

impl MethodCounts {
    /// Counts a job that ran `method` (`Auto` is never run: it counts as `Dma`).
    pub(super) fn add(&mut self, method: CopyMethod) {
        let m = if method == CopyMethod::Auto {
            CopyMethod::Dma
        } else {
            method
        };
        if let Some(i) = CopyMethod::RUN.iter().position(|&o| o == m) {
            self.0[i] += 1;
        }
    }

    /// Jobs per method, in the order of [`CopyMethod::RUN`].
    pub(super) fn all(&self) -> [(CopyMethod, u64); CopyMethod::RUN.len()] {
        std::array::from_fn(|i| (CopyMethod::RUN[i], self.0[i]))
    }
}

/// The CUDA engine of one direction (one handler): its stream, event pool and in-flight FIFO.
pub struct CudaEngine {
    pub(super) device: Arc<CudaDevice>,
    pub(super) cfg: CudaEngineConfig,
    pub(super) direction: Direction,
    /// `None` once shut down (released).
    pub(super) stream: Option<Stream>,
    /// `None` once shut down (released).
    pub(super) caller_event: Option<Event>,
    /// Points of callers' streams recorded before their jobs reach `submit` (`Job::after`).
    pub(super) marks: Arc<super::marks::CallerMarks>,
    pub(super) events: Vec<Event>,
    pub(super) descs: Vec<DescBuf>,
    pub(super) inflight: VecDeque<InFlight>,
    pub(super) closed: bool,
    pub(super) close_errors: Vec<String>,
    /// Jobs per method since creation (see `method_counts()`).
    pub(super) method_counts: MethodCounts,
    pub(super) last_ctas: u32,
    pub(super) last_stats: SubmitStats,
    pub(super) staging: Option<Staging>,
    /// Reused argument arrays of the batch call.
    pub(super) scratch_dma: DmaBufs,
    /// Helper thread and stream of split DMA jobs (created on first use).
    pub(super) dma_helper: Option<DmaHelper>,
    /// Pacing events of DMA enqueued by this thread (created on first use).
    pub(super) pace: Pace,
    pub(super) scratch_runs: Vec<(u64, u64, u64)>,
    pub(super) last_pack_ns: u64,
    /// This thread's fastest recent descriptor uploads (`share`: the copy kernel's calls are
    /// watched for contention too).
    pub(super) call_base: super::share::CallBase,
    pub(super) last_submit_ns: u64,
    /// Results of jobs drained by `shutdown`, returned by the next `poll`.
    pub(super) drained: Vec<JobResult>,
    /// The device's calibration when `method` is `Auto` and calibration is on.
    pub(super) calibration: Option<Arc<Calibration>>,
    /// Streams on which the model computes, watched at each submit besides the job's own
    /// ordering stream ([`CudaEngine::set_compute_streams`]).
    pub(super) compute_streams: Vec<u64>,
    /// Measured GB/s of DMA and staging under the serving policy (see `Scores`).
    pub(super) scores: Scores,
    /// The thread that enqueues long DMA jobs (created on first use; see `Feeder`).
    pub(super) feeder: Option<Feeder>,
    /// Device allocations seen by pitched DMA (a run stays within one).
    pub(super) alloc_ranges: AllocRanges,
}

impl std::fmt::Debug for CudaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEngine")
            .field("device", &self.device)
            .field("direction", &self.direction)
            .field("cfg", &self.cfg)
            .field("in_flight", &self.inflight.len())
            .finish_non_exhaustive()
    }
}

impl CudaEngine {
    /// An engine for one direction on `device`. Loads (`CpuToGpu`) get the highest stream priority,
    /// stores the lowest. `KVOFF_CUDA_TUNE` is not read here: callers apply it to `cfg`
    /// ([`CudaEngineConfig::apply_env_tuning`], or [`crate::engine::EngineOptions::from_env`]).
    ///
    /// # Errors
    /// [`KvoffError::Cuda`] if the stream or events cannot be created.
    pub fn new(
        device: Arc<CudaDevice>,
        direction: Direction,
        cfg: CudaEngineConfig,
    ) -> Result<Self> {
        if cfg.max_ctas == 0 {
            return Err(KvoffError::arg("max_ctas must be at least 1"));
        }
        if cfg.kernel_threads == 0
            || cfg.kernel_threads % 32 != 0
            || cfg.kernel_threads > MAX_KERNEL_THREADS
        {
            return Err(KvoffError::arg(format!(
                "kernel_threads must be a multiple of 32 in 32..={MAX_KERNEL_THREADS}, got {}",
                cfg.kernel_threads
            )));
        }
        if cfg.staging_slots == 0 || cfg.staging_slot_bytes < 1 << 16 {
            return Err(KvoffError::arg(
                "staging needs at least one slot of at least 64 KiB",
            ));
        }
        let calibration = if cfg.method == CopyMethod::Auto && cfg.calibrate {
            device.calibration()
        } else {
            None
        };
        device.bind()?;
        device.driver.set_slow_share(cfg.polite_slow_share);
        device
            .driver
            .set_duty_device_wide(cfg.polite_duty_device_wide);
        // Beside a model (serving policy) both directions take the lowest priority, so that the
        // model's pending CTAs are scheduled before the copy kernel's.
        let high =
            direction == Direction::CpuToGpu && cfg.load_high_priority.unwrap_or(!cfg.serving());
        // SAFETY: the context is current.
        let stream = unsafe { Stream::new(high) }?;
        // SAFETY: as above. (On error `stream` is destroyed by its Drop.)
        let caller_event = unsafe { Event::new(false) }?;
        let marks = Arc::new(super::marks::CallerMarks::new(Arc::clone(&device)));
        Ok(Self {
            device,
            cfg,
            direction,
            stream: Some(stream),
            caller_event: Some(caller_event),
            marks,
            events: Vec::new(),
            descs: Vec::new(),
            inflight: VecDeque::new(),
            closed: false,
            close_errors: Vec::new(),
            method_counts: MethodCounts::default(),
            last_ctas: 0,
            last_stats: SubmitStats::default(),
            staging: None,
            scratch_dma: DmaBufs::default(),
            dma_helper: None,
            pace: Pace::default(),
            scratch_runs: Vec::new(),
            last_pack_ns: 0,
            call_base: super::share::CallBase::default(),
            last_submit_ns: 0,
            drained: Vec::new(),
            calibration,
            compute_streams: Vec::new(),
            scores: Scores::default(),
            feeder: None,
            alloc_ranges: AllocRanges::default(),
        })
    }

    /// The device.
    #[must_use]
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Settings.
    #[must_use]
    pub fn config(&self) -> &CudaEngineConfig {
        &self.cfg
    }

    /// Streams on which the model computes (raw `CUstream` handles; 0 is the legacy default
    /// stream), for the serving policy's idle detection ([`CudaEngineConfig::idle_after_us`]):
    /// besides each job's ordering stream, `submit` asks these whether they have unfinished work.
    /// Needed when jobs are not ordered after the model's stream (transfers submitted from a
    /// thread of their own); replaces the earlier list.
    ///
    /// A stream being captured into a CUDA graph is not queried (a query would invalidate the
    /// capture); it counts as idle meanwhile.
    ///
    /// # Safety
    /// 1. Every stream is a live stream of this engine's device (its primary context), or 0 (the
    ///    legacy default stream), and stays live until the list is replaced or the engine is
    ///    dropped.
    pub unsafe fn set_compute_streams(&mut self, streams: &[u64]) {
        self.compute_streams = streams.to_vec();
    }

    /// Looks for the model computing (a job's ordering stream or a watched stream with unfinished
    /// work) and records a sighting on the device; skipped while a sighting of the last
    /// millisecond already decides.
    fn observe_compute(&self, caller: Option<u64>, mark: Option<ffi::CUevent>) {
        if self.cfg.idle_after_us == 0
            || self
                .device
                .compute_seen_within(self.cfg.idle_after_us.min(1_000))
        {
            return;
        }
        // A job asked for earlier (`Job::after`): the caller's stream is judged by its recorded
        // point, not queried (it need not outlive the call that asked): still pending, the
        // caller's work before the job is still running.
        if let Some(e) = mark {
            // SAFETY: a live event of this context, held by the job; a query has no effect.
            if let Ok(false) = unsafe { ffi::event_done(e) } {
                self.device.note_compute();
                return;
            }
        }
        // With no model stream watched, the legacy default stream is asked too: where a model
        // runs on it (torch's default) while the jobs come from a side thread and its stream,
        // its work is seen; a GPU taken for idle on no evidence ran the copy kernel beside a
        // graph replay (docs/performance.md "Transfers beside an eager model"). `stream_busy`
        // skips it while another stream's capture makes the query unsafe (`cuStreamIsCapturing`
        // then fails).
        let fallback = (self.compute_streams.is_empty() && caller != Some(0)).then_some(0);
        for s in caller
            .into_iter()
            .chain(self.compute_streams.iter().copied())
            .chain(fallback)
        {
            // SAFETY: the job's stream is live (submit's contract), the watched ones by
            // `set_compute_streams`'s obligation, 0 is the legacy default stream of the current
            // context; a query has no effect on the stream.
            if let Ok(true) = unsafe { ffi::stream_busy(s as ffi::CUstream) } {
                self.device.note_compute();
                return;
            }
        }
    }

    /// Whether the job about to be submitted uses the serving policy.
    pub(super) fn decide_serving(&self, caller: Option<u64>, mark: Option<ffi::CUevent>) -> bool {
        if !self.cfg.serving() {
            return false;
        }
        self.observe_compute(caller, mark);
        // A model launching eagerly beside kvoff's copy calls (`share`) is computing too, also
        // when none of its streams was given to watch.
        self.device.compute_seen_within(self.cfg.idle_after_us) || self.device.driver.polite_now()
    }

    /// Jobs run per method since creation, one entry per [`CopyMethod::RUN`] (`Dma`: batched DMA;
    /// a DMA job where the driver lacks the batch API counts as `Loop`).
    #[must_use]
    pub fn method_counts(&self) -> [(CopyMethod, u64); CopyMethod::RUN.len()] {
        self.method_counts.all()
    }

    /// CPU time of the last `submit` and of its staged packing, in nanoseconds.
    #[must_use]
    pub fn last_submit_timing_ns(&self) -> (u64, u64) {
        (self.last_submit_ns, self.last_pack_ns)
    }

    /// CTAs used by the last kernel job (0 if none ran).
    #[must_use]
    pub fn last_kernel_ctas(&self) -> u32 {
        self.last_ctas
    }

    /// Raw handle of this engine's stream (as an integer, e.g. for `torch.cuda.ExternalStream`).
    #[must_use]
    pub fn stream_handle(&self) -> u64 {
        self.stream.as_ref().map_or(0, |s| s.raw() as u64)
    }

    /// Errors recorded while releasing resources.
    #[must_use]
    pub fn close_errors(&self) -> &[String] {
        &self.close_errors
    }

    pub(super) fn take_event(&mut self) -> Result<Event> {
        if let Some(e) = self.events.pop() {
            return Ok(e);
        }
        // SAFETY: callers bind the context first.
        unsafe { Event::new(true) }
    }

    /// The engine's stream (the engine is open: `submit`, `poll` and `wait` check first).
    pub(super) fn stream(&self) -> Result<ffi::CUstream> {
        self.stream
            .as_ref()
            .map(Stream::raw)
            .ok_or_else(|| KvoffError::state("the CUDA engine was shut down"))
    }

    pub(super) fn check_open(&self) -> Result<()> {
        if self.closed {
            return Err(KvoffError::state("the CUDA engine was shut down"));
        }
        Ok(())
    }
}
