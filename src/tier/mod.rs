//! The file tier behind host memory (docs/spec.md §9): offloaded blocks kept as files in a directory on
//! a local `NVMe` drive or a shared filesystem, persistent across restarts and shared between engines.
//!
//! **Files.** One file per block and rank,
//! `<dir>/kvoff-<layout fingerprint>/<shard>/<key hex>.r<rank>.<owner>.kvb`, where `<shard>` is one of
//! 256 subdirectories chosen by a hash of the key (keys longer than 100 bytes are named by their
//! xxh3-128). Each file is a 4 KiB header (magic, format
//! version, layout fingerprint, rank, world size, payload length, xxh3-64 of the payload, owner tag,
//! the key, a header checksum; see [`format`]) followed by the block's bytes padded to 4 KiB. The
//! fingerprint covers a user namespace id, the page sizes, `block_size_factor`, dtype, world size and
//! the payload length, so engines of different models or layouts never read each other's files.
//!
//! **Publication and durability.** A file is written whole under a temporary name
//! (`.tmp.<host>.<pid>.<n>`) and renamed into place, so a reader sees either no file or a complete
//! one; a process killed while writing leaves only a temporary file, which the next start on the
//! same host removes when its pid is gone. By default nothing is `fsync`ed: the tier is a cache, and
//! after a power loss or kernel crash a published file whose data did not reach the disk fails its
//! checksum and is dropped (a miss, never served). [`TierConfig::fsync`] syncs each file before the
//! rename for filesystems where that matters (some network filesystems).
//!
//! **I/O.** `O_DIRECT` with 4 KiB-aligned buffers where the filesystem accepts it (probed at start),
//! buffered I/O otherwise. With 4 KiB-aligned host memory ([`RawRows`] over a `HostRegion`,
//! [`AlignedRows`]) a file's header and block move in one `pwritev`/`preadv` straight between the file
//! and the host block; other memory is copied through the I/O thread's buffer. A fixed pool of I/O
//! threads does every file operation, copy and checksum; the caller's thread only updates the
//! in-memory index and queues jobs, never waits. Promotions (reads) go before writes. Writes are
//! bounded by [`TierConfig::max_queued_writes`]: beyond it a write is dropped and counted.
//!
//! **Index and capacity.** At start the directory is listed (no file is read except hashed names):
//! every `*.kvb` of this rank is indexed (restart = warm), stale temporary files of dead local
//! processes are removed. The listing is repeated every [`TierConfig::rescan_interval`] by an idle
//! I/O thread, so files written by other engines sharing the directory become visible and files they
//! removed are forgotten. The capacity ([`TierConfig::capacity_bytes`]) bounds the bytes of the files
//! *this instance* owns (its owner tag, which survives restarts): before a write, least-recently-used
//! own files (recency = written or promoted) are removed to make room. Other engines' files are
//! never removed except when they are corrupt. Files with this instance's owner tag found at start
//! are adopted as its own; found later (another live process with the same tag) they are readable
//! but not counted, so two engines with the same tag still share files, but their capacities
//! overlap: give engines on one host and namespace distinct [`TierConfig::owner`]s.
//!
//! **Validation.** A read checks header and payload checksum, the fingerprint, rank and key before a
//! byte reaches host memory; a file that fails is never served: the read is a miss, the file is
//! removed and [`TierStats::corrupt_files`] counts it.
//!
//! **Errors.** A directory that is missing and cannot be created, is not a directory, or is not
//! writable is a [`KvoffError::Config`] at [`FileTier::open`]. Every later I/O error (full disk,
//! permissions changed, file vanished) is counted in [`TierStats`], the store is skipped or the
//! promotion fails, and the tier keeps working.
//!
//! **Layout.** This module holds what every tier shares (host memory as [`BlockMemory`], the
//! [`Layout`], [`Completion`]); [`mod@file`] is the file tier ([`FileTier`]), [`remote`] the remote
//! tier, [`secondary`] their common trait and [`chain`] the one tiered manager over them.
//!
//! [`chain::ChainManager`] puts a tier (or several: files, then a remote store) behind an offloading
//! manager (the protocol of docs/spec.md §9, docs/tier.md "Tier chain").
//!
//! ```
//! use std::sync::Arc;
//! use kvoff::key::ByteKey;
//! use kvoff::manager::{LruManager, ManagerConfig, Presence};
//! use kvoff::tier::chain::{ChainConfig, ChainManager, ChainTier};
//! use kvoff::tier::{FileTier, Layout, TierConfig, VecMemory};
//!
//! let dir = std::env::temp_dir().join(format!("kvoff-doc-{}", std::process::id()));
//! let layout = Layout { namespace: "my-model".into(), world_size: 1, ..Layout::default() };
//! let open = |mem: Arc<VecMemory>| -> kvoff::Result<ChainManager<LruManager<ByteKey>>> {
//!     let tier = FileTier::open(TierConfig::new(&dir, 1 << 30, layout.clone()), mem)?;
//!     let tiers = vec![ChainTier::new(Box::new(tier))];
//!     Ok(ChainManager::new(LruManager::new(ManagerConfig::new(4)), tiers, ChainConfig::default()))
//! };
//! let key = ByteKey::new(b"block-hash\0\0\0\0");
//! {
//!     let mem = Arc::new(VecMemory::new(4, 4096));
//!     let mut m = open(mem.clone())?;
//!     let out = m.prepare_store(&[key.clone()])?.expect("room");
//!     mem.set_block(out.block_ids[0], &[7; 4096])?;          // the engine fills the host block
//!     m.complete_store(&out.keys_to_store, true)?;           // ready, and written through to disk
//!     m.shutdown();                                          // waits for the write
//! }
//! // A restart: host memory is empty, the file is found, promoted, then served.
//! let mem = Arc::new(VecMemory::new(4, 4096));
//! let mut m = open(mem.clone())?;
//! assert_eq!(m.lookup(&key)?, Presence::Pending);
//! m.flush();
//! assert_eq!(m.lookup(&key)?, Presence::Ready);
//! let ids = m.prepare_load(&[key.clone()])?;
//! assert_eq!(mem.block(ids[0])?, vec![7; 4096]);
//! m.complete_load(&[key])?;
//! # m.shutdown();
//! # let _ = std::fs::remove_dir_all(&dir);
//! # Ok::<(), kvoff::KvoffError>(())
//! ```
#![deny(unsafe_code)]

