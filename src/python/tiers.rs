//! Each tier's settings, read in one place for both constructors that open tiers
//! (`ChainManagerCore`, `BlockStore`) and for the surfaces that check settings before they open
//! anything (`check_tier_settings`: vLLM's and SGLang's configs). docs/design.md "A new tier".
//!
//! The settings arrive as keyword arguments (`**settings`) and are taken out of that dict one
//! group at a time — the layout, the host manager's, the file tier's ([`FileSettings`]), the
//! remote tier's ([`RemoteSettings`]), the object tier's ([`ObjectSettings`]) — each through the bindings' checked types ([`super::args`]):
//! an `int` setting is never a `bool` (`TypeError`) and out of range is a `ValueError` (never an
//! `OverflowError`); a seconds setting is an `int` or `float`, never a `bool`, out of range a
//! `ConfigError` (a `ValueError`). A keyword left over is a `TypeError`, as Python's own.
//!
//! Every default comes from the crate's configs (`ManagerConfig::new`, `ChainConfig::default`,
//! `TierConfig::new`, `RemoteConfig::new`, `ObjectConfig::new`) and is exported as `kvoff._native.TIER_DEFAULTS`,
//! which the Python surfaces read.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyString, PyTuple};

use super::args::{num_bounds, Float, Int, PathArg};
use super::errors::to_py;
use super::keys::type_name;
use super::names::parse_direct_io;
use crate::manager::ManagerConfig;
use crate::tier::chain::ChainConfig;
use crate::tier::object::ObjectConfig;
use crate::tier::remote::RemoteConfig;
use crate::tier::{DirectIo, Layout, TierConfig};
use crate::KvoffError;

/// Longest `remote_idle_spin_s` (an I/O thread spinning longer only burns a CPU) and
/// `remote_idle_nap_s` (a napping thread looking less often delays a fetch more).
pub(crate) const MAX_IDLE_SPIN_S: f64 = 0.01;

/// Most remote I/O threads (`RemoteTier::open` refuses more).
pub(crate) const MAX_REMOTE_IO_THREADS: usize = 64;

/// The keyword settings of one constructor call, taken out one at a time (see the module docs).
pub(crate) struct Settings<'py> {
    kw: Bound<'py, PyDict>,
}

impl<'py> Settings<'py> {
    /// A copy of `kw` (the caller's dict is left as it is).
    pub(crate) fn new(py: Python<'py>, kw: Option<&Bound<'py, PyDict>>) -> PyResult<Self> {
        Ok(Self {
            kw: match kw {
                Some(d) => d.copy()?,
                None => PyDict::new(py),
            },
        })
    }

    /// The value of `name` (removed), `None` when absent or `None`.
    fn take(&self, name: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
        let v = self.kw.get_item(name)?;
        if v.is_some() {
            self.kw.del_item(name)?;
        }
        Ok(v.filter(|v| !v.is_none()))
    }

    /// An `int` setting in `T`'s range.
    fn int<T>(&self, name: &str, default: T) -> PyResult<T>
    where
        T: TryFrom<i128> + num_bounds::Bounds,
    {
        Ok(self.opt_int(name)?.unwrap_or(default))
    }

    /// An `int` setting that may be `None`.
    fn opt_int<T>(&self, name: &str) -> PyResult<Option<T>>
    where
        T: TryFrom<i128> + num_bounds::Bounds,
    {
        self.take(name)?
            .map(|v| {
                let i: Int = v.extract().map_err(|_| {
                    PyTypeError::new_err(format!("{name} must be an int, got {}", type_name(&v)))
                })?;
                i.get(name)
            })
            .transpose()
    }

    /// A number of seconds that may be `None`: > 0 and finite.
    fn opt_secs(&self, name: &str) -> PyResult<Option<Duration>> {
        self.take(name)?
            .map(|v| {
                let s = number(&v, name)?;
                if s.is_finite() && s > 0.0 && s < 1e7 {
                    Ok(Duration::from_secs_f64(s))
                } else {
                    Err(to_py(KvoffError::Config(format!(
                        "{name} must be > 0 seconds and finite, got {s}"
                    ))))
                }
            })
            .transpose()
    }

