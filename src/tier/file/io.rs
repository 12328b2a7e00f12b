//! File I/O of the tier: 4 KiB-aligned buffers, `O_DIRECT` where the filesystem takes it (buffered
//! otherwise), whole-file reads and atomic publication (temporary file, optional `fsync`, `rename`).
//!
//! Every name in the tier's directory is reached relative to a directory descriptor (`openat`,
//! `mkdirat`, `renameat`, `unlinkat`, `fstatat`, `fdopendir`) and never through a symbolic link
//! (`O_NOFOLLOW`, `AT_SYMLINK_NOFOLLOW`); files are opened `O_NONBLOCK` (a FIFO never blocks an
//! open) and judged by `fstat` on the open descriptor (docs/tier.md "Trust").
//!
//! The only `unsafe` of the tier lives here: viewing an aligned allocation as bytes, the libc calls
//! above, and [`RawRows`], host memory given as a raw pointer by a caller that promises it stays
//! mapped (the Python bindings, which get the pointer of a `HostRegion` view, as the transfer
//! engines do).

use std::ffi::{CStr, CString, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::{KvoffError, Result};
use crate::manager::BlockId;

use crate::tier::BlockMemory;

/// Alignment (and length unit) of every `O_DIRECT` transfer.
pub const ALIGN: usize = 4096;

#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Chunk([u8; ALIGN]);

/// A zero-initialised byte buffer whose start is 4 KiB-aligned and whose length is a multiple of
/// 4 KiB.
pub struct AlignedBuf {
    chunks: Vec<Chunk>,
}

impl AlignedBuf {
    /// A buffer of at least `len` bytes (rounded up to 4 KiB).
    #[must_use]
    pub fn new(len: usize) -> Self {
        Self {
            chunks: vec![Chunk([0; ALIGN]); len.div_ceil(ALIGN)],
        }
    }

    /// Length in bytes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.chunks.len() * ALIGN
    }

    /// `true` for a zero-length buffer.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// The bytes.
    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `Chunk` is `repr(C)` around `[u8; ALIGN]` with size = align = ALIGN, so the Vec's
        // storage is `len()` initialised, contiguous bytes, borrowed immutably through `&self`.
        unsafe { std::slice::from_raw_parts(self.chunks.as_ptr().cast::<u8>(), self.len()) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len();
        // SAFETY: as in `as_slice`; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.chunks.as_mut_ptr().cast::<u8>(), len) }
    }
}

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

/// Host memory given as a raw pointer: `num_rows` rows, `row_stride_bytes` apart, of which the
/// first `block_bytes` of each row are one block. Copies use `memcpy` without locks; the tier's
/// protocol guarantees that no one else writes a block while it is copied out (it is pinned by a
/// load) and no one reads a block while it is copied in (it is a pending store).
#[derive(Debug)]
pub struct RawRows {
    ptr: u64,
    num_rows: u64,
    row_stride_bytes: u64,
    block_bytes: usize,
}

impl RawRows {
    /// Describes host memory at `ptr`.
    ///
    /// # Safety
    /// 1. `ptr .. ptr + (num_rows - 1) * row_stride_bytes + block_bytes` is mapped, readable and
    ///    writable for as long as this value (and every tier using it) lives.
    /// 2. No one else writes a block while the tier copies it out, nor reads or writes a block while
    ///    the tier copies into it (the tiered manager's pins and pending stores guarantee this).
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] for a null pointer, a zero block size, or a block larger
    /// than the row stride.
    pub unsafe fn new(
        ptr: u64,
        num_rows: u64,
        row_stride_bytes: u64,
        block_bytes: usize,
    ) -> Result<Self> {
        if ptr == 0 || block_bytes == 0 || block_bytes as u64 > row_stride_bytes {
            return Err(KvoffError::arg(format!(
                "host rows need a non-null pointer and 0 < block_bytes <= row_stride_bytes \
                 (ptr {ptr:#x}, block_bytes {block_bytes}, row_stride_bytes {row_stride_bytes})"
            )));
        }
        Ok(Self {
            ptr,
            num_rows,
            row_stride_bytes,
            block_bytes,
        })
    }

    fn row_ptr(&self, block: BlockId, len: usize) -> Result<u64> {
        if u64::from(block) >= self.num_rows || len != self.block_bytes {
            return Err(KvoffError::arg(format!(
                "block {block} (of {} rows) with {len} bytes (block is {} bytes)",
                self.num_rows, self.block_bytes
            )));
        }
        Ok(self.ptr + u64::from(block) * self.row_stride_bytes)
    }
}

