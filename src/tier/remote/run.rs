//! What an I/O thread does on the server for one job (docs/tier.md "Remote tier", "The data
//! path"): a fetch (`Shared::run_fetch`), a batch of promotions (`Shared::run_reads`) and a
//! batch of writes (`Shared::run_writes`), with the checks of what comes back. Runs only on the
//! I/O threads.
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use super::route::{Conns, Pack, DIRECT_SEND_BYTES};
use super::shared::{ns, Checked, ReadItem, Shared, Wrote};
use super::wire::{BlockMget, BlockRead, BlockWrite, HeaderGet, Mget, WritePart};
use super::{FETCH_JOB_BYTES, VALUE_HEADER_BYTES};

use crate::key::ByteKey;
use crate::manager::BlockId;
use crate::tier::format;

impl Shared {
    /// What a fetch of `key`'s header found (see [`Shared::header_fetch`]): `Ok` with an empty
    /// buffer for a valid header.
    pub(super) fn check_header(&self, key: &ByteKey, v: Option<redis::Value>) -> Checked {
        match v {
            None => Checked::Failed,
            Some(redis::Value::ServerError(e)) => self.failed_by(&e),
            Some(redis::Value::Nil) => Checked::Missing,
            Some(redis::Value::BulkString(b)) if b.is_empty() => Checked::Missing,
            Some(redis::Value::BulkString(b)) if b.len() == VALUE_HEADER_BYTES => {
                match format::verify_header_sized(&b, &self.expect_header(key), VALUE_HEADER_BYTES)
                {
                    Ok(_) => Checked::Ok(Vec::new()),
                    Err(_) => Checked::Rejected,
                }
            }
            Some(_) => Checked::Rejected,
        }
    }

    pub(super) fn check(&self, key: &ByteKey, v: Option<redis::Value>) -> Checked {
        let bytes = match v {
            None => return Checked::Failed,
            Some(redis::Value::ServerError(e)) => return self.failed_by(&e),
            Some(redis::Value::Nil) => return Checked::Missing,
            Some(redis::Value::BulkString(b)) => b,
            Some(_) => return Checked::Rejected,
        };
        if bytes.len() != self.value_len {
            return Checked::Rejected;
        }
        match format::verify_sized(&bytes, &self.expect_header(key), VALUE_HEADER_BYTES) {
            Ok(_) => Checked::Ok(bytes),
            Err(_) => Checked::Rejected,
        }
    }

    /// A read answered by a server error: failed, its text kept (scrubbed and capped).
    fn failed_by(&self, e: &redis::ServerError) -> Checked {
        self.set_error(format!(
            "{}: {} {}",
            self.url_redacted,
            e.code(),
            e.details().unwrap_or("")
        ));
        Checked::Failed
    }

    /// Runs `cmds` (each with its key) through the router: one reply per command, `None` for a
    /// command that was not answered (see `route`); failures go to `last_error`.
    pub(super) fn run<R: Pack>(
        &self,
        conns: &mut Conns,
        cmds: &[(String, R)],
    ) -> Vec<Option<redis::Value>> {
        let out = self.router.run(conns, cmds);
        if let Some(e) = out.error {
            self.set_error(e);
        }
        out.replies
    }

    pub(super) fn delete(&self, conns: &mut Conns, key: &ByteKey) {
        let k = self.redis_key(key);
        let mut c = redis::cmd("DEL");
        c.arg(&k);
        let _ = self.run(conns, &[(k, c)]);
    }