    fn secs(&self, name: &str, default: Duration) -> PyResult<Duration> {
        Ok(self.opt_secs(name)?.unwrap_or(default))
    }

    /// `remote_idle_spin_s` and `remote_idle_nap_s`: 0 (none) up to [`MAX_IDLE_SPIN_S`].
    fn opt_idle(&self, name: &str) -> PyResult<Option<Duration>> {
        self.take(name)?
            .map(|v| {
                let s = number(&v, name)?;
                if s.is_finite() && (0.0..=MAX_IDLE_SPIN_S).contains(&s) {
                    Ok(Duration::from_secs_f64(s))
                } else {
                    Err(to_py(KvoffError::Config(format!(
                        "{name} must be between 0 and {MAX_IDLE_SPIN_S} seconds, got {s}"
                    ))))
                }
            })
            .transpose()
    }

    /// A `bool` setting (only `True` or `False`).
    fn flag(&self, name: &str, default: bool) -> PyResult<bool> {
        match self.take(name)? {
            None => Ok(default),
            Some(v) if v.is_instance_of::<PyBool>() => v.extract(),
            Some(v) => Err(PyTypeError::new_err(format!(
                "{name} must be a bool, got {}",
                type_name(&v)
            ))),
        }
    }

    fn opt_str(&self, name: &str) -> PyResult<Option<String>> {
        self.take(name)?
            .map(|v| {
                if v.is_instance_of::<PyString>() {
                    v.extract()
                } else {
                    Err(PyTypeError::new_err(format!(
                        "{name} must be a str, got {}",
                        type_name(&v)
                    )))
                }
            })
            .transpose()
    }

    fn opt_path(&self, name: &str) -> PyResult<Option<PathBuf>> {
        self.take(name)?
            .map(|v| {
                v.extract::<PathArg>()
                    .map(|p| p.0)
                    .map_err(|e| rename(v.py(), name, &e))
            })
            .transpose()
    }

    /// Refuses what no group took: `TypeError`, as Python's own for an unknown keyword.
    pub(crate) fn finish(self, what: &str) -> PyResult<()> {
        if let Some((k, _)) = self.kw.iter().next() {
            return Err(PyTypeError::new_err(format!(
                "{what}() got an unexpected keyword argument {}",
                k.repr()?
            )));
        }
        Ok(())
    }
}

/// A number (`int` or `float`, never `bool`) as `f64`.
fn number(v: &Bound<'_, PyAny>, name: &str) -> PyResult<f64> {
    let f: Float = v.extract().map_err(|e| rename(v.py(), name, &e))?;
    Ok(f.0)
}

/// `e` (a `TypeError` or `ValueError` of a converter) with the setting's name in front.
fn rename(py: Python<'_>, name: &str, e: &PyErr) -> PyErr {
    let msg = format!("{name}: {}", e.value(py));
    if e.is_instance_of::<PyValueError>(py) {
        PyValueError::new_err(msg)
    } else {
        PyTypeError::new_err(msg)
    }
}

/// The layout settings (both constructors): `namespace`, `page_sizes`, `block_size_factor`,
/// `dtype`, `world_size`, `rank`.
pub(crate) fn layout(s: &Settings<'_>) -> PyResult<Layout> {
    let page_sizes = match s.take("page_sizes")? {
        None => Vec::new(),
        Some(v) => {
            if v.is_instance_of::<PyString>() {
                return Err(PyTypeError::new_err("page_sizes must be a list of ints"));
            }
            let mut out = Vec::new();
            for p in v.try_iter()? {
                let p = p?;
                let i: Int = p.extract().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "page_sizes must hold ints, got {}",
                        type_name(&p)
                    ))
                })?;
                out.push(i.get::<u64>("page_sizes[i]")?);
            }
            out
        }
    };
    Ok(Layout {
        namespace: s.opt_str("namespace")?.unwrap_or_default(),
        page_sizes_bytes: page_sizes,
        block_size_factor: s.int("block_size_factor", 1)?,
        dtype: s.opt_str("dtype")?.unwrap_or_default(),
        world_size: s.int("world_size", 1)?,
        rank: s.int("rank", 0)?,
    })
}