impl RawRows {
    /// Reads a whole file: `header.len()` bytes into `header`, then the block's bytes straight into
    /// block `block` (one `preadv`), and returns the xxh3-64 of what landed in the block.
    fn read_file(&self, block: BlockId, file: &File, header: &mut [u8]) -> io::Result<u64> {
        let dst = self
            .row_ptr(block, self.block_bytes)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        // SAFETY: obligation 1 (the block's bytes are mapped and writable; `row_ptr` checked the
        // bounds) and 2 (the block is a pending store: no one else reads or writes it while this
        // slice lives, which ends with this function).
        let payload = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, self.block_bytes) };
        let iov = [
            libc::iovec {
                iov_base: header.as_mut_ptr().cast(),
                iov_len: header.len(),
            },
            libc::iovec {
                iov_base: payload.as_mut_ptr().cast(),
                iov_len: payload.len(),
            },
        ];
        // SAFETY: both iovecs describe live, writable, distinct buffers of the given lengths (the
        // header slice and `payload` above); the fd is open for the duration of the call.
        let n = unsafe { libc::preadv(file.as_raw_fd(), iov.as_ptr(), 2, 0) };
        let want = header.len() + payload.len();
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if usize::try_from(n).unwrap_or(0) < want {
            // Short read (end of file, or a signal): read each part again to the end.
            file.read_exact_at(header, 0)?;
            file.read_exact_at(payload, header.len() as u64)?;
        }
        Ok(xxhash_rust::xxh3::xxh3_64(payload))
    }
}

impl RawRows {
    fn aligned(&self, block: BlockId) -> bool {
        (self.ptr + u64::from(block) * self.row_stride_bytes) % ALIGN as u64 == 0
            && self.block_bytes % ALIGN == 0
    }

    fn block_slice(&self, block: BlockId) -> io::Result<&[u8]> {
        let src = self
            .row_ptr(block, self.block_bytes)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        // SAFETY: obligation 1 (mapped; `row_ptr` checked the bounds) and 2 (the block is pinned:
        // no one writes it while the tier reads it, and the slice does not outlive the caller's use
        // within one write job).
        Ok(unsafe { std::slice::from_raw_parts(src as *const u8, self.block_bytes) })
    }

    fn write_file(&self, block: BlockId, file: &File, header: &[u8]) -> io::Result<()> {
        let payload = self.block_slice(block)?;
        let iov = [
            libc::iovec {
                iov_base: header.as_ptr().cast_mut().cast(),
                iov_len: header.len(),
            },
            libc::iovec {
                iov_base: payload.as_ptr().cast_mut().cast(),
                iov_len: payload.len(),
            },
        ];
        // SAFETY: both iovecs describe live buffers of the given lengths that `pwritev` only reads;
        // the fd is open for the duration of the call.
        let n = unsafe { libc::pwritev(file.as_raw_fd(), iov.as_ptr(), 2, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if usize::try_from(n).unwrap_or(0) < header.len() + payload.len() {
            file.write_all_at(header, 0)?;
            file.write_all_at(payload, header.len() as u64)?;
        }
        Ok(())
    }
}

impl BlockMemory for RawRows {
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }
    fn num_blocks(&self) -> u64 {
        self.num_rows
    }
    fn copy_out(&self, block: BlockId, out: &mut [u8]) -> Result<()> {
        let src = self.row_ptr(block, out.len())?;
        // SAFETY: obligation 1 (the row is mapped; `row_ptr` checked the bounds) and 2 (no writer
        // while the block is copied out); `out` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
    fn read_file_into(
        &self,
        block: BlockId,
        file: &File,
        header: &mut [u8],
    ) -> Option<io::Result<u64>> {
        // `O_DIRECT` needs 4 KiB-aligned memory and lengths; otherwise the tier uses its buffer.
        (self.aligned(block) && header.len() % ALIGN == 0)
            .then(|| self.read_file(block, file, header))
    }
    fn payload_sum(&self, block: BlockId) -> Option<io::Result<u64>> {
        self.aligned(block)
            .then(|| self.block_slice(block).map(xxhash_rust::xxh3::xxh3_64))
    }
    fn write_file_from(
        &self,
        block: BlockId,
        file: &File,
        header: &[u8],
    ) -> Option<io::Result<()>> {
        (self.aligned(block) && header.len() % ALIGN == 0)
            .then(|| self.write_file(block, file, header))
    }
    fn with_block(&self, block: BlockId, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        let src = self.row_ptr(block, self.block_bytes)?;
        // SAFETY: obligation 1 (the row is mapped; `row_ptr` checked the bounds) and 2 (the block
        // is pinned: no writer while `f` reads it; the slice does not outlive this call).
        f(unsafe { std::slice::from_raw_parts(src as *const u8, self.block_bytes) });
        Ok(())
    }
    fn with_block_mut(&self, block: BlockId, f: &mut dyn FnMut(&mut [u8]) -> bool) -> Result<()> {
        let dst = self.row_ptr(block, self.block_bytes)?;
        // SAFETY: obligation 1 (mapped and writable, bounds checked) and 2 (a pending block: no
        // other reader or writer while `f` writes it; the slice does not outlive this call).
        f(unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, self.block_bytes) });
        Ok(())
    }
    fn copy_in(&self, block: BlockId, data: &[u8]) -> Result<()> {
        let dst = self.row_ptr(block, data.len())?;
        // SAFETY: obligation 1 (mapped and writable, bounds checked) and 2 (no other reader or
        // writer of a pending block); `data` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len()) };
        Ok(())
    }
}

