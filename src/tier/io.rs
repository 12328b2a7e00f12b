//! File I/O of the tier: 4 KiB-aligned buffers, `O_DIRECT` where the filesystem takes it (buffered
//! otherwise), whole-file reads and atomic publication (temporary file, optional `fsync`, `rename`).
//!
//! The only `unsafe` of the tier lives here: viewing an aligned allocation as bytes, and [`RawRows`],
//! host memory given as a raw pointer by a caller that promises it stays mapped (the Python bindings,
//! which get the pointer of a `HostRegion` view, as the transfer engines do).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::error::{KvoffError, Result};
use crate::manager::BlockId;

use super::BlockMemory;

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

/// Opens `path` for reading, with `O_DIRECT` when `direct`.
///
/// # Errors
/// The OS error.
pub fn open_read(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    if direct {
        o.custom_flags(libc::O_DIRECT | libc::O_NOFOLLOW | libc::O_CLOEXEC);
    }
    o.open(path)
}

fn open_new(path: &Path, direct: bool, mode: u32) -> io::Result<File> {
    let mut o = OpenOptions::new();
    let base = libc::O_NOFOLLOW | libc::O_CLOEXEC;
    o.write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(if direct { base | libc::O_DIRECT } else { base });
    o.open(path)
}

/// Reads exactly `buf.len()` bytes from offset 0 of `f`. A short file is `UnexpectedEof`.
///
/// # Errors
/// The OS error, or `UnexpectedEof`.
pub fn read_full(f: &File, buf: &mut [u8]) -> io::Result<()> {
    f.read_exact_at(buf, 0)
}

/// How [`publish`] opens and finishes files.
#[derive(Clone, Copy, Debug)]
pub struct PublishOpts {
    /// Open with `O_DIRECT`.
    pub direct: bool,
    /// `fdatasync` before the rename.
    pub fsync: bool,
    /// Mode of new files.
    pub mode: u32,
}

/// Writes a whole file of `len` bytes (by calling `write` on it) under the temporary name `tmp`, optionally `fsync`s it, and
/// renames it to `dst`. With `reuse`, an existing file (an evicted one of the same length) is first
/// renamed to `tmp` and overwritten in place, which spares the filesystem an inode and block
/// allocation per file; if that rename fails a new file is created. On any failure the temporary
/// file is removed. With `direct`, `write` must write 4 KiB-aligned memory in multiples of 4 KiB.
///
/// # Errors
/// The OS error of the step that failed.
pub fn publish(
    tmp: &Path,
    dst: &Path,
    len: u64,
    write: &mut dyn FnMut(&File) -> io::Result<()>,
    reuse: Option<&Path>,
    opts: PublishOpts,
) -> io::Result<()> {
    let PublishOpts {
        direct,
        fsync,
        mode,
    } = opts;
    let r = (|| {
        let reused = reuse.is_some_and(|old| std::fs::rename(old, tmp).is_ok());
        let f = if reused {
            let mut o = OpenOptions::new();
            let base = libc::O_NOFOLLOW | libc::O_CLOEXEC;
            o.write(true)
                .custom_flags(if direct { base | libc::O_DIRECT } else { base });
            let f = o.open(tmp)?;
            if f.metadata()?.len() != len {
                f.set_len(len)?;
            }
            f
        } else {
            open_new(tmp, direct, mode)?
        };
        write(&f)?;
        if fsync {
            f.sync_data()?;
        }
        drop(f);
        std::fs::rename(tmp, dst)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    r
}

/// Whether `dir` accepts `O_DIRECT` writes and reads of 4 KiB (tmpfs does not). Creates and removes
/// the file `probe` (a name inside `dir`).
///
/// # Errors
/// Any error other than `EINVAL` from `O_DIRECT` (the directory is not writable, …).
pub fn probe_direct(probe: &Path) -> io::Result<bool> {
    let buf = AlignedBuf::new(ALIGN);
    let direct = match open_new(probe, true, 0o600) {
        Ok(f) => {
            let ok = match f.write_all_at(buf.as_slice(), 0) {
                Ok(()) => true,
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => false,
                Err(e) => {
                    drop(f);
                    let _ = std::fs::remove_file(probe);
                    return Err(e);
                }
            };
            drop(f);
            ok
        }
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => false,
        Err(e) => return Err(e),
    };
    if !direct {
        // Plain write access still has to work.
        let _ = std::fs::remove_file(probe);
        let f = open_new(probe, false, 0o600)?;
        f.write_all_at(buf.as_slice(), 0)?;
    }
    std::fs::remove_file(probe)?;
    Ok(direct)
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
        Ok(xxhash_rust::xxh3::xxh3_64(payload))
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
            .then(|| self.block_slice(block).map(xxhash_rust::xxh3::xxh3_64))
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
