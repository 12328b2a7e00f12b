//! The block store's state behind its lock: the tier (files or remote, [`Backend`]), the
//! writes queued and not yet reported, the finished jobs, the segments mode's slots ([`Inner`]),
//! and the helpers the Python methods share (running a closure on the state with or without the
//! GIL, batches of segment jobs, resolving lookups, the statistics dictionaries).
// Unsafe: `SlotMemory::set` with the caller's pieces (the block says which obligation holds).
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::super::enter::{blocking, locked, Hold};
use super::super::errors::to_py;
use super::segments::SlotMemory;
use super::{keys_of, shut, Active, PyBlockStore};
use crate::key::ByteKey;
use crate::manager::BlockId;
use crate::tier::secondary::{Known, SecondaryCounters, SecondaryTier};
use crate::tier::{Completion, FileTier, TierStats};
use crate::KvoffError;

/// The tier behind a block store: every job goes through [`SecondaryTier`]; the file tier's
/// extras through [`Backend::file`].
pub(super) enum Backend {
    File(FileTier),
    /// The remote or object tier, and its URL as shown (no password).
    Net(Box<dyn SecondaryTier>, String),
}

impl Backend {
    pub(super) fn sec(&self) -> &dyn SecondaryTier {
        match self {
            Self::File(t) => t,
            Self::Net(t, _) => &**t,
        }
    }

    pub(super) fn sec_mut(&mut self) -> &mut dyn SecondaryTier {
        match self {
            Self::File(t) => t,
            Self::Net(t, _) => &mut **t,
        }
    }

    pub(super) fn file(&self, what: &str) -> crate::Result<&FileTier> {
        match self {
            Self::File(t) => Ok(t),
            Self::Net(t, _) => Err(KvoffError::state(format!(
                "{what} is a file-tier operation; this block store is on the {} tier",
                t.kind()
            ))),
        }
    }

    pub(super) fn present(&self, key: &ByteKey) -> bool {
        self.sec().index(key) == Known::Present
    }
}

/// A write queued on the tier and not yet reported.
pub(super) struct PendingWrite {
    pub(super) block: BlockId,
    pub(super) released: bool,
}

pub(super) struct Inner {
    pub(super) tier: Backend,
    /// The process that opened the tier (a `fork()`ed child must open its own).
    pub(super) pid: u32,
    /// Segments mode: the slot memory and its free slots.
    pub(super) slots: Option<Arc<SlotMemory>>,
    pub(super) free: Vec<BlockId>,
    pub(super) writes: HashMap<ByteKey, PendingWrite, foldhash::fast::RandomState>,
    /// Rows mode: finished jobs not yet returned by `poll`.
    pub(super) done_writes: Vec<(ByteKey, BlockId, bool)>,
    pub(super) done_reads: Vec<(ByteKey, BlockId, bool)>,
    /// Segments mode: finished jobs by slot.
    pub(super) slot_done: HashMap<BlockId, bool, foldhash::fast::RandomState>,
}

impl Inner {
    /// Takes the tier's completions; a write is finished once its file is published or gone.
    pub(super) fn pump(&mut self) {
        for c in self.tier.sec().poll() {
            match c {
                Completion::Released { key, .. } => {
                    if let Some(w) = self.writes.get_mut(&key) {
                        w.released = true;
                    }
                }
                Completion::Promoted { key, block, ok } => {
                    if self.slots.is_some() {
                        self.slot_done.insert(block, ok);
                    } else {
                        self.done_reads.push((key, block, ok));
                    }
                }
            }
        }
        if self.writes.values().any(|w| w.released) {
            let tier = &self.tier;
            let mut finished = Vec::new();
            for (k, w) in &self.writes {
                if !w.released {
                    continue;
                }
                if tier.present(k) {
                    finished.push((k.clone(), w.block, true));
                } else if !tier.sec().has_or_writing(k) {
                    finished.push((k.clone(), w.block, false));
                }
            }
            for (k, block, ok) in finished {
                self.writes.remove(&k);
                if self.slots.is_some() {
                    self.slot_done.insert(block, ok);
                } else {
                    self.done_writes.push((k, block, ok));
                }
            }
        }
    }

    /// Asks the tier about the keys its index does not know (remote tier); returns how many it
    /// has not answered yet (those just asked and those whose fetch was already in flight).
    pub(super) fn fetch_unknown(&mut self, keys: &[ByteKey]) -> usize {
        self.pump();
        let t = self.tier.sec();
        let mut unknown = Vec::new();
        let mut in_flight = 0;
        for k in keys {
            match t.index(k) {
                Known::Unknown => unknown.push(k.clone()),
                Known::Pending => in_flight += 1,
                Known::Present | Known::Absent => {}
            }
        }
        if !unknown.is_empty() {
            t.submit_fetch(&unknown);
        }
        unknown.len() + in_flight
    }

