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
#![forbid(unsafe_code)]

use std::ops::Range;
use std::sync::{Mutex, PoisonError};

use crate::error::{KvoffError, Result};

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

/// Direction of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Store: GPU-side tensors → CPU-side tensors.
    GpuToCpu,
    /// Load: CPU-side tensors → GPU-side tensors.
    CpuToGpu,
}

impl Direction {
    /// vLLM's `transfer_type` tuple: `("GPU", "CPU")` or `("CPU", "GPU")`.
    #[must_use]
    pub const fn transfer_type(self) -> (&'static str, &'static str) {
        match self {
            Self::GpuToCpu => ("GPU", "CPU"),
            Self::CpuToGpu => ("CPU", "GPU"),
        }
    }

    /// Metrics label: `"GPU_to_CPU"` or `"CPU_to_GPU"`.
    #[must_use]
    pub const fn label(self) -> &'static str {
        match self {
            Self::GpuToCpu => "GPU_to_CPU",
            Self::CpuToGpu => "CPU_to_GPU",
        }
    }
}

/// The memory of one canonical tensor on one side: `num_blocks` rows of `row_bytes`, the first at
/// `base_ptr`, consecutive rows `row_stride_bytes` apart (`≥ row_bytes`; larger for strided views
/// and padded region rows).
///
/// From a torch tensor `x` of shape `(num_blocks, …)`: `base_ptr = x.data_ptr()`,
/// `num_blocks = x.shape[0]`, `row_stride_bytes = x.stride(0) * x.element_size()`,
/// `row_bytes` = the page size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorDesc {
    /// Address of row 0.
    pub base_ptr: u64,
    /// Number of rows (blocks).
    pub num_blocks: u64,
    /// Bytes from one row to the next.
    pub row_stride_bytes: u64,
    /// Bytes of one row that belong to the tensor.
    pub row_bytes: u64,
}

impl TensorDesc {
    /// A tensor of `num_blocks` rows of `row_bytes`, `row_stride_bytes` apart.
    #[must_use]
    pub const fn new(
        base_ptr: u64,
        num_blocks: u64,
        row_stride_bytes: u64,
        row_bytes: u64,
    ) -> Self {
        Self {
            base_ptr,
            num_blocks,
            row_stride_bytes,
            row_bytes,
        }
    }

    /// A contiguous tensor: row stride = `row_bytes`.
    #[must_use]
    pub const fn contiguous(base_ptr: u64, num_blocks: u64, row_bytes: u64) -> Self {
        Self::new(base_ptr, num_blocks, row_bytes, row_bytes)
    }

    /// Bytes from the first byte of row 0 to the end of the last row (0 when there are no rows), or
    /// `None` on overflow.
    #[must_use]
    pub fn extent_bytes(&self) -> Option<u64> {
        if self.num_blocks == 0 {
            return Some(0);
        }
        (self.num_blocks - 1)
            .checked_mul(self.row_stride_bytes)?
            .checked_add(self.row_bytes)
    }

    /// Checks the descriptor and returns its address range.
    fn check(&self, side: &str, t: usize) -> Result<Range<u64>> {
        let what = || format!("{side} tensor {t} ({self:?})");
        if self.row_bytes == 0 {
            return Err(KvoffError::arg(format!(
                "{}: row_bytes must be > 0",
                what()
            )));
        }
        if self.num_blocks > 1 && self.row_stride_bytes < self.row_bytes {
            return Err(KvoffError::arg(format!(
                "{}: row_stride_bytes must be >= row_bytes, rows would overlap",
                what()
            )));
        }
        if self.num_blocks > 0 && self.base_ptr == 0 {
            return Err(KvoffError::arg(format!("{}: base_ptr is null", what())));
        }
        let end = self
            .extent_bytes()
            .and_then(|e| self.base_ptr.checked_add(e))
            .ok_or_else(|| KvoffError::arg(format!("{}: extent overflows u64", what())))?;
        Ok(self.base_ptr..end)
    }
}

/// One layer reference of a KV-cache group (vLLM's `CanonicalKVCacheRef`): copy the first
/// `page_size_bytes` (un-padded) bytes of each block of tensor `tensor_idx`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PlanRef {
    /// Index into the tensor lists of the planner.
    pub tensor_idx: usize,
    /// Bytes copied per block (≤ the tensor's page).
    pub page_size_bytes: u64,
}

impl PlanRef {
    /// A reference to `page_size_bytes` of each block of tensor `tensor_idx`.
    #[must_use]
    pub const fn new(tensor_idx: usize, page_size_bytes: u64) -> Self {
        Self {
            tensor_idx,
            page_size_bytes,
        }
    }
}

/// The GPU side of a job (vLLM's `GPULoadStoreSpec`): GPU block ids ordered group by group.
/// `group_sizes = None` means one group holding all ids; `block_indices = None` means index 0 for
/// every group. Slices of `i64` so that numpy `int64` arrays can be passed without conversion.
#[derive(Debug, Clone, Copy, Default)]
pub struct GpuSpec<'a> {
    /// GPU block ids, group by group.
    pub block_ids: &'a [i64],
    /// Number of ids of each group (`Σ = block_ids.len()`).
    pub group_sizes: Option<&'a [i64]>,
    /// Index within the request of each group's first GPU block.
    pub block_indices: Option<&'a [i64]>,
}

