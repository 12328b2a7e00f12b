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
//! [`tiered::TieredManager`] puts a tier behind an offloading manager (the protocol of docs/spec.md §9).
//!
//! ```
//! use std::sync::Arc;
//! use kvoff::key::ByteKey;
//! use kvoff::manager::{LruManager, ManagerConfig, Presence};
//! use kvoff::tier::{tiered::{TieredConfig, TieredManager}, FileTier, Layout, TierConfig, VecMemory};
//!
//! let dir = std::env::temp_dir().join(format!("kvoff-doc-{}", std::process::id()));
//! let layout = Layout { namespace: "my-model".into(), world_size: 1, ..Layout::default() };
//! let open = |mem: Arc<VecMemory>| -> kvoff::Result<TieredManager<LruManager<ByteKey>>> {
//!     let tier = FileTier::open(TierConfig::new(&dir, 1 << 30, layout.clone()), mem)?;
//!     Ok(TieredManager::new(LruManager::new(ManagerConfig::new(4)), tier, TieredConfig::default()))
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
//! m.tier().flush();
//! assert_eq!(m.lookup(&key)?, Presence::Ready);
//! let ids = m.prepare_load(&[key.clone()])?;
//! assert_eq!(mem.block(ids[0])?, vec![7; 4096]);
//! m.complete_load(&[key])?;
//! # m.shutdown();
//! # let _ = std::fs::remove_dir_all(&dir);
//! # Ok::<(), kvoff::KvoffError>(())
//! ```
#![deny(unsafe_code)]

pub mod bench;
pub mod chain;
mod format;
#[allow(unsafe_code)]
mod io;
pub mod remote;
pub mod secondary;
pub mod tiered;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

pub use format::{file_len, HEADER_BYTES};
pub use io::{AlignedBuf, AlignedRows, RawRows};

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

/// Whether to use `O_DIRECT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DirectIo {
    /// Where the filesystem accepts it (probed at open).
    #[default]
    Auto,
    /// Always (open fails where the filesystem refuses it).
    On,
    /// Never (buffered I/O through the page cache).
    Off,
}

/// Settings of a [`FileTier`].
#[derive(Clone, Debug)]
pub struct TierConfig {
    /// The shared directory (created if missing).
    pub dir: PathBuf,
    /// Bytes of files this instance may own (headers included).
    pub capacity_bytes: u64,
    /// What the blocks are.
    pub layout: Layout,
    /// Number of I/O threads (≥ 1).
    pub io_threads: usize,
    /// Writes queued beyond this are dropped (counted in [`TierStats::writes_dropped`]).
    pub max_queued_writes: usize,
    /// At most this many I/O threads write at once (the others stay free for promotions, which a
    /// scheduler waits for); clamped to `1..=io_threads`. On the development VM's disk (noisy) 8
    /// concurrent writers were no faster than 2–4 and 2 were too few for 256 KiB blocks.
    pub write_threads: usize,
    /// `fsync` each file before publishing it.
    pub fsync: bool,
    /// `O_DIRECT` policy.
    pub direct_io: DirectIo,
    /// How often an idle I/O thread lists the directory again (`None`: only at start).
    pub rescan_interval: Option<Duration>,
    /// Identity of this instance for capacity accounting (files it wrote, also in an earlier life);
    /// default: the namespace, rank and host name.
    pub owner: Option<String>,
    /// File mode of new files (default 0o600: only this user may read the KV cache).
    pub file_mode: u32,
    /// Users besides this process's effective uid whose files and directories are trusted
    /// (docs/tier.md "Trust"; default none: a directory shared by several users names them here).
    pub trusted_uids: Vec<u32>,
    /// A group whose files and directories are trusted, and whose write permission on them is
    /// accepted (default none).
    pub trusted_gid: Option<u32>,
    /// Accept directories writable by untrusted users without the sticky bit (default `false`:
    /// such a directory is a [`KvoffError::Config`] at [`FileTier::open`]).
    pub allow_writable_dir: bool,
}

impl TierConfig {
    /// Defaults: 8 I/O threads of which at most 4 write at once, 256 queued writes, no fsync, `O_DIRECT` where possible, rescan every
    /// 2 s, files 0600.
    #[must_use]
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64, layout: Layout) -> Self {
        Self {
            dir: dir.into(),
            capacity_bytes,
            layout,
            io_threads: 8,
            max_queued_writes: 256,
            write_threads: 4,
            fsync: false,
            direct_io: DirectIo::Auto,
            rescan_interval: Some(Duration::from_secs(2)),
            owner: None,
            file_mode: 0o600,
            trusted_uids: Vec::new(),
            trusted_gid: None,
            allow_writable_dir: false,
        }
    }
}

/// Counters and gauges of a tier. Counters only grow; per-direction GB/s = bytes / seconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TierStats {
    /// Files published by this instance.
    pub files_written: u64,
    /// Payload bytes published.
    pub bytes_written: u64,
    /// Seconds the I/O threads spent writing (copy out, checksum, write, rename), summed over threads.
    pub write_seconds: f64,
    /// Writes that failed (full disk, permissions, …): the store to the tier was skipped.
    pub write_errors: u64,
    /// Writes dropped because the queue was full or the capacity could not be freed.
    pub writes_dropped: u64,
    /// Promotions that reached host memory.
    pub promotions: u64,
    /// Payload bytes promoted.
    pub bytes_read: u64,
    /// Seconds the I/O threads spent reading (read, checks, copy in), summed over threads.
    pub read_seconds: f64,
    /// Promotions whose file had vanished or could not be read.
    pub read_errors: u64,
    /// Files rejected by a header or checksum check (and removed).
    pub corrupt_files: u64,
    /// Foreign entries skipped where the tier expected its own files or shard directories: FIFOs,
    /// sockets, devices, symbolic links, directories, files of untrusted owners or writable by
    /// untrusted users, hard-linked files it was about to overwrite (docs/tier.md "Trust"). Each
    /// entry (name and inode) counts once.
    pub rejected_files: u64,
    /// Own files removed to respect the capacity.
    pub evicted_files: u64,
    /// Files indexed (readable).
    pub indexed_files: u64,
    /// Files owned by this instance.
    pub own_files: u64,
    /// Bytes of the files owned by this instance.
    pub own_bytes: u64,
    /// Jobs queued or running.
    pub queued_reads: u64,
    /// Writes queued or running.
    pub queued_writes: u64,
    /// Whether `O_DIRECT` is used.
    pub direct_io: bool,
    /// The last I/O error, for diagnosis.
    pub last_error: Option<String>,
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FileState {
    Writing,
    Published,
}

