//! Host memory as the tiers see it (docs/tier.md "Secondary tiers"): the [`BlockMemory`] trait a
//! tier copies blocks out of and into, and its implementations — [`VecMemory`] (one `Vec` per
//! block, for tests and tools), [`RawRows`] (host memory given as a raw pointer: a `HostRegion`
//! view from the bindings) and [`AlignedRows`] (4 KiB-aligned rows the tier owns) — with
//! [`AlignedBuf`], the 4 KiB-aligned buffer of `O_DIRECT` transfers.
//!
//! Unsafe code here: viewing an aligned allocation as bytes, and [`RawRows`], whose caller
//! promises the memory stays mapped (its `new`'s safety section); each block is fenced by a
//! bounds check before a slice of it is made.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::error::{KvoffError, Result};
use crate::manager::BlockId;

/// The payload checksum (XXH3-64, seed 0): `format::payload_sum`'s function, which this layer
/// cannot import (docs/design.md "Crate layout"); twox-hash picks AVX2 at run time. A sum that
/// differed would fail every file-tier read of a block written through `format` (tests/tier_files.rs).
fn xxh3_64(payload: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(payload)
}

/// Host memory the tier copies blocks out of and into (one rank's slot of each row).
///
/// The tier calls these from its I/O threads. The caller's protocol keeps a block unchanged while it
/// is copied out (pinned) and unread while it is copied in (a pending store).
pub trait BlockMemory: Send + Sync {
    /// Bytes of one block (the payload of one file).
    fn block_bytes(&self) -> usize;
    /// Number of blocks.
    fn num_blocks(&self) -> u64;
    /// Copies block `block` into `out` (`out.len() == block_bytes()`).
    ///
    /// # Errors
    /// A block out of range or a wrong length.
    fn copy_out(&self, block: BlockId, out: &mut [u8]) -> Result<()>;
    /// Copies `data` (`block_bytes()` long) into block `block`.
    ///
    /// # Errors
    /// A block out of range or a wrong length.
    fn copy_in(&self, block: BlockId, data: &[u8]) -> Result<()>;
    /// Calls `f` with block `block`'s bytes: in place where the memory allows it (the remote
    /// tier then checksums and sends a block without copying it first); the default copies the
    /// block into a new buffer.
    ///
    /// # Errors
    /// A block out of range.
    fn with_block(&self, block: BlockId, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        let mut v = vec![0u8; self.block_bytes()];
        self.copy_out(block, &mut v)?;
        f(&v);
        Ok(())
    }
    /// Calls `f` with block `block`'s bytes to overwrite (a pending block: nobody reads it
    /// meanwhile): in place where the memory allows it (the remote tier then reads a value from
    /// its socket straight into host memory); the default gives `f` a new buffer and copies it
    /// into the block when `f` returns `true`.
    ///
    /// # Errors
    /// A block out of range.
    fn with_block_mut(&self, block: BlockId, f: &mut dyn FnMut(&mut [u8]) -> bool) -> Result<()> {
        let mut v = vec![0u8; self.block_bytes()];
        if f(&mut v) {
            self.copy_in(block, &v)?;
        }
        Ok(())
    }
    /// Reads a whole tier file from `file` (opened with `O_DIRECT`): the first `header.len()` bytes
    /// into `header`, the next `block_bytes()` straight into block `block`; returns the xxh3-64 of
    /// the bytes that landed in the block. `None` (the default) when the memory cannot take such a
    /// read (alignment): the tier then reads into its own buffer and uses [`BlockMemory::copy_in`].
    fn read_file_into(
        &self,
        block: BlockId,
        file: &std::fs::File,
        header: &mut [u8],
    ) -> Option<std::io::Result<u64>> {
        let _ = (block, file, header);
        None
    }
    /// The xxh3-64 of block `block`, computed in place, when the memory supports writes straight
    /// from the block ([`BlockMemory::write_file_from`]); `None` (the default) otherwise.
    fn payload_sum(&self, block: BlockId) -> Option<std::io::Result<u64>> {
        let _ = block;
        None
    }
    /// Writes a whole tier file to `file` (opened with `O_DIRECT`): `header`, then block `block`'s
    /// bytes straight from host memory. `None` (the default) when not supported; then the tier
    /// copies the block into its buffer first. Supported exactly when `payload_sum` is.
    fn write_file_from(
        &self,
        block: BlockId,
        file: &std::fs::File,
        header: &[u8],
    ) -> Option<std::io::Result<()>> {
        let _ = (block, file, header);
        None
    }
}

/// Host memory as one `Vec` per block behind a lock: for tests and tools.
#[derive(Debug)]
pub struct VecMemory {
    blocks: Vec<Mutex<Vec<u8>>>,
    block_bytes: usize,
}

