//! Opening a file tier (docs/tier.md "Files", "Trust", "Errors"): the directory checked and
//! created under the trust rules, `O_DIRECT` probed, the owner tag chosen, the I/O threads started
//! and the first scan queued.
#![deny(unsafe_code)]

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex};

use xxhash_rust::xxh3::xxh3_64;

use super::io;
use super::trust::{untrusted_dir, Trust};
use super::{lock, Counters, DirectIo, FileTier, Job, Shared, State, TierConfig};
use crate::error::{KvoffError, Result};
use crate::tier::{file_len, format, AlignedBuf, BlockMemory};

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
        let host_tag = format::host_name();
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
            .unwrap_or_else(|| format::default_owner(lay, &host_tag));
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
}

fn config_err(what: &str, path: &Path, e: &std::io::Error) -> KvoffError {
    KvoffError::Config(format!(
        "disk tier: {what} {}: {e} (set disk_path to a writable directory)",
        path.display()
    ))
}
