//! Store and load handlers in one call, for Rust servers (docs/spec.md §6): the counterpart of
//! Python's `kvoff.CpuGpuOffloadingHandlers`. [`OffloadingHandlers::new`] takes the canonical
//! KV-cache tensors (one 2-D `(num_blocks, page)` tensor each, see docs/spec.md §6 "Canonical KV
//! caches") and their groups, allocates the host region (one CPU block holds each tensor's page ×
//! `block_size_factor`, block-major), pins it for a CUDA engine, builds the [`CopyPlanner`], and
//! opens one engine per direction with [`engine::open`](crate::engine::open). Jobs are then planned
//! and submitted by block ids.
// Unsafe: only the declaration of `OffloadingHandlers::submit`, whose caller vouches for the GPU
// tensors.
#![allow(unsafe_code)]

use crate::engine::{
    cuda_usable, open, EngineKind, EngineOptions, EngineTensor, Job, JobResult, TransferEngine,
    DEFAULT_COMPUTE_BUDGET_BP,
};
use crate::error::{KvoffError, Result};
use crate::plan::{CopyPlanner, Direction, GpuSpec, PlanRef, TensorDesc};
use crate::region::HostRegion;

/// Settings of [`OffloadingHandlers::new`] (the defaults of `CpuGpuOffloadingHandlers`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandlersConfig {
    /// Which engine serves (`Auto`: CUDA for CUDA tensors where CUDA is usable, else the host
    /// engine).
    pub engine: EngineKind,
    /// GPU blocks per CPU block (≥ 1).
    pub block_size_factor: u64,
    /// CPU blocks the host region holds.
    pub num_cpu_blocks: u64,
    /// The engines' options: `compute_budget_bp` defaults to [`DEFAULT_COMPUTE_BUDGET_BP`];
    /// `cuda_tune` to none (pass [`EngineOptions::from_env`] to apply `KVOFF_CUDA_TUNE`).
    pub options: EngineOptions,
}

impl Default for HandlersConfig {
    fn default() -> Self {
        Self {
            engine: EngineKind::Auto,
            block_size_factor: 1,
            num_cpu_blocks: 0,
            options: EngineOptions {
                compute_budget_bp: Some(DEFAULT_COMPUTE_BUDGET_BP),
                cuda_tune: None,
            },
        }
    }
}

/// A store engine and a load engine over one set of GPU-side tensors and a private host region.
pub struct OffloadingHandlers {
    store: Box<dyn TransferEngine>,
    load: Box<dyn TransferEngine>,
    planner: CopyPlanner,
    engine_name: String,
    pin_error: Option<String>,
    /// Declared last: dropped after the engines, which drain their jobs first.
    region: HostRegion,
}

impl std::fmt::Debug for OffloadingHandlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadingHandlers")
            .field("engine", &self.engine_name)
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

