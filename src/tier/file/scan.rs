//! The file tier's directory as its I/O threads see it (docs/tier.md "Files", "Persistence,
//! sharing, capacity", "Trust"): file names from keys and back, shard directories, the listing
//! that indexes what is there (and removes stale temporary files), and foreign entries rejected.
#![deny(unsafe_code)]

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use xxhash_rust::xxh3::xxh3_64;

use super::io;
use super::{is_shard, lock, split_name, untrusted, Entry, FileState, Shared};
use crate::key::ByteKey;
use crate::tier::{format, HEADER_BYTES};

impl Shared {
    pub(super) fn file_name(&self, key: &ByteKey) -> Box<str> {
        let k = key.as_bytes();
        let stem = format::key_stem(k);
        format!(
            "{:02x}/{stem}.r{}.{}.kvb",
            xxh3_64(k) & 0xff,
            self.rank,
            self.owner_hex
        )
        .into_boxed_str()
    }

    /// `(key, owned)` of a file name of this rank; `None` for other names. Hashed names need the
    /// header: `Some((None, owned))`.
    pub(super) fn parse_name(&self, name: &str) -> Option<(Option<Vec<u8>>, bool)> {
        let rest = name.strip_suffix(".kvb")?;
        let (rest, owner_tag) = rest.rsplit_once('.')?;
        let (stem, rank) = rest.rsplit_once('.')?;
        if rank.strip_prefix('r')?.parse::<u32>().ok()? != self.rank {
            return None;
        }
        let owned = owner_tag == self.owner_hex;
        match format::parse_key_stem(stem)? {
            format::Stem::Key(k) => Some((Some(k), owned)),
            format::Stem::Hashed => Some((None, owned)),
        }
    }

    /// Opens shard directory `shard` (relative to the namespace directory, never through a link)
    /// and checks it is a trusted directory; with `create`, a missing one is created first.
    pub(super) fn open_shard(
        &self,
        shard: &str,
        create: bool,
    ) -> std::io::Result<std::os::fd::OwnedFd> {
        let c = io::cname(shard)?;
        let fd = match io::open_dir_at(self.dir_fd.as_fd(), &c) {
            Err(e) if create && e.kind() == std::io::ErrorKind::NotFound => {
                io::mkdir_at(self.dir_fd.as_fd(), &c)?;
                io::open_dir_at(self.dir_fd.as_fd(), &c)?
            }
            r => r?,
        };
        let st = io::fstat(fd.as_fd())?;
        self.trust
            .dir(&st)
            .map_err(|why| untrusted(format!("shard directory {shard}: {why}")))?;
        Ok(fd)
    }

    /// Counts a foreign entry (once per name and inode) and says why in `last_error`.
    pub(super) fn reject(&self, name: &str, ino: u64, why: &str) {
        let mut st = lock(&self.state);
        if st.rejected.get(name) == Some(&ino) {
            return;
        }
        if st.rejected.len() >= 65_536 {
            st.rejected.clear();
        }
        st.rejected.insert(name.into(), ino);
        self.counters.rejected_files.fetch_add(1, Relaxed);
        st.last_error = Some(format!(
            "skipped {}: {why}",
            self.ns_dir.join(name).display()
        ));
    }

