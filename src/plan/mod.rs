//! Transfer plans (docs/spec.md §4 "Transfer plan"): GPU/CPU load-store specs × canonical tensors → a list of
//! bounds-checked byte copies ([`CopyPlan`]).
//!
//! Memory model. Each canonical KV-cache tensor `t` exists twice:
//! - on the GPU side as `num_blocks` rows of `row_bytes` (the tensor's page), `row_stride_bytes` apart;
//!   one GPU block per row (block size factor 1);
//! - on the CPU side as a tensor `(num_cpu_blocks, page × f)` exactly like vLLM's CPU tensors: sub-block
//!   `j` of CPU block `b` is at `cpu.base_ptr + b*cpu.row_stride_bytes + j*(cpu.row_bytes/f)`.
//!
//! A group `g` of the job consumes `group_sizes[g]` GPU ids and, with `skip = block_indices[g] % f`,
//! `ceil((group_sizes[g] + skip) / f)` CPU ids (none for an empty group, as in vLLM); for each
//! [`PlanRef`] of the group it emits `group_sizes[g]` copies of `page_size_bytes` bytes, GPU block `i`
//! of the group ↔ CPU sub-block `skip + i`.
//!
//! Invariants of a [`CopyPlan`] returned by a [`CopyPlanner`]:
//! 1. every copy lies inside one row's sub-block of its source tensor and of its destination tensor,
//!    as described by the [`TensorDesc`]s the planner was built from (validated once in
//!    [`CopyPlanner::new`]: rows do not overlap, no extent overflows `u64`, every ref's bytes fit in a
//!    sub-block on both sides; and per job: every id is in range for the tensors it is used with);
//! 2. destinations do not overlap: destination sub-blocks are distinct among all groups that share a
//!    tensor, no group references a tensor twice, and GPU-side and CPU-side tensors are disjoint;
//! 3. all ids of both specs are consumed exactly and `total_bytes` equals
//!    `Σ_g group_sizes[g] × Σ_{refs of g} page_size_bytes`;
//! 4. adjacent copies are merged when both their sources and their destinations are contiguous.
//!
//! Validation is complete before the plan is filled: an error leaves nothing half-planned.
//!
//! Caps (hostile or absurd input is an error, never an allocation that aborts the process): a job
//! has at most [`MAX_BLOCK_COPIES`] per-block copies and its `total_bytes` must fit `u64`; the
//! copies are reserved fallibly. The duplicate-destination check (invariant 2) marks a bitmap of
//! the destination tensors' blocks (sub-blocks on the CPU side) when that takes at most 32 MiB
//! (2^28 blocks, more than any real KV cache), and otherwise sorts the job's own destinations, so
//! its memory follows the job, never a hostile `num_blocks`.
//!
//! Files: this one (the planner: construction, `plan`, emitting the copies), `types` (directions,
//! tensor descriptors, refs, specs, the plan), `validate` (every check a job passes before
//! anything is emitted).
#![forbid(unsafe_code)]

mod types;
mod validate;

use std::ops::Range;
use std::sync::Mutex;

use crate::error::{KvoffError, Result};
pub use types::{CopyOp, CopyPlan, Direction, GpuSpec, PlanRef, TensorDesc};
use validate::{block_index, GroupSizes};

/// Most per-block copies (`Σ_g group_sizes[g] × refs of g`) one job may have: 2^28, as many as
/// one expansion may produce ([`crate::expand::MAX_SUB_BLOCKS`]); a 512 MiB job of 4 KiB pages
/// has 2^17. More is an error, not an attempt to reserve 24 bytes per copy.
pub const MAX_BLOCK_COPIES: u64 = 1 << 28;

/// Most tensors per side a planner takes (far above any engine's KV caches: a layer's K and V,
/// split into at most 64 parts each, for hundreds of layers). The overlap checks compare every
/// pair of tensors, so the cap also bounds construction time (well under a second).
pub const MAX_TENSORS: usize = 1 << 15;

