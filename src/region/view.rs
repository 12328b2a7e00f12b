//! Views of a region: [`RegionView`] (one rank's byte range in every row, as a tensor
//! descriptor for the planner) and the bounds-checked copies in and out of a slot.
// Unsafe: copies between the mapping and Rust buffers, inside bounds checked by `slot_range`.
#![allow(unsafe_code)]

use super::HostRegion;
use crate::error::{KvoffError, Result};
use crate::plan::TensorDesc;

/// A 2-D byte view inside one rank's slot: `rows` rows of `nbytes`, `row_stride_bytes` apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionView {
    /// Address of the view's first byte (row 0).
    pub ptr: u64,
    /// Number of rows (= the region's `num_cpu_blocks`).
    pub rows: u64,
    /// Bytes from one row to the next (= the region's row stride).
    pub row_stride_bytes: u64,
    /// Bytes per row of the view.
    pub nbytes: u64,
}

impl RegionView {
    /// The view as a CPU-side tensor descriptor for [`crate::plan::CopyPlanner`].
    #[must_use]
    pub const fn tensor_desc(&self) -> TensorDesc {
        TensorDesc::new(self.ptr, self.rows, self.row_stride_bytes, self.nbytes)
    }
}

impl HostRegion {
    /// A view of bytes `offset..offset+nbytes` of `rank`'s slot in every row.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] when `rank ≥ world_size` or the bytes leave the slot;
    /// [`KvoffError::InvalidState`] after close.
    pub fn view(&self, rank: u64, offset: u64, nbytes: u64) -> Result<RegionView> {
        self.check_open()?;
        if rank >= self.world_size {
            return Err(KvoffError::arg(format!(
                "rank {rank} out of range for world_size {}",
                self.world_size
            )));
        }
        if offset
            .checked_add(nbytes)
            .is_none_or(|e| e > self.slot_bytes)
        {
            return Err(KvoffError::arg(format!(
                "view of {nbytes} bytes at offset {offset} does not fit in a slot of {} bytes",
                self.slot_bytes
            )));
        }
        Ok(RegionView {
            ptr: self.data_ptr() + rank * self.slot_bytes + offset,
            rows: self.num_cpu_blocks,
            row_stride_bytes: self.row_stride_bytes,
            nbytes,
        })
    }

    fn slot_range(&self, rank: u64, row: u64, offset: u64, len: usize, write: bool) -> Result<u64> {
        self.check_open()?;
        if write && self.rank.is_some_and(|r| r != rank) {
            return Err(KvoffError::arg(format!(
                "rank {rank}'s slot belongs to another process; this process is rank {}",
                self.rank.unwrap_or(0)
            )));
        }
        let end = offset.checked_add(len as u64);
        if rank >= self.world_size
            || row >= self.num_cpu_blocks
            || end.is_none_or(|e| e > self.slot_bytes)
        {
            return Err(KvoffError::arg(format!(
                "rank {rank}, row {row}, bytes {offset}+{len} is outside the region \
                 ({} ranks, {} rows, slot {} bytes)",
                self.world_size, self.num_cpu_blocks, self.slot_bytes
            )));
        }
        Ok(self.data_ptr() + row * self.row_stride_bytes + rank * self.slot_bytes + offset)
    }

    /// Copies bytes out of `rank`'s slot in `row`, starting at `offset`, into `out`.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] when the bytes are outside the slot;
    /// [`KvoffError::InvalidState`] after close.
    pub fn copy_from_slot(&self, rank: u64, row: u64, offset: u64, out: &mut [u8]) -> Result<()> {
        let src = self.slot_range(rank, row, offset, out.len(), false)?;
        // SAFETY: `src..src+len` lies in the live mapping (checked by `slot_range`); `out` is a
        // distinct Rust buffer, so they do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `data` into `rank`'s slot in `row` at `offset`. A rank of a shared region may write
    /// only its own slot (an observer, any).
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] when the bytes are outside the slot or belong to another
    /// process's rank; [`KvoffError::InvalidState`] after close.
    pub fn copy_to_slot(&mut self, rank: u64, row: u64, offset: u64, data: &[u8]) -> Result<()> {
        let dst = self.slot_range(rank, row, offset, data.len(), true)?;
        // SAFETY: `dst..dst+len` lies in the live, writable mapping inside a slot this process owns
        // (checked by `slot_range`); `data` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len()) };
        Ok(())
    }
}