    pub(super) fn run_fetch(&self, conns: &mut Conns, keys: &[ByteKey]) -> Vec<Checked> {
        let t0 = Instant::now();
        let header = self.header_fetch();
        let values = if header {
            let cmds: Vec<(String, HeaderGet)> = keys
                .iter()
                .map(|k| (self.redis_key(k), HeaderGet))
                .collect();
            self.run(conns, &cmds)
        } else if keys.len() > 1 && self.multi_key() {
            self.mget(conns, keys)
        } else {
            let cmds: Vec<(String, redis::Cmd)> = keys
                .iter()
                .map(|k| {
                    let rk = self.redis_key(k);
                    let mut c = redis::cmd("GET");
                    c.arg(&rk);
                    (rk, c)
                })
                .collect();
            self.run(conns, &cmds)
        };
        let mut rejected = Vec::new();
        let mut results = Vec::with_capacity(keys.len());
        for (k, v) in keys.iter().zip(values) {
            let c = if header {
                self.check_header(k, v)
            } else {
                self.check(k, v)
            };
            if matches!(c, Checked::Rejected) {
                rejected.push(k.clone());
            }
            results.push(c);
        }
        if results.iter().any(|c| !matches!(c, Checked::Failed)) {
            self.counters.read_ns.fetch_add(ns(t0), Relaxed);
        }
        for k in &rejected {
            self.delete(conns, k);
        }
        results
    }

    /// The values of `keys` by one `MGET` (see [`Shared::multi_key`]), one reply per key as
    /// [`Shared::run`] gives them: `None` for each when the command was not answered or not with
    /// an array of as many values (a server error reply fails them all).
    fn mget(&self, conns: &mut Conns, keys: &[ByteKey]) -> Vec<Option<redis::Value>> {
        let mut c = redis::cmd("MGET");
        for k in keys {
            c.arg(self.redis_key(k));
        }
        let cmd = [(String::new(), Mget(c, keys.len()))];
        match self.run(conns, &cmd).pop().flatten() {
            Some(redis::Value::Array(values)) if values.len() == keys.len() => {
                values.into_iter().map(Some).collect()
            }
            Some(other) => {
                self.set_error(format!("{}: MGET answered {other:?}", self.url_redacted));
                vec![None; keys.len()]
            }
            None => vec![None; keys.len()],
        }
    }