pub mod chain;
pub mod file;
mod format;
pub mod remote;
pub mod secondary;

use std::sync::{Mutex, MutexGuard, PoisonError};

use xxhash_rust::xxh3::xxh3_64;

pub use file::bench;
pub use file::io::{AlignedBuf, AlignedRows, RawRows};
pub use file::{DirectIo, FileTier, IdleWaiter, TierConfig, TierStats};
pub use format::{file_len, COMPACT_HEADER_BYTES, HEADER_BYTES};

use crate::error::{KvoffError, Result};
use crate::key::ByteKey;
use crate::manager::BlockId;

/// Host memory the tier copies blocks out of and into (one rank's slot of each row).
///
/// The tier calls these from its I/O threads. The caller's protocol keeps a block unchanged while it
/// is copied out (pinned) and unread while it is copied in (a pending store).
pub trait BlockMemory: Send + Sync {
    /// Bytes of one block (the payload of one file).
    fn block_bytes(&self) -> usize;
    /// Number of blocks.
    fn num_blocks(&self) -> u64;
    /// Copies block `block` into `out` (`out.len() == block_bytes()`).
    ///
    /// # Errors
    /// A block out of range or a wrong length.
    fn copy_out(&self, block: BlockId, out: &mut [u8]) -> Result<()>;
    /// Copies `data` (`block_bytes()` long) into block `block`.
    ///
    /// # Errors
    /// A block out of range or a wrong length.
    fn copy_in(&self, block: BlockId, data: &[u8]) -> Result<()>;
    /// Calls `f` with block `block`'s bytes: in place where the memory allows it (the remote
    /// tier then checksums and sends a block without copying it first); the default copies the
    /// block into a new buffer.
    ///
    /// # Errors
    /// A block out of range.
    fn with_block(&self, block: BlockId, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        let mut v = vec![0u8; self.block_bytes()];
        self.copy_out(block, &mut v)?;
        f(&v);
        Ok(())
    }
    /// Calls `f` with block `block`'s bytes to overwrite (a pending block: nobody reads it
    /// meanwhile): in place where the memory allows it (the remote tier then reads a value from
    /// its socket straight into host memory); the default gives `f` a new buffer and copies it
    /// into the block when `f` returns `true`.
    ///
    /// # Errors
    /// A block out of range.
    fn with_block_mut(&self, block: BlockId, f: &mut dyn FnMut(&mut [u8]) -> bool) -> Result<()> {
        let mut v = vec![0u8; self.block_bytes()];
        if f(&mut v) {
            self.copy_in(block, &v)?;
        }
        Ok(())
    }
    /// Reads a whole tier file from `file` (opened with `O_DIRECT`): the first `header.len()` bytes
    /// into `header`, the next `block_bytes()` straight into block `block`; returns the xxh3-64 of
    /// the bytes that landed in the block. `None` (the default) when the memory cannot take such a
    /// read (alignment): the tier then reads into its own buffer and uses [`BlockMemory::copy_in`].
    fn read_file_into(
        &self,
        block: BlockId,
        file: &std::fs::File,
        header: &mut [u8],
    ) -> Option<std::io::Result<u64>> {
        let _ = (block, file, header);
        None
    }
    /// The xxh3-64 of block `block`, computed in place, when the memory supports writes straight
    /// from the block ([`BlockMemory::write_file_from`]); `None` (the default) otherwise.
    fn payload_sum(&self, block: BlockId) -> Option<std::io::Result<u64>> {
        let _ = block;
        None
    }
    /// Writes a whole tier file to `file` (opened with `O_DIRECT`): `header`, then block `block`'s
    /// bytes straight from host memory. `None` (the default) when not supported; then the tier
    /// copies the block into its buffer first. Supported exactly when `payload_sum` is.
    fn write_file_from(
        &self,
        block: BlockId,
        file: &std::fs::File,
        header: &[u8],
    ) -> Option<std::io::Result<()>> {
        let _ = (block, file, header);
        None
    }
}

