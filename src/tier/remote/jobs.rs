//! The remote tier's shared state and I/O threads (docs/tier.md "Remote tier"): the partial
//! index, the job queues, the counters, and the jobs the threads run (fetch, read, write).
#![forbid(unsafe_code)]

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::tier::remote_conn::{set_head, set_tail, BufPool, Conn, Next};
use crate::tier::remote_route::{Pack, DIRECT_SEND_BYTES};

#[derive(Clone, Debug)]
pub(super) enum Entry {
    /// A fetch is asking the server.
    Fetching,
    /// Being written by this instance.
    Writing,
    /// Found or written; `value` holds a fetched, checked value until it is read.
    Present {
        value: Option<Arc<Vec<u8>>>,
        until: Instant,
    },
    /// Not found (remembered until `until`).
    Absent { until: Instant },
}

pub(super) enum Job {
    /// Not queued: an idle I/O thread's turn to probe a failed node (see `worker`).
    Probe,
    Fetch(Vec<ByteKey>),
    /// Promotions: keys and their reserved host blocks.
    Read(Vec<(ByteKey, BlockId)>),
    Write(Vec<(ByteKey, BlockId)>),
}

#[derive(Default)]
pub(super) struct State {
    pub(super) index: HashMap<ByteKey, Entry, foldhash::fast::RandomState>,
    pub(super) jobs_reads: VecDeque<Job>,
    pub(super) jobs_writes: VecDeque<(ByteKey, BlockId)>,
    pub(super) queued_writes: usize,
    pub(super) running_reads: u64,
    pub(super) running_writes: u64,
    /// Fetch jobs taken by an I/O thread and not finished.
    pub(super) running_fetches: u64,
    pub(super) inflight_bytes: u64,
    /// Bytes of values that queued or running fetches may stage (reserved at `submit_fetch`, so
    /// that readahead never fetches a value it has no room to keep).
    pub(super) fetch_reserved: u64,
    pub(super) staged_bytes: u64,
    pub(super) completions: Vec<Completion>,
    pub(super) shutdown: bool,
    pub(super) last_error: Option<String>,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) writes: AtomicU64,
    pub(super) bytes_written: AtomicU64,
    pub(super) write_ns: AtomicU64,
    pub(super) write_errors: AtomicU64,
    pub(super) writes_dropped: AtomicU64,
    pub(super) promotions: AtomicU64,
    pub(super) bytes_read: AtomicU64,
    pub(super) read_ns: AtomicU64,
    pub(super) read_errors: AtomicU64,
    pub(super) rejected: AtomicU64,
    pub(super) fetch_hits: AtomicU64,
    pub(super) fetch_misses: AtomicU64,
    pub(super) fetch_errors: AtomicU64,
}

pub(super) struct Shared {
    pub(super) cluster: bool,
    pub(super) router: Router,
    pub(super) url_redacted: String,
    pub(super) fingerprint: u64,
    pub(super) fp_hex: String,
    pub(super) rank: u32,
    pub(super) world_size: u32,
    pub(super) owner: u64,
    pub(super) payload_len: usize,
    pub(super) value_len: usize,
    pub(super) cfg: RemoteConfig,
    pub(super) memory: Arc<dyn BlockMemory>,
    pub(super) state: Mutex<State>,
    pub(super) cv: Condvar,
    pub(super) counters: Counters,
    pub(super) pid: u32,
    /// Buffers of values read, reused (see `BufPool`).
    pub(super) pool: Arc<BufPool>,
}

