//! Prefaulting a region: the pages of this process's own slots are populated at creation
//! (`MADV_POPULATE_WRITE`, or one read and write-back per page where the kernel lacks it), so
//! that the first transfer does not pay for page faults and an out-of-memory shows at creation.
// Unsafe: `madvise` and volatile accesses inside this process's own slots.
#![allow(unsafe_code)]

use super::sys::last_err;
use super::{os_page_size, HostRegion};
use crate::error::{KvoffError, Result};

const MADV_POPULATE_WRITE: libc::c_int = 23;

impl HostRegion {
    /// Page-aligned ranges to prefault and the exact byte ranges they stand for.
    pub(super) fn own_ranges(&self) -> Vec<(usize, usize)> {
        let data = crate::usize_from(self.data_ptr());
        let len = crate::usize_from(self.len_bytes());
        match self.rank {
            Some(r) if self.world_size > 1 => {
                let (slot, stride) = (
                    crate::usize_from(self.slot_bytes),
                    crate::usize_from(self.row_stride_bytes),
                );
                (0..crate::usize_from(self.num_cpu_blocks))
                    .map(|row| {
                        let s = data + row * stride + crate::usize_from(r) * slot;
                        (s, s + slot)
                    })
                    .collect()
            }
            _ if len > 0 => vec![(data, data + len)],
            _ => Vec::new(),
        }
    }

    /// Prefaults this process's slots: `MADV_POPULATE_WRITE` over page-aligned ranges (merged), or,
    /// where the kernel lacks it, reading and writing back one byte per page inside the slots.
    pub(super) fn prefault(&mut self) -> Result<()> {
        let slots = self.own_ranges();
        if slots.is_empty() {
            return Ok(());
        }
        let page = crate::usize_from(os_page_size());
        let mut merged: Vec<(usize, usize)> = Vec::new();
        for &(s, e) in &slots {
            let (a, b) = (s / page * page, e.div_ceil(page) * page);
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        for (k, &(a, b)) in merged.iter().enumerate() {
            // SAFETY: `[a, b)` lies inside our live mapping (slots are inside the data area, and the
            // data area starts and ends on page boundaries); POPULATE_WRITE does not change contents.
            let rc = unsafe { libc::madvise(a as *mut libc::c_void, b - a, MADV_POPULATE_WRITE) };
            if rc != 0 {
                let e = last_err();
                if k == 0 && e.raw_os_error() == Some(libc::EINVAL) {
                    self.touch_pages(&slots, page);
                    return Ok(());
                }
                return Err(KvoffError::region_io(
                    format!(
                        "cannot prefault {} bytes of host region at {a:#x}: {e}",
                        b - a
                    ),
                    e,
                ));
            }
        }
        Ok(())
    }

    /// Fallback prefault: one read + write-back per page, only at addresses inside our slots.
    #[allow(clippy::unused_self)] // `&mut self`: the mapping must not be shared while touched
    fn touch_pages(&mut self, slots: &[(usize, usize)], page: usize) {
        for &(s, e) in slots {
            let mut addr = s;
            while addr < e {
                let p = addr as *mut u8;
                // SAFETY: `p` is inside one of this process's own slots of the live mapping (no one
                // else writes there), so reading it and writing the same value back is a no-op
                // that faults the page in.
                unsafe { p.write_volatile(p.read_volatile()) };
                addr = (addr / page + 1) * page;
            }
        }
    }
}
