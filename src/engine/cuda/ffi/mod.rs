//! Thin `Result` wrappers over `cudarc::driver::sys` (the raw driver API), in cudarc's own layering:
//! `sys` (raw) → this module (checked calls, typed errors) → [`super`] (the engine).
//!
//! Every function here is `unsafe` because it takes raw handles or pointers; each lists what the
//! caller must guarantee. Errors become [`KvoffError::Cuda`] naming the call and the driver's error
//! name and text; each enqueue call is timed into this thread's `telemetry` record. Nothing here
//! panics: symbols that an older driver may lack (`cuMemcpyBatchAsync_v2`) are looked up through the
//! loader and reported as `None`. Device and context calls are in `device`.
#![allow(unsafe_code)]

use std::ffi::{c_void, CStr};
use std::ptr;

use cudarc::driver::sys;

use super::telemetry::timed;
use crate::error::{KvoffError, Result};

pub(crate) use sys::{CUcontext, CUdevice, CUevent, CUfunction, CUmodule, CUstream};

mod device;
pub(crate) use device::*;

/// Turns a driver status into a typed error naming the call.
pub(crate) fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        let text = error_text(r);
        Err(KvoffError::Cuda {
            message: format!("{what} failed: {text}"),
            source: Some(crate::error::CudaStatus {
                call: what.to_owned(),
                code: r as i32,
                text,
            }),
        })
    }
}

/// `NAME: description` of a driver status.
pub(crate) fn error_text(r: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = ptr::null();
    let mut desc: *const std::ffi::c_char = ptr::null();
    // SAFETY: both calls only write a pointer to a static string into the out-parameter.
    unsafe {
        sys::cuGetErrorName(r, &raw mut name);
        sys::cuGetErrorString(r, &raw mut desc);
    }
    let s = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::from("?")
        } else {
            // SAFETY: the driver returns NUL-terminated static strings.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    format!("{} ({})", s(name), s(desc))
}

/// A non-blocking stream; `high_priority` picks the greatest priority the context allows, else the
/// lowest.
///
/// # Safety
/// 1. A live context is current on this thread.
pub(crate) unsafe fn stream_create(high_priority: bool) -> Result<CUstream> {
    let (mut least, mut greatest) = (0, 0);
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuCtxGetStreamPriorityRange(&raw mut least, &raw mut greatest) },
        "cuCtxGetStreamPriorityRange",
    )?;
    let prio = if high_priority { greatest } else { least };
    let mut s: CUstream = ptr::null_mut();
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe {
            sys::cuStreamCreateWithPriority(
                &raw mut s,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                prio,
            )
        },
        "cuStreamCreateWithPriority",
    )?;
    Ok(s)
}

/// # Safety
/// 1. `s` was created by [`stream_create`], has no work in flight and is destroyed once.
pub(crate) unsafe fn stream_destroy(s: CUstream) -> Result<()> {
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    check(unsafe { sys::cuStreamDestroy_v2(s) }, "cuStreamDestroy")
}

/// # Safety
/// 1. A live context is current on this thread.
pub(crate) unsafe fn event_create(timing: bool) -> Result<CUevent> {
    let flags = if timing {
        sys::CUevent_flags::CU_EVENT_DEFAULT as u32
    } else {
        sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
    };
    let mut e: CUevent = ptr::null_mut();
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuEventCreate(&raw mut e, flags) },
        "cuEventCreate",
    )?;
    Ok(e)
}

/// # Safety
/// 1. `e` is a live event destroyed once, not used afterwards.
pub(crate) unsafe fn event_destroy(e: CUevent) -> Result<()> {
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    check(unsafe { sys::cuEventDestroy_v2(e) }, "cuEventDestroy")
}

/// # Safety
/// 1. `e` and `s` are live handles of the current context (`s` may be a foreign stream such as
///    torch's current stream, or null for the legacy default stream).
pub(crate) unsafe fn event_record(e: CUevent, s: CUstream) -> Result<()> {
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    check(
        timed("cuEventRecord", || unsafe { sys::cuEventRecord(e, s) }),
        "cuEventRecord",
    )
}

/// `Ok(true)` when the work before the event finished, `Ok(false)` while pending.
///
/// # Safety
/// 1. `e` is a live event.
pub(crate) unsafe fn event_done(e: CUevent) -> Result<bool> {
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    let r = unsafe { sys::cuEventQuery(e) };
    if r == sys::CUresult::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check(r, "cuEventQuery").map(|()| true)
}

