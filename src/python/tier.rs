//! Bindings of the file tier (docs/spec.md §9): `TieredManagerCore`, a [`TieredManager`] over an LRU or ARC
//! manager with plain return values (the Python class `kvoff.tier.TieredOffloadingManager` wraps it
//! into docs/spec.md §2's types), and `bench_disk`.
//!
//! Keys are extracted before the lock is taken and Python objects are built after it is released;
//! calls that wait for I/O (`flush`, `reset`, `shutdown`, `bench_disk`) release the GIL.
// Unsafe: the one `RawRows::new` over the caller's host memory (see its SAFETY comment).
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::args::{Float, Int, PathArg};
use super::enter::{blocking, locked, Hold};
use super::errors::{to_py, IntoPyResult};
use super::names::parse_direct_io;
use super::region::{PyHostRegion, SharedRegion};
use crate::key::ByteKey;
use crate::manager::{AnyManager, BlockId, ManagerConfig, ManagerStats, PolicyKind, Presence};
use crate::tier::bench::{run as run_bench, DiskBenchConfig};
use crate::tier::tiered::{TieredConfig, TieredCounters, TieredManager};
use crate::tier::{BlockMemory, FileTier, Layout, RawRows, TierConfig, TierStats};
use crate::KvoffError;

/// The host manager behind the tier.
type Host = AnyManager<ByteKey>;

/// A tiered manager for Python: see the module docs.
#[pyclass(name = "TieredManagerCore", module = "kvoff._native", frozen)]
pub struct PyTieredCore {
    inner: Mutex<Option<TieredManager<Host>>>,
    /// Keeps the host region mapped while the tier may copy into it (dropped at `shutdown`, after
    /// the I/O threads are joined).
    region: Mutex<Option<SharedRegion>>,
    /// The process that created it: a `fork()`ed child takes none of its locks (docs/spec.md §9).
    pid: u32,
}

fn keys_of(keys: &Bound<'_, PyAny>) -> PyResult<Vec<ByteKey>> {
    let mut v = Vec::new();
    for k in keys.try_iter()? {
        let k = k?;
        let b = k.cast::<PyBytes>().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(format!(
                "keys must be bytes, got {}",
                k.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        v.push(ByteKey::new(b.as_bytes()));
    }
    Ok(v)
}

fn key_of(key: &Bound<'_, PyAny>) -> PyResult<ByteKey> {
    let b = key
        .cast::<PyBytes>()
        .map_err(|_| pyo3::exceptions::PyTypeError::new_err("a key must be bytes"))?;
    Ok(ByteKey::new(b.as_bytes()))
}

fn shut() -> KvoffError {
    KvoffError::state("the tiered manager is shut down")
}

impl PyTieredCore {
    fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    /// Runs `f` on the manager under its lock ([`locked`]): brief calls keep the GIL when the
    /// lock is free, `Hold::Long` ones (directory scans) always release it. A panic shuts the
    /// manager down.
    fn with_hold<R: Send>(
        &self,
        py: Python<'_>,
        hold: Hold,
        f: impl FnOnce(&mut TieredManager<Host>) -> crate::Result<R> + Send,
    ) -> PyResult<R> {
        // Before any lock: in a `fork()`ed child a parent thread may have held it at the fork.
        if self.forked() {
            return Err(to_py(KvoffError::state(
                "this tiered manager was created in another process (before fork()); \
                 create a new one in this process",
            )));
        }
        let on_panic = |m: &mut Option<TieredManager<Host>>| {
            if let Some(mut m) = m.take() {
                m.shutdown();
            }
        };
        locked(py, &self.inner, hold, on_panic, |g| {
            let m = g.as_mut().ok_or_else(shut)?;
            if m.tier().forked() {
                return Err(KvoffError::state(
                    "this tiered manager was created in another process (before fork()); \
                     create a new one in this process",
                ));
            }
            f(m)
        })
    }

    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut TieredManager<Host>) -> crate::Result<R> + Send,
    ) -> PyResult<R> {
        self.with_hold(py, Hold::Brief, f)
    }
}

