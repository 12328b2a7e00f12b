//! Method choice of `Auto`: the serving policy (what the model can afford beside the transfer)
//! and the idle-GPU policy (calibrated per device, see `calibrate`).
#![forbid(unsafe_code)]

use std::collections::HashMap;

use super::engine::CudaEngine;
use super::{CopyMethod, CudaEngineConfig, STAGED_MIN_JOB_BYTES};
use crate::plan::{CopyOp, Direction};

/// Which jobs share a measured score under the serving policy: the average copy size and the job
/// size (each by powers of two; jobs by powers of four) and whether the other direction was busy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct ScoreKey {
    copy_class: u8,
    job_class: u8,
    other_busy: bool,
    /// DMA would move the job as pitched copies.
    pitched: bool,
}

impl ScoreKey {
    pub(super) fn new(avg_copy_bytes: u64, job_bytes: u64, other_busy: bool) -> Self {
        let log2 = |x: u64| u8::try_from(x.max(1).ilog2()).unwrap_or(u8::MAX);
        Self {
            copy_class: log2(avg_copy_bytes),
            job_class: log2(job_bytes) / 2,
            other_busy,
            pitched: false,
        }
    }

    /// The same key for jobs that DMA moves as pitched copies.
    pub(super) fn pitched(self) -> Self {
        Self {
            pitched: true,
            ..self
        }
    }
}

/// Measured GB/s of the two methods in one cell (index 0: DMA, 1: staged).
#[derive(Clone, Copy, Debug, Default)]
struct ScoreCell {
    gbps: [f64; 2],
    samples: [u32; 2],
    jobs: u32,
    /// The slot currently kept (changed only when the other is faster by [`SCORE_MARGIN`], or by
    /// [`SCORE_MARGIN_TO_STAGED`] to leave DMA).
    best: Option<usize>,
}

/// How much faster the other method must measure before the kept one is changed (per-job rates
/// beside a model vary by tens of percent; without a margin the choice flips on noise): to DMA.
const SCORE_MARGIN: f64 = 1.05;

/// The same to leave DMA for the staged pipeline, whose pack kernel takes SMs and device-memory
/// bandwidth from the model (within the budget, but more than DMA's none): a near tie goes to DMA.
/// Measured on an H100, 4 KiB × 128 MiB pitched stores beside a memory-bound kernel at about 77%
/// of the HBM's peak (cuBLAS `Scopy`): DMA 29.0 GB/s (+0.3% to the kernel), staging 27.1 (+1.9%);
/// with a 5% margin either way the feedback flipped on noise and moved 26.6. Where staging truly
/// wins (beside a kernel at the HBM's peak, 27.0 against 17.7) its lead is far over this.
const SCORE_MARGIN_TO_STAGED: f64 = 1.15;

/// Samples of each method before the moving averages decide.
const SCORE_WARM: u32 = 3;

/// Weight of a new sample in a cell's moving average.
const SCORE_ALPHA: f64 = 0.3;

/// The serving policy's feedback: which of batched DMA and the staged pipeline moves more for
/// small copies beside *this* model on *this* machine, measured from the engine's own jobs.
///
/// Both methods keep the model within the budget for small copies (DMA uses no SMs; the staged
/// pipeline's pack kernel runs in short low-priority launches), but which one moves more depends
/// on how much of the GPU the model leaves: on one H100 beside a GEMM, 4 KiB × 8 MiB stores moved
/// 7.6 GB/s by DMA and 5.4 staged; on another of the same kind 4.3 and 7.9 (BENCHMARKS.md). So
/// the rule's choice is the default, the two alternate until each has three samples, and after
/// that each job runs the method with the higher moving average of device-timed GB/s (changed
/// only when the other is 5% faster), except that every `every × ⌈(best / other)²⌉`-th job (at most every 1024th) tries the other again, so
/// a change in the model's load is noticed while a clearly slower method costs little.
#[derive(Debug, Default)]
pub(super) struct Scores {
    cells: HashMap<ScoreKey, ScoreCell>,
}

const fn slot(m: CopyMethod) -> usize {
    match m {
        CopyMethod::Staged => 1,
        _ => 0,
    }
}

const SLOT_METHOD: [CopyMethod; 2] = [CopyMethod::Dma, CopyMethod::Staged];