impl VecMemory {
    /// `num_blocks` zeroed blocks of `block_bytes`.
    #[must_use]
    pub fn new(num_blocks: usize, block_bytes: usize) -> Self {
        Self {
            blocks: (0..num_blocks)
                .map(|_| Mutex::new(vec![0; block_bytes]))
                .collect(),
            block_bytes,
        }
    }

    fn get(&self, block: BlockId, len: usize) -> Result<MutexGuard<'_, Vec<u8>>> {
        if len != self.block_bytes {
            return Err(KvoffError::arg(format!(
                "{len} bytes for a block of {}",
                self.block_bytes
            )));
        }
        self.blocks
            .get(block as usize)
            .map(|m| m.lock().unwrap_or_else(PoisonError::into_inner))
            .ok_or_else(|| KvoffError::arg(format!("block {block} out of range")))
    }

    /// A copy of block `block`.
    ///
    /// # Errors
    /// A block out of range.
    pub fn block(&self, block: BlockId) -> Result<Vec<u8>> {
        Ok(self.get(block, self.block_bytes)?.clone())
    }

    /// Overwrites block `block`.
    ///
    /// # Errors
    /// A block out of range or a wrong length.
    pub fn set_block(&self, block: BlockId, data: &[u8]) -> Result<()> {
        self.get(block, data.len())?.copy_from_slice(data);
        Ok(())
    }
}

impl BlockMemory for VecMemory {
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }
    fn num_blocks(&self) -> u64 {
        self.blocks.len() as u64
    }
    fn copy_out(&self, block: BlockId, out: &mut [u8]) -> Result<()> {
        out.copy_from_slice(&self.get(block, out.len())?);
        Ok(())
    }
    fn copy_in(&self, block: BlockId, data: &[u8]) -> Result<()> {
        self.set_block(block, data)
    }
    fn with_block(&self, block: BlockId, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        f(&self.get(block, self.block_bytes)?);
        Ok(())
    }
}

/// Alignment (and length unit) of every `O_DIRECT` transfer.
pub const ALIGN: usize = 4096;

#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Chunk([u8; ALIGN]);

/// A zero-initialised byte buffer whose start is 4 KiB-aligned and whose length is a multiple of
/// 4 KiB.
pub struct AlignedBuf {
    chunks: Vec<Chunk>,
}

impl AlignedBuf {
    /// A buffer of at least `len` bytes (rounded up to 4 KiB).
    #[must_use]
    pub fn new(len: usize) -> Self {
        Self {
            chunks: vec![Chunk([0; ALIGN]); len.div_ceil(ALIGN)],
        }
    }

    /// Length in bytes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.chunks.len() * ALIGN
    }

    /// `true` for a zero-length buffer.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// The bytes.
    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `Chunk` is `repr(C)` around `[u8; ALIGN]` with size = align = ALIGN, so the Vec's
        // storage is `len()` initialised, contiguous bytes, borrowed immutably through `&self`.
        unsafe { std::slice::from_raw_parts(self.chunks.as_ptr().cast::<u8>(), self.len()) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len();
        // SAFETY: as in `as_slice`; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.chunks.as_mut_ptr().cast::<u8>(), len) }
    }
}

/// Host memory given as a raw pointer: `num_rows` rows, `row_stride_bytes` apart, of which the
/// first `block_bytes` of each row are one block. Copies use `memcpy` without locks; the tier's
/// protocol guarantees that no one else writes a block while it is copied out (it is pinned by a
/// load) and no one reads a block while it is copied in (it is a pending store).
#[derive(Debug)]
pub struct RawRows {
    ptr: u64,
    num_rows: u64,
    row_stride_bytes: u64,
    block_bytes: usize,
}

impl RawRows {
    /// Describes host memory at `ptr`.
    ///
    /// # Safety
    /// 1. `ptr .. ptr + (num_rows - 1) * row_stride_bytes + block_bytes` is mapped, readable and
    ///    writable for as long as this value (and every tier using it) lives.
    /// 2. No one else writes a block while the tier copies it out, nor reads or writes a block while
    ///    the tier copies into it (the tiered manager's pins and pending stores guarantee this).
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] for a null pointer, a zero block size, or a block larger
    /// than the row stride.
    pub unsafe fn new(
        ptr: u64,
        num_rows: u64,
        row_stride_bytes: u64,
        block_bytes: usize,
    ) -> Result<Self> {
        if ptr == 0 || block_bytes == 0 || block_bytes as u64 > row_stride_bytes {
            return Err(KvoffError::arg(format!(
                "host rows need a non-null pointer and 0 < block_bytes <= row_stride_bytes \
                 (ptr {ptr:#x}, block_bytes {block_bytes}, row_stride_bytes {row_stride_bytes})"
            )));
        }
        Ok(Self {
            ptr,
            num_rows,
            row_stride_bytes,
            block_bytes,
        })
    }

    fn row_ptr(&self, block: BlockId, len: usize) -> Result<u64> {
        if u64::from(block) >= self.num_rows || len != self.block_bytes {
            return Err(KvoffError::arg(format!(
                "block {block} (of {} rows) with {len} bytes (block is {} bytes)",
                self.num_rows, self.block_bytes
            )));
        }
        Ok(self.ptr + u64::from(block) * self.row_stride_bytes)
    }
}