fn stats_dict<'py>(
    py: Python<'py>,
    h: Option<&ManagerStats>,
    t: &TierStats,
    c: &TieredCounters,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    if let Some(s) = h {
        d.set_item("usage", s.usage)?;
        d.set_item("write_usage", s.write_usage)?;
        d.set_item("read_usage", s.read_usage)?;
        d.set_item("num_blocks", s.num_blocks)?;
        d.set_item("num_present", s.num_present)?;
        d.set_item("num_free", s.num_free)?;
        d.set_item("num_evictable", s.num_evictable)?;
        d.set_item("stores_skipped", s.stores_skipped)?;
    }
    d.set_item("disk_files_written", t.files_written)?;
    d.set_item("disk_bytes_written", t.bytes_written)?;
    d.set_item("disk_write_seconds", t.write_seconds)?;
    d.set_item("disk_write_errors", t.write_errors)?;
    d.set_item("disk_writes_dropped", t.writes_dropped)?;
    d.set_item("disk_promotions", t.promotions)?;
    d.set_item("disk_bytes_read", t.bytes_read)?;
    d.set_item("disk_read_seconds", t.read_seconds)?;
    d.set_item("disk_read_errors", t.read_errors)?;
    d.set_item("disk_corrupt_files", t.corrupt_files)?;
    d.set_item("disk_rejected_files", t.rejected_files)?;
    d.set_item("disk_evicted_files", t.evicted_files)?;
    d.set_item("disk_indexed_files", t.indexed_files)?;
    d.set_item("disk_own_files", t.own_files)?;
    d.set_item("disk_own_bytes", t.own_bytes)?;
    d.set_item("disk_queued_reads", t.queued_reads)?;
    d.set_item("disk_queued_writes", t.queued_writes)?;
    d.set_item("disk_direct_io", t.direct_io)?;
    d.set_item("disk_last_error", t.last_error.clone())?;
    d.set_item("disk_hits", c.disk_hits)?;
    d.set_item("disk_promotions_started", c.promotions_started)?;
    d.set_item("disk_promotions_failed", c.promotions_failed)?;
    d.set_item("disk_promotions_no_room", c.promotions_no_room)?;
    d.set_item("disk_writes_started", c.writes_started)?;
    d.set_item("disk_writes_below_threshold", c.writes_below_threshold)?;
    Ok(d)
}

