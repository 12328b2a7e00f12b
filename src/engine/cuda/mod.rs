//! CUDA transfer engine (docs/spec.md §6 on a GPU): moves a [`CopyPlan`](crate::plan::CopyPlan) between GPU memory and pinned host
//! memory on a pooled stream, choosing per job between batched DMA (`cuMemcpyBatchAsync`, one call
//! per job; a per-copy `cuMemcpyAsync` loop where the driver lacks it) and a gather/scatter copy
//! kernel over device-mapped host memory (`kernels/copy.cu`, shipped as PTX).
//!
//! Ordering: each job first waits on the caller's stream (an event recorded there at submission),
//! then runs on this engine's stream after the previous job, so jobs of one engine complete in
//! submission order. Loads use a higher-priority stream than stores. Each job is bracketed by two
//! pooled timing events; [`TransferEngine::poll`] queries them without blocking.
//!
//! Errors: a failing driver call during submission or execution never panics and never aborts the
//! process: the job is reported with `success = false` and the driver's error text. Errors while
//! releasing resources in `Drop` are recorded in [`CudaEngine::close_errors`].
//!
//! Loading: the driver library is opened at run time (cudarc `dynamic-loading`); where there is
//! none, [`CudaDevice::open`] returns [`KvoffError::CudaUnavailable`] and nothing else is touched.
#![allow(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

mod calibrate;
mod ffi;
mod handles;
mod memory;
mod staged;

pub use calibrate::{CalRow, Calibration};
pub use memory::{CudaStream, DeviceBuffer, PinnedBuffer};
pub(crate) use staged::{
    staged_chunk_count, staged_chunk_len, staged_desc_bound, StagedPacker, STAGED_MIN_JOB_BYTES,
};

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock};

use super::{Job, JobResult, SubmitStats, TransferEngine};
use crate::error::{KvoffError, Result};
use crate::plan::{CopyOp, Direction};
use crate::region::HostRegistrar;
use handles::{DevMem, Event, PinnedHost, Stream};

/// PTX of `kernels/copy.cu` (built by `kernels/build_ptx.py`).
const COPY_PTX: &str = concat!(include_str!("../../../kernels/copy.ptx"), "\0");
/// Most threads per CTA of the copy kernel (its `__launch_bounds__`).
const MAX_KERNEL_THREADS: u32 = 1024;
/// Largest piece one warp copies; longer copies are split so warps stay balanced.
const KERNEL_CHUNK_BYTES: u64 = 64 << 10;
/// Bytes of one kernel descriptor (`src`, `dst`, `bytes`).
const DESC_BYTES: usize = 24;

/// How a job's bytes are moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CopyMethod {
    /// Choose per job (page size, copy count, whether the host memory is mapped).
    Auto,
    /// Batched DMA: one `cuMemcpyBatchAsync` per job (or a per-copy loop without it).
    Dma,
    /// The gather/scatter copy kernel (needs pinned, device-mapped host memory).
    Kernel,
    /// One `cuMemcpyAsync` per copy (a baseline for benchmarks).
    Loop,
    /// Staged: the kernel gathers (stores) or scatters (loads) the GPU side through device staging
    /// slots, and the copy engines move host-contiguous runs over PCIe with batched DMA. The job
    /// is cut into chunks (2, 4, 8 … MiB up to a slot) that alternate between two streams, so one
    /// stream's kernel overlaps the other's DMA; each chunk is packed on the CPU just before it is
    /// enqueued, so the device starts after little CPU work. Two driver calls per chunk. Best when
    /// host-side runs are long (kvoff's block-major host layout) and especially when stores and
    /// loads run at the same time.
    Staged,
}

impl CopyMethod {
    /// Parses `"auto" | "dma" | "kernel" | "loop"`.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] naming the valid choices.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" | "cuda" => Ok(Self::Auto),
            "dma" => Ok(Self::Dma),
            "kernel" => Ok(Self::Kernel),
            "loop" => Ok(Self::Loop),
            "staged" => Ok(Self::Staged),
            _ => Err(KvoffError::arg(format!(
                "unknown CUDA copy method {s:?}; valid: \"auto\", \"dma\", \"kernel\", \"staged\", \"loop\""
            ))),
        }
    }

    /// Lower-case name.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Dma => "dma",
            Self::Kernel => "kernel",
            Self::Loop => "loop",
            Self::Staged => "staged",
        }
    }
}

/// Raw driver handles are plain pointers; the driver API is thread-safe for the calls made here
/// (each engine's handles are used under `&mut self` or the device's lock).
struct SendPtr<T>(T);
// SAFETY: driver handles may be used from any thread once the context is current there, which
// every entry point ensures with `bind()`.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above; shared use goes through `&self` methods that only read the handle values.
unsafe impl<T> Sync for SendPtr<T> {}

/// One CUDA device's primary context (the one torch uses), the loaded copy kernel and the optional
/// batched-copy entry point. Shared by the engines of one device.
pub struct CudaDevice {
    ordinal: i32,
    dev: ffi::CUdevice,
    ctx: SendPtr<ffi::CUcontext>,
    module: SendPtr<ffi::CUmodule>,
    kernel: SendPtr<ffi::CUfunction>,
    kernel_nc: SendPtr<ffi::CUfunction>,
    sleep_kernel: SendPtr<ffi::CUfunction>,
    batch: Option<ffi::MemcpyBatchFn>,
    name: String,
    sm_count: i32,
    /// Jobs submitted and not yet reported, per direction (`[stores, loads]`), across all engines
    /// of this device: `Auto` uses it to pick methods that run well together.
    in_flight: [std::sync::atomic::AtomicU64; 2],
    /// Time of the last submission per direction, in µs since `epoch` (0 = never).
    last_submit_us: [std::sync::atomic::AtomicU64; 2],
    epoch: std::time::Instant,
    /// `Auto`'s calibration (measured or loaded once per process; `None` if disabled or failed).
    calibration: OnceLock<Option<Arc<Calibration>>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("sm_count", &self.sm_count)
            .field("batch_memcpy", &self.batch.is_some())
            .finish_non_exhaustive()
    }
}