/// Milliseconds between two completed timing events.
///
/// # Safety
/// 1. Both are live timing events that have completed.
pub(crate) unsafe fn event_elapsed_ms(start: CUevent, end: CUevent) -> Result<f32> {
    let mut ms = 0f32;
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuEventElapsedTime_v2(&raw mut ms, start, end) },
        "cuEventElapsedTime",
    )?;
    Ok(ms)
}

/// Makes `s` wait for `e`.
///
/// # Safety
/// 1. Both are live handles of the current context.
pub(crate) unsafe fn stream_wait(s: CUstream, e: CUevent) -> Result<()> {
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        timed("cuStreamWaitEvent", || unsafe {
            sys::cuStreamWaitEvent(s, e, 0)
        }),
        "cuStreamWaitEvent",
    )
}

/// Whether `s` has work that has not finished yet (`cuStreamQuery` answers "not ready"). A stream
/// being captured into a CUDA graph is never queried (a query would invalidate the capture): it
/// answers `false`, as does a stream whose capture state cannot be read.
///
/// # Safety
/// 1. `s` is a live stream of the current context, or 0 (the legacy default stream).
pub(crate) unsafe fn stream_busy(s: CUstream) -> Result<bool> {
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    if unsafe { stream_capturing(s) } {
        return Ok(false);
    }
    // SAFETY: as above; the stream is not capturing.
    let r = timed("cuStreamQuery", || unsafe { sys::cuStreamQuery(s) });
    if r == sys::CUresult::CUDA_ERROR_NOT_READY {
        return Ok(true);
    }
    check(r, "cuStreamQuery").map(|()| false)
}

/// Whether `s` is being captured into a CUDA graph (also when its capture state cannot be read).
///
/// # Safety
/// 1. `s` is a live stream of the current context, or 0 (the legacy default stream).
pub(crate) unsafe fn stream_capturing(s: CUstream) -> bool {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: obligation 1; asking for the capture state is allowed during a capture.
    let r = timed("cuStreamIsCapturing", || unsafe {
        sys::cuStreamIsCapturing(s, &raw mut status)
    });
    r != sys::CUresult::CUDA_SUCCESS
        || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
}

/// # Safety
/// 1. `s` is live.
pub(crate) unsafe fn stream_sync(s: CUstream) -> Result<()> {
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuStreamSynchronize(s) },
        "cuStreamSynchronize",
    )
}

/// Asynchronous pitched copy between two unified addresses: `rows` rows of `width` bytes, row `i`
/// from `src + i·spitch` to `dst + i·dpitch` (one copy-engine operation).
///
/// # Safety
/// 1. Every row satisfies the contract of [`memcpy_async`]; `spitch, dpitch ≥ width`.
/// 2. `s` is a live stream of the current context.
pub(crate) unsafe fn memcpy_2d(
    dst: u64,
    dpitch: u64,
    src: u64,
    spitch: u64,
    width: u64,
    rows: u64,
    s: CUstream,
) -> Result<()> {
    let us = |v: u64| usize::try_from(v).map_err(|_| KvoffError::arg("copy size exceeds usize"));
    // Every field written (the memory-type enums have no zero value, so no `zeroed()`); host
    // pointers and arrays are ignored for unified memory.
    let p = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
        srcHost: ptr::null(),
        srcDevice: src,
        srcArray: ptr::null_mut(),
        srcPitch: us(spitch)?,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
        dstHost: ptr::null_mut(),
        dstDevice: dst,
        dstArray: ptr::null_mut(),
        dstPitch: us(dpitch)?,
        WidthInBytes: us(width)?,
        Height: us(rows)?,
    };
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations; `p` outlives the call.
        timed("cuMemcpy2DAsync", || unsafe {
            sys::cuMemcpy2DAsync_v2(&raw const p, s)
        }),
        "cuMemcpy2DAsync",
    )
}

/// Asynchronous copy between two unified addresses.
///
/// # Safety
/// 1. `[src, src+bytes)` and `[dst, dst+bytes)` are valid device-accessible or host memory that
///    stays alive and unchanged (src) / unused (dst) until the copy has run.
/// 2. `s` is a live stream of the current context.
pub(crate) unsafe fn memcpy_async(dst: u64, src: u64, bytes: u64, s: CUstream) -> Result<()> {
    let n = usize::try_from(bytes).map_err(|_| KvoffError::arg("copy size exceeds usize"))?;
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        timed("cuMemcpyAsync", || unsafe {
            sys::cuMemcpyAsync(dst, src, n, s)
        }),
        "cuMemcpyAsync",
    )
}

