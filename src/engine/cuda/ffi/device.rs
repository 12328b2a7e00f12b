//! Driver wrappers for the driver, its devices and their primary contexts: loading, `cuInit`,
//! opening and releasing a device, making its context current, identity and memory attributes.
#![allow(unsafe_code)]

use std::ffi::CStr;
use std::ptr;

use cudarc::driver::sys;

use super::{check, CUcontext, CUdevice};
use crate::error::Result;

/// Whether a CUDA driver library can be loaded. Must be checked before any other call here:
/// cudarc panics when the library is missing.
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library names; no other effect.
    std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

/// `cuInit(0)` and the device count.
///
/// # Safety
/// 1. [`driver_present`] returned `true`.
pub(crate) unsafe fn init() -> Result<i32> {
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    check(unsafe { sys::cuInit(0) }, "cuInit")?;
    let mut n = 0;
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuDeviceGetCount(&raw mut n) },
        "cuDeviceGetCount",
    )?;
    Ok(n)
}

/// The device handle, its retained primary context (the one torch uses), name and SM count.
///
/// # Safety
/// 1. [`init`] succeeded.
pub(crate) unsafe fn open_device(ordinal: i32) -> Result<(CUdevice, CUcontext, String, i32)> {
    let mut dev: CUdevice = 0;
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuDeviceGet(&raw mut dev, ordinal) },
        "cuDeviceGet",
    )?;
    let mut ctx: CUcontext = ptr::null_mut();
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuDevicePrimaryCtxRetain(&raw mut ctx, dev) },
        "cuDevicePrimaryCtxRetain",
    )?;
    let mut name = [0 as std::ffi::c_char; 256];
    let mut sms = 0;
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    let r = unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 255, dev) };
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    let r2 = unsafe {
        sys::cuDeviceGetAttribute(
            &raw mut sms,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            dev,
        )
    };
    if let Err(e) = check(r, "cuDeviceGetName").and(check(r2, "cuDeviceGetAttribute")) {
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(dev) };
        return Err(e);
    }
    // SAFETY: the driver wrote a NUL-terminated name into the buffer.
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    Ok((dev, ctx, name, sms))
}

/// Releases a primary context retained by [`open_device`].
///
/// # Safety
/// 1. `dev` was opened by [`open_device`] and is released once.
pub(crate) unsafe fn release_device(dev: CUdevice) -> Result<()> {
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(dev) },
        "cuDevicePrimaryCtxRelease",
    )
}

/// Makes `ctx` current on the calling thread.
///
/// # Safety
/// 1. `ctx` is a live context.
pub(crate) unsafe fn set_current(ctx: CUcontext) -> Result<()> {
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    check(unsafe { sys::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")
}

/// The device's UUID as 32 hex digits, and the driver version (e.g. 13000).
///
/// # Safety
/// 1. [`init`] succeeded and `dev` came from [`open_device`].
pub(crate) unsafe fn device_identity(dev: CUdevice) -> Result<(String, i32)> {
    // SAFETY: all-zero is a valid CUuuid.
    let mut uuid: sys::CUuuid = unsafe { std::mem::zeroed() };
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuDeviceGetUuid_v2(&raw mut uuid, dev) },
        "cuDeviceGetUuid",
    )?;
    let mut version = 0;
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuDriverGetVersion(&raw mut version) },
        "cuDriverGetVersion",
    )?;
    let hex = uuid
        .bytes
        .iter()
        .fold(String::with_capacity(32), |mut s, b| {
            use std::fmt::Write as _;
            #[allow(clippy::cast_sign_loss)] // c_char bytes, printed as unsigned
            let _ = write!(s, "{:02x}", *b as u8);
            s
        });
    Ok((hex, version))
}

/// Peak device-memory bandwidth in GB/s from the device's memory clock and bus width (DDR: two
/// transfers a clock), or `None` where the driver reports neither.
///
/// # Safety
/// 1. `dev` is a device handle from [`open_device`].
pub(crate) unsafe fn memory_peak_gbps(dev: CUdevice) -> Option<f64> {
    let (mut khz, mut bits) = (0i32, 0i32);
    // SAFETY: obligation 1; valid out-parameters.
    let r1 = unsafe {
        sys::cuDeviceGetAttribute(
            &raw mut khz,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE,
            dev,
        )
    };
    // SAFETY: as above.
    let r2 = unsafe {
        sys::cuDeviceGetAttribute(
            &raw mut bits,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH,
            dev,
        )
    };
    if r1 != sys::CUresult::CUDA_SUCCESS
        || r2 != sys::CUresult::CUDA_SUCCESS
        || khz <= 0
        || bits <= 0
    {
        return None;
    }
    Some(f64::from(khz) * 1e3 * 2.0 * f64::from(bits) / 8.0 / 1e9)
}
