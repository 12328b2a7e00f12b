//! The DMA of a job (docs/performance.md, "How kvoff moves bytes"): batched (`cuMemcpyBatchAsync`),
//! with pitched runs (see `pitched`), split over two threads (`DmaHelper`) or handed to the feeder
//! thread (`Feeder`); a per-copy loop where the driver lacks the batch API. The threads, buffers
//! and pacing are in `feed`.
// Unsafe: driver calls through `ffi` on handles this engine owns (each block says why it is sound).
#![allow(unsafe_code)]

use super::engine::{CudaEngine, JobCtx};
use super::feed::{device_limit, enqueue_batches, DmaBufs, DmaHelper, Feeder, Pace, Work};
use super::ffi;
use super::handles::SendPtr;
use super::share::{Governor, Polite};
use super::telemetry;
use crate::error::{KvoffError, Result};
use crate::plan::CopyOp;

impl CudaEngine {
    /// The DMA of a whole job on `s`: a job of more pacing units than
    /// [`CudaEngineConfig::max_queued_copies`] goes to the feeder thread, which also records the
    /// job's `end` event (then `Ok(true)`); else enqueued here (`Ok(false)`: the caller records it).
    ///
    /// [`CudaEngineConfig::max_queued_copies`]: super::CudaEngineConfig::max_queued_copies
    pub(super) fn dma_job(
        &mut self,
        job: &JobCtx,
        copies: &[CopyOp],
        host_to_device: bool,
        s: ffi::CUstream,
        end: ffi::CUevent,
    ) -> Result<bool> {
        let bound = self.cfg.max_queued_copies;
        let Some(f) = self
            .device
            .batch
            .filter(|_| bound > 0 && self.cfg.dma_feeder)
        else {
            self.dma(
                copies.iter().map(|c| (c.src_ptr, c.dst_ptr, c.bytes)),
                host_to_device,
                job.group_pitched,
                s,
                self.polite(job),
            )?;
            return Ok(false);
        };
        let mut bufs = std::mem::take(&mut self.scratch_dma);
        bufs.fill(
            copies.iter().map(|c| (c.src_ptr, c.dst_ptr, c.bytes)),
            job.group_pitched,
            &mut device_limit(&mut self.alloc_ranges, self.direction),
        );
        if bufs.units() <= bound
            && !(self.device.driver.polite_now() && self.polite(job) != Polite::Off)
        {
            // Short enough to queue at once: enqueued here, unpaced. (Not while polite: the
            // waits between polite calls would be spent on the caller's thread, in vLLM the
            // model's.)
            let mut p = std::mem::take(&mut self.pace);
            // SAFETY: memory validated by the plan, alive until the job completes; `s` is a
            // created stream; submit binds first.
            let r = unsafe {
                enqueue_batches(
                    f,
                    &mut bufs,
                    self.cfg.max_batch_copies,
                    host_to_device,
                    s,
                    &mut p,
                    bound,
                    &Governor::new(
                        &self.device.driver,
                        self.polite(job),
                        self.cfg.dma_driver_duty_pct,
                    ),
                )
            };
            self.pace = p;
            self.scratch_dma = bufs;
            return r.map(|()| false);
        }
        let polite = self.polite(job);
        self.feed(job.id, |spare, pace| {
            (
                Work {
                    bufs,
                    pace,
                    host_to_device,
                    stream: SendPtr(s),
                    end: Some(SendPtr(end)),
                    polite,
                    duty_pct: 0,
                    staged: None,
                },
                spare,
            )
        })?;
        Ok(true)
    }

    /// Hands job `job_id`'s work to the feeder thread (started on first use), which enqueues it
    /// and records the end event the work names; `make` gets the feeder's spare DMA buffers and
    /// pacing events and returns the work and the buffers this engine keeps as its scratch.
    pub(super) fn feed(
        &mut self,
        job_id: i64,
        make: impl FnOnce(DmaBufs, Pace) -> (Work, DmaBufs),
    ) -> Result<()> {
        let bound = self.cfg.max_queued_copies;
        if self.feeder.is_none() {
            self.feeder = Some(Feeder::new(&self.device, self.cfg.max_batch_copies, bound)?);
        }
        let duty_pct = self.cfg.dma_driver_duty_pct;
        let fd = self
            .feeder
            .as_mut()
            .ok_or_else(|| KvoffError::state("DMA feeder missing"))?;
        let (spare, pace) = fd.spare.take().unwrap_or_default();
        let (mut work, scratch) = make(spare, pace);
        work.duty_pct = duty_pct;
        self.scratch_dma = scratch;
        let tx = fd
            .worker
            .tx
            .as_ref()
            .ok_or_else(|| KvoffError::state("the DMA feeder thread stopped"))?;
        tx.send(work)
            .map_err(|_| KvoffError::state("the DMA feeder thread stopped"))?;
        fd.busy = Some(job_id);
        Ok(())
    }

    /// Batched DMA of `(src, dst, bytes)` triples on `s` (a per-copy loop without the batch API),
    /// grouping regular runs into pitched copies when `pitched`.
    pub(super) fn dma(
        &mut self,
        runs: impl Iterator<Item = (u64, u64, u64)> + Clone,
        host_to_device: bool,
        pitched: bool,
        s: ffi::CUstream,
        polite: Polite,
    ) -> Result<()> {
        if let Some(f) = self.device.batch {
            let mut bufs = std::mem::take(&mut self.scratch_dma);
            let mut pace = std::mem::take(&mut self.pace);
            bufs.fill(
                runs,
                pitched,
                &mut device_limit(&mut self.alloc_ranges, self.direction),
            );
            // SAFETY: memory validated by the plan (or staging owned by this engine) and kept
            // alive until the job completes; `s` is a created stream; callers bind first.
            let r = unsafe {
                enqueue_batches(
                    f,
                    &mut bufs,
                    self.cfg.max_batch_copies,
                    host_to_device,
                    s,
                    &mut pace,
                    self.cfg.max_queued_copies,
                    &Governor::new(&self.device.driver, polite, self.cfg.dma_driver_duty_pct),
                )
            };
            self.scratch_dma = bufs;
            self.pace = pace;
            r
        } else {
            for (src, dst, n) in runs {
                // SAFETY: as above.
                unsafe { ffi::memcpy_async(dst, src, n, s) }?;
            }
            Ok(())
        }
    }

