//! `BlockStore`: kvoff's file tier (docs/tier.md) as a plain block store, for engines that own
//! their host memory — SGLang's HiCache host pool (`kvoff.sglang`) and vLLM 0.33's CPU tier under
//! its `TieringOffloadingSpec` (`kvoff.vllm.tiering`). See docs/tier.md "The block store".
//!
//! No host manager is involved: the engine says which host bytes belong to which key, and the
//! tier's I/O threads copy them to and from files with the tier's header, checksum and namespace
//! rules. Two ways to name the host bytes, fixed at construction:
//! - **rows** (`rows=(ptr, num_rows, row_stride_bytes)`): block `i` is row `i` of one buffer
//!   (vLLM's CPU tier). `submit_write`/`submit_read` queue jobs and return at once; `poll` returns
//!   the finished ones. With 4 KiB-aligned rows and `O_DIRECT` the bytes move straight between the
//!   file and the row (no copy).
//! - **segments** (no `rows`): each key's block is a list of `(pointer, length)` pieces anywhere in
//!   host memory (SGLang's layer-first pool: one piece per layer and K/V). `write_segments` and
//!   `read_segments` queue the batch on the I/O threads (at most `slots` blocks in flight) and wait
//!   for it with the GIL released; the I/O thread gathers or scatters the pieces through its buffer.
//!
//! `contains`, `contains_many` and `leading_run` answer from the tier's in-memory index (no I/O).
//! Keys are converted before the lock is taken and Python objects built after it is released;
//! every wait releases the GIL and holds no kvoff lock.
// Unsafe: `RawRows::new` over the caller's rows and `SlotMemory::set` (`segments`) with the
// caller's pieces; each block says which obligation of the caller's contract holds.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::enter::{blocking, locked, Hold};
use super::errors::{to_py, IntoPyResult};
use super::names::parse_direct_io;
use super::segments::{split_pieces, SlotMemory};
use crate::key::ByteKey;
use crate::manager::BlockId;
use crate::tier::{BlockMemory, Completion, FileTier, Layout, RawRows, TierConfig, TierStats};
use crate::KvoffError;

/// A write queued on the tier and not yet reported.
struct PendingWrite {
    block: BlockId,
    released: bool,
}

struct Inner {
    tier: FileTier,
    /// Segments mode: the slot memory and its free slots.
    slots: Option<Arc<SlotMemory>>,
    free: Vec<BlockId>,
    writes: HashMap<ByteKey, PendingWrite, foldhash::fast::RandomState>,
    /// Rows mode: finished jobs not yet returned by `poll`.
    done_writes: Vec<(ByteKey, BlockId, bool)>,
    done_reads: Vec<(ByteKey, BlockId, bool)>,
    /// Segments mode: finished jobs by slot.
    slot_done: HashMap<BlockId, bool, foldhash::fast::RandomState>,
}