/// Device allocation.
///
/// # Safety
/// 1. A live context is current.
pub(crate) unsafe fn mem_alloc(bytes: usize) -> Result<u64> {
    let mut p = 0u64;
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuMemAlloc_v2(&raw mut p, bytes.max(1)) },
        "cuMemAlloc",
    )?;
    Ok(p)
}

/// # Safety
/// 1. `p` came from [`mem_alloc`], is freed once and no work using it is in flight.
pub(crate) unsafe fn mem_free(p: u64) -> Result<()> {
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    check(unsafe { sys::cuMemFree_v2(p) }, "cuMemFree")
}

/// Pinned, device-mapped host allocation.
///
/// # Safety
/// 1. A live context is current.
pub(crate) unsafe fn mem_alloc_host(bytes: usize) -> Result<*mut c_void> {
    let mut p: *mut c_void = ptr::null_mut();
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuMemAllocHost_v2(&raw mut p, bytes.max(1)) },
        "cuMemAllocHost",
    )?;
    Ok(p)
}

/// # Safety
/// 1. `p` came from [`mem_alloc_host`], is freed once and no work using it is in flight.
pub(crate) unsafe fn mem_free_host(p: *mut c_void) -> Result<()> {
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    check(unsafe { sys::cuMemFreeHost(p) }, "cuMemFreeHost")
}

/// Page-locks and maps `[ptr, ptr+len)` for the device (portable across contexts).
///
/// # Safety
/// 1. The range is mapped host memory that stays mapped until [`host_unregister`].
/// 2. A live context is current.
pub(crate) unsafe fn host_register(ptr: u64, len: u64) -> Result<()> {
    let n = usize::try_from(len).map_err(|_| KvoffError::arg("region too large"))?;
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe {
            sys::cuMemHostRegister_v2(
                ptr as *mut c_void,
                n,
                sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
            )
        },
        "cuMemHostRegister",
    )
}

/// # Safety
/// 1. `ptr` was registered by [`host_register`] and no work using it is in flight.
pub(crate) unsafe fn host_unregister(ptr: u64) -> Result<()> {
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) },
        "cuMemHostUnregister",
    )
}

/// Whether host address `ptr` is page-locked and mapped for the device (registered or allocated
/// pinned), so that a kernel may dereference it directly.
///
/// # Safety
/// 1. A live context is current.
pub(crate) unsafe fn host_ptr_is_mapped(ptr: u64) -> bool {
    let mut dptr: u64 = 0;
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&raw mut dptr).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
            ptr,
        )
    };
    r == sys::CUresult::CUDA_SUCCESS && dptr == ptr
}

/// The device allocation holding `ptr`, `(base, bytes)`; `None` when `ptr` is not device memory
/// the driver knows.
///
/// # Safety
/// 1. A live context is current.
pub(crate) unsafe fn device_alloc_range(ptr: u64) -> Option<(u64, u64)> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: the caller upholds this function's `# Safety` obligations; both out-pointers are
    // live locals.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&raw mut base, &raw mut size, ptr) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some((base, size as u64))
}

/// Whether `ptr` is device memory of some context.
///
/// # Safety
/// 1. A live context is current.
pub(crate) unsafe fn is_device_ptr(ptr: u64) -> bool {
    let mut ty: u32 = 0;
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&raw mut ty).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr,
        )
    };
    r == sys::CUresult::CUDA_SUCCESS && ty == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
}

/// Loads a PTX module and looks up one function.
///
/// # Safety
/// 1. A live context is current.
pub(crate) unsafe fn load_kernel(ptx: &CStr, name: &CStr) -> Result<(CUmodule, CUfunction)> {
    let mut m: CUmodule = ptr::null_mut();
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuModuleLoadData(&raw mut m, ptx.as_ptr().cast()) },
        "cuModuleLoadData",
    )?;
    let mut f: CUfunction = ptr::null_mut();
    if let Err(e) = check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuModuleGetFunction(&raw mut f, m, name.as_ptr()) },
        "cuModuleGetFunction",
    ) {
        // SAFETY: `m` was loaded above and nothing else holds it; it is unloaded once.
        unsafe { sys::cuModuleUnload(m) };
        return Err(e);
    }
    Ok((m, f))
}