static DEVICES: OnceLock<Mutex<Vec<Arc<CudaDevice>>>> = OnceLock::new();

/// Whether a CUDA driver can be loaded and reports at least one device.
#[must_use]
pub fn cuda_available() -> bool {
    device_count().is_ok_and(|n| n > 0)
}

/// Number of CUDA devices.
///
/// # Errors
/// [`KvoffError::CudaUnavailable`] without a driver; [`KvoffError::Cuda`] if `cuInit` fails.
pub fn device_count() -> Result<i32> {
    if !ffi::driver_present() {
        return Err(KvoffError::CudaUnavailable(
            "no CUDA driver (libcuda.so) could be loaded on this machine; use the host engine"
                .into(),
        ));
    }
    // SAFETY: the driver is present (obligation 1 of `init`).
    unsafe { ffi::init() }
        .map_err(|e| KvoffError::CudaUnavailable(format!("CUDA driver unusable: {e}")))
}

impl CudaDevice {
    /// Opens (once per process) device `ordinal`: retains its primary context and loads the kernel.
    ///
    /// # Errors
    /// [`KvoffError::CudaUnavailable`] without a driver or device; [`KvoffError::Cuda`] otherwise.
    pub fn open(ordinal: i32) -> Result<Arc<Self>> {
        let n = device_count()?;
        if ordinal < 0 || ordinal >= n {
            return Err(KvoffError::CudaUnavailable(format!(
                "CUDA device {ordinal} does not exist ({n} device(s))"
            )));
        }
        let cache = DEVICES.get_or_init(|| Mutex::new(Vec::new()));
        let mut devs = cache
            .lock()
            .map_err(|_| KvoffError::state("CUDA device cache poisoned"))?;
        if let Some(d) = devs.iter().find(|d| d.ordinal == ordinal) {
            return Ok(Arc::clone(d));
        }
        // SAFETY: init succeeded in device_count.
        let (dev, ctx, name, sm_count) = unsafe { ffi::open_device(ordinal) }?;
        // SAFETY: ctx was just retained.
        let loaded = unsafe { ffi::set_current(ctx) }.and_then(|()| {
            let ptx = std::ffi::CStr::from_bytes_with_nul(COPY_PTX.as_bytes())
                .map_err(|_| KvoffError::cuda("embedded PTX is not NUL-terminated"))?;
            // SAFETY: the context is current.
            unsafe { ffi::load_kernel(ptx, c"kvoff_copy") }
        });
        let loaded = loaded.and_then(|(m, k)| {
            // SAFETY: the module was just loaded in the current context.
            match unsafe { ffi::get_function(m, c"kvoff_sleep") }.and_then(|sl| {
                // SAFETY: as above.
                Ok((sl, unsafe { ffi::get_function(m, c"kvoff_copy_nc") }?))
            }) {
                Ok((sl, nc)) => Ok((m, k, sl, nc)),
                Err(e) => {
                    // SAFETY: loaded above, nothing launched.
                    let _ = unsafe { ffi::unload_module(m) };
                    Err(e)
                }
            }
        });
        let (module, kernel, sleep_kernel, kernel_nc) = match loaded {
            Ok(mk) => mk,
            Err(e) => {
                // SAFETY: retained above, released once.
                let _ = unsafe { ffi::release_device(dev) };
                return Err(e);
            }
        };
        // SAFETY: the driver is present.
        let batch = unsafe { ffi::memcpy_batch_fn() };
        let d = Arc::new(Self {
            ordinal,
            dev,
            ctx: SendPtr(ctx),
            module: SendPtr(module),
            kernel: SendPtr(kernel),
            kernel_nc: SendPtr(kernel_nc),
            sleep_kernel: SendPtr(sleep_kernel),
            batch,
            name,
            sm_count,
            in_flight: [
                std::sync::atomic::AtomicU64::new(0),
                std::sync::atomic::AtomicU64::new(0),
            ],
            last_submit_us: [
                std::sync::atomic::AtomicU64::new(0),
                std::sync::atomic::AtomicU64::new(0),
            ],
            epoch: std::time::Instant::now(),
            calibration: OnceLock::new(),
        });
        devs.push(Arc::clone(&d));
        Ok(d)
    }

    /// The calibration `Auto` uses on this device: loaded from the on-disk cache, or measured now
    /// (about a second, see the `calibrate` module) and cached. `None` when `KVOFF_CALIBRATION=off` or
    /// the measurement failed (then `Auto` uses its built-in thresholds).
    pub fn calibration(self: &Arc<Self>) -> Option<Arc<Calibration>> {
        self.calibration
            .get_or_init(|| {
                let mode = std::env::var("KVOFF_CALIBRATION").unwrap_or_default();
                if mode == "off" {
                    return None;
                }
                self.bind().ok()?;
                // SAFETY: the device was opened by `open`.
                let path = unsafe { ffi::device_identity(self.dev) }
                    .ok()
                    .and_then(|(uuid, driver)| calibrate::cache_path(&uuid, driver));
                if mode != "force" {
                    if let Some(c) = path
                        .as_ref()
                        .and_then(|p| std::fs::read_to_string(p).ok())
                        .and_then(|t| Calibration::from_text(&t))
                    {
                        return Some(Arc::new(c));
                    }
                }
                let c = calibrate::measure(self).ok()?;
                if let Some(p) = path {
                    if let Some(dir) = p.parent() {
                        let _ = std::fs::create_dir_all(dir);
                    }
                    // Write then rename, so a concurrent reader never sees half a file.
                    let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                    if std::fs::write(&tmp, c.to_text()).is_ok() {
                        let _ = std::fs::rename(&tmp, &p);
                    }
                }
                Some(Arc::new(c))
            })
            .clone()
    }

