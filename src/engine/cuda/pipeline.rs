//! The GPU side of the `Staged` method: the second stream, the staging slots, and the chunked
//! enqueue (the CPU side, the chunk schedule and packer, is in `staged`).
// Unsafe: driver calls through `ffi` on handles this engine owns (each block says why it is sound).
#![allow(unsafe_code)]

use super::engine::{CudaEngine, JobCtx, Prepared};
use super::feed::{DmaBufs, StagedPack, StagedWork, Work};
use super::ffi;
use super::handles::{DevMem, Event, SendPtr, Stream};
use super::kernel::{DescBuf, DESC_BYTES, KERNEL_CHUNK_BYTES};
use super::share::Polite;
use super::staged::{staged_chunk_count, staged_desc_bound, Slot, StagedChunks, Staging};
use crate::error::{KvoffError, Result};
use crate::plan::{CopyOp, Direction};

impl CudaEngine {
    /// Creates the second stream, the fork/join events and the staging slots on first use.
    pub(super) fn ensure_staging(&mut self) -> Result<()> {
        if self.staging.is_some() {
            return Ok(());
        }
        let slot_bytes = usize::try_from(self.cfg.staging_slot_bytes)
            .map_err(|_| KvoffError::arg("staging_slot_bytes exceeds usize"))?;
        let high = self.direction == Direction::CpuToGpu && !self.cfg.serving();
        // SAFETY: the context is current (callers bind first). On an error below, what was
        // created so far is destroyed by its Drop.
        let aux = unsafe { Stream::new(high) }?;
        // SAFETY: as above.
        let fork = unsafe { Event::new(false) }?;
        // SAFETY: as above.
        let join = unsafe { Event::new(false) }?;
        let mut slots = Vec::with_capacity(self.cfg.staging_slots);
        for _ in 0..self.cfg.staging_slots {
            // SAFETY: as above.
            let dev = unsafe { DevMem::new(slot_bytes) }?;
            slots.push(Slot { dev });
        }
        self.staging = Some(Staging {
            aux,
            fork,
            join,
            slots,
            next: 0,
        });
        Ok(())
    }

    /// Frees the staging resources (its streams must be idle); errors are recorded.
    pub(super) fn release_staging(&mut self) {
        let Some(st) = self.staging.take() else {
            return;
        };
        let mut errs: Vec<Result<()>> = st.slots.into_iter().map(|sl| sl.dev.release()).collect();
        errs.push(st.fork.release());
        errs.push(st.join.release());
        errs.push(st.aux.release());
        self.close_errors.extend(
            errs.into_iter()
                .filter_map(|r| r.err().map(|e| e.to_string())),
        );
    }

    /// CPU side of the `Staged` method (see [`CopyMethod::Staged`]) before the start event: the
    /// staging ring and a pinned descriptor buffer large enough for the whole job. The chunks are
    /// packed at issue time ([`CudaEngine::enqueue_staged`]).
    pub(super) fn prepare_staged(&mut self, copies: &[CopyOp], total: u64) -> Result<Prepared> {
        self.ensure_staging()?;
        let (cap, first_slot) = {
            let st = self
                .staging
                .as_ref()
                .ok_or_else(|| KvoffError::state("staging missing"))?;
            (self.cfg.staging_slot_bytes, st.next)
        };
        let n_chunks = staged_chunk_count(total, cap);
        if n_chunks == 0 {
            return Ok(Prepared::Nothing);
        }
        let nbytes = staged_desc_bound(copies.len(), total, n_chunks)
            .checked_mul(DESC_BYTES)
            .ok_or_else(|| KvoffError::arg("too many copies for one job"))?;
        Ok(Prepared::Staged {
            buf: self.take_desc(nbytes)?,
            n_chunks,
            first_slot,
            total,
        })
    }

