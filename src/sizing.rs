//! Host-memory sizing (docs/spec.md §3): how many CPU blocks fit in the host budget.
//!
//! One CPU block of one rank holds, for every canonical KV tensor, `block_size_factor` pages of that
//! tensor (`slot_bytes = Σ page_size_bytes × f`). A row of the host region holds one such slot per
//! rank, padded to the OS page size: `row_stride_bytes = round_up(slot_bytes × world_size, page)`.
//! `num_cpu_blocks = cpu_bytes_to_use / row_stride_bytes`, where `cpu_bytes_to_use` is the budget for
//! all ranks together.
//!
//! Invariants of a returned [`CpuSizing`]: `slot_bytes > 0`, `row_stride_bytes` is a positive multiple
//! of the OS page size and `≥ slot_bytes × world_size`, and
//! `num_cpu_blocks × row_stride_bytes ≤ cpu_bytes_to_use`. Every product is overflow-checked.
#![forbid(unsafe_code)]

use crate::error::{KvoffError, Result};
use crate::region::os_page_size;

/// Name of the configuration key holding the host memory budget (for all ranks together).
pub const CPU_BYTES_TO_USE_KEY: &str = "cpu_bytes_to_use";

/// The result of [`cpu_sizing`]: the geometry of a host region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuSizing {
    /// Bytes of one rank's share of one CPU block: `Σ page_size_bytes × block_size_factor`.
    pub slot_bytes: u64,
    /// Bytes between consecutive CPU blocks (rows) of the region: all ranks' slots, rounded up to the
    /// OS page size. This is `kv_bytes_per_cpu_block`.
    pub row_stride_bytes: u64,
    /// Number of CPU blocks that fit in the budget.
    pub num_cpu_blocks: u64,
}

/// Bytes of one rank's slot: `Σ page_size_bytes × block_size_factor`.
///
/// # Errors
/// [`KvoffError::InvalidArgument`] when `page_size_bytes` is empty or contains 0, when
/// `block_size_factor` is 0, or on overflow.
pub fn slot_bytes(page_size_bytes: &[u64], block_size_factor: u64) -> Result<u64> {
    if block_size_factor == 0 {
        return Err(KvoffError::arg("block_size_factor must be >= 1, got 0"));
    }
    if page_size_bytes.is_empty() {
        return Err(KvoffError::arg(
            "page_size_bytes is empty: there must be at least one KV-cache tensor",
        ));
    }
    let mut sum: u64 = 0;
    for (t, &page) in page_size_bytes.iter().enumerate() {
        if page == 0 {
            return Err(KvoffError::arg(format!(
                "page_size_bytes[{t}] is 0: every KV-cache tensor must have a positive page size"
            )));
        }
        sum = sum
            .checked_add(page)
            .ok_or_else(|| KvoffError::arg("sum of page_size_bytes overflows u64"))?;
    }
    sum.checked_mul(block_size_factor).ok_or_else(|| {
        KvoffError::arg(format!(
            "slot size overflows u64: {sum} bytes x block_size_factor {block_size_factor}"
        ))
    })
}

/// `kv_bytes_per_cpu_block`: the row stride of the host region,
/// `round_up(Σ page_size_bytes × block_size_factor × world_size, OS page size)`.
///
/// # Errors
/// [`KvoffError::InvalidArgument`] when `page_size_bytes` is empty or contains 0, when
/// `block_size_factor` or `world_size` is 0, or on overflow.
pub fn kv_bytes_per_cpu_block(
    page_size_bytes: &[u64],
    block_size_factor: u64,
    world_size: u64,
) -> Result<u64> {
    let slot = slot_bytes(page_size_bytes, block_size_factor)?;
    row_stride_bytes(slot, world_size)
}

/// Row stride for `world_size` slots of `slot_bytes`: their sum rounded up to the OS page size.
///
/// # Errors
/// [`KvoffError::InvalidArgument`] when `slot_bytes` or `world_size` is 0, or on overflow.
pub fn row_stride_bytes(slot_bytes: u64, world_size: u64) -> Result<u64> {
    if world_size == 0 {
        return Err(KvoffError::arg("world_size must be >= 1, got 0"));
    }
    if slot_bytes == 0 {
        return Err(KvoffError::arg("slot_bytes must be > 0"));
    }
    let page = os_page_size();
    slot_bytes
        .checked_mul(world_size)
        .and_then(|b| b.checked_next_multiple_of(page))
        .ok_or_else(|| {
            KvoffError::arg(format!(
                "row size overflows u64: {slot_bytes} bytes x world_size {world_size}"
            ))
        })
}

