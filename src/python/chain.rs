//! Bindings of the tier chain (docs/tier.md "Tier chain", "Remote tier"): `ChainManagerCore`, a
//! [`ChainManager`] over an LRU or ARC manager with host memory → files (optional) → Redis/Valkey
//! (optional) behind it, with plain return values (the Python class
//! `kvoff.tier.TieredOffloadingManager` wraps it when `remote_url` is given).
//!
//! Keys are extracted before the lock is taken and Python objects are built after it is released;
//! calls that wait for I/O (`flush`, `reset`, `shutdown`) release the GIL. No call waits on the
//! network: the tiers' I/O threads do (docs/tier.md "Remote tier").
// Unsafe: the one `RawRows::new` over the caller's host memory (see its SAFETY comment).
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::enter::{blocking, locked, Hold};
use super::errors::{to_py, IntoPyResult};
use super::names::parse_direct_io;
use crate::key::ByteKey;
use crate::manager::{AnyManager, BlockId, ManagerConfig, PolicyKind, Presence};
use crate::tier::chain::{ChainConfig, ChainManager, ChainTier, ChainTierStats};
use crate::tier::remote::{RemoteConfig, RemoteTier};
use crate::tier::secondary::Known;
use crate::tier::{BlockMemory, FileTier, Layout, RawRows, TierConfig};
use crate::KvoffError;

type Host = AnyManager<ByteKey>;

