//! Whom a shared tier directory trusts (docs/tier.md "Trust"): which owners and modes of files and
//! directories the file tier uses; everything else is skipped and counted.
#![forbid(unsafe_code)]

use std::path::Path;

use super::io;
use crate::error::KvoffError;

/// Whom the directory trusts (docs/tier.md "Trust").
#[derive(Debug)]
pub(super) struct Trust {
    pub(super) uids: Vec<u32>,
    pub(super) gid: Option<u32>,
    pub(super) allow_writable_dir: bool,
}

impl Trust {
    pub(super) fn owner_ok(&self, st: &io::Stat) -> bool {
        self.uids.contains(&st.uid) || self.gid == Some(st.gid)
    }

    /// Writable only by trusted users: not by everyone, by the group only if it is trusted.
    pub(super) fn write_ok(&self, st: &io::Stat) -> std::result::Result<(), String> {
        if st.mode & 0o002 != 0 {
            return Err(format!(
                "writable by every user (mode {:o})",
                st.mode & 0o7777
            ));
        }
        if st.mode & 0o020 != 0 && self.gid != Some(st.gid) {
            return Err(format!(
                "writable by group {} (mode {:o}), which is not trusted_gid",
                st.gid,
                st.mode & 0o7777
            ));
        }
        Ok(())
    }

    /// A file the tier may serve.
    pub(super) fn file(&self, st: &io::Stat) -> std::result::Result<(), String> {
        if !st.is_file() {
            return Err(format!(
                "not a regular file (type {:o})",
                st.mode & libc::S_IFMT
            ));
        }
        if !self.owner_ok(st) {
            return Err(format!(
                "owned by uid {} gid {}, which are not trusted",
                st.uid, st.gid
            ));
        }
        self.write_ok(st)
    }

    /// A directory whose entries other users cannot rename or remove: writable only by trusted
    /// users, or with the sticky bit (or `allow_writable_dir`).
    pub(super) fn dir_writers(&self, st: &io::Stat) -> std::result::Result<(), String> {
        if self.allow_writable_dir || st.mode & libc::S_ISVTX != 0 {
            return Ok(());
        }
        self.write_ok(st).map_err(|e| {
            format!("{e} without the sticky bit (set allow_writable_dir to accept it)")
        })
    }

    /// A directory of the tier's own tree (namespace or shard directory).
    pub(super) fn dir(&self, st: &io::Stat) -> std::result::Result<(), String> {
        if !st.is_dir() {
            return Err(format!(
                "not a directory (type {:o})",
                st.mode & libc::S_IFMT
            ));
        }
        if !self.owner_ok(st) {
            return Err(format!(
                "owned by uid {} gid {}, which are not trusted",
                st.uid, st.gid
            ));
        }
        self.dir_writers(st)
    }
}

pub(super) fn untrusted(what: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::PermissionDenied, what)
}

pub(super) fn untrusted_dir(path: &Path, why: &str) -> KvoffError {
    KvoffError::Config(format!(
        "disk tier: refusing to use {}: {why}; the tier trusts directories and files of this user \
         (and of trusted_uids / trusted_gid), writable by no one else unless the directory has the \
         sticky bit (docs/tier.md \"Trust\"); remove it or fix its owner and mode",
        path.display()
    ))
}
