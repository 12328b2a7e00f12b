//! The geometry of a region (row stride, data bytes) and the header of a shared region's file:
//! whole pages of `u64` words (magic, version, geometry, join counter, one joined flag per rank),
//! every word accessed atomically through [`HostRegion::hdr`].
// Unsafe: a reference to a header word of the live mapping (`hdr`).
#![allow(unsafe_code)]

use std::sync::atomic::AtomicU64;

use super::{os_page_size, HostRegion};
use crate::error::{KvoffError, Result};

pub(super) const MAGIC: u64 = u64::from_le_bytes(*b"KVOFFRG1");
pub(super) const VERSION: u64 = 1;
// Header words (u64 each).
pub(super) const H_MAGIC: usize = 0;
pub(super) const H_VERSION: usize = 1;
pub(super) const H_NUM_CPU_BLOCKS: usize = 2;
pub(super) const H_SLOT_BYTES: usize = 3;
pub(super) const H_WORLD_SIZE: usize = 4;
pub(super) const H_ROW_STRIDE: usize = 5;
pub(super) const H_HEADER_BYTES: usize = 6;
pub(super) const H_JOINED: usize = 7;
pub(super) const H_RANK_FLAGS: usize = 8;

pub(super) struct Geometry {
    pub(super) row_stride_bytes: u64,
    pub(super) data_bytes: u64,
}

pub(super) fn geometry(num_cpu_blocks: u64, slot_bytes: u64, world_size: u64) -> Result<Geometry> {
    if world_size == 0 {
        return Err(KvoffError::arg("world_size must be >= 1, got 0"));
    }
    if slot_bytes == 0 {
        return Err(KvoffError::arg("slot_bytes must be > 0"));
    }
    let page = os_page_size();
    let row_stride_bytes = slot_bytes
        .checked_mul(world_size)
        .and_then(|b| b.checked_next_multiple_of(page))
        .ok_or_else(|| KvoffError::arg("region row size overflows u64"))?;
    let data_bytes = num_cpu_blocks
        .checked_mul(row_stride_bytes)
        .filter(|&b| usize::try_from(b).is_ok() && i64::try_from(b).is_ok())
        .ok_or_else(|| {
            KvoffError::arg(format!(
                "region size overflows: {num_cpu_blocks} rows x {row_stride_bytes} bytes"
            ))
        })?;
    Ok(Geometry {
        row_stride_bytes,
        data_bytes,
    })
}

pub(super) fn header_bytes(world_size: u64) -> Result<u64> {
    (H_RANK_FLAGS as u64)
        .checked_add(world_size)
        .and_then(|w| w.checked_mul(8))
        .and_then(|b| b.checked_next_multiple_of(os_page_size()))
        .ok_or_else(|| KvoffError::arg("world_size too large"))
}

impl HostRegion {
    /// Header word `word` of a shared region's mapping.
    pub(super) fn hdr(&self, word: usize) -> &AtomicU64 {
        debug_assert!(self.map_len >= self.data_offset && (word + 1) * 8 <= self.data_offset);
        // SAFETY: only called on a shared region while its mapping (header included, page aligned
        // and so 8-aligned) is live; `word` indexes inside the header (`H_RANK_FLAGS + rank`,
        // rank < world_size, fits `header_bytes`); the reference cannot outlive `&self`, and the
        // mapping is only unmapped through `&mut self`.
        #[allow(clippy::cast_ptr_alignment)] // 8-aligned: see the SAFETY comment
        let p = self.map_ptr.as_ptr().cast::<AtomicU64>();
        // SAFETY: as above.
        unsafe { &*p.add(word) }
    }
}
