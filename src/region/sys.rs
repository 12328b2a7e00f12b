//! The system calls of host regions, as small checked helpers: open/close/`fstat`/`stat` of
//! files (never following symlinks), the private-file check, `flock`, unlinking a path only if it
//! still names a given file, and shared mappings. Errors are `io::Error`s, or
//! [`KvoffError::Region`] values naming the path.
// Unsafe: libc calls (each block says which obligation it meets).
#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::ptr::NonNull;

use crate::error::{KvoffError, Result};

pub(super) fn os_err(what: &str, path: &Path, e: &io::Error) -> KvoffError {
    KvoffError::region_io(format!("{what} {}: {e}", path.display()), copy_io(e))
}

/// A copy of an I/O error to keep as a source (`io::Error` is not `Clone`).
pub(super) fn copy_io(e: &io::Error) -> io::Error {
    e.raw_os_error().map_or_else(
        || io::Error::new(e.kind(), e.to_string()),
        io::Error::from_raw_os_error,
    )
}

pub(super) fn cpath(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| KvoffError::arg(format!("path {} contains a NUL byte", p.display())))
}

pub(super) fn last_err() -> io::Error {
    io::Error::last_os_error()
}

pub(super) fn open_fd(path: &Path, flags: libc::c_int) -> io::Result<libc::c_int> {
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

pub(super) fn close_fd(fd: libc::c_int) -> io::Result<()> {
    // SAFETY: callers pass a descriptor they own and never use it again.
    if unsafe { libc::close(fd) } != 0 {
        return Err(last_err());
    }
    Ok(())
}

pub(super) fn fstat_id(fd: libc::c_int) -> io::Result<(u64, u64, u64)> {
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
pub(super) fn check_private(fd: libc::c_int, path: &Path) -> Result<()> {
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
pub(super) fn flock_fd(fd: libc::c_int, op: libc::c_int) -> io::Result<bool> {
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

pub(super) fn stat_id(path: &Path) -> io::Result<(u64, u64)> {
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

pub(super) fn unlink_path(path: &Path) -> io::Result<()> {
    std::fs::remove_file(path)
}

/// Unlinks `path` only if it is still the file `(dev, ino)`.
pub(super) fn unlink_if_same(path: &Path, dev: u64, ino: u64) -> io::Result<bool> {
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
pub(super) fn still_named(fd: libc::c_int, path: &Path) -> io::Result<bool> {
    let (dev, ino, _) = fstat_id(fd)?;
    match stat_id(path) {
        Ok((d, i)) => Ok(d == dev && i == ino),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Maps `len` bytes of `fd` shared, read-write.
pub(super) fn map_shared(fd: libc::c_int, len: usize, path: &Path) -> Result<NonNull<u8>> {
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
pub(super) fn unmap(ptr: NonNull<u8>, len: usize) -> io::Result<()> {
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