/// The host manager's settings of the tiered manager.
pub(crate) struct HostSettings {
    pub(crate) block_size: usize,
    pub(crate) enable_events: bool,
    pub(crate) store_threshold: usize,
    pub(crate) max_tracker_size: usize,
    pub(crate) max_promotions: usize,
}

impl HostSettings {
    pub(crate) fn read(s: &Settings<'_>) -> PyResult<Self> {
        let m = ManagerConfig::new(0);
        Ok(Self {
            block_size: s.int("block_size", m.block_size)?,
            enable_events: s.flag("enable_events", m.enable_events)?,
            store_threshold: s.int("store_threshold", m.store_threshold)?,
            max_tracker_size: s.int("max_tracker_size", m.max_tracker_size)?,
            max_promotions: s.int("max_promotions", ChainConfig::default().max_promotions)?,
        })
    }
}

/// The file tier's settings (both constructors; `disk_store_threshold` only in the tiered
/// manager, read by [`FileSettings::store_threshold`]).
pub(crate) struct FileSettings {
    pub(crate) io_threads: usize,
    pub(crate) write_threads: usize,
    pub(crate) max_queued_writes: usize,
    pub(crate) fsync: bool,
    pub(crate) direct: DirectIo,
    pub(crate) rescan: Option<Duration>,
    pub(crate) trusted_uids: Vec<u32>,
    pub(crate) trusted_gid: Option<u32>,
    pub(crate) allow_writable_dir: bool,
}

/// `TierConfig`'s defaults (the directory and layout do not matter).
fn file_defaults() -> TierConfig {
    TierConfig::new(PathBuf::new(), 0, Layout::default())
}

impl FileSettings {
    pub(crate) fn read(s: &Settings<'_>) -> PyResult<Self> {
        let d = file_defaults();
        let direct = match s.take("direct_io")? {
            None => d.direct_io,
            Some(v) => {
                let name: String = v.extract().map_err(|_| {
                    PyTypeError::new_err(format!("direct_io must be a str, got {}", type_name(&v)))
                })?;
                parse_direct_io(&name)?
            }
        };
        // `rescan_interval_s=None` means "index only at start"; absent means the default.
        let rescan = match s.kw.get_item("rescan_interval_s")? {
            None => d.rescan_interval,
            Some(v) if v.is_none() => {
                s.kw.del_item("rescan_interval_s")?;
                None
            }
            Some(_) => {
                let r = s.opt_secs("rescan_interval_s")?;
                if r.is_some_and(|r| r.as_secs_f64() >= 1e6) {
                    return Err(PyValueError::new_err(
                        "rescan_interval_s must be > 0 and finite, or None",
                    ));
                }
                r
            }
        };
        let trusted_uids = match s.take("trusted_uids")? {
            None => Vec::new(),
            Some(v) => {
                let mut out = Vec::new();
                for u in v.try_iter()? {
                    let u = u?;
                    let i: Int = u.extract().map_err(|_| {
                        PyTypeError::new_err(format!(
                            "trusted_uids must hold ints, got {}",
                            type_name(&u)
                        ))
                    })?;
                    out.push(i.get::<u32>("trusted_uids[i]")?);
                }
                out
            }
        };
        Ok(Self {
            io_threads: s.int("io_threads", d.io_threads)?,
            write_threads: s.int("write_threads", d.write_threads)?,
            max_queued_writes: s.int("max_queued_writes", d.max_queued_writes)?,
            fsync: s.flag("fsync", d.fsync)?,
            direct,
            rescan,
            trusted_uids,
            trusted_gid: s.opt_int("trusted_gid")?,
            allow_writable_dir: s.flag("allow_writable_dir", d.allow_writable_dir)?,
        })
    }

