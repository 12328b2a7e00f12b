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
//!
//! Files by concern: this one (the type, private regions, accessors, pinning, closing), `sys` (the
//! system calls as checked helpers), `header` (geometry and the shared file's header words),
//! `shared` (the create/join protocol above), `prefault`, `view` ([`RegionView`], copies in and
//! out of a slot).
// Unsafe: mmap/munmap, flock, fstat and views of the mapping (each block says which obligation it meets).
#![allow(unsafe_code)]

mod header;
mod prefault;
mod shared;
mod sys;
mod view;

use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{KvoffError, Result};
use header::geometry;
use sys::{close_fd, last_err, os_err, unlink_if_same, unmap};
pub use view::RegionView;

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