impl OffloadingHandlers {
    /// Handlers for the canonical tensors `gpu` (tensor `i` is `gpu[i].desc.num_blocks` GPU blocks
    /// of `gpu[i].desc.row_bytes` bytes, the page) whose KV-cache groups are `group_refs` (per
    /// group, `(tensor index, page bytes)` of each of its layers).
    ///
    /// A CUDA engine wants the host region pinned; where pinning fails the handlers run unpinned
    /// (slower; the `"kernel"` method is then refused) and [`Self::pin_error`] says why.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] for no tensors, a factor of 0, sizes that overflow,
    /// overlapping tensors, groups the planner refuses, or tensors that do not fit the engine
    /// (see [`crate::engine::open`]); [`KvoffError::CudaUnavailable`] where a CUDA engine is
    /// needed and CUDA is not usable; errors of the region's allocation and of the driver.
    pub fn new(
        gpu: &[EngineTensor],
        group_refs: Vec<Vec<PlanRef>>,
        cfg: &HandlersConfig,
    ) -> Result<Self> {
        if gpu.is_empty() {
            return Err(KvoffError::arg(
                "there must be at least one KV-cache tensor",
            ));
        }
        let f = cfg.block_size_factor;
        if f == 0 {
            return Err(KvoffError::arg("block_size_factor must be >= 1, got 0"));
        }
        let gpu_descs: Vec<TensorDesc> = gpu.iter().map(|t| t.desc).collect();
        check_disjoint(&gpu_descs, "GPU-side")?;
        let pages = gpu
            .iter()
            .map(|t| t.desc.row_bytes.checked_mul(f))
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| KvoffError::arg("page × block_size_factor overflows"))?;
        let slot = pages
            .iter()
            .try_fold(0u64, |a, &p| a.checked_add(p))
            .ok_or_else(|| KvoffError::arg("the CPU block size overflows"))?;
        let placements: Vec<Option<i64>> = gpu.iter().map(|t| t.cuda_device).collect();
        let use_cuda = cfg.engine.resolve(&placements, &[], cuda_usable())?;
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut region = HostRegion::private(cfg.num_cpu_blocks, slot, 1)?;
        let mut pin_error = None;
        if use_cuda && region.len_bytes() > 0 {
            pin_error = pin(
                &mut region,
                placements.first().copied().flatten().unwrap_or(0),
            );
        }
        let mut cpu = Vec::with_capacity(pages.len());
        let mut offset = 0;
        for &p in &pages {
            cpu.push(EngineTensor::host(region.view(0, offset, p)?.tensor_desc()));
            offset += p;
        }
        let cpu_descs = cpu.iter().map(|t| t.desc).collect();
        let planner = CopyPlanner::new(gpu_descs, cpu_descs, group_refs, f)?;
        let (store, engine_name) = open(cfg.engine, Direction::GpuToCpu, gpu, &cpu, &cfg.options)?;
        let (load, _) = open(cfg.engine, Direction::CpuToGpu, gpu, &cpu, &cfg.options)?;
        Ok(Self {
            store,
            load,
            planner,
            engine_name,
            pin_error,
            region,
        })
    }

    /// The engine serving: `"host"` or `"cuda:<method>"`.
    #[must_use]
    pub fn engine_name(&self) -> &str {
        &self.engine_name
    }

    /// Why the host region could not be pinned for a CUDA engine (`None`: pinned, or not needed).
    #[must_use]
    pub fn pin_error(&self) -> Option<&str> {
        self.pin_error.as_deref()
    }

    /// The host region holding the CPU blocks.
    #[must_use]
    pub fn region(&self) -> &HostRegion {
        &self.region
    }

    /// The planner (block ids → copies).
    #[must_use]
    pub fn planner(&self) -> &CopyPlanner {
        &self.planner
    }

    /// The engine of `direction`.
    pub fn engine(&mut self, direction: Direction) -> &mut dyn TransferEngine {
        match direction {
            Direction::GpuToCpu => self.store.as_mut(),
            Direction::CpuToGpu => self.load.as_mut(),
        }
    }

    /// Plans and submits job `job_id`: `direction` between the GPU blocks `gpu` and the CPU blocks
    /// `cpu_block_ids`, after the work queued on `stream` (a raw CUDA stream; `None`: unordered).
    ///
    /// # Errors
    /// Planning errors (bad ids, mismatched counts) and the engine's submission errors; nothing
    /// is enqueued then.
    ///
    /// # Safety
    /// 1. The GPU-side tensors given to [`Self::new`] stay allocated until this job is reported by
    ///    [`Self::poll`] (or [`Self::shutdown`] returned).
    /// 2. Nothing else writes the job's destination blocks, or frees its source blocks, while it
    ///    runs; `stream`, if any, is a live stream of the tensors' device.
    pub unsafe fn submit(
        &mut self,
        job_id: i64,
        direction: Direction,
        gpu: &GpuSpec<'_>,
        cpu_block_ids: &[i64],
        stream: Option<u64>,
    ) -> Result<()> {
        let plan = self.planner.plan(direction, gpu, cpu_block_ids)?;
        let mut job = Job::new(job_id, plan);
        job.stream = stream;
        // SAFETY: the plan comes from `self.planner`, whose CPU-side descriptors describe
        // `self.region` (alive while `self` is; the engines drain before it drops) and whose
        // GPU-side descriptors the caller keeps alive and unaliased (this function's contract).
        unsafe { self.engine(direction).submit(job) }
    }

    /// Finished jobs of `direction`, in submission order, each once.
    pub fn poll(&mut self, direction: Direction) -> Vec<JobResult> {
        self.engine(direction).poll()
    }

    /// Blocks until the jobs `job_ids` of `direction` finished (their results stay for `poll`).
    ///
    /// # Errors
    /// The engine's (a driver error while waiting).
    pub fn wait(&mut self, direction: Direction, job_ids: &[i64]) -> Result<()> {
        self.engine(direction).wait(job_ids)
    }

    /// Drains and stops both engines (idempotent); results stay pollable.
    pub fn shutdown(&mut self) {
        self.store.shutdown();
        self.load.shutdown();
    }
}