    pub(super) fn check(&self) -> crate::Result<()> {
        if crate::process::id() != self.pid {
            return Err(KvoffError::state(
                "this block store was created in another process (before fork()); \
                 create a new one in this process",
            ));
        }
        Ok(())
    }
}
pub(super) fn stats_dict<'py>(py: Python<'py>, t: &TierStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("disk_files_written", t.files_written)?;
    d.set_item("disk_bytes_written", t.bytes_written)?;
    d.set_item("disk_write_seconds", t.write_seconds)?;
    d.set_item("disk_write_errors", t.write_errors)?;
    d.set_item("disk_writes_dropped", t.writes_dropped)?;
    d.set_item("disk_reads", t.promotions)?;
    d.set_item("disk_bytes_read", t.bytes_read)?;
    d.set_item("disk_read_seconds", t.read_seconds)?;
    d.set_item("disk_read_errors", t.read_errors)?;
    d.set_item("disk_corrupt_files", t.corrupt_files)?;
    d.set_item("disk_evicted_files", t.evicted_files)?;
    d.set_item("disk_indexed_files", t.indexed_files)?;
    d.set_item("disk_own_files", t.own_files)?;
    d.set_item("disk_own_bytes", t.own_bytes)?;
    d.set_item("disk_queued_reads", t.queued_reads)?;
    d.set_item("disk_queued_writes", t.queued_writes)?;
    d.set_item("disk_direct_io", t.direct_io)?;
    d.set_item("disk_last_error", t.last_error.clone())?;
    Ok(d)
}

/// Kinds of batch job in segments mode.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Dir {
    Write,
    Read,
}

impl PyBlockStore {
    pub(super) fn with<R: Send>(
        &self,
        py: Python<'_>,
        hold: Hold,
        f: impl FnOnce(&mut Inner) -> crate::Result<R> + Send,
    ) -> PyResult<R> {
        let on_panic = |s: &mut Option<Inner>| {
            if let Some(mut s) = s.take() {
                s.tier.sec_mut().shutdown();
            }
        };
        locked(py, &self.inner, hold, on_panic, |g| {
            let s = g.as_mut().ok_or_else(shut)?;
            s.check()?;
            f(s)
        })
    }

    /// The keys, after fetching those the remote tier does not know when `wait_s` > 0.
    pub(super) fn resolved(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        wait_s: f64,
    ) -> PyResult<Vec<ByteKey>> {
        let k = keys_of(keys)?;
        if !(wait_s.is_finite() && (0.0..1e6).contains(&wait_s)) {
            return Err(to_py(KvoffError::arg(format!(
                "wait_s must be >= 0 and finite, got {wait_s}"
            ))));
        }
        if wait_s == 0.0 {
            return Ok(k);
        }
        let lock = &self.inner;
        blocking(py, move || {
            resolve(lock, &k, Duration::from_secs_f64(wait_s))?;
            Ok(k)
        })
    }

    /// Runs one batch in segments mode: queues as many keys as there are free slots, waits (GIL
    /// released, lock not held between rounds) for them, until every key is done.
    pub(super) fn run_segments(
        &self,
        py: Python<'_>,
        dir: Dir,
        keys: Vec<ByteKey>,
        pieces: Vec<Vec<(u64, usize)>>,
    ) -> PyResult<Vec<bool>> {
        let n = keys.len();
        let mut result = vec![false; n];
        // (key index, slot) in flight.
        let mut inflight: Vec<(usize, BlockId)> = Vec::new();
        let mut next = 0usize;
        let mut pieces: Vec<Option<Vec<(u64, usize)>>> = pieces.into_iter().map(Some).collect();
        let lock = &self.inner;
        // Counted before the first submission (which happens under `lock`): `shutdown` takes the
        // tier under the same lock only when no call is counted, so no call's pieces are still
        // in use when the tier goes.
        let _active = Active::enter(&self.active);
        blocking(py, move || {
            if dir == Dir::Read {
                // The remote tier reads only keys its index knows to be there: ask for the
                // others first (bounded by the tier's timeouts; the file tier knows every key).
                resolve(lock, &keys, RESOLVE_WAIT)?;
            }
            let mut idle_rounds = 0u32;
            loop {
                let progressed;
                {
                    let mut g = lock.lock().unwrap_or_else(PoisonError::into_inner);
                    let s = g.as_mut().ok_or_else(shut)?;
                    s.check()?;
                    let Some(mem) = s.slots.clone() else {
                        return Err(KvoffError::state(
                            "this block store was made over rows: use submit_write/submit_read",
                        ));
                    };
                    s.pump();
                    let before = inflight.len();
                    inflight.retain(|&(i, slot)| match s.slot_done.remove(&slot) {
                        Some(ok) => {
                            result[i] = ok;
                            s.free.push(slot);
                            false
                        }
                        None => true,
                    });
                    let mut moved = before != inflight.len();
                    while next < n {
                        let i = next;
                        let key = &keys[i];
                        if dir == Dir::Write && s.tier.sec().has_or_writing(key) {
                            // Already stored (or being stored by another caller).
                            result[i] = true;
                            next += 1;
                            moved = true;
                            continue;
                        }
                        let Some(slot) = s.free.pop() else { break };
                        let p = pieces[i].take().unwrap_or_default();
                        // SAFETY: obligations 1 and 2 of `SlotMemory::set` are the caller's,
                        // documented on `BlockStore.write_segments`/`read_segments`: the pieces
                        // stay valid and untouched until this call returns, and it returns only
                        // once the job using this slot has finished (no timeout).
                        if let Err(e) = unsafe { mem.set(slot, p) } {
                            s.free.push(slot);
                            return Err(e);
                        }
                        let queued = match dir {
                            Dir::Write => {
                                let q = submit_one(s.tier.sec(), key, slot, Dir::Write);
                                if q {
                                    s.writes.insert(
                                        key.clone(),
                                        PendingWrite {
                                            block: slot,
                                            released: false,
                                        },
                                    );
                                }
                                q
                            }
                            Dir::Read => submit_one(s.tier.sec(), key, slot, Dir::Read),
                        };
                        next += 1;
                        moved = true;
                        if queued {
                            inflight.push((i, slot));
                        } else {
                            s.free.push(slot);
                        }
                    }
                    progressed = moved;
                    if next >= n && inflight.is_empty() {
                        return Ok(std::mem::take(&mut result));
                    }
                }
                // Short sleeps while jobs finish quickly, longer ones on a slow disk.
                idle_rounds = if progressed { 0 } else { idle_rounds + 1 };
                let us = if idle_rounds < 20 { 50 } else { 500 };
                std::thread::sleep(Duration::from_micros(us));
            }
        })
    }
}

