//! The file tier's I/O threads (docs/spec.md §9, the [`super`] module docs): their loop, writes
//! and reads (the directory's names and scans are in `scan`), and [`IdleWaiter`].
#![deny(unsafe_code)]

use std::os::fd::AsFd;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use super::super::{format, AlignedBuf, Completion, HEADER_BYTES};
use super::io;
use super::{lock, split_name, FileState, Job, Shared, State};
use crate::key::ByteKey;
use crate::manager::BlockId;

/// Waits until a tier's queued jobs have run; see [`super::FileTier::idle_waiter`].
pub struct IdleWaiter(pub(super) Arc<Shared>);

impl std::fmt::Debug for IdleWaiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleWaiter").finish_non_exhaustive()
    }
}

impl IdleWaiter {
    /// Blocks until no job is queued or running (returns at once in a `fork()`ed child or after
    /// shutdown, where no thread runs them). Completions stay for [`super::FileTier::poll`].
    pub fn wait(&self) {
        let sh = &self.0;
        if crate::process::id() != sh.pid {
            return;
        }
        let mut st = lock(&sh.state);
        while !(st.idle() || (st.shutdown && st.running_reads == 0 && st.running_writes == 0)) {
            // The I/O threads signal the last job's end; the timeout only bounds a missed signal.
            st = sh
                .idle_cv
                .wait_timeout(st, Duration::from_millis(50))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Shared {
    pub(super) fn expect_header(&self, key: &ByteKey) -> format::Header {
        format::Header {
            fingerprint: self.fingerprint,
            rank: self.rank,
            world_size: self.world_size,
            payload_len: self.payload_len as u64,
            payload_sum: 0,
            owner: self.owner,
            key: key.as_bytes().to_vec(),
        }
    }

    pub(super) fn note_error(&self, e: impl std::fmt::Display) {
        lock(&self.state).last_error = Some(e.to_string());
    }

    pub(super) fn run_write(
        &self,
        key: &ByteKey,
        block: BlockId,
        name: &str,
        reuse: Option<&str>,
        buf: &mut AlignedBuf,
    ) {
        let t0 = Instant::now();
        let flen = usize::try_from(self.file_len).unwrap_or(usize::MAX);
        let release = || {
            lock(&self.state).completions.push(Completion::Released {
                key: key.clone(),
                block,
            });
        };
        // Straight from host memory when it is aligned for `O_DIRECT` (the block stays pinned
        // until the write is done); else copy it into the buffer and release it at once.
        let in_place = if self.direct {
            self.memory.payload_sum(block)
        } else {
            None
        };
        let zero_copy = in_place.is_some();
        let sum = if let Some(r) = in_place {
            r.map_err(|e| e.to_string())
        } else {
            let b = buf.as_mut_slice();
            let r = self
                .memory
                .copy_out(block, &mut b[HEADER_BYTES..HEADER_BYTES + self.payload_len]);
            // The host block is free again whatever happens next.
            release();
            r.map_err(|e| e.to_string()).map(|()| {
                b[HEADER_BYTES + self.payload_len..flen].fill(0);
                format::payload_sum(&b[HEADER_BYTES..HEADER_BYTES + self.payload_len])
            })
        };
        let result = sum.and_then(|sum| {
            let b = buf.as_mut_slice();
            let mut h = self.expect_header(key);
            h.payload_sum = sum;
            if !format::encode(&h, b) {
                return Err(format!(
                    "key of {} bytes is too long for the file header",
                    h.key.len()
                ));
            }
            let n = self.tmp_seq.fetch_add(1, Relaxed);
            let path = || self.ns_dir.join(name).display().to_string();
            let (shard, fname) = split_name(name);
            let tmp = io::cname(&format!(
                ".tmp.{}.{}.{n}",
                self.host_tag,
                std::process::id()
            ))
            .map_err(|e| format!("writing {}: {e}", path()))?;
            let dst = io::cname(fname).map_err(|e| format!("writing {}: {e}", path()))?;
            let dir = self
                .open_shard(shard, true)
                .map_err(|e| format!("writing {}: {e}", path()))?;
            // The evicted file to overwrite, in its own shard directory.
            let old = reuse.and_then(|r| {
                let (rs, rf) = split_name(r);
                let fd = self.open_shard(rs, false).ok()?;
                Some((fd, io::cname(rf).ok()?, r))
            });
            let image: &[u8] = b;
            let mut write = |f: &std::fs::File| -> std::io::Result<()> {
                if zero_copy {
                    self.memory
                        .write_file_from(block, f, &image[..HEADER_BYTES])
                        .unwrap_or_else(|| Err(std::io::Error::other("direct write not supported")))
                } else {
                    std::os::unix::fs::FileExt::write_all_at(f, &image[..flen], 0)
                }
            };
            let foreign = io::publish(
                dir.as_fd(),
                &tmp,
                &dst,
                self.file_len,
                &mut write,
                old.as_ref().map(|(fd, c, _)| io::Reuse {
                    dir: fd.as_fd(),
                    name: c,
                }),
                io::PublishOpts {
                    direct: self.direct,
                    fsync: self.fsync,
                    mode: self.file_mode,
                },
            )
            .map_err(|e| format!("writing {}: {e}", path()))?;
            if foreign {
                if let Some((_, _, r)) = &old {
                    self.reject(
                        r,
                        0,
                        "not a single-link regular file of this user; not overwritten",
                    );
                }
            }
            Ok(())
        });
        if zero_copy {
            release();
        }
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let mut st = lock(&self.state);
        st.running_writes = st.running_writes.saturating_sub(1);
        match result {
            Ok(()) => {
                self.counters.files_written.fetch_add(1, Relaxed);
                self.counters
                    .bytes_written
                    .fetch_add(self.payload_len as u64, Relaxed);
                self.counters.write_ns.fetch_add(ns, Relaxed);
                match st.index.get_mut(key) {
                    Some(e) if e.state == FileState::Writing => e.state = FileState::Published,
                    // Forgotten meanwhile (reset of the index): do not leave an unaccounted file.
                    _ => st.unlinks.push_back(Job::Unlink { name: name.into() }),
                }
            }
            Err(msg) => {
                self.counters.write_errors.fetch_add(1, Relaxed);
                st.last_error = Some(msg);
                if let Some(e) = st.index.remove(key) {
                    if let Some(s) = e.own_stamp {
                        st.own_lru.remove(&s);
                        st.own_bytes = st.own_bytes.saturating_sub(self.file_len);
                    }
                }
            }
        }
        // This thread takes queued unlinks and reads before writes: with those queued, another
        // thread takes the writer slot it freed.
        let others = !st.reads.is_empty() || !st.unlinks.is_empty();
        if others && !st.writes.is_empty() {
            self.cv.notify_one();
        }
        self.job_done(&st);
    }

    /// Wakes [`IdleWaiter::wait`] when `st` (locked) has nothing queued or running.
    fn job_done(&self, st: &State) {
        if st.idle() {
            self.idle_cv.notify_all();
        }
    }

    pub(super) fn run_read(&self, key: &ByteKey, block: BlockId, name: &str, buf: &mut AlignedBuf) {
        enum Outcome {
            Ok,
            Missing(String),
            Corrupt,
            /// Not a trusted regular file: `(inode, why)`.
            Rejected(u64, String),
        }
        let t0 = Instant::now();
        let path = self.ns_dir.join(name);
        let flen = usize::try_from(self.file_len).unwrap_or(usize::MAX);
        let (sname, fname) = split_name(name);
        let shard = self.open_shard(sname, false);
        let opened = shard
            .as_ref()
            .map_err(|e| std::io::Error::new(e.kind(), e.to_string()))
            .and_then(|d| {
                let c = io::cname(fname)?;
                let flags = if self.direct {
                    libc::O_RDONLY | libc::O_DIRECT
                } else {
                    libc::O_RDONLY
                };
                match io::open_at(d.as_fd(), &c, flags) {
                    Ok(f) => {
                        let st = io::fstat(f.as_fd())?;
                        Ok(Ok((f, st)))
                    }
                    // A link, a FIFO, a socket at the file's name (`ELOOP`, `ENXIO`, `EINVAL` for
                    // `O_DIRECT`, ...): say so rather than "missing".
                    Err(e) => match io::stat_at(d.as_fd(), &c) {
                        Ok(st) => match self.trust.file(&st) {
                            Err(why) => Ok(Err((st.ino, why))),
                            Ok(()) => Err(e),
                        },
                        Err(_) => Err(e),
                    },
                }
            });
        let outcome = match opened {
            Err(e) => Outcome::Missing(format!("opening {}: {e}", path.display())),
            Ok(Err((ino, why))) => Outcome::Rejected(ino, why),
            Ok(Ok((_, st))) if self.trust.file(&st).is_err() => {
                Outcome::Rejected(st.ino, self.trust.file(&st).err().unwrap_or_default())
            }
            Ok(Ok((f, st))) => {
                // A longer file is not ours either.
                let longer = st.size != self.file_len;
                let expect = self.expect_header(key);
                let direct_read = if self.direct && !longer {
                    self.memory
                        .read_file_into(block, &f, &mut buf.as_mut_slice()[..HEADER_BYTES])
                } else {
                    None
                };
                match direct_read {
                    // Straight into the (pending) host block: check header and checksum there.
                    Some(Ok(sum)) => {
                        match format::verify_header(&buf.as_slice()[..HEADER_BYTES], &expect) {
                            Ok(h) if h.payload_sum == sum => Outcome::Ok,
                            _ => Outcome::Corrupt,
                        }
                    }
                    Some(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        Outcome::Corrupt
                    }
                    Some(Err(e)) => Outcome::Missing(format!("reading {}: {e}", path.display())),
                    None => match io::read_full(&f, &mut buf.as_mut_slice()[..flen]) {
                        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Outcome::Corrupt,
                        Err(e) => Outcome::Missing(format!("reading {}: {e}", path.display())),
                        Ok(()) => match format::verify(&buf.as_slice()[..flen], &expect) {
                            Ok(payload) if !longer => match self.memory.copy_in(block, payload) {
                                Ok(()) => Outcome::Ok,
                                Err(e) => Outcome::Missing(e.to_string()),
                            },
                            _ => Outcome::Corrupt,
                        },
                    },
                }
            }
        };
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let ok = matches!(outcome, Outcome::Ok);
        let outcome_note = match &outcome {
            Outcome::Rejected(ino, why) => Outcome::Rejected(*ino, why.clone()),
            _ => Outcome::Ok,
        };
        let mut st = lock(&self.state);
        st.running_reads = st.running_reads.saturating_sub(1);
        match outcome {
            Outcome::Ok => {
                self.counters.promotions.fetch_add(1, Relaxed);
                self.counters
                    .bytes_read
                    .fetch_add(self.payload_len as u64, Relaxed);
                self.counters.read_ns.fetch_add(ns, Relaxed);
            }
            Outcome::Missing(msg) => {
                self.counters.read_errors.fetch_add(1, Relaxed);
                st.last_error = Some(msg);
                Self::forget(&mut st, key, self.file_len);
            }
            Outcome::Corrupt => {
                self.counters.corrupt_files.fetch_add(1, Relaxed);
                st.last_error = Some(format!("corrupt file {} removed", path.display()));
                Self::forget(&mut st, key, self.file_len);
                if let (Ok(d), Ok(c)) = (&shard, io::cname(fname)) {
                    let _ = io::unlink_at(d.as_fd(), &c);
                }
            }
            Outcome::Rejected(..) => {
                Self::forget(&mut st, key, self.file_len);
            }
        }
        st.completions.push(Completion::Promoted {
            key: key.clone(),
            block,
            ok,
        });
        let idle = st.idle();
        drop(st);
        if let Outcome::Rejected(ino, why) = &outcome_note {
            self.reject(name, *ino, why);
        }
        if idle {
            self.idle_cv.notify_all();
        }
    }

    pub(super) fn forget(st: &mut State, key: &ByteKey, file_len: u64) {
        if st
            .index
            .get(key)
            .is_some_and(|e| e.state == FileState::Published)
        {
            if let Some(e) = st.index.remove(key) {
                if let Some(s) = e.own_stamp {
                    st.own_lru.remove(&s);
                    st.own_bytes = st.own_bytes.saturating_sub(file_len);
                }
            }
        }
    }

    pub(super) fn worker(self: &Arc<Self>, mut buf: AlignedBuf) {
        loop {
            let mut st = lock(&self.state);
            let job = loop {
                if let Some(j) = st.unlinks.pop_front() {
                    st.running_unlinks += 1;
                    break Some(j);
                }
                if let Some(j) = st.reads.pop_front() {
                    st.running_reads += 1;
                    break Some(j);
                }
                if st.running_writes < self.write_threads {
                    if let Some(j) = st.writes.pop_front() {
                        st.running_writes += 1;
                        break Some(j);
                    }
                }
                if st.shutdown {
                    break None;
                }
                if let Some(iv) = self.rescan_interval {
                    let due = st.last_scan.is_none_or(|t| t.elapsed() >= iv);
                    if due && !st.scanning {
                        st.scanning = true;
                        drop(st);
                        self.scan(false);
                        st = lock(&self.state);
                        st.scanning = false;
                        continue;
                    }
                    let wait = st
                        .last_scan
                        .map_or(iv, |t| iv.saturating_sub(t.elapsed()))
                        .max(Duration::from_millis(1));
                    st = self
                        .cv
                        .wait_timeout(st, wait)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                } else {
                    st = self.cv.wait(st).unwrap_or_else(PoisonError::into_inner);
                }
            };
            drop(st);
            match job {
                None => return,
                Some(Job::Unlink { name }) => {
                    let (sname, fname) = split_name(&name);
                    if let (Ok(d), Ok(c)) = (self.open_shard(sname, false), io::cname(fname)) {
                        let _ = io::unlink_at(d.as_fd(), &c);
                    }
                    let mut st = lock(&self.state);
                    st.running_unlinks = st.running_unlinks.saturating_sub(1);
                    self.job_done(&st);
                }
                Some(Job::Write {
                    key,
                    block,
                    name,
                    reuse,
                }) => self.run_write(&key, block, &name, reuse.as_deref(), &mut buf),
                Some(Job::Read { key, block, name }) => self.run_read(&key, block, &name, &mut buf),
            }
        }
    }
}
