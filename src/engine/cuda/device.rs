//! One CUDA device: its primary context, the loaded kernels, the batched-copy entry point, the
//! per-direction activity that `Auto` reads, and host-memory registration ([`HostRegistrar`]).
// Unsafe: driver calls through `ffi` on handles this engine owns (each block says why it is sound).
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex, OnceLock};

use super::calibration::Calibration;
use super::ffi;
use super::handles::{Module, PrimaryCtx, SendPtr};
use super::pace::StagedPacer;
use crate::error::{KvoffError, Result};
use crate::plan::Direction;
use crate::region::HostRegistrar;

/// PTX of `kernels/copy.cu` (built by `kernels/build_ptx.py`).
pub(super) const COPY_PTX: &str = concat!(include_str!("../../../kernels/copy.ptx"), "\0");

/// Index of a direction in per-direction arrays.
pub(super) const fn dir_index(d: Direction) -> usize {
    match d {
        Direction::GpuToCpu => 0,
        Direction::CpuToGpu => 1,
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

/// One CUDA device's primary context (the one torch uses), the loaded copy kernel and the optional
/// batched-copy entry point. Shared by the engines of one device.
pub struct CudaDevice {
    pub(super) ordinal: i32,
    pub(super) dev: ffi::CUdevice,
    /// Fields drop in declaration order: the module (unloaded in the context `Drop` binds) before
    /// the context it lives in (released).
    pub(super) module: Module,
    pub(super) ctx: PrimaryCtx,
    pub(super) kernel: SendPtr<ffi::CUfunction>,
    pub(super) kernel_nc: SendPtr<ffi::CUfunction>,
    pub(super) sleep_kernel: SendPtr<ffi::CUfunction>,
    pub(super) batch: Option<ffi::MemcpyBatchFn>,
    pub(super) name: String,
    pub(super) sm_count: i32,
    /// Jobs submitted and not yet reported, per direction (`[stores, loads]`), across all engines
    /// of this device: `Auto` uses it to pick methods that run well together.
    pub(super) in_flight: [std::sync::atomic::AtomicU64; 2],
    /// Time of the last submission per direction, in µs since `epoch` (0 = never).
    pub(super) last_submit_us: [std::sync::atomic::AtomicU64; 2],
    /// When an engine of this device last saw the model's stream (a job's ordering stream or a
    /// watched compute stream) with unfinished work, in µs since `epoch` (0 = never).
    pub(super) compute_seen_us: std::sync::atomic::AtomicU64,
    pub(super) epoch: std::time::Instant,
    /// `Auto`'s calibration (measured or loaded once per process; `None` if disabled or failed).
    pub(super) calibration: OnceLock<Option<Arc<Calibration>>>,
    /// Peak device-memory bandwidth, GB/s (from the memory clock and bus width; `None` where the
    /// driver reports neither): sizes the serving policy's staged-pipeline cap.
    pub(super) memory_peak_gbps: Option<f64>,
    /// The serving policy's token bucket for the staged pipeline of both directions (`pace`).
    pub(super) staged_pacer: Arc<StagedPacer>,
    /// kvoff's share of the driver beside a model that launches eagerly (`share`).
    pub(super) driver: super::share::DriverShare,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("sm_count", &self.sm_count)
            .field("batch_memcpy", &self.batch.is_some())
            .field("memory_peak_gbps", &self.memory_peak_gbps)
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
        // On an error below, `module` (if loaded) and then `ctx` drop: unloaded, then released.
        // SAFETY: init succeeded in device_count.
        let (ctx, name, sm_count) = unsafe { PrimaryCtx::open(ordinal) }?;
        let dev = ctx.dev();
        // SAFETY: ctx was just retained.
        unsafe { ffi::set_current(ctx.raw()) }?;
        let ptx = std::ffi::CStr::from_bytes_with_nul(COPY_PTX.as_bytes())
            .map_err(|_| KvoffError::cuda("embedded PTX is not NUL-terminated"))?;
        // SAFETY: the context is current.
        let (module, kernel) = unsafe { Module::load(ptx, c"kvoff_copy") }?;
        // SAFETY: the context is current.
        let sleep_kernel = unsafe { module.function(c"kvoff_sleep") }?;
        // SAFETY: the context is current.
        let kernel_nc = unsafe { module.function(c"kvoff_copy_nc") }?;
        // SAFETY: the driver is present.
        let batch = unsafe { ffi::memcpy_batch_fn() };
        // SAFETY: `dev` was opened above.
        let memory_peak_gbps = unsafe { ffi::memory_peak_gbps(dev) };
        let d = Arc::new(Self {
            ordinal,
            dev,
            module,
            ctx,
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
            compute_seen_us: std::sync::atomic::AtomicU64::new(0),
            epoch: std::time::Instant::now(),
            calibration: OnceLock::new(),
            memory_peak_gbps,
            staged_pacer: StagedPacer::new(),
            driver: super::share::DriverShare::default(),
        });
        devs.push(Arc::clone(&d));
        Ok(d)
    }

    /// Microseconds since `epoch` (the clock of the activity timestamps; 0 means "never").
    fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Records a submission in `dir` (for [`CudaDevice::other_direction_active`]).
    pub(super) fn note_submit(&self, dir: Direction) {
        use std::sync::atomic::Ordering::Relaxed;
        let i = dir_index(dir);
        self.in_flight[i].fetch_add(1, Relaxed);
        let now = self.now_us().max(1);
        self.last_submit_us[i].store(now, Relaxed);
    }

    /// Whether the direction opposite to `dir` has jobs in flight or submitted one in the last
    /// 50 ms: stores and loads are then expected to overlap.
    pub(super) fn other_direction_active(&self, dir: Direction) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let o = dir_index(dir) ^ 1;
        if self.in_flight[o].load(Relaxed) > 0 {
            return true;
        }
        let last = self.last_submit_us[o].load(Relaxed);
        let now = self.now_us();
        busy_within(last, now, 50_000)
    }

    /// Records that the model was seen computing now (see [`CudaDevice::compute_seen_within`]).
    pub(super) fn note_compute(&self) {
        let now = self.now_us().max(1);
        self.compute_seen_us
            .fetch_max(now, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the model was seen computing within the last `window_us` µs.
    pub(super) fn compute_seen_within(&self, window_us: u64) -> bool {
        let last = self
            .compute_seen_us
            .load(std::sync::atomic::Ordering::Relaxed);
        let now = self.now_us();
        busy_within(last, now, window_us)
    }

    /// Makes the primary context current on the calling thread.
    pub(super) fn bind(&self) -> Result<()> {
        // SAFETY: the context stays retained while `self` lives.
        unsafe { ffi::set_current(self.ctx.raw()) }
    }

    /// Device name, e.g. "NVIDIA H100 80GB HBM3".
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Peak device-memory bandwidth in GB/s, as the driver reports the memory clock and bus width
    /// (`None` where it reports neither).
    #[must_use]
    pub fn memory_peak_gbps(&self) -> Option<f64> {
        self.memory_peak_gbps
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
        // Devices live in a process-wide cache; this runs only if the cache is torn down. No
        // engine holds the device any more (they hold an Arc), so no launch is in flight. The
        // fields then drop: `module` (unloaded in the context bound here; if binding fails the
        // unload's error is ignored) before `ctx` (released).
        let _ = self.bind();
        // Held only to keep the kernels loaded while the device lives.
        let _ = (&self.module, self.kernel.0);
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
