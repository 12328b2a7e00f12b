//! Host memory of the block store's segments mode (`super`): each key's block is a
//! list of `(address, length)` pieces anywhere in host memory ([`SlotMemory`], set per job), and
//! the flat `(ptrs, sizes)` arrays the caller passes are split into those lists
//! ([`split_pieces`]).
// Unsafe: copies between the tier's buffer and the caller's pieces (`SlotMemory`); each block says
// which obligation of `SlotMemory::set` holds.
#![allow(unsafe_code)]

use std::sync::{Mutex, PoisonError};

use crate::manager::BlockId;
use crate::tier::BlockMemory;
use crate::KvoffError;

/// Host memory given as per-block lists of `(address, length)` pieces, set for each job.
///
/// The I/O threads read a slot's pieces while it is in flight; the store only changes a slot's
/// pieces while no job uses it.
#[derive(Debug)]
pub(super) struct SlotMemory {
    slots: Vec<Mutex<Vec<(u64, usize)>>>,
    block_bytes: usize,
}

impl SlotMemory {
    pub(super) fn new(num_slots: usize, block_bytes: usize) -> Self {
        Self {
            slots: (0..num_slots).map(|_| Mutex::new(Vec::new())).collect(),
            block_bytes,
        }
    }

    /// Sets slot `slot`'s pieces.
    ///
    /// # Safety
    /// 1. Every piece `addr .. addr + len` is mapped, readable and writable until the job queued
    ///    with this slot has finished (its completion came out of the tier's `poll`).
    /// 2. No one else writes the pieces while a write job copies them out, nor reads or writes them
    ///    while a read job copies into them.
    pub(super) unsafe fn set(&self, slot: BlockId, pieces: Vec<(u64, usize)>) -> crate::Result<()> {
        let total: usize = pieces.iter().map(|p| p.1).sum();
        if total != self.block_bytes || pieces.iter().any(|p| p.0 == 0) {
            return Err(KvoffError::arg(format!(
                "a block's pieces must be non-null and add up to {} bytes, got {total}",
                self.block_bytes
            )));
        }
        let s = self
            .slots
            .get(slot as usize)
            .ok_or_else(|| KvoffError::arg(format!("slot {slot} out of range")))?;
        *s.lock().unwrap_or_else(PoisonError::into_inner) = pieces;
        Ok(())
    }

    fn pieces(&self, block: BlockId, len: usize) -> crate::Result<Vec<(u64, usize)>> {
        if len != self.block_bytes {
            return Err(KvoffError::arg(format!(
                "{len} bytes for a block of {}",
                self.block_bytes
            )));
        }
        let s = self
            .slots
            .get(block as usize)
            .ok_or_else(|| KvoffError::arg(format!("slot {block} out of range")))?;
        Ok(s.lock().unwrap_or_else(PoisonError::into_inner).clone())
    }
}

impl BlockMemory for SlotMemory {
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn num_blocks(&self) -> u64 {
        self.slots.len() as u64
    }

    fn copy_out(&self, block: BlockId, out: &mut [u8]) -> crate::Result<()> {
        let mut at = 0;
        for (addr, len) in self.pieces(block, out.len())? {
            // SAFETY: obligation 1 of `SlotMemory::set` (the piece is mapped while its job runs,
            // and this runs inside the job) and 2 (no one writes it while a write copies it out);
            // `set` checked that the pieces add up to `out.len()`.
            let src = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
            out[at..at + len].copy_from_slice(src);
            at += len;
        }
        Ok(())
    }

    fn copy_in(&self, block: BlockId, data: &[u8]) -> crate::Result<()> {
        let mut at = 0;
        for (addr, len) in self.pieces(block, data.len())? {
            // SAFETY: obligations 1 and 2 of `SlotMemory::set` (mapped and writable while the
            // read job runs, and no one else touches it meanwhile); the lengths add up to
            // `data.len()`.
            let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            dst.copy_from_slice(&data[at..at + len]);
            at += len;
        }
        Ok(())
    }
}

/// Splits flat `(ptrs, sizes)` into one list of pieces per key (the same number for each).
pub(super) fn split_pieces(
    n_keys: usize,
    ptrs: &[u64],
    sizes: &[u64],
) -> crate::Result<Vec<Vec<(u64, usize)>>> {
    if ptrs.len() != sizes.len() {
        return Err(KvoffError::arg(format!(
            "{} pointers but {} sizes",
            ptrs.len(),
            sizes.len()
        )));
    }
    if n_keys == 0 {
        return if ptrs.is_empty() {
            Ok(Vec::new())
        } else {
            Err(KvoffError::arg("pointers given for no keys"))
        };
    }
    if ptrs.len() % n_keys != 0 || ptrs.is_empty() {
        return Err(KvoffError::arg(format!(
            "{} pieces do not divide evenly among {n_keys} keys",
            ptrs.len()
        )));
    }
    let per = ptrs.len() / n_keys;
    let mut out = Vec::with_capacity(n_keys);
    for i in 0..n_keys {
        let mut v = Vec::with_capacity(per);
        for j in i * per..(i + 1) * per {
            let len = usize::try_from(sizes[j])
                .map_err(|_| KvoffError::arg(format!("piece of {} bytes", sizes[j])))?;
            v.push((ptrs[j], len));
        }
        out.push(v);
    }
    Ok(out)
}