#[derive(Debug)]
struct Entry {
    name: Box<str>,
    state: FileState,
    /// Recency stamp when owned by this instance.
    own_stamp: Option<u64>,
}

enum Job {
    Write {
        key: ByteKey,
        block: BlockId,
        name: Box<str>,
        /// An evicted own file to overwrite instead of creating a new one.
        reuse: Option<Box<str>>,
    },
    Read {
        key: ByteKey,
        block: BlockId,
        name: Box<str>,
    },
    Unlink {
        name: Box<str>,
    },
}

#[derive(Default)]
struct State {
    index: HashMap<ByteKey, Entry, foldhash::fast::RandomState>,
    own_lru: BTreeMap<u64, ByteKey>,
    stamp: u64,
    own_bytes: u64,
    reads: VecDeque<Job>,
    writes: VecDeque<Job>,
    unlinks: VecDeque<Job>,
    running_reads: u64,
    running_writes: u64,
    completions: Vec<Completion>,
    shutdown: bool,
    last_scan: Option<Instant>,
    scanning: bool,
    last_error: Option<String>,
    /// Foreign entries already counted in [`TierStats::rejected_files`]: name → inode.
    rejected: HashMap<Box<str>, u64, foldhash::fast::RandomState>,
}

#[derive(Default)]
struct Counters {
    files_written: AtomicU64,
    bytes_written: AtomicU64,
    write_ns: AtomicU64,
    write_errors: AtomicU64,
    writes_dropped: AtomicU64,
    promotions: AtomicU64,
    bytes_read: AtomicU64,
    read_ns: AtomicU64,
    read_errors: AtomicU64,
    corrupt_files: AtomicU64,
    rejected_files: AtomicU64,
    evicted_files: AtomicU64,
}

/// Whom the directory trusts (docs/tier.md "Trust").
#[derive(Debug)]
struct Trust {
    uids: Vec<u32>,
    gid: Option<u32>,
    allow_writable_dir: bool,
}

impl Trust {
    fn owner_ok(&self, st: &io::Stat) -> bool {
        self.uids.contains(&st.uid) || self.gid == Some(st.gid)
    }

    /// Writable only by trusted users: not by everyone, by the group only if it is trusted.
    fn write_ok(&self, st: &io::Stat) -> std::result::Result<(), String> {
        if st.mode & 0o002 != 0 {
            return Err(format!(
                "writable by every user (mode {:o})",
                st.mode & 0o7777
            ));
        }
        if st.mode & 0o020 != 0 && self.gid != Some(st.gid) {
            return Err(format!(
                "writable by group {} (mode {:o}), which is not trusted_gid",
                st.gid,
                st.mode & 0o7777
            ));
        }
        Ok(())
    }

    /// A file the tier may serve.
    fn file(&self, st: &io::Stat) -> std::result::Result<(), String> {
        if !st.is_file() {
            return Err(format!(
                "not a regular file (type {:o})",
                st.mode & libc::S_IFMT
            ));
        }
        if !self.owner_ok(st) {
            return Err(format!(
                "owned by uid {} gid {}, which are not trusted",
                st.uid, st.gid
            ));
        }
        self.write_ok(st)
    }

    /// A directory whose entries other users cannot rename or remove: writable only by trusted
    /// users, or with the sticky bit (or `allow_writable_dir`).
    fn dir_writers(&self, st: &io::Stat) -> std::result::Result<(), String> {
        if self.allow_writable_dir || st.mode & libc::S_ISVTX != 0 {
            return Ok(());
        }
        self.write_ok(st).map_err(|e| {
            format!("{e} without the sticky bit (set allow_writable_dir to accept it)")
        })
    }

    /// A directory of the tier's own tree (namespace or shard directory).
    fn dir(&self, st: &io::Stat) -> std::result::Result<(), String> {
        if !st.is_dir() {
            return Err(format!(
                "not a directory (type {:o})",
                st.mode & libc::S_IFMT
            ));
        }
        if !self.owner_ok(st) {
            return Err(format!(
                "owned by uid {} gid {}, which are not trusted",
                st.uid, st.gid
            ));
        }
        self.dir_writers(st)
    }
}

/// `("ab", "<file>")` of an index name `"ab/<file>"`.
fn split_name(name: &str) -> (&str, &str) {
    name.split_once('/').unwrap_or(("", name))
}

fn untrusted(what: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::PermissionDenied, what)
}

struct Shared {
    ns_dir: PathBuf,
    /// The namespace directory, opened once at start: every name is reached relative to it.
    dir_fd: std::os::fd::OwnedFd,
    trust: Trust,
    fingerprint: u64,
    rank: u32,
    world_size: u32,
    owner: u64,
    owner_hex: String,
    host_tag: String,
    payload_len: usize,
    file_len: u64,
    capacity_bytes: u64,
    max_queued_writes: usize,
    write_threads: u64,
    fsync: bool,
    direct: bool,
    file_mode: u32,
    rescan_interval: Option<Duration>,
    memory: Arc<dyn BlockMemory>,
    state: Mutex<State>,
    cv: Condvar,
    counters: Counters,
    tmp_seq: AtomicU64,
    /// The process that started the I/O threads (a `fork()`ed child has none of them).
    pid: u32,
}

/// Waits until a tier's queued jobs have run; see [`FileTier::idle_waiter`].
pub struct IdleWaiter(Arc<Shared>);

impl std::fmt::Debug for IdleWaiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleWaiter").finish_non_exhaustive()
    }
}

