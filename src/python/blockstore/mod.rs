//! `BlockStore`: one of kvoff's secondary tiers (docs/tier.md "Secondary tiers": the file tier, or
//! the remote tier on Redis/Valkey) as a plain block store, for engines that own their host
//! memory — SGLang's HiCache host pool (`kvoff.sglang`) and vLLM 0.33's CPU tier under its
//! `TieringOffloadingSpec` (`kvoff.vllm.tiering`). See docs/tier.md "The block store".
//!
//! No host manager is involved: the engine says which host bytes belong to which key, and the
//! tier's I/O threads copy them to and from files (or the server) with the tier's header,
//! checksum and namespace rules. Every job goes through the [`SecondaryTier`] trait; only the
//! file tier's extras (its directory, a key's path, removal, rescans) are asked of it by name.
//! Two ways to name the host bytes, fixed at construction:
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
//! The remote tier's index may not know a key (docs/tier.md "Remote tier"): `lookup` starts a
//! fetch for such keys and answers `None` for them; `contains_many`/`leading_run` with `wait_s`
//! fetch them and wait (GIL released, lock not held) up to that long; `read_segments` fetches the
//! keys it is asked for first (bounded by the tier's timeouts).
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

mod segments;
mod state;

use state::{net_stats_dict, stats_dict, Backend, Dir, Inner, PendingWrite};

use super::args::Int;
use super::enter::{blocking, Hold};
use super::errors::{to_py, IntoPyResult};
use super::tiers::{self, FileSettings, ObjectSettings, RemoteSettings, Settings};
use crate::key::ByteKey;
use crate::manager::BlockId;
use crate::tier::object::ObjectTier;
use crate::tier::remote::RemoteTier;
use crate::tier::secondary::{Known, SecondaryCounters};
use crate::tier::{BlockMemory, FileTier, RawRows, TierStats};
use crate::KvoffError;
use segments::{split_pieces, SlotMemory};

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
pub(super) struct Active<'a>(&'a AtomicUsize);