impl<'a> GpuSpec<'a> {
    /// One group, starting at index 0.
    #[must_use]
    pub const fn new(block_ids: &'a [i64]) -> Self {
        Self {
            block_ids,
            group_sizes: None,
            block_indices: None,
        }
    }

    /// Several groups.
    #[must_use]
    pub const fn with_groups(
        block_ids: &'a [i64],
        group_sizes: &'a [i64],
        block_indices: Option<&'a [i64]>,
    ) -> Self {
        Self {
            block_ids,
            group_sizes: Some(group_sizes),
            block_indices,
        }
    }
}

/// One byte copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopyOp {
    /// Source address.
    pub src_ptr: u64,
    /// Destination address.
    pub dst_ptr: u64,
    /// Number of bytes.
    pub bytes: u64,
}

/// A list of copies for one direction. Built and validated by [`CopyPlanner`] (or, for callers that
/// describe memory themselves, [`CopyPlan::from_copies`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyPlan {
    direction: Direction,
    copies: Vec<CopyOp>,
    total_bytes: u64,
    num_block_copies: u64,
}

impl CopyPlan {
    /// An empty plan.
    #[must_use]
    pub const fn new(direction: Direction) -> Self {
        Self {
            direction,
            copies: Vec::new(),
            total_bytes: 0,
            num_block_copies: 0,
        }
    }

    /// A plan of explicit copies (not merged). Only overflow is checked here: the caller vouches for
    /// the memory, as it does when it submits the plan to an engine.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] when a copy's range or the total overflows `u64`.
    pub fn from_copies(direction: Direction, copies: Vec<CopyOp>) -> Result<Self> {
        let mut total: u64 = 0;
        for (i, c) in copies.iter().enumerate() {
            if c.src_ptr.checked_add(c.bytes).is_none() || c.dst_ptr.checked_add(c.bytes).is_none()
            {
                return Err(KvoffError::arg(format!("copy {i} ({c:?}) overflows u64")));
            }
            total = total
                .checked_add(c.bytes)
                .ok_or_else(|| KvoffError::arg("total bytes of the copies overflow u64"))?;
        }
        Ok(Self {
            direction,
            num_block_copies: copies.len() as u64,
            copies,
            total_bytes: total,
        })
    }

    /// Direction of every copy.
    #[must_use]
    pub const fn direction(&self) -> Direction {
        self.direction
    }

    /// The copies (after merging).
    #[must_use]
    pub fn copies(&self) -> &[CopyOp] {
        &self.copies
    }

    /// Bytes moved by the whole plan.
    #[must_use]
    pub const fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Number of copies after merging.
    #[must_use]
    pub fn len(&self) -> usize {
        self.copies.len()
    }

    /// Whether there is nothing to copy.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.copies.is_empty()
    }

    /// Number of per-block copies before merging (`Σ_g group_sizes[g] × refs of g`).
    #[must_use]
    pub const fn num_block_copies(&self) -> u64 {
        self.num_block_copies
    }

    fn reset(&mut self, direction: Direction) {
        self.direction = direction;
        self.copies.clear();
        self.total_bytes = 0;
        self.num_block_copies = 0;
    }

    #[inline]
    fn push_merged(&mut self, src_ptr: u64, dst_ptr: u64, bytes: u64) {
        if let Some(last) = self.copies.last_mut() {
            // Cannot overflow: both ends lie inside validated tensors (module invariant 1).
            if last.src_ptr + last.bytes == src_ptr && last.dst_ptr + last.bytes == dst_ptr {
                last.bytes += bytes;
                return;
            }
        }
        self.copies.push(CopyOp {
            src_ptr,
            dst_ptr,
            bytes,
        });
    }
}

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

    fn group_sizes<'s>(&self, gpu: &GpuSpec<'s>) -> Result<GroupSizes<'s>> {
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
    fn validate(&self, gpu: &GpuSpec<'_>, cpu_ids: &[i64]) -> Result<usize> {
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
    fn check_distinct_destinations(
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
    fn check_component_sorted(
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

/// The error for two copies writing destination unit `u` (see [`for_each_dest_unit`]); `g` and
/// `gid` name the second writer's group and GPU block id.
fn duplicate_destination(direction: Direction, f: u64, g: usize, u: u64, gid: i64) -> KvoffError {
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
fn for_each_dest_unit<T>(
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
fn dest_unit(
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

enum GroupSizes<'a> {
    All(usize),
    Given(&'a [i64]),
}

impl GroupSizes<'_> {
    fn get(&self, g: usize) -> Result<usize> {
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

fn block_index(gpu: &GpuSpec<'_>, g: usize) -> Result<u64> {
    match gpu.block_indices {
        None => Ok(0),
        Some(bi) => {
            let v = bi[g];
            u64::try_from(v)
                .map_err(|_| KvoffError::arg(format!("block_indices[{g}] = {v} must be >= 0")))
        }
    }
}

fn check_ids(ids: &[i64], limit: u64, side: &str, g: usize, offset: usize) -> Result<()> {
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
}
