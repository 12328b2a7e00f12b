//! The remote tier's shared state and I/O threads (docs/tier.md "Remote tier"): the partial
//! index, the job queues, the counters, and the jobs the threads run (fetch, read, write).
#![forbid(unsafe_code)]

use super::conn::{mset_head, pair_head, set_head, set_tail, BufPool, Conn, Head, Next, Plain};
use super::route::{Pack, DIRECT_SEND_BYTES};
#[allow(clippy::wildcard_imports)]
use super::*;
use crossbeam_channel::{Receiver, Select, Sender};
use std::sync::atomic::Ordering::SeqCst;

/// A promotion: the key, its reserved host block, and its staged value if one was fetched.
pub(super) struct ReadItem {
    pub(super) key: ByteKey,
    pub(super) block: BlockId,
    pub(super) staged: Option<Arc<Vec<u8>>>,
    /// The index did not know the key (a read of a key not fetched first; see
    /// `SecondaryTier::may_read_unknown`): a missing value is a miss, not a failed promotion.
    pub(super) unknown: bool,
}
/// A write: the key and the host block it is written from.
pub(super) type WriteItem = (ByteKey, BlockId);

pub(super) enum Job {
    /// Keys and the tickets of their answers (`Answers`).
    Fetch(Vec<ByteKey>, Vec<u32>),
    /// Promotions: keys, their reserved host blocks and their staged values (taken out of the
    /// index when the promotion was queued).
    Read(Vec<ReadItem>),
    Write(Vec<(ByteKey, BlockId)>),
}

/// What the I/O threads hand back to the scheduler's thread, which applies it to the index and
/// its accounting (`Sched::apply`) at its next call: the I/O threads never take the lock of the
/// index, so no scheduler call waits on a thread that is busy with the network or preempted
/// (docs/tier.md "Remote tier", the scheduler's path).
pub(super) enum Done {
    /// The values a fetch found and checked, to stage (the fetch's other answers went to its
    /// tickets' cells, `Answers`): the keys' [`Index::hash`]es, their tickets, their values.
    Fetch {
        hashes: Vec<u64>,
        tickets: Vec<u32>,
        values: Vec<Vec<u8>>,
    },
    Read {
        items: Vec<ReadItem>,
        ok: Vec<bool>,
    },
    /// A write batch: its host blocks are no longer read, and how each write ended.
    Write {
        items: Vec<(ByteKey, BlockId)>,
        wrote: Vec<Wrote>,
    },
    /// A job whose thread panicked: it failed as a whole (a write batch's blocks are no longer
    /// read either).
    Panicked(Job),
}

/// What a job's run found (see `Shared::worker`).
enum Ran {
    Fetch(Vec<Checked>),
    Read(Vec<bool>),
    Write(Vec<Wrote>),
}

/// How one write of a batch ended.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Wrote {
    /// The server stored it.
    Stored,
    /// Not stored (no reply, an error reply, or the value could not be built).
    Failed,
}

/// What a fetch found for a key (the state of an `Answers` cell).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Answer {
    /// Not yet.
    Pending,
    /// The server holds a value of ours (a header checked; nothing staged).
    Present,
    /// A value was found and checked, and goes to the scheduler's side to be staged (`Done`).
    Staged,
    /// Not found, rejected, or unanswered: remembered as absent.
    Absent,
}

/// The answers of fetches, one cell per ticket (docs/tier.md "Remote tier", the scheduler's
/// path). A fetch's keys take tickets on the scheduler's side; an I/O thread writes each key's
/// answer and the time it came (µs since the index's epoch) into the key's cell; the scheduler's
/// side reads a cell only when it looks at the key again, and then puts the answer in the index
/// in place of the ticket. So a scheduler's call costs the keys it looks at, not the answers of
/// every fetch that ended since the last call. A ticket is taken again once its cell is
/// answered (`Sched::take_ticket`); a key whose ticket was taken again has lost its answer (it is
/// unknown again).
pub(super) struct Answers {
    cells: Box<[AtomicU64]>,
}

impl Answers {
    /// `n` cells (a power of two), none pending.
    pub(super) fn new(n: usize) -> Self {
        Self {
            cells: (0..n)
                .map(|_| AtomicU64::new(Self::pack(Answer::Absent, 0)))
                .collect(),
        }
    }

    fn pack(a: Answer, at: Tick) -> u64 {
        let s = match a {
            Answer::Pending => 0,
            Answer::Present => 1,
            Answer::Staged => 2,
            Answer::Absent => 3,
        };
        s | (at << 2)
    }

    /// Cell `t`'s answer and when it came.
    pub(super) fn read(&self, t: u32) -> (Answer, Tick) {
        let w = self.cells[t as usize].load(Acquire);
        let a = match w & 3 {
            0 => Answer::Pending,
            1 => Answer::Present,
            2 => Answer::Staged,
            _ => Answer::Absent,
        };
        (a, w >> 2)
    }

