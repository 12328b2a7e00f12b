//! The serving policy's feedback (docs/performance.md, "Transfers beside compute"): measured GB/s
//! of batched DMA and the staged pipeline per class of job, and which of the two the next job runs.
#![forbid(unsafe_code)]

use std::collections::HashMap;

use super::config::CopyMethod;

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
/// 7.6 GB/s by DMA and 5.4 staged; on another of the same kind 4.3 and 7.9 (docs/performance.md). So
/// the rule's choice is the default, the two alternate until each has three samples, and after
/// that each job runs the method with the higher moving average of device-timed GB/s (changed
/// only when the other is 5% faster, or 15% faster to leave DMA for staging), except that every `every × ⌈(best / other)²⌉`-th job (at most every 1024th) tries the other again, so
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

#[cfg(test)]
mod tests {
    use super::{CopyMethod, ScoreKey, Scores};

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
}