/// Host memory as one `Vec` per block behind a lock: for tests and tools.
#[derive(Debug)]
pub struct VecMemory {
    blocks: Vec<Mutex<Vec<u8>>>,
    block_bytes: usize,
}

impl VecMemory {
    /// `num_blocks` zeroed blocks of `block_bytes`.
    #[must_use]
    pub fn new(num_blocks: usize, block_bytes: usize) -> Self {
        Self {
            blocks: (0..num_blocks)
                .map(|_| Mutex::new(vec![0; block_bytes]))
                .collect(),
            block_bytes,
        }
    }

    fn get(&self, block: BlockId, len: usize) -> Result<MutexGuard<'_, Vec<u8>>> {
        if len != self.block_bytes {
            return Err(KvoffError::arg(format!(
                "{len} bytes for a block of {}",
                self.block_bytes
            )));
        }
        self.blocks
            .get(block as usize)
            .map(|m| m.lock().unwrap_or_else(PoisonError::into_inner))
            .ok_or_else(|| KvoffError::arg(format!("block {block} out of range")))
    }

    /// A copy of block `block`.
    ///
    /// # Errors
    /// A block out of range.
    pub fn block(&self, block: BlockId) -> Result<Vec<u8>> {
        Ok(self.get(block, self.block_bytes)?.clone())
    }

    /// Overwrites block `block`.
    ///
    /// # Errors
    /// A block out of range or a wrong length.
    pub fn set_block(&self, block: BlockId, data: &[u8]) -> Result<()> {
        self.get(block, data.len())?.copy_from_slice(data);
        Ok(())
    }
}

impl BlockMemory for VecMemory {
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }
    fn num_blocks(&self) -> u64 {
        self.blocks.len() as u64
    }
    fn copy_out(&self, block: BlockId, out: &mut [u8]) -> Result<()> {
        out.copy_from_slice(&self.get(block, out.len())?);
        Ok(())
    }
    fn copy_in(&self, block: BlockId, data: &[u8]) -> Result<()> {
        self.set_block(block, data)
    }
    fn with_block(&self, block: BlockId, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        f(&self.get(block, self.block_bytes)?);
        Ok(())
    }
}

/// What the files hold: engines agree on every field or they never read each other's files.
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
