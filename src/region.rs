//! Host regions (docs/spec.md §5): one memory mapping holding `num_cpu_blocks` rows; a row is `world_size`
//! slots of `slot_bytes` (slot `r` belongs to rank `r`), then padding to the OS page size.
//!
//! A region is either **private** (anonymous mapping, one process) or **shared by name**: a file
//! `<dir>/<name>` (default `dir` = `/dev/shm`) that the ranks of one engine map together.
//!
//! Shared-region protocol (all ranks call [`HostRegion::create_or_join`]):
//! 0. Trust: region and lock files are opened with `O_NOFOLLOW` (a planted symlink is an error),
//!    created with mode 0600, and used only if they are regular files of this user with no group or
//!    other access (checked with `fstat` on the open descriptor); anything else is a
//!    [`KvoffError::Region`] telling the user to remove it.
//! 1. If `<dir>/<name>` exists and is **alive**, it is complete: **join** it (check geometry, set
//!    this rank's flag in the header page, increment the join counter). Alive means some process
//!    holds a shared `flock` on it: the creator and every rank that joined hold one until they
//!    close the region, and the kernel drops it when a process dies. The probe is a non-blocking
//!    exclusive `flock`: if it is granted, nobody holds the file, which is stale (its engine
//!    crashed before every rank joined): the prober unlinks it (if the name still refers to it)
//!    before releasing it, and the region is created anew. Otherwise the rank waits for its shared
//!    lock and then checks that the name still refers to the file it locked (else it starts over):
//!    see "Liveness" below for why no rank joins a dead creator's region or reuses its bytes.
//!    Recovery after a crash is therefore automatic: restart the ranks.
//! 2. Otherwise try to take the creation lock `<dir>/<name>.lock` (`flock`, non-blocking; the lock
//!    file's inode is re-checked after locking so that it can be unlinked safely). The winner is the
//!    **creator**: it builds the file unnamed (`O_TMPFILE`; fallback: a temporary name, unlinked on
//!    failure), sizes it with `posix_fallocate` (so a full `/dev/shm` fails here, with the size and
//!    path in the error, not later with `SIGBUS`), writes the header, and only then links it to
//!    `<dir>/<name>` and removes the lock. A creator that dies at any point before the link leaves no
//!    region file; its lock is released by the kernel.
//! 3. A process that found the lock held waits (polling) for the file. If the lock is released (or
//!    its holder died) and no file appeared, the creator failed: [`KvoffError::Region`] at once (a
//!    stale lock file is removed). If the file does not appear within the timeout:
//!    [`KvoffError::Region`] naming the path and size.
//! 4. When the last of the `world_size` ranks joins, the file is unlinked if
//!    [`RegionOptions::unlink_when_all_joined`] (default): the mapping lives on, and a crash leaks
//!    nothing. [`HostRegion::unlink`] does it by hand.
//!
//! **Liveness: why no rank joins a dead creator's region** (issue #11 asked for a generation in
//! the header; the locks give the guarantee, and a header counter would add nothing: ranks share
//! only the name, so a rank has no expected generation to compare one with. What tells one
//! creation from the next is the file's identity, `(dev, inode)`, checked below.)
//! - (F1) A name is linked only to a complete file (header written) whose creator holds a shared
//!   lock on it. A creator that dies before the link leaves no name: the `O_TMPFILE` file vanishes
//!   with it (the fallback's temporary name stays behind as garbage; no rank opens it).
//! - (F2) Every member (creator, joined rank, [`attach`](HostRegion::attach)ed observer) holds a
//!   shared lock from before it uses the file until it closes it; the kernel drops it at death.
//!   Only probes take the exclusive lock, and a probe that gets it (no member left) unlinks the
//!   name, if it still refers to that file, before releasing it.
//! - (F3) A rank or observer uses a file only after (i) its probe failed: some process held a lock
//!   at that instant; (ii) its own shared lock was granted; (iii) the name still refers to that
//!   file after (ii).
//!
//! Hence: (a) a file whose members were all gone when a rank probed it is never used: the lock the
//! probe met was another prober's exclusive one, and shared locks are granted only after that
//! prober released it, i.e. after it unlinked the name, so (iii) fails and the rank starts over.
//! (Before (iii) existed, a rank or observer that probed while another rank was removing a stale
//! file waited for its lock and then used the removed file: the dead engine's bytes, apart from
//! the region the other ranks create, which an observer would then never see.) (b) A creator
//! killed while creating leaves no name, so there is nothing to join; a rank waiting for it sees
//! the creation lock released without a name and fails at once ("failed or died"), and the next
//! creator takes the stale lock over. (c) A rank that joined keeps the region alive after its
//! creator dies: a restarted creator then finds its rank's flag set and fails ("already joined")
//! instead of creating a second region beside the live one; once the last member is gone the
//! file is stale and replaced by the next creator. (d) What no check at one instant can exclude:
//! the last members die between a rank's failed probe and the grant of its shared lock
//! (microseconds). The rank then holds a complete region whose engine just died, as if they had
//! died just after it joined. It does not go unnoticed: the dead creator's rank flag is set, so
//! the new engine's rank of that number fails with "already joined" (every rank of an engine
//! joins; `world_size` must match) unless the name was unlinked first, by
//! `unlink_when_all_joined` counting the dead ranks (each rank then works in its own slots, which
//! is all a rank touches) or by an observer that attached before all ranks joined (vLLM's
//! integration attaches after the workers' KV caches are registered, and names each region after
//! its engine's id, a fresh UUID unless configured, so a new engine does not meet an old one's name). Tests: `tests/worker_region.rs`
//! (a creator SIGKILLed inside `posix_fallocate`, a rank that outlives its creator, ranks and
//! observers blocked behind a stale file's removal, stale regions, hostile files).
//!
//! File layout: a header of whole pages (magic, geometry, join counter, one joined flag per rank;
//! all words accessed atomically), then the rows. [`HostRegion::as_ptr`] points at row 0.
//!
//! Invariants: the mapping is valid from construction until [`HostRegion::close`] (or drop), which
//! is idempotent and never panics; every pointer handed out (`as_ptr`, [`RegionView`]) lies inside
//! the mapping; `row_stride_bytes` is a multiple of the OS page size and ≥ `world_size × slot_bytes`;
//! the data area starts on a page boundary.
//!
//! Pinning is delegated to a [`HostRegistrar`] (the CUDA engine implements it with
//! `cuMemHostRegister`): row-aligned pieces of at most [`MAX_REGISTER_PIECE_BYTES`], all or nothing;
//! on failure the region stays usable and unpinned, and [`HostRegion::pin_error`] says why.
// Unsafe: mmap/munmap, flock, fstat and views of the mapping (each block says which obligation it meets).
#![allow(unsafe_code)]