/// Looks up another function of a loaded module.
///
/// # Safety
/// 1. `m` is a live module of the current context.
pub(crate) unsafe fn get_function(m: CUmodule, name: &CStr) -> Result<CUfunction> {
    let mut f: CUfunction = ptr::null_mut();
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        unsafe { sys::cuModuleGetFunction(&raw mut f, m, name.as_ptr()) },
        "cuModuleGetFunction",
    )?;
    Ok(f)
}

/// # Safety
/// 1. `m` was loaded by [`load_kernel`] and no launch of it is in flight.
pub(crate) unsafe fn unload_module(m: CUmodule) -> Result<()> {
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    check(unsafe { sys::cuModuleUnload(m) }, "cuModuleUnload")
}

/// Launches the copy kernel over `n` descriptors at device address `descs`.
///
/// # Safety
/// 1. `f` is the `kvoff_copy` function; `descs` holds `n` valid descriptors (device memory) until
///    the kernel has run, and every descriptor names device-accessible memory (see the kernel).
/// 2. `s` is a live stream of the current context.
pub(crate) unsafe fn launch_copy(
    f: CUfunction,
    grid: u32,
    block: u32,
    descs: u64,
    n: u64,
    s: CUstream,
) -> Result<()> {
    let mut a0 = descs;
    let mut a1 = n;
    let mut params: [*mut c_void; 2] = [(&raw mut a0).cast(), (&raw mut a1).cast()];
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        timed("cuLaunchKernel", || unsafe {
            sys::cuLaunchKernel(
                f,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                s,
                params.as_mut_ptr(),
                ptr::null_mut(),
            )
        }),
        "cuLaunchKernel(kvoff_copy)",
    )
}

/// Host-to-device copy of a pinned staging buffer.
///
/// # Safety
/// 1. `src` is pinned host memory of `bytes` bytes that stays unchanged until the copy has run;
///    `dst` is device memory of at least `bytes`.
/// 2. `s` is a live stream of the current context.
pub(crate) unsafe fn memcpy_htod_async(
    dst: u64,
    src: *const c_void,
    bytes: usize,
    s: CUstream,
) -> Result<()> {
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        timed("cuMemcpyHtoDAsync", || unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src, bytes, s)
        }),
        "cuMemcpyHtoDAsync",
    )
}

/// Signature of `cuMemcpyBatchAsync_v2` (CUDA 13).
pub(crate) type MemcpyBatchFn = unsafe extern "C" fn(
    dsts: *mut u64,
    srcs: *mut u64,
    sizes: *mut usize,
    count: usize,
    attrs: *mut sys::CUmemcpyAttributes,
    attrs_idxs: *mut usize,
    num_attrs: usize,
    stream: CUstream,
) -> sys::CUresult;

/// Looks up `cuMemcpyBatchAsync_v2` without panicking when the driver lacks it.
///
/// # Safety
/// 1. [`driver_present`] returned `true`.
pub(crate) unsafe fn memcpy_batch_fn() -> Option<MemcpyBatchFn> {
    // SAFETY: the driver library is present (obligation 1); the symbol's type is the documented
    // CUDA 13 signature above.
    let lib = unsafe { sys::culib() };
    // SAFETY: the caller upholds this function's `# Safety` obligations.
    let sym = unsafe { lib.get::<MemcpyBatchFn>(b"cuMemcpyBatchAsync_v2\0") }.ok()?;
    Some(*sym)
}