    /// Lists the directory and merges it into the index. At start (`initial`) own files are
    /// adopted into the LRU (oldest modification first) and stale local temporary files removed.
    /// Nothing is opened but shard directories and files with hashed names (their header holds the
    /// key), each `O_NOFOLLOW | O_NONBLOCK`; an entry of the tier's name forms that is not a
    /// regular file (a directory for shards) of a trusted owner is skipped and counted
    /// (docs/tier.md "Trust"). Files not yet indexed are checked with `fstatat` (no lock held).
    #[allow(clippy::too_many_lines)] // one pass: list, check the new names, merge
    pub(super) fn scan(&self, initial: bool) {
        struct Found {
            key: ByteKey,
            name: Box<str>,
            owned: bool,
            /// The `fstat` of a file opened to read its header (hashed names).
            stat: Option<io::Stat>,
        }
        let tops = match io::list_dir(self.dir_fd.as_fd()) {
            Ok(v) => v,
            Err(e) => {
                self.note_error(format!("listing {}: {e}", self.ns_dir.display()));
                return;
            }
        };
        let mut found: Vec<Found> = Vec::new();
        let tmp_prefix = format!(".tmp.{}.", self.host_tag);
        for top in tops {
            let Some(shard_name) = top.name.to_str().filter(|n| is_shard(n)) else {
                continue;
            };
            if top.kind != libc::DT_DIR && top.kind != libc::DT_UNKNOWN {
                self.reject(shard_name, top.ino, "not a directory");
                continue;
            }
            let shard = match self.open_shard(shard_name, false) {
                Ok(fd) => fd,
                Err(e) => {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        self.reject(shard_name, top.ino, &e.to_string());
                    }
                    continue;
                }
            };
            let Ok(files) = io::list_dir(shard.as_fd()) else {
                continue;
            };
            for ent in files {
                let Some(name) = ent.name.to_str() else {
                    continue;
                };
                if initial {
                    if let Some(rest) = name.strip_prefix(&tmp_prefix) {
                        let pid = rest.split('.').next().unwrap_or("");
                        let alive = !pid.is_empty() && Path::new("/proc").join(pid).exists();
                        if !alive {
                            if let Ok(c) = io::cname(name) {
                                let _ = io::unlink_at(shard.as_fd(), &c);
                            }
                        }
                        continue;
                    }
                }
                let Some((key, owned)) = self.parse_name(name) else {
                    continue;
                };
                let full = format!("{shard_name}/{name}");
                if ent.kind != libc::DT_REG && ent.kind != libc::DT_UNKNOWN {
                    self.reject(&full, ent.ino, "not a regular file");
                    continue;
                }
                let (key, stat) = match key {
                    Some(k) => (ByteKey::new(&k), None),
                    None => match self.read_header_key(&shard, name, &full) {
                        Some((k, st)) => (ByteKey::new(&k), Some(st)),
                        None => continue,
                    },
                };
                found.push(Found {
                    key,
                    name: full.into_boxed_str(),
                    owned,
                    stat,
                });
            }
        }
        // Names not indexed yet are checked (owner, type, mode) before they are indexed; indexed
        // ones are checked again when a promotion opens them.
        let unchecked: Vec<usize> = {
            let st = lock(&self.state);
            (0..found.len())
                .filter(|&i| {
                    found[i].stat.is_none() && (initial || !st.index.contains_key(&found[i].key))
                })
                .collect()
        };
        let mut ok = vec![true; found.len()];
        let mut shard: Option<(String, std::os::fd::OwnedFd)> = None;
        for i in unchecked {
            let (sname, fname) = split_name(&found[i].name);
            if shard.as_ref().is_none_or(|(n, _)| n != sname) {
                shard = self
                    .open_shard(sname, false)
                    .ok()
                    .map(|fd| (sname.to_owned(), fd));
            }
            let st = match (&shard, io::cname(fname)) {
                (Some((_, fd)), Ok(c)) => io::stat_at(fd.as_fd(), &c),
                _ => Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
            };
            match st {
                Ok(st) => match self.trust.file(&st) {
                    Ok(()) => found[i].stat = Some(st),
                    Err(why) => {
                        ok[i] = false;
                        self.reject(&found[i].name, st.ino, &why);
                    }
                },
                // Vanished since the listing.
                Err(_) => ok[i] = false,
            }
        }
        drop(shard);
        let mut own_times: Vec<(i64, usize)> = Vec::new();
        if initial {
            for (i, f) in found.iter().enumerate() {
                if ok[i] && f.owned {
                    own_times.push((f.stat.map_or(0, |s| s.mtime), i));
                }
            }
        }
        own_times.sort_unstable();
        let mut st = lock(&self.state);
        if initial {
            for (_, i) in own_times {
                let Found { key, name, .. } = &found[i];
                if st.index.contains_key(key) {
                    continue;
                }
                st.stamp += 1;
                let stamp = st.stamp;
                st.own_lru.insert(stamp, key.clone());
                st.own_bytes += self.file_len;
                st.index.insert(
                    key.clone(),
                    Entry {
                        name: name.clone(),
                        state: FileState::Published,
                        own_stamp: Some(stamp),
                    },
                );
            }
        }
        let mut seen: std::collections::HashSet<&ByteKey, foldhash::fast::RandomState> =
            std::collections::HashSet::with_capacity_and_hasher(
                found.len(),
                foldhash::fast::RandomState::default(),
            );
        // Files of other owners, and (after the start) files with this owner's tag that this
        // instance does not know (another live process with the same owner tag): readable, but not
        // counted in this instance's capacity.
        for (i, Found { key, name, .. }) in found.iter().enumerate() {
            if !ok[i] {
                continue;
            }
            seen.insert(key);
            if st.index.contains_key(key) {
                continue;
            }
            st.index.insert(
                key.clone(),
                Entry {
                    name: name.clone(),
                    state: FileState::Published,
                    own_stamp: None,
                },
            );
        }
        if !initial {
            // Forget other engines' files that disappeared.
            st.index.retain(|k, e| {
                e.own_stamp.is_some() || e.state == FileState::Writing || seen.contains(k)
            });
        }
        st.last_scan = Some(Instant::now());
    }

    /// The key in the header of the hashed-name file `name` of `shard` (and its `fstat`), if it
    /// is a trusted regular file of this layout and rank.
    pub(super) fn read_header_key(
        &self,
        shard: &std::os::fd::OwnedFd,
        name: &str,
        full: &str,
    ) -> Option<(Vec<u8>, io::Stat)> {
        let c = io::cname(name).ok()?;
        let f = match io::open_at(shard.as_fd(), &c, libc::O_RDONLY) {
            Ok(f) => f,
            Err(e) => {
                if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENXIO)) {
                    let ino = io::stat_at(shard.as_fd(), &c).map_or(0, |s| s.ino);
                    self.reject(full, ino, &e.to_string());
                }
                return None;
            }
        };
        let st = io::fstat(f.as_fd()).ok()?;
        if let Err(why) = self.trust.file(&st) {
            self.reject(full, st.ino, &why);
            return None;
        }
        let mut b = vec![0u8; HEADER_BYTES];
        io::read_full(&f, &mut b).ok()?;
        let h = format::decode(&b).ok()?;
        (h.fingerprint == self.fingerprint && h.rank == self.rank).then_some((h.key, st))
    }
}