impl RawRows {
    /// Reads a whole file: `header.len()` bytes into `header`, then the block's bytes straight into
    /// block `block` (one `preadv`), and returns the xxh3-64 of what landed in the block.
    fn read_file(&self, block: BlockId, file: &File, header: &mut [u8]) -> io::Result<u64> {
        let dst = self
            .row_ptr(block, self.block_bytes)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        // SAFETY: obligation 1 (the block's bytes are mapped and writable; `row_ptr` checked the
        // bounds) and 2 (the block is a pending store: no one else reads or writes it while this
        // slice lives, which ends with this function).
        let payload = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, self.block_bytes) };
        let iov = [
            libc::iovec {
                iov_base: header.as_mut_ptr().cast(),
                iov_len: header.len(),
            },
            libc::iovec {
                iov_base: payload.as_mut_ptr().cast(),
                iov_len: payload.len(),
            },
        ];
        // SAFETY: both iovecs describe live, writable, distinct buffers of the given lengths (the
        // header slice and `payload` above); the fd is open for the duration of the call.
        let n = unsafe { libc::preadv(file.as_raw_fd(), iov.as_ptr(), 2, 0) };
        let want = header.len() + payload.len();
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if usize::try_from(n).unwrap_or(0) < want {
            // Short read (end of file, or a signal): read each part again to the end.
            file.read_exact_at(header, 0)?;
            file.read_exact_at(payload, header.len() as u64)?;
        }
        Ok(xxh3_64(payload))
    }
}

impl RawRows {
    fn aligned(&self, block: BlockId) -> bool {
        (self.ptr + u64::from(block) * self.row_stride_bytes) % ALIGN as u64 == 0
            && self.block_bytes % ALIGN == 0
    }

    fn block_slice(&self, block: BlockId) -> io::Result<&[u8]> {
        let src = self
            .row_ptr(block, self.block_bytes)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        // SAFETY: obligation 1 (mapped; `row_ptr` checked the bounds) and 2 (the block is pinned:
        // no one writes it while the tier reads it, and the slice does not outlive the caller's use
        // within one write job).
        Ok(unsafe { std::slice::from_raw_parts(src as *const u8, self.block_bytes) })
    }

    fn write_file(&self, block: BlockId, file: &File, header: &[u8]) -> io::Result<()> {
        let payload = self.block_slice(block)?;
        let iov = [
            libc::iovec {
                iov_base: header.as_ptr().cast_mut().cast(),
                iov_len: header.len(),
            },
            libc::iovec {
                iov_base: payload.as_ptr().cast_mut().cast(),
                iov_len: payload.len(),
            },
        ];
        // SAFETY: both iovecs describe live buffers of the given lengths that `pwritev` only reads;
        // the fd is open for the duration of the call.
        let n = unsafe { libc::pwritev(file.as_raw_fd(), iov.as_ptr(), 2, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if usize::try_from(n).unwrap_or(0) < header.len() + payload.len() {
            file.write_all_at(header, 0)?;
            file.write_all_at(payload, header.len() as u64)?;
        }
        Ok(())
    }
}

impl BlockMemory for RawRows {
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }
    fn num_blocks(&self) -> u64 {
        self.num_rows
    }
    fn copy_out(&self, block: BlockId, out: &mut [u8]) -> Result<()> {
        let src = self.row_ptr(block, out.len())?;
        // SAFETY: obligation 1 (the row is mapped; `row_ptr` checked the bounds) and 2 (no writer
        // while the block is copied out); `out` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
    fn read_file_into(
        &self,
        block: BlockId,
        file: &File,
        header: &mut [u8],
    ) -> Option<io::Result<u64>> {
        // `O_DIRECT` needs 4 KiB-aligned memory and lengths; otherwise the tier uses its buffer.
        (self.aligned(block) && header.len() % ALIGN == 0)
            .then(|| self.read_file(block, file, header))
    }
    fn payload_sum(&self, block: BlockId) -> Option<io::Result<u64>> {
        self.aligned(block)
            .then(|| self.block_slice(block).map(xxh3_64))
    }
    fn write_file_from(
        &self,
        block: BlockId,
        file: &File,
        header: &[u8],
    ) -> Option<io::Result<()>> {
        (self.aligned(block) && header.len() % ALIGN == 0)
            .then(|| self.write_file(block, file, header))
    }
    fn with_block(&self, block: BlockId, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        let src = self.row_ptr(block, self.block_bytes)?;
        // SAFETY: obligation 1 (the row is mapped; `row_ptr` checked the bounds) and 2 (the block
        // is pinned: no writer while `f` reads it; the slice does not outlive this call).
        f(unsafe { std::slice::from_raw_parts(src as *const u8, self.block_bytes) });
        Ok(())
    }
    fn with_block_mut(&self, block: BlockId, f: &mut dyn FnMut(&mut [u8]) -> bool) -> Result<()> {
        let dst = self.row_ptr(block, self.block_bytes)?;
        // SAFETY: obligation 1 (mapped and writable, bounds checked) and 2 (a pending block: no
        // other reader or writer while `f` writes it; the slice does not outlive this call).
        f(unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, self.block_bytes) });
        Ok(())
    }
    fn copy_in(&self, block: BlockId, data: &[u8]) -> Result<()> {
        let dst = self.row_ptr(block, data.len())?;
        // SAFETY: obligation 1 (mapped and writable, bounds checked) and 2 (no other reader or
        // writer of a pending block); `data` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len()) };
        Ok(())
    }
}

