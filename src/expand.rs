//! Pointer expansion (docs/spec.md §4): block ids → sub-block ids or sub-block pointers.
//!
//! A CPU block holds `block_size_factor` (`f`) consecutive sub-blocks (one GPU block each). Block id
//! `b` expands to the sub-block ids `b*f, b*f+1, …, b*f+f−1`; the first `skip_count` (< f) expanded
//! entries are dropped and then `count` are kept (default: all the rest). This is the expansion of
//! vLLM's `expand_block_ids` / `compute_sub_block_ptrs`, with every argument checked.
//!
//! Invariants: every function validates all of its input before writing anything (an `_into`
//! variant leaves `out` untouched on error); every multiplication and addition that depends on input
//! is overflow-checked up front (against the largest id), so the inner loops are plain arithmetic.
#![forbid(unsafe_code)]

use crate::error::{KvoffError, Result};

/// Checks the common arguments and returns `(f, max_id, number of sub-blocks to emit)`.
/// Most sub-blocks one expansion may produce (2^28: 2 GiB of ids or pointers). Far above any real
/// job (a 512 MiB job of 4 KiB pages is 2^17 copies); an absurd size is a `ValueError`, never an
/// allocation that aborts the process.
pub const MAX_SUB_BLOCKS: usize = 1 << 28;

fn reserve<T>(out: &mut Vec<T>, count: usize) -> Result<()> {
    out.try_reserve(count).map_err(|_| {
        KvoffError::arg(format!(
            "cannot allocate {count} sub-blocks ({} bytes)",
            count.saturating_mul(std::mem::size_of::<T>())
        ))
    })
}

fn check_args(
    block_ids: &[i64],
    block_size_factor: usize,
    skip_count: usize,
    count: Option<usize>,
) -> Result<(u64, u64, usize)> {
    if block_size_factor == 0 {
        return Err(KvoffError::arg("block_size_factor must be >= 1, got 0"));
    }
    if skip_count >= block_size_factor {
        return Err(KvoffError::arg(format!(
            "skip_count ({skip_count}) must be smaller than block_size_factor ({block_size_factor})"
        )));
    }
    let total = block_ids
        .len()
        .checked_mul(block_size_factor)
        .ok_or_else(|| {
            KvoffError::arg("number of sub-blocks (len(block_ids) x block_size_factor) overflows")
        })?;
    if skip_count > total {
        return Err(KvoffError::arg(format!(
            "skip_count ({skip_count}) exceeds the number of sub-blocks ({total})"
        )));
    }
    let available = total - skip_count;
    let count = match count {
        None => available,
        Some(c) if c <= available => c,
        Some(c) => {
            return Err(KvoffError::arg(format!(
                "count ({c}) exceeds the {available} sub-blocks available ({} block ids x \
                 block_size_factor {block_size_factor} - skip_count {skip_count})",
                block_ids.len()
            )))
        }
    };
    if count > MAX_SUB_BLOCKS {
        return Err(KvoffError::arg(format!(
            "this expansion would produce {count} sub-blocks, more than the {MAX_SUB_BLOCKS} one \
             call may (a job of that many copies cannot be right; check block_size_factor and count)"
        )));
    }
    let mut max_id: i64 = 0;
    for (i, &b) in block_ids.iter().enumerate() {
        if b < 0 {
            return Err(KvoffError::arg(format!(
                "block_ids[{i}] = {b} is negative: block ids must be >= 0"
            )));
        }
        max_id = max_id.max(b);
    }
    Ok((block_size_factor as u64, max_id.unsigned_abs(), count))
}

/// Expands CPU block ids into sub-block ids: `b ↦ b*f .. b*f+f−1`, dropping the first `skip_count`
/// and keeping `count` (default: all remaining).
///
/// Example: `[0, 1, 3]`, f = 4 → `[0..=7, 12..=15]`.
///
/// # Errors
/// [`KvoffError::InvalidArgument`] when `block_size_factor` is 0, `skip_count ≥ block_size_factor`,
/// `count` exceeds the available sub-blocks, an id is negative, or a sub-block id overflows `i64`.
pub fn expand_block_ids(
    block_ids: &[i64],
    block_size_factor: usize,
    skip_count: usize,
    count: Option<usize>,
) -> Result<Vec<i64>> {
    let mut out = Vec::new();
    expand_block_ids_into(block_ids, block_size_factor, skip_count, count, &mut out)?;
    Ok(out)
}