    /// Records a submission in `dir` (for [`CudaDevice::other_direction_active`]).
    fn note_submit(&self, dir: Direction) {
        use std::sync::atomic::Ordering::Relaxed;
        let i = dir_index(dir);
        self.in_flight[i].fetch_add(1, Relaxed);
        let now = u64::try_from(self.epoch.elapsed().as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        self.last_submit_us[i].store(now, Relaxed);
    }

    /// Whether the direction opposite to `dir` has jobs in flight or submitted one in the last
    /// 50 ms: stores and loads are then expected to overlap.
    fn other_direction_active(&self, dir: Direction) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let o = dir_index(dir) ^ 1;
        if self.in_flight[o].load(Relaxed) > 0 {
            return true;
        }
        let last = self.last_submit_us[o].load(Relaxed);
        let now = u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX);
        last != 0 && now.saturating_sub(last) < 50_000
    }

    /// Makes the primary context current on the calling thread.
    fn bind(&self) -> Result<()> {
        // SAFETY: the context stays retained while `self` lives.
        unsafe { ffi::set_current(self.ctx.0) }
    }

    /// Device name, e.g. "NVIDIA H100 80GB HBM3".
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of SMs.
    #[must_use]
    pub fn sm_count(&self) -> i32 {
        self.sm_count
    }

    /// Device ordinal.
    #[must_use]
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Whether the driver has `cuMemcpyBatchAsync`.
    #[must_use]
    pub fn has_batch_memcpy(&self) -> bool {
        self.batch.is_some()
    }

    /// Whether host address `ptr` is pinned and mapped for this device.
    ///
    /// # Errors
    /// If the context cannot be made current.
    pub fn host_ptr_is_mapped(&self, ptr: u64) -> Result<bool> {
        self.bind()?;
        // SAFETY: the context is current.
        Ok(unsafe { ffi::host_ptr_is_mapped(ptr) })
    }

    /// Whether `ptr` is device memory.
    ///
    /// # Errors
    /// If the context cannot be made current.
    pub fn is_device_ptr(&self, ptr: u64) -> Result<bool> {
        self.bind()?;
        // SAFETY: the context is current.
        Ok(unsafe { ffi::is_device_ptr(ptr) })
    }

    /// A [`HostRegistrar`] that page-locks region pieces for this device.
    #[must_use]
    pub fn registrar(self: &Arc<Self>) -> Arc<dyn HostRegistrar> {
        Arc::new(CudaRegistrar(Arc::clone(self)))
    }

    /// Creates a stream of this device (for callers without one, tests and benchmarks).
    ///
    /// # Errors
    /// A driver error.
    pub fn create_stream(self: &Arc<Self>) -> Result<CudaStream> {
        self.bind()?;
        // SAFETY: the context is current.
        let s = unsafe { ffi::stream_create(false) }?;
        Ok(CudaStream {
            device: Arc::clone(self),
            stream: SendPtr(s),
        })
    }

    /// Synchronizes the whole context (tests and benchmarks).
    ///
    /// # Errors
    /// A pending asynchronous error.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: the context is current.
        unsafe { ffi::ctx_sync() }
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Devices live in a process-wide cache; this runs only if the cache is torn down.
        if self.bind().is_ok() {
            // SAFETY: no engine holds the device any more (they hold an Arc), so no launch is in
            // flight; the module and context are released once.
            let _ = unsafe { ffi::unload_module(self.module.0) };
        }
        // SAFETY: retained in `open`, released once.
        let _ = unsafe { ffi::release_device(self.dev) };
        let _ = self.kernel.0;
    }
}

/// Page-locks host memory for a device (`cuMemHostRegister`, portable + device-mapped).
struct CudaRegistrar(Arc<CudaDevice>);

impl HostRegistrar for CudaRegistrar {
    fn register(&self, ptr: u64, len: u64) -> Result<()> {
        self.0.bind()?;
        // SAFETY: the region guarantees the range is mapped until `unregister` (its contract).
        unsafe { ffi::host_register(ptr, len) }
    }

    fn unregister(&self, ptr: u64, _len: u64) -> Result<()> {
        self.0.bind()?;
        // SAFETY: registered by `register`; the region unregisters only when no job uses it.
        unsafe { ffi::host_unregister(ptr) }
    }
}

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
    /// Serving policy: average copy size from which `Auto` uses batched DMA.
    pub serving_dma_min_copy_bytes: u64,
    /// Serving policy: smaller copies go through the bounded copy kernel (`serving_ctas`,
    /// `serving_launch_bytes`) instead of the staged pipeline (measured slower beside compute;
    /// kept for the benchmark's comparison).
    pub serving_small_kernel: bool,
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
            serving_dma_min_copy_bytes: 32 << 10,
            serving_small_kernel: false,
            serving_ctas: 0,
            serving_launch_bytes: 1 << 20,
        }
    }
}

impl CudaEngineConfig {
    /// Whether the serving (budgeted) policy is on: `Auto` with a compute budget (an explicit
    /// method runs as configured).
    #[must_use]
    pub fn serving(&self) -> bool {
        self.method == CopyMethod::Auto && self.compute_budget_bp.is_some()
    }

