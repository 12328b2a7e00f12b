//! The create/join protocol of shared regions (module docs of [`super`], steps 0–4 and
//! "Liveness"): the creation lock, opening an existing region file and telling whether it is
//! alive, creating and publishing a new one, joining one as a rank, attaching as an observer.
// Unsafe: `posix_fallocate`, `O_TMPFILE` and `linkat`, and the header words of the mapping (each
// block says which obligation it meets).
#![allow(unsafe_code)]

use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::header::{
    geometry, header_bytes, H_HEADER_BYTES, H_JOINED, H_MAGIC, H_NUM_CPU_BLOCKS, H_RANK_FLAGS,
    H_ROW_STRIDE, H_SLOT_BYTES, H_VERSION, H_WORLD_SIZE, MAGIC, VERSION,
};
use super::sys::{
    check_private, close_fd, cpath, flock_fd, fstat_id, last_err, map_shared, open_fd, os_err,
    stat_id, still_named, unlink_if_same, unlink_path, unmap,
};
use super::{os_page_size, HostRegion, RegionOptions, SharedFile};
use crate::error::{KvoffError, Result};

/// The creation lock, held (flock) while a creator builds the region. Dropping it releases it.
struct CreationLock {
    fd: libc::c_int,
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl CreationLock {
    /// Removes the lock file (while still holding the lock), then releases it.
    fn release(self) {
        let _ = unlink_if_same(&self.path, self.dev, self.ino);
        // Drop closes the descriptor, which releases the flock.
    }
}

impl Drop for CreationLock {
    fn drop(&mut self) {
        let _ = close_fd(self.fd);
    }
}

enum LockAttempt {
    Acquired(CreationLock),
    Busy,
    /// The lock file does not exist (only when not creating it).
    Absent,
}

/// Tries to take the creation lock (non-blocking). With `create`, the lock file is created if needed.
fn try_lock(path: &Path, create: bool) -> Result<LockAttempt> {
    loop {
        let flags = libc::O_RDWR | if create { libc::O_CREAT } else { 0 };
        let fd = match open_fd(path, flags) {
            Ok(fd) => fd,
            Err(e) if !create && e.kind() == io::ErrorKind::NotFound => {
                return Ok(LockAttempt::Absent)
            }
            Err(e) => return Err(os_err("cannot open lock file", path, &e)),
        };
        if let Err(e) = check_private(fd, path) {
            let _ = close_fd(fd);
            return Err(e);
        }
        // SAFETY: `fd` is an open descriptor we own.
        if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = last_err();
            let _ = close_fd(fd);
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Ok(LockAttempt::Busy);
            }
            return Err(os_err("cannot lock", path, &e));
        }
        let (dev, ino, _) = fstat_id(fd).map_err(|e| os_err("cannot stat", path, &e))?;
        match stat_id(path) {
            Ok((d, i)) if d == dev && i == ino => {
                return Ok(LockAttempt::Acquired(CreationLock {
                    fd,
                    path: path.to_path_buf(),
                    dev,
                    ino,
                }))
            }
            // The file we locked was unlinked (and maybe replaced) meanwhile: try again.
            Ok(_) => {
                let _ = close_fd(fd);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let _ = close_fd(fd);
                if !create {
                    return Ok(LockAttempt::Absent);
                }
            }
            Err(e) => {
                let _ = close_fd(fd);
                return Err(os_err("cannot stat", path, &e));
            }
        }
    }
}

/// What [`open_existing`] found at a region's path.
enum Existing {
    /// No file.
    Missing,
    /// This user's private region file that nobody holds (its engine is gone); the descriptor
    /// holds the exclusive liveness lock.
    Stale(libc::c_int),
    /// A region file in use; the descriptor holds this process's shared liveness lock.
    Live(libc::c_int),
    /// The file was found stale and removed (or replaced) by another process while this one
    /// waited for its shared lock: not to be used; look again.
    Removed,
}