    /// Writes cell `t` (`Pending` on the scheduler's side before the job is queued; an answer
    /// from the I/O thread that ran it).
    pub(super) fn write(&self, t: u32, a: Answer, at: Tick) {
        self.cells[t as usize].store(Self::pack(a, at), Release);
    }
}

/// The scheduler's side of the tier: the partial index and the accounting of queued and running
/// jobs. Only the scheduler's calls lock it (never an I/O thread), so the lock is never contended
/// by the I/O threads.
pub(super) struct Sched {
    pub(super) index: Index,
    /// Size of the index at which the next submission prunes it (see `RemoteTier::expire`).
    pub(super) prune_at: usize,
    /// Writes queued or running.
    pub(super) queued_writes: usize,
    pub(super) inflight_bytes: u64,
    /// Promotions queued or running.
    pub(super) reads_out: u64,
    /// The key (hash) each ticket of `Answers` was last taken for.
    pub(super) owner: Vec<u64>,
    /// The next ticket to take.
    pub(super) next_ticket: usize,
    /// Since when promotion or fetch jobs have been waiting in the queues with no wake-up rung
    /// for them (see [`Shared::queued_jobs`]).
    pub(super) unrung_since: Option<Instant>,
    pub(super) completions: Vec<Completion>,
    pub(super) done: std::sync::mpsc::Receiver<Done>,
}

impl Sched {
    /// Applies the results the I/O threads handed back since the last call.
    pub(super) fn apply(&mut self, sh: &Shared) {
        while let Ok(d) = self.done.try_recv() {
            self.apply_one(sh, d);
        }
    }

    fn end_writes(&mut self, sh: &Shared, n: usize) {
        self.queued_writes = self.queued_writes.saturating_sub(n);
        self.inflight_bytes = self
            .inflight_bytes
            .saturating_sub((n * sh.value_len) as u64);
    }

    fn apply_one(&mut self, sh: &Shared, d: Done) {
        let now = self.index.tick(Instant::now());
        let absent = Entry::Absent {
            until: Index::after(now, sh.cfg.negative_ttl),
        };
        let present = Entry::Present {
            until: Index::after(now, sh.cfg.present_ttl),
            staged: false,
        };
        match d {
            Done::Fetch {
                hashes,
                tickets,
                values,
            } => {
                for ((h, t), v) in hashes.into_iter().zip(tickets).zip(values) {
                    // Its reservation ends here, not in the I/O thread (which ends the others'):
                    // until now the value's bytes were counted there.
                    sh.fetch_reserved.fetch_sub(sh.fetch_unit(), Relaxed);
                    // The ticket may be taken again from now on (not before: `take_ticket`).
                    sh.answers.write(t, Answer::Present, now);
                    if self.index.get(h) != Some(Entry::Fetching { ticket: t })
                        || self.owner[t as usize] != h
                    {
                        continue; // forgotten or written meanwhile
                    }
                    if self.index.staged_bytes() + v.len() as u64 <= sh.cfg.max_staged_bytes {
                        self.index
                            .stage(h, Index::after(now, sh.cfg.present_ttl), v);
                    } else {
                        self.index.set(h, present);
                    }
                }
            }
            Done::Read { items, ok } => {
                self.reads_out = self.reads_out.saturating_sub(items.len() as u64);
                for (ReadItem { key, block, .. }, ok) in items.into_iter().zip(ok) {
                    let h = Index::hash(&key);
                    if !ok {
                        self.forget_failed(sh, h, absent);
                    } else if !matches!(
                        self.resolve(sh, h),
                        Some(Entry::Writing | Entry::Fetching { .. })
                    ) {
                        // The server holds it (a read of a key the index did not know learns it).
                        self.index.set(h, present);
                    }
                    self.completions
                        .push(Completion::Promoted { key, block, ok });
                }
            }
            Done::Write { items, wrote } => {
                self.end_writes(sh, items.len());
                for ((key, block), w) in items.into_iter().zip(wrote) {
                    let h = Index::hash(&key);
                    if self.index.get(h) == Some(Entry::Writing) {
                        if w == Wrote::Stored {
                            self.index.set(h, present);
                        } else {
                            // Not on the server because of this write.
                            self.index.remove(h);
                        }
                    }
                    self.completions.push(Completion::Released { key, block });
                }
            }
            Done::Panicked(job) => match job {
                // Answered by its thread (`Shared::worker`).
                Job::Fetch(..) => {}
                Job::Read(items) => {
                    self.reads_out = self.reads_out.saturating_sub(items.len() as u64);
                    for ReadItem { key, block, .. } in items {
                        sh.counters.read_errors.fetch_add(1, Relaxed);
                        self.forget_failed(sh, Index::hash(&key), absent);
                        self.completions.push(Completion::Promoted {
                            key,
                            block,
                            ok: false,
                        });
                    }
                }
                Job::Write(items) => {
                    self.end_writes(sh, items.len());
                    sh.counters
                        .write_errors
                        .fetch_add(items.len() as u64, Relaxed);
                    for (key, block) in items {
                        let h = Index::hash(&key);
                        if self.index.get(h) == Some(Entry::Writing) {
                            self.index.remove(h);
                        }
                        self.completions.push(Completion::Released { key, block });
                    }
                }
            },
        }
    }