/// Host memory owned by the tier's user: `num_blocks` blocks of `block_bytes` in one 4 KiB-aligned
/// allocation, rows 4 KiB-aligned, so that promotions read straight into it (as into a
/// `HostRegion`). For tools, benchmarks and tests.
pub struct AlignedRows {
    rows: RawRows,
    _buf: AlignedBuf,
}

impl std::fmt::Debug for AlignedRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedRows")
            .field("rows", &self.rows)
            .finish_non_exhaustive()
    }
}

impl AlignedRows {
    /// `num_blocks` zeroed blocks of `block_bytes`.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] for a zero block size or a size that overflows.
    pub fn new(num_blocks: usize, block_bytes: usize) -> Result<Self> {
        let stride = block_bytes.next_multiple_of(ALIGN);
        let total = stride
            .checked_mul(num_blocks.max(1))
            .ok_or_else(|| KvoffError::arg("host rows too large"))?;
        let mut buf = AlignedBuf::new(total);
        let ptr = buf.as_mut_slice().as_mut_ptr() as u64;
        // SAFETY: obligation 1: the allocation of `buf` (owned by the returned value, never
        // reallocated or otherwise borrowed) holds `num_blocks` rows of `stride` bytes.
        // Obligation 2 is the tier's protocol, as for any `RawRows`.
        let rows = unsafe { RawRows::new(ptr, num_blocks as u64, stride as u64, block_bytes)? };
        Ok(Self { rows, _buf: buf })
    }
}

impl BlockMemory for AlignedRows {
    fn block_bytes(&self) -> usize {
        self.rows.block_bytes()
    }
    fn num_blocks(&self) -> u64 {
        self.rows.num_blocks()
    }
    fn copy_out(&self, block: BlockId, out: &mut [u8]) -> Result<()> {
        self.rows.copy_out(block, out)
    }
    fn copy_in(&self, block: BlockId, data: &[u8]) -> Result<()> {
        self.rows.copy_in(block, data)
    }
    fn with_block(&self, block: BlockId, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        self.rows.with_block(block, f)
    }
    fn with_block_mut(&self, block: BlockId, f: &mut dyn FnMut(&mut [u8]) -> bool) -> Result<()> {
        self.rows.with_block_mut(block, f)
    }
    fn read_file_into(
        &self,
        block: BlockId,
        file: &File,
        header: &mut [u8],
    ) -> Option<io::Result<u64>> {
        self.rows.read_file_into(block, file, header)
    }
    fn payload_sum(&self, block: BlockId) -> Option<io::Result<u64>> {
        self.rows.payload_sum(block)
    }
    fn write_file_from(
        &self,
        block: BlockId,
        file: &File,
        header: &[u8],
    ) -> Option<io::Result<()>> {
        self.rows.write_file_from(block, file, header)
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;

    #[test]
    fn aligned() {
        let mut b = AlignedBuf::new(5000);
        assert_eq!(b.len(), 8192);
        assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
        b.as_mut_slice()[8191] = 3;
        assert_eq!(b.as_slice()[8191], 3);
    }
}