use std::ffi::{CString, OsStr};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{KvoffError, Result};
use crate::plan::TensorDesc;

/// The OS page size in bytes (`sysconf(_SC_PAGESIZE)`; 4096 if that fails).
#[must_use]
pub fn os_page_size() -> u64 {
    // SAFETY: sysconf has no preconditions; it only reads a system constant.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(v).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// Largest piece registered with one [`HostRegistrar::register`] call.
pub const MAX_REGISTER_PIECE_BYTES: u64 = 64 << 30;

/// Registers host memory with a device runtime (page-locking it for DMA). Implemented by the CUDA
/// engine; tests use fakes.
pub trait HostRegistrar: Send + Sync {
    /// Registers `[ptr, ptr+len)`.
    ///
    /// # Errors
    /// Whatever the runtime reports; the region then unregisters the pieces already registered.
    fn register(&self, ptr: u64, len: u64) -> Result<()>;
    /// Unregisters a piece previously registered with exactly these arguments.
    ///
    /// # Errors
    /// Whatever the runtime reports (recorded by the region, never panicked on).
    fn unregister(&self, ptr: u64, len: u64) -> Result<()>;
}

/// Options of a shared region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionOptions {
    /// Directory of the region file (default `/dev/shm`).
    pub dir: PathBuf,
    /// How long a joiner waits for the creator (default 60 s).
    pub timeout: Duration,
    /// Unlink the file once all `world_size` ranks have joined (default true).
    pub unlink_when_all_joined: bool,
    /// Prefault this rank's slots after mapping (default true).
    pub prefault: bool,
}

impl Default for RegionOptions {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("/dev/shm"),
            timeout: Duration::from_secs(60),
            unlink_when_all_joined: true,
            prefault: true,
        }
    }
}

/// A 2-D byte view inside one rank's slot: `rows` rows of `nbytes`, `row_stride_bytes` apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionView {
    /// Address of the view's first byte (row 0).
    pub ptr: u64,
    /// Number of rows (= the region's `num_cpu_blocks`).
    pub rows: u64,
    /// Bytes from one row to the next (= the region's row stride).
    pub row_stride_bytes: u64,
    /// Bytes per row of the view.
    pub nbytes: u64,
}

