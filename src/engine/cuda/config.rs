//! The engine's settings, [`CudaEngineConfig`] (the copy methods themselves, [`CopyMethod`], are
//! listed beside the engine names in `engine/kind.rs`).

#![forbid(unsafe_code)]

pub use super::share::Polite;
pub use crate::engine::CopyMethod;
use crate::error::{KvoffError, Result};

/// Engine settings.
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(clippy::struct_excessive_bools)] // independent switches, each documented
pub struct CudaEngineConfig {
    /// Copy method.
    pub method: CopyMethod,
    /// Most CTAs (thread blocks) the copy kernel uses (≤ 16 by default; each CTA occupies one SM).
    pub max_ctas: u32,
    /// Whether the host side of every job is pinned and device-mapped (required by the kernel).
    pub host_mapped: bool,
    /// Average copy size from which `Auto` prefers DMA.
    pub dma_min_avg_copy_bytes: u64,
    /// Threads per CTA of the copy kernel (32..=1024, a multiple of 32).
    pub kernel_threads: u32,
    /// Bytes of one device staging slot (`Staged`).
    pub staging_slot_bytes: u64,
    /// Number of staging slots (`Staged`); device memory used = slots × slot bytes.
    pub staging_slots: usize,
    /// Average host-contiguous run from which `Auto` uses `Staged` for stores (GPU → host).
    pub staged_min_run_bytes: u64,
    /// Average host-contiguous run from which `Auto` uses `Staged` for loads (host → GPU).
    pub staged_min_run_bytes_load: u64,
    /// Read through the non-coherent (read-only) load path in the copy kernel.
    pub read_only_loads: bool,
    /// Let `Auto` use the device's calibration ([`CudaDevice::calibration`]); the thresholds above
    /// are the fallback.
    pub calibrate: bool,
    /// Slowdown the model may suffer from transfers running beside it, in basis points of a
    /// compute-bound kernel's time (200 = 2%; a memory-bound kernel sees about 2.5× that). `None`:
    /// the idle-GPU policy (fastest method, loads on a high-priority stream). `Some`: the
    /// serving policy of `Auto` (see [`CudaEngineConfig::serving`]): batched DMA for copies of at
    /// least [`CudaEngineConfig::serving_dma_min_copy_bytes`], else the staged pipeline, both
    /// directions on the lowest-priority stream. (The value itself sizes the copy kernel only
    /// with [`CudaEngineConfig::serving_small_kernel`]; the policy was chosen so that the default
    /// 2% holds in the measured cells.)
    pub compute_budget_bp: Option<u32>,
    /// Most copies per batched driver call; longer batches are split so that no call holds the
    /// driver (and every other thread's launches) for long. 0: no limit.
    pub max_batch_copies: usize,
    /// Most copies one DMA job keeps queued on a stream at once: past this, kvoff waits (outside
    /// the driver, polling an event) for the device to finish earlier batches before it enqueues
    /// more, so the driver does not wait inside a call for room in the stream's queue (single
    /// calls of 64 copies took 300–820 µs of CPU at 32768 queued 4 KiB copies on an H100; with at
    /// most 256–1024 queued, 79–132 µs). 512 copies are 2 MiB at 4 KiB pages, several times what
    /// the device moves while kvoff wakes up (tens of µs). 0: no bound.
    pub max_queued_copies: usize,
    /// Batched DMA moves copies that form a regular grid (equal sizes, source and destination
    /// each at a constant stride: a KV block's pages across evenly spaced tensors, or a tensor's
    /// consecutive blocks) as one pitched copy per run (`cuMemcpy2DAsync`) instead of one batch
    /// entry per copy: 2–4 µs of CPU per run instead of ~1 µs per copy, and 31–52 GB/s instead of
    /// 4–33 GB/s at 4–32 KiB pages on an H100. `false`: one batch entry per copy (the plain
    /// batched DMA of the benchmarks' baseline).
    pub dma_pitched: bool,
    /// DMA jobs of more than [`CudaEngineConfig::max_queued_copies`] units are enqueued by a
    /// feeder thread of the engine (paced), so that `submit` returns at once; `false`: the
    /// submitting thread enqueues and paces them itself (`submit` returns when most of the job
    /// has moved).
    pub dma_feeder: bool,
    /// `Auto`'s DMA jobs of at least this many copies are enqueued by two threads on two streams
    /// (the driver's per-copy CPU cost limits one thread; see the `dma` module). 0: never.
    pub dma_split_min_copies: usize,
    /// Serving policy: average copy size from which `Auto` uses batched DMA.
    pub serving_dma_min_copy_bytes: u64,
    /// Serving policy: smaller copies go through the bounded copy kernel (`serving_ctas`,
    /// `serving_launch_bytes`) instead of the staged pipeline (measured slower beside compute;
    /// kept for the benchmark's comparison).
    pub serving_small_kernel: bool,
    /// Serving policy: small-copy stores use batched DMA instead of the staged pipeline while the
    /// other direction (loads) is active, so that two staged pipelines do not run at once.
    pub serving_store_dma_beside_loads: bool,
    /// ... but only for store jobs of at least this many bytes: two staged pipelines at full rate
    /// (jobs large enough to overlap their stages) cost a memory-bound model 5.6–7%, while with
    /// jobs of a few MiB they cost it under 2% and move 3× what DMA moves at 4 KiB copies.
    pub serving_store_dma_min_job_bytes: u64,
    /// Serving policy: `Auto` keeps it only while the model is seen computing. An engine looks at
    /// the stream each job is ordered after (the caller's stream: in vLLM the model's) and at the
    /// streams given to [`CudaEngine::set_compute_streams`](super::CudaEngine::set_compute_streams)
    /// when it submits; if none of the engines of the device has found one of them with unfinished
    /// work within this many µs, the GPU counts as idle and `Auto` uses the idle-GPU policy (the
    /// fastest method). 0: never idle (the serving policy for every job).
    pub idle_after_us: u64,
    /// Serving policy: for small copies (below [`CudaEngineConfig::serving_dma_min_copy_bytes`])
    /// both batched DMA and the staged pipeline are within the budget, and which moves more
    /// depends on the model's load; `Auto` measures both on its own jobs (device-timed) and keeps
    /// the faster, trying the other again every `serving_feedback_every × ⌈(faster / slower)²⌉`
    /// jobs of the same kind (copy size, job size, other direction busy). 0: no feedback (the
    /// staged pipeline, the measured default).
    pub serving_feedback_every: u32,
    /// Stream priority of loads: `None` (the default) gives loads the highest priority without a
    /// budget and the lowest under the serving policy (stores always have the lowest); `Some(true)`
    /// / `Some(false)` force the highest / the lowest. Set when the engine is made. For measuring
    /// whether the priority moves DMA beside a model (docs/performance.md, "How `auto` chooses a
    /// copy method"); tune key `loadprio` (`high`, `low`, `auto`).
    pub load_high_priority: Option<bool>,
    /// When copy calls turn polite beside a model that launches eagerly (see the `share` module):
    /// `Auto` (the default) under the serving policy while another thread's calls are seen to
    /// hold the driver; tune key `polite` (`auto`, `always`, `off`).
    pub polite: Polite,
    /// Share of wall time, in percent, that kvoff's copy calls hold the driver while polite:
    /// after each call the thread waits outside the driver `call × (100 − pct) / pct` (at least
    /// 10 µs). Tune key `duty`.
    pub dma_driver_duty_pct: u32,
    /// Whether that share is the device's (the default): polite calls of every kvoff thread of
    /// the device (both directions' engines, their feeders) take turns, one call and its wait at
    /// a time, so that two threads together hold the driver no longer than one would; `false`:
    /// each thread's own (two threads then held it up to twice as long, and an eager decode
    /// beside 128 MiB jobs both ways lost up to +5.5% where a quarter each kept it within +2.1%:
    /// docs/performance.md, "Transfers beside an eager model"). Tune key `dutywide` (0/1).
    /// Device-wide: the engine made last sets it.
    pub polite_duty_device_wide: bool,
    /// Polite also needs this share (of 1024) of the device's sampled copy calls blocked over a
    /// slow window (1/256 per call), not only the fast one's 100; 0 (the default): the fast share
    /// alone decides. Tune key `slowshare` (0–1024). Device-wide: the engine made last sets it.
    /// At 40 the synthetic grid's 32 KiB cells moved 0.69–1.31× plain DMA (0.36–0.89× without);
    /// that it keeps an eager forward within the budget is not shown (docs/performance.md,
    /// "Transfers beside an eager model").
    pub polite_slow_share: u32,
    /// Serving policy: the rate in MB/s at which staged jobs are paced while the model computes
    /// (their pack kernel and DMA cross the GPU's memory three times per byte, which a
    /// memory-bound model pays for; see the `pace` module). The engines of a device share one
    /// time bucket: a paced job reserves its bytes at its engine's cap and starts when the jobs
    /// reserved before it (both directions) are through, so the cap holds on average over jobs
    /// (one job runs at full speed); jobs are paced only while the device's staged jobs arrive
    /// near the cap. `None` (the default): derived from the budget and the device's peak memory
    /// bandwidth (driver attributes), so that a model at the memory's peak loses at most 80% of
    /// its memory-bound budget (2.5 × the compute budget): 30.5 GB/s on an H100 (3352 GB/s) at 2%.
    /// `Some(0)`: no cap. Tune key `stagedcap` (MB/s, `auto`, or 0).
    pub serving_staged_cap_mb_s: Option<u32>,
    /// Serving policy: CTAs of the copy kernel (0: derived from the budget and the SM count).
    pub serving_ctas: u32,
    /// Serving policy: most bytes one copy-kernel launch moves (so a launch holds its SMs only
    /// briefly; work queued behind it, the model's kernels, gets them back soon).
    pub serving_launch_bytes: u64,
}

