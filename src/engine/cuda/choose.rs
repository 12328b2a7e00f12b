//! Method choice of `Auto`: the serving policy (what the model can afford beside the transfer)
//! and the idle-GPU policy (calibrated per device, see `calibrate`).
#![forbid(unsafe_code)]

use super::config::{CopyMethod, CudaEngineConfig};
use super::engine::{CudaEngine, JobCtx};
use super::scores::ScoreKey;
use super::staged::STAGED_MIN_JOB_BYTES;
use crate::plan::{CopyOp, Direction};

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

/// What the serving policy looks at in a job.
#[derive(Clone, Copy, Debug)]
pub(super) struct ServingJob {
    /// Average bytes per copy.
    pub(super) avg_copy: u64,
    /// Bytes of the job.
    pub(super) bytes: u64,
    /// At least half of the copies form pitched runs within one device allocation, each of at least
    /// [`choice_min_run_bytes`](super::pitched::choice_min_run_bytes) (64 KiB and 16 rows).
    pub(super) mostly_pitched: bool,
    /// The engine of the other direction submitted or has jobs in flight (within 50 ms).
    pub(super) other_busy: bool,
    /// GPU → host.
    pub(super) store: bool,
}

/// The serving policy's rule: the method, the feedback cell when the feedback may override it,
/// and which rule decided. Pure (unit-tested against a scenario table below).
///
/// Beside a model (measured on an H100 beside a bf16 GEMM and a 1 GiB device copy; docs/performance.md
/// "How `auto` chooses a copy method"): batched DMA uses no SMs and moves copies of ≥ 32 KiB efficiently
/// (2–3× staging's GB/s there, slowdown within noise); smaller copies go through the staged
/// pipeline, whose pack kernel runs device-to-device in short launches and whose PCIe leg is large
/// DMAs (3–6× plain DMA beside a GEMM at 4 KiB pages, within the budget). The copy kernel over
/// mapped host memory holds its SMs for the whole job (+10–85% on a GEMM) and is not used.
pub(super) fn serving_choice(
    cfg: &CudaEngineConfig,
    job: ServingJob,
) -> (CopyMethod, Option<ScoreKey>, &'static str) {
    let ServingJob {
        avg_copy: avg,
        bytes,
        mostly_pitched,
        other_busy,
        store,
    } = job;
    let small = cfg.host_mapped && avg < cfg.serving_dma_min_copy_bytes;
    if small && mostly_pitched && !other_busy && cfg.serving_feedback_every > 0 {
        // Pitched runs (a block's pages across evenly spaced tensors, …) move by DMA with no SMs
        // and one pass over HBM: 27–29 GB/s at 4 KiB pages beside a GEMM where staging moves 22.
        // Beside a memory-bound kernel the order flips (DMA 18, staging 26.6 within the budget,
        // 4 KiB × 128 MiB stores on an H100), so while one direction runs the feedback measures
        // both, DMA first.
        let key = ScoreKey::new(avg, bytes, other_busy).pitched();
        return (
            CopyMethod::Dma,
            Some(key),
            "serving: pitched runs, feedback",
        );
    }
    let (m, why) = if !small {
        (CopyMethod::Dma, "serving: large copies")
    } else if mostly_pitched {
        // Pitched runs move by DMA (above); both directions at once too.
        (CopyMethod::Dma, "serving: pitched runs")
    } else if cfg.serving_small_kernel {
        (CopyMethod::Kernel, "serving: small-copy kernel")
    } else if cfg.serving_store_dma_beside_loads
        && store
        && bytes >= cfg.serving_store_dma_min_job_bytes
        && other_busy
    {
        // Off by default: with small copies that are not pitched, DMA moves 4–7 GB/s, and
        // staging both ways stays within the budget (docs/performance.md). When on, large
        // stores, which nothing waits for, leave the HBM to the loads' pipeline.
        (CopyMethod::Dma, "serving: stores beside loads")
    } else {
        // Both DMA and staging are within the budget here; which moves more depends on the
        // model's load and the machine, so the feedback decides (`Scores`) — while this direction
        // runs alone. With loads and stores at once each engine would only see its own rate:
        // measured on an H100 (4 KiB × 8 MiB, both directions beside a GEMM / a memory-bound
        // kernel), per-direction feedback moved 9.9–10.6 / 8.0–10.0 GB/s in all where staging
        // both ways moved 11.2 / 11.6, so the pair keeps the rule.
        let key = (cfg.serving_feedback_every > 0 && !other_busy)
            .then(|| ScoreKey::new(avg, bytes, false));
        let why = if key.is_some() {
            "serving: small copies, feedback"
        } else {
            "serving: small copies"
        };
        return (CopyMethod::Staged, key, why);
    };
    (m, None, why)
}