impl RegionView {
    /// The view as a CPU-side tensor descriptor for [`crate::plan::CopyPlanner`].
    #[must_use]
    pub const fn tensor_desc(&self) -> TensorDesc {
        TensorDesc::new(self.ptr, self.rows, self.row_stride_bytes, self.nbytes)
    }
}

const MAGIC: u64 = u64::from_le_bytes(*b"KVOFFRG1");
const VERSION: u64 = 1;
// Header words (u64 each).
const H_MAGIC: usize = 0;
const H_VERSION: usize = 1;
const H_NUM_CPU_BLOCKS: usize = 2;
const H_SLOT_BYTES: usize = 3;
const H_WORLD_SIZE: usize = 4;
const H_ROW_STRIDE: usize = 5;
const H_HEADER_BYTES: usize = 6;
const H_JOINED: usize = 7;
const H_RANK_FLAGS: usize = 8;

const MADV_POPULATE_WRITE: libc::c_int = 23;

/// State of a region backed by a named file.
#[derive(Debug)]
struct SharedFile {
    fd: libc::c_int,
    path: PathBuf,
    dev: u64,
    ino: u64,
}

/// A host memory region. See the module docs.
pub struct HostRegion {
    /// Start of the mapping (header first for shared regions).
    map_ptr: NonNull<u8>,
    /// Length of the mapping; 0 means nothing is mapped.
    map_len: usize,
    /// Offset of row 0 in the mapping.
    data_offset: usize,
    num_cpu_blocks: u64,
    slot_bytes: u64,
    world_size: u64,
    row_stride_bytes: u64,
    /// `Some(rank)` for a rank of a shared region; `None` for a private region (all slots are ours)
    /// or an observer of a shared one ([`HostRegion::attach`]).
    rank: Option<u64>,
    shared: Option<SharedFile>,
    registrar: Option<Arc<dyn HostRegistrar>>,
    pinned_pieces: Vec<(u64, u64)>,
    pin_error: Option<String>,
    closed: bool,
    close_errors: Vec<String>,
}

impl std::fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegion")
            .field("ptr", &self.as_ptr())
            .field("num_cpu_blocks", &self.num_cpu_blocks)
            .field("slot_bytes", &self.slot_bytes)
            .field("world_size", &self.world_size)
            .field("row_stride_bytes", &self.row_stride_bytes)
            .field("rank", &self.rank)
            .field("path", &self.shared.as_ref().map(|s| &s.path))
            .field("pinned", &self.is_pinned())
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

// SAFETY: the region owns its mapping and file descriptor; nothing in it is tied to a thread. The
// registrar is `Send + Sync` by its trait bound.
unsafe impl Send for HostRegion {}
// SAFETY: `&self` methods only read plain fields or copy out of the mapping through raw pointers
// (`copy_from_slot`); every mutation of the mapping's bytes through this type needs `&mut self`.
unsafe impl Sync for HostRegion {}

struct Geometry {
    row_stride_bytes: u64,
    data_bytes: u64,
}

fn geometry(num_cpu_blocks: u64, slot_bytes: u64, world_size: u64) -> Result<Geometry> {
    if world_size == 0 {
        return Err(KvoffError::arg("world_size must be >= 1, got 0"));
    }
    if slot_bytes == 0 {
        return Err(KvoffError::arg("slot_bytes must be > 0"));
    }
    let page = os_page_size();
    let row_stride_bytes = slot_bytes
        .checked_mul(world_size)
        .and_then(|b| b.checked_next_multiple_of(page))
        .ok_or_else(|| KvoffError::arg("region row size overflows u64"))?;
    let data_bytes = num_cpu_blocks
        .checked_mul(row_stride_bytes)
        .filter(|&b| usize::try_from(b).is_ok() && i64::try_from(b).is_ok())
        .ok_or_else(|| {
            KvoffError::arg(format!(
                "region size overflows: {num_cpu_blocks} rows x {row_stride_bytes} bytes"
            ))
        })?;
    Ok(Geometry {
        row_stride_bytes,
        data_bytes,
    })
}

fn header_bytes(world_size: u64) -> Result<u64> {
    (H_RANK_FLAGS as u64)
        .checked_add(world_size)
        .and_then(|w| w.checked_mul(8))
        .and_then(|b| b.checked_next_multiple_of(os_page_size()))
        .ok_or_else(|| KvoffError::arg("world_size too large"))
}

fn os_err(what: &str, path: &Path, e: &io::Error) -> KvoffError {
    KvoffError::region_io(format!("{what} {}: {e}", path.display()), copy_io(e))
}

