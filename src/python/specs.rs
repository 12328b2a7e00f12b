//! The value types of the scheduler-side protocol (docs/spec.md §2): `CPULoadStoreSpec`,
//! `PrepareStoreOutput`, `OffloadingEvent`, and the checked int64 id arrays they hold.
#![forbid(unsafe_code)]

use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use super::keys::extract_keys;

/// CPU block ids of a load or store (`block_ids`: int64 numpy array).
#[pyclass(name = "CPULoadStoreSpec", module = "kvoff._native", frozen)]
pub struct PyCpuSpec {
    pub(super) block_ids: Py<PyArray1<i64>>,
}

#[pymethods]
impl PyCpuSpec {
    #[new]
    fn new(py: Python<'_>, block_ids: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self {
            block_ids: int64_array(py, block_ids, "block_ids")?.unbind(),
        })
    }

    /// The block ids (int64, one dimension).
    #[getter]
    fn block_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.block_ids.bind(py).clone()
    }

    /// The medium name, `"CPU"`.
    #[staticmethod]
    fn medium() -> &'static str {
        "CPU"
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.block_ids.bind(py).len()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "CPULoadStoreSpec({})",
            self.block_ids.bind(py).repr()?
        ))
    }
}

/// Converts ids to a one-dimensional int64 numpy array (no copy if it already is one).
///
/// # Errors
/// `TypeError` for non-integer input, `ValueError` for negative ids or more than one dimension.
pub(crate) fn int64_array<'py>(
    py: Python<'py>,
    o: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    if let Ok(a) = o.cast::<PyArray1<i64>>() {
        let a = a.clone();
        check_non_negative(&a, what)?;
        return Ok(a);
    }
    let np = py.import("numpy")?;
    let arr = np.call_method1("asarray", (o,))?;
    let kind: String = arr.getattr("dtype")?.getattr("kind")?.extract()?;
    let ndim: usize = arr.getattr("ndim")?.extract()?;
    let size: usize = arr.getattr("size")?.extract()?;
    if size > 0 && kind != "i" && kind != "u" {
        return Err(PyTypeError::new_err(format!(
            "{what} must be integers, got dtype kind {kind:?}"
        )));
    }
    if ndim != 1 {
        return Err(PyValueError::new_err(format!(
            "{what} must be one-dimensional, got {ndim} dimensions"
        )));
    }
    let arr = arr.call_method1("astype", ("int64",))?;
    let a = arr
        .cast_into::<PyArray1<i64>>()
        .map_err(|e| PyTypeError::new_err(e.to_string()))?;
    check_non_negative(&a, what)?;
    Ok(a)
}

fn check_non_negative(a: &Bound<'_, PyArray1<i64>>, what: &str) -> PyResult<()> {
    let ro = a.readonly();
    if let Some(v) = ro.as_array().iter().find(|&&v| v < 0) {
        return Err(PyValueError::new_err(format!(
            "{what} must be non-negative, found {v}"
        )));
    }
    Ok(())
}

/// Result of `prepare_store`.
#[pyclass(name = "PrepareStoreOutput", module = "kvoff._native", frozen)]
pub struct PyPrepareStoreOutput {
    /// Keys to store now, in input order (absent keys that were admitted).
    #[pyo3(get)]
    pub(super) keys_to_store: Py<PyList>,
    /// CPU block ids for `keys_to_store`, co-indexed: where the worker writes them.
    #[pyo3(get)]
    pub(super) store_spec: Py<PyCpuSpec>,
    /// Keys evicted to make room, in eviction order.
    #[pyo3(get)]
    pub(super) evicted_keys: Py<PyList>,
}

#[pymethods]
impl PyPrepareStoreOutput {
    #[new]
    fn new(
        py: Python<'_>,
        keys_to_store: &Bound<'_, PyAny>,
        store_spec: Py<PyCpuSpec>,
        evicted_keys: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let mut scratch = Vec::new();
        extract_keys(keys_to_store, &mut scratch)?;
        extract_keys(evicted_keys, &mut scratch)?;
        Ok(Self {
            keys_to_store: PyList::new(
                py,
                keys_to_store.try_iter()?.collect::<PyResult<Vec<_>>>()?,
            )?
            .unbind(),
            store_spec,
            evicted_keys: PyList::new(py, evicted_keys.try_iter()?.collect::<PyResult<Vec<_>>>()?)?
                .unbind(),
        })
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "PrepareStoreOutput(keys_to_store={}, store_spec={}, evicted_keys={})",
            self.keys_to_store.bind(py).repr()?,
            self.store_spec.bind(py).repr()?,
            self.evicted_keys.bind(py).repr()?
        ))
    }
}

/// A change of the set of ready blocks.
#[pyclass(name = "OffloadingEvent", module = "kvoff._native", frozen)]
pub struct PyOffloadingEvent {
    /// The keys that became ready (stored) or were removed (evicted).
    #[pyo3(get)]
    pub(super) keys: Py<PyList>,
    /// The manager's `block_size` setting (tokens per block), as configured.
    #[pyo3(get)]
    pub(super) block_size: usize,
    /// Where the blocks live: `"CPU"`.
    #[pyo3(get)]
    pub(super) medium: String,
    /// `True` for removals, `False` for stores.
    #[pyo3(get)]
    pub(super) removed: bool,
}

#[pymethods]
impl PyOffloadingEvent {
    #[new]
    #[pyo3(signature = (keys, block_size, medium, removed))]
    fn new(
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        block_size: usize,
        medium: String,
        removed: bool,
    ) -> PyResult<Self> {
        let mut scratch = Vec::new();
        extract_keys(keys, &mut scratch)?;
        Ok(Self {
            keys: PyList::new(py, scratch.iter().map(|k| PyBytes::new(py, k.as_bytes())))?.unbind(),
            block_size,
            medium,
            removed,
        })
    }

    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        let Ok(o) = other.cast::<PyOffloadingEvent>() else {
            return Ok(false);
        };
        let o = o.get();
        Ok(self.block_size == o.block_size
            && self.medium == o.medium
            && self.removed == o.removed
            && self.keys.bind(py).eq(o.keys.bind(py))?)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "OffloadingEvent(keys={}, block_size={}, medium={:?}, removed={})",
            self.keys.bind(py).repr()?,
            self.block_size,
            self.medium,
            if self.removed { "True" } else { "False" }
        ))
    }
}