/// A tier chain for Python: see the module docs.
#[pyclass(name = "ChainManagerCore", module = "kvoff._native", frozen)]
pub struct PyChainCore {
    inner: Mutex<Option<ChainManager<Host>>>,
    /// Keeps the object that owns the host memory alive while the tiers may copy into it.
    owner: Mutex<Option<Py<PyAny>>>,
    /// The file tier's directory, when there is one.
    disk_dir: Option<String>,
    /// The remote URL with its password hidden.
    remote_url: Option<String>,
    /// The process that created the tiers (their I/O threads exist only there).
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

fn seconds(name: &str, s: f64) -> PyResult<Duration> {
    if s.is_finite() && s > 0.0 && s < 1e7 {
        Ok(Duration::from_secs_f64(s))
    } else {
        Err(to_py(KvoffError::Config(format!(
            "{name} must be > 0 seconds and finite, got {s}"
        ))))
    }
}

impl PyChainCore {
    fn with_hold<R: Send>(
        &self,
        py: Python<'_>,
        hold: Hold,
        f: impl FnOnce(&mut ChainManager<Host>) -> crate::Result<R> + Send,
    ) -> PyResult<R> {
        let on_panic = |m: &mut Option<ChainManager<Host>>| {
            if let Some(mut m) = m.take() {
                m.shutdown();
            }
        };
        let pid = self.pid;
        locked(py, &self.inner, hold, on_panic, |g| {
            let m = g
                .as_mut()
                .ok_or_else(|| KvoffError::state("the tiered manager is shut down"))?;
            if std::process::id() != pid {
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
        f: impl FnOnce(&mut ChainManager<Host>) -> crate::Result<R> + Send,
    ) -> PyResult<R> {
        self.with_hold(py, Hold::Brief, f)
    }
}

/// Stats keys of one tier: `<kind>_<name>`, with the file tier's historical names
/// (`disk_files_written`, `disk_corrupt_files`) and the remote tier's `remote_rejected_values`.
fn tier_stats(d: &Bound<'_, PyDict>, s: &ChainTierStats) -> PyResult<()> {
    let p = s.kind;
    let t = &s.tier;
    let c = &s.chain;
    let (writes, rejected) = if p == "disk" {
        ("files_written", "corrupt_files")
    } else {
        ("writes", "rejected_values")
    };
    let put = |name: &str, v: u64| d.set_item(format!("{p}_{name}"), v);
    put(writes, t.writes)?;
    put("bytes_written", t.bytes_written)?;
    d.set_item(format!("{p}_write_seconds"), t.write_seconds)?;
    put("write_errors", t.write_errors)?;
    put("writes_dropped", t.writes_dropped)?;
    put("promotions", t.promotions)?;
    put("bytes_read", t.bytes_read)?;
    d.set_item(format!("{p}_read_seconds"), t.read_seconds)?;
    put("read_errors", t.read_errors)?;
    put(rejected, t.rejected)?;
    put("queued_reads", t.queued_reads)?;
    put("queued_writes", t.queued_writes)?;
    d.set_item(format!("{p}_last_error"), t.last_error.clone())?;
    put("hits", c.hits)?;
    put("misses", c.misses)?;
    put("promotions_started", c.promotions_started)?;
    put("promotions_failed", c.promotions_failed)?;
    put("promotions_no_room", c.promotions_no_room)?;
    put("writes_started", c.writes_started)?;
    put("writes_refused", c.writes_refused)?;
    put("writes_below_threshold", c.writes_below_threshold)?;
    if p != "disk" {
        put("fetches", c.fetches)?;
        put("fetch_keys", c.fetch_keys)?;
        put("fetch_hits", t.fetch_hits)?;
        put("fetch_misses", t.fetch_misses)?;
        put("fetch_errors", t.fetch_errors)?;
        put("reconnects", t.reconnects)?;
    }
    Ok(())
}

#[pymethods]
impl PyChainCore {
    /// See `kvoff.tier.TieredOffloadingManager`.
    #[new]
    #[pyo3(signature = (
        policy, num_blocks, disk_path, disk_bytes_to_use, memory_ptr, memory_rows, row_stride_bytes,
        block_bytes, memory_owner, *, namespace = String::new(), page_sizes = Vec::new(),
        block_size_factor = 1, dtype = String::new(), world_size = 1, rank = 0, block_size = 0,
        enable_events = false, store_threshold = 0, max_tracker_size = 64000, disk_store_threshold = 0,
        io_threads = 8, write_threads = 4, max_queued_writes = 256, fsync = false, direct_io = "auto",
        rescan_interval_s = Some(2.0), owner = None, max_promotions = 256,
        remote_url = None, remote_cluster = false, remote_namespace = None, remote_store_threshold = 0,
        remote_ttl_s = None, remote_connect_timeout_s = 1.0, remote_timeout_s = 2.0,
        remote_io_threads = 2, remote_max_queued_writes = 256, remote_max_inflight_bytes = 256 << 20,
        remote_negative_ttl_s = 2.0, remote_max_fetch_keys = 64,
        remote_password_env = String::from("KVOFF_REMOTE_PASSWORD")
    ))]
    #[allow(clippy::too_many_arguments, clippy::fn_params_excessive_bools)]
    fn new(
        py: Python<'_>,
        policy: &str,
        num_blocks: usize,
        disk_path: Option<std::path::PathBuf>,
        disk_bytes_to_use: Option<u64>,
        memory_ptr: u64,
        memory_rows: u64,
        row_stride_bytes: u64,
        block_bytes: usize,
        memory_owner: Py<PyAny>,
        namespace: String,
        page_sizes: Vec<u64>,
        block_size_factor: u64,
        dtype: String,
        world_size: u32,
        rank: u32,
        block_size: usize,
        enable_events: bool,
        store_threshold: usize,
        max_tracker_size: usize,
        disk_store_threshold: u32,
        io_threads: usize,
        write_threads: usize,
        max_queued_writes: usize,
        fsync: bool,
        direct_io: &str,
        rescan_interval_s: Option<f64>,
        owner: Option<String>,
        max_promotions: usize,
        remote_url: Option<String>,
        remote_cluster: bool,
        remote_namespace: Option<String>,
        remote_store_threshold: u32,
        remote_ttl_s: Option<f64>,
        remote_connect_timeout_s: f64,
        remote_timeout_s: f64,
        remote_io_threads: usize,
        remote_max_queued_writes: usize,
        remote_max_inflight_bytes: u64,
        remote_negative_ttl_s: f64,
        remote_max_fetch_keys: usize,
        remote_password_env: String,
    ) -> PyResult<Self> {
        if memory_rows < num_blocks as u64 {
            return Err(to_py(KvoffError::arg(format!(
                "the host memory has {memory_rows} rows but num_blocks = {num_blocks}"
            ))));
        }
        let direct = parse_direct_io(direct_io)?;
        let rescan = rescan_interval_s
            .map(|s| seconds("rescan_interval_s", s))
            .transpose()?;
        let ttl = remote_ttl_s
            .map(|s| seconds("remote_ttl_s", s))
            .transpose()?;
        let connect_timeout = seconds("remote_connect_timeout_s", remote_connect_timeout_s)?;
        let io_timeout = seconds("remote_timeout_s", remote_timeout_s)?;
        let negative_ttl = seconds("remote_negative_ttl_s", remote_negative_ttl_s)?;
        if disk_path.is_none() && remote_url.is_none() {
            return Err(to_py(KvoffError::Config(
                "a tiered manager needs disk_path, remote_url or both".into(),
            )));
        }
        // SAFETY: obligation 1 of `RawRows::new` is the caller's, documented on
        // `kvoff.tier.TieredOffloadingManager` (as for the tensor pointers given to transfer
        // engines): the memory belongs to `memory_owner`, which this object keeps alive until
        // `shutdown`, and it is not closed before that. Obligation 2 is kept by `ChainManager`
        // (write pins, pending promotions).
        let memory =
            unsafe { RawRows::new(memory_ptr, memory_rows, row_stride_bytes, block_bytes) }.py()?;
        let mut mc = ManagerConfig::new(num_blocks);
        mc.block_size = block_size;
        mc.enable_events = enable_events;
        mc.store_threshold = store_threshold;
        mc.max_tracker_size = max_tracker_size;
        let host = Host::try_new(PolicyKind::parse(policy).py()?, mc).py()?;
        let layout = Layout {
            namespace,
            page_sizes_bytes: page_sizes,
            block_size_factor,
            dtype,
            world_size,
            rank,
        };
        let mem: Arc<dyn BlockMemory> = Arc::new(memory);
        let mut tiers = Vec::new();
        let mut disk_dir = None;
        if let Some(dir) = disk_path {
            let Some(bytes) = disk_bytes_to_use else {
                return Err(to_py(KvoffError::Config(
                    "disk_bytes_to_use is required with disk_path".into(),
                )));
            };
            let mut tc = TierConfig::new(dir, bytes, layout.clone());
            tc.io_threads = io_threads;
            tc.write_threads = write_threads;
            tc.max_queued_writes = max_queued_writes;
            tc.fsync = fsync;
            tc.direct_io = direct;
            tc.rescan_interval = rescan;
            tc.owner.clone_from(&owner);
            let m = Arc::clone(&mem);
            let tier = blocking(py, move || FileTier::open(tc, m))?;
            disk_dir = Some(tier.dir().display().to_string());
            tiers.push(ChainTier {
                tier: Box::new(tier),
                store_threshold: disk_store_threshold,
            });
        }
        let mut shown_url = None;
        if let Some(url) = remote_url {
            let mut lay = layout;
            if let Some(ns) = remote_namespace {
                lay.namespace = ns;
            }
            let url = if remote_cluster && !url.contains("+cluster://") {
                url.replacen("://", "+cluster://", 1)
            } else {
                url
            };
            let mut rc = RemoteConfig::new(url, lay);
            rc.ttl = ttl;
            rc.connect_timeout = connect_timeout;
            rc.io_timeout = io_timeout;
            rc.io_threads = remote_io_threads;
            rc.max_queued_writes = remote_max_queued_writes;
            rc.max_inflight_bytes = remote_max_inflight_bytes;
            rc.negative_ttl = negative_ttl;
            rc.max_fetch_keys = remote_max_fetch_keys.max(1);
            rc.password_env = remote_password_env;
            rc.owner = owner;
            let tier = RemoteTier::open(rc, mem).py()?;
            shown_url = Some(tier.url().to_owned());
            tiers.push(ChainTier {
                tier: Box::new(tier),
                store_threshold: remote_store_threshold,
            });
        }
        let cfg = ChainConfig {
            max_tracker_size,
            max_promotions,
            max_fetch_keys: remote_max_fetch_keys.max(1),
        };
        Ok(Self {
            inner: Mutex::new(Some(ChainManager::new(host, tiers, cfg))),
            owner: Mutex::new(Some(memory_owner)),
            disk_dir,
            remote_url: shown_url,
            pid: std::process::id(),
        })
    }