impl Default for CudaEngineConfig {
    fn default() -> Self {
        Self {
            method: CopyMethod::Auto,
            max_ctas: 16,
            host_mapped: true,
            dma_min_avg_copy_bytes: 1 << 20,
            kernel_threads: 1024,
            staging_slot_bytes: 32 << 20,
            staging_slots: 2,
            staged_min_run_bytes: 1 << 20,
            staged_min_run_bytes_load: 256 << 10,
            read_only_loads: false,
            calibrate: true,
            compute_budget_bp: None,
            max_batch_copies: 64,
            max_queued_copies: 512,
            dma_pitched: true,
            dma_feeder: true,
            dma_split_min_copies: 256,
            serving_dma_min_copy_bytes: 32 << 10,
            serving_small_kernel: false,
            serving_store_dma_beside_loads: false,
            serving_store_dma_min_job_bytes: 32 << 20,
            serving_feedback_every: 32,
            load_high_priority: None,
            serving_staged_cap_mb_s: None,
            polite: Polite::Auto,
            dma_driver_duty_pct: 50,
            polite_duty_device_wide: true,
            polite_slow_share: 0,
            serving_ctas: 0,
            serving_launch_bytes: 1 << 20,
            idle_after_us: 100_000,
        }
    }
}

impl CudaEngineConfig {
    /// Whether the serving (budgeted) policy is on: `Auto` with a compute budget (an explicit
    /// method runs as configured). Under it, each job uses the serving policy while the model is
    /// seen computing and the idle-GPU policy otherwise ([`CudaEngineConfig::idle_after_us`]).
    #[must_use]
    pub fn serving(&self) -> bool {
        self.method == CopyMethod::Auto && self.compute_budget_bp.is_some()
    }

