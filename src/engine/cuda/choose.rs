//! Method choice of `Auto`: the serving policy (what the model can afford beside the transfer)
//! and the idle-GPU policy (calibrated per device, see `calibrate`).
#![forbid(unsafe_code)]

use super::engine::CudaEngine;
use super::{CopyMethod, STAGED_MIN_JOB_BYTES};
use crate::plan::{CopyOp, Direction};

/// Whether a sighting of the model computing at `last` µs (0 = never) lies within `window_us` of
/// `now` µs. A window of 0 means "the model is always assumed busy" (the serving policy always).
pub(super) fn busy_within(last: u64, now: u64, window_us: u64) -> bool {
    if window_us == 0 {
        return true;
    }
    last != 0 && now.saturating_sub(last) < window_us
}

/// Number of host-contiguous runs of a job, in emission order (O(n), no allocation): a run
/// continues while each copy's host address follows the previous copy's end. kvoff's planner emits
/// copies block-major, so one CPU block's pages of all tensors form one run.
pub(super) fn host_runs(direction: Direction, copies: &[CopyOp]) -> u64 {
    let d2h = direction == Direction::GpuToCpu;
    let mut runs = 0;
    let mut end = u64::MAX;
    for c in copies {
        let a = if d2h { c.dst_ptr } else { c.src_ptr };
        if a != end {
            runs += 1;
        }
        end = a + c.bytes;
    }
    runs
}

impl CudaEngine {
    pub(super) fn choose(&self, copies: &[CopyOp], bytes: u64) -> CopyMethod {
        match self.cfg.method {
            CopyMethod::Auto if self.job_serving => {
                // Beside a model (measured on an H100 beside a bf16 GEMM and a 1 GiB device copy,
                // BENCHMARKS.md "Transfers beside compute"): batched DMA uses no SMs and moves
                // copies of ≥ 32 KiB efficiently (2–3× staging's GB/s there, slowdown within
                // noise); smaller copies go through the staged pipeline, whose pack kernel runs
                // device-to-device in short launches and whose PCIe leg is large DMAs (3–6× plain
                // DMA beside a GEMM at 4 KiB pages, within the budget). The copy kernel over mapped
                // host memory holds its SMs for the whole job (+10–85% on a GEMM) and is not used.
                let avg = bytes / (copies.len().max(1) as u64);
                if !self.cfg.host_mapped || avg >= self.cfg.serving_dma_min_copy_bytes {
                    CopyMethod::Dma
                } else if self.cfg.serving_small_kernel {
                    CopyMethod::Kernel
                } else if self.cfg.serving_store_dma_beside_loads
                    && self.direction == Direction::GpuToCpu
                    && bytes >= self.cfg.serving_store_dma_min_job_bytes
                    && self.device.other_direction_active(self.direction)
                {
                    // Staging both ways at once with large jobs moves 33–42 GB/s beside a GEMM but
                    // its pack kernels' HBM traffic costs a memory-bound model 5.6–7% (over the 5%
                    // budget). Loads are what a request waits for, so they keep the staged pipeline
                    // and large stores, which nothing waits for, fall back to DMA while loads are
                    // active. Jobs of a few MiB (what a serving step stores) stay staged: there
                    // the pair cost under 2% and DMA would move a third as much at 4 KiB copies.
                    CopyMethod::Dma
                } else {
                    CopyMethod::Staged
                }
            }
            CopyMethod::Auto => {
                let avg = bytes / (copies.len().max(1) as u64);
                if !self.cfg.host_mapped || avg >= self.cfg.dma_min_avg_copy_bytes {
                    return CopyMethod::Dma;
                }
                // Measured on an H200 (BENCHMARKS.md): with 64 × 4 KiB pages per block (256 KiB
                // runs) the kernel wins for stores (92% vs 85% of the link) and staging wins for
                // loads (90% vs 89%); from 1 MiB runs staging wins both ways, and it is the only
                // method that keeps ≥ 95 GB/s when stores and loads run together.
                // When the other direction is busy, staging both ways is the best pair from 256 KiB
                // runs (82–99 GB/s total vs 58–75 for any pair with the kernel).
                let other_busy = self.device.other_direction_active(self.direction);
                let runs = host_runs(self.direction, copies);
                // The staged pipeline needs a few chunks to overlap its two stages (measured from
                // 32 MiB jobs; below, the kernel or DMA is as fast).
                let run_for_staging = if bytes >= STAGED_MIN_JOB_BYTES {
                    bytes / runs.max(1)
                } else {
                    0
                };
                if let Some(m) = self.calibration.as_ref().and_then(|c| {
                    c.choose(
                        self.direction,
                        avg,
                        run_for_staging,
                        self.cfg.host_mapped,
                        other_busy,
                    )
                }) {
                    return m;
                }
                let min_run = match self.direction {
                    _ if other_busy => self.cfg.staged_min_run_bytes_load,
                    Direction::GpuToCpu => self.cfg.staged_min_run_bytes,
                    Direction::CpuToGpu => self.cfg.staged_min_run_bytes_load,
                };
                if runs > 0 && bytes / runs >= min_run {
                    CopyMethod::Staged
                } else {
                    CopyMethod::Kernel
                }
            }
            m => m,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::busy_within;

    #[test]
    fn busy_window() {
        assert!(!busy_within(0, 5, 100), "never seen: idle");
        assert!(busy_within(10, 50, 100));
        assert!(
            !busy_within(10, 110, 100),
            "the window is open on the right"
        );
        assert!(busy_within(10, 5, 100), "a clock read before the sighting");
        assert!(busy_within(0, 1 << 40, 0), "window 0: always busy");
    }
}