/// `num_cpu_blocks = cpu_bytes_to_use / row_stride_bytes` (0 when the budget is smaller than a row).
///
/// `cpu_bytes_to_use` is an `Option<i64>` because it comes from user configuration (a Python `int`
/// or a missing key).
///
/// # Errors
/// [`KvoffError::Config`] naming the key `cpu_bytes_to_use` when it is missing or ≤ 0;
/// [`KvoffError::InvalidArgument`] when `row_stride_bytes` is 0.
pub fn num_cpu_blocks(cpu_bytes_to_use: Option<i64>, row_stride_bytes: u64) -> Result<u64> {
    let budget = match cpu_bytes_to_use {
        None => {
            return Err(KvoffError::Config(format!(
                "`{CPU_BYTES_TO_USE_KEY}` is not set: set it to the number of host bytes to use for \
                 offloaded KV-cache blocks (total for all ranks), e.g. {CPU_BYTES_TO_USE_KEY}=64000000000"
            )))
        }
        Some(b) if b <= 0 => {
            return Err(KvoffError::Config(format!(
                "`{CPU_BYTES_TO_USE_KEY}` must be a positive number of bytes (total for all ranks), \
                 got {b}"
            )))
        }
        Some(b) => b.unsigned_abs(),
    };
    if row_stride_bytes == 0 {
        return Err(KvoffError::arg("row_stride_bytes must be > 0"));
    }
    Ok(budget / row_stride_bytes)
}

/// Full sizing in one call: slot, row stride and number of CPU blocks.
///
/// # Errors
/// As [`kv_bytes_per_cpu_block`] and [`num_cpu_blocks`]; the configuration key is checked first.
pub fn cpu_sizing(
    page_size_bytes: &[u64],
    block_size_factor: u64,
    world_size: u64,
    cpu_bytes_to_use: Option<i64>,
) -> Result<CpuSizing> {
    // Check the configuration first so that a missing key is reported as such.
    num_cpu_blocks(cpu_bytes_to_use, 1)?;
    let slot_bytes = slot_bytes(page_size_bytes, block_size_factor)?;
    let row_stride_bytes = row_stride_bytes(slot_bytes, world_size)?;
    let num_cpu_blocks = num_cpu_blocks(cpu_bytes_to_use, row_stride_bytes)?;
    Ok(CpuSizing {
        slot_bytes,
        row_stride_bytes,
        num_cpu_blocks,
    })
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;

    #[test]
    fn row_stride_rounds_up_to_page() {
        let page = os_page_size();
        // 2 tensors of 1000 B, f=3, ws=2 → 12000 B → next page multiple.
        let stride = kv_bytes_per_cpu_block(&[1000, 1000], 3, 2).unwrap();
        assert_eq!(stride, 12000u64.next_multiple_of(page));
        assert_eq!(stride % page, 0);
        // Exact multiple stays.
        assert_eq!(kv_bytes_per_cpu_block(&[page], 1, 1).unwrap(), page);
    }

    #[test]
    fn num_blocks_divides_budget() {
        let page = os_page_size();
        let s = cpu_sizing(
            &[page / 2, page / 2],
            4,
            2,
            Some(i64::try_from(page * 81).unwrap()),
        )
        .unwrap();
        assert_eq!(s.slot_bytes, page * 4);
        assert_eq!(s.row_stride_bytes, page * 8);
        assert_eq!(s.num_cpu_blocks, 10);
        // Budget smaller than one row → 0 blocks.
        assert_eq!(num_cpu_blocks(Some(1), page).unwrap(), 0);
    }

    #[test]
    fn missing_or_bad_budget_is_config_error() {
        for bad in [None, Some(0), Some(-5)] {
            match cpu_sizing(&[4096], 1, 1, bad) {
                Err(KvoffError::Config(msg)) => assert!(msg.contains("cpu_bytes_to_use"), "{msg}"),
                other => panic!("expected Config error, got {other:?}"),
            }
        }
    }

    #[test]
    fn bad_geometry_is_invalid_argument() {
        assert!(matches!(
            kv_bytes_per_cpu_block(&[], 1, 1),
            Err(KvoffError::InvalidArgument(_))
        ));
        assert!(matches!(
            kv_bytes_per_cpu_block(&[0], 1, 1),
            Err(KvoffError::InvalidArgument(_))
        ));
        assert!(matches!(
            kv_bytes_per_cpu_block(&[1], 0, 1),
            Err(KvoffError::InvalidArgument(_))
        ));
        assert!(matches!(
            kv_bytes_per_cpu_block(&[1], 1, 0),
            Err(KvoffError::InvalidArgument(_))
        ));
        assert!(matches!(
            kv_bytes_per_cpu_block(&[u64::MAX, 1], 1, 1),
            Err(KvoffError::InvalidArgument(_))
        ));
        assert!(matches!(
            kv_bytes_per_cpu_block(&[u64::MAX / 2], 4, 1),
            Err(KvoffError::InvalidArgument(_))
        ));
    }
}