    /// After a failed promotion of `key`: remembered as absent, unless it is being written or
    /// fetched again meanwhile (that job's result decides); a value staged again meanwhile is
    /// given up with its bytes.
    fn forget_failed(&mut self, sh: &Shared, h: u64, absent: Entry) {
        if !matches!(
            self.resolve(sh, h),
            Some(Entry::Writing | Entry::Fetching { .. })
        ) {
            self.index.set(h, absent);
        }
    }

    /// Jobs queued or running.
    pub(super) fn outstanding(&self, sh: &Shared) -> bool {
        self.queued_writes > 0 || self.reads_out > 0 || sh.fetches_out.load(Acquire) > 0
    }

    /// `h`'s entry, with the answer of its fetch in place of its ticket once it came (see
    /// [`Answers`]); `None` also for a key whose ticket was taken again (its answer is lost).
    pub(super) fn resolve(&mut self, sh: &Shared, h: u64) -> Option<Entry> {
        let e = self.index.get(h)?;
        match Self::answered(&self.owner, sh, h, e) {
            Some(a) if a == e => Some(e),
            Some(a) => {
                self.index.set(h, a);
                Some(a)
            }
            None => {
                self.index.remove(h);
                None
            }
        }
    }

    /// `e` (`h`'s entry), or for a fetching one its answer if it came, or `None` if it is lost.
    pub(super) fn answered(owner: &[u64], sh: &Shared, h: u64, e: Entry) -> Option<Entry> {
        let Entry::Fetching { ticket } = e else {
            return Some(e);
        };
        if owner.get(ticket as usize) != Some(&h) {
            return None;
        }
        Some(match sh.answers.read(ticket) {
            // A staged value is on its way (`Done::Fetch`, sent before the cell was written).
            (Answer::Pending | Answer::Staged, _) => e,
            (Answer::Present, at) => Entry::Present {
                until: Index::after(at, sh.cfg.present_ttl),
                staged: false,
            },
            (Answer::Absent, at) => Entry::Absent {
                until: Index::after(at, sh.cfg.negative_ttl),
            },
        })
    }

    /// A ticket for a fetch of `h`, its cell pending; `None` while the next one's fetch is
    /// still running, or its staged value not yet applied (more fetches in flight than there
    /// are tickets for: the caller stops).
    pub(super) fn take_ticket(&mut self, sh: &Shared, h: u64) -> Option<u32> {
        let t = self.next_ticket;
        #[allow(clippy::cast_possible_truncation)]
        let ticket = t as u32; // fewer than 2^32 cells
        if self.owner[t] != 0
            && matches!(sh.answers.read(ticket).0, Answer::Pending | Answer::Staged)
        {
            return None;
        }
        self.owner[t] = h;
        sh.answers.write(ticket, Answer::Pending, 0);
        self.next_ticket = (t + 1) & (self.owner.len() - 1);
        Some(ticket)
    }
}

