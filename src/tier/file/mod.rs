//! The file tier ([`FileTier`]): blocks kept as files in a directory (docs/spec.md §9; the format,
//! I/O, index and error rules are in the [`super`] module docs). This file holds its settings,
//! counters, shared state and the owner-side API (submissions on the caller's thread, never
//! waiting); `jobs` the I/O threads' work (naming, directory scans, writes, reads) and `trust`
//! the trust rules for what is found in a shared directory (docs/tier.md "Trust").
#![deny(unsafe_code)]

pub mod bench;
#[allow(unsafe_code)]
pub(crate) mod io;
mod jobs;
mod trust;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::xxh3_64;

pub use jobs::IdleWaiter;
use trust::{untrusted, untrusted_dir, Trust};

use super::{file_len, AlignedBuf, BlockMemory, Completion, Layout};
use crate::error::{KvoffError, Result};
use crate::key::ByteKey;
use crate::manager::BlockId;

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

pub(crate) fn hex(bytes: &[u8]) -> String {
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

pub(crate) fn host_name() -> String {
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

fn config_err(what: &str, path: &Path, e: &std::io::Error) -> KvoffError {
    KvoffError::Config(format!(
        "disk tier: {what} {}: {e} (set disk_path to a writable directory)",
        path.display()
    ))
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
            idle_cv: Condvar::new(),
            counters: Counters::default(),
            tmp_seq: AtomicU64::new(0),
            pid: crate::process::id(),
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