    /// The staged-pipeline cap of the serving policy in MB/s on a device whose memory peaks at
    /// `memory_peak_gbps` (0: no cap; see [`CudaEngineConfig::serving_staged_cap_mb_s`]).
    #[must_use]
    pub fn staged_cap_mb_s(&self, memory_peak_gbps: Option<f64>) -> u32 {
        match (self.serving_staged_cap_mb_s, self.compute_budget_bp) {
            (Some(cap), _) => cap,
            (None, Some(bp)) => super::pace::derived_cap_mb_s(bp, memory_peak_gbps),
            (None, None) => 0,
        }
    }

    /// Applies the environment's `KVOFF_CUDA_TUNE` (if set) with [`Self::apply_tuning`]. For
    /// callers that make engines (the handlers, benchmarks, calibration); `CudaEngine::new` does
    /// not read the environment.
    ///
    /// # Errors
    /// As [`Self::apply_tuning`].
    pub fn apply_env_tuning(&mut self) -> Result<()> {
        match std::env::var("KVOFF_CUDA_TUNE") {
            Ok(spec) => self.apply_tuning(&spec),
            Err(_) => Ok(()),
        }
    }

    /// Applies `KVOFF_CUDA_TUNE` overrides (`key=value` pairs separated by commas; keys `budget`
    /// (basis points, or `off`), `batch`, `queued`, `pitched` (0/1), `feeder` (0/1), `dmasplit`, `storedma`, `storedmamin` (bytes), `idleafter` (µs; 0 = never idle), `polite` (`auto`, `always`, `off`), `duty` (percent), `dutywide` (0/1), `feedback` (0 = off), `loadprio` (`high`, `low`, `auto`), `stagedcap` (MB/s, `auto`; 0 = no cap), `ctas`, `max_ctas`, `launch`, `dmamin`, `small`
    /// (`kernel` or `staged`)), used by the
    /// benchmarks to sweep the serving policy's knobs without rebuilding.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] for an unknown key or a value that does not parse.
    pub fn apply_tuning(&mut self, spec: &str) -> Result<()> {
        for kv in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                KvoffError::arg(format!("KVOFF_CUDA_TUNE: {kv:?} is not key=value"))
            })?;
            let num = |v: &str| {
                v.parse::<u64>().map_err(|_| {
                    KvoffError::arg(format!("KVOFF_CUDA_TUNE: {k}={v:?} is not a number"))
                })
            };
            match k {
                "budget" if v == "off" => self.compute_budget_bp = None,
                "budget" => {
                    self.compute_budget_bp = Some(u32::try_from(num(v)?).unwrap_or(u32::MAX));
                }
                "batch" => self.max_batch_copies = usize::try_from(num(v)?).unwrap_or(usize::MAX),
                "pitched" => self.dma_pitched = num(v)? != 0,
                "feeder" => self.dma_feeder = num(v)? != 0,
                "queued" => {
                    self.max_queued_copies = usize::try_from(num(v)?).unwrap_or(usize::MAX);
                }
                "dmasplit" => {
                    self.dma_split_min_copies = usize::try_from(num(v)?).unwrap_or(usize::MAX);
                }
                "ctas" => self.serving_ctas = u32::try_from(num(v)?).unwrap_or(u32::MAX),
                "max_ctas" => self.max_ctas = u32::try_from(num(v)?).unwrap_or(u32::MAX).max(1),
                "launch" => self.serving_launch_bytes = num(v)?.max(4096),
                "dmamin" => self.serving_dma_min_copy_bytes = num(v)?,
                "small" => self.serving_small_kernel = v == "kernel",
                "storedma" => self.serving_store_dma_beside_loads = num(v)? != 0,
                "storedmamin" => self.serving_store_dma_min_job_bytes = num(v)?,
                "idleafter" => self.idle_after_us = num(v)?,
                "slowshare" => {
                    self.polite_slow_share = u32::try_from(num(v)?).unwrap_or(u32::MAX);
                    if self.polite_slow_share > 1024 {
                        return Err(KvoffError::arg(format!(
                            "KVOFF_CUDA_TUNE: slowshare={v:?} is over 1024"
                        )));
                    }
                }
                "duty" => {
                    self.dma_driver_duty_pct = u32::try_from(num(v)?).unwrap_or(100).clamp(1, 100);
                }
                "dutywide" => self.polite_duty_device_wide = num(v)? != 0,
                "polite" => {
                    self.polite = match v {
                        "auto" => Polite::Auto,
                        "always" => Polite::Always,
                        "off" => Polite::Off,
                        "watch" => Polite::Watch,
                        _ => {
                            return Err(KvoffError::arg(format!(
                                "KVOFF_CUDA_TUNE: polite={v:?} is not auto, always, off or watch"
                            )))
                        }
                    };
                }
                "loadprio" => {
                    self.load_high_priority = match v {
                        "high" => Some(true),
                        "low" => Some(false),
                        "auto" => None,
                        _ => {
                            return Err(KvoffError::arg(format!(
                                "KVOFF_CUDA_TUNE: loadprio={v:?} is not high, low or auto"
                            )))
                        }
                    };
                }
                "stagedcap" if v == "auto" => self.serving_staged_cap_mb_s = None,
                "stagedcap" => {
                    self.serving_staged_cap_mb_s = Some(u32::try_from(num(v)?).unwrap_or(u32::MAX));
                }
                "feedback" => {
                    self.serving_feedback_every = u32::try_from(num(v)?).unwrap_or(u32::MAX);
                }
                _ => {
                    return Err(KvoffError::arg(format!(
                        "KVOFF_CUDA_TUNE: unknown key {k:?}"
                    )))
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{CopyMethod, CudaEngineConfig};

    #[test]
    fn serving_needs_auto_and_a_budget() {
        let mut c = CudaEngineConfig::default();
        assert!(!c.serving());
        c.compute_budget_bp = Some(200);
        assert!(c.serving());
        c.method = CopyMethod::Kernel;
        assert!(!c.serving(), "an explicit method runs as configured");
    }

    #[test]
    fn tuning_sets_each_knob_and_rejects_bad_input() {
        let mut c = CudaEngineConfig::default();
        c.apply_tuning(
            "budget=150, batch=32,queued=96,pitched=0,feeder=0,ctas=3,max_ctas=8,launch=65536,dmamin=4096,small=kernel,dmasplit=9,storedma=1,storedmamin=7,idleafter=0,feedback=0",
        )
        .unwrap();
        assert_eq!(c.compute_budget_bp, Some(150));
        assert_eq!(c.max_batch_copies, 32);
        assert_eq!(c.max_queued_copies, 96);
        assert!(!c.dma_pitched);
        assert!(!c.dma_feeder);
        assert_eq!(c.serving_ctas, 3);
        assert_eq!(c.max_ctas, 8);
        assert_eq!(c.serving_launch_bytes, 65536);
        assert_eq!(c.serving_dma_min_copy_bytes, 4096);
        assert!(c.serving_small_kernel);
        assert_eq!(c.dma_split_min_copies, 9);
        assert!(c.serving_store_dma_beside_loads);
        assert_eq!(c.serving_store_dma_min_job_bytes, 7);
        assert_eq!(c.idle_after_us, 0);
        assert_eq!(c.serving_feedback_every, 0);
        assert_eq!(c.load_high_priority, None);
        c.apply_tuning("loadprio=high").unwrap();
        assert_eq!(c.load_high_priority, Some(true));
        c.apply_tuning("loadprio=low").unwrap();
        assert_eq!(c.load_high_priority, Some(false));
        c.apply_tuning("loadprio=auto").unwrap();
        assert_eq!(c.load_high_priority, None);
        assert!(c.apply_tuning("loadprio=top").is_err());
        c.apply_tuning("stagedcap=12000").unwrap();
        assert_eq!(c.serving_staged_cap_mb_s, Some(12_000));
        c.apply_tuning("stagedcap=0").unwrap();
        assert_eq!(c.serving_staged_cap_mb_s, Some(0));
        c.apply_tuning("stagedcap=auto").unwrap();
        assert_eq!(c.serving_staged_cap_mb_s, None);
        assert!(c.apply_tuning("stagedcap=fast").is_err());
        assert_eq!(c.polite_slow_share, 0, "the slow gate is off by default");
        c.apply_tuning("slowshare=40").unwrap();
        assert_eq!(c.polite_slow_share, 40);
        assert!(c.apply_tuning("slowshare=1025").is_err());
        assert!(c.apply_tuning("slowshare=-1").is_err());
        c.apply_tuning("budget=off,small=staged,launch=1").unwrap();
        assert_eq!(c.compute_budget_bp, None);
        assert!(!c.serving_small_kernel);
        assert_eq!(c.serving_launch_bytes, 4096, "launches move at least 4 KiB");
        assert!(c.apply_tuning("batch").is_err());
        assert!(c.apply_tuning("batch=x").is_err());
        assert!(c.apply_tuning("nope=1").is_err());
        c.apply_tuning("").unwrap();
    }
}