impl Scores {
    /// The method for the next job of `key`'s cell; `default` (DMA or staged) is the rule's choice.
    pub(super) fn pick(&mut self, key: ScoreKey, default: CopyMethod, every: u32) -> CopyMethod {
        let c = self.cells.entry(key).or_default();
        c.jobs = c.jobs.saturating_add(1);
        let kept = c.best.unwrap_or_else(|| slot(default));
        let margin = if SLOT_METHOD[1 - kept] == CopyMethod::Staged {
            SCORE_MARGIN_TO_STAGED
        } else {
            SCORE_MARGIN
        };
        let best =
            if c.samples[0] > 0 && c.samples[1] > 0 && c.gbps[1 - kept] > c.gbps[kept] * margin {
                1 - kept
            } else {
                kept
            };
        c.best = Some(best);
        let other = 1 - best;
        let probe = if c.samples[other] < SCORE_WARM || c.samples[best] < SCORE_WARM {
            // Warm-up: alternate until each has a few samples (one job's rate beside a model
            // can be far off; a single early sample would decide for dozens of jobs).
            c.jobs % 2 == 0
        } else {
            let ratio = if c.gbps[other] > 0.0 {
                c.gbps[best] / c.gbps[other]
            } else {
                f64::INFINITY
            };
            // ⌈ratio²⌉ in 1..=1024 (a ratio of NaN or infinity gives the cap).
            let mut factor = 1u32;
            while factor < 1024 && f64::from(factor) < ratio * ratio {
                factor += 1;
            }
            let n = every.max(1).saturating_mul(factor).min(1024);
            c.jobs % n.max(2) == 0
        };
        SLOT_METHOD[if probe { other } else { best }]
    }

    /// Adds a finished job's device-timed rate.
    pub(super) fn record(&mut self, key: ScoreKey, method: CopyMethod, bytes: u64, seconds: f64) {
        if seconds.is_nan() || seconds <= 0.0 || bytes == 0 {
            return;
        }
        #[allow(clippy::cast_precision_loss)] // a rate; 52 bits are plenty
        let g = bytes as f64 / seconds / 1e9;
        let c = self.cells.entry(key).or_default();
        let i = slot(method);
        c.gbps[i] = if c.samples[i] == 0 {
            g
        } else {
            (1.0 - SCORE_ALPHA) * c.gbps[i] + SCORE_ALPHA * g
        };
        c.samples[i] = c.samples[i].saturating_add(1);
    }

    /// The cell's moving averages `[dma, staged]` in GB/s (0 before a sample).
    #[cfg(test)]
    fn rates(&self, key: ScoreKey) -> [f64; 2] {
        self.cells.get(&key).map_or([0.0; 2], |c| c.gbps)
    }
}

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

/// What the serving policy looks at in a job.
#[derive(Clone, Copy, Debug)]
pub(super) struct ServingJob {
    /// Average bytes per copy.
    pub(super) avg_copy: u64,
    /// Bytes of the job.
    pub(super) bytes: u64,
    /// At least half of the copies form pitched runs of ≥ 64 KiB within one device allocation.
    pub(super) mostly_pitched: bool,
    /// The engine of the other direction submitted or has jobs in flight (within 50 ms).
    pub(super) other_busy: bool,
    /// GPU → host.
    pub(super) store: bool,
}