impl CudaEngine {
    /// The method for a job, and — when the serving policy chose between batched DMA and the
    /// staged pipeline by speed alone (small copies) — the feedback cell it belongs to.
    /// The third value says which rule decided (reported in [`SubmitStats::reason`]).
    ///
    /// [`SubmitStats::reason`]: crate::engine::SubmitStats::reason
    pub(super) fn choose(
        &self,
        job: &JobCtx,
        copies: &[CopyOp],
        bytes: u64,
    ) -> (CopyMethod, Option<ScoreKey>, &'static str) {
        let (m, why) = match self.cfg.method {
            CopyMethod::Auto if job.serving => {
                let sj = ServingJob {
                    avg_copy: bytes / (copies.len().max(1) as u64),
                    bytes,
                    mostly_pitched: job.mostly_pitched(self.cfg.dma_pitched, copies.len()),
                    other_busy: self.device.other_direction_active(self.direction),
                    store: self.direction == Direction::GpuToCpu,
                };
                return serving_choice(&self.cfg, sj);
            }
            CopyMethod::Auto => {
                let avg = bytes / (copies.len().max(1) as u64);
                if !self.cfg.host_mapped {
                    return (CopyMethod::Dma, None, "idle: host memory not mapped");
                }
                if avg >= self.cfg.dma_min_avg_copy_bytes {
                    return (CopyMethod::Dma, None, "idle: large copies");
                }
                // Measured on an H200 (docs/performance.md): with 64 × 4 KiB pages per block (256 KiB
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
                    return (m, None, "idle: calibration");
                }
                let min_run = match self.direction {
                    _ if other_busy => self.cfg.staged_min_run_bytes_load,
                    Direction::GpuToCpu => self.cfg.staged_min_run_bytes,
                    Direction::CpuToGpu => self.cfg.staged_min_run_bytes_load,
                };
                if runs > 0 && bytes / runs >= min_run {
                    (CopyMethod::Staged, "idle: long host runs")
                } else {
                    (CopyMethod::Kernel, "idle: short host runs")
                }
            }
            m => (m, "explicit method"),
        };
        (m, None, why)
    }
}

#[cfg(test)]
mod tests {
    use super::{serving_choice, CopyMethod, CudaEngineConfig, ServingJob};

    /// (page, job MiB, pitched, other busy, store, method, feedback?, reason).
    type Scenario = (u64, u64, bool, bool, bool, CopyMethod, bool, &'static str);

    /// The serving policy against a scenario table: (page, job MiB, pitched, other direction busy,
    /// store) → (method, feedback?, reason), with default settings.
    #[test]
    fn serving_rule_scenarios() {
        use CopyMethod::{Dma, Staged};
        let cfg = CudaEngineConfig::default();
        #[rustfmt::skip]
        let table: [Scenario; 12] = [
            // per-layer tensors (no pitched runs), 4 KiB pages
            (4 << 10, 8, false, false, true, Staged, true, "serving: small copies, feedback"),
            (4 << 10, 8, false, true, true, Staged, false, "serving: small copies"),
            (4 << 10, 128, false, true, true, Staged, false, "serving: small copies"),
            (4 << 10, 128, false, true, false, Staged, false, "serving: small copies"),
            (4 << 10, 128, false, false, false, Staged, true, "serving: small copies, feedback"),
            // evenly spaced tensors in one allocation: pitched runs
            (4 << 10, 8, true, false, true, Dma, true, "serving: pitched runs, feedback"),
            (4 << 10, 128, true, true, true, Dma, false, "serving: pitched runs"),
            (16 << 10, 128, true, true, false, Dma, false, "serving: pitched runs"),
            // copies of 32 KiB and more: DMA whatever the layout
            (32 << 10, 8, false, false, true, Dma, false, "serving: large copies"),
            (32 << 10, 128, false, true, true, Dma, false, "serving: large copies"),
            (2 << 20, 512, true, true, false, Dma, false, "serving: large copies"),
            (32 << 10, 128, true, false, false, Dma, false, "serving: large copies"),
        ];
        for (page, mib, pitched, busy, store, m, fb, why) in table {
            let job = ServingJob {
                avg_copy: page,
                bytes: mib << 20,
                mostly_pitched: pitched,
                other_busy: busy,
                store,
            };
            let (got, key, reason) = serving_choice(&cfg, job);
            assert_eq!((got, key.is_some(), reason), (m, fb, why), "{job:?}");
        }
        // Knobs: stores by DMA beside loads (large jobs only), the small-copy kernel, no feedback,
        // unmapped host memory (the staged pipeline and the kernel need it: DMA).
        let job = ServingJob {
            avg_copy: 4096,
            bytes: 128 << 20,
            mostly_pitched: false,
            other_busy: true,
            store: true,
        };
        let on = CudaEngineConfig {
            serving_store_dma_beside_loads: true,
            ..CudaEngineConfig::default()
        };
        assert_eq!(serving_choice(&on, job).0, Dma);
        assert_eq!(
            serving_choice(
                &on,
                ServingJob {
                    store: false,
                    ..job
                }
            )
            .0,
            Staged
        );
        assert_eq!(
            serving_choice(
                &on,
                ServingJob {
                    bytes: 8 << 20,
                    ..job
                }
            )
            .0,
            Staged
        );
        let kernel = CudaEngineConfig {
            serving_small_kernel: true,
            ..CudaEngineConfig::default()
        };
        assert_eq!(serving_choice(&kernel, job).0, CopyMethod::Kernel);
        let nofb = CudaEngineConfig {
            serving_feedback_every: 0,
            ..CudaEngineConfig::default()
        };
        let alone = ServingJob {
            other_busy: false,
            ..job
        };
        assert_eq!(serving_choice(&nofb, alone).1, None);
        assert_eq!(
            serving_choice(
                &nofb,
                ServingJob {
                    mostly_pitched: true,
                    ..alone
                }
            ),
            (Dma, None, "serving: pitched runs")
        );
        let unmapped = CudaEngineConfig {
            host_mapped: false,
            ..CudaEngineConfig::default()
        };
        assert_eq!(serving_choice(&unmapped, job).0, Dma);
    }
}
