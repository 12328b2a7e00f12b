//! The gather/scatter copy kernel's descriptors (`kernels/copy.cu`): their format and buffers
//! (the launches are in `launch`).
// Unsafe: driver calls through `ffi` on handles this engine owns (each block says why it is sound).
#![allow(unsafe_code)]

use super::handles::{DevMem, PinnedHost};
use crate::error::{KvoffError, Result};
use crate::plan::CopyOp;

/// Most threads per CTA of the copy kernel (its `__launch_bounds__`).
pub(super) const MAX_KERNEL_THREADS: u32 = 1024;

/// Largest piece one warp copies; longer copies are split so warps stay balanced.
pub(super) const KERNEL_CHUNK_BYTES: u64 = 64 << 10;

/// Bytes of one kernel descriptor (`src`, `dst`, `bytes`).
pub(super) const DESC_BYTES: usize = 24;

/// A pinned staging buffer plus a device buffer for kernel descriptors.
pub(super) struct DescBuf {
    pub(super) host: PinnedHost,
    pub(super) dev: DevMem,
    pub(super) cap: usize,
}

/// Copies of a kernel job whose descriptors are written before its start event; the rest are
/// written while the device copies these (a head of a few hundred microseconds of work).
pub(super) const KERNEL_HEAD_COPIES: usize = 2048;

/// Writes the kernel descriptors of `copies` (pieces of at most [`KERNEL_CHUNK_BYTES`]) into
/// `buf`'s pinned host side from descriptor `first` on; returns how many were written.
pub(super) fn write_kernel_descs(copies: &[CopyOp], buf: &DescBuf, first: usize) -> Result<usize> {
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
