//! Bindings of the tiered manager (docs/spec.md §9, docs/tier.md "Tier chain", "Remote tier"):
//! `ChainManagerCore`, a [`ChainManager`] over an LRU or ARC manager with host memory → files
//! (optional) → Redis/Valkey (optional) behind it, with plain return values (the Python class
//! `kvoff.tier.TieredOffloadingManager` wraps it into docs/spec.md §2's types).
//!
//! Keys are extracted before the lock is taken and Python objects are built after it is released;
//! calls that wait for I/O (`flush`, `reset`, `shutdown`) release the GIL, and wait
//! for the file tier without holding the manager's lock. No call waits on the network: the tiers'
//! I/O threads do (docs/tier.md "Remote tier"). In a `fork()`ed child no call takes a lock of the
//! parent's manager (docs/spec.md §9).
// Unsafe: the one `RawRows::new` over the caller's host memory (see its SAFETY comment).
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::args::{Int, PathArg};
use super::enter::{blocking, locked, Hold};
use super::errors::{to_py, IntoPyResult};
use super::region::{PyHostRegion, SharedRegion};
use super::tier_stats::stats_dict;
use super::tiers::{self, FileSettings, HostSettings, ObjectSettings, RemoteSettings, Settings};
use crate::key::ByteKey;
use crate::manager::{AnyManager, BlockId, ManagerConfig, PolicyKind, Presence};
use crate::tier::chain::{ChainConfig, ChainManager, ChainTier};
use crate::tier::object::ObjectTier;
use crate::tier::remote::RemoteTier;
use crate::tier::secondary::Known;
use crate::tier::{BlockMemory, FileTier, RawRows};
use crate::KvoffError;

/// The host manager behind the tiers.
type Host = AnyManager<ByteKey>;

/// A tiered manager for Python: see the module docs.
#[pyclass(name = "ChainManagerCore", module = "kvoff._native", frozen)]
pub struct PyChainCore {
    inner: Mutex<Option<ChainManager<Host>>>,
    /// Keeps the host region mapped while the tiers may copy into it (dropped at `shutdown`, after
    /// the I/O threads are joined).
    region: Mutex<Option<SharedRegion>>,
    /// The file tier's directory, when there is one.
    disk_dir: Option<String>,
    /// The remote URL with its password hidden, when there is a remote tier.
    remote_url: Option<String>,
    /// The process that created it: a `fork()`ed child takes none of its locks (docs/spec.md §9).
    pid: u32,
}

