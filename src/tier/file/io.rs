//! The file tier's directory I/O: `O_DIRECT` where the filesystem takes it (buffered otherwise),
//! whole-file reads and atomic publication (temporary file, optional `fsync`, `rename`).
//!
//! Every name in the tier's directory is reached relative to a directory descriptor (`openat`,
//! `mkdirat`, `renameat`, `unlinkat`, `fstatat`, `fdopendir`) and never through a symbolic link
//! (`O_NOFOLLOW`, `AT_SYMLINK_NOFOLLOW`); files are opened `O_NONBLOCK` (a FIFO never blocks an
//! open) and judged by `fstat` on the open descriptor (docs/tier.md "Trust").
//!
//! The file tier's only `unsafe` lives here: the libc calls above (the host-memory views with
//! their own `unsafe` are in `tier::memory`).

use std::ffi::{CStr, CString, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::tier::memory::{AlignedBuf, ALIGN};

/// What `fstat`/`fstatat` says about an entry (the fields the trust rule needs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stat {
    /// `st_mode` (type and permission bits).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Number of hard links.
    pub nlink: u64,
    /// Size in bytes.
    pub size: u64,
    /// Device and inode.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
    /// Modification time (seconds since the epoch).
    pub mtime: i64,
}

impl Stat {
    /// A regular file.
    #[must_use]
    pub fn is_file(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFREG
    }
    /// A directory.
    #[must_use]
    pub fn is_dir(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFDIR
    }
}

fn last_err() -> io::Error {
    io::Error::last_os_error()
}

