//! Owned driver handles of the engine, modelled on cudarc's `driver/safe`: each destroys its
//! handle exactly once — with `release()`, which returns the driver's error for the engine's
//! `close_errors`, or else in `Drop` (errors ignored there: nothing to report them to) — so error
//! paths need no hand-written cleanup. Every call goes through [`ffi`]; the callers bind the
//! device's context first (creation, `release` and the owners' `Drop`s all run after `bind`;
//! [`PrimaryCtx`], the context itself, needs none).
#![allow(unsafe_code)]

use std::ffi::{c_void, CStr};

use super::ffi;
use crate::error::Result;

/// Raw driver handles are plain pointers; the driver API is thread-safe for the calls made here
/// (each engine's handles are used under `&mut self` or the device's lock).
pub(super) struct SendPtr<T>(pub(super) T);
// SAFETY: driver handles may be used from any thread once the context is current there, which
// every entry point ensures with `bind()`.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above; shared use goes through `&self` methods that only read the handle values.
unsafe impl<T> Sync for SendPtr<T> {}

/// A device's retained primary context (the one torch uses).
pub(super) struct PrimaryCtx {
    dev: ffi::CUdevice,
    ctx: SendPtr<ffi::CUcontext>,
}

impl PrimaryCtx {
    /// Retains device `ordinal`'s primary context; also returns the device's name and SM count.
    ///
    /// # Safety
    /// The driver is initialised (`ffi::init` succeeded).
    pub(super) unsafe fn open(ordinal: i32) -> Result<(Self, String, i32)> {
        // SAFETY: the caller's obligation.
        let (dev, ctx, name, sm_count) = unsafe { ffi::open_device(ordinal) }?;
        let ctx = Self {
            dev,
            ctx: SendPtr(ctx),
        };
        Ok((ctx, name, sm_count))
    }

    pub(super) fn dev(&self) -> ffi::CUdevice {
        self.dev
    }

    pub(super) fn raw(&self) -> ffi::CUcontext {
        self.ctx.0
    }
}

/// Released only here: the device owning it lives in a process-wide cache, so there is no one to
/// report an error to (hence no `release`).
impl Drop for PrimaryCtx {
    fn drop(&mut self) {
        // SAFETY: retained in `open` and released only here, once.
        let _ = unsafe { ffi::release_device(self.dev) };
    }
}

/// A loaded module (the engine's kernels).
pub(super) struct Module(SendPtr<ffi::CUmodule>);

impl Module {
    /// Loads PTX `ptx` and looks up its function `name`.
    ///
    /// # Safety
    /// The device's context is current on this thread.
    pub(super) unsafe fn load(ptx: &CStr, name: &CStr) -> Result<(Self, ffi::CUfunction)> {
        // SAFETY: the caller's obligation.
        let (m, f) = unsafe { ffi::load_kernel(ptx, name) }?;
        Ok((Self(SendPtr(m)), f))
    }

    /// Looks up another function of the module; it stays valid while the module is loaded.
    ///
    /// # Safety
    /// The device's context is current on this thread.
    pub(super) unsafe fn function(&self, name: &CStr) -> Result<ffi::CUfunction> {
        // SAFETY: the module is live (owned by `self`); the context is the caller's obligation.
        unsafe { ffi::get_function(self.0 .0, name) }
    }
}

/// Unloaded only here, like [`PrimaryCtx`] (no `release`); the owner binds the context first and
/// drops the module before the context.
impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: the module is live and unloaded only here, once; its owner drops it only when no
        // launch of it can be in flight.
        let _ = unsafe { ffi::unload_module(self.0 .0) };
    }
}

/// A stream.
pub(super) struct Stream(SendPtr<ffi::CUstream>);

impl Stream {
    /// A non-blocking stream of the highest (`high`) or lowest priority.
    ///
    /// # Safety
    /// The device's context is current on this thread.
    pub(super) unsafe fn new(high: bool) -> Result<Self> {
        // SAFETY: the caller's obligation.
        Ok(Self(SendPtr(unsafe { ffi::stream_create(high) }?)))
    }

    pub(super) fn raw(&self) -> ffi::CUstream {
        self.0 .0
    }

    /// Destroys the stream (its work must have drained), returning the driver's error.
    pub(super) fn release(self) -> Result<()> {
        let s = self.0 .0;
        std::mem::forget(self);
        // SAFETY: the handle is live and, with `self` forgotten, destroyed only here.
        unsafe { ffi::stream_destroy(s) }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: the handle is live and destroyed only here (`release` forgets `self`).
        let _ = unsafe { ffi::stream_destroy(self.0 .0) };
    }
}

/// An event.
pub(super) struct Event(SendPtr<ffi::CUevent>);

impl Event {
    /// An event, with timing (`timing`) or without (cheaper, for ordering only).
    ///
    /// # Safety
    /// The device's context is current on this thread.
    pub(super) unsafe fn new(timing: bool) -> Result<Self> {
        // SAFETY: the caller's obligation.
        Ok(Self(SendPtr(unsafe { ffi::event_create(timing) }?)))
    }

    pub(super) fn raw(&self) -> ffi::CUevent {
        self.0 .0
    }

    /// Destroys the event, returning the driver's error.
    pub(super) fn release(self) -> Result<()> {
        let e = self.0 .0;
        std::mem::forget(self);
        // SAFETY: the handle is live and, with `self` forgotten, destroyed only here.
        unsafe { ffi::event_destroy(e) }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the handle is live and destroyed only here (`release` forgets `self`).
        let _ = unsafe { ffi::event_destroy(self.0 .0) };
    }
}

/// Device memory.
pub(super) struct DevMem(u64);

impl DevMem {
    /// `bytes` of device memory.
    ///
    /// # Safety
    /// The device's context is current on this thread.
    pub(super) unsafe fn new(bytes: usize) -> Result<Self> {
        // SAFETY: the caller's obligation.
        Ok(Self(unsafe { ffi::mem_alloc(bytes) }?))
    }

    pub(super) fn ptr(&self) -> u64 {
        self.0
    }

    /// Frees the memory (no queued work may use it), returning the driver's error.
    pub(super) fn release(self) -> Result<()> {
        let p = self.0;
        std::mem::forget(self);
        // SAFETY: the allocation is live and, with `self` forgotten, freed only here.
        unsafe { ffi::mem_free(p) }
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        // SAFETY: the allocation is live and freed only here (`release` forgets `self`).
        let _ = unsafe { ffi::mem_free(self.0) };
    }
}

/// Pinned, device-mapped host memory.
pub(super) struct PinnedHost(SendPtr<*mut c_void>);

impl PinnedHost {
    /// `bytes` of pinned host memory.
    ///
    /// # Safety
    /// The device's context is current on this thread.
    pub(super) unsafe fn new(bytes: usize) -> Result<Self> {
        // SAFETY: the caller's obligation.
        Ok(Self(SendPtr(unsafe { ffi::mem_alloc_host(bytes) }?)))
    }

    pub(super) fn ptr(&self) -> *mut c_void {
        self.0 .0
    }

    /// Frees the memory (no queued work may use it), returning the driver's error.
    pub(super) fn release(self) -> Result<()> {
        let p = self.0 .0;
        std::mem::forget(self);
        // SAFETY: the allocation is live and, with `self` forgotten, freed only here.
        unsafe { ffi::mem_free_host(p) }
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: the allocation is live and freed only here (`release` forgets `self`).
        let _ = unsafe { ffi::mem_free_host(self.0 .0) };
    }
}