    /// `True` ready, `None` pending (store, promotion or fetch in flight), `False` absent.
    fn lookup(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Option<bool>> {
        let k = key_of(key)?;
        Ok(match self.with(py, |m| m.lookup(&k))? {
            Presence::Ready => Some(true),
            Presence::Pending => None,
            Presence::Absent => Some(false),
        })
    }

    /// Leading ready keys, or `None` when the first non-ready one is pending, being promoted or
    /// being fetched.
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

    /// Finishes stores (and writes the stored blocks through to the tiers).
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
        let evs = self.with(py, ChainManager::take_events)?;
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

    /// Host gauges (docs/spec.md §2.2) plus `disk_*` and `remote_*` counters and gauges.
    fn get_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (h, tiers, extra) = self.with(py, |m| {
            let (h, t) = m.get_stats()?;
            let extra: Vec<(&'static str, Vec<(&'static str, u64)>)> =
                m.tiers().map(|t| (t.kind(), t.extra_stats())).collect();
            Ok((h, t, extra))
        })?;
        let d = PyDict::new(py);
        d.set_item("usage", h.usage)?;
        d.set_item("write_usage", h.write_usage)?;
        d.set_item("read_usage", h.read_usage)?;
        d.set_item("num_blocks", h.num_blocks)?;
        d.set_item("num_present", h.num_present)?;
        d.set_item("num_free", h.num_free)?;
        d.set_item("num_evictable", h.num_evictable)?;
        d.set_item("stores_skipped", h.stores_skipped)?;
        for s in &tiers {
            tier_stats(&d, s)?;
        }
        for (kind, kv) in extra {
            for (name, v) in kv {
                if kind == "disk" && name == "direct_io" {
                    d.set_item("disk_direct_io", v != 0)?;
                } else {
                    d.set_item(format!("{kind}_{name}"), v)?;
                }
            }
        }
        Ok(d)
    }