    /// The tiered manager's `disk_store_threshold`.
    pub(crate) fn store_threshold(s: &Settings<'_>) -> PyResult<u32> {
        s.int("disk_store_threshold", 0)
    }

    /// The file tier's config in `dir`.
    pub(crate) fn config(
        self,
        dir: PathBuf,
        bytes: u64,
        layout: Layout,
        owner: Option<String>,
    ) -> TierConfig {
        let mut tc = TierConfig::new(dir, bytes, layout);
        tc.io_threads = self.io_threads;
        tc.write_threads = self.write_threads;
        tc.max_queued_writes = self.max_queued_writes;
        tc.fsync = self.fsync;
        tc.direct_io = self.direct;
        tc.rescan_interval = self.rescan;
        tc.owner = owner;
        tc.trusted_uids = self.trusted_uids;
        tc.trusted_gid = self.trusted_gid;
        tc.allow_writable_dir = self.allow_writable_dir;
        tc
    }
}

/// The remote tier's settings (both constructors; `remote_store_threshold` only in the tiered
/// manager, read by [`RemoteSettings::store_threshold`]). `url` is `None` without a remote tier
/// (the other settings are checked all the same).
pub(crate) struct RemoteSettings {
    pub(crate) url: Option<String>,
    cluster: bool,
    namespace: Option<String>,
    ttl: Option<Duration>,
    connect_timeout: Duration,
    io_timeout: Duration,
    /// `None`: the surface's default (the tiered manager: `RemoteConfig`'s; the block store: its
    /// `io_threads`, see docs/tier.md "The block store").
    pub(crate) io_threads: Option<usize>,
    idle_spin: Option<Duration>,
    idle_nap: Option<Duration>,
    /// `None`: as `io_threads`.
    pub(crate) max_queued_writes: Option<usize>,
    max_inflight_bytes: u64,
    negative_ttl: Duration,
    pub(crate) max_fetch_keys: usize,
    password_env: String,
    tls_ca_file: Option<PathBuf>,
}

/// `RemoteConfig`'s defaults (the URL and layout do not matter).
fn remote_defaults() -> RemoteConfig {
    RemoteConfig::new(String::new(), Layout::default())
}

impl RemoteSettings {
    pub(crate) fn read(s: &Settings<'_>) -> PyResult<Self> {
        let d = remote_defaults();
        let io_threads: Option<usize> = s.opt_int("remote_io_threads")?;
        if let Some(n) = io_threads {
            if n == 0 || n > MAX_REMOTE_IO_THREADS {
                return Err(PyValueError::new_err(format!(
                    "remote_io_threads must be in 1..={MAX_REMOTE_IO_THREADS}, got {n}"
                )));
            }
        }
        Ok(Self {
            url: s.opt_str("remote_url")?,
            cluster: s.flag("remote_cluster", false)?,
            namespace: s.opt_str("remote_namespace")?,
            ttl: s.opt_secs("remote_ttl_s")?,
            connect_timeout: s.secs("remote_connect_timeout_s", d.connect_timeout)?,
            io_timeout: s.secs("remote_timeout_s", d.io_timeout)?,
            io_threads,
            idle_spin: s.opt_idle("remote_idle_spin_s")?,
            idle_nap: s.opt_idle("remote_idle_nap_s")?,
            max_queued_writes: s.opt_int("remote_max_queued_writes")?,
            max_inflight_bytes: s.int("remote_max_inflight_bytes", d.max_inflight_bytes)?,
            negative_ttl: s.secs("remote_negative_ttl_s", d.negative_ttl)?,
            max_fetch_keys: s
                .int::<usize>("remote_max_fetch_keys", d.max_fetch_keys)?
                .max(1),
            password_env: s.opt_str("remote_password_env")?.unwrap_or(d.password_env),
            tls_ca_file: s.opt_path("remote_tls_ca_file")?,
        })
    }