    /// Whether `job`'s copy calls may turn polite (`share`): the `auto` method's, unless
    /// `KVOFF_CUDA_TUNE` forces it (`polite`); an explicit method runs as configured.
    pub(super) fn polite(&self, _job: &JobCtx) -> Polite {
        match self.cfg.polite {
            // `auto` under either policy: a GPU taken for idle because no stream of the model
            // was given to watch may still have a model launching beside it (the contention
            // then also makes the serving policy decide: `decide_serving`).
            Polite::Auto if self.cfg.method == super::CopyMethod::Auto => Polite::Auto,
            Polite::Auto => Polite::Off,
            m => m,
        }
    }

    /// Whether a DMA job of `n` copies is enqueued by two threads on two streams.
    /// (Not when most of the job goes as pitched copies: those cost the CPU little. Nor beside a
    /// model while the other direction runs: the link beside the model, not one thread's driver
    /// calls, limits each direction there, and four DMA streams moved less than two — on an H100,
    /// 32 KiB × 128 MiB jobs both ways, per-layer tensors: 33.6 / 29.7 GB/s beside a GEMM / a
    /// memory-bound kernel split, 37.3 / 33.9 not; 36.2 / 30.8 against 37.9 / 42.7 in another run.)
    pub(super) fn splits_dma(&self, job: &JobCtx, n: usize) -> bool {
        self.cfg.method == super::CopyMethod::Auto
            && self.cfg.dma_split_min_copies > 0
            && n >= self.cfg.dma_split_min_copies
            && self.device.batch.is_some()
            && !job.mostly_pitched(self.cfg.dma_pitched, n)
            && !(job.serving && self.device.other_direction_active(self.direction))
            // While polite the driver's share, not one thread's calls, bounds the rate; and the
            // caller's half would be paced on the caller's thread (the model's, in vLLM).
            && !self.device.driver.polite_now()
    }

    /// A DMA job enqueued in two halves at once: the second by the helper thread on its stream
    /// (forked from `s`, joined back into it, also after an error, so the job's end event covers
    /// both), the first by the caller on `s`.
    pub(super) fn dma_split(
        &mut self,
        job: &JobCtx,
        copies: &[CopyOp],
        host_to_device: bool,
        s: ffi::CUstream,
    ) -> Result<()> {
        if self.dma_helper.is_none() {
            let high = self.direction == crate::plan::Direction::CpuToGpu && !self.cfg.serving();
            // SAFETY: the context is current (submit binds first).
            self.dma_helper = Some(unsafe {
                DmaHelper::new(
                    &self.device,
                    self.cfg.max_batch_copies,
                    self.cfg.max_queued_copies,
                    high,
                )
            }?);
        }
        let polite = self.polite(job);
        let h = self
            .dma_helper
            .as_mut()
            .ok_or_else(|| KvoffError::state("DMA helper missing"))?;
        let (aux, fork, join) = (h.aux.raw(), h.fork.raw(), h.join.raw());
        let mut bufs = h.spare.take().unwrap_or_default();
        let pace = h.pace.take().unwrap_or_default();
        let half = copies.len() / 2;
        bufs.fill(
            copies[half..]
                .iter()
                .map(|c| (c.src_ptr, c.dst_ptr, c.bytes)),
            job.group_pitched,
            &mut device_limit(&mut self.alloc_ranges, self.direction),
        );
        // SAFETY: live handles of the current context.
        unsafe {
            ffi::event_record(fork, s)?;
            ffi::stream_wait(aux, fork)?;
        }
        let sent = h
            .worker
            .tx
            .as_ref()
            .ok_or_else(|| KvoffError::state("the DMA helper thread stopped"))?
            .send(Work {
                bufs,
                pace,
                host_to_device,
                stream: SendPtr(aux),
                end: None,
                polite,
                duty_pct: self.cfg.dma_driver_duty_pct,
                staged: None,
            })
            .map_err(|_| KvoffError::state("the DMA helper thread stopped"));
        let mine = sent.and_then(|()| {
            self.dma(
                copies[..half]
                    .iter()
                    .map(|c| (c.src_ptr, c.dst_ptr, c.bytes)),
                host_to_device,
                job.group_pitched,
                s,
                self.polite(job),
            )
        });
        let h = self
            .dma_helper
            .as_mut()
            .ok_or_else(|| KvoffError::state("DMA helper missing"))?;
        // Wait for the helper's half (with the GIL released by the bindings): the join event
        // must follow everything it enqueued.
        let theirs = match h.rx.recv() {
            Ok((r, calls, bufs, pace)) => {
                h.spare = Some(bufs);
                h.pace = Some(pace);
                telemetry::add_call_record(calls);
                r
            }
            Err(_) => Err(KvoffError::state("the DMA helper thread stopped")),
        };
        // SAFETY: live handles of the current context.
        let j = unsafe { ffi::event_record(join, aux).and_then(|()| ffi::stream_wait(s, join)) };
        mine.and(theirs).and(j)
    }
}