    /// Applies finished I/O (never blocks).
    fn poll(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, ChainManager::poll)
    }

    /// Waits (GIL released) until the queued I/O has run — bounded by the remote timeouts — then
    /// applies it. For tests and tools, not a scheduler.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        self.with_hold(py, Hold::Long, |m| {
            m.flush();
            Ok(())
        })?;
        self.with(py, ChainManager::poll)
    }

    /// Number of promotions in flight.
    fn num_promoting(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |m| Ok(m.num_promoting()))
    }

    /// The directory of this layout's files, or `None` without a file tier.
    #[getter]
    fn disk_dir(&self) -> Option<String> {
        self.disk_dir.clone()
    }

    /// The remote URL with its password hidden, or `None` without a remote tier.
    #[getter]
    fn remote_url(&self) -> Option<String> {
        self.remote_url.clone()
    }

    /// What tier `kind`'s index knows about a key (no I/O): `True` present, `False` absent,
    /// `None` unknown (a fetch would ask the server); `False` when there is no such tier.
    fn tier_index(
        &self,
        py: Python<'_>,
        kind: &str,
        key: &Bound<'_, PyAny>,
    ) -> PyResult<Option<bool>> {
        let k = key_of(key)?;
        let kind = kind.to_owned();
        self.with(py, move |m| {
            Ok(match m.tier(&kind).map(|t| t.index(&k)) {
                Some(Known::Present) => Some(true),
                Some(Known::Unknown) => None,
                Some(Known::Absent) | None => Some(false),
            })
        })
    }

    /// Waits for I/O, then forgets every host key (the tiers keep their values).
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        self.with_hold(py, Hold::Long, ChainManager::reset)
    }

    /// Waits for I/O (bounded by the remote timeouts), stops the I/O threads; idempotent. Later
    /// calls raise `InvalidStateError`.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let m = locked(py, &self.inner, Hold::Brief, |_| {}, |g| Ok(g.take()))?;
        if let Some(mut m) = m {
            blocking(py, move || {
                m.shutdown();
                Ok(())
            })?;
        }
        let owner = self
            .owner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        drop(owner);
        Ok(())
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

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyChainCore>()?;
    Ok(())
}