    /// The tiered manager's `remote_store_threshold`.
    pub(crate) fn store_threshold(s: &Settings<'_>) -> PyResult<u32> {
        s.int("remote_store_threshold", 0)
    }

    /// The remote tier's config (`url` must be set), with this layout (its namespace replaced by
    /// `remote_namespace` when given).
    pub(crate) fn config(self, mut layout: Layout, owner: Option<String>) -> RemoteConfig {
        if let Some(ns) = self.namespace {
            layout.namespace = ns;
        }
        let url = self.url.unwrap_or_default();
        let url = if self.cluster && !url.contains("+cluster://") {
            url.replacen("://", "+cluster://", 1)
        } else {
            url
        };
        let mut rc = RemoteConfig::new(url, layout);
        rc.ttl = self.ttl;
        rc.connect_timeout = self.connect_timeout;
        rc.io_timeout = self.io_timeout;
        if let Some(n) = self.io_threads {
            rc.io_threads = n;
        }
        if let Some(d) = self.idle_spin {
            rc.idle_spin = d;
        }
        if let Some(d) = self.idle_nap {
            rc.idle_nap = d;
        }
        if let Some(n) = self.max_queued_writes {
            rc.max_queued_writes = n;
        }
        rc.max_inflight_bytes = self.max_inflight_bytes;
        rc.negative_ttl = self.negative_ttl;
        rc.max_fetch_keys = self.max_fetch_keys;
        rc.password_env = self.password_env;
        rc.tls_ca_file = self.tls_ca_file;
        rc.owner = owner;
        rc
    }
}

/// The object tier's settings (both constructors; `object_store_threshold` only in the tiered
/// manager, read by [`ObjectSettings::store_threshold`]). `url` is `None` without an object tier
/// (the other settings are checked all the same).
pub(crate) struct ObjectSettings {
    pub(crate) url: Option<String>,
    endpoint: Option<String>,
    region: Option<String>,
    namespace: Option<String>,
    pub(crate) bytes_to_use: Option<u64>,
    ttl: Option<Duration>,
    connect_timeout: Duration,
    io_timeout: Duration,
    max_retries: usize,
    io_threads: usize,
    max_requests: usize,
    max_queued_writes: usize,
    max_inflight_bytes: u64,
    negative_ttl: Duration,
    list_interval: Option<Duration>,
    multipart_bytes: u64,
    profile: Option<String>,
}

/// `ObjectConfig`'s defaults (the URL, budget and layout do not matter).
fn object_defaults() -> ObjectConfig {
    ObjectConfig::new(String::new(), 0, Layout::default())
}

impl ObjectSettings {
    pub(crate) fn read(s: &Settings<'_>) -> PyResult<Self> {
        let d = object_defaults();
        let io_threads: usize = s.int("object_io_threads", d.io_threads)?;
        if io_threads == 0 || io_threads > MAX_REMOTE_IO_THREADS {
            return Err(PyValueError::new_err(format!(
                "object_io_threads must be in 1..={MAX_REMOTE_IO_THREADS}, got {io_threads}"
            )));
        }
        let max_requests: usize = s.int("object_max_requests", d.max_requests)?;
        if max_requests == 0 || max_requests > 4096 {
            return Err(PyValueError::new_err(format!(
                "object_max_requests must be in 1..=4096, got {max_requests}"
            )));
        }
        let multipart_bytes: u64 = s.int("object_multipart_bytes", d.multipart_bytes)?;
        if !(5 << 20..=5 << 30).contains(&multipart_bytes) {
            return Err(PyValueError::new_err(format!(
                "object_multipart_bytes must be in 5 MiB..=5 GiB (S3's part sizes), got {multipart_bytes}"
            )));
        }
        let bytes_to_use: Option<u64> = s.opt_int("object_bytes_to_use")?;
        if bytes_to_use == Some(0) {
            return Err(PyValueError::new_err("object_bytes_to_use must be > 0"));
        }
        // `object_list_interval_s=None` means "list only at start"; absent means the default.
        let list_interval = match s.kw.get_item("object_list_interval_s")? {
            None => d.list_interval,
            Some(v) if v.is_none() => {
                s.kw.del_item("object_list_interval_s")?;
                None
            }
            Some(_) => s.opt_secs("object_list_interval_s")?,
        };
        Ok(Self {
            url: s.opt_str("object_url")?,
            endpoint: s.opt_str("object_endpoint")?,
            region: s.opt_str("object_region")?,
            namespace: s.opt_str("object_namespace")?,
            bytes_to_use,
            ttl: s.opt_secs("object_ttl_s")?,
            connect_timeout: s.secs("object_connect_timeout_s", d.connect_timeout)?,
            io_timeout: s.secs("object_timeout_s", d.io_timeout)?,
            max_retries: s.int("object_max_retries", d.max_retries)?.min(16),
            io_threads,
            max_requests,
            max_queued_writes: s.int("object_max_queued_writes", d.max_queued_writes)?,
            max_inflight_bytes: s.int("object_max_inflight_bytes", d.max_inflight_bytes)?,
            negative_ttl: s.secs("object_negative_ttl_s", d.negative_ttl)?,
            list_interval,
            multipart_bytes,
            profile: s.opt_str("object_profile")?,
        })
    }