fn keys_of(keys: &Bound<'_, PyAny>) -> PyResult<Vec<ByteKey>> {
    // Sized once (a scheduler's list of keys): growing it costs a lookup a few reallocations.
    let mut v = Vec::with_capacity(keys.len().unwrap_or(0));
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

fn other_process() -> KvoffError {
    KvoffError::state(
        "this tiered manager was created in another process (before fork()); \
         create a new one in this process",
    )
}

fn no_file_tier() -> KvoffError {
    KvoffError::state("this tiered manager has no file tier (no disk_path)")
}

/// The file tier of `m`, or an error naming the call.
fn file_tier(m: &ChainManager<Host>) -> crate::Result<&FileTier> {
    m.tier_as::<FileTier>().ok_or_else(no_file_tier)
}

impl PyChainCore {
    fn forked(&self) -> bool {
        crate::process::id() != self.pid
    }

    /// Runs `f` on the manager under its lock ([`locked`]): brief calls keep the GIL when the
    /// lock is free, `Hold::Long` ones (directory scans, waits) always release it. A panic shuts
    /// the manager down.
    fn with_hold<R: Send>(
        &self,
        py: Python<'_>,
        hold: Hold,
        f: impl FnOnce(&mut ChainManager<Host>) -> crate::Result<R> + Send,
    ) -> PyResult<R> {
        // Before any lock: in a `fork()`ed child a parent thread may have held it at the fork.
        if self.forked() {
            return Err(to_py(other_process()));
        }
        let on_panic = |m: &mut Option<ChainManager<Host>>| {
            if let Some(mut m) = m.take() {
                m.shutdown();
            }
        };
        locked(py, &self.inner, hold, on_panic, |g| {
            let m = g.as_mut().ok_or_else(shut)?;
            if m.forked() {
                return Err(other_process());
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

    /// Waits (GIL released, manager lock not held) until the file tier's queued I/O has run, then
    /// waits for the other tiers' under the lock (GIL released; bounded by their timeouts).
    fn wait_idle(&self, py: Python<'_>) -> PyResult<()> {
        let (waiter, others) = self.with(py, |m| {
            let file = m.tier_as::<FileTier>();
            Ok((
                file.map(FileTier::idle_waiter),
                m.tiers().count() > usize::from(file.is_some()),
            ))
        })?;
        if let Some(w) = waiter {
            blocking(py, move || {
                w.wait();
                Ok(())
            })?;
        }
        if others {
            self.with_hold(py, Hold::Long, |m| {
                m.flush();
                Ok(())
            })?;
        }
        Ok(())
    }
}

#[pymethods]
impl PyChainCore {
    /// See `kvoff.tier.TieredOffloadingManager`; the settings are read by [`super::tiers`].
    #[new]
    #[pyo3(signature = (
        policy, num_blocks, disk_path, disk_bytes_to_use, memory_ptr, memory_rows, row_stride_bytes,
        block_bytes, memory_owner, *, owner = None, **settings
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        policy: &str,
        num_blocks: Int,
        disk_path: Option<PathArg>,
        disk_bytes_to_use: Option<Int>,
        memory_ptr: Int,
        memory_rows: Int,
        row_stride_bytes: Int,
        block_bytes: Int,
        memory_owner: &Bound<'_, PyHostRegion>,
        owner: Option<String>,
        settings: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        // Every argument is converted (TypeError / ValueError / ConfigError) before anything is
        // created.
        let num_blocks: usize = num_blocks.get("num_blocks")?;
        let memory_ptr: u64 = memory_ptr.get("memory_ptr")?;
        let memory_rows: u64 = memory_rows.get("memory_rows")?;
        let row_stride_bytes: u64 = row_stride_bytes.get("row_stride_bytes")?;
        let block_bytes: usize = block_bytes.get("block_bytes")?;
        let disk_bytes_to_use: Option<u64> = disk_bytes_to_use
            .map(|b| b.get("disk_bytes_to_use"))
            .transpose()?;
        let s = Settings::new(py, settings)?;
        let layout = tiers::layout(&s)?;
        let host = HostSettings::read(&s)?;
        let file = FileSettings::read(&s)?;
        let disk_store_threshold = FileSettings::store_threshold(&s)?;
        let remote = RemoteSettings::read(&s)?;
        let remote_store_threshold = RemoteSettings::store_threshold(&s)?;
        let object = ObjectSettings::read(&s)?;
        let object_store_threshold = ObjectSettings::store_threshold(&s)?;
        s.finish("ChainManagerCore")?;
        let disk = match disk_path {
            None => None,
            Some(dir) => Some((
                dir.0,
                disk_bytes_to_use.ok_or_else(|| {
                    to_py(KvoffError::Config(
                        "disk_bytes_to_use is required with disk_path".into(),
                    ))
                })?,
            )),
        };
        let remote = remote.url.is_some().then_some(remote);
        let object = object.url.is_some().then_some(object);
        if disk.is_none() && remote.is_none() && object.is_none() {
            return Err(to_py(KvoffError::Config(
                "a tiered manager needs disk_path, remote_url or object_url (or several)".into(),
            )));
        }
        let object_bytes = match &object {
            Some(o) => Some(o.bytes_to_use.ok_or_else(|| {
                to_py(KvoffError::Config(
                    "object_bytes_to_use is required with object_url".into(),
                ))
            })?),
            None => None,
        };
        if memory_rows < num_blocks as u64 {
            return Err(to_py(KvoffError::arg(format!(
                "the host memory has {memory_rows} rows but num_blocks = {num_blocks}"
            ))));
        }
        // The tiers keep the region's mapping alive (as a view does) until `shutdown`, so closing
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
        // I/O threads) keeps mapped. Obligation 2 is kept by `ChainManager` (write pins, pending
        // promotions).
        let memory =
            unsafe { RawRows::new(memory_ptr, memory_rows, row_stride_bytes, block_bytes) }.py()?;
        let mut mc = ManagerConfig::new(num_blocks);
        mc.block_size = host.block_size;
        mc.enable_events = host.enable_events;
        mc.store_threshold = host.store_threshold;
        mc.max_tracker_size = host.max_tracker_size;
        let manager = Host::try_new(PolicyKind::parse(policy).py()?, mc).py()?;
        let mem: Arc<dyn BlockMemory> = Arc::new(memory);
        let mut tiers = Vec::new();
        let mut disk_dir = None;
        let max_fetch_keys = remote
            .as_ref()
            .map_or(ChainConfig::default().max_fetch_keys, |r| r.max_fetch_keys);
        if let Some((dir, bytes)) = disk {
            let tc = file.config(dir, bytes, layout.clone(), owner.clone());
            let m = Arc::clone(&mem);
            let tier = blocking(py, move || FileTier::open(tc, m))?;
            disk_dir = Some(tier.dir().display().to_string());
            tiers.push(ChainTier {
                tier: Box::new(tier),
                store_threshold: disk_store_threshold,
            });
        }
        let mut shown_url = None;
        if let Some(r) = remote {
            // Without the GIL: opening reads the TLS CA file (docs/tier.md "Faults").
            let rc = r.config(layout.clone(), owner.clone());
            let m = Arc::clone(&mem);
            let tier = blocking(py, move || RemoteTier::open(rc, m))?;
            shown_url = Some(tier.url().to_owned());
            tiers.push(ChainTier {
                tier: Box::new(tier),
                store_threshold: remote_store_threshold,
            });
        }
        if let (Some(o), Some(bytes)) = (object, object_bytes) {
            // Without the GIL: opening reads the credentials file and starts the runtime.
            let oc = o.config(bytes, layout, owner);
            let tier = blocking(py, move || ObjectTier::open(oc, mem))?;
            tiers.push(ChainTier {
                tier: Box::new(tier),
                store_threshold: object_store_threshold,
            });
        }
        let cfg = ChainConfig {
            max_tracker_size: host.max_tracker_size,
            max_promotions: host.max_promotions,
            max_fetch_keys,
            ..ChainConfig::default()
        };
        Ok(Self {
            inner: Mutex::new(Some(ChainManager::new(manager, tiers, cfg))),
            region: Mutex::new(Some(region)),
            disk_dir,
            remote_url: shown_url,
            pid: crate::process::id(),
        })
    }

    /// `True` ready, `None` pending (store, promotion or fetch in flight), `False` absent.
    /// `after`: the key before `key` in its prefix, looked up just before (a caller that looks
    /// a prefix up one key at a time, in order; docs/tier.md "Tier chain"). `req_context` is
    /// vLLM's, unused: the signature is the manager's, so that `TieredOffloadingManager` hands the
    /// scheduler's calls to this method with no Python frame in between.
    #[pyo3(signature = (key, req_context = None, after = None))]
    fn lookup(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
        after: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<bool>> {
        let _ = req_context;
        let k = key_of(key)?;
        let prev = after.map(key_of).transpose()?;
        Ok(
            match self.with(py, |m| match &prev {
                Some(p) => m.lookup_after(&k, p),
                None => m.lookup(&k),
            })? {
                Presence::Ready => Some(true),
                Presence::Pending => None,
                Presence::Absent => Some(false),
            },
        )
    }

    /// Leading ready keys, or `None` when the first non-ready one is pending, being promoted or
    /// being fetched. `req_context`: as `lookup`'s.
    #[pyo3(signature = (keys, req_context = None))]
    fn lookup_prefix(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<usize>> {
        let _ = req_context;
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
        stats_dict(py, &h, &tiers, extra)
    }

    /// Applies finished I/O (never blocks).
    fn poll(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, ChainManager::poll)
    }

    /// Waits (GIL released; for the file tier without the manager's lock) until the queued I/O
    /// has run — bounded by the remote timeouts — then applies it. For tests and tools, not a
    /// scheduler.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        self.wait_idle(py)?;
        self.with(py, ChainManager::poll)
    }

    /// Number of promotions in flight.
    fn num_promoting(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |m| Ok(m.num_promoting()))
    }

    /// The directory of this layout's files, or `None` without a file tier.
    #[getter]
    fn disk_dir(&self, py: Python<'_>) -> PyResult<Option<String>> {
        self.with(py, |_| Ok(()))?;
        Ok(self.disk_dir.clone())
    }

    /// The remote URL with its password hidden, or `None` without a remote tier.
    #[getter]
    fn remote_url(&self, py: Python<'_>) -> PyResult<Option<String>> {
        self.with(py, |_| Ok(()))?;
        Ok(self.remote_url.clone())
    }

    /// Path of a key's file (whether or not it exists).
    fn disk_path_of(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<String> {
        let k = key_of(key)?;
        self.with(py, |m| Ok(file_tier(m)?.path_of(&k).display().to_string()))
    }

    /// Lists the file tier's directory again now (GIL released).
    fn disk_rescan(&self, py: Python<'_>) -> PyResult<()> {
        self.with_hold(py, Hold::Long, |m| {
            file_tier(m)?.rescan();
            Ok(())
        })
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
                Some(Known::Unknown | Known::Pending) => None,
                Some(Known::Absent) | None => Some(false),
            })
        })
    }

    /// Waits for I/O, then forgets every host key (the tiers keep their values).
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        // Wait without the lock first, so other threads are not held up for the whole wait; the
        // reset itself then finds (almost) nothing in flight.
        self.wait_idle(py)?;
        self.with_hold(py, Hold::Long, ChainManager::reset)
    }

    /// Waits for I/O (bounded by the remote timeouts), stops the I/O threads; idempotent. Later
    /// calls raise `InvalidStateError`.
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

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyChainCore>()?;
    Ok(())
}