/// Largest duplicate-destination bitmap, in 64-bit words (32 MiB: 2^28 destination blocks); a
/// component of larger tensors is checked by sorting the job's destinations instead.
const MAX_BITMAP_WORDS: u64 = 1 << 22;

/// Per-group data computed once by [`CopyPlanner::new`].
#[derive(Debug, Clone)]
struct GroupInfo {
    /// Range of this group's refs in `CopyPlanner::refs`.
    refs: Range<usize>,
    /// Bytes per GPU block of the group: Σ page_size_bytes of its refs.
    bytes_per_block: u64,
    /// GPU ids must be below this (min `num_blocks` over the group's GPU tensors).
    gpu_limit: u64,
    /// CPU ids must be below this (min `num_blocks` over the group's CPU tensors).
    cpu_limit: u64,
    /// Index of the set of groups that share tensors with this one (see `CopyPlanner::components`).
    component: usize,
}

/// Builds [`CopyPlan`]s for jobs over a fixed set of tensors (one planner per KV-cache layout; it is
/// `Send + Sync` and cheap to call from many threads).
#[derive(Debug)]
pub struct CopyPlanner {
    gpu: Vec<TensorDesc>,
    cpu: Vec<TensorDesc>,
    /// Bytes of one CPU sub-block of each tensor: `cpu[t].row_bytes / f`.
    cpu_sub_bytes: Vec<u64>,
    refs: Vec<PlanRef>,
    groups: Vec<GroupInfo>,
    /// For each component (groups sharing a tensor, transitively): (max GPU blocks, max CPU blocks)
    /// over its tensors, to size the duplicate-destination bitmap.
    components: Vec<(u64, u64)>,
    block_size_factor: u64,
    /// Bitmap reused by the duplicate-destination check; all zero between calls.
    scratch: Mutex<Vec<u64>>,
    /// Distinguishes planners, so that a [`CheckedSpec`] is planned only by the planner that
    /// checked it.
    id: u64,
}

/// A job's spec that passed [`CopyPlanner::check`], owning its ids: planned later (on another
/// thread) by [`CopyPlanner::plan_checked`] without checking again. Its fields cannot change
/// after the check, which is what makes the unchecked emission sound.
#[derive(Debug)]
pub struct CheckedSpec {
    planner: u64,
    direction: Direction,
    block_ids: Vec<i64>,
    group_sizes: Option<Vec<i64>>,
    block_indices: Option<Vec<i64>>,
    cpu_block_ids: Vec<i64>,
    num_copies: usize,
}

impl CheckedSpec {
    /// The job's direction.
    #[must_use]
    pub const fn direction(&self) -> Direction {
        self.direction
    }

    fn gpu(&self) -> GpuSpec<'_> {
        GpuSpec {
            block_ids: &self.block_ids,
            group_sizes: self.group_sizes.as_deref(),
            block_indices: self.block_indices.as_deref(),
        }
    }
}

fn find(parent: &mut [usize], mut x: usize) -> usize {
    while parent[x] != x {
        parent[x] = parent[parent[x]];
        x = parent[x];
    }
    x
}