    /// The tiered manager's `object_store_threshold`.
    pub(crate) fn store_threshold(s: &Settings<'_>) -> PyResult<u32> {
        s.int("object_store_threshold", 0)
    }

    /// The object tier's config (`url` must be set) with a budget of `bytes` and this layout (its
    /// namespace replaced by `object_namespace` when given).
    pub(crate) fn config(
        self,
        bytes: u64,
        mut layout: Layout,
        owner: Option<String>,
    ) -> ObjectConfig {
        if let Some(ns) = self.namespace {
            layout.namespace = ns;
        }
        let mut c = ObjectConfig::new(self.url.unwrap_or_default(), bytes, layout);
        c.endpoint = self.endpoint;
        c.region = self.region;
        c.ttl = self.ttl;
        c.connect_timeout = self.connect_timeout;
        c.io_timeout = self.io_timeout;
        c.max_retries = self.max_retries;
        c.io_threads = self.io_threads;
        c.max_requests = self.max_requests;
        c.max_queued_writes = self.max_queued_writes;
        c.max_inflight_bytes = self.max_inflight_bytes;
        c.negative_ttl = self.negative_ttl;
        c.list_interval = self.list_interval;
        c.multipart_bytes = self.multipart_bytes;
        c.profile = self.profile;
        c.owner = owner;
        c
    }
}

/// Checks settings as the constructors read them, opening nothing (vLLM's and SGLang's config
/// surfaces call it before an engine starts). `kind`: `"manager"` (the tiered manager's
/// settings) or `"store"` (the block store's).
///
/// # Errors
/// `TypeError` (wrong type, unknown setting), `ValueError`/`ConfigError` (out of range), naming
/// the setting.
#[pyfunction]
#[pyo3(signature = (kind, **settings))]
fn check_tier_settings(
    py: Python<'_>,
    kind: &str,
    settings: Option<&Bound<'_, PyDict>>,
) -> PyResult<()> {
    let s = Settings::new(py, settings)?;
    layout(&s)?;
    FileSettings::read(&s)?;
    RemoteSettings::read(&s)?;
    ObjectSettings::read(&s)?;
    match kind {
        "manager" => {
            HostSettings::read(&s)?;
            FileSettings::store_threshold(&s)?;
            RemoteSettings::store_threshold(&s)?;
            ObjectSettings::store_threshold(&s)?;
            s.finish("TieredOffloadingManager")
        }
        "store" => s.finish("BlockStore"),
        other => Err(PyValueError::new_err(format!(
            "kind must be 'manager' or 'store', got {other:?}"
        ))),
    }
}