    /// Applies `KVOFF_CUDA_TUNE` overrides (`key=value` pairs separated by commas; keys `budget`
    /// (basis points, or `off`), `batch`, `ctas`, `max_ctas`, `launch`, `dmamin`, `small`
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
                "ctas" => self.serving_ctas = u32::try_from(num(v)?).unwrap_or(u32::MAX),
                "max_ctas" => self.max_ctas = u32::try_from(num(v)?).unwrap_or(u32::MAX).max(1),
                "launch" => self.serving_launch_bytes = num(v)?.max(4096),
                "dmamin" => self.serving_dma_min_copy_bytes = num(v)?,
                "small" => self.serving_small_kernel = v == "kernel",
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

/// A pinned staging buffer plus a device buffer for kernel descriptors.
struct DescBuf {
    host: PinnedHost,
    dev: DevMem,
    cap: usize,
}

/// CPU-side preparation of a job (see `CudaEngine::prepare`).
enum Prepared {
    /// Nothing to prepare (DMA, loop, empty job).
    Nothing,
    /// Kernel descriptors in a pinned buffer.
    /// Kernel descriptors in a pinned buffer sized for the whole job; those of the first `head`
    /// copies (`head_n` descriptors) are written, the rest are written at issue time while the
    /// device already copies the head.
    Kernel {
        buf: DescBuf,
        head: usize,
        head_n: usize,
    },
    /// A staged job: a pinned descriptor buffer sized for the whole job; the chunks are packed
    /// and enqueued one by one at issue time, so the device starts on the first chunk while the
    /// CPU packs the next.
    Staged {
        buf: DescBuf,
        n_chunks: usize,
        first_slot: usize,
    },
}

/// Resources of one submitted job.
struct InFlight {
    job_id: i64,
    bytes: u64,
    direction: Direction,
    start: Event,
    end: Event,
    desc: Option<DescBuf>,
    method: CopyMethod,
    /// Error at submission: the job is reported failed in its turn.
    failed: Option<String>,
}

/// One device staging slot of the `Staged` method. A slot is always used by the same stream
/// (even slots: the engine's stream; odd slots: the auxiliary stream), so stream order alone keeps
/// a chunk from overwriting a slot before its previous chunk was consumed.
struct Slot {
    dev: DevMem,
}

/// Second stream and staging ring of the `Staged` method (created on first use).
struct Staging {
    aux: Stream,
    fork: Event,
    join: Event,
    slots: Vec<Slot>,
    next: usize,
}

/// Index of a direction in per-direction arrays.
const fn dir_index(d: Direction) -> usize {
    match d {
        Direction::GpuToCpu => 0,
        Direction::CpuToGpu => 1,
    }
}

/// Number of host-contiguous runs of a job, in emission order (O(n), no allocation): a run
/// continues while each copy's host address follows the previous copy's end. kvoff's planner emits
/// copies block-major, so one CPU block's pages of all tensors form one run.
fn host_runs(direction: Direction, copies: &[CopyOp]) -> u64 {
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

/// Copies of a kernel job whose descriptors are written before its start event; the rest are
/// written while the device copies these (a head of a few hundred microseconds of work).
const KERNEL_HEAD_COPIES: usize = 2048;

/// Writes the kernel descriptors of `copies` (pieces of at most [`KERNEL_CHUNK_BYTES`]) into
/// `buf`'s pinned host side from descriptor `first` on; returns how many were written.
fn write_kernel_descs(copies: &[CopyOp], buf: &DescBuf, first: usize) -> Result<usize> {
    let cap = buf.cap / DESC_BYTES;
    // SAFETY: `buf.host` is a pinned allocation of `buf.cap` bytes (8-byte aligned, from
    // cuMemAllocHost) owned by the job being prepared; descriptors from `first` on are not
    // read by the device until they are uploaded after this returns, and nothing else aliases
    // this memory while the slice lives.
    let words = unsafe { std::slice::from_raw_parts_mut(buf.host.ptr().cast::<u64>(), cap * 3) };
    let mut out = words
        .get_mut(first * 3..)
        .unwrap_or_default()
        .chunks_exact_mut(3);
    let mut n = 0usize;
    for c in copies {
        let mut off = 0;
        loop {
            let len = (c.bytes - off).min(KERNEL_CHUNK_BYTES);
            let d = out.next().ok_or_else(|| {
                KvoffError::state("kernel descriptor buffer too small (a kvoff bug)")
            })?;
            d.copy_from_slice(&[c.src_ptr + off, c.dst_ptr + off, len]);
            n += 1;
            off += len;
            if off >= c.bytes {
                break;
            }
        }
    }
    Ok(n)
}

/// The CUDA engine of one direction (one handler): its stream, event pool and in-flight FIFO.
pub struct CudaEngine {
    device: Arc<CudaDevice>,
    cfg: CudaEngineConfig,
    direction: Direction,
    /// `None` once shut down (released).
    stream: Option<Stream>,
    /// `None` once shut down (released).
    caller_event: Option<Event>,
    events: Vec<Event>,
    descs: Vec<DescBuf>,
    inflight: VecDeque<InFlight>,
    closed: bool,
    close_errors: Vec<String>,
    /// Jobs per method since creation: `[dma, kernel, loop, staged]` (see `method_counts()`).
    method_counts: [u64; 4],
    last_ctas: u32,
    /// Largest grid launched by the current `submit` (for [`SubmitStats::sms`]).
    submit_grid: u32,
    last_stats: SubmitStats,
    staging: Option<Staging>,
    /// Reused argument arrays of the batch call: sources, destinations, sizes.
    scratch_dma: (Vec<u64>, Vec<u64>, Vec<usize>),
    scratch_runs: Vec<(u64, u64, u64)>,
    last_pack_ns: u64,
    last_submit_ns: u64,
    /// Results of jobs drained by `shutdown`, returned by the next `poll`.
    drained: Vec<JobResult>,
    /// The device's calibration when `method` is `Auto` and calibration is on.
    calibration: Option<Arc<Calibration>>,
}

impl std::fmt::Debug for CudaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEngine")
            .field("device", &self.device)
            .field("direction", &self.direction)
            .field("cfg", &self.cfg)
            .field("in_flight", &self.inflight.len())
            .finish_non_exhaustive()
    }
}