impl CopyPlanner {
    /// A planner for `gpu_tensors[t]` ↔ `cpu_tensors[t]` with KV-cache groups `group_refs[g]`
    /// (vLLM's `group_data_refs`) and CPU blocks of `block_size_factor` GPU blocks.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] when `block_size_factor` is 0; the two tensor lists differ in
    /// length; a descriptor has `row_bytes` 0, overlapping rows, a null base or an extent that
    /// overflows; a CPU tensor's `row_bytes` is not a multiple of `block_size_factor`; a ref names a
    /// missing tensor, copies 0 bytes or more than a GPU row or a CPU sub-block; a group references a
    /// tensor twice; or a GPU-side tensor overlaps a CPU-side tensor.
    #[allow(clippy::needless_pass_by_value)] // owned API: callers hand their descriptors over
    pub fn new(
        gpu_tensors: Vec<TensorDesc>,
        cpu_tensors: Vec<TensorDesc>,
        group_refs: Vec<Vec<PlanRef>>,
        block_size_factor: u64,
    ) -> Result<Self> {
        if block_size_factor == 0 {
            return Err(KvoffError::arg("block_size_factor must be >= 1, got 0"));
        }
        if gpu_tensors.len().max(cpu_tensors.len()) > MAX_TENSORS {
            return Err(KvoffError::arg(format!(
                "{} tensors: at most {MAX_TENSORS} per side",
                gpu_tensors.len().max(cpu_tensors.len())
            )));
        }
        if gpu_tensors.len() != cpu_tensors.len() {
            return Err(KvoffError::arg(format!(
                "{} GPU tensors but {} CPU tensors: there must be one CPU tensor per GPU tensor",
                gpu_tensors.len(),
                cpu_tensors.len()
            )));
        }
        let n = gpu_tensors.len();
        let mut gpu_ranges = Vec::with_capacity(n);
        let mut cpu_ranges = Vec::with_capacity(n);
        let mut cpu_sub_bytes = Vec::with_capacity(n);
        for t in 0..n {
            gpu_ranges.push(gpu_tensors[t].check("GPU", t)?);
            cpu_ranges.push(cpu_tensors[t].check("CPU", t)?);
            let row = cpu_tensors[t].row_bytes;
            if row % block_size_factor != 0 {
                return Err(KvoffError::arg(format!(
                    "CPU tensor {t}: row_bytes ({row}) is not a multiple of block_size_factor \
                     ({block_size_factor}); CPU tensors must be (num_cpu_blocks, page x factor)"
                )));
            }
            cpu_sub_bytes.push(row / block_size_factor);
        }
        for (t, g) in gpu_ranges.iter().enumerate() {
            for (u, c) in cpu_ranges.iter().enumerate() {
                if g.start < c.end && c.start < g.end {
                    return Err(KvoffError::arg(format!(
                        "GPU tensor {t} ({:#x}..{:#x}) overlaps CPU tensor {u} ({:#x}..{:#x})",
                        g.start, g.end, c.start, c.end
                    )));
                }
            }
        }

        // Union-find over groups: groups that share a tensor can collide on destinations.
        let num_groups = group_refs.len();
        let mut parent: Vec<usize> = (0..num_groups).collect();
        let mut owner: Vec<Option<usize>> = vec![None; n];
        let mut refs = Vec::new();
        let mut groups = Vec::with_capacity(num_groups);
        for (g, group) in group_refs.iter().enumerate() {
            let start = refs.len();
            let mut bytes_per_block: u64 = 0;
            let mut gpu_limit = u64::MAX;
            let mut cpu_limit = u64::MAX;
            for (k, r) in group.iter().enumerate() {
                let t = r.tensor_idx;
                if t >= n {
                    return Err(KvoffError::arg(format!(
                        "group {g} ref {k}: tensor_idx {t} out of range (there are {n} tensors)"
                    )));
                }
                if group[..k].iter().any(|o| o.tensor_idx == t) {
                    return Err(KvoffError::arg(format!(
                        "group {g} references tensor {t} twice"
                    )));
                }
                let p = r.page_size_bytes;
                if p == 0 || p > gpu_tensors[t].row_bytes || p > cpu_sub_bytes[t] {
                    return Err(KvoffError::arg(format!(
                        "group {g} ref {k}: page_size_bytes {p} must be in 1..={} (GPU row of \
                         tensor {t}: {} bytes, CPU sub-block: {} bytes)",
                        gpu_tensors[t].row_bytes.min(cpu_sub_bytes[t]),
                        gpu_tensors[t].row_bytes,
                        cpu_sub_bytes[t]
                    )));
                }
                bytes_per_block = bytes_per_block
                    .checked_add(p)
                    .ok_or_else(|| KvoffError::arg("bytes per block overflow u64"))?;
                gpu_limit = gpu_limit.min(gpu_tensors[t].num_blocks);
                cpu_limit = cpu_limit.min(cpu_tensors[t].num_blocks);
                match owner[t] {
                    None => owner[t] = Some(g),
                    Some(o) => {
                        let (a, b) = (find(&mut parent, o), find(&mut parent, g));
                        parent[a] = b;
                    }
                }
                refs.push(*r);
            }
            groups.push(GroupInfo {
                refs: start..refs.len(),
                bytes_per_block,
                gpu_limit,
                cpu_limit,
                component: 0,
            });
        }
        // Number the components and record their bitmap sizes.
        let mut comp_of_root: Vec<Option<usize>> = vec![None; num_groups];
        let mut components: Vec<(u64, u64)> = Vec::new();
        for g in 0..num_groups {
            let root = find(&mut parent, g);
            let c = *comp_of_root[root].get_or_insert_with(|| {
                components.push((0, 0));
                components.len() - 1
            });
            groups[g].component = c;
            for r in &refs[groups[g].refs.clone()] {
                let t = r.tensor_idx;
                let cpu_units = cpu_tensors[t]
                    .num_blocks
                    .checked_mul(block_size_factor)
                    .ok_or_else(|| KvoffError::arg("CPU sub-block count overflows u64"))?;
                components[c].0 = components[c].0.max(gpu_tensors[t].num_blocks);
                components[c].1 = components[c].1.max(cpu_units);
            }
        }
        Ok(Self {
            gpu: gpu_tensors,
            cpu: cpu_tensors,
            cpu_sub_bytes,
            refs,
            groups,
            components,
            block_size_factor,
            scratch: Mutex::new(Vec::new()),
            id: {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            },
        })
    }

