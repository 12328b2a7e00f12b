//! Batched DMA (`cuMemcpyBatchAsync`, split so that no call holds the driver long), or a
//! per-copy loop where the driver lacks the batch API.
// Unsafe: driver calls through `ffi` on handles this engine owns (each block says why it is sound).
#![allow(unsafe_code)]

use super::engine::CudaEngine;
use super::ffi;
use crate::error::Result;

impl CudaEngine {
    /// Batched DMA of `(src, dst, bytes)` triples on `s` (a per-copy loop without the batch API).
    pub(super) fn dma(
        &mut self,
        runs: impl Iterator<Item = (u64, u64, u64)> + Clone,
        host_to_device: bool,
        s: ffi::CUstream,
    ) -> Result<()> {
        if let Some(f) = self.device.batch {
            let (mut srcs, mut dsts, mut sizes) = std::mem::take(&mut self.scratch_dma);
            srcs.clear();
            dsts.clear();
            sizes.clear();
            for (src, dst, n) in runs {
                srcs.push(src);
                dsts.push(dst);
                sizes.push(usize::try_from(n).unwrap_or(usize::MAX));
            }
            let r = if sizes.is_empty() {
                Ok(())
            } else {
                // Split so that no call holds the driver for long (32768 copies in one call take
                // ~100 ms of CPU, stalling every other thread's launches meanwhile).
                let step = match self.cfg.max_batch_copies {
                    0 => sizes.len(),
                    n => n,
                };
                let mut r = Ok(());
                for ((d, sr), sz) in dsts
                    .chunks_mut(step)
                    .zip(srcs.chunks_mut(step))
                    .zip(sizes.chunks_mut(step))
                {
                    // SAFETY: co-indexed arrays; memory validated by the plan (or staging owned
                    // by this engine) and kept alive until the job completes; `s` is a created
                    // stream.
                    r = unsafe { ffi::memcpy_batch(f, d, sr, sz, host_to_device, s) };
                    if r.is_err() {
                        break;
                    }
                }
                r
            };
            self.scratch_dma = (srcs, dsts, sizes);
            r
        } else {
            for (src, dst, n) in runs {
                // SAFETY: as above.
                unsafe { ffi::memcpy_async(dst, src, n, s) }?;
            }
            Ok(())
        }
    }
}
