//! Launches of the gather/scatter copy kernel (`kernels/copy.cu`): the descriptor buffers a job
//! takes, its CTA budget, and the launches (short ones under the serving policy, docs/performance.md
//! "Transfers beside compute").
// Unsafe: driver calls through `ffi` on handles this engine owns (each block says why it is sound).
#![allow(unsafe_code)]

use super::engine::{CudaEngine, JobCtx};
use super::ffi;
use super::handles::{DevMem, PinnedHost};
use super::kernel::{DescBuf, DESC_BYTES};
use crate::error::Result;

impl CudaEngine {
    pub(super) fn take_desc(&mut self, bytes: usize) -> Result<DescBuf> {
        if let Some(pos) = self.descs.iter().position(|d| d.cap >= bytes) {
            return Ok(self.descs.swap_remove(pos));
        }
        let cap = bytes.next_power_of_two().max(64 << 10);
        // SAFETY: the context is current (callers bind first). On error, what was allocated
        // is freed by its Drop.
        let host = unsafe { PinnedHost::new(cap) }?;
        // SAFETY: as above.
        let dev = unsafe { DevMem::new(cap) }?;
        Ok(DescBuf { host, dev, cap })
    }

    /// CTAs of a copy-kernel job: `max_ctas`, or under the serving policy `serving_ctas` (or,
    /// when 0, about 1.5 × budget × SMs: 4 CTAs of an H100's 132 SMs at 2%).
    pub(super) fn kernel_ctas(&self, job: &JobCtx) -> u32 {
        match self.cfg.compute_budget_bp {
            _ if !job.serving => self.cfg.max_ctas,
            None => self.cfg.max_ctas,
            Some(_) if self.cfg.serving_ctas > 0 => self.cfg.serving_ctas.min(self.cfg.max_ctas),
            Some(bp) => {
                let sms = u64::try_from(self.device.sm_count()).unwrap_or(1);
                let c = (sms * u64::from(bp) * 3).div_ceil(2 * 10_000);
                u32::try_from(c).unwrap_or(1).clamp(1, self.cfg.max_ctas)
            }
        }
    }

    /// Launches the copy kernel over `n` descriptors at device address `descs` on `s`.
    pub(super) fn launch(
        &mut self,
        job: &mut JobCtx,
        descs: u64,
        n: u64,
        max_ctas: u32,
        s: ffi::CUstream,
    ) -> Result<()> {
        let grid = self.copy_grid(n, max_ctas);
        job.grid = job.grid.max(grid);
        // SAFETY: descriptors live in a device buffer held by the job; they name memory the plan
        // validated and the caller keeps alive (TransferEngine::submit contract), or staging slots
        // owned by this engine.
        let f = self.copy_kernel();
        // SAFETY: as above; both kernels take the same parameters.
        unsafe { ffi::launch_copy(f, grid, self.cfg.kernel_threads, descs, n, s) }
    }

    /// CTAs of a copy kernel over `n` descriptors, at most `max_ctas` (noted as the last launch's).
    pub(super) fn copy_grid(&mut self, n: u64, max_ctas: u32) -> u32 {
        let warps_per_cta = u64::from(self.cfg.kernel_threads / 32);
        let grid = u32::try_from(n.div_ceil(warps_per_cta).min(u64::from(max_ctas)))
            .unwrap_or(1)
            .max(1);
        self.last_ctas = grid;
        grid
    }

    /// The copy kernel this engine launches (`read_only_loads`: the non-coherent-load variant).
    pub(super) fn copy_kernel(&self) -> ffi::CUfunction {
        if self.cfg.read_only_loads {
            self.device.kernel_nc.0
        } else {
            self.device.kernel.0
        }
    }

    /// Uploads descriptors `first..first + n` of a kernel job's pinned buffer to its device buffer
    /// and launches the copy kernel over them.
    pub(super) fn upload_and_launch(
        &mut self,
        job: &mut JobCtx,
        buf: &DescBuf,
        first: usize,
        n: usize,
        s: ffi::CUstream,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let off = first * DESC_BYTES;
        let polite = self.polite(job);
        let gov =
            super::share::Governor::new(&self.device.driver, polite, self.cfg.dma_driver_duty_pct);
        let e = gov.enter();
        // SAFETY: the pinned buffer holds these descriptors and stays untouched until this job
        // completes (it travels with the job; later writes go to other descriptors); the device
        // buffer is as large.
        let up = unsafe {
            ffi::memcpy_htod_async(
                buf.dev.ptr() + off as u64,
                buf.host.ptr().cast::<u8>().add(off).cast(),
                n * DESC_BYTES,
                s,
            )
        };
        // The upload is one small copy call: sampled like a batch of one (`share`).
        gov.leave(e, 1, &mut self.call_base);
        up?;
        let ctas = self.kernel_ctas(job);
        if !job.serving {
            return self.launch(job, buf.dev.ptr() + off as u64, n as u64, ctas, s);
        }
        // Serving policy: launches of at most `serving_launch_bytes` each, so the SMs a launch
        // holds go back to the model's queued CTAs within tens of microseconds.
        let cap = buf.cap / DESC_BYTES;
        // SAFETY: `buf.host` is the job's pinned allocation of `buf.cap` bytes (8-byte aligned);
        // descriptors `first..first + n` were written before this call and are only read here.
        let words = unsafe { std::slice::from_raw_parts(buf.host.ptr().cast::<u64>(), cap * 3) };
        let limit = self.cfg.serving_launch_bytes.max(1);
        let (mut i, end) = (first, first + n);
        while i < end {
            let (mut j, mut bytes) = (i, 0u64);
            while j < end && (j == i || bytes < limit) {
                bytes += words.get(j * 3 + 2).copied().unwrap_or(0);
                j += 1;
            }
            self.launch(
                job,
                buf.dev.ptr() + (i * DESC_BYTES) as u64,
                (j - i) as u64,
                ctas,
                s,
            )?;
            i = j;
        }
        Ok(())
    }
}