impl Drop for OffloadingHandlers {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Pins `region` for CUDA device `ordinal`; the error's text where it fails.
#[cfg(feature = "cuda")]
fn pin(region: &mut HostRegion, ordinal: i64) -> Option<String> {
    let r = i32::try_from(ordinal)
        .map_err(|_| KvoffError::arg(format!("bad CUDA device index {ordinal}")))
        .and_then(crate::engine::cuda::CudaDevice::open)
        .and_then(|dev| region.pin(dev.registrar()));
    r.err().map(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn pin(_region: &mut HostRegion, _ordinal: i64) -> Option<String> {
    Some("kvoff was built without the `cuda` feature".to_owned())
}

/// Checks that no two tensors of one side share a byte. Exact for tensors with equal row strides
/// (interleaved column ranges, like the block-major host layout), conservative otherwise.
///
/// # Errors
/// [`KvoffError::InvalidArgument`] naming the two tensors, or for more than
/// [`crate::plan::MAX_TENSORS`] tensors.
pub(crate) fn check_disjoint(descs: &[TensorDesc], side: &str) -> Result<()> {
    // Pairwise: bounded by the planner's cap, checked first so that a hostile count fails fast.
    if descs.len() > crate::plan::MAX_TENSORS {
        return Err(KvoffError::arg(format!(
            "{} {side} tensors: at most {}",
            descs.len(),
            crate::plan::MAX_TENSORS
        )));
    }
    let range = |d: &TensorDesc| {
        let e = d.extent_bytes().unwrap_or(u64::MAX);
        (d.base_ptr, d.base_ptr.saturating_add(e))
    };
    for (a, da) in descs.iter().enumerate() {
        for (b, db) in descs.iter().enumerate().skip(a + 1) {
            if da.num_blocks == 0 || db.num_blocks == 0 {
                continue;
            }
            let (ra, rb) = (range(da), range(db));
            if ra.1 <= rb.0 || rb.1 <= ra.0 {
                continue;
            }
            let s = da.row_stride_bytes;
            let interleaved =
                s == db.row_stride_bytes && s > 0 && da.row_bytes <= s && db.row_bytes <= s && {
                    // Column intervals on a circle of circumference s.
                    let (ca, cb) = (da.base_ptr % s, db.base_ptr % s);
                    let d = (cb + s - ca) % s; // offset of b's column start after a's
                    d >= da.row_bytes && s - d >= db.row_bytes
                };
            if !interleaved {
                return Err(KvoffError::arg(format!(
                    "{side} tensors {a} and {b} overlap ({:#x}..{:#x} and {:#x}..{:#x}): every \
                     canonical KV-cache tensor must have its own bytes",
                    ra.0, ra.1, rb.0, rb.1
                )));
            }
        }
    }
    Ok(())
}
