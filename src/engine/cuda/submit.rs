//! What the engine does with a job: `submit` (decide the policy and method, prepare, enqueue
//! between the timing events), `poll`, `wait` and `shutdown` ([`TransferEngine`]).
// Unsafe: driver calls through `ffi` on handles this engine owns (each block says why it is sound).
#![allow(unsafe_code)]

use super::config::CopyMethod;
use super::device::dir_index;
use super::engine::{CudaEngine, InFlight, JobCtx, Prepared};
use super::feed::{device_limit, FeedStats, Feeder};
use super::ffi;
use super::handles::{Event, Stream};
use super::kernel::{write_kernel_descs, DESC_BYTES, KERNEL_CHUNK_BYTES, KERNEL_HEAD_COPIES};
use super::pitched::{choice_min_run_bytes, pitched_copies_until};
use super::staged::staged_chunk_count;
use super::telemetry;
use crate::engine::{Job, JobResult, SubmitStats, TransferEngine};
use crate::error::{KvoffError, Result};
use crate::plan::{CopyOp, Direction};

impl CudaEngine {
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
        job: &mut JobCtx,
        method: CopyMethod,
        copies: &[CopyOp],
        prep: &Prepared,
        end: ffi::CUevent,
    ) -> Result<()> {
        let s = self.stream()?;
        match prep {
            Prepared::Kernel { buf, head, head_n } => {
                self.upload_and_launch(job, buf, 0, *head_n, s)?;
                if *head < copies.len() {
                    let t = std::time::Instant::now();
                    let tail_n = write_kernel_descs(&copies[*head..], buf, *head_n)?;
                    self.last_pack_ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    self.upload_and_launch(job, buf, *head_n, tail_n, s)?;
                }
                Ok(())
            }
            Prepared::Staged {
                buf,
                n_chunks,
                first_slot,
                total,
            } => {
                let r =
                    self.enqueue_staged(job, copies, buf, *n_chunks, *first_slot, *total, s, end);
                if let Some(st) = self.staging.as_mut() {
                    st.next = (first_slot + n_chunks) % st.slots.len().max(1);
                }
                r
            }
            Prepared::Nothing => match method {
                CopyMethod::Dma | CopyMethod::Auto if self.splits_dma(job, copies.len()) => {
                    self.dma_split(job, copies, self.direction == Direction::CpuToGpu, s)
                }
                CopyMethod::Dma | CopyMethod::Auto => {
                    job.fed =
                        self.dma_job(job, copies, self.direction == Direction::CpuToGpu, s, end)?;
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

    fn finish(&mut self, job: InFlight, error: Option<String>) -> JobResult {
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
        JobResult {
            job_id: job.job_id,
            success: error.is_none(),
            bytes: job.bytes, // the plan's total, as every engine reports it (JobResult docs)
            seconds,
            direction: job.direction,
            error,
        }
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
        let _ = telemetry::take_call_record();
        self.device.bind()?;
        // A job still being fed keeps the stream: this one is enqueued after it.
        self.collect_feed();
        let mut ctx = JobCtx::new(job.job_id);
        let start = self.take_event()?;
        let end = match self.take_event() {
            Ok(e) => e,
            Err(e) => {
                self.events.push(start);
                return Err(e);
            }
        };
        // Shared with the feeder when it packs the job (a staged job of `auto`).
        let plan = std::sync::Arc::new(job.plan);
        ctx.plan = Some(std::sync::Arc::clone(&plan));
        let copies = plan.copies();
        let bytes = plan.total_bytes();
        ctx.serving = match &job.after {
            Some(m) => self.decide_serving(None, Some(m.raw_event() as ffi::CUevent)),
            None => self.decide_serving(job.stream, None),
        };
        // Read only by `auto`'s choice and its split decision: not counted for explicit methods.
        ctx.pitched = if self.cfg.dma_pitched && self.cfg.method == CopyMethod::Auto {
            let avg = bytes / (copies.len().max(1) as u64);
            let min = choice_min_run_bytes(avg);
            pitched_copies_until(
                copies.len(),
                min,
                copies.len().div_ceil(2), // all that `mostly_pitched` asks
                |j| copies.get(j).map(|c| (c.src_ptr, c.dst_ptr, c.bytes)),
                &mut device_limit(&mut self.alloc_ranges, self.direction),
            )
        } else {
            0
        };
        let (mut method, score, why) = self.choose(&ctx, copies, bytes);
        ctx.reason = why;
        if let Some(key) = score {
            method = self
                .scores
                .pick(key, method, self.cfg.serving_feedback_every);
        }
        // Beside a model, DMA groups copies into pitched runs only when most of the job forms
        // long runs in emission order (`choice_min_run_bytes`): 4-row runs of 32 KiB pages moved
        // half the bytes of plain batch entries beside a memory-bound kernel (docs/performance.md,
        // "Transfers beside compute"). The idle policy groups as configured (`dma_pitched`).
        ctx.group_pitched = self.cfg.dma_pitched
            && !(ctx.serving
                && self.cfg.method == CopyMethod::Auto
                && !ctx.mostly_pitched(self.cfg.dma_pitched, copies.len()));
        // The serving policy's staged jobs share the device's rate cap (`pace`); an explicit
        // method or the idle policy runs at full speed.
        ctx.staged_cap_mb_s = if ctx.serving && method == CopyMethod::Staged {
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
            if let Some(mark) = &job.after {
                // SAFETY: a live event recorded by this engine's marker (`Job::after`), held by
                // the job until the wait is enqueued; the stream is ours.
                unsafe { ffi::stream_wait(s, mark.raw_event() as ffi::CUevent) }?;
            } else if let Some(caller) = job.stream {
                // SAFETY: the caller passes a live stream of this device (the torch shim passes
                // torch.cuda.current_stream()); the event is ours.
                unsafe { ffi::event_record(caller_event, caller as ffi::CUstream) }?;
                // SAFETY: both are live handles of the current context.
                unsafe { ffi::stream_wait(s, caller_event) }?;
            }
            // SAFETY: live events and stream.
            unsafe { ffi::event_record(start.raw(), s) }?;
            self.issue(&mut ctx, method, copies, &prepared, end.raw())?;
            if ctx.fed {
                return Ok(()); // the feeder records the end event after the last copy
            }
            // SAFETY: as above.
            unsafe { ffi::event_record(end.raw(), s) }
        })();
        self.method_counts.add(match method {
            CopyMethod::Dma | CopyMethod::Auto if self.device.batch.is_none() => CopyMethod::Loop,
            m => m,
        });
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
        let calls = telemetry::take_call_record();
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
            sms: (ctx.grid * concurrent).min(sms),
            policy: match (self.cfg.method, ctx.serving) {
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
            fed: ctx.fed,
            reason: (!ctx.reason.is_empty()).then_some(ctx.reason),
            staged_cap_mb_s: ctx.staged_cap_mb_s,
            polite: match self.polite(&ctx) {
                super::share::Polite::Always => true,
                super::share::Polite::Auto => self.device.driver.polite_now(),
                super::share::Polite::Off | super::share::Polite::Watch => false,
            },
            driver_contention: self.device.driver.contention(),
            driver_blocked: self.device.driver.blocked_histogram(),
        };
        Ok(())
    }

    fn stream_marks(&self) -> Option<std::sync::Arc<dyn crate::engine::StreamMarks>> {
        if self.closed {
            return None;
        }
        let m: std::sync::Arc<dyn crate::engine::StreamMarks> = self.marks.clone();
        Some(m)
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
                // Errors surface in the job's result at poll.
                let _ = wait_event(j.end.raw());
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
        errs.extend(self.marks.release());
        errs.extend(self.stream.take().map(Stream::release));
        self.close_errors.extend(
            errs.into_iter()
                .filter_map(|r| r.err().map(|e| e.to_string())),
        );
    }
}

/// Waits for `e` by querying it with sleeps between the queries, not in `cuEventSynchronize`: a
/// synchronize on a spin-waiting event keeps the waiting thread in the driver, and an eager model's
/// launches from another thread waited for it (docs/performance.md, "Transfers beside an eager
/// model": an H200 decode step +30% with a side thread in `wait`, +2% with it polling).
fn wait_event(e: ffi::CUevent) -> Result<()> {
    let mut polls = 0u32;
    // SAFETY: callers pass a live pooled event; a query has no effect on it.
    while !unsafe { ffi::event_done(e) }? {
        polls = polls.saturating_add(1);
        if polls < 3 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }
    Ok(())
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