#[pymethods]
impl PyTieredCore {
    /// See `kvoff.tier.TieredOffloadingManager`.
    #[new]
    #[pyo3(signature = (
        policy, num_blocks, disk_path, disk_bytes_to_use, memory_ptr, memory_rows, row_stride_bytes,
        block_bytes, memory_owner, *, namespace = String::new(), page_sizes = Vec::new(),
        block_size_factor = Int::of(1), dtype = String::new(), world_size = Int::of(1),
        rank = Int::of(0), block_size = Int::of(0), enable_events = false,
        store_threshold = Int::of(0), max_tracker_size = Int::of(64000),
        disk_store_threshold = Int::of(0), io_threads = Int::of(8), write_threads = Int::of(4),
        max_queued_writes = Int::of(256), fsync = false, direct_io = "auto",
        rescan_interval_s = Some(Float(2.0)), owner = None, max_promotions = Int::of(256),
        trusted_uids = Vec::new(), trusted_gid = None, allow_writable_dir = false
    ))]
    #[allow(clippy::too_many_arguments, clippy::fn_params_excessive_bools)]
    fn new(
        py: Python<'_>,
        policy: &str,
        num_blocks: Int,
        disk_path: PathArg,
        disk_bytes_to_use: Int,
        memory_ptr: Int,
        memory_rows: Int,
        row_stride_bytes: Int,
        block_bytes: Int,
        memory_owner: &Bound<'_, PyHostRegion>,
        namespace: String,
        page_sizes: Vec<Int>,
        block_size_factor: Int,
        dtype: String,
        world_size: Int,
        rank: Int,
        block_size: Int,
        enable_events: bool,
        store_threshold: Int,
        max_tracker_size: Int,
        disk_store_threshold: Int,
        io_threads: Int,
        write_threads: Int,
        max_queued_writes: Int,
        fsync: bool,
        direct_io: &str,
        rescan_interval_s: Option<Float>,
        owner: Option<String>,
        max_promotions: Int,
        trusted_uids: Vec<Int>,
        trusted_gid: Option<Int>,
        allow_writable_dir: bool,
    ) -> PyResult<Self> {
        // Every argument is converted (TypeError / ValueError) before anything is created.
        let num_blocks: usize = num_blocks.get("num_blocks")?;
        let disk_bytes_to_use: u64 = disk_bytes_to_use.get("disk_bytes_to_use")?;
        let memory_ptr: u64 = memory_ptr.get("memory_ptr")?;
        let memory_rows: u64 = memory_rows.get("memory_rows")?;
        let row_stride_bytes: u64 = row_stride_bytes.get("row_stride_bytes")?;
        let block_bytes: usize = block_bytes.get("block_bytes")?;
        let page_sizes = page_sizes
            .into_iter()
            .map(|p| p.get::<u64>("page_sizes[i]"))
            .collect::<PyResult<Vec<u64>>>()?;
        let block_size_factor: u64 = block_size_factor.get("block_size_factor")?;
        let world_size: u32 = world_size.get("world_size")?;
        let rank: u32 = rank.get("rank")?;
        let block_size: usize = block_size.get("block_size")?;
        let store_threshold: usize = store_threshold.get("store_threshold")?;
        let max_tracker_size: usize = max_tracker_size.get("max_tracker_size")?;
        let disk_store_threshold: u32 = disk_store_threshold.get("disk_store_threshold")?;
        let io_threads: usize = io_threads.get("io_threads")?;
        let write_threads: usize = write_threads.get("write_threads")?;
        let max_queued_writes: usize = max_queued_writes.get("max_queued_writes")?;
        let max_promotions: usize = max_promotions.get("max_promotions")?;
        let trusted_uids = trusted_uids
            .into_iter()
            .map(|u| u.get::<u32>("trusted_uids[i]"))
            .collect::<PyResult<Vec<u32>>>()?;
        let trusted_gid: Option<u32> = trusted_gid.map(|g| g.get("trusted_gid")).transpose()?;
        let direct = parse_direct_io(direct_io)?;
        if memory_rows < num_blocks as u64 {
            return Err(to_py(KvoffError::arg(format!(
                "the host memory has {memory_rows} rows but num_blocks = {num_blocks}"
            ))));
        }
        let rescan = match rescan_interval_s {
            None => None,
            Some(Float(s)) if s.is_finite() && s > 0.0 && s < 1e6 => {
                Some(Duration::from_secs_f64(s))
            }
            Some(Float(s)) => {
                return Err(to_py(KvoffError::arg(format!(
                    "rescan_interval_s must be > 0 and finite, or None; got {s}"
                ))))
            }
        };
        // The tier keeps the region's mapping alive (as a view does) until `shutdown`, so closing
        // the region first never unmaps memory the I/O threads copy into (docs/spec.md §5).
        let region = memory_owner.get().shared_region()?;
        let (base, len) = locked(
            py,
            &region,
            Hold::Brief,
            |_| {},
            |r| Ok((r.as_ptr(), r.len_bytes())),
        )?;
        let fits = memory_rows
            .checked_sub(1)
            .and_then(|last| last.checked_mul(row_stride_bytes))
            .and_then(|o| o.checked_add(block_bytes as u64))
            .and_then(|o| memory_ptr.checked_sub(base)?.checked_add(o))
            .is_some_and(|end| end <= len);
        if !fits || memory_ptr < base {
            return Err(to_py(KvoffError::arg(format!(
                "memory_ptr {memory_ptr:#x} with {memory_rows} rows of {row_stride_bytes} bytes \
                 ({block_bytes}-byte blocks) is not inside the region ({len} bytes at {base:#x})"
            ))));
        }
        // SAFETY: obligation 1 of `RawRows::new`: the rows were just checked to lie inside the
        // region's mapping, which `region` (an `Arc` of it, held until `shutdown` has joined the
        // I/O threads) keeps mapped. Obligation 2 is kept by `TieredManager` (write pins, pending
        // promotions).
        let memory =
            unsafe { RawRows::new(memory_ptr, memory_rows, row_stride_bytes, block_bytes) }.py()?;
        let mut mc = ManagerConfig::new(num_blocks);
        mc.block_size = block_size;
        mc.enable_events = enable_events;
        mc.store_threshold = store_threshold;
        mc.max_tracker_size = max_tracker_size;
        let host = Host::try_new(PolicyKind::parse(policy).py()?, mc).py()?;
        let mut tc = TierConfig::new(
            disk_path.0,
            disk_bytes_to_use,
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
        tc.trusted_uids = trusted_uids;
        tc.trusted_gid = trusted_gid;
        tc.allow_writable_dir = allow_writable_dir;
        let mem: Arc<dyn BlockMemory> = Arc::new(memory);
        let tier = blocking(py, move || FileTier::open(tc, mem))?;
        let cfg = TieredConfig {
            disk_store_threshold,
            max_tracker_size,
            max_promotions,
        };
        Ok(Self {
            inner: Mutex::new(Some(TieredManager::new(host, tier, cfg))),
            region: Mutex::new(Some(region)),
            pid: std::process::id(),
        })
    }

    /// `True` ready, `None` pending (store or promotion in flight), `False` absent.
    fn lookup(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Option<bool>> {
        let k = key_of(key)?;
        Ok(match self.with(py, |m| m.lookup(&k))? {
            Presence::Ready => Some(true),
            Presence::Pending => None,
            Presence::Absent => Some(false),
        })
    }

    /// Leading ready keys, or `None` when the first non-ready one is pending or being promoted.
    fn lookup_prefix(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        let k = keys_of(keys)?;
        self.with(py, |m| m.lookup_prefix(&k))
    }

    /// Pins the keys for a load; returns their block ids.
    fn prepare_load(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<BlockId>> {
        let k = keys_of(keys)?;
        self.with(py, |m| m.prepare_load(&k))
    }

    /// Recency update.
    fn touch(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = keys_of(keys)?;
        self.with(py, |m| m.touch(&k))
    }

    /// Unpins loaded keys.
    fn complete_load(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = keys_of(keys)?;
        self.with(py, |m| m.complete_load(&k))
    }

    /// `(keys_to_store, block_ids, evicted_keys)` or `None`.
    #[allow(clippy::type_complexity)]
    fn prepare_store<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<
        Option<(
            Vec<Bound<'py, PyBytes>>,
            Vec<BlockId>,
            Vec<Bound<'py, PyBytes>>,
        )>,
    > {
        let k = keys_of(keys)?;
        let out = self.with(py, |m| m.prepare_store(&k))?;
        Ok(out.map(|o| {
            (
                o.keys_to_store
                    .iter()
                    .map(|k| PyBytes::new(py, k.as_bytes()))
                    .collect(),
                o.block_ids,
                o.evicted_keys
                    .iter()
                    .map(|k| PyBytes::new(py, k.as_bytes()))
                    .collect(),
            )
        }))
    }

    /// Finishes stores (and writes the stored blocks through to the disk tier).
    #[pyo3(signature = (keys, success = true))]
    fn complete_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        success: bool,
    ) -> PyResult<()> {
        let k = keys_of(keys)?;
        self.with(py, |m| m.complete_store(&k, success))
    }

    /// Events as `(keys, removed)` pairs, in order.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<(Vec<Bound<'py, PyBytes>>, bool)>> {
        let evs = self.with(py, TieredManager::take_events)?;
        Ok(evs
            .into_iter()
            .map(|e| {
                (
                    e.keys
                        .iter()
                        .map(|k| PyBytes::new(py, k.as_bytes()))
                        .collect(),
                    e.removed,
                )
            })
            .collect())
    }

    /// Host gauges (docs/spec.md §2.2) plus `disk_*` counters and gauges.
    fn get_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (h, t, c) = self.with(py, TieredManager::get_stats)?;
        stats_dict(py, Some(&h), &t, &c)
    }

    /// Applies finished disk I/O (never blocks).
    fn poll(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, TieredManager::poll)
    }

    /// Waits (GIL released, manager lock not held) until the queued disk I/O has run, then
    /// applies it.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let waiter = self.with(py, |m| Ok(m.tier().idle_waiter()))?;
        blocking(py, move || {
            waiter.wait();
            Ok(())
        })?;
        self.with(py, TieredManager::poll)
    }

    /// Number of promotions in flight.
    fn num_promoting(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |m| Ok(m.num_promoting()))
    }

    /// The directory of this layout's files.
    #[getter]
    fn disk_dir(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |m| Ok(m.tier().dir().display().to_string()))
    }

    /// Path of a key's file (whether or not it exists).
    fn disk_path_of(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<String> {
        let k = key_of(key)?;
        self.with(py, |m| Ok(m.tier().path_of(&k).display().to_string()))
    }

    /// Whether a key has a published file (no I/O).
    fn disk_contains(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let k = key_of(key)?;
        self.with(py, |m| Ok(m.tier().contains(&k)))
    }

    /// Lists the disk directory again now (GIL released).
    fn disk_rescan(&self, py: Python<'_>) -> PyResult<()> {
        self.with_hold(py, Hold::Long, |m| {
            m.tier().rescan();
            Ok(())
        })
    }

    /// Waits for disk I/O, then forgets every host key (files stay).
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        // Wait without the lock first, so other threads are not held up for the whole wait; the
        // reset itself then finds (almost) nothing in flight.
        let waiter = self.with(py, |m| Ok(m.tier().idle_waiter()))?;
        blocking(py, move || {
            waiter.wait();
            Ok(())
        })?;
        self.with_hold(py, Hold::Long, TieredManager::reset)
    }

    /// Waits for disk I/O, stops the I/O threads; idempotent. Later calls raise `InvalidStateError`.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        if self.forked() {
            // The parent's manager, threads and locks are not this process's to touch; what is
            // left of them here is released with the object, without taking a lock.
            return Ok(());
        }
        let m = locked(py, &self.inner, Hold::Brief, |_| {}, |g| Ok(g.take()))?;
        if let Some(mut m) = m {
            blocking(py, move || {
                m.shutdown();
                Ok(())
            })?;
        }
        let region = self
            .region
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        // The I/O threads are joined: the mapping may go now (if the region was closed).
        blocking(py, move || {
            drop(region);
            Ok(())
        })
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |m| Ok(m.len()))
    }

    /// Host capacity in blocks.
    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |m| Ok(m.num_blocks()))
    }
}

