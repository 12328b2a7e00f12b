//! The file tier ([`FileTier`], docs/spec.md §9, docs/tier.md): offloaded blocks kept as files in a directory on
//! a local `NVMe` drive or a shared filesystem, persistent across restarts and shared between engines.
//!
//! **Files.** One file per block and rank,
//! `<dir>/kvoff-<layout fingerprint>/<shard>/<key hex>.r<rank>.<owner>.kvb`, where `<shard>` is one of
//! 256 subdirectories chosen by a hash of the key (keys longer than 100 bytes are named by their
//! xxh3-128). Each file is a 4 KiB header (magic, format
//! version, layout fingerprint, rank, world size, payload length, xxh3-64 of the payload, owner tag,
//! the key, a header checksum; see the tier's `format` module) followed by the block's bytes padded to 4 KiB. The
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
//! buffered I/O otherwise. With 4 KiB-aligned host memory ([`RawRows`](crate::tier::RawRows) over a
//! `HostRegion`, [`AlignedRows`](crate::tier::AlignedRows)) a file's header and block move in one `pwritev`/`preadv` straight between the file
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
//! writable is a [`KvoffError::Config`](crate::KvoffError::Config) at [`FileTier::open`]. Every later I/O error (full disk,
//! permissions changed, file vanished) is counted in [`TierStats`], the store is skipped or the
//! promotion fails, and the tier keeps working.
//!
//! **Code.** This file holds the tier's shared state and owner-side API (submissions on the
//! caller's thread, never waiting); `open` the start of a tier, `config` its settings and
//! counters, `jobs` the I/O threads' loop, writes and reads, `scan` the directory's names and
//! scans, `io` the directory I/O, `trust` the trust rules for what is found in a shared directory
//! (docs/tier.md "Trust"), `secondary` its [`SecondaryTier`] implementation and [`bench`](mod@bench) the
//! disk benchmark.
//!
//! [`SecondaryTier`]: crate::tier::secondary::SecondaryTier
//!
//! [`ChainManager`](crate::tier::chain::ChainManager) puts the tier (or several: files, then a remote
//! store) behind an offloading manager (the protocol of docs/spec.md §9, docs/tier.md "Tier chain").
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

pub mod bench;
mod config;
#[allow(unsafe_code)]
pub(crate) mod io;
mod jobs;
mod open;
mod scan;
mod secondary;
mod trust;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use config::{DirectIo, TierConfig, TierStats};

use super::secondary::TierInfo;

/// The file tier's registration (docs/design.md "Recipe: adding a tier").
pub const INFO: TierInfo = TierInfo {
    kind: "disk",
    folder: "file",
    extra_stats: &[
        "rejected_files",
        "evicted_files",
        "indexed_files",
        "own_files",
        "own_bytes",
        "direct_io",
    ],
};
pub use jobs::IdleWaiter;
use trust::{untrusted, Trust};

use super::{BlockMemory, Completion};
use crate::key::ByteKey;
use crate::manager::BlockId;

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
    running_unlinks: u64,
    completions: Vec<Completion>,
    shutdown: bool,
    last_scan: Option<Instant>,
    scanning: bool,
    last_error: Option<String>,
    /// Foreign entries already counted in [`TierStats::rejected_files`]: name → inode.
    rejected: HashMap<Box<str>, u64, foldhash::fast::RandomState>,
}

impl State {
    /// No job queued or running.
    fn idle(&self) -> bool {
        self.reads.is_empty()
            && self.writes.is_empty()
            && self.unlinks.is_empty()
            && self.running_reads == 0
            && self.running_writes == 0
            && self.running_unlinks == 0
    }
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

/// `("ab", "<file>")` of an index name `"ab/<file>"`.
fn split_name(name: &str) -> (&str, &str) {
    name.split_once('/').unwrap_or(("", name))
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
    /// Wakes I/O threads: a job was queued or a writer slot freed, or shutdown.
    cv: Condvar,
    /// Wakes [`IdleWaiter::wait`]: the last queued or running job finished, or shutdown.
    idle_cv: Condvar,
    counters: Counters,
    tmp_seq: AtomicU64,
    /// The process that started the I/O threads (a `fork()`ed child has none of them).
    pid: u32,
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

/// Files are spread over 256 subdirectories `00`..`ff` (by a hash of the key), so that directory
/// locks taken by create and rename are not shared by all I/O threads and directories stay small.
const SHARD_LEN: usize = 2;

fn is_shard(n: &str) -> bool {
    n.len() == SHARD_LEN
        && n.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

impl FileTier {
    /// Whether this is a `fork()`ed copy of the tier (no I/O threads here: submissions are refused,
    /// `flush` returns at once, `shutdown` only marks it shut).
    #[must_use]
    pub fn forked(&self) -> bool {
        crate::process::id() != self.shared.pid
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
        // With every writer slot taken, a writer takes this job when it finishes its own.
        let wake = st.running_writes < sh.write_threads;
        drop(st);
        if wake {
            sh.cv.notify_one();
        }
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
        self.shared.idle_cv.notify_all();
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