/// Opens the region file at `path` if there is one, checks that it is this user's private regular
/// file, and tells whether it is alive. Liveness: every process that created, joined or attached
/// to the region holds a shared `flock` on it until it closes the region (the kernel drops it
/// when a process dies), so a file nobody holds belongs to a crashed engine.
fn open_existing(path: &Path) -> Result<Existing> {
    let fd = match open_fd(path, libc::O_RDWR) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Existing::Missing),
        Err(e) => return Err(os_err("cannot open region", path, &e)),
    };
    let live =
        check_private(fd, path).and_then(|()| match flock_fd(fd, libc::LOCK_EX | libc::LOCK_NB) {
            Ok(true) => Ok(false),
            Ok(false) => flock_fd(fd, libc::LOCK_SH)
                .map(|_| true)
                .map_err(|e| os_err("cannot lock", path, &e)),
            Err(e) => Err(os_err("cannot lock", path, &e)),
        });
    // The probe may have failed because a process that found the file stale held it exclusively
    // while removing it: then the name is gone or names another file now, and this one must not
    // be used (module docs, "Liveness").
    let live = live.and_then(|live| {
        if !live {
            return Ok(Some(false));
        }
        still_named(fd, path)
            .map(|named| named.then_some(true))
            .map_err(|e| os_err("cannot stat", path, &e))
    });
    match live {
        Ok(Some(true)) => Ok(Existing::Live(fd)),
        Ok(Some(false)) => Ok(Existing::Stale(fd)),
        Ok(None) => {
            let _ = close_fd(fd);
            Ok(Existing::Removed)
        }
        Err(e) => {
            let _ = close_fd(fd);
            Err(e)
        }
    }
}

fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && !name.contains(['/', '\0'])
        && std::path::Path::new(name)
            .extension()
            .is_none_or(|e| e != "lock");
    if ok {
        Ok(())
    } else {
        Err(KvoffError::arg(format!(
            "invalid region name {name:?}: use 1-200 characters, no '/', not starting with '.', \
             not ending with '.lock'"
        )))
    }
}

impl HostRegion {
    /// Creates or joins the shared region `name` in `/dev/shm` as `rank`, waiting up to `timeout`
    /// for its creator. See [`HostRegion::create_or_join_with`].
    ///
    /// # Errors
    /// As [`HostRegion::create_or_join_with`].
    pub fn create_or_join(
        name: &str,
        num_cpu_blocks: u64,
        slot_bytes: u64,
        world_size: u64,
        rank: u64,
        timeout: Duration,
    ) -> Result<Self> {
        let opts = RegionOptions {
            timeout,
            ..RegionOptions::default()
        };
        Self::create_or_join_with(name, num_cpu_blocks, slot_bytes, world_size, rank, &opts)
    }

