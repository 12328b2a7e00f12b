//! The engine of one direction: its stream, event pool and in-flight FIFO; `submit`, `poll`,
//! `wait` and `shutdown`.
// Unsafe: driver calls through `ffi` on handles this engine owns (each block says why it is sound).
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::sync::Arc;

use super::calibrate::Calibration;
use super::choose::{ScoreKey, Scores};
use super::dma::{DmaBufs, DmaHelper, FeedStats, Feeder, Pace};
use super::ffi;
use super::handles::{Event, Stream};
use super::kernel::{
    write_kernel_descs, DescBuf, DESC_BYTES, KERNEL_CHUNK_BYTES, KERNEL_HEAD_COPIES,
    MAX_KERNEL_THREADS,
};
use super::pipeline::Staging;
use super::{staged_chunk_count, CopyMethod, CudaDevice, CudaEngineConfig};
use crate::engine::{Job, JobResult, SubmitStats, TransferEngine};
use crate::error::{KvoffError, Result};
use crate::plan::{CopyOp, Direction};

/// CPU-side preparation of a job (see `CudaEngine::prepare`).
pub(super) enum Prepared {
    /// Nothing to prepare (DMA, loop, empty job).
    Nothing,
    /// Kernel descriptors in a pinned buffer.
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

/// Index of a direction in per-direction arrays.
pub(super) const fn dir_index(d: Direction) -> usize {
    match d {
        Direction::GpuToCpu => 0,
        Direction::CpuToGpu => 1,
    }
}

/// The CUDA engine of one direction (one handler): its stream, event pool and in-flight FIFO.
#[allow(clippy::struct_excessive_bools)] // per-job flags, each documented
pub struct CudaEngine {
    pub(super) device: Arc<CudaDevice>,
    pub(super) cfg: CudaEngineConfig,
    pub(super) direction: Direction,
    /// `None` once shut down (released).
    pub(super) stream: Option<Stream>,
    /// `None` once shut down (released).
    pub(super) caller_event: Option<Event>,
    pub(super) events: Vec<Event>,
    pub(super) descs: Vec<DescBuf>,
    pub(super) inflight: VecDeque<InFlight>,
    pub(super) closed: bool,
    pub(super) close_errors: Vec<String>,
    /// Jobs per method since creation: `[dma, kernel, loop, staged]` (see `method_counts()`).
    pub(super) method_counts: [u64; 4],
    pub(super) last_ctas: u32,
    /// Largest grid launched by the current `submit` (for [`SubmitStats::sms`]).
    pub(super) submit_grid: u32,
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
    pub(super) last_submit_ns: u64,
    /// Results of jobs drained by `shutdown`, returned by the next `poll`.
    pub(super) drained: Vec<JobResult>,
    /// The device's calibration when `method` is `Auto` and calibration is on.
    pub(super) calibration: Option<Arc<Calibration>>,
    /// Streams on which the model computes, watched at each submit besides the job's own
    /// ordering stream ([`CudaEngine::set_compute_streams`]).
    pub(super) compute_streams: Vec<u64>,
    /// Whether the job being submitted uses the serving policy (the budget is set and the model
    /// was seen computing recently); decided once per submit.
    pub(super) job_serving: bool,
    /// Measured GB/s of DMA and staging under the serving policy (see `Scores`).
    pub(super) scores: Scores,
    /// Copies of the job being submitted that form pitched runs in order (see `pitched`).
    pub(super) job_pitched: usize,
    /// Whether the current job's DMA groups copies into pitched runs (see `submit`).
    pub(super) job_group_pitched: bool,
    /// The thread that enqueues long DMA jobs (created on first use; see `Feeder`).
    pub(super) feeder: Option<Feeder>,
    /// Id of the job being submitted.
    pub(super) submitting: i64,
    /// Whether the job being submitted went to the feeder (which records its end event).
    pub(super) job_fed: bool,
    /// Device allocations seen by pitched DMA (a run stays within one).
    pub(super) alloc_ranges: super::pitched::AllocRanges,
    /// Which rule of `choose` decided the job's method (`SubmitStats::reason`).
    pub(super) job_reason: &'static str,
    /// The current job's staged-pipeline cap in MB/s (0: not paced; see the `pace` module).
    pub(super) job_staged_cap_mb_s: u32,
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
    /// stores the lowest.
    ///
    /// # Errors
    /// [`KvoffError::Cuda`] if the stream or events cannot be created.
    pub fn new(
        device: Arc<CudaDevice>,
        direction: Direction,
        mut cfg: CudaEngineConfig,
    ) -> Result<Self> {
        if let Ok(spec) = std::env::var("KVOFF_CUDA_TUNE") {
            cfg.apply_tuning(&spec)?;
        }
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
        // Beside a model (serving policy) both directions take the lowest priority, so that the
        // model's pending CTAs are scheduled before the copy kernel's.
        let high =
            direction == Direction::CpuToGpu && cfg.load_high_priority.unwrap_or(!cfg.serving());
        // SAFETY: the context is current.
        let stream = unsafe { Stream::new(high) }?;
        // SAFETY: as above. (On error `stream` is destroyed by its Drop.)
        let caller_event = unsafe { Event::new(false) }?;
        Ok(Self {
            device,
            cfg,
            direction,
            stream: Some(stream),
            caller_event: Some(caller_event),
            events: Vec::new(),
            descs: Vec::new(),
            inflight: VecDeque::new(),
            closed: false,
            close_errors: Vec::new(),
            method_counts: [0; 4],
            last_ctas: 0,
            submit_grid: 0,
            last_stats: SubmitStats::default(),
            staging: None,
            scratch_dma: DmaBufs::default(),
            dma_helper: None,
            pace: Pace::default(),
            scratch_runs: Vec::new(),
            last_pack_ns: 0,
            last_submit_ns: 0,
            drained: Vec::new(),
            calibration,
            compute_streams: Vec::new(),
            job_serving: false,
            scores: Scores::default(),
            job_pitched: 0,
            job_group_pitched: true,
            feeder: None,
            submitting: 0,
            job_fed: false,
            job_reason: "",
            job_staged_cap_mb_s: 0,
            alloc_ranges: super::pitched::AllocRanges::default(),
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
    fn observe_compute(&self, caller: Option<u64>) {
        if self.cfg.idle_after_us == 0
            || self
                .device
                .compute_seen_within(self.cfg.idle_after_us.min(1_000))
        {
            return;
        }
        for s in caller
            .into_iter()
            .chain(self.compute_streams.iter().copied())
        {
            // SAFETY: the job's stream is live (submit's contract), the watched ones by
            // `set_compute_streams`'s obligation; a query has no effect on the stream.
            if let Ok(true) = unsafe { ffi::stream_busy(s as ffi::CUstream) } {
                self.device.note_compute();
                return;
            }
        }
    }

    /// Whether the job about to be submitted uses the serving policy.
    fn decide_serving(&self, caller: Option<u64>) -> bool {
        if !self.cfg.serving() {
            return false;
        }
        self.observe_compute(caller);
        self.device.compute_seen_within(self.cfg.idle_after_us)
    }

    /// Jobs run per method since creation: `[dma (batched, or per-copy loop without the batch API),
    /// kernel, loop, staged]`.
    #[must_use]
    pub fn method_counts(&self) -> [u64; 4] {
        self.method_counts
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

    /// CPU-side work of a job before its start event: buffers, and the kernel descriptors of the
    /// job's head. The rest (the kernel job's tail, the staged chunks) is written while the device
    /// already works on what was enqueued, so a job starts after a few microseconds of CPU work;
    /// the device-timed `transfer_time` still covers device work only as long as the CPU keeps
    /// ahead of the device (it packs several times faster than PCIe moves the bytes).
    pub(super) fn prepare(
        &mut self,
        method: CopyMethod,
        copies: &[CopyOp],
        total: u64,
    ) -> Result<Prepared> {
        if copies.is_empty() {
            return Ok(Prepared::Nothing);
        }
        match method {
            CopyMethod::Staged => self.prepare_staged(copies, total),
            CopyMethod::Kernel => {
                if !self.cfg.host_mapped {
                    return Err(KvoffError::arg(
                        "the copy kernel needs pinned, device-mapped host memory; use engine \"dma\" or pin the region",
                    ));
                }
                let bound = usize::try_from(total / KERNEL_CHUNK_BYTES)
                    .unwrap_or(usize::MAX)
                    .saturating_add(copies.len());
                let nbytes = bound
                    .checked_mul(DESC_BYTES)
                    .ok_or_else(|| KvoffError::arg("too many copies for one job"))?;
                let buf = self.take_desc(nbytes)?;
                let head = copies.len().min(KERNEL_HEAD_COPIES);
                let head_n = write_kernel_descs(&copies[..head], &buf, 0)?;
                Ok(Prepared::Kernel { buf, head, head_n })
            }
            CopyMethod::Dma | CopyMethod::Auto | CopyMethod::Loop => Ok(Prepared::Nothing),
        }
    }

    /// Enqueues the device work of one job on the stream (between the timing events).
    pub(super) fn issue(
        &mut self,
        method: CopyMethod,
        copies: &[CopyOp],
        prep: &Prepared,
        end: ffi::CUevent,
    ) -> Result<()> {
        let s = self.stream()?;
        match prep {
            Prepared::Kernel { buf, head, head_n } => {
                self.upload_and_launch(buf, 0, *head_n, s)?;
                if *head < copies.len() {
                    let t = std::time::Instant::now();
                    let tail_n = write_kernel_descs(&copies[*head..], buf, *head_n)?;
                    self.last_pack_ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    self.upload_and_launch(buf, *head_n, tail_n, s)?;
                }
                Ok(())
            }
            Prepared::Staged {
                buf,
                n_chunks,
                first_slot,
                total,
            } => {
                let r = self.enqueue_staged(copies, buf, *n_chunks, *first_slot, *total, s);
                if let Some(st) = self.staging.as_mut() {
                    st.next = (first_slot + n_chunks) % st.slots.len().max(1);
                }
                r
            }
            Prepared::Nothing => match method {
                CopyMethod::Dma | CopyMethod::Auto if self.splits_dma(copies.len()) => {
                    self.dma_split(copies, self.direction == Direction::CpuToGpu, s)
                }
                CopyMethod::Dma | CopyMethod::Auto => {
                    self.job_fed =
                        self.dma_job(copies, self.direction == Direction::CpuToGpu, s, end)?;
                    Ok(())
                }
                CopyMethod::Loop => {
                    for c in copies {
                        // SAFETY: memory validated by the plan and kept alive by the caller.
                        unsafe { ffi::memcpy_async(c.dst_ptr, c.src_ptr, c.bytes, s) }?;
                    }
                    Ok(())
                }
                CopyMethod::Kernel | CopyMethod::Staged => Ok(()),
            },
        }
    }

    pub(super) fn finish(&mut self, job: InFlight, error: Option<String>) -> JobResult {
        self.device.in_flight[dir_index(self.direction)]
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        let mut seconds = 0.0;
        let mut error = error.or(job.failed);
        if error.is_none() {
            // SAFETY: both events completed (the end event was queried done, and the start event
            // precedes it on the same stream).
            match unsafe { ffi::event_elapsed_ms(job.start.raw(), job.end.raw()) } {
                Ok(ms) => seconds = f64::from(ms) / 1e3,
                Err(e) => error = Some(e.to_string()),
            }
            if let (None, Some(key)) = (&error, job.score) {
                self.scores.record(key, job.method, job.bytes, seconds);
            }
        }
        self.events.push(job.start);
        self.events.push(job.end);
        if let Some(d) = job.desc {
            self.descs.push(d);
        }
        let _ = job.method;
        JobResult {
            job_id: job.job_id,
            success: error.is_none(),
            bytes: job.bytes, // the plan's total, as every engine reports it (JobResult docs)
            seconds,
            direction: job.direction,
            error,
        }
    }

    pub(super) fn check_open(&self) -> Result<()> {
        if self.closed {
            return Err(KvoffError::state("the CUDA engine was shut down"));
        }
        Ok(())
    }
}

impl TransferEngine for CudaEngine {
    /// # Safety
    /// See [`TransferEngine::submit`]: every copy names memory that stays valid until the job is
    /// reported finished; host memory must be device-mapped for the kernel method.
    unsafe fn submit(&mut self, job: Job) -> Result<()> {
        self.check_open()?;
        if job.plan.direction() != self.direction {
            return Err(KvoffError::arg(format!(
                "this engine moves {:?}, the job is {:?}",
                self.direction,
                job.plan.direction()
            )));
        }
        if self.inflight.iter().any(|j| j.job_id == job.job_id) {
            return Err(KvoffError::arg(format!(
                "job id {} is already in flight",
                job.job_id
            )));
        }
        let t_submit = std::time::Instant::now();
        self.last_pack_ns = 0;
        self.submit_grid = 0;
        let _ = ffi::take_call_record();
        self.device.bind()?;
        // A job still being fed keeps the stream: this one is enqueued after it.
        self.collect_feed();
        self.submitting = job.job_id;
        self.job_fed = false;
        self.job_reason = "";
        let start = self.take_event()?;
        let end = match self.take_event() {
            Ok(e) => e,
            Err(e) => {
                self.events.push(start);
                return Err(e);
            }
        };
        let copies = job.plan.copies();
        let bytes = job.plan.total_bytes();
        self.job_serving = self.decide_serving(job.stream);
        // Read only by `auto`'s choice and its split decision: not counted for explicit methods.
        self.job_pitched = if self.cfg.dma_pitched && self.cfg.method == CopyMethod::Auto {
            let avg = bytes / (copies.len().max(1) as u64);
            let min = super::pitched::choice_min_run_bytes(avg);
            super::pitched::pitched_copies(
                copies.len(),
                min,
                |j| copies.get(j).map(|c| (c.src_ptr, c.dst_ptr, c.bytes)),
                &mut super::dma::device_limit(&mut self.alloc_ranges, self.direction),
            )
        } else {
            0
        };
        let (mut method, score, why) = self.choose(copies, bytes);
        self.job_reason = why;
        if let Some(key) = score {
            method = self
                .scores
                .pick(key, method, self.cfg.serving_feedback_every);
        }
        // Beside a model, DMA groups copies into pitched runs only when most of the job forms
        // long runs in emission order (`choice_min_run_bytes`): 4-row runs of 32 KiB pages moved
        // half the bytes of plain batch entries beside a memory-bound kernel (BENCHMARKS.md
        // session 10). The idle policy groups as configured (`dma_pitched`).
        self.job_group_pitched = self.cfg.dma_pitched
            && !(self.job_serving
                && self.cfg.method == CopyMethod::Auto
                && !self.job_mostly_pitched(copies.len()));
        // The serving policy's staged jobs share the device's rate cap (`pace`); an explicit
        // method or the idle policy runs at full speed.
        self.job_staged_cap_mb_s = if self.job_serving && method == CopyMethod::Staged {
            let cap = self.cfg.staged_cap_mb_s(self.device.memory_peak_gbps);
            // Paced only while the device's staged jobs arrive near the cap: a host function
            // costs the job its latency (measured up to ~250 µs beside a GEMM), which jobs well
            // under the cap need not pay.
            if self.device.staged_pacer.note_submit(bytes, cap) {
                cap
            } else {
                0
            }
        } else {
            0
        };
        let (Ok(s), Some(caller_event)) =
            (self.stream(), self.caller_event.as_ref().map(Event::raw))
        else {
            self.events.push(start);
            self.events.push(end);
            return Err(KvoffError::state("the CUDA engine was shut down"));
        };
        let prepared = match self.prepare(method, copies, bytes) {
            Ok(p) => p,
            Err(e) => {
                self.events.push(start);
                self.events.push(end);
                return Err(e);
            }
        };
        let r = (|| {
            if let Some(caller) = job.stream {
                // SAFETY: the caller passes a live stream of this device (the torch shim passes
                // torch.cuda.current_stream()); the event is ours.
                unsafe { ffi::event_record(caller_event, caller as ffi::CUstream) }?;
                // SAFETY: both are live handles of the current context.
                unsafe { ffi::stream_wait(s, caller_event) }?;
            }
            // SAFETY: live events and stream.
            unsafe { ffi::event_record(start.raw(), s) }?;
            self.issue(method, copies, &prepared, end.raw())?;
            if self.job_fed {
                return Ok(()); // the feeder records the end event after the last copy
            }
            // SAFETY: as above.
            unsafe { ffi::event_record(end.raw(), s) }
        })();
        let idx = match method {
            CopyMethod::Kernel => 1,
            CopyMethod::Loop => 2,
            CopyMethod::Staged => 3,
            CopyMethod::Dma | CopyMethod::Auto => usize::from(self.device.batch.is_none()) * 2,
        };
        self.method_counts[idx] += 1;
        self.inflight.push_back(InFlight {
            job_id: job.job_id,
            bytes,
            direction: self.direction,
            start,
            end,
            desc: match prepared {
                Prepared::Kernel { buf, .. } | Prepared::Staged { buf, .. } => Some(buf),
                Prepared::Nothing => None,
            },
            method,
            score,
            failed: r.err().map(|e| e.to_string()),
        });
        self.device.note_submit(self.direction);
        self.last_submit_ns = u64::try_from(t_submit.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let calls = ffi::take_call_record();
        // A staged job's chunks alternate between two streams, so two of its kernels may run at once.
        let concurrent = if method == CopyMethod::Staged
            && staged_chunk_count(bytes, self.cfg.staging_slot_bytes) > 1
        {
            2
        } else {
            1
        };
        let sms = u32::try_from(self.device.sm_count()).unwrap_or(u32::MAX);
        self.last_stats = SubmitStats {
            method: Some(match method {
                CopyMethod::Dma | CopyMethod::Auto if self.device.batch.is_none() => "loop",
                m => m.name(),
            }),
            sms: (self.submit_grid * concurrent).min(sms),
            policy: match (self.cfg.method, self.job_serving) {
                (CopyMethod::Auto, true) => Some("serving"),
                (CopyMethod::Auto, false) => Some("idle"),
                _ => None,
            },
            submit_ns: self.last_submit_ns,
            longest_call_ns: calls.longest_ns,
            longest_call_cpu_ns: calls.longest_cpu_ns,
            driver_calls: calls.calls,
            longest_call: (!calls.longest_name.is_empty()).then_some(calls.longest_name),
            paced_ns: calls.paced_ns,
            fed: self.job_fed,
            reason: (!self.job_reason.is_empty()).then_some(self.job_reason),
            staged_cap_mb_s: self.job_staged_cap_mb_s,
        };
        Ok(())
    }

    fn poll(&mut self) -> Vec<JobResult> {
        let mut out = std::mem::take(&mut self.drained);
        if self.closed {
            return out;
        }
        if self.device.bind().is_err() {
            return out;
        }
        while let Some(front) = self.inflight.front() {
            if self.feeder.as_ref().and_then(|f| f.busy) == Some(front.job_id) {
                match self.feeder.as_mut().and_then(Feeder::try_collect) {
                    Some(done) => self.apply_feed(done),
                    None => break, // still being enqueued
                }
                continue;
            }
            let state = if front.failed.is_some() {
                Ok(true)
            } else {
                // SAFETY: a live pooled event.
                unsafe { ffi::event_done(front.end.raw()) }
            };
            match state {
                Ok(false) => break,
                Ok(true) => {
                    if let Some(job) = self.inflight.pop_front() {
                        out.push(self.finish(job, None));
                    }
                }
                Err(e) => {
                    if let Some(job) = self.inflight.pop_front() {
                        out.push(self.finish(job, Some(e.to_string())));
                    }
                }
            }
        }
        out
    }

    fn wait(&mut self, job_ids: &[i64]) -> Result<()> {
        self.device.bind()?;
        self.collect_feed();
        for j in &self.inflight {
            if j.failed.is_none() && job_ids.contains(&j.job_id) {
                // SAFETY: a live pooled event. Errors surface in the job's result at poll.
                let _ = unsafe { ffi::event_sync(j.end.raw()) };
            }
        }
        Ok(())
    }

    unsafe fn set_compute_streams(&mut self, streams: &[u64]) {
        // SAFETY: the trait method's obligation is the inherent one's.
        unsafe { CudaEngine::set_compute_streams(self, streams) }
    }

    fn last_submit_stats(&self) -> SubmitStats {
        self.last_stats
    }

    fn shutdown(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        if let Err(e) = self.device.bind() {
            self.close_errors.push(e.to_string());
            return;
        }
        // Drain: let in-flight work finish before its resources go (the feeder first: it may still
        // be enqueueing).
        self.collect_feed();
        if let Some(s) = &self.stream {
            // SAFETY: our streams are live.
            if let Err(e) = unsafe { ffi::stream_sync(s.raw()) } {
                self.close_errors.push(e.to_string());
            }
        }
        if let Some(st) = &self.staging {
            // SAFETY: as above.
            if let Err(e) = unsafe { ffi::stream_sync(st.aux.raw()) } {
                self.close_errors.push(e.to_string());
            }
        }
        if let Some(h) = &self.dma_helper {
            // SAFETY: as above.
            if let Err(e) = unsafe { ffi::stream_sync(h.aux.raw()) } {
                self.close_errors.push(e.to_string());
            }
        }
        if let Some(h) = self.dma_helper.take() {
            self.close_errors.extend(
                h.release()
                    .into_iter()
                    .filter_map(|r| r.err().map(|e| e.to_string())),
            );
        }
        if let Some(f) = self.feeder.take() {
            self.close_errors.extend(
                f.release()
                    .into_iter()
                    .filter_map(|r| r.err().map(|e| e.to_string())),
            );
        }
        self.release_staging();
        // Keep the drained jobs' results for `poll` (the TransferEngine contract: shutdown
        // completes in-flight jobs or reports them failed).
        while let Some(job) = self.inflight.pop_front() {
            let err = if job.failed.is_some() {
                None
            } else {
                // SAFETY: a live pooled event; the stream has drained.
                match unsafe { ffi::event_done(job.end.raw()) } {
                    Ok(true) => None,
                    Ok(false) => Some("the job did not finish before shutdown".to_owned()),
                    Err(e) => Some(e.to_string()),
                }
            };
            let r = self.finish(job, err);
            self.drained.push(r);
        }
        // Everything below is unused once the streams drained; each handle is released once.
        let mut errs: Vec<Result<()>> = self.events.drain(..).map(Event::release).collect();
        errs.extend(std::mem::take(&mut self.pace).release());
        for d in self.descs.drain(..) {
            errs.push(d.dev.release());
            errs.push(d.host.release());
        }
        errs.extend(self.caller_event.take().map(Event::release));
        errs.extend(self.stream.take().map(Stream::release));
        self.close_errors.extend(
            errs.into_iter()
                .filter_map(|r| r.err().map(|e| e.to_string())),
        );
    }
}

impl CudaEngine {
    /// Waits for the job the feeder is enqueueing, if any, and notes its result.
    fn collect_feed(&mut self) {
        if let Some(done) = self.feeder.as_mut().and_then(Feeder::collect) {
            self.apply_feed(done);
        }
    }

    /// A fed job whose enqueue failed is reported failed in its turn.
    fn apply_feed(&mut self, (job_id, r): (i64, Result<()>)) {
        if let Err(e) = r {
            if let Some(j) = self.inflight.iter_mut().find(|j| j.job_id == job_id) {
                j.failed.get_or_insert_with(|| e.to_string());
            }
        }
    }

    /// What the feeder thread did for the last job it fed (long DMA jobs are enqueued there,
    /// paced, so that `submit` returns at once): its driver calls and pacing, for the same
    /// "no driver call over 200 µs" accounting as [`SubmitStats`]. `None` before the first.
    #[must_use]
    pub fn last_feed_stats(&self) -> Option<FeedStats> {
        self.feeder.as_ref().and_then(|f| f.last)
    }

    /// Jobs submitted and not yet reported by `poll`.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
