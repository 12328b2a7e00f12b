//! The remote tier's state shared by the scheduler's side and the I/O threads (docs/tier.md
//! "Remote tier"): the jobs and results that pass between them, the fetch answers (`Answers`),
//! the job queues, the counters, and `Shared` with what both sides ask of it (key names,
//! headers, job sizes, wake-ups).
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering::{Acquire, Release, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::conn::BufPool;
use super::index::Tick;
use super::route::Router;
use super::{
    RemoteConfig, FETCH_JOB_BYTES, HEADER_FETCH_BYTES, MAX_FETCH_JOB_KEYS, MAX_HEADER_FETCHES,
    VALUE_HEADER_BYTES,
};

use crate::key::ByteKey;
use crate::manager::BlockId;
use crate::tier::{format, BlockMemory};

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

/// A write taken from the queue by an idle thread, with its payload's checksum (`None` where the
/// block could not be read; see `Shared::sum_ahead`).
pub(super) type SummedWrite = (WriteItem, Option<u64>);

pub(super) enum Job {
    /// Keys and the tickets of their answers (`Answers`).
    Fetch(Vec<ByteKey>, Vec<u32>),
    /// Promotions: keys, their reserved host blocks and their staged values (taken out of the
    /// index when the promotion was queued).
    Read(Vec<ReadItem>),
    /// Writes and, for each, its payload's checksum where an idle thread computed it ahead
    /// (`Shared::sum_ahead`).
    Write(Vec<(ByteKey, BlockId)>, Vec<Option<u64>>),
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

/// The job queues (multi-consumer channels: the I/O threads take from them in priority order,
/// promotions first, then fetches, then writes) and the bell that wakes idle threads.
///
/// An idle thread waits on `bell` alone (with `stop`), as one receiver: a ring wakes one thread.
/// The scheduler's side rings once per call that queued jobs (`Shared::ring`), and a thread that
/// takes a job while more wait rings again, so a burst of jobs wakes the threads one after the
/// other and the scheduler's thread pays for one wake-up at most (waiting for any of the three
/// queues instead made every job a wake-up of every idle thread: docs/performance.md "Tier tuning table"). A woken thread takes jobs
/// until the queues are empty, so
/// a job queued before a ring is never left behind; a ring left over only wakes a thread that
/// finds nothing.
pub(super) struct Queues {
    pub(super) reads: (Sender<Job>, Receiver<Job>),
    pub(super) fetches: (Sender<Job>, Receiver<Job>),
    pub(super) writes: (Sender<WriteItem>, Receiver<WriteItem>),
    /// Writes of large values taken from `writes` by an idle thread that computed their
    /// payloads' checksums (`Shared::sum_ahead`; `None` where the block could not be read):
    /// writers take from it first.
    pub(super) summed: (Sender<SummedWrite>, Receiver<SummedWrite>),
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
    /// Writes whose payload checksum an idle thread computed ahead (`Shared::sum_ahead`).
    pub(super) summed_ahead: AtomicU64,
}

pub(super) struct Shared {
    pub(super) cluster: bool,
    pub(super) router: Router,
    pub(super) url_redacted: String,
    /// The password's forms [`super::config::scrub`] takes out of every kept error text.
    pub(super) secrets: Vec<String>,
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
    /// Write jobs of large values running (at most `large_write_jobs`).
    pub(super) writes_running: std::sync::atomic::AtomicUsize,
    /// Fewest values of a write pipeline of large values ([`super::LARGE_WRITE_BATCH`] unless tuned).
    pub(super) large_write_batch: usize,
    /// Most write pipelines of large values at once (`large_write_jobs()` unless tuned).
    pub(super) large_write_jobs: usize,
    /// Most writes of large values taken from `writes` to be checksummed ahead, or waiting in
    /// `summed` (see `Shared::sum_ahead`); 0: none.
    pub(super) sum_ahead: usize,
    /// Writes taken to be checksummed ahead, or waiting in `summed`.
    pub(super) summing: std::sync::atomic::AtomicUsize,
    /// Most value bytes of one promotion job ([`super::FETCH_JOB_BYTES`] unless tuned).
    pub(super) read_job_bytes: usize,
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
        (self.read_job_bytes / self.value_len.max(1)).max(1)
    }

    /// Hands a result to the scheduler's side (dropped when the tier is gone).
    pub(super) fn send(&self, d: Done) {
        let _ = self.done.send(d);
    }

    /// Keeps `e` for `last_error`, scrubbed of the password and capped (docs/tier.md "Faults").
    pub(super) fn set_error(&self, e: String) {
        let e = super::config::scrub(e, &self.secrets);
        *lock(&self.last_error) = Some(e);
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
}