    /// Number of KV-cache groups.
    #[must_use]
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// CPU block size factor.
    #[must_use]
    pub const fn block_size_factor(&self) -> u64 {
        self.block_size_factor
    }

    /// The GPU-side tensors.
    #[must_use]
    pub fn gpu_tensors(&self) -> &[TensorDesc] {
        &self.gpu
    }

    /// The CPU-side tensors.
    #[must_use]
    pub fn cpu_tensors(&self) -> &[TensorDesc] {
        &self.cpu
    }

    /// Plans one job: GPU spec `gpu` ↔ CPU block ids `cpu_block_ids`, in `direction`.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] when the spec does not match the groups (lengths, negative
    /// sizes or indices, `Σ group_sizes ≠ len(block_ids)`), an id is negative or out of range for a
    /// tensor of its group, the CPU ids are not consumed exactly, two copies would write the same
    /// destination, the job has more than [`MAX_BLOCK_COPIES`] per-block copies or more than
    /// `u64::MAX` bytes, or the plan's memory cannot be allocated.
    pub fn plan(
        &self,
        direction: Direction,
        gpu: &GpuSpec<'_>,
        cpu_block_ids: &[i64],
    ) -> Result<CopyPlan> {
        let mut out = CopyPlan::new(direction);
        self.plan_into(direction, gpu, cpu_block_ids, &mut out)?;
        Ok(out)
    }

    /// Checks one job's spec as [`CopyPlanner::plan`] does (the same errors, except allocation)
    /// without building its copies: O(blocks), for the caller's thread, while
    /// [`CopyPlanner::plan_checked`] emits the copies elsewhere.
    ///
    /// # Errors
    /// As [`CopyPlanner::plan`].
    pub fn check(
        &self,
        direction: Direction,
        block_ids: Vec<i64>,
        group_sizes: Option<Vec<i64>>,
        block_indices: Option<Vec<i64>>,
        cpu_block_ids: Vec<i64>,
    ) -> Result<CheckedSpec> {
        let mut spec = CheckedSpec {
            planner: self.id,
            direction,
            block_ids,
            group_sizes,
            block_indices,
            cpu_block_ids,
            num_copies: 0,
        };
        let gpu = spec.gpu();
        let n = self.validate(&gpu, &spec.cpu_block_ids)?;
        self.check_distinct_destinations(direction, &gpu, &spec.cpu_block_ids)?;
        spec.num_copies = n;
        Ok(spec)
    }

