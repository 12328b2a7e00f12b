//! The file tier's settings ([`TierConfig`], [`DirectIo`]) and counters ([`TierStats`]).

use std::path::PathBuf;
use std::time::Duration;

use crate::tier::Layout;
#[cfg(doc)]
use crate::{tier::FileTier, KvoffError};

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
    /// scheduler waits for); clamped to `1..=io_threads` (docs/performance.md "Tier tuning table").
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