pub(super) fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(super) fn ns(t0: Instant) -> u64 {
    u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// What checking a fetched value found.
pub(super) enum Checked {
    Ok(Vec<u8>),
    Missing,
    Rejected,
    /// No answer (node down or failing, slot unserved) or a server error reply.
    Failed,
}

impl Shared {
    pub(super) fn redis_key(&self, key: &ByteKey) -> String {
        let k = key.as_bytes();
        let stem = if k.len() <= MAX_HEX_KEY {
            crate::tier::file::hex(k)
        } else {
            format!("h{:032x}", xxh3_128(k))
        };
        format!("kvoff:{{{}:{stem}}}:r{}", self.fp_hex, self.rank)
    }

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

    /// Whether fetches read values' headers alone: for large values, a fetch (readahead) only
    /// learns that a valid value of this layout is there (`GETRANGE key 0 4095`: no payload on
    /// the wire, nothing staged) and the promotion reads the payload once, from the socket
    /// straight into its host block (`BlockRead`); a damaged payload then fails the promotion
    /// (rejected, deleted) instead of the fetch. Small values are fetched whole and staged: one
    /// command each rather than two (the server's cost per command dominates there).
    pub(super) fn header_fetch(&self) -> bool {
        self.value_len >= HEADER_FETCH_BYTES
    }

    /// The staging room a fetch reserves per key until it ends: its value; or, for fetches of
    /// headers alone (nothing staged), a share of the room that bounds them to
    /// `MAX_HEADER_FETCHES` in flight (a scheduler asking faster than the server answers queues
    /// no more).
    pub(super) fn fetch_unit(&self) -> u64 {
        if self.header_fetch() {
            (self.cfg.max_staged_bytes / MAX_HEADER_FETCHES).max(1)
        } else {
            (self.value_len as u64).max(1)
        }
    }

    /// What a fetch of `key`'s header found (see [`Shared::header_fetch`]): `Ok` with an empty
    /// buffer for a valid header.
    pub(super) fn check_header(&self, key: &ByteKey, v: Option<redis::Value>) -> Checked {
        match v {
            None | Some(redis::Value::ServerError(_)) => Checked::Failed,
            Some(redis::Value::Nil) => Checked::Missing,
            Some(redis::Value::BulkString(b)) if b.is_empty() => Checked::Missing,
            Some(redis::Value::BulkString(b)) if b.len() == HEADER_BYTES => {
                match format::verify_header(&b, &self.expect_header(key)) {
                    Ok(_) => Checked::Ok(Vec::new()),
                    Err(_) => Checked::Rejected,
                }
            }
            Some(_) => Checked::Rejected,
        }
    }

    pub(super) fn check(&self, key: &ByteKey, v: Option<redis::Value>) -> Checked {
        let bytes = match v {
            None | Some(redis::Value::ServerError(_)) => return Checked::Failed,
            Some(redis::Value::Nil) => return Checked::Missing,
            Some(redis::Value::BulkString(b)) => b,
            Some(_) => return Checked::Rejected,
        };
        if bytes.len() != self.value_len {
            return Checked::Rejected;
        }
        match format::verify(&bytes, &self.expect_header(key)) {
            Ok(_) => Checked::Ok(bytes),
            Err(_) => Checked::Rejected,
        }
    }

    /// Runs `cmds` (each with its key) through the router: one reply per command, `None` for a
    /// command that was not answered (see `remote_route`); failures go to `last_error`.
    pub(super) fn run<R: Pack>(
        &self,
        conns: &mut Conns,
        cmds: &[(String, R)],
    ) -> Vec<Option<redis::Value>> {
        let out = self.router.run(conns, cmds);
        if let Some(e) = out.error {
            lock(&self.state).last_error = Some(e);
        }
        out.replies
    }

    pub(super) fn delete(&self, conns: &mut Conns, key: &ByteKey) {
        let k = self.redis_key(key);
        let mut c = redis::cmd("DEL");
        c.arg(&k);
        let _ = self.run(conns, &[(k, c)]);
    }

    pub(super) fn run_fetch(&self, conns: &mut Conns, keys: &[ByteKey]) {
        let t0 = Instant::now();
        let header = self.header_fetch();
        let reserved = keys.len() as u64 * self.fetch_unit();
        let cmds: Vec<(String, redis::Cmd)> = keys
            .iter()
            .map(|k| {
                let rk = self.redis_key(k);
                let c = if header {
                    let mut c = redis::cmd("GETRANGE");
                    c.arg(&rk).arg(0).arg(HEADER_BYTES - 1);
                    c
                } else {
                    let mut c = redis::cmd("GET");
                    c.arg(&rk);
                    c
                };
                (rk, c)
            })
            .collect();
        let values = self.run(conns, &cmds);
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
        {
            let now = Instant::now();
            let mut st = lock(&self.state);
            st.fetch_reserved = st.fetch_reserved.saturating_sub(reserved);
            st.running_fetches = st.running_fetches.saturating_sub(1);
            for (k, c) in keys.iter().zip(results) {
                if !matches!(st.index.get(k), Some(Entry::Fetching)) {
                    continue; // written or forgotten meanwhile
                }
                let e = match c {
                    Checked::Ok(v) => {
                        self.counters.fetch_hits.fetch_add(1, Relaxed);
                        let keep = !v.is_empty()
                            && st.staged_bytes + v.len() as u64 <= self.cfg.max_staged_bytes;
                        let value = keep.then(|| {
                            st.staged_bytes += v.len() as u64;
                            Arc::new(v)
                        });
                        Entry::Present {
                            value,
                            until: now + self.cfg.present_ttl,
                        }
                    }
                    Checked::Missing => {
                        self.counters.fetch_misses.fetch_add(1, Relaxed);
                        Entry::Absent {
                            until: now + self.cfg.negative_ttl,
                        }
                    }
                    Checked::Rejected => {
                        self.counters.rejected.fetch_add(1, Relaxed);
                        self.counters.fetch_misses.fetch_add(1, Relaxed);
                        Entry::Absent {
                            until: now + self.cfg.negative_ttl,
                        }
                    }
                    // Unanswered (its node down, failing or redirected away): remembered as
                    // absent for a while (no refetch storm); the other keys of the batch stand.
                    Checked::Failed => {
                        self.counters.fetch_errors.fetch_add(1, Relaxed);
                        Entry::Absent {
                            until: now + self.cfg.negative_ttl,
                        }
                    }
                };
                st.index.insert(k.clone(), e);
            }
        }
        for k in &rejected {
            self.delete(conns, k);
        }
    }

    /// Promotes `items` (keys with their reserved host blocks): each from its staged value, or
    /// with a `GET` whose value is read from the socket straight into its host block (one
    /// pipeline for the batch; see `BlockRead`); one lock for the batch's completions.
    pub(super) fn run_reads(&self, conns: &mut Conns, items: &[(ByteKey, BlockId)]) {
        let t0 = Instant::now();
        let staged: Vec<Option<Arc<Vec<u8>>>> = {
            let mut st = lock(&self.state);
            items
                .iter()
                .map(|(key, _)| {
                    let v = match st.index.get_mut(key) {
                        Some(Entry::Present { value, .. }) => value.take(),
                        _ => None,
                    };
                    if let Some(v) = &v {
                        st.staged_bytes -= v.len() as u64;
                    }
                    v
                })
                .collect()
        };
        let gets: Vec<(String, BlockRead<'_>)> = items
            .iter()
            .zip(&staged)
            .filter(|(_, v)| v.is_none())
            .map(|((key, block), _)| {
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
        let mut replies = if gets.is_empty() {
            Vec::new()
        } else {
            self.run(conns, &gets)
        }
        .into_iter()
        .zip(&gets);
        let mut done = Vec::with_capacity(items.len());
        for ((key, block), staged) in items.iter().zip(staged) {
            let mut rejected = false;
            let ok = if let Some(v) = staged {
                let ok = self
                    .memory
                    .copy_in(*block, &v[HEADER_BYTES..HEADER_BYTES + self.payload_len])
                    .is_ok();
                if let Ok(v) = Arc::try_unwrap(v) {
                    self.pool.give(v);
                }
                ok
            } else {
                let Some((reply, (_, get))) = replies.next() else {
                    done.push(false);
                    continue;
                };
                match (get.split.get(), reply) {
                    // The payload is in the block already: its header and checksum decide.
                    (Some(sum), Some(redis::Value::BulkString(head))) => {
                        let good = format::verify_header(&head, &self.expect_header(key))
                            .is_ok_and(|h| h.payload_sum == sum);
                        rejected = !good;
                        good
                    }
                    (_, reply) => match self.check(key, reply) {
                        Checked::Ok(b) => {
                            let ok = self
                                .memory
                                .copy_in(*block, &b[HEADER_BYTES..HEADER_BYTES + self.payload_len])
                                .is_ok();
                            self.pool.give(b);
                            ok
                        }
                        Checked::Missing | Checked::Failed => false,
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
            done.push(ok);
        }
        let mut st = lock(&self.state);
        st.running_reads = st.running_reads.saturating_sub(items.len() as u64);
        let good = done.iter().filter(|&&ok| ok).count() as u64;
        if good > 0 {
            self.counters.promotions.fetch_add(good, Relaxed);
            self.counters
                .bytes_read
                .fetch_add(good * self.payload_len as u64, Relaxed);
            self.counters.read_ns.fetch_add(ns(t0), Relaxed);
        }
        let until = Instant::now() + self.cfg.negative_ttl;
        for ((key, block), ok) in items.iter().zip(done) {
            if !ok {
                self.counters.read_errors.fetch_add(1, Relaxed);
                st.index.insert(key.clone(), Entry::Absent { until });
            }
            st.completions.push(Completion::Promoted {
                key: key.clone(),
                block: *block,
                ok,
            });
        }
    }

    /// Writes `items`; sets `released` once their host blocks are handed back (completions).
    ///
    /// Each value goes to the socket from its host block (docs/design.md "The data path"): the
    /// block is checksummed where it lies, its header is packed into the pipeline and the block's
    /// bytes are written from host memory, with no copy of it in user space. The blocks are
    /// therefore handed back once the batch's replies are in (a command that must go again, after
    /// a redirect or a failover, reads its block again), not before the network as when values
    /// were copied.
    pub(super) fn run_writes(
        &self,
        conns: &mut Conns,
        items: &[(ByteKey, BlockId)],
        released: &mut bool,
    ) {
        let t0 = Instant::now();
        let px = self
            .cfg
            .ttl
            .map(|ttl| u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1));
        let cmds: Vec<(String, BlockWrite<'_>)> = items
            .iter()
            .map(|(k, b)| {
                (
                    self.redis_key(k),
                    BlockWrite {
                        sh: self,
                        key: k,
                        block: *b,
                        px,
                        failed: std::cell::Cell::new(false),
                    },
                )
            })
            .collect();
        let replies = self.run(conns, &cmds);
        {
            let mut st = lock(&self.state);
            for (k, b) in items {
                st.completions.push(Completion::Released {
                    key: k.clone(),
                    block: *b,
                });
            }
            *released = true;
        }
        conns.trim();
        let n_failed_local = cmds.iter().filter(|(_, c)| c.failed.get()).count();
        let elapsed = ns(t0);
        let mut st = lock(&self.state);
        self.end_writes(&mut st, items.len(), n_failed_local);
        let now = Instant::now();
        for (i, (_, cmd)) in cmds.iter().enumerate() {
            let k = cmd.key;
            if cmd.failed.get() {
                // Counted in `end_writes`; the key is not on the server because of this write.
                if matches!(st.index.get(k), Some(Entry::Writing)) {
                    st.index.remove(k);
                }
                continue;
            }
            let reply = replies.get(i).and_then(Option::as_ref);
            let good = reply
                .is_some_and(|v| matches!(v, redis::Value::Okay | redis::Value::SimpleString(_)));
            if good {
                self.counters.writes.fetch_add(1, Relaxed);
                self.counters
                    .bytes_written
                    .fetch_add(self.payload_len as u64, Relaxed);
                if matches!(st.index.get(k), Some(Entry::Writing)) {
                    st.index.insert(
                        k.clone(),
                        Entry::Present {
                            value: None,
                            until: now + self.cfg.present_ttl,
                        },
                    );
                }
            } else {
                self.counters.write_errors.fetch_add(1, Relaxed);
                if let Some(v) = reply {
                    st.last_error = Some(format!("{}: SET answered {v:?}", self.url_redacted));
                }
                if matches!(st.index.get(k), Some(Entry::Writing)) {
                    st.index.remove(k);
                }
            }
        }
        self.counters.write_ns.fetch_add(elapsed, Relaxed);
        drop(st);
        self.cv.notify_all();
    }

    /// A thread's (empty) set of connections.
    fn conns(&self) -> Conns {
        let mut c = Conns::default();
        c.pool = Some(Arc::clone(&self.pool));
        c
    }

    pub(super) fn worker(self: &Arc<Self>) {
        let mut conns = self.conns();
        loop {
            // A failed node whose backoff is over is probed between jobs (one thread at a time);
            // jobs meanwhile fail its commands at once.
            if let Some(e) = self.router.probe(&mut conns) {
                lock(&self.state).last_error = Some(e);
            }
            let mut st = lock(&self.state);
            let job = loop {
                if let Some(j) = st.jobs_reads.pop_front() {
                    match &j {
                        Job::Read(items) => st.running_reads += items.len() as u64,
                        Job::Fetch(..) => st.running_fetches += 1,
                        _ => {}
                    }
                    break Some(j);
                }
                if !st.jobs_writes.is_empty() {
                    let by_bytes = (WRITE_BATCH_BYTES / self.value_len.max(1)).max(1);
                    let n = st
                        .jobs_writes
                        .len()
                        .min(self.cfg.max_write_batch.max(1))
                        .min(by_bytes);
                    let batch: Vec<_> = st.jobs_writes.drain(..n).collect();
                    st.running_writes += batch.len() as u64;
                    break Some(Job::Write(batch));
                }
                if st.shutdown {
                    break None;
                }
                let idle = Duration::from_millis(500);
                let wait = self
                    .router
                    .next_probe(Instant::now())
                    .map_or(idle, |d| d.min(idle));
                if wait.is_zero() {
                    break Some(Job::Probe);
                }
                st = self
                    .cv
                    .wait_timeout(st, wait)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            };
            drop(st);
            let Some(job) = job else { return };
            // A panic inside a job (a bug in a dependency or a `BlockMemory`) must not leave the
            // job's accounting open, or `flush` and `shutdown` would wait for ever: the job fails
            // (its keys absent, its blocks released, counted as errors), the thread's connections
            // are dropped and the thread goes on (docs/tier.md, remote tier, Faults).
            let mut released = false;
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &job {
                Job::Probe => {}
                Job::Fetch(keys) => self.run_fetch(&mut conns, keys),
                Job::Read(items) => self.run_reads(&mut conns, items),
                Job::Write(items) => self.run_writes(&mut conns, items, &mut released),
            }));
            if let Err(p) = r {
                conns = self.conns();
                self.fail_panicked(&job, released, &panic_text(p.as_ref()));
            }
        }
    }

    /// Takes a finished write batch of `n` values off the queue and in-flight accounting and
    /// counts `failed` of them as write errors.
    pub(super) fn end_writes(&self, st: &mut State, n: usize, failed: usize) {
        st.inflight_bytes = st
            .inflight_bytes
            .saturating_sub((n * self.value_len) as u64);
        st.running_writes = st.running_writes.saturating_sub(n as u64);
        st.queued_writes = st.queued_writes.saturating_sub(n);
        self.counters.write_errors.fetch_add(failed as u64, Relaxed);
    }

    /// Closes the accounting of a job whose thread panicked (see `worker`).
    pub(super) fn fail_panicked(&self, job: &Job, released: bool, why: &str) {
        let mut st = lock(&self.state);
        st.last_error = Some(format!(
            "a remote I/O thread panicked (its job failed): {why}"
        ));
        let until = Instant::now() + self.cfg.negative_ttl;
        match job {
            Job::Probe => {}
            Job::Fetch(keys) => {
                st.running_fetches = st.running_fetches.saturating_sub(1);
                st.fetch_reserved = st
                    .fetch_reserved
                    .saturating_sub((keys.len() * self.value_len) as u64);
                for k in keys {
                    if matches!(st.index.get(k), Some(Entry::Fetching)) {
                        self.counters.fetch_errors.fetch_add(1, Relaxed);
                        st.index.insert(k.clone(), Entry::Absent { until });
                    }
                }
            }
            Job::Read(items) => {
                st.running_reads = st.running_reads.saturating_sub(items.len() as u64);
                for (k, b) in items {
                    self.counters.read_errors.fetch_add(1, Relaxed);
                    st.index.insert(k.clone(), Entry::Absent { until });
                    st.completions.push(Completion::Promoted {
                        key: k.clone(),
                        block: *b,
                        ok: false,
                    });
                }
            }
            Job::Write(items) => {
                if !released {
                    for (k, b) in items {
                        st.completions.push(Completion::Released {
                            key: k.clone(),
                            block: *b,
                        });
                    }
                }
                self.end_writes(&mut st, items.len(), items.len());
                for (k, _) in items {
                    if matches!(st.index.get(k), Some(Entry::Writing)) {
                        st.index.remove(k);
                    }
                }
            }
        }
        drop(st);
        self.cv.notify_all();
    }
}

/// A `GET` of one value whose payload is read from the socket straight into its (pending) host
/// block, checksummed there while it is still in the CPU's caches (see `Shared::run_reads`);
/// the reply the batch sees is the value's header alone. Over a connection kvoff does not read
/// itself (TLS), or for a reply of another length, the whole value is read as usual.
pub(super) struct BlockRead<'a> {
    sh: &'a Shared,
    block: BlockId,
    /// The payload went into the block, with this checksum.
    split: std::cell::Cell<Option<u64>>,
}

impl Pack for BlockRead<'_> {
    fn pack(&self, key: &str, _c: &mut Conn, packed: &mut Vec<u8>) -> Result<(), String> {
        redis::cmd("GET").arg(key).write_packed_command(packed);
        Ok(())
    }

    fn recv(&self, c: &mut Conn, pool: Option<&BufPool>) -> Result<redis::Value, String> {
        self.split.set(None);
        let Conn::Plain(p) = c else {
            return c.recv(pool);
        };
        if p.peek()? != Next::Bulk(self.sh.value_len) {
            return p.recv(pool);
        }
        p.take_bulk_header()?;
        let mut head = vec![0u8; HEADER_BYTES];
        p.read_body(&mut head)?;
        let mut io = Ok(());
        let mut sum = 0;
        let mut read = false;
        let placed = self.sh.memory.with_block_mut(self.block, &mut |dst| {
            if dst.len() != self.sh.payload_len {
                return false;
            }
            read = true;
            io = p.read_body(dst);
            if io.is_ok() {
                sum = format::payload_sum(dst);
            }
            io.is_ok()
        });
        io?;
        if !read {
            // The block could not take the payload: read it past (the stream stays in step).
            let mut scratch = vec![0u8; self.sh.payload_len];
            p.read_body(&mut scratch)?;
        }
        if !read || placed.is_err() {
            // The block could not take it (out of range): a nil reply, a failed promotion.
            p.read_crlf()?;
            return Ok(redis::Value::Nil);
        }
        p.read_crlf()?;
        self.split.set(Some(sum));
        Ok(redis::Value::BulkString(head))
    }
}

/// A `SET` of one block's value, packed straight from host memory (see `Shared::run_writes`).
pub(super) struct BlockWrite<'a> {
    sh: &'a Shared,
    key: &'a ByteKey,
    block: BlockId,
    px: Option<u64>,
    /// The value could not be built (the block unreadable, the header not encodable): a `PING`
    /// went in its place, and the write counts as failed.
    failed: std::cell::Cell<bool>,
}

impl Pack for BlockWrite<'_> {
    fn pack(&self, key: &str, c: &mut Conn, packed: &mut Vec<u8>) -> Result<(), String> {
        let mut h = self.sh.expect_header(self.key);
        let mut header = [0u8; HEADER_BYTES];
        let mut built = false;
        let mut sent = Ok(());
        let read = self.sh.memory.with_block(self.block, &mut |payload| {
            h.payload_sum = format::payload_sum(payload);
            if !format::encode(&h, &mut header) {
                return;
            }
            built = true;
            set_head(key, HEADER_BYTES + payload.len(), self.px, packed);
            packed.extend_from_slice(&header);
            if payload.len() >= DIRECT_SEND_BYTES {
                sent = c.send(packed).and_then(|()| {
                    packed.clear();
                    c.send(payload)
                });
            } else {
                packed.extend_from_slice(payload);
            }
            set_tail(self.px, packed);
        });
        if read.is_err() || !built {
            // Keeps the pipeline's replies in step with its commands.
            self.failed.set(true);
            redis::cmd("PING").write_packed_command(packed);
        }
        sent
    }
}

pub(super) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}