/// `TIER_DEFAULTS`: every tier setting's default as the constructors apply it (`None`: none, or
/// chosen by the machine or the surface — see the setting's docs).
fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    let m = ManagerConfig::new(0);
    let c = ChainConfig::default();
    let f = file_defaults();
    let r = remote_defaults();
    d.set_item("block_size", m.block_size)?;
    d.set_item("enable_events", m.enable_events)?;
    d.set_item("store_threshold", m.store_threshold)?;
    d.set_item("max_tracker_size", m.max_tracker_size)?;
    d.set_item("max_promotions", c.max_promotions)?;
    d.set_item("disk_store_threshold", 0)?;
    d.set_item("io_threads", f.io_threads)?;
    d.set_item("write_threads", f.write_threads)?;
    d.set_item("max_queued_writes", f.max_queued_writes)?;
    d.set_item("fsync", f.fsync)?;
    d.set_item("direct_io", super::names::direct_io_name(f.direct_io))?;
    d.set_item(
        "rescan_interval_s",
        f.rescan_interval.map(|r| r.as_secs_f64()),
    )?;
    d.set_item("allow_writable_dir", f.allow_writable_dir)?;
    d.set_item("remote_store_threshold", 0)?;
    d.set_item("remote_cluster", false)?;
    d.set_item("remote_ttl_s", r.ttl.map(|t| t.as_secs_f64()))?;
    d.set_item("remote_connect_timeout_s", r.connect_timeout.as_secs_f64())?;
    d.set_item("remote_timeout_s", r.io_timeout.as_secs_f64())?;
    d.set_item("remote_io_threads", r.io_threads)?;
    d.set_item("remote_max_queued_writes", r.max_queued_writes)?;
    d.set_item("remote_max_inflight_bytes", r.max_inflight_bytes)?;
    d.set_item("remote_negative_ttl_s", r.negative_ttl.as_secs_f64())?;
    d.set_item("remote_max_fetch_keys", r.max_fetch_keys)?;
    d.set_item("remote_password_env", r.password_env)?;
    d.set_item("remote_idle_spin_s", py.None())?;
    d.set_item("remote_idle_nap_s", py.None())?;
    let o = object_defaults();
    d.set_item("object_store_threshold", 0)?;
    d.set_item("object_region", py.None())?;
    d.set_item("object_ttl_s", o.ttl.map(|t| t.as_secs_f64()))?;
    d.set_item("object_connect_timeout_s", o.connect_timeout.as_secs_f64())?;
    d.set_item("object_timeout_s", o.io_timeout.as_secs_f64())?;
    d.set_item("object_max_retries", o.max_retries)?;
    d.set_item("object_io_threads", o.io_threads)?;
    d.set_item("object_max_requests", o.max_requests)?;
    d.set_item("object_max_queued_writes", o.max_queued_writes)?;
    d.set_item("object_max_inflight_bytes", o.max_inflight_bytes)?;
    d.set_item("object_negative_ttl_s", o.negative_ttl.as_secs_f64())?;
    d.set_item(
        "object_list_interval_s",
        o.list_interval.map(|t| t.as_secs_f64()),
    )?;
    d.set_item("object_multipart_bytes", o.multipart_bytes)?;
    Ok(d)
}

/// `TIERS`: every registered tier's kind (`crate::tier::registry::TIERS`, in chain order) and the
/// names of its own stats (`<kind>_<name>` in `get_stats()`).
fn registered(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for t in crate::tier::registry::TIERS {
        d.set_item(t.kind, PyTuple::new(py, t.extra_stats)?)?;
    }
    Ok(d)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("TIERS", registered(m.py())?)?;
    m.add("TIER_DEFAULTS", defaults(m.py())?)?;
    m.add("MAX_REMOTE_IO_THREADS", MAX_REMOTE_IO_THREADS)?;
    m.add("MAX_IDLE_SPIN_S", MAX_IDLE_SPIN_S)?;
    m.add_function(wrap_pyfunction!(check_tier_settings, m)?)?;
    Ok(())
}