    /// Enqueues a staged job on the main stream `s` and the auxiliary stream (forked from `s` and
    /// joined back into it, also after an error, so the job's end event covers both): per chunk,
    /// packs its descriptors straight into the job's pinned buffer (the kernel reads them from
    /// there, through the device mapping of pinned memory), then enqueues the kernel and the
    /// batched DMA of its runs, handing the slot between the streams with events. The device
    /// works on chunk `k` while the CPU packs chunk `k + 1`.
    ///
    /// For `auto`, where the feeder may be used (`dma_feeder`, the batch API), the feeder thread
    /// packs and enqueues the chunks, then joins the streams and records `end` (then
    /// `job.fed`): the caller's thread — in vLLM the model's, between its forwards — spends
    /// neither the packing nor a driver call on them, nor the waits between calls while the
    /// device is polite.
    #[allow(clippy::too_many_arguments)] // the job's context, its parts and the stream
    pub(super) fn enqueue_staged(
        &mut self,
        job: &mut JobCtx,
        copies: &[CopyOp],
        buf: &DescBuf,
        n_chunks: usize,
        first_slot: usize,
        total: u64,
        s: ffi::CUstream,
        end: ffi::CUevent,
    ) -> Result<()> {
        let (aux, fork, join) = {
            let st = self
                .staging
                .as_ref()
                .ok_or_else(|| KvoffError::state("staging missing"))?;
            (st.aux.raw(), st.fork.raw(), st.join.raw())
        };
        if job.staged_cap_mb_s > 0 {
            // Under the serving policy, near the device's cap, the job first waits for its slot
            // in the cap (a host function on the engine's stream: no SM, no wait in `submit`).
            let pacer = std::sync::Arc::clone(&self.device.staged_pacer);
            // SAFETY: live stream of the current context.
            unsafe { pacer.enqueue(s, total, job.staged_cap_mb_s) }?;
        }
        // SAFETY: live handles of the current context.
        unsafe {
            ffi::event_record(fork, s)?;
            ffi::stream_wait(aux, fork)?;
        }
        // `auto`'s staged jobs are fed (the explicit method enqueues on the caller's thread, as
        // the calibration measures it). Beside a model (the serving policy's jobs, or any while
        // the device is polite) the feeder's calls are watched as the caller's were; a job the
        // idle policy chose is fed unwatched: there the caller's own binds and polls beside the
        // feeding thread looked like contention to its few calls (docs/performance.md, "DMA:
        // pitched copies, pacing, the feeder").
        let fed = self.device.batch.is_some()
            && self.cfg.dma_feeder
            && self.cfg.max_queued_copies > 0
            && self.cfg.method == super::CopyMethod::Auto;
        let r = if fed {
            match self.feed_staged(job, buf, n_chunks, first_slot, total, s, aux, join, end) {
                Ok(()) => {
                    // The feeder packs and enqueues the chunks, then joins the streams and
                    // records the end event (also after an error: the job then fails).
                    job.fed = true;
                    return Ok(());
                }
                Err(e) => Err(e),
            }
        } else {
            self.enqueue_staged_chunks(job, copies, buf, n_chunks, first_slot, s, aux)
        };
        // SAFETY: as above.
        let j = unsafe { ffi::event_record(join, aux).and_then(|()| ffi::stream_wait(s, join)) };
        r.and(j)
    }

    /// Hands a staged job to the feeder, which packs its chunks (descriptors into the job's pinned
    /// buffer, the staging leg's DMA runs) and enqueues each as soon as it is packed: the
    /// submitting thread spends neither the packing nor a driver call on them.
    #[allow(clippy::too_many_arguments)] // the job's parts, its streams and events
    fn feed_staged(
        &mut self,
        job: &mut JobCtx,
        buf: &DescBuf,
        n_chunks: usize,
        first_slot: usize,
        total: u64,
        s: ffi::CUstream,
        aux: ffi::CUstream,
        join: ffi::CUevent,
        end: ffi::CUevent,
    ) -> Result<()> {
        let plan = job
            .plan
            .clone()
            .ok_or_else(|| KvoffError::state("a staged job without its plan (a kvoff bug)"))?;
        let slots = self.slot_ptrs()?;
        let d2h = self.direction == Direction::GpuToCpu;
        // Watched (see `enqueue_staged`) only beside a model.
        let watched =
            job.serving || self.device.driver.polite_now() || self.polite(job) == Polite::Always;
        let polite = if watched {
            self.polite(job)
        } else {
            Polite::Off
        };
        // Two kernels (one per stream) may run at once: each gets half the CTA budget. The
        // stats report the grid of a full chunk (the feeder launches the chunks).
        let ctas = (self.cfg.max_ctas / 2).max(1);
        let cap = self.cfg.staging_slot_bytes;
        let n_copies = plan.copies().len().max(1) as u64;
        let piece = (total / n_copies).clamp(1, KERNEL_CHUNK_BYTES);
        job.grid = job.grid.max(self.copy_grid(total.min(cap) / piece, ctas));
        let pack = StagedPack {
            plan,
            words: SendPtr(buf.host.ptr().cast::<u64>()),
            n_words: buf.cap / 8,
            desc_base: buf.host.ptr() as u64,
            slots,
            first_slot,
            n_chunks,
            cap,
            ctas,
            pitched: self.cfg.dma_pitched,
        };
        let kernel = SendPtr(self.copy_kernel());
        let threads = self.cfg.kernel_threads;
        self.feed(job.id, |spare, pace| {
            (
                Work {
                    bufs: DmaBufs::default(),
                    pace,
                    host_to_device: !d2h,
                    stream: SendPtr(s),
                    end: Some(SendPtr(end)),
                    polite,
                    duty_pct: 0,
                    staged: Some(StagedWork {
                        kernel,
                        threads,
                        d2h,
                        pack,
                        aux: SendPtr(aux),
                        join: SendPtr(join),
                    }),
                },
                spare,
            )
        })
    }