/// The serving policy's rule: the method, the feedback cell when the feedback may override it,
/// and which rule decided. Pure (unit-tested against a scenario table below).
///
/// Beside a model (measured on an H100 beside a bf16 GEMM and a 1 GiB device copy, BENCHMARKS.md
/// "Transfers beside compute"): batched DMA uses no SMs and moves copies of ≥ 32 KiB efficiently
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
        // staging both ways stays within the budget (BENCHMARKS.md session 9). When on, large
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
        copies: &[CopyOp],
        bytes: u64,
    ) -> (CopyMethod, Option<ScoreKey>, &'static str) {
        let (m, why) = match self.cfg.method {
            CopyMethod::Auto if self.job_serving => {
                let job = ServingJob {
                    avg_copy: bytes / (copies.len().max(1) as u64),
                    bytes,
                    mostly_pitched: self.job_mostly_pitched(copies.len()),
                    other_busy: self.device.other_direction_active(self.direction),
                    store: self.direction == Direction::GpuToCpu,
                };
                return serving_choice(&self.cfg, job);
            }
            CopyMethod::Auto => {
                let avg = bytes / (copies.len().max(1) as u64);
                if !self.cfg.host_mapped {
                    return (CopyMethod::Dma, None, "idle: host memory not mapped");
                }
                if avg >= self.cfg.dma_min_avg_copy_bytes {
                    return (CopyMethod::Dma, None, "idle: large copies");
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
    use super::{
        busy_within, serving_choice, CopyMethod, CudaEngineConfig, ScoreKey, Scores, ServingJob,
    };

    /// Runs `n` jobs of one cell where DMA moves `dma` GB/s and staging `staged`, the rule's
    /// default being staging; returns the methods picked.
    fn drive(s: &mut Scores, key: ScoreKey, n: usize, dma: f64, staged: f64) -> Vec<CopyMethod> {
        drive_from(s, key, CopyMethod::Staged, n, dma, staged)
    }

    /// [`drive`] with the rule's default `default`.
    fn drive_from(
        s: &mut Scores,
        key: ScoreKey,
        default: CopyMethod,
        n: usize,
        dma: f64,
        staged: f64,
    ) -> Vec<CopyMethod> {
        (0..n)
            .map(|_| {
                let m = s.pick(key, default, 32);
                let g = if m == CopyMethod::Dma { dma } else { staged };
                s.record(key, m, 8 << 20, 8_388_608.0 / (g * 1e9));
                m
            })
            .collect()
    }

    #[test]
    fn feedback_tries_both_then_keeps_the_faster() {
        let key = ScoreKey::new(4096, 8 << 20, false);
        let mut s = Scores::default();
        let picks = drive(&mut s, key, 400, 7.6, 5.4);
        assert_eq!(picks[0], CopyMethod::Staged, "the rule's default first");
        assert_eq!(
            picks[1],
            CopyMethod::Dma,
            "the other method on the second job"
        );
        let staged = picks[2..]
            .iter()
            .filter(|&&m| m == CopyMethod::Staged)
            .count();
        // Two more in the warm-up (jobs 3 and 5), then probes every 32 × ⌈(7.6/5.4)²⌉ = 64 jobs.
        assert!(
            (6..=10).contains(&staged),
            "{staged} probes of the slower method"
        );
        let r = s.rates(key);
        assert!(
            (r[0] - 7.6).abs() < 1e-6 && (r[1] - 5.4).abs() < 1e-6,
            "{r:?}"
        );
        // The default stays where it is faster.
        let key2 = ScoreKey::new(4096, 128 << 20, false);
        let picks = drive(&mut s, key2, 400, 7.7, 22.0);
        let dma = picks.iter().filter(|&&m| m == CopyMethod::Dma).count();
        // Three in the warm-up, then every 32 × ⌈(22/7.7)²⌉ = 288 jobs.
        assert!((3..=5).contains(&dma), "{dma} DMA jobs");
    }

    #[test]
    fn feedback_follows_a_change_in_load() {
        let key = ScoreKey::new(4096, 8 << 20, false);
        let mut s = Scores::default();
        drive(&mut s, key, 200, 4.3, 7.9);
        let late = drive(&mut s, key, 2000, 7.6, 5.4);
        let tail = &late[1000..];
        assert!(
            tail.iter().filter(|&&m| m == CopyMethod::Dma).count() > 950,
            "switched to the now faster DMA"
        );
    }

    #[test]
    fn feedback_starts_from_the_rules_default() {
        // Pitched jobs: DMA first, staging on the second job; the faster is kept.
        let key = ScoreKey::new(4096, 128 << 20, false).pitched();
        assert_ne!(key, ScoreKey::new(4096, 128 << 20, false));
        let mut s = Scores::default();
        let picks = drive_from(&mut s, key, CopyMethod::Dma, 100, 18.0, 26.6);
        assert_eq!(&picks[..2], &[CopyMethod::Dma, CopyMethod::Staged]);
        let staged = picks[2..]
            .iter()
            .filter(|&&m| m == CopyMethod::Staged)
            .count();
        assert!(staged >= 95, "{staged}");
    }

    #[test]
    fn feedback_keeps_its_choice_within_the_margin() {
        let key = ScoreKey::new(4096, 8 << 20, false);
        let mut s = Scores::default();
        // DMA 3% faster: within the 5% margin, the rule's staged pipeline stays.
        let picks = drive(&mut s, key, 300, 5.15, 5.0);
        let dma = picks.iter().filter(|&&m| m == CopyMethod::Dma).count();
        assert!(dma <= 4 + 300 / 32, "{dma} DMA jobs");
    }

    #[test]
    fn feedback_leaves_dma_for_staging_only_at_a_clear_lead() {
        let key = ScoreKey::new(4096, 128 << 20, false).pitched();
        let mut s = Scores::default();
        // Staging 10% faster (29.0 vs 31.9): within the 15% margin for leaving DMA, DMA stays.
        let picks = drive_from(&mut s, key, CopyMethod::Dma, 300, 29.0, 31.9);
        let staged = picks.iter().filter(|&&m| m == CopyMethod::Staged).count();
        assert!(staged <= 3 + 300 / 32, "{staged} staged jobs");
        // Where staging is kept (the rule's default for scattered small copies), DMA 10% faster
        // takes over (5% margin).
        let key2 = ScoreKey::new(4096, 8 << 20, false);
        let late = drive(&mut s, key2, 300, 5.5, 5.0);
        let dma = late[100..]
            .iter()
            .filter(|&&m| m == CopyMethod::Dma)
            .count();
        assert!(dma > 180, "{dma} DMA jobs");
    }

    #[test]
    fn feedback_ignores_empty_and_untimed_jobs_and_keys_by_class() {
        let mut s = Scores::default();
        let key = ScoreKey::new(4096, 8 << 20, false);
        s.record(key, CopyMethod::Dma, 0, 1.0);
        s.record(key, CopyMethod::Dma, 1 << 20, 0.0);
        s.record(key, CopyMethod::Dma, 1 << 20, f64::NAN);
        assert!(s.rates(key).iter().all(|&r| r == 0.0), "no sample");
        assert_eq!(
            key,
            ScoreKey::new(4096 + 100, 12 << 20, false),
            "same classes"
        );
        assert_ne!(key, ScoreKey::new(8192, 8 << 20, false));
        assert_ne!(key, ScoreKey::new(4096, 32 << 20, false));
        assert_ne!(key, ScoreKey::new(4096, 8 << 20, true));
        assert_eq!(ScoreKey::new(0, 0, false), ScoreKey::new(1, 1, false));
    }

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