    /// The values of `items` (keys whose values were not staged), each read from the socket
    /// straight into its host block: one reply per item, with the payload's checksum where the
    /// payload went into the block. On one server (see [`Shared::multi_key`]) in `MGET`s of up
    /// to `FETCH_JOB_BYTES` of values, else a pipeline of `GET`s.
    fn read_unstaged(
        &self,
        conns: &mut Conns,
        items: &[(&ByteKey, BlockId)],
    ) -> Vec<(Option<redis::Value>, Option<u64>)> {
        if items.is_empty() {
            return Vec::new();
        }
        if items.len() == 1 || !self.multi_key() {
            let gets: Vec<(String, BlockRead<'_>)> = items
                .iter()
                .map(|(key, block)| {
                    (
                        self.redis_key(key),
                        BlockRead {
                            sh: self,
                            block: *block,
                            split: std::cell::Cell::new(None),
                        },
                    )
                })
                .collect();
            let replies = self.run(conns, &gets);
            return replies
                .into_iter()
                .zip(&gets)
                .map(|(r, (_, g))| (r, g.split.get()))
                .collect();
        }
        let per = usize::try_from(FETCH_JOB_BYTES).unwrap_or(usize::MAX) / self.value_len.max(1);
        let cmds: Vec<(String, BlockMget<'_>)> = items
            .chunks(per.max(1))
            .map(|part| {
                let mut cmd = redis::cmd("MGET");
                for (key, _) in part {
                    cmd.arg(self.redis_key(key));
                }
                (
                    String::new(),
                    BlockMget {
                        sh: self,
                        cmd,
                        blocks: part.iter().map(|(_, b)| *b).collect(),
                        splits: vec![std::cell::Cell::new(None); part.len()],
                    },
                )
            })
            .collect();
        let mut out = Vec::with_capacity(items.len());
        for (reply, (_, m)) in self.run(conns, &cmds).into_iter().zip(&cmds) {
            let n = m.blocks.len();
            match reply {
                Some(redis::Value::Array(values)) if values.len() == n => {
                    out.extend(
                        values
                            .into_iter()
                            .zip(&m.splits)
                            .map(|(v, s)| (Some(v), s.get())),
                    );
                }
                Some(other) => {
                    self.set_error(format!("{}: MGET answered {other:?}", self.url_redacted));
                    out.extend(std::iter::repeat_n((None, None), n));
                }
                None => out.extend(std::iter::repeat_n((None, None), n)),
            }
        }
        out
    }

    /// Promotes `items` (keys with their reserved host blocks): each from its staged value, or
    /// read from the socket straight into its host block (`read_unstaged`: `MGET`s or a
    /// pipeline of `GET`s); one lock for the batch's completions.
    pub(super) fn run_reads(&self, conns: &mut Conns, job: &mut [ReadItem]) -> Vec<bool> {
        let t0 = Instant::now();
        let staged: Vec<Option<Arc<Vec<u8>>>> = job.iter_mut().map(|i| i.staged.take()).collect();
        let items: Vec<(&ByteKey, BlockId, bool)> =
            job.iter().map(|i| (&i.key, i.block, i.unknown)).collect();
        let unstaged: Vec<(&ByteKey, BlockId)> = items
            .iter()
            .zip(&staged)
            .filter(|(_, v)| v.is_none())
            .map(|((key, block, _), _)| (*key, *block))
            .collect();
        let mut replies = self.read_unstaged(conns, &unstaged).into_iter();
        let mut done = Vec::with_capacity(items.len());
        let mut read_errors = 0;
        for ((key, block, unknown), staged) in items.iter().zip(staged) {
            let mut rejected = false;
            let mut missing = false;
            let ok = if let Some(v) = staged {
                // Checked when it was fetched, for the key it was fetched for: the index knows
                // keys by a 64-bit hash (`index` module), so its header must name this key too.
                let ok = format::verify_header_sized(
                    &v[..VALUE_HEADER_BYTES],
                    &self.expect_header(key),
                    VALUE_HEADER_BYTES,
                )
                .is_ok()
                    && self
                        .memory
                        .copy_in(
                            *block,
                            &v[VALUE_HEADER_BYTES..VALUE_HEADER_BYTES + self.payload_len],
                        )
                        .is_ok();
                if let Ok(v) = Arc::try_unwrap(v) {
                    self.pool.give(v);
                }
                ok
            } else {
                let Some((reply, split)) = replies.next() else {
                    done.push(false);
                    read_errors += 1;
                    continue;
                };
                match (split, reply) {
                    // The payload is in the block already: its header and checksum decide.
                    (Some(sum), Some(redis::Value::BulkString(head))) => {
                        let good = format::verify_header_sized(
                            &head,
                            &self.expect_header(key),
                            VALUE_HEADER_BYTES,
                        )
                        .is_ok_and(|h| h.payload_sum == sum);
                        rejected = !good;
                        good
                    }
                    (_, reply) => match self.check(key, reply) {
                        Checked::Ok(b) => {
                            let ok = self
                                .memory
                                .copy_in(
                                    *block,
                                    &b[VALUE_HEADER_BYTES..VALUE_HEADER_BYTES + self.payload_len],
                                )
                                .is_ok();
                            self.pool.give(b);
                            ok
                        }
                        Checked::Missing => {
                            missing = true;
                            false
                        }
                        Checked::Failed => false,
                        Checked::Rejected => {
                            rejected = true;
                            false
                        }
                    },
                }
            };
            if rejected {
                self.counters.rejected.fetch_add(1, Relaxed);
                self.delete(conns, key);
            }
            // A read of a key the index did not know is also its fetch: counted as one.
            let c = &self.counters;
            match (*unknown, ok, missing || rejected) {
                (true, true, _) => c.fetch_hits.fetch_add(1, Relaxed),
                (true, false, true) => c.fetch_misses.fetch_add(1, Relaxed),
                (true, false, false) => c.fetch_errors.fetch_add(1, Relaxed),
                (false, true, _) => 0,
                (false, false, _) => {
                    read_errors += 1;
                    0
                }
            };
            done.push(ok);
        }
        let good = done.iter().filter(|&&ok| ok).count() as u64;
        if good > 0 {
            self.counters.promotions.fetch_add(good, Relaxed);
            self.counters
                .bytes_read
                .fetch_add(good * self.payload_len as u64, Relaxed);
            self.counters.read_ns.fetch_add(ns(t0), Relaxed);
        }
        self.counters.read_errors.fetch_add(read_errors, Relaxed);
        done
    }

    /// Writes `items`; sets `released` once their host blocks are handed back (completions).
    ///
    /// Each value goes to the socket from its host block (docs/design.md "The data path"): the
    /// block is checksummed where it lies, its header is packed into the pipeline and the block's
    /// bytes are written from host memory, with no copy of it in user space. The blocks are
    /// therefore handed back once the batch's replies are in (a command that must go again, after
    /// a redirect or a failover, reads its block again), not before the network as when values
    /// were copied. Small values on one server without a TTL go as one `MSET` for the batch
    /// (see [`Shared::multi_key`]), others as a `SET` each.
    /// `sums` holds each payload's checksum where it was computed ahead (`Shared::sum_ahead`).
    pub(super) fn run_writes(
        &self,
        conns: &mut Conns,
        items: &[(ByteKey, BlockId)],
        sums: &[Option<u64>],
    ) -> Vec<Wrote> {
        let t0 = Instant::now();
        let px = self
            .cfg
            .ttl
            .map(|ttl| u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1));
        let per_command = if px.is_none() && self.multi_key() {
            items.len().max(1)
        } else {
            1
        };
        let cmds: Vec<(String, BlockWrite<'_>)> = items
            .chunks(per_command)
            .zip(sums.chunks(per_command).chain(std::iter::repeat(&[][..])))
            .map(|(chunk, sums)| {
                let parts: Vec<WritePart<'_>> = chunk
                    .iter()
                    .enumerate()
                    .map(|(i, (k, b))| WritePart {
                        key: k,
                        rkey: self.redis_key(k),
                        block: *b,
                        sum: sums.get(i).copied().flatten(),
                        failed: std::cell::Cell::new(false),
                    })
                    .collect();
                (
                    parts[0].rkey.clone(),
                    BlockWrite {
                        sh: self,
                        parts,
                        px,
                    },
                )
            })
            .collect();
        let replies = self.run(conns, &cmds);
        conns.trim();
        let mut wrote = Vec::with_capacity(items.len());
        for (i, (_, cmd)) in cmds.iter().enumerate() {
            let reply = replies.get(i).and_then(Option::as_ref);
            let stored = reply
                .is_some_and(|v| matches!(v, redis::Value::Okay | redis::Value::SimpleString(_)));
            let mut answered = false;
            for part in &cmd.parts {
                if !part.failed.get() && stored {
                    self.counters.writes.fetch_add(1, Relaxed);
                    self.counters
                        .bytes_written
                        .fetch_add(self.payload_len as u64, Relaxed);
                    wrote.push(Wrote::Stored);
                } else {
                    self.counters.write_errors.fetch_add(1, Relaxed);
                    answered |= !part.failed.get() && reply.is_some();
                    wrote.push(Wrote::Failed);
                }
            }
            if let (true, Some(v)) = (answered, reply) {
                let name = if cmd.parts.len() > 1 { "MSET" } else { "SET" };
                self.set_error(format!("{}: {name} answered {v:?}", self.url_redacted));
            }
        }
        self.counters.write_ns.fetch_add(ns(t0), Relaxed);
        wrote
    }

    /// Whether several keys go in one command (`MSET` of a write batch, `MGET` of a fetch job):
    /// on one server (not a Cluster, where keys of different blocks hash to different slots),
    /// for values below `DIRECT_SEND_BYTES`, whose commands are packed whole before they are
    /// sent. The server's cost per command is then paid once per batch (docs/performance.md "Tier tuning table").
    pub(super) fn multi_key(&self) -> bool {
        !self.cluster && self.value_len < DIRECT_SEND_BYTES
    }
}