impl CudaEngine {
    /// An engine for one direction on `device`. Loads (`CpuToGpu`) get the highest stream priority,
    /// stores the lowest.
    ///
    /// # Errors
    /// [`KvoffError::Cuda`] if the stream or events cannot be created.
    pub fn new(
        device: Arc<CudaDevice>,
        direction: Direction,
        mut cfg: CudaEngineConfig,
    ) -> Result<Self> {
        if let Ok(spec) = std::env::var("KVOFF_CUDA_TUNE") {
            cfg.apply_tuning(&spec)?;
        }
        if cfg.max_ctas == 0 {
            return Err(KvoffError::arg("max_ctas must be at least 1"));
        }
        if cfg.kernel_threads == 0
            || cfg.kernel_threads % 32 != 0
            || cfg.kernel_threads > MAX_KERNEL_THREADS
        {
            return Err(KvoffError::arg(format!(
                "kernel_threads must be a multiple of 32 in 32..={MAX_KERNEL_THREADS}, got {}",
                cfg.kernel_threads
            )));
        }
        if cfg.staging_slots == 0 || cfg.staging_slot_bytes < 1 << 16 {
            return Err(KvoffError::arg(
                "staging needs at least one slot of at least 64 KiB",
            ));
        }
        let calibration = if cfg.method == CopyMethod::Auto && cfg.calibrate {
            device.calibration()
        } else {
            None
        };
        device.bind()?;
        // Beside a model (serving policy) both directions take the lowest priority, so that the
        // model's pending CTAs are scheduled before the copy kernel's.
        let high = direction == Direction::CpuToGpu && !cfg.serving();
        // SAFETY: the context is current.
        let stream = unsafe { Stream::new(high) }?;
        // SAFETY: as above. (On error `stream` is destroyed by its Drop.)
        let caller_event = unsafe { Event::new(false) }?;
        Ok(Self {
            device,
            cfg,
            direction,
            stream: Some(stream),
            caller_event: Some(caller_event),
            events: Vec::new(),
            descs: Vec::new(),
            inflight: VecDeque::new(),
            closed: false,
            close_errors: Vec::new(),
            method_counts: [0; 4],
            last_ctas: 0,
            submit_grid: 0,
            last_stats: SubmitStats::default(),
            staging: None,
            scratch_dma: (Vec::new(), Vec::new(), Vec::new()),
            scratch_runs: Vec::new(),
            last_pack_ns: 0,
            last_submit_ns: 0,
            drained: Vec::new(),
            calibration,
        })
    }

    /// The device.
    #[must_use]
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Settings.
    #[must_use]
    pub fn config(&self) -> &CudaEngineConfig {
        &self.cfg
    }

    /// Jobs run per method since creation: `[dma (batched, or per-copy loop without the batch API),
    /// kernel, loop, staged]`.
    #[must_use]
    pub fn method_counts(&self) -> [u64; 4] {
        self.method_counts
    }

    /// CPU time of the last `submit` and of its staged packing, in nanoseconds.
    #[must_use]
    pub fn last_submit_timing_ns(&self) -> (u64, u64) {
        (self.last_submit_ns, self.last_pack_ns)
    }

    /// CTAs used by the last kernel job (0 if none ran).
    #[must_use]
    pub fn last_kernel_ctas(&self) -> u32 {
        self.last_ctas
    }

    /// Raw handle of this engine's stream (as an integer, e.g. for `torch.cuda.ExternalStream`).
    #[must_use]
    pub fn stream_handle(&self) -> u64 {
        self.stream.as_ref().map_or(0, |s| s.raw() as u64)
    }

    /// Errors recorded while releasing resources.
    #[must_use]
    pub fn close_errors(&self) -> &[String] {
        &self.close_errors
    }

    fn take_event(&mut self) -> Result<Event> {
        if let Some(e) = self.events.pop() {
            return Ok(e);
        }
        // SAFETY: callers bind the context first.
        unsafe { Event::new(true) }
    }

    /// The engine's stream (the engine is open: `submit`, `poll` and `wait` check first).
    fn stream(&self) -> Result<ffi::CUstream> {
        self.stream
            .as_ref()
            .map(Stream::raw)
            .ok_or_else(|| KvoffError::state("the CUDA engine was shut down"))
    }

