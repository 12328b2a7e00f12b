//! The checks of a job before anything is emitted (module invariants 1–3 of [`super`]): group
//! sizes, ids in range for their tensors, ids consumed exactly, and distinct destinations (a
//! bitmap of destination units, or sorting the job's own destinations when the bitmap would be
//! large).
#![forbid(unsafe_code)]

use std::sync::PoisonError;

use super::{CopyPlanner, Direction, GpuSpec, MAX_BITMAP_WORDS, MAX_BLOCK_COPIES};
use crate::error::{KvoffError, Result};

impl CopyPlanner {
    pub(super) fn group_sizes<'s>(&self, gpu: &GpuSpec<'s>) -> Result<GroupSizes<'s>> {
        let ng = self.groups.len();
        let sizes = match gpu.group_sizes {
            Some(s) => {
                if s.len() != ng {
                    return Err(KvoffError::arg(format!(
                        "group_sizes has {} entries but there are {ng} KV-cache groups",
                        s.len()
                    )));
                }
                GroupSizes::Given(s)
            }
            None if ng == 1 => GroupSizes::All(gpu.block_ids.len()),
            None => {
                return Err(KvoffError::arg(format!(
                    "group_sizes is required: there are {ng} KV-cache groups"
                )))
            }
        };
        if let Some(bi) = gpu.block_indices {
            if bi.len() != ng {
                return Err(KvoffError::arg(format!(
                    "block_indices has {} entries but there are {ng} KV-cache groups",
                    bi.len()
                )));
            }
        }
        Ok(sizes)
    }

    /// Validates the whole job and returns the number of per-block copies (at most
    /// [`MAX_BLOCK_COPIES`]; the job's total bytes fit `u64`).
    pub(super) fn validate(&self, gpu: &GpuSpec<'_>, cpu_ids: &[i64]) -> Result<usize> {
        let sizes = self.group_sizes(gpu)?;
        let f = self.block_size_factor;
        let gpu_ids = gpu.block_ids;
        let (mut goff, mut coff) = (0usize, 0usize);
        let mut num_copies: usize = 0;
        let mut total_bytes: u64 = 0;
        for (g, info) in self.groups.iter().enumerate() {
            let size = sizes.get(g)?;
            let skip = block_index(gpu, g)? % f;
            let gend = goff
                .checked_add(size)
                .filter(|&e| e <= gpu_ids.len())
                .ok_or_else(|| {
                    KvoffError::arg(format!(
                        "group_sizes sum to more than the {} GPU block ids (at group {g})",
                        gpu_ids.len()
                    ))
                })?;
            let ccount = if size == 0 {
                0
            } else {
                // size + skip ≤ usize::MAX/2 + u64 small: use u64/u128-free checked math.
                let subs = (size as u64).checked_add(skip).ok_or_else(|| {
                    KvoffError::arg(format!("group {g}: sub-block count overflows"))
                })?;
                usize::try_from(subs.div_ceil(f))
                    .map_err(|_| KvoffError::arg(format!("group {g}: CPU block count overflows")))?
            };
            let cend = coff
                .checked_add(ccount)
                .filter(|&e| e <= cpu_ids.len())
                .ok_or_else(|| {
                    KvoffError::arg(format!(
                        "not enough CPU block ids: group {g} needs {ccount} (group_size {size}, \
                         block_index % factor = {skip}, factor {f}) starting at CPU id #{coff}, \
                         but only {} were given",
                        cpu_ids.len()
                    ))
                })?;
            check_ids(&gpu_ids[goff..gend], info.gpu_limit, "GPU", g, goff)?;
            check_ids(&cpu_ids[coff..cend], info.cpu_limit, "CPU", g, coff)?;
            num_copies = num_copies
                .checked_add(size.saturating_mul(info.refs.len()))
                .filter(|&n| n as u64 <= MAX_BLOCK_COPIES)
                .ok_or_else(|| {
                    KvoffError::arg(format!(
                        "this job has more than {MAX_BLOCK_COPIES} per-block copies (at group \
                         {g}: {size} blocks x {} refs); a job that large cannot be right, split it",
                        info.refs.len()
                    ))
                })?;
            // Several refs to tensors that share memory can add up past u64 (emit relies on it).
            total_bytes = (size as u64)
                .checked_mul(info.bytes_per_block)
                .and_then(|b| b.checked_add(total_bytes))
                .ok_or_else(|| {
                    KvoffError::arg(format!(
                        "the job's total bytes overflow u64 (at group {g}: {size} blocks x {} \
                         bytes per block)",
                        info.bytes_per_block
                    ))
                })?;
            goff = gend;
            coff = cend;
        }
        if goff != gpu_ids.len() {
            return Err(KvoffError::arg(format!(
                "group_sizes sum to {goff} but {} GPU block ids were given",
                gpu_ids.len()
            )));
        }
        if coff != cpu_ids.len() {
            return Err(KvoffError::arg(format!(
                "the groups consume {coff} CPU block ids but {} were given",
                cpu_ids.len()
            )));
        }
        Ok(num_copies)
    }

    /// Invariant 2: destination units (GPU blocks, or CPU sub-blocks) are distinct within each
    /// component of groups sharing tensors. Assumes `validate` passed (ids in range).
    pub(super) fn check_distinct_destinations(
        &self,
        direction: Direction,
        gpu: &GpuSpec<'_>,
        cpu_ids: &[i64],
    ) -> Result<()> {
        // Only groups that actually copy something matter.
        let sizes = self.group_sizes(gpu)?;
        let f = self.block_size_factor;
        let mut bitmap = self.scratch.lock().unwrap_or_else(PoisonError::into_inner);
        for (c, &(gpu_units, cpu_units)) in self.components.iter().enumerate() {
            let units = match direction {
                Direction::CpuToGpu => gpu_units,
                Direction::GpuToCpu => cpu_units,
            };
            if units.div_ceil(64) > MAX_BITMAP_WORDS {
                self.check_component_sorted(direction, gpu, &sizes, cpu_ids, c)?;
                continue;
            }
            let words = crate::usize_from(units.div_ceil(64));
            if bitmap.len() < words {
                bitmap.resize(words, 0);
            }
            let bits: &mut [u64] = &mut bitmap[..words];
            let in_component = |(g, span): (usize, (usize, usize, usize, u64))| {
                let info = &self.groups[g];
                // A group without refs writes nothing.
                (info.component == c && span.2 > 0 && !info.refs.is_empty()).then_some((g, span))
            };
            // Mark until the first duplicate.
            let mut dup = None;
            let mut marked: usize = 0;
            for (g, (goff, coff, size, skip)) in self
                .group_spans(gpu, &sizes)
                .enumerate()
                .filter_map(in_component)
            {
                let gids = &gpu.block_ids[goff..goff + size];
                let found =
                    for_each_dest_unit(direction, gids, &cpu_ids[coff..], skip, f, |i, u| {
                        let (w, bit) = ((u / 64) as usize, 1u64 << (u % 64));
                        if bits[w] & bit != 0 {
                            return Some(i);
                        }
                        bits[w] |= bit;
                        None
                    });
                marked += size;
                if let Some(i) = found {
                    let u = dest_unit(direction, gids, &cpu_ids[coff..], skip, f, i);
                    dup = Some((g, u, gids[i]));
                    break;
                }
            }
            // Clear: the bitmap was all zero before this component, so either zero the words in
            // use (when that is cheaper) or clear every unit of the component (clearing an
            // unmarked bit is harmless).
            if words <= marked.saturating_mul(4) {
                bits.fill(0);
            } else {
                for (_, (goff, coff, size, skip)) in self
                    .group_spans(gpu, &sizes)
                    .enumerate()
                    .filter_map(in_component)
                {
                    let gids = &gpu.block_ids[goff..goff + size];
                    for_each_dest_unit(direction, gids, &cpu_ids[coff..], skip, f, |_, u| {
                        bits[(u / 64) as usize] &= !(1u64 << (u % 64));
                        None::<()>
                    });
                }
            }
            if let Some((g, u, gid)) = dup {
                return Err(duplicate_destination(direction, f, g, u, gid));
            }
        }
        Ok(())
    }

    /// Invariant 2 for component `c` without a bitmap (its tensors are too large for one):
    /// sorts the destination units of the job's groups in the component, so memory follows the
    /// job (24 bytes per destination block), not the tensors.
    pub(super) fn check_component_sorted(
        &self,
        direction: Direction,
        gpu: &GpuSpec<'_>,
        sizes: &GroupSizes<'_>,
        cpu_ids: &[i64],
        c: usize,
    ) -> Result<()> {
        let f = self.block_size_factor;
        let spans = || {
            self.group_spans(gpu, sizes)
                .enumerate()
                .filter(|&(g, (_, _, size, _))| {
                    let info = &self.groups[g];
                    info.component == c && size > 0 && !info.refs.is_empty()
                })
        };
        let n: usize = spans().map(|(_, (_, _, size, _))| size).sum();
        // (destination unit, group, index into the GPU ids)
        let mut units: Vec<(u64, usize, usize)> = Vec::new();
        units.try_reserve_exact(n).map_err(|_| {
            KvoffError::arg(format!(
                "cannot allocate the duplicate-destination check of {n} blocks"
            ))
        })?;
        for (g, (goff, coff, size, skip)) in spans() {
            let gids = &gpu.block_ids[goff..goff + size];
            for_each_dest_unit(direction, gids, &cpu_ids[coff..], skip, f, |i, u| {
                units.push((u, g, goff + i));
                None::<()>
            });
        }
        units.sort_unstable();
        match units.windows(2).find(|w| w[0].0 == w[1].0) {
            Some(w) => {
                let (u, g, k) = w[1];
                Err(duplicate_destination(direction, f, g, u, gpu.block_ids[k]))
            }
            None => Ok(()),
        }
    }
}

