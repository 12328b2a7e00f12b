//! Python classes of the scheduler side (docs/spec.md §2): `OffloadingManager` and its two policies,
//! `CPULoadStoreSpec`, `PrepareStoreOutput`, `OffloadingEvent`.
//!
//! Each manager object is `frozen` and holds its Rust manager behind a mutex; every call validates
//! its arguments completely before the Rust manager sees them, so a call that raises changes nothing.
#![forbid(unsafe_code)]

use std::sync::Mutex;

use numpy::PyArray1;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use super::enter::{locked, Hold};
use super::errors::IntoPyResult;
use super::keys::{extract_key, extract_keys, type_name};
use super::specs::{PyCpuSpec, PyOffloadingEvent, PyPrepareStoreOutput};
use crate::key::ByteKey;
use crate::manager::{
    AnyManager, ManagerConfig, OffloadingEvent, OffloadingManager, PolicyKind, Presence,
};

struct State {
    mgr: AnyManager<ByteKey>,
    /// Set by `shutdown()`: the accessors (`len`, `num_blocks`, …) refuse too (docs/spec.md §7).
    shut_down: bool,
}

/// Base class of the offloading managers.
#[pyclass(name = "OffloadingManager", module = "kvoff._native", subclass, frozen)]
pub struct PyManager {
    state: Mutex<State>,
    policy: PolicyKind,
}

fn config(
    num_blocks: &Bound<'_, PyAny>,
    block_size: &Bound<'_, PyAny>,
    enable_events: bool,
    store_threshold: &Bound<'_, PyAny>,
    max_tracker_size: &Bound<'_, PyAny>,
) -> PyResult<ManagerConfig> {
    let int = |o: &Bound<'_, PyAny>, name: &str| -> PyResult<usize> {
        if o.is_instance_of::<pyo3::types::PyBool>() || !o.is_instance_of::<pyo3::types::PyInt>() {
            return Err(PyTypeError::new_err(format!(
                "{name} must be an int, got {}",
                type_name(o)
            )));
        }
        // Out of i128 range is still an int: a range error, not an OverflowError.
        let v: i128 = o.extract().unwrap_or(i128::MAX);
        usize::try_from(v)
            .ok()
            .filter(|&v| v < u32::MAX as usize)
            .ok_or_else(|| {
                PyValueError::new_err(format!("{name} must be in 0..{}, got {v}", u32::MAX))
            })
    };
    let cfg = ManagerConfig {
        num_blocks: int(num_blocks, "num_blocks")?,
        block_size: int(block_size, "block_size")?,
        enable_events,
        store_threshold: int(store_threshold, "store_threshold")?,
        max_tracker_size: int(max_tracker_size, "max_tracker_size")?,
    };
    cfg.validate().py()?;
    Ok(cfg)
}

fn ids_array<'py>(py: Python<'py>, ids: &[u32]) -> Bound<'py, PyArray1<i64>> {
    PyArray1::from_iter(py, ids.iter().map(|&i| i64::from(i)))
}

fn event_to_py(py: Python<'_>, e: &OffloadingEvent<ByteKey>) -> PyResult<Py<PyOffloadingEvent>> {
    let keys = PyList::new(py, e.keys.iter().map(|k| PyBytes::new(py, k.as_bytes())))?;
    Py::new(
        py,
        PyOffloadingEvent {
            keys: keys.unbind(),
            block_size: e.block_size,
            medium: e.medium.to_owned(),
            removed: e.removed,
        },
    )
}

fn shut_down_error() -> crate::KvoffError {
    crate::KvoffError::state("the manager was shut down; create a new one")
}

impl PyManager {
    fn new_with(policy: PolicyKind, cfg: ManagerConfig) -> PyResult<Self> {
        let mgr = AnyManager::try_new(policy, cfg).py()?;
        Ok(Self {
            state: Mutex::new(State {
                mgr,
                shut_down: false,
            }),
            policy,
        })
    }

    /// Runs `f` on the manager under its lock: the one way every method reaches the Rust manager.
    ///
    /// Lock and GIL discipline (docs/spec.md §7): `f` is plain Rust (no Python object is touched, no
    /// Python code can run while the lock is held), arguments are converted before and results
    /// after; the lock is taken without waiting while the GIL is held (`try_lock`), and when another
    /// thread holds it, the wait happens with the GIL released, so a thread that holds the lock and
    /// needs the GIL can always finish. A panic (a kvoff bug) shuts the manager down, so that later
    /// calls fail cleanly instead of using a half-updated state, and becomes the internal error.
    fn run<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut State) -> Result<R, crate::KvoffError> + Send,
    ) -> PyResult<R> {
        let on_panic = |st: &mut State| {
            st.mgr.shutdown();
            st.shut_down = true;
        };
        locked(py, &self.state, Hold::Brief, on_panic, f)
    }

    /// Like [`run`](Self::run) for a call that only reads, refusing after `shutdown()`.
    fn read<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&AnyManager<ByteKey>) -> R + Send,
    ) -> PyResult<R> {
        self.run(py, |st| {
            if st.shut_down {
                return Err(shut_down_error());
            }
            Ok(f(&st.mgr))
        })
    }

    /// Converts `keys` to Rust keys (no lock held: the iterable may run any Python code, even
    /// call this manager), then runs `f` with them under the lock.
    fn run_keys<R: Send>(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        f: impl FnOnce(&mut AnyManager<ByteKey>, &[ByteKey]) -> Result<R, crate::KvoffError> + Send,
    ) -> PyResult<R> {
        let mut ks = Vec::new();
        extract_keys(keys, &mut ks)?;
        self.run(py, move |st| f(&mut st.mgr, &ks))
    }
}