/// As [`expand_block_ids`], appending to `out` (which is left unchanged on error).
///
/// # Errors
/// As [`expand_block_ids`].
pub fn expand_block_ids_into(
    block_ids: &[i64],
    block_size_factor: usize,
    skip_count: usize,
    count: Option<usize>,
    out: &mut Vec<i64>,
) -> Result<()> {
    let (f, max_id, count) = check_args(block_ids, block_size_factor, skip_count, count)?;
    // Largest sub-block id is max_id*f + f-1; it must fit in i64.
    let fits = i64::try_from(f).is_ok()
        && max_id
            .checked_mul(f)
            .and_then(|v| v.checked_add(f - 1))
            .is_some_and(|v| i64::try_from(v).is_ok());
    if !fits {
        return Err(KvoffError::arg(format!(
            "block id {max_id} x block_size_factor {f} overflows i64"
        )));
    }
    reserve(out, count)?;
    // Both fit in i64: checked above.
    #[allow(clippy::cast_possible_wrap)]
    let (f, mut skip) = (f as i64, skip_count as i64);
    let mut remaining = count;
    for &b in block_ids {
        if remaining == 0 {
            break;
        }
        let first = b * f + skip;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 0 < f - skip ≤ f
        let take = ((f - skip) as usize).min(remaining);
        // An inclusive range: the last id may be `i64::MAX` (a `first..` range would compute the
        // id after it, which overflows). `take` ≥ 1 and ≤ f, so `take - 1` fits.
        #[allow(clippy::cast_possible_wrap)]
        out.extend(first..=first + (take - 1) as i64);
        remaining -= take;
        skip = 0;
    }
    Ok(())
}

/// Pointers of the sub-blocks of `block_ids` in a tensor viewed as rows: the pointer of sub-block
/// `j` of block `b` is `base_ptr + b*row_stride_bytes + j*(row_bytes/f)`; skip/count as in
/// [`expand_block_ids`]. `row_stride_bytes` may exceed `row_bytes` (strided views).
///
/// Example: f = 3, ids `[7, 2]`, skip 2, count 4 →
/// `base+7R+2S, base+2R, base+2R+S, base+2R+2S` (R = row stride, S = row_bytes/3).
///
/// # Errors
/// [`KvoffError::InvalidArgument`] as for [`expand_block_ids`], and when `row_bytes` is not a
/// multiple of `block_size_factor`, or a pointer would overflow `u64`.
pub fn compute_sub_block_ptrs(
    block_ids: &[i64],
    block_size_factor: usize,
    base_ptr: u64,
    row_stride_bytes: u64,
    row_bytes: u64,
    skip_count: usize,
    count: Option<usize>,
) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    compute_sub_block_ptrs_into(
        block_ids,
        block_size_factor,
        base_ptr,
        row_stride_bytes,
        row_bytes,
        skip_count,
        count,
        &mut out,
    )?;
    Ok(out)
}