/// The error for two copies writing destination unit `u` (see [`for_each_dest_unit`]); `g` and
/// `gid` name the second writer's group and GPU block id.
pub(super) fn duplicate_destination(
    direction: Direction,
    f: u64,
    g: usize,
    u: u64,
    gid: i64,
) -> KvoffError {
    let what = match direction {
        Direction::CpuToGpu => format!("GPU block {u}"),
        Direction::GpuToCpu => format!("CPU block {} sub-block {}", u / f, u % f),
    };
    KvoffError::arg(format!(
        "two copies write the same destination, {what} (group {g}, GPU block id {gid}): \
         destination blocks must be distinct"
    ))
}

/// Calls `visit(i, unit)` for the destination unit of each block `i` of a group (the GPU block id,
/// or the CPU sub-block index `cpu_id * f + j`) until `visit` returns `Some`. `cpu_ids` starts at
/// the group's first CPU id; ids were validated. No divisions in the loop.
#[inline]
pub(super) fn for_each_dest_unit<T>(
    direction: Direction,
    gids: &[i64],
    cpu_ids: &[i64],
    skip: u64,
    f: u64,
    mut visit: impl FnMut(usize, u64) -> Option<T>,
) -> Option<T> {
    match direction {
        Direction::CpuToGpu => {
            for (i, &g) in gids.iter().enumerate() {
                if let Some(t) = visit(i, g.unsigned_abs()) {
                    return Some(t);
                }
            }
        }
        Direction::GpuToCpu => {
            // The row of a CPU id is computed only when a block of the group lands in it:
            // `cpu_ids` runs on into the next group's ids, which were checked against that
            // group's tensors, so `id * f` may overflow for them.
            let (mut ci, mut j, mut row) = (0usize, skip, 0u64);
            for i in 0..gids.len() {
                if i == 0 || j == f {
                    if i > 0 {
                        j = 0;
                        ci += 1;
                    }
                    row = cpu_ids.get(ci).map_or(0, |c| c.unsigned_abs() * f);
                }
                if let Some(t) = visit(i, row + j) {
                    return Some(t);
                }
                j += 1;
            }
        }
    }
    None
}