    fn take_desc(&mut self, bytes: usize) -> Result<DescBuf> {
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

    fn choose(&self, copies: &[CopyOp], bytes: u64) -> CopyMethod {
        match self.cfg.method {
            CopyMethod::Auto if self.cfg.serving() => {
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

    /// Creates the second stream, the fork/join events and the staging slots on first use.
    fn ensure_staging(&mut self) -> Result<()> {
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
    fn release_staging(&mut self) {
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

    /// CTAs of a copy-kernel job: `max_ctas`, or under the serving policy `serving_ctas` (or,
    /// when 0, about 1.5 × budget × SMs: 4 CTAs of an H100's 132 SMs at 2%).
    fn kernel_ctas(&self) -> u32 {
        match self.cfg.compute_budget_bp {
            _ if !self.cfg.serving() => self.cfg.max_ctas,
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
    fn launch(&mut self, descs: u64, n: u64, max_ctas: u32, s: ffi::CUstream) -> Result<()> {
        let warps_per_cta = u64::from(self.cfg.kernel_threads / 32);
        let grid = u32::try_from(n.div_ceil(warps_per_cta).min(u64::from(max_ctas)))
            .unwrap_or(1)
            .max(1);
        self.last_ctas = grid;
        self.submit_grid = self.submit_grid.max(grid);
        // SAFETY: descriptors live in a device buffer held by the job; they name memory the plan
        // validated and the caller keeps alive (TransferEngine::submit contract), or staging slots
        // owned by this engine.
        let f = if self.cfg.read_only_loads {
            self.device.kernel_nc.0
        } else {
            self.device.kernel.0
        };
        // SAFETY: as above; both kernels take the same parameters.
        unsafe { ffi::launch_copy(f, grid, self.cfg.kernel_threads, descs, n, s) }
    }

    /// Batched DMA of `(src, dst, bytes)` triples on `s` (a per-copy loop without the batch API).
    fn dma(
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

    /// CPU side of the `Staged` method (see [`CopyMethod::Staged`]) before the start event: the
    /// staging ring and a pinned descriptor buffer large enough for the whole job. The chunks are
    /// packed at issue time ([`CudaEngine::enqueue_staged`]).
    fn prepare_staged(&mut self, copies: &[CopyOp], total: u64) -> Result<Prepared> {
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
        })
    }

    /// Enqueues a staged job on the main stream `s` and the auxiliary stream (forked from `s` and
    /// joined back into it, also after an error, so the job's end event covers both): per chunk,
    /// packs its descriptors straight into the job's pinned buffer (the kernel reads them from
    /// there, through the device mapping of pinned memory), then enqueues the kernel and the
    /// batched DMA of its runs, handing the slot between the streams with events. The device
    /// works on chunk `k` while the CPU packs chunk `k + 1`.
    fn enqueue_staged(
        &mut self,
        copies: &[CopyOp],
        buf: &DescBuf,
        n_chunks: usize,
        first_slot: usize,
        s: ffi::CUstream,
    ) -> Result<()> {
        let (aux, fork, join) = {
            let st = self
                .staging
                .as_ref()
                .ok_or_else(|| KvoffError::state("staging missing"))?;
            (st.aux.raw(), st.fork.raw(), st.join.raw())
        };
        // SAFETY: live handles of the current context.
        unsafe {
            ffi::event_record(fork, s)?;
            ffi::stream_wait(aux, fork)?;
        }
        let r = self.enqueue_staged_chunks(copies, buf, n_chunks, first_slot, s, aux);
        // SAFETY: as above.
        let j = unsafe { ffi::event_record(join, aux).and_then(|()| ffi::stream_wait(s, join)) };
        r.and(j)
    }

    #[allow(clippy::too_many_arguments)] // the two streams and the job's parts
    fn enqueue_staged_chunks(
        &mut self,
        copies: &[CopyOp],
        buf: &DescBuf,
        n_chunks: usize,
        first_slot: usize,
        s: ffi::CUstream,
        aux: ffi::CUstream,
    ) -> Result<()> {
        let d2h = self.direction == Direction::GpuToCpu;
        let cap = self.cfg.staging_slot_bytes;
        let slots: Vec<u64> = self
            .staging
            .as_ref()
            .ok_or_else(|| KvoffError::state("staging missing"))?
            .slots
            .iter()
            .map(|sl| sl.dev.ptr())
            .collect();
        let nslots = slots.len();
        if nslots == 0 {
            return Err(KvoffError::state("no staging slots"));
        }
        // Two kernels (one per stream) may run at once: each gets half the CTA budget.
        let ctas = (self.cfg.max_ctas / 2).max(1);
        // SAFETY: `buf.host` is a pinned allocation of `buf.cap` bytes (8-byte aligned, from
        // cuMemAllocHost) owned by this job and used by nothing else until the job completes;
        // nothing else aliases it while this slice lives. The kernel reads a chunk's descriptors
        // only after they were written here (its launch is enqueued afterwards).
        let words =
            unsafe { std::slice::from_raw_parts_mut(buf.host.ptr().cast::<u64>(), buf.cap / 8) };
        let host_base = buf.host.ptr() as u64;
        let mut runs = std::mem::take(&mut self.scratch_runs);
        let mut packer = StagedPacker::default();
        let mut nd = 0usize;
        let mut pack = std::time::Duration::ZERO;
        let r = (|| {
            for k in 0..n_chunks {
                let slot = (first_slot + k) % nslots;
                // Chunks alternate between the two streams: while one stream gathers (scatters)
                // a chunk with the kernel, the other moves its chunk over PCIe, and each stream
                // runs its own chunks strictly in order.
                let st = if slot % 2 == 0 { s } else { aux };
                let t = std::time::Instant::now();
                let d0 = nd;
                let got = packer
                    .pack_chunk(
                        copies,
                        d2h,
                        staged_chunk_len(k, cap),
                        slots[slot],
                        words,
                        &mut nd,
                        &mut runs,
                    )
                    .ok_or_else(|| {
                        KvoffError::state("staged descriptor buffer too small (a kvoff bug)")
                    })?;
                pack += t.elapsed();
                if got == 0 {
                    break;
                }
                let kdesc = host_base + (d0 * DESC_BYTES) as u64;
                let ndesc = (nd - d0) as u64;
                if d2h {
                    self.launch(kdesc, ndesc, ctas, st)?;
                    self.dma(runs.iter().copied(), false, st)?;
                } else {
                    self.dma(runs.iter().copied(), true, st)?;
                    self.launch(kdesc, ndesc, ctas, st)?;
                }
            }
            Ok(())
        })();
        self.scratch_runs = runs;
        self.last_pack_ns = u64::try_from(pack.as_nanos()).unwrap_or(u64::MAX);
        r
    }

    /// CPU-side work of a job before its start event: buffers, and the kernel descriptors of the
    /// job's head. The rest (the kernel job's tail, the staged chunks) is written while the device
    /// already works on what was enqueued, so a job starts after a few microseconds of CPU work;
    /// the device-timed `transfer_time` still covers device work only as long as the CPU keeps
    /// ahead of the device (it packs several times faster than PCIe moves the bytes).
    fn prepare(&mut self, method: CopyMethod, copies: &[CopyOp], total: u64) -> Result<Prepared> {
        if copies.is_empty() {
            return Ok(Prepared::Nothing);
        }
        match method {
            CopyMethod::Staged => self.prepare_staged(copies, total),
            CopyMethod::Kernel => {
                if !self.cfg.host_mapped {
                    return Err(KvoffError::arg(
                        "the copy kernel needs pinned, device-mapped host memory; use engine \"dma\" or pin the region",
                    ));
                }
                let bound = usize::try_from(total / KERNEL_CHUNK_BYTES)
                    .unwrap_or(usize::MAX)
                    .saturating_add(copies.len());
                let nbytes = bound
                    .checked_mul(DESC_BYTES)
                    .ok_or_else(|| KvoffError::arg("too many copies for one job"))?;
                let buf = self.take_desc(nbytes)?;
                let head = copies.len().min(KERNEL_HEAD_COPIES);
                let head_n = write_kernel_descs(&copies[..head], &buf, 0)?;
                Ok(Prepared::Kernel { buf, head, head_n })
            }
            CopyMethod::Dma | CopyMethod::Auto | CopyMethod::Loop => Ok(Prepared::Nothing),
        }
    }

    /// Uploads descriptors `first..first + n` of a kernel job's pinned buffer to its device buffer
    /// and launches the copy kernel over them.
    fn upload_and_launch(
        &mut self,
        buf: &DescBuf,
        first: usize,
        n: usize,
        s: ffi::CUstream,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let off = first * DESC_BYTES;
        // SAFETY: the pinned buffer holds these descriptors and stays untouched until this job
        // completes (it travels with the job; later writes go to other descriptors); the device
        // buffer is as large.
        unsafe {
            ffi::memcpy_htod_async(
                buf.dev.ptr() + off as u64,
                buf.host.ptr().cast::<u8>().add(off).cast(),
                n * DESC_BYTES,
                s,
            )
        }?;
        let ctas = self.kernel_ctas();
        if !self.cfg.serving() {
            return self.launch(buf.dev.ptr() + off as u64, n as u64, ctas, s);
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
                buf.dev.ptr() + (i * DESC_BYTES) as u64,
                (j - i) as u64,
                ctas,
                s,
            )?;
            i = j;
        }
        Ok(())
    }

    /// Enqueues the device work of one job on the stream (between the timing events).
    fn issue(&mut self, method: CopyMethod, copies: &[CopyOp], prep: &Prepared) -> Result<()> {
        let s = self.stream()?;
        match prep {
            Prepared::Kernel { buf, head, head_n } => {
                self.upload_and_launch(buf, 0, *head_n, s)?;
                if *head < copies.len() {
                    let t = std::time::Instant::now();
                    let tail_n = write_kernel_descs(&copies[*head..], buf, *head_n)?;
                    self.last_pack_ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    self.upload_and_launch(buf, *head_n, tail_n, s)?;
                }
                Ok(())
            }
            Prepared::Staged {
                buf,
                n_chunks,
                first_slot,
            } => {
                let r = self.enqueue_staged(copies, buf, *n_chunks, *first_slot, s);
                if let Some(st) = self.staging.as_mut() {
                    st.next = (first_slot + n_chunks) % st.slots.len().max(1);
                }
                r
            }
            Prepared::Nothing => match method {
                CopyMethod::Dma | CopyMethod::Auto => self.dma(
                    copies.iter().map(|c| (c.src_ptr, c.dst_ptr, c.bytes)),
                    self.direction == Direction::CpuToGpu,
                    s,
                ),
                CopyMethod::Loop => {
                    for c in copies {
                        // SAFETY: memory validated by the plan and kept alive by the caller.
                        unsafe { ffi::memcpy_async(c.dst_ptr, c.src_ptr, c.bytes, s) }?;
                    }
                    Ok(())
                }
                CopyMethod::Kernel | CopyMethod::Staged => Ok(()),
            },
        }
    }

    fn finish(&mut self, job: InFlight, error: Option<String>) -> JobResult {
        self.device.in_flight[dir_index(self.direction)]
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        let mut seconds = 0.0;
        let mut error = error.or(job.failed);
        if error.is_none() {
            // SAFETY: both events completed (the end event was queried done, and the start event
            // precedes it on the same stream).
            match unsafe { ffi::event_elapsed_ms(job.start.raw(), job.end.raw()) } {
                Ok(ms) => seconds = f64::from(ms) / 1e3,
                Err(e) => error = Some(e.to_string()),
            }
        }
        self.events.push(job.start);
        self.events.push(job.end);
        if let Some(d) = job.desc {
            self.descs.push(d);
        }
        let _ = job.method;
        JobResult {
            job_id: job.job_id,
            success: error.is_none(),
            bytes: job.bytes, // the plan's total, as every engine reports it (JobResult docs)
            seconds,
            direction: job.direction,
            error,
        }
    }

    fn check_open(&self) -> Result<()> {
        if self.closed {
            return Err(KvoffError::state("the CUDA engine was shut down"));
        }
        Ok(())
    }
}

impl TransferEngine for CudaEngine {
    /// # Safety
    /// See [`TransferEngine::submit`]: every copy names memory that stays valid until the job is
    /// reported finished; host memory must be device-mapped for the kernel method.
    unsafe fn submit(&mut self, job: Job) -> Result<()> {
        self.check_open()?;
        if job.plan.direction() != self.direction {
            return Err(KvoffError::arg(format!(
                "this engine moves {:?}, the job is {:?}",
                self.direction,
                job.plan.direction()
            )));
        }
        if self.inflight.iter().any(|j| j.job_id == job.job_id) {
            return Err(KvoffError::arg(format!(
                "job id {} is already in flight",
                job.job_id
            )));
        }
        let t_submit = std::time::Instant::now();
        self.last_pack_ns = 0;
        self.submit_grid = 0;
        let _ = ffi::take_call_record();
        self.device.bind()?;
        let start = self.take_event()?;
        let end = match self.take_event() {
            Ok(e) => e,
            Err(e) => {
                self.events.push(start);
                return Err(e);
            }
        };
        let copies = job.plan.copies();
        let bytes = job.plan.total_bytes();
        let method = self.choose(copies, bytes);
        let (Ok(s), Some(caller_event)) =
            (self.stream(), self.caller_event.as_ref().map(Event::raw))
        else {
            self.events.push(start);
            self.events.push(end);
            return Err(KvoffError::state("the CUDA engine was shut down"));
        };
        let prepared = match self.prepare(method, copies, bytes) {
            Ok(p) => p,
            Err(e) => {
                self.events.push(start);
                self.events.push(end);
                return Err(e);
            }
        };
        let r = (|| {
            if let Some(caller) = job.stream {
                // SAFETY: the caller passes a live stream of this device (the torch shim passes
                // torch.cuda.current_stream()); the event is ours.
                unsafe { ffi::event_record(caller_event, caller as ffi::CUstream) }?;
                // SAFETY: both are live handles of the current context.
                unsafe { ffi::stream_wait(s, caller_event) }?;
            }
            // SAFETY: live events and stream.
            unsafe { ffi::event_record(start.raw(), s) }?;
            self.issue(method, copies, &prepared)?;
            // SAFETY: as above.
            unsafe { ffi::event_record(end.raw(), s) }
        })();
        let idx = match method {
            CopyMethod::Kernel => 1,
            CopyMethod::Loop => 2,
            CopyMethod::Staged => 3,
            CopyMethod::Dma | CopyMethod::Auto => usize::from(self.device.batch.is_none()) * 2,
        };
        self.method_counts[idx] += 1;
        self.inflight.push_back(InFlight {
            job_id: job.job_id,
            bytes,
            direction: self.direction,
            start,
            end,
            desc: match prepared {
                Prepared::Kernel { buf, .. } | Prepared::Staged { buf, .. } => Some(buf),
                Prepared::Nothing => None,
            },
            method,
            failed: r.err().map(|e| e.to_string()),
        });
        self.device.note_submit(self.direction);
        self.last_submit_ns = u64::try_from(t_submit.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let (driver_calls, longest_call_ns) = ffi::take_call_record();
        // A staged job's chunks alternate between two streams, so two of its kernels may run at once.
        let concurrent = if method == CopyMethod::Staged
            && staged_chunk_count(bytes, self.cfg.staging_slot_bytes) > 1
        {
            2
        } else {
            1
        };
        let sms = u32::try_from(self.device.sm_count()).unwrap_or(u32::MAX);
        self.last_stats = SubmitStats {
            method: Some(match method {
                CopyMethod::Dma | CopyMethod::Auto if self.device.batch.is_none() => "loop",
                m => m.name(),
            }),
            sms: (self.submit_grid * concurrent).min(sms),
            submit_ns: self.last_submit_ns,
            longest_call_ns,
            driver_calls,
        };
        Ok(())
    }

    fn poll(&mut self) -> Vec<JobResult> {
        let mut out = std::mem::take(&mut self.drained);
        if self.closed {
            return out;
        }
        if self.device.bind().is_err() {
            return out;
        }
        while let Some(front) = self.inflight.front() {
            let state = if front.failed.is_some() {
                Ok(true)
            } else {
                // SAFETY: a live pooled event.
                unsafe { ffi::event_done(front.end.raw()) }
            };
            match state {
                Ok(false) => break,
                Ok(true) => {
                    if let Some(job) = self.inflight.pop_front() {
                        out.push(self.finish(job, None));
                    }
                }
                Err(e) => {
                    if let Some(job) = self.inflight.pop_front() {
                        out.push(self.finish(job, Some(e.to_string())));
                    }
                }
            }
        }
        out
    }

    fn wait(&mut self, job_ids: &[i64]) -> Result<()> {
        self.device.bind()?;
        for j in &self.inflight {
            if j.failed.is_none() && job_ids.contains(&j.job_id) {
                // SAFETY: a live pooled event. Errors surface in the job's result at poll.
                let _ = unsafe { ffi::event_sync(j.end.raw()) };
            }
        }
        Ok(())
    }

    fn last_submit_stats(&self) -> SubmitStats {
        self.last_stats
    }

    fn shutdown(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        if let Err(e) = self.device.bind() {
            self.close_errors.push(e.to_string());
            return;
        }
        // Drain: let in-flight work finish before its resources go.
        if let Some(s) = &self.stream {
            // SAFETY: our streams are live.
            if let Err(e) = unsafe { ffi::stream_sync(s.raw()) } {
                self.close_errors.push(e.to_string());
            }
        }
        if let Some(st) = &self.staging {
            // SAFETY: as above.
            if let Err(e) = unsafe { ffi::stream_sync(st.aux.raw()) } {
                self.close_errors.push(e.to_string());
            }
        }
        self.release_staging();
        // Keep the drained jobs' results for `poll` (the TransferEngine contract: shutdown
        // completes in-flight jobs or reports them failed).
        while let Some(job) = self.inflight.pop_front() {
            let err = if job.failed.is_some() {
                None
            } else {
                // SAFETY: a live pooled event; the stream has drained.
                match unsafe { ffi::event_done(job.end.raw()) } {
                    Ok(true) => None,
                    Ok(false) => Some("the job did not finish before shutdown".to_owned()),
                    Err(e) => Some(e.to_string()),
                }
            };
            let r = self.finish(job, err);
            self.drained.push(r);
        }
        // Everything below is unused once the streams drained; each handle is released once.
        let mut errs: Vec<Result<()>> = self.events.drain(..).map(Event::release).collect();
        for d in self.descs.drain(..) {
            errs.push(d.dev.release());
            errs.push(d.host.release());
        }
        errs.extend(self.caller_event.take().map(Event::release));
        errs.extend(self.stream.take().map(Stream::release));
        self.close_errors.extend(
            errs.into_iter()
                .filter_map(|r| r.err().map(|e| e.to_string())),
        );
    }
}

impl CudaEngine {
    /// Jobs submitted and not yet reported by `poll`.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod config_tests {
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
            "budget=150, batch=32,ctas=3,max_ctas=8,launch=65536,dmamin=4096,small=kernel",
        )
        .unwrap();
        assert_eq!(c.compute_budget_bp, Some(150));
        assert_eq!(c.max_batch_copies, 32);
        assert_eq!(c.serving_ctas, 3);
        assert_eq!(c.max_ctas, 8);
        assert_eq!(c.serving_launch_bytes, 65536);
        assert_eq!(c.serving_dma_min_copy_bytes, 4096);
        assert!(c.serving_small_kernel);
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