/// Host memory owned by the tier's user: `num_blocks` blocks of `block_bytes` in one 4 KiB-aligned
/// allocation, rows 4 KiB-aligned, so that promotions read straight into it (as into a
/// `HostRegion`). For tools, benchmarks and tests.
pub struct AlignedRows {
    rows: RawRows,
    _buf: AlignedBuf,
}

impl std::fmt::Debug for AlignedRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedRows")
            .field("rows", &self.rows)
            .finish_non_exhaustive()
    }
}

impl AlignedRows {
    /// `num_blocks` zeroed blocks of `block_bytes`.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] for a zero block size or a size that overflows.
    pub fn new(num_blocks: usize, block_bytes: usize) -> Result<Self> {
        let stride = block_bytes.next_multiple_of(ALIGN);
        let total = stride
            .checked_mul(num_blocks.max(1))
            .ok_or_else(|| KvoffError::arg("host rows too large"))?;
        let mut buf = AlignedBuf::new(total);
        let ptr = buf.as_mut_slice().as_mut_ptr() as u64;
        // SAFETY: obligation 1: the allocation of `buf` (owned by the returned value, never
        // reallocated or otherwise borrowed) holds `num_blocks` rows of `stride` bytes.
        // Obligation 2 is the tier's protocol, as for any `RawRows`.
        let rows = unsafe { RawRows::new(ptr, num_blocks as u64, stride as u64, block_bytes)? };
        Ok(Self { rows, _buf: buf })
    }
}

impl BlockMemory for AlignedRows {
    fn block_bytes(&self) -> usize {
        self.rows.block_bytes()
    }
    fn num_blocks(&self) -> u64 {
        self.rows.num_blocks()
    }
    fn copy_out(&self, block: BlockId, out: &mut [u8]) -> Result<()> {
        self.rows.copy_out(block, out)
    }
    fn copy_in(&self, block: BlockId, data: &[u8]) -> Result<()> {
        self.rows.copy_in(block, data)
    }
    fn with_block(&self, block: BlockId, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        self.rows.with_block(block, f)
    }
    fn with_block_mut(&self, block: BlockId, f: &mut dyn FnMut(&mut [u8]) -> bool) -> Result<()> {
        self.rows.with_block_mut(block, f)
    }
    fn read_file_into(
        &self,
        block: BlockId,
        file: &File,
        header: &mut [u8],
    ) -> Option<io::Result<u64>> {
        self.rows.read_file_into(block, file, header)
    }
    fn payload_sum(&self, block: BlockId) -> Option<io::Result<u64>> {
        self.rows.payload_sum(block)
    }
    fn write_file_from(
        &self,
        block: BlockId,
        file: &File,
        header: &[u8],
    ) -> Option<io::Result<()>> {
        self.rows.write_file_from(block, file, header)
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;

    #[test]
    fn aligned() {
        let mut b = AlignedBuf::new(5000);
        assert_eq!(b.len(), 8192);
        assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
        b.as_mut_slice()[8191] = 3;
        assert_eq!(b.as_slice()[8191], 3);
    }
}