/// The job queues (multi-consumer channels: the I/O threads take from them in priority order,
/// promotions first, then fetches, then writes) and the bell that wakes idle threads.
///
/// An idle thread waits on `bell` alone (with `stop`), as one receiver: a ring wakes one thread.
/// The scheduler's side rings once per call that queued jobs (`Shared::ring`), and a thread that
/// takes a job while more wait rings again, so a burst of jobs wakes the threads one after the
/// other and the scheduler's thread pays for one wake-up at most. (Waiting for any of the three
/// queues to be ready made every job a wake-up of every idle thread, a system call each on the
/// scheduler's thread: `lookup_prefix` p99 with the server up grew from 16 µs with one I/O thread
/// to 40 µs with eight on the H100 host.) A woken thread takes jobs until the queues are empty, so
/// a job queued before a ring is never left behind; a ring left over only wakes a thread that
/// finds nothing.
pub(super) struct Queues {
    pub(super) reads: (Sender<Job>, Receiver<Job>),
    pub(super) fetches: (Sender<Job>, Receiver<Job>),
    pub(super) writes: (Sender<WriteItem>, Receiver<WriteItem>),
    pub(super) bell: (Sender<()>, Receiver<()>),
    /// Never sent on: disconnected (its sender dropped) at shutdown, which wakes every thread.
    pub(super) stop: Receiver<()>,
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
    pub(super) queues: Queues,
    /// Results for the scheduler's side (`Done`).
    pub(super) done: std::sync::mpsc::Sender<Done>,
    pub(super) shutdown: AtomicBool,
    pub(super) last_error: Mutex<Option<String>>,
    pub(super) counters: Counters,
    pub(super) pid: u32,
    /// Buffers of values read, reused (see `BufPool`).
    pub(super) pool: Arc<BufPool>,
    /// Write jobs running (see [`MAX_LARGE_WRITE_JOBS`]).
    pub(super) writes_running: std::sync::atomic::AtomicUsize,
    /// Fewest values of a write pipeline of large values (see `large_write_batch`).
    pub(super) large_write_batch: usize,
    /// I/O threads looking at the queues in `Shared::idle_spin` now.
    pub(super) spinning: std::sync::atomic::AtomicUsize,
    /// An idle thread is napping (`Shared::idle_spin`): one at a time.
    pub(super) napping: AtomicBool,
    /// The answers of fetches (see [`Answers`]).
    pub(super) answers: Answers,
    /// Promotion and fetch jobs queued and not yet taken by a thread (added before they are
    /// sent): a job still waiting a while after it was queued without a wake-up (a thread was
    /// spinning or napping, and has not come back to the queues: its CPU taken from it) gets one
    /// at the scheduler's next call (`RemoteTier::poll`).
    pub(super) queued_jobs: std::sync::atomic::AtomicUsize,
    /// The index's epoch (answers' times are µs since it).
    pub(super) epoch: Instant,
    /// Keys of fetches queued or running.
    pub(super) fetches_out: AtomicU64,
    /// Bytes of values that queued or running fetches may stage (reserved at `submit_fetch`, so
    /// that readahead never fetches a value it has no room to keep; a fetch's thread ends the
    /// reservations of the keys it staged nothing for, the scheduler's side the others').
    pub(super) fetch_reserved: AtomicU64,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
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
        let stem = format::key_stem(key.as_bytes());
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
    /// learns that a valid value of this layout is there (`GETRANGE key 0 1095`: no payload on
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
            None | Some(redis::Value::ServerError(_)) => return Checked::Failed,
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
        let values = if !header && keys.len() > 1 && self.multi_key() {
            self.mget(conns, keys)
        } else {
            let cmds: Vec<(String, redis::Cmd)> = keys
                .iter()
                .map(|k| {
                    let rk = self.redis_key(k);
                    let c = if header {
                        let mut c = redis::cmd("GETRANGE");
                        c.arg(&rk).arg(0).arg(VALUE_HEADER_BYTES - 1);
                        c
                    } else {
                        let mut c = redis::cmd("GET");
                        c.arg(&rk);
                        c
                    };
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
    pub(super) fn run_writes(&self, conns: &mut Conns, items: &[(ByteKey, BlockId)]) -> Vec<Wrote> {
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
            .map(|chunk| {
                let parts: Vec<WritePart<'_>> = chunk
                    .iter()
                    .map(|(k, b)| WritePart {
                        key: k,
                        rkey: self.redis_key(k),
                        block: *b,
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
    /// sent. The server's cost per command is then paid once per batch: on the 2-CPU dev VM,
    /// redis-server 7.0 spent 11.9–13.4 µs of CPU per 33 KB value in `MSET`s of 8 against
    /// 18.4–20.9 µs in pipelined `SET`s, and 12.8–13.0 µs per value in `MGET`s of 8 against
    /// 17.0–17.5 µs in `GET`s (redis-benchmark, its CPU time from `/proc`).
    pub(super) fn multi_key(&self) -> bool {
        !self.cluster && self.value_len < DIRECT_SEND_BYTES
    }

    /// A thread's (empty) set of connections.
    fn conns(&self) -> Conns {
        let mut c = Conns::default();
        c.pool = Some(Arc::clone(&self.pool));
        c
    }

    /// Hands a result to the scheduler's side (dropped when the tier is gone).
    pub(super) fn send(&self, d: Done) {
        let _ = self.done.send(d);
    }

    pub(super) fn set_error(&self, e: String) {
        *lock(&self.last_error) = Some(e);
    }

    /// Keys of one fetch job: values (or headers alone) of at most `FETCH_JOB_BYTES`, at least one
    /// and at most `MAX_FETCH_JOB_KEYS`.
    pub(super) fn fetch_job_keys(&self) -> usize {
        let wire = if self.header_fetch() {
            VALUE_HEADER_BYTES
        } else {
            self.value_len
        };
        (usize::try_from(FETCH_JOB_BYTES).unwrap_or(usize::MAX) / wire.max(1))
            .clamp(1, MAX_FETCH_JOB_KEYS)
    }

    /// Values of one promotion job: at most `FETCH_JOB_BYTES`, at least one.
    pub(super) fn read_job_items(&self) -> usize {
        (usize::try_from(FETCH_JOB_BYTES).unwrap_or(usize::MAX) / self.value_len.max(1)).max(1)
    }

    /// The next job: the one `stash` holds (taken from a queue by the last call), promotions, then
    /// fetches, then a batch of writes; `None` when there is none now. Promotion and fetch jobs
    /// queued one after another are merged up to a job's size (`merge`).
    fn next_job(&self, stash: &mut Option<Job>) -> Option<Job> {
        let q = &self.queues;
        if let Some(j) = stash
            .take()
            .or_else(|| q.reads.1.try_recv().ok().inspect(|_| self.took()))
            .or_else(|| q.fetches.1.try_recv().ok().inspect(|_| self.took()))
        {
            return Some(self.merge(j, stash));
        }
        // Large values: at most MAX_LARGE_WRITE_JOBS write pipelines at once (a slot taken before
        // the queue is looked at, given back when there is no write or the job ends).
        let capped = self.header_fetch();
        if capped && self.writes_running.fetch_add(1, AcqRel) >= MAX_LARGE_WRITE_JOBS {
            self.writes_running.fetch_sub(1, AcqRel);
            return None;
        }
        let Ok(first) = q.writes.1.try_recv() else {
            if capped {
                self.writes_running.fetch_sub(1, AcqRel);
            }
            return None;
        };
        let batch_bytes = if self.cfg.ttl.is_none() && self.multi_key() {
            MSET_BATCH_BYTES
        } else {
            WRITE_BATCH_BYTES
        };
        let fewest = if capped {
            self.large_write_batch
        } else {
            MIN_WRITE_BATCH
        };
        let by_bytes = (batch_bytes / self.value_len.max(1)).max(fewest);
        let n = self.cfg.max_write_batch.max(1).min(by_bytes);
        let mut batch = Vec::with_capacity(n.min(1024));
        batch.push(first);
        while batch.len() < n {
            match q.writes.1.try_recv() {
                Ok(w) => batch.push(w),
                Err(_) => break,
            }
        }
        Some(Job::Write(batch))
    }

    /// `job` with the promotion or fetch jobs queued behind it, while they fit in one job
    /// (`read_job_items`, `fetch_job_keys`); a job that does not fit goes to `stash`, for the next
    /// call. A scheduler that looks keys up one at a time (vLLM's connector asks for each block
    /// of a request in turn) queues a job per key; its keys then still share commands (an
    /// `MGET`), as those of one lookup of a prefix do.
    fn merge(&self, mut job: Job, stash: &mut Option<Job>) -> Job {
        let q = &self.queues;
        match &mut job {
            Job::Read(items) => {
                let cap = self.read_job_items();
                while items.len() < cap {
                    let got = q.reads.1.try_recv();
                    if got.is_ok() {
                        self.took();
                    }
                    match got {
                        Ok(Job::Read(more)) if items.len() + more.len() <= cap => {
                            items.extend(more);
                        }
                        Ok(other) => {
                            *stash = Some(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
            }
            Job::Fetch(keys, tickets) => {
                let cap = self.fetch_job_keys();
                while keys.len() < cap {
                    let got = q.fetches.1.try_recv();
                    if got.is_ok() {
                        self.took();
                    }
                    match got {
                        Ok(Job::Fetch(more, more_tickets)) if keys.len() + more.len() <= cap => {
                            keys.extend(more);
                            tickets.extend(more_tickets);
                        }
                        Ok(other) => {
                            *stash = Some(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
            }
            Job::Write(_) => {}
        }
        job
    }

    /// A promotion or fetch job was taken from its queue (see [`Shared::queued_jobs`]).
    fn took(&self) {
        self.queued_jobs.fetch_sub(1, Release);
    }

    /// Wakes an idle I/O thread for jobs just queued (which wakes the next one if more wait; see
    /// [`Queues`]).
    pub(super) fn ring(&self) {
        let _ = self.queues.bell.0.send(());
    }

    /// [`Shared::ring`] from the scheduler's side, after queuing jobs: nothing when an I/O thread
    /// is looking at the queues ([`Shared::idle_spin`]), which then takes them with no wake-up
    /// (a system call on the scheduler's thread).
    pub(super) fn ring_from_caller(&self) {
        // Pairs with the fence in `idle_spin`: either this load sees the thread still spinning
        // (and its look at the queues after the fence sees the jobs queued before this one), or
        // this call rings.
        std::sync::atomic::fence(SeqCst);
        if self.spinning.load(SeqCst) == 0 {
            self.ring();
        }
    }

    /// An I/O thread with nothing to do looks at the queues for up to `cfg.idle_spin` before it
    /// waits on the bell (docs/tier.md, remote tier, "Threads and bounds"): a job queued
    /// meanwhile is taken with no wake-up. Returns whether a job
    /// is waiting.
    fn idle_spin(&self, wait: Duration) -> bool {
        let (spin, nap) = (self.cfg.idle_spin, self.cfg.idle_nap);
        if spin.is_zero() && nap.is_zero() {
            return false;
        }
        self.spinning.fetch_add(1, SeqCst);
        let t0 = Instant::now();
        let mut found = false;
        let mut i = 0u32;
        while !spin.is_zero() && !self.shutdown.load(Acquire) {
            if self.jobs_waiting() {
                found = true;
                break;
            }
            i = i.wrapping_add(1);
            if i % 64 == 0 && t0.elapsed() >= spin {
                break;
            }
            std::hint::spin_loop();
        }
        // Then one thread at a time naps between looks, while it still counts as looking (so
        // the scheduler's side queues with no wake-up), up to `idle_nap_for` after its last job
        // and never past `wait` (a node's probe may be due).
        if !found && !nap.is_zero() && !self.napping.swap(true, AcqRel) {
            let until = self.cfg.idle_nap_for.min(wait);
            while !self.shutdown.load(Acquire) && t0.elapsed() < until {
                std::thread::sleep(nap);
                if self.jobs_waiting() {
                    found = true;
                    break;
                }
            }
            self.napping.store(false, Release);
        }
        self.spinning.fetch_sub(1, SeqCst);
        std::sync::atomic::fence(SeqCst);
        found || self.jobs_waiting()
    }

    /// Whether a job this thread may take is queued: a write of large values counts only while
    /// fewer than [`MAX_LARGE_WRITE_JOBS`] run (a writer that ends takes the next one itself, or
    /// rings for it after taking another job). Counting them regardless kept every other idle
    /// thread spinning at full speed on a queue it could not take from.
    fn jobs_waiting(&self) -> bool {
        let q = &self.queues;
        !(q.reads.1.is_empty() && q.fetches.1.is_empty())
            || (!q.writes.1.is_empty()
                && (!self.header_fetch()
                    || self.writes_running.load(Acquire) < MAX_LARGE_WRITE_JOBS))
    }

    /// Waits until the bell rings, the tier stops, or `wait` passes.
    fn wait_job(&self, wait: Duration) {
        let q = &self.queues;
        let mut sel = Select::new();
        let bell = sel.recv(&q.bell.1);
        sel.recv(&q.stop);
        if let Ok(op) = sel.select_timeout(wait) {
            // A selected operation must be completed on its own channel.
            let _ = if op.index() == bell {
                op.recv(&q.bell.1)
            } else {
                op.recv(&q.stop)
            };
        }
    }

    pub(super) fn worker(self: &Arc<Self>) {
        let mut conns = self.conns();
        // A job taken from a queue that did not fit in the last merged one (see `merge`).
        let mut stash = None;
        loop {
            // A failed node whose backoff is over is probed between jobs (one thread at a time);
            // jobs meanwhile fail its commands at once.
            if let Some(e) = self.router.probe(&mut conns) {
                self.set_error(e);
            }
            let Some(job) = self.next_job(&mut stash) else {
                if self.shutdown.load(Acquire) {
                    return;
                }
                let idle = Duration::from_millis(500);
                let wait = self
                    .router
                    .next_probe(Instant::now())
                    .map_or(idle, |d| d.min(idle));
                if !wait.is_zero() && !self.idle_spin(wait) {
                    self.wait_job(wait);
                }
                continue;
            };
            if self.jobs_waiting() {
                self.ring(); // the next idle thread takes the next job
            }
            // A panic inside a job (a bug in a dependency or a `BlockMemory`) must not leave the
            // job's accounting open, or `flush` and `shutdown` would wait for ever: the job fails
            // (its keys absent, its blocks released, counted as errors), the thread's connections
            // are dropped and the thread goes on (docs/tier.md, remote tier, Faults).
            let mut job = job;
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &mut job {
                Job::Fetch(keys, _) => Ran::Fetch(self.run_fetch(&mut conns, keys)),
                Job::Read(items) => Ran::Read(self.run_reads(&mut conns, items)),
                Job::Write(items) => Ran::Write(self.run_writes(&mut conns, items)),
            }));
            if matches!(job, Job::Write(_)) && self.header_fetch() {
                self.writes_running.fetch_sub(1, AcqRel);
            }
            let done = match (r, job) {
                (Ok(Ran::Fetch(results)), Job::Fetch(keys, tickets)) => {
                    self.answer_fetch(&keys, &tickets, results);
                    continue;
                }
                (Ok(Ran::Read(ok)), Job::Read(items)) => Done::Read { items, ok },
                (Ok(Ran::Write(wrote)), Job::Write(items)) => Done::Write { items, wrote },
                (r, job) => {
                    conns = self.conns();
                    let why = r.err().map_or_else(
                        || "job and result differ".into(),
                        |p| panic_text(p.as_ref()),
                    );
                    self.set_error(format!(
                        "a remote I/O thread panicked (its job failed): {why}"
                    ));
                    if let Job::Fetch(keys, tickets) = &job {
                        // Unanswered: remembered as absent, counted as errors.
                        let failed = keys.iter().map(|_| Checked::Failed).collect();
                        self.answer_fetch(keys, tickets, failed);
                        continue;
                    }
                    Done::Panicked(job)
                }
            };
            self.send(done);
        }
    }

    /// Hands a fetch's answers back (see [`Answers`]): the values found go to the scheduler's
    /// side to be staged (sent first, so that a cell that says `Staged` has its value in the
    /// channel), each key's answer goes to its ticket's cell, then the job's reservations and
    /// count end.
    fn answer_fetch(&self, keys: &[ByteKey], tickets: &[u32], results: Vec<Checked>) {
        let now = u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX >> 2);
        let (mut hits, mut misses, mut rejected, mut errors) = (0u64, 0u64, 0u64, 0u64);
        let mut answers = Vec::with_capacity(keys.len());
        let (mut hashes, mut staged_tickets, mut values) = (Vec::new(), Vec::new(), Vec::new());
        for ((k, &t), c) in keys.iter().zip(tickets).zip(results) {
            let a = match c {
                Checked::Ok(v) if !v.is_empty() => {
                    hashes.push(Index::hash(k));
                    staged_tickets.push(t);
                    values.push(v);
                    hits += 1;
                    Answer::Staged
                }
                Checked::Ok(_) => {
                    hits += 1;
                    Answer::Present
                }
                Checked::Missing => {
                    misses += 1;
                    Answer::Absent
                }
                Checked::Rejected => {
                    rejected += 1;
                    misses += 1;
                    Answer::Absent
                }
                // Unanswered (its node down, failing or redirected away) too: remembered as
                // absent for a while (no refetch storm).
                Checked::Failed => {
                    errors += 1;
                    Answer::Absent
                }
            };
            answers.push((t, a));
        }
        let n_staged = values.len() as u64;
        if !values.is_empty() {
            self.send(Done::Fetch {
                hashes,
                tickets: staged_tickets,
                values,
            });
        }
        for (t, a) in answers {
            self.answers.write(t, a, now);
        }
        let c = &self.counters;
        for (counter, n) in [
            (&c.fetch_hits, hits),
            (&c.fetch_misses, misses),
            (&c.rejected, rejected),
            (&c.fetch_errors, errors),
        ] {
            if n > 0 {
                counter.fetch_add(n, Relaxed);
            }
        }
        let n = keys.len() as u64;
        self.fetch_reserved
            .fetch_sub((n - n_staged) * self.fetch_unit(), Relaxed);
        self.fetches_out.fetch_sub(n, Release);
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
        let (v, split) = read_into_block(self.sh, p, self.block, pool)?;
        self.split.set(split);
        Ok(v)
    }
}

/// Reads the next reply of `p`: a bulk string of a whole value (`value_len` bytes) has its header
/// returned and its payload read straight into `block`, with the payload's checksum; any other
/// reply is read as usual (no checksum).
fn read_into_block(
    sh: &Shared,
    p: &mut Plain,
    block: BlockId,
    pool: Option<&BufPool>,
) -> Result<(redis::Value, Option<u64>), String> {
    if p.peek()? != Next::Bulk(sh.value_len) {
        return Ok((p.recv(pool)?, None));
    }
    p.take_bulk_header()?;
    let mut head = vec![0u8; VALUE_HEADER_BYTES];
    p.read_body(&mut head)?;
    let mut io = Ok(());
    let mut sum = 0;
    let mut read = false;
    let placed = sh.memory.with_block_mut(block, &mut |dst| {
        if dst.len() != sh.payload_len {
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
        let mut scratch = vec![0u8; sh.payload_len];
        p.read_body(&mut scratch)?;
    }
    p.read_crlf()?;
    if !read || placed.is_err() {
        // The block could not take it (out of range): a nil reply, a failed promotion.
        return Ok((redis::Value::Nil, None));
    }
    Ok((redis::Value::BulkString(head), Some(sum)))
}

/// An `MGET` of the values of `blocks`' keys whose payloads are read from the socket each
/// straight into its (pending) host block, as [`BlockRead`] reads one: the reply is the array of
/// the values' headers (or of whole values, over a connection kvoff does not read itself).
pub(super) struct BlockMget<'a> {
    sh: &'a Shared,
    cmd: redis::Cmd,
    blocks: Vec<BlockId>,
    /// Per value: its payload went into its block, with this checksum.
    splits: Vec<std::cell::Cell<Option<u64>>>,
}

impl Pack for BlockMget<'_> {
    fn pack(&self, _key: &str, _c: &mut Conn, packed: &mut Vec<u8>) -> Result<(), String> {
        self.cmd.write_packed_command(packed);
        Ok(())
    }

    fn recv(&self, c: &mut Conn, pool: Option<&BufPool>) -> Result<redis::Value, String> {
        for s in &self.splits {
            s.set(None);
        }
        let n = self.blocks.len();
        let Conn::Plain(p) = c else {
            return c.recv_array(pool, n);
        };
        match p.array_header(n)? {
            Head::Array(m) if m == n => {
                let mut out = Vec::with_capacity(n);
                for (block, split) in self.blocks.iter().zip(&self.splits) {
                    let (v, sum) = read_into_block(self.sh, p, *block, pool)?;
                    split.set(sum);
                    out.push(v);
                }
                Ok(redis::Value::Array(out))
            }
            Head::Array(m) => {
                // Fewer values than keys: read them past (the caller fails the command).
                let mut out = Vec::with_capacity(m);
                for _ in 0..m {
                    out.push(p.recv(pool)?);
                }
                Ok(redis::Value::Array(out))
            }
            Head::NilArray => Ok(redis::Value::Nil),
            Head::Other => p.recv(pool),
        }
    }
}

/// An `MGET` of `.1` keys, whose values are read from the socket each into a buffer of its own
/// ([`Conn::recv_array`]).
pub(super) struct Mget(redis::Cmd, usize);

impl Pack for Mget {
    fn pack(&self, _key: &str, _c: &mut Conn, packed: &mut Vec<u8>) -> Result<(), String> {
        self.0.write_packed_command(packed);
        Ok(())
    }

    fn recv(&self, c: &mut Conn, pool: Option<&BufPool>) -> Result<redis::Value, String> {
        c.recv_array(pool, self.1)
    }
}

/// A write of block values, packed straight from host memory (see `Shared::run_writes`): a
/// `SET` (with `PX` for a TTL) of one value, or an `MSET` of several (each below
/// `DIRECT_SEND_BYTES`: packed whole before it is sent).
pub(super) struct BlockWrite<'a> {
    sh: &'a Shared,
    parts: Vec<WritePart<'a>>,
    px: Option<u64>,
}

/// One value of a [`BlockWrite`].
pub(super) struct WritePart<'a> {
    key: &'a ByteKey,
    rkey: String,
    block: BlockId,
    /// The value could not be built (the block unreadable, the header not encodable): it is left
    /// out of its command (a `PING` goes in place of a command left with none), and the write
    /// counts as failed.
    failed: std::cell::Cell<bool>,
}

impl BlockWrite<'_> {
    /// Reads `part`'s block and hands its header and payload to `f`; false (and `f` not called)
    /// when the value cannot be built.
    fn build(&self, part: &WritePart<'_>, f: &mut dyn FnMut(&[u8], &[u8])) -> bool {
        let mut h = self.sh.expect_header(part.key);
        let mut header = [0u8; VALUE_HEADER_BYTES];
        let mut built = false;
        let read = self.sh.memory.with_block(part.block, &mut |payload| {
            h.payload_sum = format::payload_sum(payload);
            if format::encode_sized(&h, &mut header, VALUE_HEADER_BYTES) {
                built = true;
                f(&header, payload);
            }
        });
        read.is_ok() && built
    }

    /// Packs the `MSET` of the parts that can be built (each value whole into `packed`); a part
    /// that cannot is marked failed and the command packed again without it.
    fn pack_mset(&self, packed: &mut Vec<u8>) {
        let start = packed.len();
        'again: loop {
            packed.truncate(start);
            let live = self.parts.iter().filter(|p| !p.failed.get()).count();
            if live == 0 {
                redis::cmd("PING").write_packed_command(packed);
                return;
            }
            mset_head(live, packed);
            for part in self.parts.iter().filter(|p| !p.failed.get()) {
                let built = self.build(part, &mut |header, payload| {
                    pair_head(&part.rkey, header.len() + payload.len(), packed);
                    packed.extend_from_slice(header);
                    packed.extend_from_slice(payload);
                    packed.extend_from_slice(b"\r\n");
                });
                if !built {
                    part.failed.set(true);
                    continue 'again;
                }
            }
            return;
        }
    }
}

impl Pack for BlockWrite<'_> {
    fn pack(&self, key: &str, c: &mut Conn, packed: &mut Vec<u8>) -> Result<(), String> {
        if self.parts.len() > 1 {
            self.pack_mset(packed);
            return Ok(());
        }
        let part = &self.parts[0];
        let mut sent = Ok(());
        let built = self.build(part, &mut |header, payload| {
            set_head(key, header.len() + payload.len(), self.px, packed);
            packed.extend_from_slice(header);
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
        if !built {
            // Keeps the pipeline's replies in step with its commands.
            part.failed.set(true);
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