/// As [`compute_sub_block_ptrs`], appending to `out` (which is left unchanged on error).
///
/// # Errors
/// As [`compute_sub_block_ptrs`].
#[allow(clippy::too_many_arguments)] // mirrors the Python signature plus the output buffer
pub fn compute_sub_block_ptrs_into(
    block_ids: &[i64],
    block_size_factor: usize,
    base_ptr: u64,
    row_stride_bytes: u64,
    row_bytes: u64,
    skip_count: usize,
    count: Option<usize>,
    out: &mut Vec<u64>,
) -> Result<()> {
    let (f, max_id, count) = check_args(block_ids, block_size_factor, skip_count, count)?;
    if row_bytes % f != 0 {
        return Err(KvoffError::arg(format!(
            "row_bytes ({row_bytes}) is not a multiple of block_size_factor ({f})"
        )));
    }
    let sub = row_bytes / f;
    // Largest pointer: base + max_id*R + (f-1)*S; everything in the loop is at most that.
    let max_ptr = max_id
        .checked_mul(row_stride_bytes)
        .and_then(|v| v.checked_add((f - 1) * sub))
        .and_then(|v| v.checked_add(base_ptr));
    if max_ptr.is_none() {
        return Err(KvoffError::arg(format!(
            "sub-block pointer overflows u64: base {base_ptr:#x} + block {max_id} x row stride \
             {row_stride_bytes}"
        )));
    }
    reserve(out, count)?;
    let mut remaining = count;
    let mut skip = skip_count as u64;
    for &b in block_ids {
        if remaining == 0 {
            break;
        }
        let row = base_ptr + b.unsigned_abs() * row_stride_bytes;
        let take = crate::usize_from(f - skip).min(remaining);
        out.extend((skip..).take(take).map(|j| row + j * sub));
        remaining -= take;
        skip = 0;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;

    #[test]
    fn spec_example_ids() {
        let v = expand_block_ids(&[0, 1, 3], 4, 0, None).unwrap();
        let want: Vec<i64> = (0..8).chain(12..16).collect();
        assert_eq!(v, want);
    }

    #[test]
    fn spec_example_ptrs() {
        let (base, r, s) = (1_000_000u64, 1000u64, 300u64);
        let v = compute_sub_block_ptrs(&[7, 2], 3, base, r, 3 * s, 2, Some(4)).unwrap();
        assert_eq!(
            v,
            vec![
                base + 7 * r + 2 * s,
                base + 2 * r,
                base + 2 * r + s,
                base + 2 * r + 2 * s
            ]
        );
    }

    #[test]
    fn skip_and_count() {
        assert_eq!(
            expand_block_ids(&[2, 5], 3, 1, Some(3)).unwrap(),
            vec![7, 8, 15]
        );
        assert_eq!(
            expand_block_ids(&[2, 5], 3, 2, None).unwrap(),
            vec![8, 15, 16, 17]
        );
        assert_eq!(
            expand_block_ids(&[2], 1, 0, Some(0)).unwrap(),
            Vec::<i64>::new()
        );
        assert_eq!(
            expand_block_ids(&[], 4, 0, None).unwrap(),
            Vec::<i64>::new()
        );
    }

    #[test]
    fn errors() {
        assert!(expand_block_ids(&[1], 0, 0, None).is_err());
        assert!(expand_block_ids(&[1], 2, 2, None).is_err());
        assert!(expand_block_ids(&[1], 2, 1, Some(2)).is_err());
        assert!(expand_block_ids(&[], 2, 1, None).is_err());
        assert!(expand_block_ids(&[-1], 2, 0, None).is_err());
        assert!(expand_block_ids(&[i64::MAX / 2], 3, 0, None).is_err());
        assert!(compute_sub_block_ptrs(&[1], 3, 0, 10, 10, 0, None).is_err());
        assert!(compute_sub_block_ptrs(&[i64::MAX], 1, 0, 1 << 20, 8, 0, None).is_err());
        assert!(compute_sub_block_ptrs(&[1], 1, u64::MAX - 4, 8, 8, 0, None).is_err());
        let mut out = vec![42];
        assert!(expand_block_ids_into(&[-3], 1, 0, None, &mut out).is_err());
        assert_eq!(out, vec![42]);
    }

    /// Regression (found by `tests/fuzz_plan.rs`): the sub-block id `i64::MAX` is valid; producing
    /// it used to overflow (a panic in debug builds) computing the id after it.
    #[test]
    fn last_id_is_i64_max() {
        assert_eq!(
            expand_block_ids(&[i64::MAX], 1, 0, None).unwrap(),
            vec![i64::MAX]
        );
        assert_eq!(
            expand_block_ids(&[i64::MAX / 4], 4, 2, None).unwrap(),
            vec![i64::MAX - 1, i64::MAX]
        );
    }

    #[test]
    fn into_appends() {
        let mut out = vec![9];
        expand_block_ids_into(&[1], 2, 0, None, &mut out).unwrap();
        assert_eq!(out, vec![9, 2, 3]);
        let mut p = vec![1u64];
        compute_sub_block_ptrs_into(&[1], 2, 100, 50, 40, 1, None, &mut p).unwrap();
        assert_eq!(p, vec![1, 170]);
    }
}