/// A copy of an I/O error to keep as a source (`io::Error` is not `Clone`).
fn copy_io(e: &io::Error) -> io::Error {
    e.raw_os_error().map_or_else(
        || io::Error::new(e.kind(), e.to_string()),
        io::Error::from_raw_os_error,
    )
}

fn cpath(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| KvoffError::arg(format!("path {} contains a NUL byte", p.display())))
}

fn last_err() -> io::Error {
    io::Error::last_os_error()
}

fn open_fd(path: &Path, flags: libc::c_int) -> io::Result<libc::c_int> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call; open has no other
    // preconditions.
    // O_NOFOLLOW: a symlink planted at a region or lock path is never followed (ELOOP).
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            flags | libc::O_CLOEXEC | libc::O_NOFOLLOW,
            0o600 as libc::c_uint,
        )
    };
    if fd < 0 {
        Err(last_err())
    } else {
        Ok(fd)
    }
}

fn close_fd(fd: libc::c_int) -> io::Result<()> {
    // SAFETY: callers pass a descriptor they own and never use it again.
    if unsafe { libc::close(fd) } != 0 {
        return Err(last_err());
    }
    Ok(())
}

fn fstat_id(fd: libc::c_int) -> io::Result<(u64, u64, u64)> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable `stat`; fstat only writes into it.
    if unsafe { libc::fstat(fd, &raw mut st) } != 0 {
        return Err(last_err());
    }
    #[allow(clippy::useless_conversion)] // field types differ between targets
    Ok((
        u64::from(st.st_dev),
        u64::from(st.st_ino),
        u64::try_from(st.st_size).unwrap_or(0),
    ))
}

/// A region or lock file may be trusted only if this user owns it and nobody else can open it:
/// another user's file could expose the engine's KV or be truncated under it (SIGBUS).
fn check_private(fd: libc::c_int, path: &Path) -> Result<()> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable `stat`; fstat only writes into it.
    if unsafe { libc::fstat(fd, &raw mut st) } != 0 {
        return Err(os_err("cannot stat", path, &last_err()));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let mode = st.st_mode & 0o7777;
    if st.st_uid != uid || mode & 0o077 != 0 || st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(KvoffError::region(format!(
            "refusing to use {}: it is owned by uid {} with mode {mode:o}, but kvoff's shared \
             region files must be regular files of this user (uid {uid}) with no group or other \
             access; remove it (or use another name/directory)",
            path.display(),
            st.st_uid
        )));
    }
    Ok(())
}