/// One `cuMemcpyBatchAsync` over co-indexed arrays, with one attribute set for all copies.
///
/// # Safety
/// 1. `f` came from [`memcpy_batch_fn`]; the arrays have equal length; every copy satisfies the
///    contract of [`memcpy_async`].
/// 2. `s` is a live, non-legacy stream of the current context.
pub(crate) unsafe fn memcpy_batch(
    f: MemcpyBatchFn,
    dsts: &mut [u64],
    srcs: &mut [u64],
    sizes: &mut [usize],
    host_to_device: bool,
    s: CUstream,
) -> Result<()> {
    // SAFETY: all-zero is a valid bit pattern for this plain C struct.
    let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
    // Host sources (loads) are stable while they are read, so the driver may read them in any
    // order; device sources (stores) must be read in stream order, after the caller's writes.
    attrs.srcAccessOrder = if host_to_device {
        sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_ANY
    } else {
        sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    };
    let (host, dev) = (
        sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
        sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
    );
    attrs.srcLocHint.type_ = if host_to_device { host } else { dev };
    attrs.dstLocHint.type_ = if host_to_device { dev } else { host };
    let mut idx0: usize = 0;
    check(
        // SAFETY: the caller upholds this function's `# Safety` obligations.
        timed("cuMemcpyBatchAsync", || unsafe {
            f(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                sizes.len(),
                &raw mut attrs,
                &raw mut idx0,
                1,
                s,
            )
        }),
        "cuMemcpyBatchAsync",
    )
}

/// `cuCtxSynchronize`: waits for all work of the current context.
///
/// # Safety
/// 1. A live context is current on this thread.
pub(crate) unsafe fn ctx_sync() -> Result<()> {
    // SAFETY: obligation 1.
    check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
}

/// Synchronous copy of `data` to device address `dst`.
///
/// # Safety
/// 1. A live context is current; `[dst, dst + data.len())` is device memory of it.
pub(crate) unsafe fn memcpy_htod(dst: u64, data: &[u8]) -> Result<()> {
    // SAFETY: obligation 1; `data` is readable for its length during the synchronous copy.
    check(
        unsafe { sys::cuMemcpyHtoD_v2(dst, data.as_ptr().cast(), data.len()) },
        "cuMemcpyHtoD",
    )
}

/// Synchronous copy from device address `src` into `out`.
///
/// # Safety
/// 1. A live context is current; `[src, src + out.len())` is device memory of it.
pub(crate) unsafe fn memcpy_dtoh(out: &mut [u8], src: u64) -> Result<()> {
    // SAFETY: obligation 1; `out` is writable for its length during the synchronous copy.
    check(
        unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src, out.len()) },
        "cuMemcpyDtoH",
    )
}

/// Queues `kvoff_sleep(ns)` on one thread.
///
/// # Safety
/// 1. A live context is current; `f` is its `kvoff_sleep` function; `s` a live stream of it.
pub(crate) unsafe fn launch_sleep(f: CUfunction, ns: u64, s: CUstream) -> Result<()> {
    let mut a0 = ns;
    let mut params: [*mut c_void; 1] = [(&raw mut a0).cast()];
    // SAFETY: obligation 1; the kernel takes one u64 parameter, read at launch.
    check(
        unsafe {
            sys::cuLaunchKernel(
                f,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                s,
                params.as_mut_ptr(),
                ptr::null_mut(),
            )
        },
        "cuLaunchKernel(kvoff_sleep)",
    )
}

/// Queues a byte fill of `len` bytes at `dst` on `s`.
///
/// # Safety
/// 1. A live context is current; `s` is a live stream of it; `[dst, dst + len)` is
///    device-accessible memory that stays alive until the fill has run.
pub(crate) unsafe fn memset_async(dst: u64, value: u8, len: usize, s: CUstream) -> Result<()> {
    // SAFETY: obligation 1.
    check(
        unsafe { sys::cuMemsetD8Async(dst, value, len, s) },
        "cuMemsetD8Async",
    )
}

/// A host function the driver runs on its own thread when stream work reaches it
/// (`cuLaunchHostFunc`); the stream's later work waits until it returns.
pub(crate) type HostFn = unsafe extern "C" fn(user_data: *mut c_void);

/// Queues host function `f(user_data)` on `s` (`cuLaunchHostFunc`). On an error the function
/// will not run, so the caller still owns whatever `user_data` points to.
///
/// # Safety
/// 1. A live context is current; `s` is a live stream of it.
/// 2. `f` may be called once with `user_data` on a driver thread, after the stream's earlier
///    work: it must make no CUDA call, must not unwind, and `user_data` must stay valid until
///    then (the function takes it over).
pub(crate) unsafe fn launch_host_func(
    s: CUstream,
    f: HostFn,
    user_data: *mut c_void,
) -> Result<()> {
    check(
        timed("cuLaunchHostFunc", || {
            // SAFETY: obligations 1 and 2.
            unsafe { sys::cuLaunchHostFunc(s, Some(f), user_data) }
        }),
        "cuLaunchHostFunc",
    )
}
