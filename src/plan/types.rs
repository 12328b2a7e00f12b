//! The values of a plan: [`Direction`], [`TensorDesc`] (one side of a canonical tensor),
//! [`PlanRef`] (one tensor of a group), [`GpuSpec`] (a job's GPU side), [`CopyOp`] and
//! [`CopyPlan`] (the validated, merged copies).
#![forbid(unsafe_code)]

use std::ops::Range;

use crate::error::{KvoffError, Result};

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
    pub(super) fn check(&self, side: &str, t: usize) -> Result<Range<u64>> {
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

/// A list of copies for one direction. Built and validated by [`CopyPlanner`](super::CopyPlanner) (or, for callers that
/// describe memory themselves, [`CopyPlan::from_copies`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyPlan {
    pub(super) direction: Direction,
    pub(super) copies: Vec<CopyOp>,
    pub(super) total_bytes: u64,
    pub(super) num_block_copies: u64,
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

    pub(super) fn reset(&mut self, direction: Direction) {
        self.direction = direction;
        self.copies.clear();
        self.total_bytes = 0;
        self.num_block_copies = 0;
    }

    #[inline]
    pub(super) fn push_merged(&mut self, src_ptr: u64, dst_ptr: u64, bytes: u64) {
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