/// The destination unit of block `i` of a group (see [`for_each_dest_unit`]).
pub(super) fn dest_unit(
    direction: Direction,
    gids: &[i64],
    cpu_ids: &[i64],
    skip: u64,
    f: u64,
    i: usize,
) -> u64 {
    match direction {
        Direction::CpuToGpu => gids[i].unsigned_abs(),
        Direction::GpuToCpu => {
            let s = skip + i as u64;
            cpu_ids[crate::usize_from(s / f)].unsigned_abs() * f + s % f
        }
    }
}

pub(super) enum GroupSizes<'a> {
    All(usize),
    Given(&'a [i64]),
}

impl GroupSizes<'_> {
    pub(super) fn get(&self, g: usize) -> Result<usize> {
        match self {
            Self::All(n) => Ok(*n),
            Self::Given(s) => {
                let v = s[g];
                usize::try_from(v)
                    .map_err(|_| KvoffError::arg(format!("group_sizes[{g}] = {v} must be >= 0")))
            }
        }
    }
}

pub(super) fn block_index(gpu: &GpuSpec<'_>, g: usize) -> Result<u64> {
    match gpu.block_indices {
        None => Ok(0),
        Some(bi) => {
            let v = bi[g];
            u64::try_from(v)
                .map_err(|_| KvoffError::arg(format!("block_indices[{g}] = {v} must be >= 0")))
        }
    }
}

pub(super) fn check_ids(
    ids: &[i64],
    limit: u64,
    side: &str,
    g: usize,
    offset: usize,
) -> Result<()> {
    // Fast path: one branch-free (vectorizable) pass; negative ids become ≥ 2^63 as u64, so a
    // limit of at most 2^63 rejects them too (a group without refs has no tensor to bound its
    // ids, `limit` = u64::MAX: its ids must still be ≥ 0).
    let limit = limit.min(1 << 63);
    #[allow(clippy::cast_sign_loss, clippy::needless_bitwise_bool)] // on purpose: see above
    let any_bad = ids.iter().fold(false, |bad, &b| bad | (b as u64 >= limit));
    if !any_bad {
        return Ok(());
    }
    for (i, &b) in ids.iter().enumerate() {
        let what = format!(
            "{side} block id {b} (#{} of the {side} ids, group {g})",
            offset + i
        );
        if b < 0 {
            return Err(KvoffError::arg(format!(
                "{what} is out of range: block ids must be >= 0"
            )));
        }
        if b.unsigned_abs() >= limit {
            return Err(KvoffError::arg(format!(
                "{what} is out of range: the group's {side} tensors have {limit} blocks"
            )));
        }
    }
    Ok(())
}