#[pymethods]
impl PyManager {
    /// Policy name, `"lru"` or `"arc"`.
    #[getter]
    fn policy(&self) -> &'static str {
        self.policy.name()
    }

    /// Capacity in CPU blocks.
    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, OffloadingManager::num_blocks)
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, OffloadingManager::len)
    }

    /// `True` ready/loading, `None` pending, `False` absent.
    #[pyo3(signature = (key, req_context=None))]
    fn lookup(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<bool>> {
        let _ = req_context;
        let k = extract_key(key)?;
        let p = self.run(py, |st| st.mgr.lookup(&k))?;
        Ok(match p {
            Presence::Ready => Some(true),
            Presence::Pending => None,
            Presence::Absent => Some(false),
        })
    }

    /// Number of leading ready keys; `None` if the first non-ready key is pending.
    #[pyo3(signature = (keys, req_context=None))]
    fn lookup_prefix(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<usize>> {
        let _ = req_context;
        self.run_keys(py, keys, |m, ks| m.lookup_prefix(ks))
    }

    /// Pins ready keys for loading; returns their CPU spec.
    #[pyo3(signature = (keys, req_context=None))]
    fn prepare_load(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyCpuSpec> {
        let _ = req_context;
        let ids = self.run_keys(py, keys, OffloadingManager::prepare_load)?;
        Ok(PyCpuSpec {
            block_ids: ids_array(py, &ids).unbind(),
        })
    }

    /// Recency update (the first key ends most recently used).
    #[pyo3(signature = (keys, req_context=None))]
    fn touch(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = req_context;
        self.run_keys(py, keys, OffloadingManager::touch)
    }

    /// Unpins keys whose load finished.
    #[pyo3(signature = (keys, req_context=None))]
    fn complete_load(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = req_context;
        self.run_keys(py, keys, OffloadingManager::complete_load)
    }

    /// docs/spec.md §2.3. `None` when there is not enough evictable room (nothing changed).
    #[pyo3(signature = (keys, req_context=None))]
    fn prepare_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<PyPrepareStoreOutput>> {
        let _ = req_context;
        // Keep a sequence of the caller's objects so the stored keys are handed back as they came.
        // A single `bytes` object is kept as is and rejected by extract_keys with a clear message.
        let seq: Bound<'_, PyAny> = if keys.is_instance_of::<PyList>()
            || keys.is_instance_of::<PyTuple>()
            || keys.is_instance_of::<PyBytes>()
        {
            keys.clone()
        } else {
            match keys.try_iter() {
                Ok(it) => PyList::new(py, it.collect::<PyResult<Vec<_>>>()?)?.into_any(),
                Err(_) => keys.clone(),
            }
        };
        let out = self.run_keys(py, &seq, AnyManager::prepare_store_indexed)?;
        let Some(out) = out else { return Ok(None) };
        let stored = PyList::empty(py);
        for &p in &out.positions {
            stored.append(seq.get_item(p)?)?;
        }
        let evicted = PyList::new(
            py,
            out.evicted_keys
                .iter()
                .map(|k| PyBytes::new(py, k.as_bytes())),
        )?;
        Ok(Some(PyPrepareStoreOutput {
            keys_to_store: stored.unbind(),
            store_spec: Py::new(
                py,
                PyCpuSpec {
                    block_ids: ids_array(py, &out.block_ids).unbind(),
                },
            )?,
            evicted_keys: evicted.unbind(),
        }))
    }

    /// Pending keys become ready (`success`) or are removed (failure).
    #[pyo3(signature = (keys, success=true, req_context=None))]
    fn complete_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        success: bool,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = req_context;
        self.run_keys(py, keys, |m, ks| m.complete_store(ks, success))
    }

    /// Drains events in order.
    #[pyo3(signature = (req_context=None))]
    fn take_events(
        &self,
        py: Python<'_>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<Py<PyOffloadingEvent>>> {
        let _ = req_context;
        let evs = self.run(py, |st| st.mgr.take_events())?;
        evs.iter().map(|e| event_to_py(py, e)).collect()
    }

    /// Gauges and counters; resets `stores_skipped`.
    #[pyo3(signature = (req_context=None))]
    fn get_stats<'py>(
        &self,
        py: Python<'py>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let _ = req_context;
        let s = self.run(py, |st| st.mgr.get_stats())?;
        let d = PyDict::new(py);
        d.set_item("usage", s.usage)?;
        d.set_item("write_usage", s.write_usage)?;
        d.set_item("read_usage", s.read_usage)?;
        d.set_item("num_blocks", s.num_blocks)?;
        d.set_item("num_present", s.num_present)?;
        d.set_item("num_free", s.num_free)?;
        d.set_item("num_evictable", s.num_evictable)?;
        d.set_item("stores_skipped", s.stores_skipped)?;
        Ok(d)
    }

    /// Forgets every key, ghost and counter; pending events stay.
    #[pyo3(signature = (req_context=None))]
    fn reset(&self, py: Python<'_>, req_context: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let _ = req_context;
        self.run(py, |st| st.mgr.reset())
    }

    /// Idempotent; later calls of other methods raise `InvalidStateError`.
    #[pyo3(signature = (req_context=None))]
    fn shutdown(&self, py: Python<'_>, req_context: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let _ = req_context;
        self.run(py, |st| {
            st.mgr.shutdown();
            st.shut_down = true;
            Ok(())
        })
    }

    /// ARC's target size of T1 (`None` for LRU). Introspection for tests and tuning.
    #[getter]
    fn arc_target(&self, py: Python<'_>) -> PyResult<Option<f64>> {
        self.read(py, AnyManager::arc_target)
    }

    /// Keys of each list from LRU to MRU: `(T1, T2, B1, B2)` for ARC, `(order, [], [], [])` for LRU.
    fn debug_lists<'py>(&self, py: Python<'py>) -> PyResult<Vec<Vec<Bound<'py, PyBytes>>>> {
        let lists = self.read(py, AnyManager::debug_lists)?;
        Ok(lists
            .iter()
            .map(|l| l.iter().map(|k| PyBytes::new(py, k.as_bytes())).collect())
            .collect())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let (n, cap) = self.read(py, |m| (m.len(), m.num_blocks()))?;
        Ok(format!(
            "<{} manager: {n}/{cap} blocks>",
            self.policy.name().to_uppercase()
        ))
    }
}