impl<'a> Active<'a> {
    pub(super) fn enter(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        Self(n)
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(super) fn shut() -> KvoffError {
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

pub(super) fn keys_of(keys: &Bound<'_, PyAny>) -> PyResult<Vec<ByteKey>> {
    keys.try_iter()?.map(|k| bytes_key(&k?)).collect()
}

/// Rows mode's `(key, row)` pairs: `keys` and `blocks` of one length.
fn keyed_rows(keys: &Bound<'_, PyAny>, blocks: Vec<BlockId>) -> PyResult<Vec<(ByteKey, BlockId)>> {
    let keys = keys_of(keys)?;
    if keys.len() != blocks.len() {
        return Err(to_py(KvoffError::arg("keys and blocks differ in length")));
    }
    Ok(keys.into_iter().zip(blocks).collect())
}

/// Refuses a rows-mode call on a store given segments (`instead`: the call to use).
fn rows_only(s: &Inner, instead: &str) -> crate::Result<()> {
    if s.slots.is_some() {
        return Err(KvoffError::state(format!(
            "this block store has no rows: use {instead}"
        )));
    }
    Ok(())
}

#[pymethods]
impl PyBlockStore {
    /// See `kvoff.BlockStore` in `_native.pyi`; the settings are read by [`super::tiers`].
    #[new]
    #[pyo3(signature = (
        path, capacity_bytes, block_bytes, *, rows = None, memory_owner = None, slots = Int::of(512),
        owner = None, **settings
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: Option<std::path::PathBuf>,
        capacity_bytes: Int,
        block_bytes: Int,
        rows: Option<(Int, Int, Int)>,
        memory_owner: Option<Py<PyAny>>,
        slots: Int,
        owner: Option<String>,
        settings: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let capacity_bytes: u64 = capacity_bytes.get("capacity_bytes")?;
        let block_bytes: usize = block_bytes.get("block_bytes")?;
        let slots: usize = slots.get("slots")?;
        let rows = rows
            .map(|(p, n, s)| -> PyResult<(u64, u64, u64)> {
                Ok((p.get("rows[0]")?, n.get("rows[1]")?, s.get("rows[2]")?))
            })
            .transpose()?;
        let s = Settings::new(py, settings)?;
        let layout = tiers::layout(&s)?;
        let file = FileSettings::read(&s)?;
        let mut remote = RemoteSettings::read(&s)?;
        let object = ObjectSettings::read(&s)?;
        s.finish("BlockStore")?;
        let named = [path.is_some(), remote.url.is_some(), object.url.is_some()];
        if named.iter().filter(|&&n| n).count() != 1 {
            return Err(to_py(KvoffError::Config(
                "a block store needs one of a path (the file tier), remote_url (the remote tier) \
                 or object_url (the object tier)"
                    .into(),
            )));
        }
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
        let tier = if remote.url.is_some() {
            // The block store's remote tier runs the store's `io_threads` and queue unless the
            // remote ones are given (docs/tier.md "The block store": the engine waits on each
            // batch there, where the tiered manager writes behind and fetches ahead).
            remote.io_threads = remote.io_threads.or(Some(file.io_threads));
            remote.max_queued_writes = remote.max_queued_writes.or(Some(file.max_queued_writes));
            let rc = remote.config(layout, owner);
            let t = blocking(py, move || RemoteTier::open(rc, mem))?;
            let shown = t.url().to_owned();
            Backend::Net(Box::new(t), shown)
        } else if object.url.is_some() {
            // The budget: object_bytes_to_use, else the store's capacity_bytes.
            let bytes = object.bytes_to_use.unwrap_or(capacity_bytes);
            let oc = object.config(bytes, layout, owner);
            let shown = oc.url.clone();
            let t = blocking(py, move || ObjectTier::open(oc, mem))?;
            Backend::Net(Box::new(t), shown)
        } else {
            let tc = file.config(path.unwrap_or_default(), capacity_bytes, layout, owner);
            Backend::File(blocking(py, move || FileTier::open(tc, mem))?)
        };
        let free = if slot_mem.is_some() {
            (0..u32::try_from(slots).unwrap_or(0)).rev().collect()
        } else {
            Vec::new()
        };
        Ok(Self {
            inner: Mutex::new(Some(Inner {
                tier,
                pid: crate::process::id(),
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
    fn block_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, Hold::Brief, |_| Ok(()))?;
        Ok(self.block_bytes)
    }

    /// Rows mode: queues writes of rows `blocks` as `keys`' files. Per key, whether it was queued
    /// (`False`: already stored or being stored, queue full, capacity).
    fn submit_write(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        blocks: Vec<BlockId>,
    ) -> PyResult<Vec<bool>> {
        let items = keyed_rows(keys, blocks)?;
        self.with(py, Hold::Brief, move |s| {
            rows_only(s, "write_segments")?;
            s.pump();
            let out = s.tier.sec().submit_writes(&items);
            for ((k, b), &q) in items.into_iter().zip(&out) {
                if q {
                    s.writes.insert(
                        k,
                        PendingWrite {
                            block: b,
                            released: false,
                        },
                    );
                }
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
        let items = keyed_rows(keys, blocks)?;
        self.with(py, Hold::Brief, move |s| {
            rows_only(s, "read_segments")?;
            s.pump();
            Ok(s.tier.sec().submit_reads(&items))
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

    /// Whether the tier's index holds `key` (no I/O; the remote tier: `False` also while it does
    /// not know — see `lookup`).
    fn contains(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let k = bytes_key(key)?;
        self.with(py, Hold::Brief, move |s| {
            s.pump();
            Ok(s.tier.present(&k))
        })
    }

    /// Per key what the tier's index knows (never waits): `True` held, `False` not held, `None`
    /// unknown — the remote tier then starts a fetch for it; ask again later.
    fn lookup(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<Option<bool>>> {
        let k = keys_of(keys)?;
        self.with(py, Hold::Brief, move |s| {
            s.fetch_unknown(&k);
            let t = s.tier.sec();
            Ok(k.iter()
                .map(|k| match t.index(k) {
                    Known::Present => Some(true),
                    Known::Absent => Some(false),
                    Known::Unknown | Known::Pending => None,
                })
                .collect())
        })
    }

    /// `contains` for each key. With `wait_s` > 0 the keys the remote tier's index does not know
    /// are fetched first, waiting (GIL released) up to `wait_s`; else no I/O.
    #[pyo3(signature = (keys, wait_s = 0.0))]
    fn contains_many(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        wait_s: f64,
    ) -> PyResult<Vec<bool>> {
        let k = self.resolved(py, keys, wait_s)?;
        self.with(py, Hold::Brief, move |s| {
            Ok(k.iter().map(|k| s.tier.present(k)).collect())
        })
    }

    /// Number of leading keys the tier holds; `wait_s` as in `contains_many`.
    #[pyo3(signature = (keys, wait_s = 0.0))]
    fn leading_run(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, wait_s: f64) -> PyResult<usize> {
        let k = self.resolved(py, keys, wait_s)?;
        self.with(py, Hold::Brief, move |s| {
            Ok(k.iter().take_while(|k| s.tier.present(k)).count())
        })
    }

    /// The tier: `"disk"` (files) or `"remote"` (Redis/Valkey).
    #[getter]
    fn kind(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.with(py, Hold::Brief, |s| Ok(s.tier.sec().kind()))
    }

    /// File tier: removes `key`'s file if this instance owns it (queued). Returns whether it did;
    /// `False` on the remote tier (values there expire by TTL or the server's eviction).
    fn remove(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let k = bytes_key(key)?;
        self.with(py, Hold::Brief, move |s| match &s.tier {
            Backend::File(t) => Ok(t.remove_own(&k)),
            Backend::Net(..) => Ok(false),
        })
    }

    /// The directory of this layout's files; the remote tier: its URL, password hidden.
    #[getter]
    fn dir(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, Hold::Brief, |s| {
            Ok(match &s.tier {
                Backend::File(t) => t.dir().display().to_string(),
                Backend::Net(_, shown) => shown.clone(),
            })
        })
    }

    /// File tier: path of a key's file (whether or not it exists).
    fn path_of(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<String> {
        let k = bytes_key(key)?;
        self.with(py, Hold::Brief, move |s| {
            Ok(s.tier.file("path_of")?.path_of(&k).display().to_string())
        })
    }

    /// Counters and gauges: the file tier's `disk_*` (as `kvoff.tier.DISK_METRICS`; `disk_reads`
    /// counts reads), the remote tier's `remote_*` (`remote_reads` counts reads).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        enum St {
            File(TierStats),
            Net(&'static str, SecondaryCounters, Vec<(&'static str, u64)>),
        }
        let t = self.with(py, Hold::Brief, |s| {
            s.pump();
            Ok(match &s.tier {
                Backend::File(t) => St::File(t.stats()),
                Backend::Net(t, _) => St::Net(t.kind(), t.counters(), t.extra_stats()),
            })
        })?;
        match t {
            St::File(t) => stats_dict(py, &t),
            St::Net(kind, c, e) => net_stats_dict(py, kind, &c, &e),
        }
    }

    /// Number of jobs queued or running and not yet reported.
    fn num_pending(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, Hold::Brief, |s| {
            s.pump();
            let c = s.tier.sec().counters();
            let q = usize::try_from(c.queued_reads + c.queued_writes).unwrap_or(usize::MAX);
            Ok(q.max(s.writes.len()))
        })
    }

    /// Waits (GIL released, lock not held) until the queued I/O has run (the remote tier: or
    /// given up after its timeouts); results stay for `poll`.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let waiter = self.with(py, Hold::Brief, |s| {
            Ok(match &s.tier {
                Backend::File(t) => Some(t.idle_waiter()),
                Backend::Net(..) => None,
            })
        })?;
        let lock = &self.inner;
        blocking(py, move || {
            if let Some(w) = waiter {
                w.wait();
                return Ok(());
            }
            loop {
                {
                    let mut g = lock.lock().unwrap_or_else(PoisonError::into_inner);
                    let s = g.as_mut().ok_or_else(shut)?;
                    s.pump();
                    let busy = s.tier.sec().busy() || s.writes.values().any(|w| !w.released);
                    if !busy {
                        return Ok(());
                    }
                }
                std::thread::sleep(Duration::from_micros(500));
            }
        })?;
        self.with(py, Hold::Brief, |s| {
            s.pump();
            Ok(())
        })
    }

    /// File tier: lists the directory again now (other engines' new files become visible; GIL
    /// released). The remote tier: nothing to do (its index asks the server).
    fn rescan(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, Hold::Long, |s| {
            if let Backend::File(t) = &s.tier {
                t.rescan();
            }
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
                s.tier.sec_mut().shutdown();
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