/// `name` as a C string (a NUL inside is `InvalidInput`).
///
/// # Errors
/// `InvalidInput` for a name with a NUL byte.
pub fn cname(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

#[allow(clippy::useless_conversion, clippy::unnecessary_cast)] // field types differ between targets
fn stat_of(st: &libc::stat) -> Stat {
    Stat {
        mode: st.st_mode as u32,
        uid: st.st_uid,
        gid: st.st_gid,
        nlink: u64::from(st.st_nlink),
        size: u64::try_from(st.st_size).unwrap_or(0),
        dev: u64::from(st.st_dev),
        ino: u64::from(st.st_ino),
        mtime: i64::from(st.st_mtime),
    }
}

/// `fstat` of an open descriptor.
///
/// # Errors
/// The OS error.
pub fn fstat(fd: BorrowedFd<'_>) -> io::Result<Stat> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open (borrowed); `st` is valid and writable; fstat only writes into it.
    if unsafe { libc::fstat(fd.as_raw_fd(), &raw mut st) } != 0 {
        return Err(last_err());
    }
    Ok(stat_of(&st))
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`: the entry itself, never what a link points to.
///
/// # Errors
/// The OS error.
pub fn stat_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Stat> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `dir` is an open descriptor, `name` NUL-terminated and `st` writable.
    let r = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &raw mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if r != 0 {
        return Err(last_err());
    }
    Ok(stat_of(&st))
}

/// The effective user id of this process.
#[must_use]
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn own_fd(fd: libc::c_int) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(last_err());
    }
    // SAFETY: `fd` was just returned by a successful open call and is owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

const DIR_FLAGS: libc::c_int =
    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC | libc::O_NONBLOCK;

/// Opens the directory `path` (the user's `disk_path`: links in it are followed, as the user named
/// it).
///
/// # Errors
/// The OS error (`ENOTDIR` for something else than a directory).
pub fn open_dir_path(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `c` is NUL-terminated and outlives the call.
    own_fd(unsafe { libc::open(c.as_ptr(), DIR_FLAGS) })
}

/// Opens the directory `name` inside `dir`, never through a symbolic link (`ELOOP`/`ENOTDIR`).
///
/// # Errors
/// The OS error.
pub fn open_dir_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: `dir` is open, `name` NUL-terminated and outliving the call.
    own_fd(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), DIR_FLAGS | libc::O_NOFOLLOW) })
}

/// Creates the directory `name` inside `dir` (mode 0777 less the umask); `Ok(false)` if something
/// of that name exists.
///
/// # Errors
/// The OS error.
pub fn mkdir_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<bool> {
    // SAFETY: `dir` is open, `name` NUL-terminated.
    if unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o777) } == 0 {
        return Ok(true);
    }
    let e = last_err();
    if e.raw_os_error() == Some(libc::EEXIST) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// Opens the existing file `name` inside `dir` with `flags` (`O_RDONLY` or `O_WRONLY`, maybe
/// `O_DIRECT`) plus `O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC`: a symbolic link is `ELOOP`, a FIFO opens
/// without waiting (and is then refused by the caller's `fstat` check) or is `ENXIO`.
///
/// # Errors
/// The OS error.
pub fn open_at(dir: BorrowedFd<'_>, name: &CStr, flags: libc::c_int) -> io::Result<File> {
    let flags = flags | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    // SAFETY: `dir` is open, `name` NUL-terminated.
    own_fd(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags) }).map(File::from)
}

/// Creates the new file `name` inside `dir` (`O_EXCL`: never an existing entry), write-only.
///
/// # Errors
/// The OS error.
pub fn create_at(dir: BorrowedFd<'_>, name: &CStr, direct: bool, mode: u32) -> io::Result<File> {
    let mut flags = libc::O_WRONLY
        | libc::O_CREAT
        | libc::O_EXCL
        | libc::O_NOFOLLOW
        | libc::O_NONBLOCK
        | libc::O_CLOEXEC;
    if direct {
        flags |= libc::O_DIRECT;
    }
    // SAFETY: `dir` is open, `name` NUL-terminated; the mode is passed as the variadic argument.
    own_fd(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags, mode as libc::c_uint) })
        .map(File::from)
}

/// `renameat`.
///
/// # Errors
/// The OS error.
pub fn rename_at(
    from_dir: BorrowedFd<'_>,
    from: &CStr,
    to_dir: BorrowedFd<'_>,
    to: &CStr,
) -> io::Result<()> {
    // SAFETY: both descriptors are open, both names NUL-terminated.
    let r = unsafe {
        libc::renameat(
            from_dir.as_raw_fd(),
            from.as_ptr(),
            to_dir.as_raw_fd(),
            to.as_ptr(),
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(last_err())
    }
}

/// `unlinkat(dir, name, 0)` (never a directory).
///
/// # Errors
/// The OS error.
pub fn unlink_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    // SAFETY: `dir` is open, `name` NUL-terminated.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) } == 0 {
        Ok(())
    } else {
        Err(last_err())
    }
}

/// One entry of a directory listing.
#[derive(Debug)]
pub struct DirEntry {
    /// The name.
    pub name: OsString,
    /// The inode number.
    pub ino: u64,
    /// `d_type` (`DT_REG`, `DT_DIR`, `DT_FIFO`, `DT_LNK`, …, or `DT_UNKNOWN` where the filesystem
    /// does not say).
    pub kind: u8,
}

/// Lists the directory `dir` (its own open file description, so concurrent listings do not share
/// a position), without `.` and `..`.
///
/// # Errors
/// The OS error.
pub fn list_dir(dir: BorrowedFd<'_>) -> io::Result<Vec<DirEntry>> {
    let fd = open_dir_at(dir, c".")?;
    let raw = fd.as_raw_fd();
    // SAFETY: `raw` is an open directory descriptor; on success fdopendir owns it (closedir below
    // closes it), so `fd` is forgotten without closing.
    let d = unsafe { libc::fdopendir(raw) };
    if d.is_null() {
        return Err(last_err());
    }
    std::mem::forget(fd);
    let mut out = Vec::new();
    loop {
        // SAFETY: `d` is a valid DIR stream until closedir; errno is reset to tell the end of the
        // stream from an error.
        let ent = unsafe {
            *libc::__errno_location() = 0;
            libc::readdir64(d)
        };
        if ent.is_null() {
            // SAFETY: reading errno has no preconditions.
            let errno = unsafe { *libc::__errno_location() };
            // SAFETY: `d` came from fdopendir and is closed once.
            unsafe { libc::closedir(d) };
            if errno != 0 {
                return Err(io::Error::from_raw_os_error(errno));
            }
            return Ok(out);
        }
        // SAFETY: a non-null result points to a dirent valid until the next readdir on `d`;
        // `d_name` is NUL-terminated.
        let (name, ino, kind) = unsafe {
            let e = &*ent;
            (CStr::from_ptr(e.d_name.as_ptr()), e.d_ino, e.d_type)
        };
        let b = name.to_bytes();
        if b == b"." || b == b".." {
            continue;
        }
        out.push(DirEntry {
            name: OsString::from_vec(b.to_vec()),
            ino,
            kind,
        });
    }
}

/// Reads exactly `buf.len()` bytes from offset 0 of `f`. A short file is `UnexpectedEof`.
///
/// # Errors
/// The OS error, or `UnexpectedEof`.
pub fn read_full(f: &File, buf: &mut [u8]) -> io::Result<()> {
    f.read_exact_at(buf, 0)
}

/// How [`publish`] opens and finishes files.
#[derive(Clone, Copy, Debug)]
pub struct PublishOpts {
    /// Open with `O_DIRECT`.
    pub direct: bool,
    /// `fdatasync` before the rename.
    pub fsync: bool,
    /// Mode of new files.
    pub mode: u32,
}

/// An evicted own file [`publish`] may overwrite in place: the directory holding it and its name.
pub struct Reuse<'a> {
    /// Its directory.
    pub dir: BorrowedFd<'a>,
    /// Its name there.
    pub name: &'a CStr,
}

/// Whether an entry may be overwritten in place: a regular file of this user with one link (a hard
/// link would carry the write to the other name, possibly outside the directory).
fn reusable(st: &Stat) -> bool {
    st.is_file() && st.nlink == 1 && st.uid == euid()
}

/// Writes a whole file of `len` bytes (by calling `write` on it) under the temporary name `tmp` in
/// `dir`, optionally `fsync`s it, and renames it to `dst` (in `dir`). With `reuse`, an existing
/// file (an evicted one of the same length) is first renamed to `tmp` and overwritten in place,
/// which spares the filesystem an inode and block allocation per file — only when `fstat` on the
/// opened descriptor says it is a regular file of this user with a single link; anything else
/// found there (a FIFO, a link, a hard-linked file, a directory) is unlinked (never opened for
/// writing, never waited on), counted in the returned flag, and a new file is created. On any
/// failure the temporary file is removed. With `direct`, `write` must write 4 KiB-aligned memory
/// in multiples of 4 KiB.
///
/// Returns whether a foreign entry was found at the reused name.
///
/// # Errors
/// The OS error of the step that failed.
pub fn publish(
    dir: BorrowedFd<'_>,
    tmp: &CStr,
    dst: &CStr,
    len: u64,
    write: &mut dyn FnMut(&File) -> io::Result<()>,
    reuse: Option<Reuse<'_>>,
    opts: PublishOpts,
) -> io::Result<bool> {
    let PublishOpts {
        direct,
        fsync,
        mode,
    } = opts;
    let mut foreign = false;
    let r = (|| {
        let mut reused = None;
        if let Some(old) = reuse {
            match stat_at(old.dir, old.name) {
                Ok(st) if reusable(&st) => {
                    if rename_at(old.dir, old.name, dir, tmp).is_ok() {
                        let mut flags = libc::O_WRONLY;
                        if direct {
                            flags |= libc::O_DIRECT;
                        }
                        // The name may have been swapped between the check and the rename: judge
                        // the opened descriptor again.
                        match open_at(dir, tmp, flags) {
                            Ok(f) if fstat(f.as_fd()).is_ok_and(|st| reusable(&st)) => {
                                reused = Some(f);
                            }
                            _ => {
                                foreign = true;
                                let _ = unlink_at(dir, tmp);
                            }
                        }
                    }
                }
                Ok(st) => {
                    // Not ours to overwrite: drop the name (a directory stays; unlink refuses it).
                    foreign = true;
                    if !st.is_dir() {
                        let _ = unlink_at(old.dir, old.name);
                    }
                }
                Err(_) => {}
            }
        }
        let f = if let Some(f) = reused {
            if f.metadata()?.len() != len {
                f.set_len(len)?;
            }
            f
        } else {
            create_at(dir, tmp, direct, mode)?
        };
        write(&f)?;
        if fsync {
            f.sync_data()?;
        }
        drop(f);
        rename_at(dir, tmp, dir, dst)
    })();
    if r.is_err() {
        let _ = unlink_at(dir, tmp);
    }
    r.map(|()| foreign)
}

/// Whether `dir` accepts `O_DIRECT` writes and reads of 4 KiB (tmpfs does not). Creates and removes
/// the file `probe` (a name inside `dir`).
///
/// # Errors
/// Any error other than `EINVAL` from `O_DIRECT` (the directory is not writable, …).
pub fn probe_direct(dir: BorrowedFd<'_>, probe: &CStr) -> io::Result<bool> {
    let buf = AlignedBuf::new(ALIGN);
    let direct = match create_at(dir, probe, true, 0o600) {
        Ok(f) => {
            let ok = match f.write_all_at(buf.as_slice(), 0) {
                Ok(()) => true,
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => false,
                Err(e) => {
                    drop(f);
                    let _ = unlink_at(dir, probe);
                    return Err(e);
                }
            };
            drop(f);
            ok
        }
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => false,
        Err(e) => return Err(e),
    };
    if !direct {
        // Plain write access still has to work.
        let _ = unlink_at(dir, probe);
        let f = create_at(dir, probe, false, 0o600)?;
        f.write_all_at(buf.as_slice(), 0)?;
    }
    unlink_at(dir, probe)?;
    Ok(direct)
}