impl Inner {
    /// Takes the tier's completions; a write is finished once its file is published or gone.
    fn pump(&mut self) {
        for c in self.tier.poll() {
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
                if tier.contains(k) {
                    finished.push((k.clone(), w.block, true));
                } else if !tier.has_or_writing(k) {
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

    fn check(&self) -> crate::Result<()> {
        if self.tier.forked() {
            return Err(KvoffError::state(
                "this block store was created in another process (before fork()); \
                 create a new one in this process",
            ));
        }
        Ok(())
    }
}

/// The block store: see the module docs.
#[pyclass(name = "BlockStore", module = "kvoff._native", frozen)]
pub struct PyBlockStore {
    inner: Mutex<Option<Inner>>,
    /// Keeps the object that owns the rows alive while the tier may copy into them.
    owner: Mutex<Option<Py<PyAny>>>,
    block_bytes: usize,
    /// Segments-mode calls in progress: `shutdown` waits for them (their pieces are in use by the
    /// I/O threads until they return).
    active: AtomicUsize,
}

/// Counts one segments-mode call for as long as it lives.
struct Active<'a>(&'a AtomicUsize);

impl<'a> Active<'a> {
    fn enter(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        Self(n)
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn shut() -> KvoffError {
    KvoffError::state("the block store is shut down")
}

fn bytes_key(k: &Bound<'_, PyAny>) -> PyResult<ByteKey> {
    let b = k.cast::<PyBytes>().map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "keys must be bytes, got {}",
            k.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    Ok(ByteKey::new(b.as_bytes()))
}

fn keys_of(keys: &Bound<'_, PyAny>) -> PyResult<Vec<ByteKey>> {
    keys.try_iter()?.map(|k| bytes_key(&k?)).collect()
}

fn stats_dict<'py>(py: Python<'py>, t: &TierStats) -> PyResult<Bound<'py, PyDict>> {
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
enum Dir {
    Write,
    Read,
}

impl PyBlockStore {
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        hold: Hold,
        f: impl FnOnce(&mut Inner) -> crate::Result<R> + Send,
    ) -> PyResult<R> {
        let on_panic = |s: &mut Option<Inner>| {
            if let Some(mut s) = s.take() {
                s.tier.shutdown();
            }
        };
        locked(py, &self.inner, hold, on_panic, |g| {
            let s = g.as_mut().ok_or_else(shut)?;
            s.check()?;
            f(s)
        })
    }

    /// Runs one batch in segments mode: queues as many keys as there are free slots, waits (GIL
    /// released, lock not held between rounds) for them, until every key is done.
    fn run_segments(
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
                        if dir == Dir::Write && s.tier.has_or_writing(key) {
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
                                let q = s.tier.submit_write(key, slot);
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
                            Dir::Read => s.tier.submit_read(key, slot),
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

#[pymethods]
impl PyBlockStore {
    /// See `kvoff.BlockStore` in `_native.pyi`.
    #[new]
    #[pyo3(signature = (
        path, capacity_bytes, block_bytes, *, rows = None, memory_owner = None, slots = 512,
        namespace = String::new(), page_sizes = Vec::new(), block_size_factor = 1,
        dtype = String::new(), world_size = 1, rank = 0, io_threads = 8, write_threads = 4,
        max_queued_writes = 256, fsync = false, direct_io = "auto", rescan_interval_s = Some(2.0),
        owner = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        capacity_bytes: u64,
        block_bytes: usize,
        rows: Option<(u64, u64, u64)>,
        memory_owner: Option<Py<PyAny>>,
        slots: usize,
        namespace: String,
        page_sizes: Vec<u64>,
        block_size_factor: u64,
        dtype: String,
        world_size: u32,
        rank: u32,
        io_threads: usize,
        write_threads: usize,
        max_queued_writes: usize,
        fsync: bool,
        direct_io: &str,
        rescan_interval_s: Option<f64>,
        owner: Option<String>,
    ) -> PyResult<Self> {
        let direct = parse_direct_io(direct_io)?;
        let rescan = match rescan_interval_s {
            None => None,
            Some(s) if s.is_finite() && s > 0.0 && s < 1e6 => Some(Duration::from_secs_f64(s)),
            Some(s) => {
                return Err(to_py(KvoffError::arg(format!(
                    "rescan_interval_s must be > 0 and finite, or None; got {s}"
                ))))
            }
        };
        if block_bytes == 0 || block_bytes > (1 << 34) {
            return Err(to_py(KvoffError::arg(format!(
                "block_bytes must be in 1..=16 GiB, got {block_bytes}"
            ))));
        }
        let (mem, slot_mem): (Arc<dyn BlockMemory>, Option<Arc<SlotMemory>>) =
            if let Some((ptr, num_rows, stride)) = rows {
                if memory_owner.is_none() {
                    return Err(to_py(KvoffError::arg(
                        "rows need memory_owner (the object that owns the memory)",
                    )));
                }
                // SAFETY: obligation 1 of `RawRows::new` is the caller's, documented on
                // `BlockStore` (the rows belong to `memory_owner`, kept alive until `shutdown`);
                // obligation 2 is the caller's protocol for `submit_write`/`submit_read`
                // (vLLM pins a store's rows and does not read a load's until it finished).
                let m = unsafe { RawRows::new(ptr, num_rows, stride, block_bytes) }.py()?;
                (Arc::new(m), None)
            } else {
                if slots == 0 || slots > 1 << 16 {
                    return Err(to_py(KvoffError::arg(format!(
                        "slots must be in 1..=65536, got {slots}"
                    ))));
                }
                let m = Arc::new(SlotMemory::new(slots, block_bytes));
                (m.clone() as Arc<dyn BlockMemory>, Some(m))
            };
        let mut tc = TierConfig::new(
            path,
            capacity_bytes,
            Layout {
                namespace,
                page_sizes_bytes: page_sizes,
                block_size_factor,
                dtype,
                world_size,
                rank,
            },
        );
        tc.io_threads = io_threads;
        tc.write_threads = write_threads;
        tc.max_queued_writes = max_queued_writes;
        tc.fsync = fsync;
        tc.direct_io = direct;
        tc.rescan_interval = rescan;
        tc.owner = owner;
        let tier = blocking(py, move || FileTier::open(tc, mem))?;
        let free = if slot_mem.is_some() {
            (0..u32::try_from(slots).unwrap_or(0)).rev().collect()
        } else {
            Vec::new()
        };
        Ok(Self {
            inner: Mutex::new(Some(Inner {
                tier,
                slots: slot_mem,
                free,
                writes: HashMap::default(),
                done_writes: Vec::new(),
                done_reads: Vec::new(),
                slot_done: HashMap::default(),
            })),
            owner: Mutex::new(memory_owner),
            block_bytes,
            active: AtomicUsize::new(0),
        })
    }

    /// Bytes of one block.
    #[getter]
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Rows mode: queues writes of rows `blocks` as `keys`' files. Per key, whether it was queued
    /// (`False`: already stored or being stored, queue full, capacity).
    fn submit_write(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        blocks: Vec<BlockId>,
    ) -> PyResult<Vec<bool>> {
        let keys = keys_of(keys)?;
        if keys.len() != blocks.len() {
            return Err(to_py(KvoffError::arg("keys and blocks differ in length")));
        }
        self.with(py, Hold::Brief, move |s| {
            if s.slots.is_some() {
                return Err(KvoffError::state(
                    "this block store has no rows: use write_segments",
                ));
            }
            s.pump();
            let mut out = Vec::with_capacity(keys.len());
            for (k, b) in keys.iter().zip(blocks) {
                let q = s.tier.submit_write(k, b);
                if q {
                    s.writes.insert(
                        k.clone(),
                        PendingWrite {
                            block: b,
                            released: false,
                        },
                    );
                }
                out.push(q);
            }
            Ok(out)
        })
    }

    /// Rows mode: queues reads of `keys`' files into rows `blocks`. Per key, whether it was queued
    /// (`False`: no published file indexed).
    fn submit_read(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        blocks: Vec<BlockId>,
    ) -> PyResult<Vec<bool>> {
        let keys = keys_of(keys)?;
        if keys.len() != blocks.len() {
            return Err(to_py(KvoffError::arg("keys and blocks differ in length")));
        }
        self.with(py, Hold::Brief, move |s| {
            if s.slots.is_some() {
                return Err(KvoffError::state(
                    "this block store has no rows: use read_segments",
                ));
            }
            s.pump();
            Ok(keys
                .iter()
                .zip(blocks)
                .map(|(k, b)| s.tier.submit_read(k, b))
                .collect())
        })
    }

    /// Rows mode: the jobs finished since the last call, as `(writes, reads)`, each a list of
    /// `(key, block, ok)`. A write is finished once its file is published (`ok`) or failed; its
    /// row may be reused from then on (from its release on, in fact). Never blocks on I/O.
    #[allow(clippy::type_complexity)]
    fn poll<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(
        Vec<(Bound<'py, PyBytes>, BlockId, bool)>,
        Vec<(Bound<'py, PyBytes>, BlockId, bool)>,
    )> {
        let (w, r) = self.with(py, Hold::Brief, |s| {
            s.pump();
            Ok((
                std::mem::take(&mut s.done_writes),
                std::mem::take(&mut s.done_reads),
            ))
        })?;
        let conv = |v: Vec<(ByteKey, BlockId, bool)>| {
            v.into_iter()
                .map(|(k, b, ok)| (PyBytes::new(py, k.as_bytes()), b, ok))
                .collect::<Vec<_>>()
        };
        Ok((conv(w), conv(r)))
    }

    /// Segments mode: writes each key's block from its pieces and waits (GIL released) until
    /// every file is published or failed. `ptrs`/`sizes` are flat, the same number of pieces per
    /// key, adding up to `block_bytes`. Per key, whether it is stored (`True` also when it already
    /// was). The memory must stay valid and unchanged until this returns.
    #[allow(clippy::needless_pass_by_value)] // arguments extracted by PyO3
    fn write_segments(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        ptrs: Vec<u64>,
        sizes: Vec<u64>,
    ) -> PyResult<Vec<bool>> {
        let keys = keys_of(keys)?;
        let pieces = split_pieces(keys.len(), &ptrs, &sizes).py()?;
        self.run_segments(py, Dir::Write, keys, pieces)
    }

    /// Segments mode: reads each key's file into its pieces (checked before a byte lands) and
    /// waits (GIL released). Per key, whether its bytes arrived (`False`: no file, or it failed its
    /// checks and was removed). The memory must stay valid and untouched until this returns.
    #[allow(clippy::needless_pass_by_value)] // arguments extracted by PyO3
    fn read_segments(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        ptrs: Vec<u64>,
        sizes: Vec<u64>,
    ) -> PyResult<Vec<bool>> {
        let keys = keys_of(keys)?;
        let pieces = split_pieces(keys.len(), &ptrs, &sizes).py()?;
        self.run_segments(py, Dir::Read, keys, pieces)
    }

    /// Whether a published file for `key` is indexed (no I/O).
    fn contains(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let k = bytes_key(key)?;
        self.with(py, Hold::Brief, move |s| Ok(s.tier.contains(&k)))
    }

    /// `contains` for each key (no I/O).
    fn contains_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let k = keys_of(keys)?;
        self.with(py, Hold::Brief, move |s| {
            Ok(k.iter().map(|k| s.tier.contains(k)).collect())
        })
    }

    /// Number of leading keys with a published file (no I/O).
    fn leading_run(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let k = keys_of(keys)?;
        self.with(py, Hold::Brief, move |s| {
            Ok(k.iter().take_while(|k| s.tier.contains(k)).count())
        })
    }

    /// Removes `key`'s file if this instance owns it (queued). Returns whether it did.
    fn remove(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let k = bytes_key(key)?;
        self.with(py, Hold::Brief, move |s| Ok(s.tier.remove_own(&k)))
    }

    /// The directory of this layout's files.
    #[getter]
    fn dir(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, Hold::Brief, |s| Ok(s.tier.dir().display().to_string()))
    }

    /// Path of a key's file (whether or not it exists).
    fn path_of(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<String> {
        let k = bytes_key(key)?;
        self.with(py, Hold::Brief, move |s| {
            Ok(s.tier.path_of(&k).display().to_string())
        })
    }

    /// Counters and gauges (`disk_*`, as `kvoff.tier.DISK_METRICS`; `disk_reads` counts reads).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = self.with(py, Hold::Brief, |s| Ok(s.tier.stats()))?;
        stats_dict(py, &t)
    }

    /// Number of jobs queued or running and not yet reported.
    fn num_pending(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, Hold::Brief, |s| {
            s.pump();
            let st = s.tier.stats();
            let q = usize::try_from(st.queued_reads + st.queued_writes).unwrap_or(usize::MAX);
            Ok(q.max(s.writes.len()))
        })
    }

    /// Waits (GIL released, lock not held) until the queued I/O has run; results stay for `poll`.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let waiter = self.with(py, Hold::Brief, |s| Ok(s.tier.idle_waiter()))?;
        blocking(py, move || {
            waiter.wait();
            Ok(())
        })?;
        self.with(py, Hold::Brief, |s| {
            s.pump();
            Ok(())
        })
    }

    /// Lists the directory again now (other engines' new files become visible; GIL released).
    fn rescan(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, Hold::Long, |s| {
            s.tier.rescan();
            Ok(())
        })
    }

    /// Waits for segments calls in progress (other threads) and the queued I/O, then stops the
    /// I/O threads; idempotent. Later calls raise `InvalidStateError`.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let (lock, active) = (&self.inner, &self.active);
        let s = blocking(py, move || loop {
            {
                let mut g = lock.lock().unwrap_or_else(PoisonError::into_inner);
                if active.load(Ordering::SeqCst) == 0 {
                    return Ok(g.take());
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        })?;
        if let Some(mut s) = s {
            blocking(py, move || {
                s.tier.shutdown();
                Ok(())
            })?;
        }
        let owner = self
            .owner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(owner);
        Ok(())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBlockStore>()?;
    Ok(())
}
