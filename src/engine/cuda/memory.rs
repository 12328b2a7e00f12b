//! Owned CUDA memory and streams for tests, benchmarks and Rust servers: [`DeviceBuffer`] (device
//! memory), [`PinnedBuffer`] (pinned, device-mapped host memory) and [`CudaStream`]; each frees its
//! handle in `Drop` (errors there are ignored: nothing can be reported from a drop of these).
//! They wrap the owned handles of `handles`, whose `Drop` is the one free path; theirs only binds
//! the device's context first.

use std::sync::Arc;

use super::device::CudaDevice;
use super::ffi;
use super::handles::{DevMem, PinnedHost, Stream};
use crate::error::{KvoffError, Result};

/// Device memory owned by Rust (tests, benchmarks and Rust servers without another allocator).
pub struct DeviceBuffer {
    // Fields drop in declaration order: the memory before the device (and its context).
    pub(super) mem: DevMem,
    pub(super) len: usize,
    pub(super) device: Arc<CudaDevice>,
}

impl DeviceBuffer {
    /// Allocates `len` bytes on `device`.
    ///
    /// # Errors
    /// [`KvoffError::Cuda`] when the allocation fails.
    pub fn new(device: &Arc<CudaDevice>, len: usize) -> Result<Self> {
        device.bind()?;
        // SAFETY: the context is current.
        let mem = unsafe { DevMem::new(len) }?;
        Ok(Self {
            device: Arc::clone(device),
            mem,
            len,
        })
    }

    /// Device address.
    #[must_use]
    pub fn ptr(&self) -> u64 {
        self.mem.ptr()
    }

    /// Size in bytes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `data` into the buffer at `offset` (synchronous).
    ///
    /// # Errors
    /// Out of range, or a driver error.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        self.device.bind()?;
        // SAFETY: range checked; `data` is readable host memory for the synchronous copy.
        unsafe { ffi::memcpy_htod(self.mem.ptr() + offset as u64, data) }
    }

    /// Copies bytes at `offset` into `out` (synchronous).
    ///
    /// # Errors
    /// Out of range, or a driver error.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        self.device.bind()?;
        // SAFETY: range checked; `out` is writable host memory for the synchronous copy.
        unsafe { ffi::memcpy_dtoh(out, self.mem.ptr() + offset as u64) }
    }

    fn check(&self, offset: usize, n: usize) -> Result<()> {
        if offset.checked_add(n).is_none_or(|e| e > self.len) {
            return Err(KvoffError::arg(format!(
                "range {offset}+{n} outside the {}-byte device buffer",
                self.len
            )));
        }
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Then `mem` frees the memory (users synchronize before dropping buffers that jobs still
        // use: the TransferEngine::submit contract).
        let _ = self.device.bind();
    }
}

/// Pinned, device-mapped host memory owned by Rust.
pub struct PinnedBuffer {
    // Fields drop in declaration order: the memory before the device (and its context).
    pub(super) mem: PinnedHost,
    pub(super) len: usize,
    pub(super) device: Arc<CudaDevice>,
}

impl PinnedBuffer {
    /// Allocates `len` pinned bytes (zeroed).
    ///
    /// # Errors
    /// [`KvoffError::Cuda`] when the allocation fails.
    pub fn new(device: &Arc<CudaDevice>, len: usize) -> Result<Self> {
        device.bind()?;
        // SAFETY: the context is current.
        let mem = unsafe { PinnedHost::new(len) }?;
        // SAFETY: fresh allocation of `len.max(1)` bytes.
        unsafe { std::ptr::write_bytes(mem.ptr().cast::<u8>(), 0, len) };
        Ok(Self {
            device: Arc::clone(device),
            mem,
            len,
        })
    }

    /// Host (and device) address.
    #[must_use]
    pub fn ptr(&self) -> u64 {
        self.mem.ptr() as u64
    }

    /// The bytes. Do not hold this while a job writes the buffer.
    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: a live allocation of `len` bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.mem.ptr().cast::<u8>(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: a live allocation of `len` bytes owned exclusively by self.
        unsafe { std::slice::from_raw_parts_mut(self.mem.ptr().cast::<u8>(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // Then `mem` frees the memory.
        let _ = self.device.bind();
    }
}

/// A stream owned by Rust (tests, benchmarks, Rust callers that pass a stream to jobs).
pub struct CudaStream {
    // Fields drop in declaration order: the stream before the device (and its context).
    pub(super) stream: Stream,
    pub(super) device: Arc<CudaDevice>,
}

impl CudaStream {
    /// Raw handle, as [`Job::stream`](crate::engine::Job::stream) takes it.
    #[must_use]
    pub fn handle(&self) -> u64 {
        self.stream.raw() as u64
    }

    /// Queues a kernel that busies one thread for at least `ns` nanoseconds (ordering tests).
    ///
    /// # Errors
    /// A driver error.
    pub fn sleep(&self, ns: u64) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the sleep kernel takes one u64 parameter; the stream is live.
        unsafe { ffi::launch_sleep(self.device.sleep_kernel.0, ns, self.stream.raw()) }
    }

    /// Queues a byte fill of device or mapped host memory.
    ///
    /// # Safety
    /// 1. `[ptr, ptr+len)` is device-accessible memory that stays alive until the fill has run.
    ///
    /// # Errors
    /// [`KvoffError::Cuda`](crate::KvoffError::Cuda) when the driver refuses the fill.
    pub unsafe fn memset(&self, ptr: u64, value: u8, len: usize) -> Result<()> {
        self.device.bind()?;
        // SAFETY: obligation 1; the stream is live.
        unsafe { ffi::memset_async(ptr, value, len, self.stream.raw()) }
    }

    /// Waits for everything queued on the stream.
    ///
    /// # Errors
    /// A pending asynchronous error.
    pub fn synchronize(&self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the stream is live.
        unsafe { ffi::stream_sync(self.stream.raw()) }
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        // Then `stream` destroys the stream (the driver defers that until queued work has
        // finished).
        let _ = self.device.bind();
    }
}

impl CudaDevice {
    /// Creates a stream of this device (for callers without one, tests and benchmarks).
    ///
    /// # Errors
    /// A driver error.
    pub fn create_stream(self: &Arc<Self>) -> Result<CudaStream> {
        self.bind()?;
        // SAFETY: the context is current.
        let stream = unsafe { Stream::new(false) }?;
        Ok(CudaStream {
            device: Arc::clone(self),
            stream,
        })
    }
}