impl IdleWaiter {
    /// Blocks until no job is queued or running (returns at once in a `fork()`ed child or after
    /// shutdown, where no thread runs them). Completions stay for [`FileTier::poll`].
    pub fn wait(&self) {
        let sh = &self.0;
        if std::process::id() != sh.pid {
            return;
        }
        loop {
            {
                let st = lock(&sh.state);
                let idle = st.reads.is_empty()
                    && st.writes.is_empty()
                    && st.unlinks.is_empty()
                    && st.running_reads == 0
                    && st.running_writes == 0;
                if idle || (st.shutdown && st.running_reads == 0 && st.running_writes == 0) {
                    return;
                }
            }
            sh.cv.notify_all();
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// The file tier. See the module docs.
pub struct FileTier {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for FileTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileTier")
            .field("dir", &self.shared.ns_dir)
            .field("direct", &self.shared.direct)
            .finish_non_exhaustive()
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Files are spread over 256 subdirectories `00`..`ff` (by a hash of the key), so that directory
/// locks taken by create and rename are not shared by all I/O threads and directories stay small.
const SHARD_LEN: usize = 2;

fn is_shard(n: &str) -> bool {
    n.len() == SHARD_LEN
        && n.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// Longest key named by its hex bytes (longer keys are named by their hash).
const MAX_HEX_KEY: usize = 100;

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn untrusted_dir(path: &Path, why: &str) -> KvoffError {
    KvoffError::Config(format!(
        "disk tier: refusing to use {}: {why}; the tier trusts directories and files of this user \
         (and of trusted_uids / trusted_gid), writable by no one else unless the directory has the \
         sticky bit (docs/tier.md \"Trust\"); remove it or fix its owner and mode",
        path.display()
    ))
}

fn config_err(what: &str, path: &Path, e: &std::io::Error) -> KvoffError {
    KvoffError::Config(format!(
        "disk tier: {what} {}: {e} (set disk_path to a writable directory)",
        path.display()
    ))
}

impl Shared {
    fn file_name(&self, key: &ByteKey) -> Box<str> {
        let k = key.as_bytes();
        let stem = if k.len() <= MAX_HEX_KEY {
            hex(k)
        } else {
            format!("h{:032x}", xxh3_128(k))
        };
        format!(
            "{:02x}/{stem}.r{}.{}.kvb",
            xxh3_64(k) & 0xff,
            self.rank,
            self.owner_hex
        )
        .into_boxed_str()
    }

    /// `(key, owned)` of a file name of this rank; `None` for other names. Hashed names need the
    /// header: `Some((None, owned))`.
    fn parse_name(&self, name: &str) -> Option<(Option<Vec<u8>>, bool)> {
        let rest = name.strip_suffix(".kvb")?;
        let (rest, owner_tag) = rest.rsplit_once('.')?;
        let (stem, rank) = rest.rsplit_once('.')?;
        if rank.strip_prefix('r')?.parse::<u32>().ok()? != self.rank {
            return None;
        }
        let owned = owner_tag == self.owner_hex;
        if let Some(h) = stem.strip_prefix('h') {
            if h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Some((None, owned));
            }
            return None;
        }
        Some((Some(unhex(stem)?), owned))
    }

    fn expect_header(&self, key: &ByteKey) -> format::Header {
        format::Header {
            fingerprint: self.fingerprint,
            rank: self.rank,
            world_size: self.world_size,
            payload_len: self.payload_len as u64,
            payload_sum: 0,
            owner: self.owner,
            key: key.as_bytes().to_vec(),
        }
    }

    fn note_error(&self, e: impl std::fmt::Display) {
        lock(&self.state).last_error = Some(e.to_string());
    }

    /// Opens shard directory `shard` (relative to the namespace directory, never through a link)
    /// and checks it is a trusted directory; with `create`, a missing one is created first.
    fn open_shard(&self, shard: &str, create: bool) -> std::io::Result<std::os::fd::OwnedFd> {
        let c = io::cname(shard)?;
        let fd = match io::open_dir_at(self.dir_fd.as_fd(), &c) {
            Err(e) if create && e.kind() == std::io::ErrorKind::NotFound => {
                io::mkdir_at(self.dir_fd.as_fd(), &c)?;
                io::open_dir_at(self.dir_fd.as_fd(), &c)?
            }
            r => r?,
        };
        let st = io::fstat(fd.as_fd())?;
        self.trust
            .dir(&st)
            .map_err(|why| untrusted(format!("shard directory {shard}: {why}")))?;
        Ok(fd)
    }

    /// Counts a foreign entry (once per name and inode) and says why in `last_error`.
    fn reject(&self, name: &str, ino: u64, why: &str) {
        let mut st = lock(&self.state);
        if st.rejected.get(name) == Some(&ino) {
            return;
        }
        if st.rejected.len() >= 65_536 {
            st.rejected.clear();
        }
        st.rejected.insert(name.into(), ino);
        self.counters.rejected_files.fetch_add(1, Relaxed);
        st.last_error = Some(format!(
            "skipped {}: {why}",
            self.ns_dir.join(name).display()
        ));
    }

    /// Lists the directory and merges it into the index. At start (`initial`) own files are
    /// adopted into the LRU (oldest modification first) and stale local temporary files removed.
    /// Nothing is opened but shard directories and files with hashed names (their header holds the
    /// key), each `O_NOFOLLOW | O_NONBLOCK`; an entry of the tier's name forms that is not a
    /// regular file (a directory for shards) of a trusted owner is skipped and counted
    /// (docs/tier.md "Trust"). Files not yet indexed are checked with `fstatat` (no lock held).
    #[allow(clippy::too_many_lines)] // one pass: list, check the new names, merge
    fn scan(&self, initial: bool) {
        struct Found {
            key: ByteKey,
            name: Box<str>,
            owned: bool,
            /// The `fstat` of a file opened to read its header (hashed names).
            stat: Option<io::Stat>,
        }
        let tops = match io::list_dir(self.dir_fd.as_fd()) {
            Ok(v) => v,
            Err(e) => {
                self.note_error(format!("listing {}: {e}", self.ns_dir.display()));
                return;
            }
        };
        let mut found: Vec<Found> = Vec::new();
        let tmp_prefix = format!(".tmp.{}.", self.host_tag);
        for top in tops {
            let Some(shard_name) = top.name.to_str().filter(|n| is_shard(n)) else {
                continue;
            };
            if top.kind != libc::DT_DIR && top.kind != libc::DT_UNKNOWN {
                self.reject(shard_name, top.ino, "not a directory");
                continue;
            }
            let shard = match self.open_shard(shard_name, false) {
                Ok(fd) => fd,
                Err(e) => {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        self.reject(shard_name, top.ino, &e.to_string());
                    }
                    continue;
                }
            };
            let Ok(files) = io::list_dir(shard.as_fd()) else {
                continue;
            };
            for ent in files {
                let Some(name) = ent.name.to_str() else {
                    continue;
                };
                if initial {
                    if let Some(rest) = name.strip_prefix(&tmp_prefix) {
                        let pid = rest.split('.').next().unwrap_or("");
                        let alive = !pid.is_empty() && Path::new("/proc").join(pid).exists();
                        if !alive {
                            if let Ok(c) = io::cname(name) {
                                let _ = io::unlink_at(shard.as_fd(), &c);
                            }
                        }
                        continue;
                    }
                }
                let Some((key, owned)) = self.parse_name(name) else {
                    continue;
                };
                let full = format!("{shard_name}/{name}");
                if ent.kind != libc::DT_REG && ent.kind != libc::DT_UNKNOWN {
                    self.reject(&full, ent.ino, "not a regular file");
                    continue;
                }
                let (key, stat) = match key {
                    Some(k) => (ByteKey::new(&k), None),
                    None => match self.read_header_key(&shard, name, &full) {
                        Some((k, st)) => (ByteKey::new(&k), Some(st)),
                        None => continue,
                    },
                };
                found.push(Found {
                    key,
                    name: full.into_boxed_str(),
                    owned,
                    stat,
                });
            }
        }
        // Names not indexed yet are checked (owner, type, mode) before they are indexed; indexed
        // ones are checked again when a promotion opens them.
        let unchecked: Vec<usize> = {
            let st = lock(&self.state);
            (0..found.len())
                .filter(|&i| {
                    found[i].stat.is_none() && (initial || !st.index.contains_key(&found[i].key))
                })
                .collect()
        };
        let mut ok = vec![true; found.len()];
        let mut shard: Option<(String, std::os::fd::OwnedFd)> = None;
        for i in unchecked {
            let (sname, fname) = split_name(&found[i].name);
            if shard.as_ref().is_none_or(|(n, _)| n != sname) {
                shard = self
                    .open_shard(sname, false)
                    .ok()
                    .map(|fd| (sname.to_owned(), fd));
            }
            let st = match (&shard, io::cname(fname)) {
                (Some((_, fd)), Ok(c)) => io::stat_at(fd.as_fd(), &c),
                _ => Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
            };
            match st {
                Ok(st) => match self.trust.file(&st) {
                    Ok(()) => found[i].stat = Some(st),
                    Err(why) => {
                        ok[i] = false;
                        self.reject(&found[i].name, st.ino, &why);
                    }
                },
                // Vanished since the listing.
                Err(_) => ok[i] = false,
            }
        }
        drop(shard);
        let mut own_times: Vec<(i64, usize)> = Vec::new();
        if initial {
            for (i, f) in found.iter().enumerate() {
                if ok[i] && f.owned {
                    own_times.push((f.stat.map_or(0, |s| s.mtime), i));
                }
            }
        }
        own_times.sort_unstable();
        let mut st = lock(&self.state);
        if initial {
            for (_, i) in own_times {
                let Found { key, name, .. } = &found[i];
                if st.index.contains_key(key) {
                    continue;
                }
                st.stamp += 1;
                let stamp = st.stamp;
                st.own_lru.insert(stamp, key.clone());
                st.own_bytes += self.file_len;
                st.index.insert(
                    key.clone(),
                    Entry {
                        name: name.clone(),
                        state: FileState::Published,
                        own_stamp: Some(stamp),
                    },
                );
            }
        }
        let mut seen: std::collections::HashSet<&ByteKey, foldhash::fast::RandomState> =
            std::collections::HashSet::with_capacity_and_hasher(
                found.len(),
                foldhash::fast::RandomState::default(),
            );
        // Files of other owners, and (after the start) files with this owner's tag that this
        // instance does not know (another live process with the same owner tag): readable, but not
        // counted in this instance's capacity.
        for (i, Found { key, name, .. }) in found.iter().enumerate() {
            if !ok[i] {
                continue;
            }
            seen.insert(key);
            if st.index.contains_key(key) {
                continue;
            }
            st.index.insert(
                key.clone(),
                Entry {
                    name: name.clone(),
                    state: FileState::Published,
                    own_stamp: None,
                },
            );
        }
        if !initial {
            // Forget other engines' files that disappeared.
            st.index.retain(|k, e| {
                e.own_stamp.is_some() || e.state == FileState::Writing || seen.contains(k)
            });
        }
        st.last_scan = Some(Instant::now());
    }

    /// The key in the header of the hashed-name file `name` of `shard` (and its `fstat`), if it
    /// is a trusted regular file of this layout and rank.
    fn read_header_key(
        &self,
        shard: &std::os::fd::OwnedFd,
        name: &str,
        full: &str,
    ) -> Option<(Vec<u8>, io::Stat)> {
        let c = io::cname(name).ok()?;
        let f = match io::open_at(shard.as_fd(), &c, libc::O_RDONLY) {
            Ok(f) => f,
            Err(e) => {
                if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENXIO)) {
                    let ino = io::stat_at(shard.as_fd(), &c).map_or(0, |s| s.ino);
                    self.reject(full, ino, &e.to_string());
                }
                return None;
            }
        };
        let st = io::fstat(f.as_fd()).ok()?;
        if let Err(why) = self.trust.file(&st) {
            self.reject(full, st.ino, &why);
            return None;
        }
        let mut b = vec![0u8; HEADER_BYTES];
        io::read_full(&f, &mut b).ok()?;
        let h = format::decode(&b).ok()?;
        (h.fingerprint == self.fingerprint && h.rank == self.rank).then_some((h.key, st))
    }

    fn run_write(
        &self,
        key: &ByteKey,
        block: BlockId,
        name: &str,
        reuse: Option<&str>,
        buf: &mut AlignedBuf,
    ) {
        let t0 = Instant::now();
        let flen = usize::try_from(self.file_len).unwrap_or(usize::MAX);
        let release = || {
            lock(&self.state).completions.push(Completion::Released {
                key: key.clone(),
                block,
            });
        };
        // Straight from host memory when it is aligned for `O_DIRECT` (the block stays pinned
        // until the write is done); else copy it into the buffer and release it at once.
        let in_place = if self.direct {
            self.memory.payload_sum(block)
        } else {
            None
        };
        let zero_copy = in_place.is_some();
        let sum = if let Some(r) = in_place {
            r.map_err(|e| e.to_string())
        } else {
            let b = buf.as_mut_slice();
            let r = self
                .memory
                .copy_out(block, &mut b[HEADER_BYTES..HEADER_BYTES + self.payload_len]);
            // The host block is free again whatever happens next.
            release();
            r.map_err(|e| e.to_string()).map(|()| {
                b[HEADER_BYTES + self.payload_len..flen].fill(0);
                format::payload_sum(&b[HEADER_BYTES..HEADER_BYTES + self.payload_len])
            })
        };
        let result = sum.and_then(|sum| {
            let b = buf.as_mut_slice();
            let mut h = self.expect_header(key);
            h.payload_sum = sum;
            if !format::encode(&h, b) {
                return Err(format!(
                    "key of {} bytes is too long for the file header",
                    h.key.len()
                ));
            }
            let n = self.tmp_seq.fetch_add(1, Relaxed);
            let path = || self.ns_dir.join(name).display().to_string();
            let (shard, fname) = split_name(name);
            let tmp = io::cname(&format!(
                ".tmp.{}.{}.{n}",
                self.host_tag,
                std::process::id()
            ))
            .map_err(|e| format!("writing {}: {e}", path()))?;
            let dst = io::cname(fname).map_err(|e| format!("writing {}: {e}", path()))?;
            let dir = self
                .open_shard(shard, true)
                .map_err(|e| format!("writing {}: {e}", path()))?;
            // The evicted file to overwrite, in its own shard directory.
            let old = reuse.and_then(|r| {
                let (rs, rf) = split_name(r);
                let fd = self.open_shard(rs, false).ok()?;
                Some((fd, io::cname(rf).ok()?, r))
            });
            let image: &[u8] = b;
            let mut write = |f: &std::fs::File| -> std::io::Result<()> {
                if zero_copy {
                    self.memory
                        .write_file_from(block, f, &image[..HEADER_BYTES])
                        .unwrap_or_else(|| Err(std::io::Error::other("direct write not supported")))
                } else {
                    std::os::unix::fs::FileExt::write_all_at(f, &image[..flen], 0)
                }
            };
            let foreign = io::publish(
                dir.as_fd(),
                &tmp,
                &dst,
                self.file_len,
                &mut write,
                old.as_ref().map(|(fd, c, _)| io::Reuse {
                    dir: fd.as_fd(),
                    name: c,
                }),
                io::PublishOpts {
                    direct: self.direct,
                    fsync: self.fsync,
                    mode: self.file_mode,
                },
            )
            .map_err(|e| format!("writing {}: {e}", path()))?;
            if foreign {
                if let Some((_, _, r)) = &old {
                    self.reject(
                        r,
                        0,
                        "not a single-link regular file of this user; not overwritten",
                    );
                }
            }
            Ok(())
        });
        if zero_copy {
            release();
        }
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let mut st = lock(&self.state);
        st.running_writes = st.running_writes.saturating_sub(1);
        match result {
            Ok(()) => {
                self.counters.files_written.fetch_add(1, Relaxed);
                self.counters
                    .bytes_written
                    .fetch_add(self.payload_len as u64, Relaxed);
                self.counters.write_ns.fetch_add(ns, Relaxed);
                match st.index.get_mut(key) {
                    Some(e) if e.state == FileState::Writing => e.state = FileState::Published,
                    // Forgotten meanwhile (reset of the index): do not leave an unaccounted file.
                    _ => st.unlinks.push_back(Job::Unlink { name: name.into() }),
                }
            }
            Err(msg) => {
                self.counters.write_errors.fetch_add(1, Relaxed);
                st.last_error = Some(msg);
                if let Some(e) = st.index.remove(key) {
                    if let Some(s) = e.own_stamp {
                        st.own_lru.remove(&s);
                        st.own_bytes = st.own_bytes.saturating_sub(self.file_len);
                    }
                }
            }
        }
        drop(st);
        // A writer slot is free: wake a thread that may be waiting for one.
        self.cv.notify_one();
    }

    fn run_read(&self, key: &ByteKey, block: BlockId, name: &str, buf: &mut AlignedBuf) {
        enum Outcome {
            Ok,
            Missing(String),
            Corrupt,
            /// Not a trusted regular file: `(inode, why)`.
            Rejected(u64, String),
        }
        let t0 = Instant::now();
        let path = self.ns_dir.join(name);
        let flen = usize::try_from(self.file_len).unwrap_or(usize::MAX);
        let (sname, fname) = split_name(name);
        let shard = self.open_shard(sname, false);
        let opened = shard
            .as_ref()
            .map_err(|e| std::io::Error::new(e.kind(), e.to_string()))
            .and_then(|d| {
                let c = io::cname(fname)?;
                let flags = if self.direct {
                    libc::O_RDONLY | libc::O_DIRECT
                } else {
                    libc::O_RDONLY
                };
                match io::open_at(d.as_fd(), &c, flags) {
                    Ok(f) => {
                        let st = io::fstat(f.as_fd())?;
                        Ok(Ok((f, st)))
                    }
                    // A link, a FIFO, a socket at the file's name (`ELOOP`, `ENXIO`, `EINVAL` for
                    // `O_DIRECT`, ...): say so rather than "missing".
                    Err(e) => match io::stat_at(d.as_fd(), &c) {
                        Ok(st) => match self.trust.file(&st) {
                            Err(why) => Ok(Err((st.ino, why))),
                            Ok(()) => Err(e),
                        },
                        Err(_) => Err(e),
                    },
                }
            });
        let outcome = match opened {
            Err(e) => Outcome::Missing(format!("opening {}: {e}", path.display())),
            Ok(Err((ino, why))) => Outcome::Rejected(ino, why),
            Ok(Ok((_, st))) if self.trust.file(&st).is_err() => {
                Outcome::Rejected(st.ino, self.trust.file(&st).err().unwrap_or_default())
            }
            Ok(Ok((f, st))) => {
                // A longer file is not ours either.
                let longer = st.size != self.file_len;
                let expect = self.expect_header(key);
                let direct_read = if self.direct && !longer {
                    self.memory
                        .read_file_into(block, &f, &mut buf.as_mut_slice()[..HEADER_BYTES])
                } else {
                    None
                };
                match direct_read {
                    // Straight into the (pending) host block: check header and checksum there.
                    Some(Ok(sum)) => {
                        match format::verify_header(&buf.as_slice()[..HEADER_BYTES], &expect) {
                            Ok(h) if h.payload_sum == sum => Outcome::Ok,
                            _ => Outcome::Corrupt,
                        }
                    }
                    Some(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        Outcome::Corrupt
                    }
                    Some(Err(e)) => Outcome::Missing(format!("reading {}: {e}", path.display())),
                    None => match io::read_full(&f, &mut buf.as_mut_slice()[..flen]) {
                        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Outcome::Corrupt,
                        Err(e) => Outcome::Missing(format!("reading {}: {e}", path.display())),
                        Ok(()) => match format::verify(&buf.as_slice()[..flen], &expect) {
                            Ok(payload) if !longer => match self.memory.copy_in(block, payload) {
                                Ok(()) => Outcome::Ok,
                                Err(e) => Outcome::Missing(e.to_string()),
                            },
                            _ => Outcome::Corrupt,
                        },
                    },
                }
            }
        };
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let ok = matches!(outcome, Outcome::Ok);
        let outcome_note = match &outcome {
            Outcome::Rejected(ino, why) => Outcome::Rejected(*ino, why.clone()),
            _ => Outcome::Ok,
        };
        let mut st = lock(&self.state);
        st.running_reads = st.running_reads.saturating_sub(1);
        match outcome {
            Outcome::Ok => {
                self.counters.promotions.fetch_add(1, Relaxed);
                self.counters
                    .bytes_read
                    .fetch_add(self.payload_len as u64, Relaxed);
                self.counters.read_ns.fetch_add(ns, Relaxed);
            }
            Outcome::Missing(msg) => {
                self.counters.read_errors.fetch_add(1, Relaxed);
                st.last_error = Some(msg);
                Self::forget(&mut st, key, self.file_len);
            }
            Outcome::Corrupt => {
                self.counters.corrupt_files.fetch_add(1, Relaxed);
                st.last_error = Some(format!("corrupt file {} removed", path.display()));
                Self::forget(&mut st, key, self.file_len);
                if let (Ok(d), Ok(c)) = (&shard, io::cname(fname)) {
                    let _ = io::unlink_at(d.as_fd(), &c);
                }
            }
            Outcome::Rejected(..) => {
                Self::forget(&mut st, key, self.file_len);
            }
        }
        st.completions.push(Completion::Promoted {
            key: key.clone(),
            block,
            ok,
        });
        drop(st);
        if let Outcome::Rejected(ino, why) = &outcome_note {
            self.reject(name, *ino, why);
        }
    }

    fn forget(st: &mut State, key: &ByteKey, file_len: u64) {
        if st
            .index
            .get(key)
            .is_some_and(|e| e.state == FileState::Published)
        {
            if let Some(e) = st.index.remove(key) {
                if let Some(s) = e.own_stamp {
                    st.own_lru.remove(&s);
                    st.own_bytes = st.own_bytes.saturating_sub(file_len);
                }
            }
        }
    }

    fn worker(self: &Arc<Self>, mut buf: AlignedBuf) {
        loop {
            let mut st = lock(&self.state);
            let job = loop {
                if let Some(j) = st.unlinks.pop_front() {
                    break Some(j);
                }
                if let Some(j) = st.reads.pop_front() {
                    st.running_reads += 1;
                    break Some(j);
                }
                if st.running_writes < self.write_threads {
                    if let Some(j) = st.writes.pop_front() {
                        st.running_writes += 1;
                        break Some(j);
                    }
                }
                if st.shutdown {
                    break None;
                }
                if let Some(iv) = self.rescan_interval {
                    let due = st.last_scan.is_none_or(|t| t.elapsed() >= iv);
                    if due && !st.scanning {
                        st.scanning = true;
                        drop(st);
                        self.scan(false);
                        st = lock(&self.state);
                        st.scanning = false;
                        continue;
                    }
                    let wait = st
                        .last_scan
                        .map_or(iv, |t| iv.saturating_sub(t.elapsed()))
                        .max(Duration::from_millis(1));
                    st = self
                        .cv
                        .wait_timeout(st, wait)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                } else {
                    st = self.cv.wait(st).unwrap_or_else(PoisonError::into_inner);
                }
            };
            drop(st);
            match job {
                None => return,
                Some(Job::Unlink { name }) => {
                    let (sname, fname) = split_name(&name);
                    if let (Ok(d), Ok(c)) = (self.open_shard(sname, false), io::cname(fname)) {
                        let _ = io::unlink_at(d.as_fd(), &c);
                    }
                }
                Some(Job::Write {
                    key,
                    block,
                    name,
                    reuse,
                }) => self.run_write(&key, block, &name, reuse.as_deref(), &mut buf),
                Some(Job::Read { key, block, name }) => self.run_read(&key, block, &name, &mut buf),
            }
        }
    }
}

impl FileTier {
    /// Opens (creating if needed) the tier's directory, probes `O_DIRECT`, indexes the files there
    /// and starts the I/O threads. Blocks of `memory` are the payloads.
    ///
    /// # Errors
    /// [`KvoffError::Config`] when the directory cannot be created, is not a directory or is not
    /// writable, or `O_DIRECT` was required and is refused; [`KvoffError::InvalidArgument`] for zero
    /// I/O threads, a zero block size or a zero world size.
    #[allow(clippy::too_many_lines, clippy::needless_pass_by_value)] // one linear start-up sequence
    pub fn open(cfg: TierConfig, memory: Arc<dyn BlockMemory>) -> Result<Self> {
        if cfg.io_threads == 0 || cfg.io_threads > 256 {
            return Err(KvoffError::arg(format!(
                "io_threads must be in 1..=256, got {}",
                cfg.io_threads
            )));
        }
        let payload_len = memory.block_bytes();
        if payload_len == 0 {
            return Err(KvoffError::arg(
                "the disk tier needs blocks of at least one byte",
            ));
        }
        let lay = &cfg.layout;
        if lay.world_size == 0 || lay.rank >= lay.world_size {
            return Err(KvoffError::arg(format!(
                "rank {} out of range for world_size {}",
                lay.rank, lay.world_size
            )));
        }
        let fingerprint = lay.fingerprint(payload_len as u64);
        let mut uids = vec![io::euid()];
        uids.extend(cfg.trusted_uids.iter().copied());
        let trust = Trust {
            uids,
            gid: cfg.trusted_gid,
            allow_writable_dir: cfg.allow_writable_dir,
        };
        let ns_name = format!("kvoff-{fingerprint:016x}");
        let ns_dir = cfg.dir.join(&ns_name);
        // `disk_path` is the user's (links in it are followed); nothing below it is.
        std::fs::create_dir_all(&cfg.dir).map_err(|e| config_err("cannot create", &cfg.dir, &e))?;
        let top =
            io::open_dir_path(&cfg.dir).map_err(|e| config_err("cannot open", &cfg.dir, &e))?;
        let top_st = io::fstat(top.as_fd()).map_err(|e| config_err("cannot open", &cfg.dir, &e))?;
        trust
            .dir_writers(&top_st)
            .map_err(|why| untrusted_dir(&cfg.dir, &why))?;
        let ns_c = io::cname(&ns_name).map_err(|e| config_err("cannot create", &ns_dir, &e))?;
        io::mkdir_at(top.as_fd(), &ns_c).map_err(|e| config_err("cannot create", &ns_dir, &e))?;
        let dir_fd = io::open_dir_at(top.as_fd(), &ns_c).map_err(|e| {
            if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) {
                untrusted_dir(&ns_dir, "not a directory (a symbolic link or another file)")
            } else {
                config_err("cannot open", &ns_dir, &e)
            }
        })?;
        drop(top);
        let ns_st =
            io::fstat(dir_fd.as_fd()).map_err(|e| config_err("cannot open", &ns_dir, &e))?;
        trust
            .dir(&ns_st)
            .map_err(|why| untrusted_dir(&ns_dir, &why))?;
        for i in 0..=255u8 {
            let name = format!("{i:02x}");
            let d = ns_dir.join(&name);
            let c = io::cname(&name).map_err(|e| config_err("cannot create", &d, &e))?;
            io::mkdir_at(dir_fd.as_fd(), &c).map_err(|e| config_err("cannot create", &d, &e))?;
            let fd = io::open_dir_at(dir_fd.as_fd(), &c).map_err(|e| {
                if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) {
                    untrusted_dir(&d, "not a directory (a symbolic link or another file)")
                } else {
                    config_err("cannot open", &d, &e)
                }
            })?;
            let st = io::fstat(fd.as_fd()).map_err(|e| config_err("cannot open", &d, &e))?;
            trust.dir(&st).map_err(|why| untrusted_dir(&d, &why))?;
        }
        let host_tag = host_name();
        let probe = io::cname(&format!(".tmp.{host_tag}.{}.probe", std::process::id()))
            .map_err(|e| config_err("cannot write to", &ns_dir, &e))?;
        let direct_ok = io::probe_direct(dir_fd.as_fd(), &probe)
            .map_err(|e| config_err("cannot write to", &ns_dir, &e))?;
        let direct = match cfg.direct_io {
            DirectIo::Auto => direct_ok,
            DirectIo::Off => false,
            DirectIo::On if direct_ok => true,
            DirectIo::On => {
                return Err(KvoffError::Config(format!(
                    "disk tier: the filesystem of {} refuses O_DIRECT; use direct_io auto or off",
                    ns_dir.display()
                )))
            }
        };
        let owner_str = cfg
            .owner
            .clone()
            .unwrap_or_else(|| format!("{}|{}|{host_tag}", lay.namespace, lay.rank));
        let owner = xxh3_64(owner_str.as_bytes());
        let shared = Arc::new(Shared {
            ns_dir,
            dir_fd,
            trust,
            fingerprint,
            rank: lay.rank,
            world_size: lay.world_size,
            owner,
            owner_hex: format!("{owner:016x}"),
            host_tag,
            payload_len,
            file_len: file_len(payload_len as u64),
            capacity_bytes: cfg.capacity_bytes,
            max_queued_writes: cfg.max_queued_writes,
            write_threads: cfg.write_threads.clamp(1, cfg.io_threads) as u64,
            fsync: cfg.fsync,
            direct,
            file_mode: cfg.file_mode,
            rescan_interval: cfg.rescan_interval,
            memory,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            counters: Counters::default(),
            tmp_seq: AtomicU64::new(0),
            pid: std::process::id(),
        });
        shared.scan(true);
        // Enforce the capacity over the adopted files (e.g. after the capacity was lowered).
        {
            let mut st = lock(&shared.state);
            while st.own_bytes > shared.capacity_bytes {
                let Some(name) = Self::evict_one(&shared, &mut st) else {
                    break;
                };
                st.unlinks.push_back(Job::Unlink { name });
            }
        }
        let mut threads = Vec::with_capacity(cfg.io_threads);
        for i in 0..cfg.io_threads {
            let s = Arc::clone(&shared);
            // Allocated (and its pages touched) here, so that the first writes do not pay for it.
            let buf = AlignedBuf::new(usize::try_from(shared.file_len).unwrap_or(0));
            let t = std::thread::Builder::new()
                .name(format!("kvoff-disk-{i}"))
                .spawn(move || {
                    crate::affinity::place_current_thread();
                    s.worker(buf);
                });
            match t {
                Ok(t) => threads.push(t),
                Err(e) => {
                    let mut tier = Self { shared, threads };
                    tier.shutdown();
                    return Err(KvoffError::Config(format!(
                        "disk tier: cannot start I/O thread: {e}"
                    )));
                }
            }
        }
        let tier = Self { shared, threads };
        tier.shared.cv.notify_all();
        Ok(tier)
    }

    /// Whether this is a `fork()`ed copy of the tier (no I/O threads here: submissions are refused,
    /// `flush` returns at once, `shutdown` only marks it shut).
    #[must_use]
    pub fn forked(&self) -> bool {
        std::process::id() != self.shared.pid
    }

    /// The directory holding this layout's files.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.shared.ns_dir
    }

    /// Bytes of one file (header + padded payload).
    #[must_use]
    pub fn file_len(&self) -> u64 {
        self.shared.file_len
    }

    /// Whether `O_DIRECT` is in use.
    #[must_use]
    pub fn direct_io(&self) -> bool {
        self.shared.direct
    }

    /// Path of `key`'s file as this instance would write it (for tests and tools).
    #[must_use]
    pub fn path_of(&self, key: &ByteKey) -> PathBuf {
        let st = lock(&self.shared.state);
        let name = st
            .index
            .get(key)
            .map_or_else(|| self.shared.file_name(key), |e| e.name.clone());
        self.shared.ns_dir.join(OsStr::new(&*name))
    }

    /// Whether a published file for `key` is indexed (no I/O).
    #[must_use]
    pub fn contains(&self, key: &ByteKey) -> bool {
        lock(&self.shared.state)
            .index
            .get(key)
            .is_some_and(|e| e.state == FileState::Published)
    }

    /// Whether `key` has a file, published or being written (no I/O).
    #[must_use]
    pub fn has_or_writing(&self, key: &ByteKey) -> bool {
        lock(&self.shared.state).index.contains_key(key)
    }

    /// Drops the least-recently-used own file from the index and the byte count; returns its name
    /// (the caller removes or reuses the file).
    fn evict_one(shared: &Shared, st: &mut State) -> Option<Box<str>> {
        // Files still being written are skipped (they are the most recent anyway).
        let index = &st.index;
        let stamp = st
            .own_lru
            .iter()
            .find(|(_, k)| {
                index
                    .get(*k)
                    .is_some_and(|e| e.state == FileState::Published)
            })
            .map(|(s, _)| *s)?;
        let key = st.own_lru.remove(&stamp)?;
        st.own_bytes = st.own_bytes.saturating_sub(shared.file_len);
        shared.counters.evicted_files.fetch_add(1, Relaxed);
        st.index.remove(&key).map(|e| e.name)
    }

    /// Queues a write of host block `block` as `key`'s file. Returns `false` (queuing nothing) when
    /// the key already has a file, the write queue is full, or the capacity cannot hold the file
    /// (the last two are counted in [`TierStats::writes_dropped`]). After `true`, the block must
    /// stay unchanged until [`Completion::Released`] for it comes out of [`FileTier::poll`]. Own
    /// least-recently-used files are removed to make room. No I/O on the caller's thread.
    #[must_use]
    pub fn submit_write(&self, key: &ByteKey, block: BlockId) -> bool {
        let sh = &self.shared;
        if self.forked() {
            return false;
        }
        let mut st = lock(&sh.state);
        if st.shutdown || st.index.contains_key(key) {
            return false;
        }
        if st.writes.len() + usize::try_from(st.running_writes).unwrap_or(usize::MAX)
            >= sh.max_queued_writes
            || sh.file_len > sh.capacity_bytes
        {
            sh.counters.writes_dropped.fetch_add(1, Relaxed);
            return false;
        }
        // Make room by evicting own LRU files; the last victim's file is overwritten by this write.
        let mut reuse = None;
        while st.own_bytes + sh.file_len > sh.capacity_bytes {
            let Some(name) = Self::evict_one(sh, &mut st) else {
                // Only files being written are left: they cannot be removed yet.
                sh.counters.writes_dropped.fetch_add(1, Relaxed);
                if let Some(name) = reuse.take() {
                    st.unlinks.push_back(Job::Unlink { name });
                }
                sh.cv.notify_one();
                return false;
            };
            if let Some(prev) = reuse.replace(name) {
                st.unlinks.push_back(Job::Unlink { name: prev });
            }
        }
        st.stamp += 1;
        let stamp = st.stamp;
        st.own_lru.insert(stamp, key.clone());
        st.own_bytes += sh.file_len;
        let name = sh.file_name(key);
        st.index.insert(
            key.clone(),
            Entry {
                name: name.clone(),
                state: FileState::Writing,
                own_stamp: Some(stamp),
            },
        );
        st.writes.push_back(Job::Write {
            key: key.clone(),
            block,
            name,
            reuse,
        });
        drop(st);
        sh.cv.notify_one();
        true
    }

    /// Queues a promotion of `key`'s file into host block `block` (a pending store the caller owns).
    /// Returns `false` when no published file is indexed. The block's bytes are valid once
    /// [`Completion::Promoted`] with `ok` comes out of [`FileTier::poll`]. Refreshes the recency of
    /// an own file. No I/O on the caller's thread.
    #[must_use]
    pub fn submit_read(&self, key: &ByteKey, block: BlockId) -> bool {
        let sh = &self.shared;
        if self.forked() {
            return false;
        }
        let mut st = lock(&sh.state);
        if st.shutdown {
            return false;
        }
        st.stamp += 1;
        let stamp = st.stamp;
        let Some(e) = st.index.get_mut(key) else {
            return false;
        };
        if e.state != FileState::Published {
            return false;
        }
        let name = e.name.clone();
        if let Some(old) = e.own_stamp {
            e.own_stamp = Some(stamp);
            st.own_lru.remove(&old);
            st.own_lru.insert(stamp, key.clone());
        }
        st.reads.push_back(Job::Read {
            key: key.clone(),
            block,
            name,
        });
        drop(st);
        sh.cv.notify_one();
        true
    }

    /// Removes `key`'s file if this instance owns it (queued; no I/O here). Returns whether it did.
    #[must_use]
    pub fn remove_own(&self, key: &ByteKey) -> bool {
        let sh = &self.shared;
        let mut st = lock(&sh.state);
        let owned = st
            .index
            .get(key)
            .is_some_and(|e| e.state == FileState::Published && e.own_stamp.is_some());
        if owned {
            if let Some(e) = st.index.remove(key) {
                if let Some(s) = e.own_stamp {
                    st.own_lru.remove(&s);
                }
                st.own_bytes = st.own_bytes.saturating_sub(sh.file_len);
                st.unlinks.push_back(Job::Unlink { name: e.name });
            }
            drop(st);
            sh.cv.notify_one();
        }
        owned
    }

    /// Takes the finished jobs (never blocks on I/O).
    #[must_use]
    pub fn poll(&self) -> Vec<Completion> {
        std::mem::take(&mut lock(&self.shared.state).completions)
    }

    /// Whether jobs are queued, running or not yet polled.
    #[must_use]
    pub fn busy(&self) -> bool {
        let st = lock(&self.shared.state);
        !(st.reads.is_empty()
            && st.writes.is_empty()
            && st.unlinks.is_empty()
            && st.running_reads == 0
            && st.running_writes == 0
            && st.completions.is_empty())
    }

    /// Lists the directory again now (on the caller's thread: for tests and tools).
    pub fn rescan(&self) {
        self.shared.scan(false);
    }

    /// Blocks until every queued job has run (for tests, tools and shutdown; never call it on a
    /// scheduler thread). Completions stay for [`FileTier::poll`].
    pub fn flush(&self) {
        if self.threads.is_empty() {
            return;
        }
        self.idle_waiter().wait();
    }

    /// A handle that waits for the queued jobs without borrowing the tier (so a caller can wait
    /// without holding the lock that guards the tier).
    #[must_use]
    pub fn idle_waiter(&self) -> IdleWaiter {
        IdleWaiter(Arc::clone(&self.shared))
    }

    /// Counters and gauges.
    #[must_use]
    pub fn stats(&self) -> TierStats {
        let c = &self.shared.counters;
        let st = lock(&self.shared.state);
        #[allow(clippy::cast_precision_loss)]
        let secs = |ns: &AtomicU64| ns.load(Relaxed) as f64 * 1e-9;
        TierStats {
            files_written: c.files_written.load(Relaxed),
            bytes_written: c.bytes_written.load(Relaxed),
            write_seconds: secs(&c.write_ns),
            write_errors: c.write_errors.load(Relaxed),
            writes_dropped: c.writes_dropped.load(Relaxed),
            promotions: c.promotions.load(Relaxed),
            bytes_read: c.bytes_read.load(Relaxed),
            read_seconds: secs(&c.read_ns),
            read_errors: c.read_errors.load(Relaxed),
            corrupt_files: c.corrupt_files.load(Relaxed),
            rejected_files: c.rejected_files.load(Relaxed),
            evicted_files: c.evicted_files.load(Relaxed),
            indexed_files: st
                .index
                .values()
                .filter(|e| e.state == FileState::Published)
                .count() as u64,
            own_files: st.own_lru.len() as u64,
            own_bytes: st.own_bytes,
            queued_reads: st.reads.len() as u64 + st.running_reads,
            queued_writes: st.writes.len() as u64 + st.running_writes,
            direct_io: self.shared.direct,
            last_error: st.last_error.clone(),
        }
    }

    /// Finishes the queued jobs and stops the I/O threads. Idempotent; later submissions return
    /// `false`.
    pub fn shutdown(&mut self) {
        if self.forked() {
            // The I/O threads exist only in the parent: never join (or detach) them here.
            // Nor take a lock: a parent thread may have held it at fork() (docs/spec.md §9).
            for t in self.threads.drain(..) {
                std::mem::forget(t);
            }
            return;
        }
        lock(&self.shared.state).shutdown = true;
        self.shared.cv.notify_all();
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                self.shared.note_error("an I/O thread panicked");
            }
        }
    }
}

impl Drop for FileTier {
    fn drop(&mut self) {
        self.shutdown();
    }
}