    /// Device addresses of the staging slots.
    fn slot_ptrs(&self) -> Result<Vec<u64>> {
        let slots: Vec<u64> = self
            .staging
            .as_ref()
            .ok_or_else(|| KvoffError::state("staging missing"))?
            .slots
            .iter()
            .map(|sl| sl.dev.ptr())
            .collect();
        if slots.is_empty() {
            return Err(KvoffError::state("no staging slots"));
        }
        Ok(slots)
    }

    #[allow(clippy::too_many_arguments)] // the two streams and the job's parts
    pub(super) fn enqueue_staged_chunks(
        &mut self,
        job: &mut JobCtx,
        copies: &[CopyOp],
        buf: &DescBuf,
        n_chunks: usize,
        first_slot: usize,
        s: ffi::CUstream,
        aux: ffi::CUstream,
    ) -> Result<()> {
        let d2h = self.direction == Direction::GpuToCpu;
        let slots = self.slot_ptrs()?;
        // Two kernels (one per stream) may run at once: each gets half the CTA budget.
        let ctas = (self.cfg.max_ctas / 2).max(1);
        // SAFETY: `buf.host` is a pinned allocation of `buf.cap` bytes (8-byte aligned, from
        // cuMemAllocHost) owned by this job and used by nothing else until the job completes;
        // nothing else aliases it while this slice lives. The kernel reads a chunk's descriptors
        // only after they were written here (its launch is enqueued afterwards).
        let words =
            unsafe { std::slice::from_raw_parts_mut(buf.host.ptr().cast::<u64>(), buf.cap / 8) };
        let host_base = buf.host.ptr() as u64;
        // The staging leg groups host runs as configured (the serving policy's rule on pitched
        // runs is about copies over the model's KV tensors, not the staging slots).
        let pitched = self.cfg.dma_pitched;
        let mut runs = std::mem::take(&mut self.scratch_runs);
        let mut chunks = StagedChunks::new(
            copies,
            d2h,
            self.cfg.staging_slot_bytes,
            &slots,
            first_slot,
            n_chunks,
        );
        let mut pack = std::time::Duration::ZERO;
        let r = (|| {
            loop {
                let t = std::time::Instant::now();
                let next = chunks.next_chunk(words, &mut runs)?;
                pack += t.elapsed();
                let Some(c) = next else {
                    return Ok(());
                };
                // Chunks alternate between the two streams: while one stream gathers (scatters)
                // a chunk with the kernel, the other moves its chunk over PCIe, and each stream
                // runs its own chunks strictly in order.
                let st = if c.slot % 2 == 0 { s } else { aux };
                let kdesc = host_base + (c.first_desc * DESC_BYTES) as u64;
                let ndesc = c.n_descs as u64;
                if d2h {
                    self.launch(job, kdesc, ndesc, ctas, st)?;
                    self.dma(runs.iter().copied(), false, pitched, st, self.polite(job))?;
                } else {
                    self.dma(runs.iter().copied(), true, pitched, st, self.polite(job))?;
                    self.launch(job, kdesc, ndesc, ctas, st)?;
                }
            }
        })();
        self.scratch_runs = runs;
        self.last_pack_ns = u64::try_from(pack.as_nanos()).unwrap_or(u64::MAX);
        r
    }
}