/// How long `read_segments` waits for the remote tier to learn about the keys it reads (each
/// fetch is bounded by the tier's own I/O timeout; this bounds the rounds).
const RESOLVE_WAIT: Duration = Duration::from_secs(10);

pub(super) fn submit_one(t: &dyn SecondaryTier, key: &ByteKey, block: BlockId, dir: Dir) -> bool {
    let item = [(key.clone(), block)];
    let q = match dir {
        Dir::Write => t.submit_writes(&item),
        Dir::Read => t.submit_reads(&item),
    };
    q.first().copied().unwrap_or(false)
}

/// Fetches the keys the tier's index does not know and waits (call it inside `blocking`: GIL
/// released; the lock is taken only briefly each round) until it knows them all or `wait` passed.
/// The file tier knows every key: it returns at once.
pub(super) fn resolve(
    lock: &Mutex<Option<Inner>>,
    keys: &[ByteKey],
    wait: Duration,
) -> crate::Result<()> {
    let deadline = Instant::now() + wait;
    loop {
        {
            let mut g = lock.lock().unwrap_or_else(PoisonError::into_inner);
            let s = g.as_mut().ok_or_else(shut)?;
            s.check()?;
            if matches!(s.tier, Backend::File(_)) || s.fetch_unknown(keys) == 0 {
                return Ok(());
            }
        }
        if Instant::now() >= deadline {
            return Ok(());
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The remote or object tier's counters under `<kind>_*` names (docs/tier.md "The block store").
pub(super) fn net_stats_dict<'py>(
    py: Python<'py>,
    kind: &str,
    c: &SecondaryCounters,
    extra: &[(&'static str, u64)],
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item(format!("{kind}_writes"), c.writes)?;
    d.set_item(format!("{kind}_bytes_written"), c.bytes_written)?;
    d.set_item(format!("{kind}_write_seconds"), c.write_seconds)?;
    d.set_item(format!("{kind}_write_errors"), c.write_errors)?;
    d.set_item(format!("{kind}_writes_dropped"), c.writes_dropped)?;
    d.set_item(format!("{kind}_reads"), c.promotions)?;
    d.set_item(format!("{kind}_bytes_read"), c.bytes_read)?;
    d.set_item(format!("{kind}_read_seconds"), c.read_seconds)?;
    d.set_item(format!("{kind}_read_errors"), c.read_errors)?;
    d.set_item(format!("{kind}_rejected_values"), c.rejected)?;
    d.set_item(format!("{kind}_fetch_hits"), c.fetch_hits)?;
    d.set_item(format!("{kind}_fetch_misses"), c.fetch_misses)?;
    d.set_item(format!("{kind}_fetch_errors"), c.fetch_errors)?;
    d.set_item(format!("{kind}_reconnects"), c.reconnects)?;
    d.set_item(format!("{kind}_queued_reads"), c.queued_reads)?;
    d.set_item(format!("{kind}_queued_writes"), c.queued_writes)?;
    d.set_item(format!("{kind}_last_error"), c.last_error.clone())?;
    for (name, v) in extra {
        d.set_item(format!("{kind}_{name}"), *v)?;
    }
    Ok(d)
}