    /// Creates or joins the shared region `<opts.dir>/<name>` as `rank` (protocol in the module
    /// docs), then prefaults this rank's slots if `opts.prefault`.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] for a bad name, `rank ≥ world_size`, zero sizes or overflow;
    /// [`KvoffError::Region`] when the file cannot be created or sized (not enough space: the error
    /// names the size in bytes and the path), when the creator failed or died, on timeout, when an
    /// existing file has another geometry, or when this rank (or all ranks) already joined it.
    pub fn create_or_join_with(
        name: &str,
        num_cpu_blocks: u64,
        slot_bytes: u64,
        world_size: u64,
        rank: u64,
        opts: &RegionOptions,
    ) -> Result<Self> {
        check_name(name)?;
        if rank >= world_size {
            return Err(KvoffError::arg(format!(
                "rank {rank} out of range for world_size {world_size}"
            )));
        }
        let geo = geometry(num_cpu_blocks, slot_bytes, world_size)?;
        let hdr = header_bytes(world_size)?;
        let total = hdr
            .checked_add(geo.data_bytes)
            .filter(|&t| usize::try_from(t).is_ok() && i64::try_from(t).is_ok())
            .ok_or_else(|| KvoffError::arg("region size overflows"))?;
        let path = opts.dir.join(name);
        let mut lock_name = OsStr::new(name).to_os_string();
        lock_name.push(".lock");
        let lock_path = opts.dir.join(lock_name);
        let mut region = Self {
            map_ptr: NonNull::dangling(),
            map_len: 0,
            data_offset: crate::usize_from(hdr),
            num_cpu_blocks,
            slot_bytes,
            world_size,
            row_stride_bytes: geo.row_stride_bytes,
            rank: Some(rank),
            shared: None,
            registrar: None,
            pinned_pieces: Vec::new(),
            pin_error: None,
            closed: false,
            close_errors: Vec::new(),
        };
        let deadline = Instant::now() + opts.timeout;
        let mut saw_creator = false;
        let mut backoff = Duration::from_millis(1);
        loop {
            match open_existing(&path)? {
                Existing::Live(fd) => {
                    region.join(fd, &path, total, opts)?;
                    break;
                }
                // A stale file from a crashed engine: removed and the region created anew,
                // never joined with stale bytes.
                Existing::Stale(fd) => {
                    let id = fstat_id(fd);
                    if let Ok((dev, ino, _)) = id {
                        let _ = unlink_if_same(&path, dev, ino);
                    }
                    let _ = close_fd(fd);
                    id.map_err(|e| os_err("cannot stat", &path, &e))?;
                    continue;
                }
                Existing::Removed => continue,
                Existing::Missing => {}
            }
            if saw_creator {
                match try_lock(&lock_path, false)? {
                    LockAttempt::Busy => {}
                    state => {
                        // The creator released its lock: it published the region or gave up
                        // (or died). A lock file left behind is stale: remove it.
                        if let LockAttempt::Acquired(stale) = state {
                            stale.release();
                        }
                        if path.exists() {
                            continue;
                        }
                        return Err(KvoffError::region(format!(
                            "the creator of shared region {} ({total} bytes) failed or died \
                             before the region was ready",
                            path.display()
                        )));
                    }
                }
            } else {
                match try_lock(&lock_path, true)? {
                    LockAttempt::Acquired(lock) => {
                        if path.exists() {
                            lock.release();
                            continue;
                        }
                        let created = region.create(&path, total, opts);
                        lock.release();
                        created?;
                        break;
                    }
                    LockAttempt::Busy | LockAttempt::Absent => saw_creator = true,
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(KvoffError::region(format!(
                    "timed out after {:?} waiting for shared region {} ({total} bytes) to be \
                     created by another rank",
                    opts.timeout,
                    path.display()
                )));
            }
            std::thread::sleep(backoff.min(deadline - now));
            backoff = (backoff * 2).min(Duration::from_millis(20));
        }
        if opts.prefault {
            region.prefault()?;
        }
        Ok(region)
    }

    /// Attaches to the shared region `name` that an engine's ranks created, as an **observer**
    /// (no rank): the process that runs the scheduler maps the rows to move blocks between host
    /// memory and a tier behind it (`kvoff::tier`). The geometry is read from the header; the
    /// observer holds the liveness lock like a rank (the region stays alive while it is attached)
    /// but takes no rank's flag, does not count as joined and does not prefault. Waits up to
    /// `opts.timeout` for the file; a stale file (nobody holds it) is left for the ranks to replace
    /// and waited past. The ranks must not unlink the name before the observer attached
    /// (`unlink_when_all_joined = false`); the observer may then [`unlink`](Self::unlink) it.
    ///
    /// # Errors
    /// [`KvoffError::Region`] when the file does not appear in time, is not this user's private
    /// file, or is not a complete kvoff region.
    pub fn attach(name: &str, opts: &RegionOptions) -> Result<Self> {
        check_name(name)?;
        let path = opts.dir.join(name);
        let deadline = Instant::now() + opts.timeout;
        let mut backoff = Duration::from_millis(1);
        let fd = loop {
            match open_existing(&path)? {
                Existing::Live(fd) => break fd,
                // Nobody holds it: stale; the ranks will replace it.
                Existing::Stale(fd) => {
                    let _ = close_fd(fd);
                }
                Existing::Removed | Existing::Missing => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(KvoffError::region(format!(
                    "timed out after {:?} waiting for shared region {} to be created by the \
                     engine's ranks",
                    opts.timeout,
                    path.display()
                )));
            }
            std::thread::sleep(backoff.min(deadline - now));
            backoff = (backoff * 2).min(Duration::from_millis(20));
        };
        let mut region = Self {
            map_ptr: NonNull::dangling(),
            map_len: 0,
            data_offset: 0,
            num_cpu_blocks: 0,
            slot_bytes: 0,
            world_size: 0,
            row_stride_bytes: 0,
            rank: None,
            shared: None,
            registrar: None,
            pinned_pieces: Vec::new(),
            pin_error: None,
            closed: false,
            close_errors: Vec::new(),
        };
        match region.attach_inner(fd, &path) {
            Ok((dev, ino)) => {
                region.shared = Some(SharedFile { fd, path, dev, ino });
                Ok(region)
            }
            Err(e) => {
                if region.map_len != 0 {
                    let _ = unmap(region.map_ptr, region.map_len);
                    region.map_len = 0;
                }
                region.closed = true;
                let _ = close_fd(fd);
                Err(e)
            }
        }
    }

    /// Maps the whole file and takes the geometry from its header, checking it is consistent.
    fn attach_inner(&mut self, fd: libc::c_int, path: &Path) -> Result<(u64, u64)> {
        let (dev, ino, size) = fstat_id(fd).map_err(|e| os_err("cannot stat", path, &e))?;
        let bad = || {
            KvoffError::region(format!(
                "{} ({size} bytes) is not a complete kvoff shared region; remove it or use another \
                 name",
                path.display()
            ))
        };
        if size < os_page_size() || usize::try_from(size).is_err() || i64::try_from(size).is_err() {
            return Err(bad());
        }
        self.map_ptr = map_shared(fd, crate::usize_from(size), path)?;
        self.map_len = crate::usize_from(size);
        // The header's words are read through `hdr`, which needs `data_offset` ≥ the words read:
        // the first page holds them all (H_RANK_FLAGS + world_size words are checked below).
        self.data_offset = crate::usize_from(os_page_size());
        let w = |i: usize| self.hdr(i).load(Ordering::Acquire);
        if w(H_MAGIC) != MAGIC || w(H_VERSION) != VERSION {
            return Err(bad());
        }
        let (n, slot, ws) = (w(H_NUM_CPU_BLOCKS), w(H_SLOT_BYTES), w(H_WORLD_SIZE));
        let (stride, hdr_bytes) = (w(H_ROW_STRIDE), w(H_HEADER_BYTES));
        let geo = geometry(n, slot, ws).map_err(|_| bad())?;
        let expect_hdr = header_bytes(ws).map_err(|_| bad())?;
        if ws == 0
            || geo.row_stride_bytes != stride
            || expect_hdr != hdr_bytes
            || hdr_bytes.checked_add(geo.data_bytes) != Some(size)
        {
            return Err(bad());
        }
        self.data_offset = crate::usize_from(hdr_bytes);
        self.num_cpu_blocks = n;
        self.slot_bytes = slot;
        self.world_size = ws;
        self.row_stride_bytes = stride;
        Ok((dev, ino))
    }

    /// Creator side: unnamed file, fallocate, map, header, link into place. Leaves no file on error.
    fn create(&mut self, path: &Path, total: u64, opts: &RegionOptions) -> Result<()> {
        let dir = &opts.dir;
        let mut tmp_name: Option<PathBuf> = None;
        let proc_fd = Path::new("/proc/self/fd").is_dir();
        let fd = match open_fd(dir, libc::O_TMPFILE | libc::O_RDWR) {
            Ok(fd) if proc_fd => fd,
            other => {
                if let Ok(fd) = other {
                    let _ = close_fd(fd);
                }
                let mut n = OsStr::new(".").to_os_string();
                n.push(path.file_name().unwrap_or_default());
                n.push(format!(".{}.tmp", std::process::id()));
                let t = dir.join(n);
                let fd = open_fd(&t, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL)
                    .map_err(|e| os_err("cannot create temporary region file", &t, &e))?;
                tmp_name = Some(t);
                fd
            }
        };
        let result = self.build_and_publish(fd, path, tmp_name.as_deref(), total, opts);
        if let Some(t) = &tmp_name {
            let _ = unlink_path(t);
        }
        if result.is_err() {
            if self.map_len != 0 {
                let _ = unmap(self.map_ptr, self.map_len);
                self.map_len = 0;
            }
            let _ = close_fd(fd);
        }
        result
    }

    fn build_and_publish(
        &mut self,
        fd: libc::c_int,
        path: &Path,
        tmp: Option<&Path>,
        total: u64,
        opts: &RegionOptions,
    ) -> Result<()> {
        // Held until the region is closed: tells joiners that this region is alive (see
        // `create_or_join_with`).
        flock_fd(fd, libc::LOCK_SH).map_err(|e| os_err("cannot lock", path, &e))?;
        let len = crate::usize_from(total); // fits: checked by the caller
        let off =
            libc::off_t::try_from(total).map_err(|_| KvoffError::arg("region size overflows"))?;
        // SAFETY: `fd` is an open descriptor we own; posix_fallocate has no memory preconditions.
        let rc = unsafe { libc::posix_fallocate(fd, 0, off) };
        if rc != 0 {
            return Err(KvoffError::region(format!(
                "cannot allocate {total} bytes for shared region {} ({} CPU blocks x {} bytes per \
                 row + header): {}. Free space in {} or lower cpu_bytes_to_use",
                path.display(),
                self.num_cpu_blocks,
                self.row_stride_bytes,
                io::Error::from_raw_os_error(rc),
                opts.dir.display()
            )));
        }
        self.map_ptr = map_shared(fd, len, path)?;
        self.map_len = len;
        let w = |i: usize| self.hdr(i);
        w(H_VERSION).store(VERSION, Ordering::Relaxed);
        w(H_NUM_CPU_BLOCKS).store(self.num_cpu_blocks, Ordering::Relaxed);
        w(H_SLOT_BYTES).store(self.slot_bytes, Ordering::Relaxed);
        w(H_WORLD_SIZE).store(self.world_size, Ordering::Relaxed);
        w(H_ROW_STRIDE).store(self.row_stride_bytes, Ordering::Relaxed);
        w(H_HEADER_BYTES).store(self.data_offset as u64, Ordering::Relaxed);
        let rank = crate::usize_from(self.rank.unwrap_or(0));
        w(H_RANK_FLAGS + rank).store(1, Ordering::Relaxed);
        w(H_JOINED).store(1, Ordering::Relaxed);
        w(H_MAGIC).store(MAGIC, Ordering::Release);
        // Publish: the name appears only now, complete.
        let link_rc = match tmp {
            None => {
                let from = cpath(&PathBuf::from(format!("/proc/self/fd/{fd}")))?;
                let to = cpath(path)?;
                // SAFETY: both are valid NUL-terminated strings that outlive the call.
                unsafe {
                    libc::linkat(
                        libc::AT_FDCWD,
                        from.as_ptr(),
                        libc::AT_FDCWD,
                        to.as_ptr(),
                        libc::AT_SYMLINK_FOLLOW,
                    )
                }
            }
            Some(t) => {
                let (from, to) = (cpath(t)?, cpath(path)?);
                // SAFETY: both are valid NUL-terminated strings that outlive the call.
                unsafe { libc::link(from.as_ptr(), to.as_ptr()) }
            }
        };
        if link_rc != 0 {
            return Err(os_err("cannot publish shared region", path, &last_err()));
        }
        let (dev, ino, _) = fstat_id(fd).map_err(|e| os_err("cannot stat", path, &e))?;
        self.shared = Some(SharedFile {
            fd,
            path: path.to_path_buf(),
            dev,
            ino,
        });
        if self.world_size == 1 && opts.unlink_when_all_joined {
            self.unlink()?;
        }
        Ok(())
    }

    /// Joiner side: check size and header, claim this rank, count the join. Closes `fd` and unmaps
    /// on error.
    fn join(
        &mut self,
        fd: libc::c_int,
        path: &Path,
        total: u64,
        opts: &RegionOptions,
    ) -> Result<()> {
        let r = self.join_inner(fd, path, total);
        match r {
            Ok((dev, ino, joined)) => {
                self.shared = Some(SharedFile {
                    fd,
                    path: path.to_path_buf(),
                    dev,
                    ino,
                });
                if joined >= self.world_size && opts.unlink_when_all_joined {
                    self.unlink()?;
                }
                Ok(())
            }
            Err(e) => {
                if self.map_len != 0 {
                    let _ = unmap(self.map_ptr, self.map_len);
                    self.map_len = 0;
                }
                let _ = close_fd(fd);
                Err(e)
            }
        }
    }

    fn join_inner(&mut self, fd: libc::c_int, path: &Path, total: u64) -> Result<(u64, u64, u64)> {
        let (dev, ino, size) = fstat_id(fd).map_err(|e| os_err("cannot stat", path, &e))?;
        if size != total {
            return Err(KvoffError::region(format!(
                "shared region {} has {size} bytes but {total} were expected for {} CPU blocks x \
                 slot {} bytes x world_size {}: another geometry or a stale file; remove it or use \
                 another name",
                path.display(),
                self.num_cpu_blocks,
                self.slot_bytes,
                self.world_size
            )));
        }
        self.map_ptr = map_shared(fd, crate::usize_from(total), path)?;
        self.map_len = crate::usize_from(total);
        let w = |i: usize| self.hdr(i);
        let header_ok = w(H_MAGIC).load(Ordering::Acquire) == MAGIC
            && w(H_VERSION).load(Ordering::Relaxed) == VERSION
            && w(H_NUM_CPU_BLOCKS).load(Ordering::Relaxed) == self.num_cpu_blocks
            && w(H_SLOT_BYTES).load(Ordering::Relaxed) == self.slot_bytes
            && w(H_WORLD_SIZE).load(Ordering::Relaxed) == self.world_size
            && w(H_ROW_STRIDE).load(Ordering::Relaxed) == self.row_stride_bytes
            && w(H_HEADER_BYTES).load(Ordering::Relaxed) == self.data_offset as u64;
        if !header_ok {
            return Err(KvoffError::region(format!(
                "shared region {} has another geometry or is not a kvoff region (expected {} CPU \
                 blocks, slot {} bytes, world_size {}); remove it or use another name",
                path.display(),
                self.num_cpu_blocks,
                self.slot_bytes,
                self.world_size
            )));
        }
        let rank = self.rank.unwrap_or(0);
        if w(H_RANK_FLAGS + crate::usize_from(rank))
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(KvoffError::region(format!(
                "rank {rank} already joined shared region {}: another process has this rank (an \
                 earlier run whose ranks are still alive holds the region?); stop it, or remove the \
                 file or use another name",
                path.display()
            )));
        }
        let joined = w(H_JOINED).fetch_add(1, Ordering::AcqRel) + 1;
        Ok((dev, ino, joined))
    }
}