/// `flock(fd, op)`; `Ok(false)` when a non-blocking request would block.
fn flock_fd(fd: libc::c_int, op: libc::c_int) -> io::Result<bool> {
    // SAFETY: callers pass an open descriptor they own; flock has no memory preconditions.
    if unsafe { libc::flock(fd, op) } == 0 {
        return Ok(true);
    }
    let e = last_err();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

fn stat_id(path: &Path) -> io::Result<(u64, u64)> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` writable; stat only writes into `st`.
    if unsafe { libc::stat(c.as_ptr(), &raw mut st) } != 0 {
        return Err(last_err());
    }
    #[allow(clippy::useless_conversion)] // field types differ between targets
    Ok((u64::from(st.st_dev), u64::from(st.st_ino)))
}

fn unlink_path(path: &Path) -> io::Result<()> {
    std::fs::remove_file(path)
}

/// Unlinks `path` only if it is still the file `(dev, ino)`.
fn unlink_if_same(path: &Path, dev: u64, ino: u64) -> io::Result<bool> {
    match stat_id(path) {
        Ok((d, i)) if d == dev && i == ino => unlink_path(path).map(|()| true),
        Ok(_) => Ok(false),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether `path` still names the file open as `fd`. Checked after a shared lock on a region was
/// granted: a process that found the region stale may have held it exclusively (that is what
/// made it look alive to the caller's probe) and removed or replaced it before releasing it.
fn still_named(fd: libc::c_int, path: &Path) -> io::Result<bool> {
    let (dev, ino, _) = fstat_id(fd)?;
    match stat_id(path) {
        Ok((d, i)) => Ok(d == dev && i == ino),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

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

/// Maps `len` bytes of `fd` shared, read-write.
fn map_shared(fd: libc::c_int, len: usize, path: &Path) -> Result<NonNull<u8>> {
    // SAFETY: a fresh mapping chosen by the kernel (addr NULL) aliases no Rust object; `fd` is open.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os_err(
            &format!("cannot map {len} bytes of"),
            path,
            &last_err(),
        ));
    }
    NonNull::new(p.cast::<u8>()).ok_or_else(|| KvoffError::region("mmap returned NULL"))
}

/// Unmaps a mapping made by this module.
fn unmap(ptr: NonNull<u8>, len: usize) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: `ptr..ptr+len` is exactly a mapping made by this module, unmapped only once (callers
    // clear their record of it), and no reference into it outlives the owning region.
    if unsafe { libc::munmap(ptr.as_ptr().cast(), len) } != 0 {
        return Err(last_err());
    }
    Ok(())
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
    /// A private region: an anonymous mapping of `num_cpu_blocks` rows of `world_size` slots of
    /// `slot_bytes`, prefaulted. All slots belong to this process.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] for zero `slot_bytes`/`world_size` or a size that overflows;
    /// [`KvoffError::Region`] when the mapping or prefault fails (e.g. not enough memory).
    pub fn private(num_cpu_blocks: u64, slot_bytes: u64, world_size: u64) -> Result<Self> {
        let geo = geometry(num_cpu_blocks, slot_bytes, world_size)?;
        let len = crate::usize_from(geo.data_bytes); // fits: checked in `geometry`
        let map_ptr = if len == 0 {
            NonNull::dangling()
        } else {
            // SAFETY: a fresh anonymous mapping chosen by the kernel aliases no Rust object.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(KvoffError::region(format!(
                    "cannot map a private region of {len} bytes ({num_cpu_blocks} rows x {} \
                     bytes): {}",
                    geo.row_stride_bytes,
                    last_err()
                )));
            }
            NonNull::new(p.cast::<u8>()).ok_or_else(|| KvoffError::region("mmap returned NULL"))?
        };
        let mut region = Self {
            map_ptr,
            map_len: len,
            data_offset: 0,
            num_cpu_blocks,
            slot_bytes,
            world_size,
            row_stride_bytes: geo.row_stride_bytes,
            rank: None,
            shared: None,
            registrar: None,
            pinned_pieces: Vec::new(),
            pin_error: None,
            closed: false,
            close_errors: Vec::new(),
        };
        region.prefault()?;
        Ok(region)
    }

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

    /// Page-aligned ranges to prefault and the exact byte ranges they stand for.
    fn own_ranges(&self) -> Vec<(usize, usize)> {
        let data = crate::usize_from(self.data_ptr());
        let len = crate::usize_from(self.len_bytes());
        match self.rank {
            Some(r) if self.world_size > 1 => {
                let (slot, stride) = (
                    crate::usize_from(self.slot_bytes),
                    crate::usize_from(self.row_stride_bytes),
                );
                (0..crate::usize_from(self.num_cpu_blocks))
                    .map(|row| {
                        let s = data + row * stride + crate::usize_from(r) * slot;
                        (s, s + slot)
                    })
                    .collect()
            }
            _ if len > 0 => vec![(data, data + len)],
            _ => Vec::new(),
        }
    }

    /// Prefaults this process's slots: `MADV_POPULATE_WRITE` over page-aligned ranges (merged), or,
    /// where the kernel lacks it, reading and writing back one byte per page inside the slots.
    fn prefault(&mut self) -> Result<()> {
        let slots = self.own_ranges();
        if slots.is_empty() {
            return Ok(());
        }
        let page = crate::usize_from(os_page_size());
        let mut merged: Vec<(usize, usize)> = Vec::new();
        for &(s, e) in &slots {
            let (a, b) = (s / page * page, e.div_ceil(page) * page);
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        for (k, &(a, b)) in merged.iter().enumerate() {
            // SAFETY: `[a, b)` lies inside our live mapping (slots are inside the data area, and the
            // data area starts and ends on page boundaries); POPULATE_WRITE does not change contents.
            let rc = unsafe { libc::madvise(a as *mut libc::c_void, b - a, MADV_POPULATE_WRITE) };
            if rc != 0 {
                let e = last_err();
                if k == 0 && e.raw_os_error() == Some(libc::EINVAL) {
                    self.touch_pages(&slots, page);
                    return Ok(());
                }
                return Err(KvoffError::region_io(
                    format!(
                        "cannot prefault {} bytes of host region at {a:#x}: {e}",
                        b - a
                    ),
                    e,
                ));
            }
        }
        Ok(())
    }

    /// Fallback prefault: one read + write-back per page, only at addresses inside our slots.
    #[allow(clippy::unused_self)] // `&mut self`: the mapping must not be shared while touched
    fn touch_pages(&mut self, slots: &[(usize, usize)], page: usize) {
        for &(s, e) in slots {
            let mut addr = s;
            while addr < e {
                let p = addr as *mut u8;
                // SAFETY: `p` is inside one of this process's own slots of the live mapping (no one
                // else writes there), so reading it and writing the same value back is a no-op
                // that faults the page in.
                unsafe { p.write_volatile(p.read_volatile()) };
                addr = (addr / page + 1) * page;
            }
        }
    }

    /// Header word `word` of a shared region's mapping.
    fn hdr(&self, word: usize) -> &AtomicU64 {
        debug_assert!(self.map_len >= self.data_offset && (word + 1) * 8 <= self.data_offset);
        // SAFETY: only called on a shared region while its mapping (header included, page aligned
        // and so 8-aligned) is live; `word` indexes inside the header (`H_RANK_FLAGS + rank`,
        // rank < world_size, fits `header_bytes`); the reference cannot outlive `&self`, and the
        // mapping is only unmapped through `&mut self`.
        #[allow(clippy::cast_ptr_alignment)] // 8-aligned: see the SAFETY comment
        let p = self.map_ptr.as_ptr().cast::<AtomicU64>();
        // SAFETY: as above.
        unsafe { &*p.add(word) }
    }

    fn data_ptr(&self) -> u64 {
        self.map_ptr.as_ptr() as u64 + self.data_offset as u64
    }

    fn check_open(&self) -> Result<()> {
        if self.closed {
            return Err(KvoffError::state("the host region is closed"));
        }
        Ok(())
    }

    /// Address of row 0 (0 after [`HostRegion::close`]).
    #[must_use]
    pub fn as_ptr(&self) -> u64 {
        if self.closed {
            0
        } else {
            self.data_ptr()
        }
    }

    /// Bytes of all rows: `num_cpu_blocks × row_stride_bytes`.
    #[must_use]
    pub fn len_bytes(&self) -> u64 {
        self.num_cpu_blocks * self.row_stride_bytes
    }

    /// Number of rows (CPU blocks).
    #[must_use]
    pub const fn num_cpu_blocks(&self) -> u64 {
        self.num_cpu_blocks
    }

    /// Bytes of one rank's slot in a row.
    #[must_use]
    pub const fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// Number of ranks (slots per row).
    #[must_use]
    pub const fn world_size(&self) -> u64 {
        self.world_size
    }

    /// This process's rank for a shared region; `None` for a private one.
    #[must_use]
    pub const fn rank(&self) -> Option<u64> {
        self.rank
    }

    /// Bytes from one row to the next (a multiple of the OS page size).
    #[must_use]
    pub const fn row_stride_bytes(&self) -> u64 {
        self.row_stride_bytes
    }

    /// Path of the region file (shared regions), whether or not it is still linked.
    #[must_use]
    pub fn path(&self) -> Option<&Path> {
        self.shared.as_ref().map(|s| s.path.as_path())
    }

    /// Whether the region is registered (page-locked) with a device runtime.
    #[must_use]
    pub fn is_pinned(&self) -> bool {
        !self.pinned_pieces.is_empty()
    }

    /// Why the last [`HostRegion::pin`] failed, if it did.
    #[must_use]
    pub fn pin_error(&self) -> Option<&str> {
        self.pin_error.as_deref()
    }

    /// Errors recorded while closing (unregistering, unmapping, closing the file).
    #[must_use]
    pub fn close_errors(&self) -> &[String] {
        &self.close_errors
    }

    /// A view of bytes `offset..offset+nbytes` of `rank`'s slot in every row.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] when `rank ≥ world_size` or the bytes leave the slot;
    /// [`KvoffError::InvalidState`] after close.
    pub fn view(&self, rank: u64, offset: u64, nbytes: u64) -> Result<RegionView> {
        self.check_open()?;
        if rank >= self.world_size {
            return Err(KvoffError::arg(format!(
                "rank {rank} out of range for world_size {}",
                self.world_size
            )));
        }
        if offset
            .checked_add(nbytes)
            .is_none_or(|e| e > self.slot_bytes)
        {
            return Err(KvoffError::arg(format!(
                "view of {nbytes} bytes at offset {offset} does not fit in a slot of {} bytes",
                self.slot_bytes
            )));
        }
        Ok(RegionView {
            ptr: self.data_ptr() + rank * self.slot_bytes + offset,
            rows: self.num_cpu_blocks,
            row_stride_bytes: self.row_stride_bytes,
            nbytes,
        })
    }

    fn slot_range(&self, rank: u64, row: u64, offset: u64, len: usize, write: bool) -> Result<u64> {
        self.check_open()?;
        if write && self.rank.is_some_and(|r| r != rank) {
            return Err(KvoffError::arg(format!(
                "rank {rank}'s slot belongs to another process; this process is rank {}",
                self.rank.unwrap_or(0)
            )));
        }
        let end = offset.checked_add(len as u64);
        if rank >= self.world_size
            || row >= self.num_cpu_blocks
            || end.is_none_or(|e| e > self.slot_bytes)
        {
            return Err(KvoffError::arg(format!(
                "rank {rank}, row {row}, bytes {offset}+{len} is outside the region \
                 ({} ranks, {} rows, slot {} bytes)",
                self.world_size, self.num_cpu_blocks, self.slot_bytes
            )));
        }
        Ok(self.data_ptr() + row * self.row_stride_bytes + rank * self.slot_bytes + offset)
    }

    /// Copies bytes out of `rank`'s slot in `row`, starting at `offset`, into `out`.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] when the bytes are outside the slot;
    /// [`KvoffError::InvalidState`] after close.
    pub fn copy_from_slot(&self, rank: u64, row: u64, offset: u64, out: &mut [u8]) -> Result<()> {
        let src = self.slot_range(rank, row, offset, out.len(), false)?;
        // SAFETY: `src..src+len` lies in the live mapping (checked by `slot_range`); `out` is a
        // distinct Rust buffer, so they do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `data` into `rank`'s slot in `row` at `offset`. A rank of a shared region may write
    /// only its own slot (an observer, any).
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] when the bytes are outside the slot or belong to another
    /// process's rank; [`KvoffError::InvalidState`] after close.
    pub fn copy_to_slot(&mut self, rank: u64, row: u64, offset: u64, data: &[u8]) -> Result<()> {
        let dst = self.slot_range(rank, row, offset, data.len(), true)?;
        // SAFETY: `dst..dst+len` lies in the live, writable mapping inside a slot this process owns
        // (checked by `slot_range`); `data` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len()) };
        Ok(())
    }

    /// Registers all rows with `registrar` in row-aligned pieces of at most
    /// [`MAX_REGISTER_PIECE_BYTES`] (one row per piece if a row is larger). All or nothing: on
    /// failure the pieces already registered are unregistered, the region stays usable and
    /// unpinned, and [`HostRegion::pin_error`] keeps the reason.
    ///
    /// # Errors
    /// The registrar's error; [`KvoffError::InvalidState`] when closed or already pinned.
    pub fn pin(&mut self, registrar: Arc<dyn HostRegistrar>) -> Result<()> {
        self.check_open()?;
        if self.is_pinned() {
            return Err(KvoffError::state("the host region is already pinned"));
        }
        let rows_per_piece = (MAX_REGISTER_PIECE_BYTES / self.row_stride_bytes).max(1);
        let mut done: Vec<(u64, u64)> = Vec::new();
        let mut row = 0;
        while row < self.num_cpu_blocks {
            let rows = rows_per_piece.min(self.num_cpu_blocks - row);
            let piece = (
                self.data_ptr() + row * self.row_stride_bytes,
                rows * self.row_stride_bytes,
            );
            if let Err(e) = registrar.register(piece.0, piece.1) {
                for &(p, l) in done.iter().rev() {
                    if let Err(u) = registrar.unregister(p, l) {
                        self.close_errors
                            .push(format!("unregister after failed pin: {u}"));
                    }
                }
                self.pin_error = Some(format!(
                    "registering {} bytes at {:#x} failed: {e}; the region is usable but not pinned",
                    piece.1, piece.0
                ));
                return Err(e);
            }
            done.push(piece);
            row += rows;
        }
        self.pin_error = None;
        self.pinned_pieces = done;
        self.registrar = Some(registrar);
        Ok(())
    }

    /// Unregisters what [`HostRegion::pin`] registered (no-op when not pinned).
    ///
    /// # Errors
    /// The first unregistration error (all pieces are still attempted; the region counts as
    /// unpinned afterwards).
    pub fn unpin(&mut self) -> Result<()> {
        let pieces = std::mem::take(&mut self.pinned_pieces);
        let Some(reg) = self.registrar.take() else {
            return Ok(());
        };
        let mut first = Ok(());
        for (p, l) in pieces {
            if let Err(e) = reg.unregister(p, l) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    /// Removes the region's file name (if it still names this region's file); the mapping stays.
    /// Returns whether a name was removed. No-op for private regions.
    ///
    /// # Errors
    /// [`KvoffError::Region`] when the file exists but cannot be removed.
    pub fn unlink(&mut self) -> Result<bool> {
        let Some(s) = &self.shared else {
            return Ok(false);
        };
        unlink_if_same(&s.path, s.dev, s.ino).map_err(|e| os_err("cannot unlink", &s.path, &e))
    }

    /// Unpins, unmaps and closes the file. Idempotent; the first error is returned and all are
    /// recorded in [`HostRegion::close_errors`]. Does not unlink a shared region's file.
    ///
    /// # Errors
    /// [`KvoffError::Region`] when unregistering, unmapping or closing failed.
    pub fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        let mut errors = Vec::new();
        if let Err(e) = self.unpin() {
            errors.push(format!("unregister: {e}"));
        }
        if self.map_len != 0 {
            if let Err(e) = unmap(self.map_ptr, self.map_len) {
                errors.push(format!("munmap: {e}"));
            }
            self.map_len = 0;
        }
        if let Some(s) = &self.shared {
            if let Err(e) = close_fd(s.fd) {
                errors.push(format!("close {}: {e}", s.path.display()));
            }
        }
        let first = errors.first().cloned();
        self.close_errors.extend(errors);
        match first {
            None => Ok(()),
            Some(e) => Err(KvoffError::region(format!("closing host region: {e}"))),
        }
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // Errors are recorded in `close_errors`, which dies with the region: nothing to do with them.
        let _ = self.close();
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;

    #[test]
    fn private_region_geometry_and_views() {
        let page = os_page_size();
        let mut r = HostRegion::private(3, 100, 2).unwrap();
        assert_eq!(r.row_stride_bytes(), page);
        assert_eq!(r.len_bytes(), 3 * page);
        assert_eq!(r.as_ptr() % page, 0);
        let v = r.view(1, 10, 90).unwrap();
        assert_eq!(v.ptr, r.as_ptr() + 110);
        assert_eq!((v.rows, v.row_stride_bytes, v.nbytes), (3, page, 90));
        assert!(r.view(2, 0, 1).is_err());
        assert!(r.view(0, 10, 91).is_err());
        r.copy_to_slot(1, 2, 0, &[7; 100]).unwrap();
        let mut out = [0u8; 100];
        r.copy_from_slot(1, 2, 0, &mut out).unwrap();
        assert_eq!(out, [7; 100]);
        r.copy_from_slot(0, 2, 0, &mut out).unwrap();
        assert_eq!(out, [0; 100]);
        assert!(r.copy_from_slot(0, 3, 0, &mut out).is_err());
        r.close().unwrap();
        r.close().unwrap();
        assert!(r.view(0, 0, 1).is_err());
    }

    #[test]
    fn zero_rows_is_fine() {
        let r = HostRegion::private(0, 64, 1).unwrap();
        assert_eq!(r.len_bytes(), 0);
    }

    struct FakeReg {
        fail_at: Option<usize>,
        log: std::sync::Mutex<Vec<(bool, u64, u64)>>,
    }
    impl HostRegistrar for FakeReg {
        fn register(&self, ptr: u64, len: u64) -> Result<()> {
            let mut l = self.log.lock().unwrap();
            if Some(l.iter().filter(|e| e.0).count()) == self.fail_at {
                return Err(KvoffError::cuda("fake failure"));
            }
            l.push((true, ptr, len));
            Ok(())
        }
        fn unregister(&self, ptr: u64, len: u64) -> Result<()> {
            self.log.lock().unwrap().push((false, ptr, len));
            Ok(())
        }
    }

    #[test]
    fn pin_all_or_nothing() {
        let mut r = HostRegion::private(4, 64, 1).unwrap();
        let ok = Arc::new(FakeReg {
            fail_at: None,
            log: std::sync::Mutex::new(Vec::new()),
        });
        r.pin(ok.clone()).unwrap();
        assert!(r.is_pinned());
        r.close().unwrap();
        let log = ok.log.lock().unwrap().clone();
        assert_eq!(
            log,
            vec![
                (true, log[0].1, r.len_bytes()),
                (false, log[0].1, r.len_bytes())
            ]
        );

        let mut r = HostRegion::private(4, 64, 1).unwrap();
        let bad = Arc::new(FakeReg {
            fail_at: Some(0),
            log: std::sync::Mutex::new(Vec::new()),
        });
        assert!(r.pin(bad).is_err());
        assert!(!r.is_pinned());
        assert!(r.pin_error().is_some());
        r.copy_to_slot(0, 3, 0, &[1; 64]).unwrap();
    }
}