    /// Plans a spec this planner checked ([`CopyPlanner::check`]).
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] when another planner checked `spec`, or the plan's memory
    /// cannot be allocated.
    pub fn plan_checked(&self, spec: &CheckedSpec) -> Result<CopyPlan> {
        if spec.planner != self.id {
            return Err(KvoffError::arg("the spec was checked by another planner"));
        }
        let mut out = CopyPlan::new(spec.direction);
        out.copies.try_reserve(spec.num_copies).map_err(|_| {
            KvoffError::arg(format!(
                "cannot allocate a plan of {} copies ({} bytes)",
                spec.num_copies,
                spec.num_copies
                    .saturating_mul(std::mem::size_of::<CopyOp>())
            ))
        })?;
        self.emit(spec.direction, &spec.gpu(), &spec.cpu_block_ids, &mut out);
        Ok(out)
    }

    /// As [`CopyPlanner::plan`], reusing `out`'s allocation. On error `out` is left empty.
    ///
    /// # Errors
    /// As [`CopyPlanner::plan`].
    pub fn plan_into(
        &self,
        direction: Direction,
        gpu: &GpuSpec<'_>,
        cpu_block_ids: &[i64],
        out: &mut CopyPlan,
    ) -> Result<()> {
        out.reset(direction);
        let num_copies = self.validate(gpu, cpu_block_ids)?;
        self.check_distinct_destinations(direction, gpu, cpu_block_ids)?;
        out.copies.try_reserve(num_copies).map_err(|_| {
            KvoffError::arg(format!(
                "cannot allocate a plan of {num_copies} copies ({} bytes)",
                num_copies.saturating_mul(std::mem::size_of::<CopyOp>())
            ))
        })?;
        self.emit(direction, gpu, cpu_block_ids, out);
        Ok(())
    }

    /// `(gpu offset, cpu offset, size, skip)` of each group; assumes `validate` passed.
    fn group_spans<'s>(
        &'s self,
        gpu: &'s GpuSpec<'_>,
        sizes: &'s GroupSizes<'_>,
    ) -> impl Iterator<Item = (usize, usize, usize, u64)> + 's {
        let f = self.block_size_factor;
        let (mut goff, mut coff) = (0usize, 0usize);
        (0..self.groups.len()).map(move |g| {
            let size = sizes.get(g).unwrap_or(0);
            let skip = block_index(gpu, g).unwrap_or(0) % f;
            let span = (goff, coff, size, skip);
            goff += size;
            if size > 0 {
                coff += crate::usize_from((size as u64 + skip).div_ceil(f));
            }
            span
        })
    }

    /// Fills `out` (already validated; see the module invariants for why nothing overflows).
    fn emit(&self, direction: Direction, gpu: &GpuSpec<'_>, cpu_ids: &[i64], out: &mut CopyPlan) {
        let Ok(sizes) = self.group_sizes(gpu) else {
            return;
        };
        let f = self.block_size_factor;
        let to_cpu = direction == Direction::GpuToCpu;
        for (g, (goff, coff, size, skip)) in self.group_spans(gpu, &sizes).enumerate() {
            if size == 0 {
                continue;
            }
            let info = &self.groups[g];
            let gids = &gpu.block_ids[goff..goff + size];
            let cids = &cpu_ids[coff..];
            let refs = &self.refs[info.refs.clone()];
            // CPU-block-major: for each CPU block, every ref's sub-blocks in row order. With
            // kvoff's block-major host rows this makes each CPU block one host-contiguous run,
            // which the CUDA engine's staged method moves with one large DMA.
            let (mut pos, mut ci, mut j0) = (0usize, 0usize, skip);
            while pos < size {
                let n = usize::try_from(f - j0)
                    .unwrap_or(usize::MAX)
                    .min(size - pos);
                let c = cids[ci].unsigned_abs();
                for r in refs {
                    let t = r.tensor_idx;
                    let (gd, cd, csub) = (&self.gpu[t], &self.cpu[t], self.cpu_sub_bytes[t]);
                    let p = r.page_size_bytes;
                    let crow = cd.base_ptr + c * cd.row_stride_bytes;
                    for (k, &gid) in gids[pos..pos + n].iter().enumerate() {
                        let gptr = gd.base_ptr + gid.unsigned_abs() * gd.row_stride_bytes;
                        let cptr = crow + (j0 + k as u64) * csub;
                        if to_cpu {
                            out.push_merged(gptr, cptr, p);
                        } else {
                            out.push_merged(cptr, gptr, p);
                        }
                    }
                }
                pos += n;
                ci += 1;
                j0 = 0;
            }
            out.total_bytes += size as u64 * info.bytes_per_block;
            out.num_block_copies += (size * info.refs.len()) as u64;
        }
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;

    const PAGE: u64 = 64;

    fn planner(f: u64, groups: Vec<Vec<PlanRef>>, ntensors: usize) -> CopyPlanner {
        let gpu = (0..ntensors)
            .map(|t| TensorDesc::contiguous(0x1000_0000 + t as u64 * 0x10_0000, 100, PAGE))
            .collect();
        let cpu = (0..ntensors)
            .map(|t| TensorDesc::contiguous(0x9000_0000 + t as u64 * 0x10_0000, 10, PAGE * f))
            .collect();
        CopyPlanner::new(gpu, cpu, groups, f).unwrap()
    }

    /// Copies come out CPU-block-major: with block-major host rows (all tensors' sub-blocks of a
    /// CPU block side by side) every CPU block is one host-contiguous run.
    #[test]
    fn emission_is_cpu_block_major() {
        let f = 2;
        let row = 2 * PAGE * f; // two tensors per row, block-major
        let gpu = (0..2)
            .map(|t| TensorDesc::contiguous(0x1000_0000 + t * 0x10_0000, 100, PAGE))
            .collect();
        let cpu = (0..2)
            .map(|t| TensorDesc::new(0x9000_0000 + t * PAGE * f, 10, row, PAGE * f))
            .collect();
        let refs = vec![vec![PlanRef::new(0, PAGE), PlanRef::new(1, PAGE)]];
        let p = CopyPlanner::new(gpu, cpu, refs, f).unwrap();
        let plan = p
            .plan(Direction::GpuToCpu, &GpuSpec::new(&[7, 3, 50, 20]), &[4, 1])
            .unwrap();
        let dsts: Vec<u64> = plan.copies().iter().map(|c| c.dst_ptr).collect();
        let base = 0x9000_0000u64;
        assert_eq!(
            dsts,
            vec![
                base + 4 * row,
                base + 4 * row + PAGE,
                base + 4 * row + 2 * PAGE,
                base + 4 * row + 3 * PAGE,
                base + row,
                base + row + PAGE,
                base + row + 2 * PAGE,
                base + row + 3 * PAGE,
            ]
        );
    }

    #[test]
    fn single_group_store_merges_contiguous() {
        let p = planner(4, vec![vec![PlanRef::new(0, PAGE)]], 1);
        let plan = p
            .plan(
                Direction::GpuToCpu,
                &GpuSpec::new(&[4, 5, 6, 7, 9]),
                &[2, 3],
            )
            .unwrap();
        assert_eq!(plan.total_bytes(), 5 * PAGE);
        assert_eq!(plan.num_block_copies(), 5);
        assert_eq!(
            plan.copies(),
            &[
                CopyOp {
                    src_ptr: 0x1000_0000 + 4 * PAGE,
                    dst_ptr: 0x9000_0000 + 2 * 4 * PAGE,
                    bytes: 4 * PAGE
                },
                CopyOp {
                    src_ptr: 0x1000_0000 + 9 * PAGE,
                    dst_ptr: 0x9000_0000 + 3 * 4 * PAGE,
                    bytes: PAGE
                },
            ]
        );
    }

    #[test]
    fn skip_from_block_index() {
        let p = planner(4, vec![vec![PlanRef::new(0, PAGE)]], 1);
        let gpu = GpuSpec::with_groups(&[10, 20, 30], &[3], Some(&[6]));
        // skip = 6 % 4 = 2: CPU sub-blocks 2,3 of block 1 and 0 of block 5.
        let plan = p.plan(Direction::CpuToGpu, &gpu, &[1, 5]).unwrap();
        let cpu = |b: u64, j: u64| 0x9000_0000 + b * 4 * PAGE + j * PAGE;
        let g = |b: u64| 0x1000_0000 + b * PAGE;
        assert_eq!(
            plan.copies(),
            &[
                CopyOp {
                    src_ptr: cpu(1, 2),
                    dst_ptr: g(10),
                    bytes: PAGE
                },
                CopyOp {
                    src_ptr: cpu(1, 3),
                    dst_ptr: g(20),
                    bytes: PAGE
                },
                CopyOp {
                    src_ptr: cpu(5, 0),
                    dst_ptr: g(30),
                    bytes: PAGE
                },
            ]
        );
    }

    #[test]
    fn empty_group_consumes_nothing() {
        let p = planner(
            2,
            vec![vec![PlanRef::new(0, PAGE)], vec![PlanRef::new(1, PAGE)]],
            2,
        );
        let gpu = GpuSpec::with_groups(&[3], &[0, 1], Some(&[5, 1]));
        let plan = p.plan(Direction::GpuToCpu, &gpu, &[7]).unwrap();
        assert_eq!(plan.len(), 1);
        assert_eq!(plan.copies()[0].dst_ptr, 0x9010_0000 + 7 * 2 * PAGE + PAGE);
    }

    /// Regressions found by `tests/fuzz_plan.rs`.
    #[test]
    fn ids_of_a_group_without_refs_are_still_checked() {
        let p = planner(2, vec![vec![PlanRef::new(0, PAGE)], vec![]], 1);
        // Group 1 has no tensor to bound its ids, but a negative id is still an error.
        let gpu = GpuSpec::with_groups(&[3, -5], &[1, 1], None);
        let e = p.plan(Direction::GpuToCpu, &gpu, &[1, 0]).unwrap_err();
        assert!(e.to_string().contains("-5"), "{e}");
        let e = p
            .plan(
                Direction::GpuToCpu,
                &GpuSpec::with_groups(&[3, 1], &[1, 1], None),
                &[1, -1],
            )
            .unwrap_err();
        assert!(e.to_string().contains(">= 0"), "{e}");
        p.plan(
            Direction::GpuToCpu,
            &GpuSpec::with_groups(&[3, i64::MAX], &[1, 1], None),
            &[1, i64::MAX],
        )
        .unwrap();
    }

    #[test]
    fn next_groups_cpu_ids_are_not_used_by_the_duplicate_check() {
        // Group 0 fills its CPU block exactly (skip 1 + 2 blocks = f); group 1 (no refs) may use
        // any id. Computing the row of the CPU id after group 0's last block (group 1's
        // i64::MAX, times f) overflowed.
        let p = planner(3, vec![vec![PlanRef::new(0, PAGE)], vec![]], 1);
        let gpu = GpuSpec::with_groups(&[3, 4, 5], &[2, 1], Some(&[1, 0]));
        let plan = p.plan(Direction::GpuToCpu, &gpu, &[2, i64::MAX]).unwrap();
        assert_eq!(plan.total_bytes(), 2 * PAGE);
    }

    #[test]
    fn duplicate_destinations_rejected_and_bitmap_cleared() {
        let p = planner(1, vec![vec![PlanRef::new(0, PAGE)]], 1);
        let e = p.plan(Direction::CpuToGpu, &GpuSpec::new(&[1, 1]), &[2, 3]);
        assert!(matches!(e, Err(KvoffError::InvalidArgument(_))), "{e:?}");
        // Source duplicates are fine.
        p.plan(Direction::GpuToCpu, &GpuSpec::new(&[1, 1]), &[2, 3])
            .unwrap();
        let e = p.plan(Direction::GpuToCpu, &GpuSpec::new(&[1, 2]), &[3, 3]);
        assert!(e.is_err());
        // After errors, the scratch bitmap is clean: a valid plan still passes.
        p.plan(Direction::CpuToGpu, &GpuSpec::new(&[1, 2]), &[3, 3])
            .unwrap();
        p.plan(Direction::GpuToCpu, &GpuSpec::new(&[1, 2]), &[2, 3])
            .unwrap();
        assert!(p.scratch.lock().unwrap().iter().all(|&w| w == 0));
    }

    /// `check` then `plan_checked` gives `plan`'s copies, and `check` refuses what `plan`
    /// refuses, with the same message; a spec is planned only by the planner that checked it.
    #[test]
    fn checked_specs_plan_as_plan_does() {
        let f = 2;
        let p = planner(
            f,
            vec![
                vec![PlanRef::new(0, PAGE), PlanRef::new(1, PAGE)],
                vec![PlanRef::new(2, PAGE / 2)],
            ],
            3,
        );
        type Case = (
            Direction,
            Vec<i64>,
            Option<Vec<i64>>,
            Option<Vec<i64>>,
            Vec<i64>,
        );
        let cases: Vec<Case> = vec![
            (
                Direction::GpuToCpu,
                vec![1, 2, 3, 4, 5],
                Some(vec![3, 2]),
                Some(vec![1, 0]),
                vec![0, 1, 2],
            ),
            (
                Direction::CpuToGpu,
                vec![7, 8, 9],
                Some(vec![2, 1]),
                None,
                vec![4, 5],
            ),
            (
                Direction::CpuToGpu,
                vec![1, 1],
                Some(vec![2, 0]),
                None,
                vec![2],
            ), // duplicate dst
            (
                Direction::GpuToCpu,
                vec![1, 2],
                Some(vec![2, 0]),
                None,
                vec![99],
            ), // id too large
            (
                Direction::GpuToCpu,
                vec![1, 2],
                Some(vec![2, 0]),
                None,
                vec![1, 2],
            ), // ids left over
            (
                Direction::GpuToCpu,
                vec![1, -2],
                Some(vec![2, 0]),
                None,
                vec![1],
            ), // negative id
        ];
        let mut planned = 0;
        for (d, g, sizes, idx, c) in cases {
            let spec = GpuSpec {
                block_ids: &g,
                group_sizes: sizes.as_deref(),
                block_indices: idx.as_deref(),
            };
            let want = p.plan(d, &spec, &c);
            let got = p
                .check(d, g.clone(), sizes.clone(), idx.clone(), c.clone())
                .and_then(|s| p.plan_checked(&s));
            match (want, got) {
                (Ok(w), Ok(g)) => {
                    assert_eq!(w.copies(), g.copies());
                    assert_eq!(w.total_bytes(), g.total_bytes());
                    assert_eq!(w.direction(), g.direction());
                    planned += 1;
                }
                (Err(w), Err(g)) => assert_eq!(w.to_string(), g.to_string()),
                (w, g) => panic!("plan {w:?} but check + plan_checked {g:?}"),
            }
        }
        assert_eq!(planned, 2, "the first two cases are valid");
        let other = planner(f, vec![vec![PlanRef::new(0, PAGE)], vec![]], 3);
        let s = p
            .check(
                Direction::GpuToCpu,
                vec![1],
                Some(vec![1, 0]),
                None,
                vec![0],
            )
            .unwrap();
        assert!(other.plan_checked(&s).is_err());
    }
}