/// Runs the disk benchmark for one layout (GIL released) and returns its row as a dict.
#[pyfunction]
#[pyo3(signature = (dir, label, page_sizes, num_blocks = Int::of(256), reps = Int::of(5), io_threads = Int::of(8), direct_io = "auto"))]
#[allow(clippy::too_many_arguments)]
fn bench_disk<'py>(
    py: Python<'py>,
    dir: PathArg,
    label: String,
    page_sizes: Vec<Int>,
    num_blocks: Int,
    reps: Int,
    io_threads: Int,
    direct_io: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let cfg = DiskBenchConfig {
        dir: dir.0,
        label,
        page_sizes_bytes: page_sizes
            .into_iter()
            .map(|p| p.get::<u64>("page_sizes[i]"))
            .collect::<PyResult<_>>()?,
        num_blocks: num_blocks.get("num_blocks")?,
        reps: reps.get("reps")?,
        io_threads: io_threads.get("io_threads")?,
        direct_io: parse_direct_io(direct_io)?,
    };
    let r = blocking(py, || run_bench(&cfg))?;
    let d = PyDict::new(py);
    d.set_item("label", r.label)?;
    d.set_item("block_bytes", r.block_bytes)?;
    d.set_item("num_blocks", r.num_blocks)?;
    d.set_item("io_threads", r.io_threads)?;
    d.set_item("direct_io", r.direct_io)?;
    d.set_item("baseline_direct_io", r.baseline_direct_io)?;
    d.set_item("fill_write_gbps", r.fill_write_gbps)?;
    d.set_item("tier_write_gbps", r.tier_write_gbps)?;
    d.set_item("tier_read_gbps", r.tier_read_gbps)?;
    d.set_item("seq_write_gbps", r.seq_write_gbps)?;
    d.set_item("seq_read_gbps", r.seq_read_gbps)?;
    d.set_item("seq_write_block_req_gbps", r.seq_write_block_req_gbps)?;
    d.set_item("seq_read_block_req_gbps", r.seq_read_block_req_gbps)?;
    d.set_item("scattered_write_gbps", r.scattered_write_gbps)?;
    d.set_item("scattered_read_gbps", r.scattered_read_gbps)?;
    d.set_item("write_ratio", r.write_ratio)?;
    d.set_item("read_ratio", r.read_ratio)?;
    d.set_item("promotion_p50_us", r.promotion_p50_us)?;
    d.set_item("promotion_p90_us", r.promotion_p90_us)?;
    d.set_item("write_cpu_us_per_block", r.write_cpu_us_per_block)?;
    d.set_item("read_cpu_us_per_block", r.read_cpu_us_per_block)?;
    d.set_item("seq_cpu_us_per_block", r.seq_cpu_us_per_block)?;
    d.set_item("lookup_hit_ns_per_key", r.lookup_hit_ns_per_key)?;
    Ok(d)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTieredCore>()?;
    m.add_function(wrap_pyfunction!(bench_disk, m)?)?;
    Ok(())
}