/// Defines one policy's Python class: a subclass of `OffloadingManager` with docs/spec.md §2's constructor.
macro_rules! policy_class {
    ($(#[$doc:meta])* $ty:ident, $pyname:literal, $policy:expr) => {
        $(#[$doc])*
        #[pyclass(name = $pyname, module = "kvoff._native", extends = PyManager, frozen)]
        pub struct $ty;

        #[pymethods]
        impl $ty {
            #[new]
            #[pyo3(signature = (num_blocks, *, block_size=None, enable_events=false, store_threshold=None, max_tracker_size=None))]
            fn new(
                py: Python<'_>,
                num_blocks: &Bound<'_, PyAny>,
                block_size: Option<&Bound<'_, PyAny>>,
                enable_events: bool,
                store_threshold: Option<&Bound<'_, PyAny>>,
                max_tracker_size: Option<&Bound<'_, PyAny>>,
            ) -> PyResult<PyClassInitializer<Self>> {
                let cfg = kw_config(
                    py,
                    num_blocks,
                    block_size,
                    enable_events,
                    store_threshold,
                    max_tracker_size,
                )?;
                Ok(PyClassInitializer::from(PyManager::new_with($policy, cfg)?).add_subclass($ty))
            }
        }
    };
}

policy_class!(
    /// LRU offloading manager (docs/spec.md §2.4).
    PyLru,
    "LRUOffloadingManager",
    PolicyKind::Lru
);
policy_class!(
    /// ARC offloading manager (docs/spec.md §2.5).
    PyArc,
    "ARCOffloadingManager",
    PolicyKind::Arc
);

fn kw_config(
    py: Python<'_>,
    num_blocks: &Bound<'_, PyAny>,
    block_size: Option<&Bound<'_, PyAny>>,
    enable_events: bool,
    store_threshold: Option<&Bound<'_, PyAny>>,
    max_tracker_size: Option<&Bound<'_, PyAny>>,
) -> PyResult<ManagerConfig> {
    let zero = 0i64.into_pyobject(py)?.into_any();
    let dflt = ManagerConfig::new(0)
        .max_tracker_size
        .into_pyobject(py)?
        .into_any();
    config(
        num_blocks,
        block_size.unwrap_or(&zero),
        enable_events,
        store_threshold.unwrap_or(&zero),
        max_tracker_size.unwrap_or(&dflt),
    )
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add(
        "POLICIES",
        PyTuple::new(m.py(), PolicyKind::ALL.map(PolicyKind::name))?,
    )?;
    let rules = PyDict::new(m.py());
    for k in PolicyKind::ALL {
        rules.set_item(k.name(), k.touch_rule().name())?;
    }
    m.add("POLICY_TOUCH_RULES", rules)?;
    m.add_class::<PyManager>()?;
    m.add_class::<PyLru>()?;
    m.add_class::<PyArc>()?;
    m.add_class::<PyCpuSpec>()?;
    m.add_class::<PyPrepareStoreOutput>()?;
    m.add_class::<PyOffloadingEvent>()?;
    Ok(())
}
