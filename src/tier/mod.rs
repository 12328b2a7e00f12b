//! The tiers behind host memory (docs/spec.md §9, docs/tier.md): where offloaded blocks go when
//! host memory is full — files on a local or shared filesystem, values in Redis/Valkey — and the
//! one tiered manager that puts them behind an offloading manager.
//!
//! **The map.** Each tier is a folder; this folder's files are what every tier shares:
//!
//! | module | what | may import |
//! |---|---|---|
//! | `format` | the value header (magic, version, layout fingerprint, rank, checksums) and the key naming rule every tier uses | — |
//! | `memory` | host memory as the tiers see it: [`BlockMemory`], [`VecMemory`], [`RawRows`], [`AlignedRows`], [`AlignedBuf`] | — |
//! | [`secondary`] | the [`SecondaryTier`](secondary::SecondaryTier) trait every tier implements; names no tier | `format`, `memory` |
//! | [`mod@file`] | the file tier ([`FileTier`]): its settings, I/O threads, directory I/O, trust rules, disk bench | the above |
//! | [`remote`] | the remote tier on Redis/Valkey ([`remote::RemoteTier`]): settings, index, jobs, connections, Cluster routing | the above |
//! | [`object`] | the object tier on S3-compatible stores ([`object::ObjectTier`]): settings, index and budget, jobs on its own runtime | the above |
//! | [`chain`] | [`chain::ChainManager`], the one tiered manager over any tiers (host → files → remote → object) | the above |
//! | [`registry`] | the one list of tiers ([`registry::TIERS`]: each tier's `INFO`) | the above |
//!
//! Sibling tiers never import each other (checked by `scripts/import_cycles.py`). A new tier is
//! its folder plus one line in [`registry::TIERS`] (docs/design.md "Recipe: adding a tier").
//!
//! This module also holds the [`Layout`] every tier fingerprints and the [`Completion`]s every
//! tier returns.
#![deny(unsafe_code)]

pub mod chain;
pub mod file;
mod format;
#[allow(unsafe_code)]
mod memory;
pub mod object;
pub mod registry;
pub mod remote;
pub mod secondary;

use xxhash_rust::xxh3::xxh3_64;

pub use file::bench;
pub use file::{DirectIo, FileTier, IdleWaiter, TierConfig, TierStats};
pub use format::{file_len, payload_sum, PayloadSum, COMPACT_HEADER_BYTES, HEADER_BYTES};
pub use memory::{AlignedBuf, AlignedRows, BlockMemory, RawRows, VecMemory};

use crate::key::ByteKey;
use crate::manager::BlockId;

/// What a tier's values hold: engines agree on every field or they never read each other's values.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Layout {
    /// A user-chosen id of the model / cache namespace (e.g. model name + revision).
    pub namespace: String,
    /// Page size of each canonical KV tensor, in bytes.
    pub page_sizes_bytes: Vec<u64>,
    /// GPU blocks per offloaded block.
    pub block_size_factor: u64,
    /// Element type of the KV cache (e.g. `"bfloat16"`).
    pub dtype: String,
    /// Number of ranks.
    pub world_size: u32,
    /// This process's rank.
    pub rank: u32,
}

impl Layout {
    /// Fingerprint of everything but the rank, plus the payload length.
    #[must_use]
    pub fn fingerprint(&self, payload_len: u64) -> u64 {
        let mut s = Vec::new();
        s.extend_from_slice(b"kvoff-tier-layout\0");
        s.extend_from_slice(&(self.namespace.len() as u64).to_le_bytes());
        s.extend_from_slice(self.namespace.as_bytes());
        s.extend_from_slice(&(self.page_sizes_bytes.len() as u64).to_le_bytes());
        for p in &self.page_sizes_bytes {
            s.extend_from_slice(&p.to_le_bytes());
        }
        s.extend_from_slice(&self.block_size_factor.to_le_bytes());
        s.extend_from_slice(&(self.dtype.len() as u64).to_le_bytes());
        s.extend_from_slice(self.dtype.as_bytes());
        s.extend_from_slice(&self.world_size.to_le_bytes());
        s.extend_from_slice(&payload_len.to_le_bytes());
        xxh3_64(&s)
    }
}

/// A finished job, returned by [`FileTier::poll`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// A write no longer needs its host block (copied out, or failed before): unpin it.
    Released {
        /// The key written.
        key: ByteKey,
        /// The host block it was copied from.
        block: BlockId,
    },
    /// A promotion finished: on success the block holds the file's payload.
    Promoted {
        /// The key read.
        key: ByteKey,
        /// The host block read into.
        block: BlockId,
        /// Whether the bytes arrived (a failed promotion left the block's bytes undefined).
        ok: bool,
    },
}
