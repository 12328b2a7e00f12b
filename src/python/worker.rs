//! Python bindings of the worker side (SPEC §3–§6): sizing, pointer expansion, host regions and the
//! native transfer handler that `kvoff.handlers` builds its public classes on.
//!
//! Memory safety at the Python boundary. The only `unsafe` here is [`TransferEngine::submit`]. It is
//! sound because a [`PyTransferHandler`]:
//! 1. is built from **torch tensors**, not raw pointers: every descriptor is derived from a tensor's
//!    `data_ptr`/shape/strides and checked to lie inside that tensor's untyped storage;
//! 2. keeps every one of those tensors alive (a strong reference) until its engine has been shut
//!    down (drained), which happens in `shutdown()` or, at the latest, in `Drop` before the
//!    references are released;
//! 3. checks that the GPU-side tensors are mutually disjoint, and so are the CPU-side tensors (byte
//!    exact for equal-stride interleaved views such as the block-major host layout), so that the
//!    planner's plans satisfy the engine's no-overlap obligation;
//! 4. plans every job with a [`CopyPlanner`], which validates every copy against those extents before
//!    anything is enqueued.
//!
//! Host regions hand out zero-copy views as numpy/torch arrays through a small exporter object
//! (`__array_interface__`) that holds an `Arc` of the region, so the mapping outlives every view:
//! `HostRegion.close()` releases the region's own hold and unmaps at once when no view is alive,
//! otherwise when the last view is garbage-collected.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::Duration;

use numpy::{
    PyArray1, PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use super::errors::{guard, to_py, IntoPyResult};
use super::keys::type_name;
use crate::engine::{HostEngine, Job, JobResult, TransferEngine};
use crate::error::KvoffError;
use crate::plan::{CopyPlanner, Direction, GpuSpec, PlanRef, TensorDesc};
use crate::region::{HostRegion, RegionOptions};

// ---------------------------------------------------------------------------------------------
// Argument helpers
// ---------------------------------------------------------------------------------------------

/// Block ids taken from Python: borrowed from a contiguous int64 numpy array (no copy) or owned.
pub(crate) enum Ids<'py> {
    /// A contiguous 1-D int64 array (checked at construction).
    Borrowed(PyReadonlyArray1<'py, i64>),
    /// Converted from another dtype, a non-contiguous array or a sequence.
    Owned(Vec<i64>),
}

impl Ids<'_> {
    pub(crate) fn as_slice(&self) -> &[i64] {
        match self {
            // Contiguity was checked when the value was built, so `as_slice` succeeds.
            Self::Borrowed(a) => a.as_slice().unwrap_or(&[]),
            Self::Owned(v) => v,
        }
    }
}

/// Reads a 1-D id array: an int64 numpy array is borrowed without copying; other integer arrays and
/// sequences of ints are converted.
///
/// # Errors
/// `TypeError` for non-integer data, `ValueError` for an array that is not 1-D.
pub(crate) fn ids_arg<'py>(o: &Bound<'py, PyAny>, name: &str) -> PyResult<Ids<'py>> {
    if let Ok(a) = o.extract::<PyReadonlyArray1<'py, i64>>() {
        if a.as_slice().is_ok() {
            return Ok(Ids::Borrowed(a));
        }
        return Ok(Ids::Owned(a.as_array().iter().copied().collect()));
    }
    if let Ok(arr) = o.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Err(PyValueError::new_err(format!(
                "{name} must be a 1-D array of block ids, got shape {:?}",
                arr.shape()
            )));
        }
        if arr.len() == 0 {
            return Ok(Ids::Owned(Vec::new()));
        }
        let kind = arr.dtype().kind();
        if kind != b'i' && kind != b'u' {
            return Err(PyTypeError::new_err(format!(
                "{name} must hold integers, got a numpy array of dtype {}",
                arr.dtype()
            )));
        }
        let conv = arr.call_method1("astype", ("int64",))?;
        let a = conv.extract::<PyReadonlyArray1<'py, i64>>()?;
        return Ok(Ids::Owned(a.as_array().iter().copied().collect()));
    }
    if o.is_instance_of::<PyString>() || o.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be a 1-D int64 numpy array or a sequence of ints, got {}",
            type_name(o)
        )));
    }
    o.extract::<Vec<i64>>().map(Ids::Owned).map_err(|_| {
        PyTypeError::new_err(format!(
            "{name} must be a 1-D int64 numpy array or a sequence of ints, got {}",
            type_name(o)
        ))
    })
}

/// An `int` argument (not `bool`) as `i128`.
fn int_arg(o: &Bound<'_, PyAny>, name: &str) -> PyResult<i128> {
    if o.is_instance_of::<PyBool>() || !o.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be an int, got {}",
            type_name(o)
        )));
    }
    // Beyond 128 bits is still an int: out of range (ValueError), not an OverflowError.
    o.extract()
        .map_err(|_| PyValueError::new_err(format!("{name} is out of range: {o}")))
}

/// A number of seconds from Python: an `int` or a `float`, not a `bool` (`True` is not "one second").
struct Seconds(f64);

impl<'a, 'py> FromPyObject<'a, 'py> for Seconds {
    type Error = PyErr;

    fn extract(o: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if o.is_instance_of::<PyBool>()
            || !(o.is_instance_of::<PyInt>() || o.is_instance_of::<pyo3::types::PyFloat>())
        {
            return Err(PyTypeError::new_err(format!(
                "timeout must be a number of seconds, got {}",
                type_name(&o)
            )));
        }
        o.extract::<f64>()
            .map(Seconds)
            .map_err(|_| PyValueError::new_err("timeout is out of range"))
    }
}

/// A non-negative `int` argument that fits in `u64`.
fn u64_arg(o: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    let v = int_arg(o, name)?;
    u64::try_from(v)
        .map_err(|_| PyValueError::new_err(format!("{name} must be in 0..2**64, got {v}")))
}

fn usize_arg(o: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    let v = u64_arg(o, name)?;
    usize::try_from(v).map_err(|_| PyValueError::new_err(format!("{name} is too large: {v}")))
}

fn opt_u64_arg(o: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<u64>> {
    match o {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => u64_arg(o, name).map(Some),
    }
}

fn opt_usize_arg(o: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<usize>> {
    match o {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => usize_arg(o, name).map(Some),
    }
}

/// Reinterprets pointers as `int64` (addresses are below 2^63 in practice; the bits are kept).
fn ptrs_to_i64(v: Vec<u64>) -> Vec<i64> {
    v.into_iter()
        .map(|p| i64::from_ne_bytes(p.to_ne_bytes()))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Sizing and expansion (SPEC §3, §4)
// ---------------------------------------------------------------------------------------------

/// `cpu_bytes_to_use` from configuration: `None`, an int, or an integral float such as `64e9`.
fn budget_arg(o: Option<&Bound<'_, PyAny>>) -> PyResult<Option<i64>> {
    let Some(o) = o else { return Ok(None) };
    if o.is_none() {
        return Ok(None);
    }
    let key = crate::sizing::CPU_BYTES_TO_USE_KEY;
    if o.is_instance_of::<PyInt>() && !o.is_instance_of::<PyBool>() {
        let v: i128 = o.extract()?;
        // Clamp: anything beyond i64 is "more than enough"; anything ≤ 0 is rejected by sizing.
        return Ok(Some(i64::try_from(v).unwrap_or(if v > 0 {
            i64::MAX
        } else {
            -1
        })));
    }
    if o.is_instance_of::<PyFloat>() {
        let f: f64 = o.extract()?;
        if f.is_finite() {
            #[allow(clippy::cast_possible_truncation)] // saturating float → int is intended
            return Ok(Some(f.trunc() as i64));
        }
    }
    Err(to_py(KvoffError::Config(format!(
        "`{key}` must be a number of bytes (an int, total for all ranks), got {}: {}",
        type_name(o),
        o.repr().map_or_else(|_| "?".into(), |r| r.to_string())
    ))))
}

/// `cpu_sizing(page_size_bytes, block_size_factor, world_size=1, cpu_bytes_to_use=None)` →
/// `(slot_bytes, row_stride_bytes, num_cpu_blocks)`.
#[pyfunction]
#[pyo3(signature = (page_size_bytes, block_size_factor, world_size=None, cpu_bytes_to_use=None))]
fn cpu_sizing(
    page_size_bytes: &Bound<'_, PyAny>,
    block_size_factor: &Bound<'_, PyAny>,
    world_size: Option<&Bound<'_, PyAny>>,
    cpu_bytes_to_use: Option<&Bound<'_, PyAny>>,
) -> PyResult<(u64, u64, u64)> {
    let budget = budget_arg(cpu_bytes_to_use)?;
    let pages: Vec<u64> = match page_size_bytes.try_iter() {
        Ok(it) => it
            .enumerate()
            .map(|(i, x)| u64_arg(&x?, &format!("page_size_bytes[{i}]")))
            .collect::<PyResult<_>>()?,
        Err(_) => {
            return Err(PyTypeError::new_err(format!(
                "page_size_bytes must be a sequence of ints, got {}",
                type_name(page_size_bytes)
            )))
        }
    };
    let f = u64_arg(block_size_factor, "block_size_factor")?;
    let w = opt_u64_arg(world_size, "world_size")?.unwrap_or(1);
    guard(|| {
        let s = crate::sizing::cpu_sizing(&pages, f, w, budget).py()?;
        Ok((s.slot_bytes, s.row_stride_bytes, s.num_cpu_blocks))
    })
}

/// `expand_block_ids(block_ids, block_size_factor, skip_count=0, count=None) -> int64 array`.
#[pyfunction]
#[pyo3(signature = (block_ids, block_size_factor, skip_count=None, count=None))]
fn expand_block_ids<'py>(
    py: Python<'py>,
    block_ids: &Bound<'py, PyAny>,
    block_size_factor: &Bound<'py, PyAny>,
    skip_count: Option<&Bound<'py, PyAny>>,
    count: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let ids = ids_arg(block_ids, "block_ids")?;
    let f = usize_arg(block_size_factor, "block_size_factor")?;
    let skip = opt_usize_arg(skip_count, "skip_count")?.unwrap_or(0);
    let count = opt_usize_arg(count, "count")?;
    let out = guard(|| crate::expand::expand_block_ids(ids.as_slice(), f, skip, count).py())?;
    Ok(PyArray1::from_vec(py, out))
}

/// `compute_sub_block_ptrs(block_ids, block_size_factor, base_ptr, row_stride, row_bytes,
/// skip_count=0, count=None) -> int64 array`.
#[pyfunction]
#[pyo3(signature = (block_ids, block_size_factor, base_ptr, row_stride, row_bytes, skip_count=None, count=None))]
#[allow(clippy::too_many_arguments)] // the Python signature
fn compute_sub_block_ptrs<'py>(
    py: Python<'py>,
    block_ids: &Bound<'py, PyAny>,
    block_size_factor: &Bound<'py, PyAny>,
    base_ptr: &Bound<'py, PyAny>,
    row_stride: &Bound<'py, PyAny>,
    row_bytes: &Bound<'py, PyAny>,
    skip_count: Option<&Bound<'py, PyAny>>,
    count: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let ids = ids_arg(block_ids, "block_ids")?;
    let f = usize_arg(block_size_factor, "block_size_factor")?;
    let base = u64_arg(base_ptr, "base_ptr")?;
    let stride = u64_arg(row_stride, "row_stride")?;
    let row = u64_arg(row_bytes, "row_bytes")?;
    let skip = opt_usize_arg(skip_count, "skip_count")?.unwrap_or(0);
    let count = opt_usize_arg(count, "count")?;
    let out = guard(|| {
        crate::expand::compute_sub_block_ptrs(ids.as_slice(), f, base, stride, row, skip, count)
            .py()
    })?;
    // Returned as int64 (numpy's pointer-sized int): a pointer that would read negative is refused.
    if let Some(&p) = out.iter().find(|&&p| i64::try_from(p).is_err()) {
        return Err(PyValueError::new_err(format!(
            "sub-block pointer {p:#x} is beyond 2**63 (base_ptr, row_stride or the block ids are wrong)"
        )));
    }
    Ok(PyArray1::from_vec(py, ptrs_to_i64(out)))
}

/// Whether kvoff can use CUDA here (a driver with at least one device).
#[pyfunction]
fn cuda_available() -> bool {
    #[cfg(feature = "cuda")]
    {
        guard(|| Ok(crate::engine::cuda::cuda_available())).unwrap_or(false)
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

// ---------------------------------------------------------------------------------------------
// Host regions (SPEC §5)
// ---------------------------------------------------------------------------------------------

type SharedRegion = Arc<Mutex<HostRegion>>;

fn lock_region(r: &SharedRegion) -> MutexGuard<'_, HostRegion> {
    // Region methods never panic while holding the lock in a way that breaks its invariants
    // (they validate first); recover the guard.
    r.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A host memory region (SPEC §5): private (anonymous) or shared by name in `/dev/shm`.
#[pyclass(name = "HostRegion", module = "kvoff._native", frozen)]
pub struct PyHostRegion {
    inner: Mutex<Option<SharedRegion>>,
    num_cpu_blocks: u64,
    slot_bytes: u64,
    world_size: u64,
    rank: Option<u64>,
    row_stride_bytes: u64,
    path: Option<String>,
}

impl PyHostRegion {
    fn wrap(r: HostRegion) -> Self {
        Self {
            num_cpu_blocks: r.num_cpu_blocks(),
            slot_bytes: r.slot_bytes(),
            world_size: r.world_size(),
            rank: r.rank(),
            row_stride_bytes: r.row_stride_bytes(),
            path: r.path().map(|p| p.display().to_string()),
            inner: Mutex::new(Some(Arc::new(Mutex::new(r)))),
        }
    }

    fn region(&self) -> PyResult<SharedRegion> {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| to_py(KvoffError::state("the host region is closed")))
    }

    fn view_exporter(&self, rank: u64, offset: u64, nbytes: u64) -> PyResult<PyRegionBuffer> {
        let region = self.region()?;
        let v = guard(|| lock_region(&region).view(rank, offset, nbytes).py())?;
        Ok(PyRegionBuffer {
            region,
            ptr: v.ptr,
            rows: v.rows,
            row_stride_bytes: v.row_stride_bytes,
            nbytes: v.nbytes,
        })
    }
}

#[pymethods]
impl PyHostRegion {
    /// A private region of `num_cpu_blocks` rows of `world_size` slots of `slot_bytes`, prefaulted.
    #[staticmethod]
    #[pyo3(signature = (num_cpu_blocks, slot_bytes, world_size=None))]
    fn private(
        py: Python<'_>,
        num_cpu_blocks: &Bound<'_, PyAny>,
        slot_bytes: &Bound<'_, PyAny>,
        world_size: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let n = u64_arg(num_cpu_blocks, "num_cpu_blocks")?;
        let s = u64_arg(slot_bytes, "slot_bytes")?;
        let w = opt_u64_arg(world_size, "world_size")?.unwrap_or(1);
        let r = py.detach(|| guard(|| HostRegion::private(n, s, w).py()))?;
        Ok(Self::wrap(r))
    }

    /// Creates or joins the shared region `name` (a file in `directory`, default `/dev/shm`) as
    /// `rank`, waiting up to `timeout` seconds for its creator. Releases the GIL while waiting.
    #[staticmethod]
    #[pyo3(signature = (name, num_cpu_blocks, slot_bytes, world_size, rank, timeout=Seconds(60.0), directory=None, unlink_when_all_joined=true, prefault=true))]
    #[pyo3(
        text_signature = "(name, num_cpu_blocks, slot_bytes, world_size, rank, timeout=60.0, directory=None, unlink_when_all_joined=True, prefault=True)"
    )]
    #[allow(clippy::too_many_arguments)] // the Python signature
    fn shared(
        py: Python<'_>,
        name: &str,
        num_cpu_blocks: &Bound<'_, PyAny>,
        slot_bytes: &Bound<'_, PyAny>,
        world_size: &Bound<'_, PyAny>,
        rank: &Bound<'_, PyAny>,
        timeout: Seconds,
        directory: Option<std::path::PathBuf>,
        unlink_when_all_joined: bool,
        prefault: bool,
    ) -> PyResult<Self> {
        let Seconds(timeout) = timeout;
        if directory.as_ref().is_some_and(|d| d.as_os_str().is_empty()) {
            return Err(PyValueError::new_err(
                "directory must name a directory (None: /dev/shm), got ''",
            ));
        }
        let n = u64_arg(num_cpu_blocks, "num_cpu_blocks")?;
        let s = u64_arg(slot_bytes, "slot_bytes")?;
        let w = u64_arg(world_size, "world_size")?;
        let r = u64_arg(rank, "rank")?;
        if !timeout.is_finite() || timeout < 0.0 {
            return Err(PyValueError::new_err(format!(
                "timeout must be a finite number of seconds >= 0, got {timeout}"
            )));
        }
        let mut opts = RegionOptions {
            timeout: Duration::from_secs_f64(timeout.min(1e9)),
            unlink_when_all_joined,
            prefault,
            ..RegionOptions::default()
        };
        if let Some(d) = directory {
            opts.dir = d;
        }
        let name = name.to_owned();
        let region =
            py.detach(|| guard(|| HostRegion::create_or_join_with(&name, n, s, w, r, &opts).py()))?;
        Ok(Self::wrap(region))
    }

    /// Number of rows (CPU blocks).
    #[getter]
    fn num_cpu_blocks(&self) -> u64 {
        self.num_cpu_blocks
    }
    /// Bytes of one rank's slot in a row.
    #[getter]
    fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }
    /// Number of ranks (slots per row).
    #[getter]
    fn world_size(&self) -> u64 {
        self.world_size
    }
    /// This process's rank (shared regions); `None` for a private region.
    #[getter]
    fn rank(&self) -> Option<u64> {
        self.rank
    }
    /// Bytes from one row to the next (a multiple of the OS page size).
    #[getter]
    fn row_stride_bytes(&self) -> u64 {
        self.row_stride_bytes
    }
    /// Bytes of all rows.
    #[getter]
    fn len_bytes(&self) -> u64 {
        self.num_cpu_blocks * self.row_stride_bytes
    }
    /// Path of the region file (shared regions), whether or not it is still linked.
    #[getter]
    fn path(&self) -> Option<String> {
        self.path.clone()
    }
    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }
    /// Address of row 0.
    #[getter]
    fn ptr(&self) -> PyResult<u64> {
        Ok(lock_region(&self.region()?).as_ptr())
    }
    /// Whether the region is registered (page-locked) with CUDA.
    #[getter]
    fn is_pinned(&self) -> bool {
        self.region().is_ok_and(|r| lock_region(&r).is_pinned())
    }
    /// Why the last `pin` failed, if it did.
    #[getter]
    fn pin_error(&self) -> Option<String> {
        self.region()
            .ok()
            .and_then(|r| lock_region(&r).pin_error().map(str::to_owned))
    }

    /// A zero-copy 2-D `torch.uint8` tensor `(num_cpu_blocks, nbytes)` with the region's row stride:
    /// bytes `offset..offset+nbytes` of `rank`'s slot in every row. The tensor keeps the mapping
    /// alive. Needs torch.
    fn view<'py>(
        &self,
        py: Python<'py>,
        rank: &Bound<'py, PyAny>,
        offset: &Bound<'py, PyAny>,
        nbytes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let arr = self.view_numpy(py, rank, offset, nbytes)?;
        py.import("torch")?.call_method1("from_numpy", (arr,))
    }

    /// As `view`, as a numpy `uint8` array.
    fn view_numpy<'py>(
        &self,
        py: Python<'py>,
        rank: &Bound<'py, PyAny>,
        offset: &Bound<'py, PyAny>,
        nbytes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let exp = self.view_exporter(
            u64_arg(rank, "rank")?,
            u64_arg(offset, "offset")?,
            u64_arg(nbytes, "nbytes")?,
        )?;
        let exp = Py::new(py, exp)?;
        py.import("numpy")?.call_method1("asarray", (exp,))
    }

    /// Page-locks the region for CUDA device `device` (row-aligned pieces, all or nothing). On
    /// failure the region stays usable and unpinned and `pin_error` says why.
    #[pyo3(signature = (device=0))]
    fn pin(&self, py: Python<'_>, device: i32) -> PyResult<()> {
        let region = self.region()?;
        #[cfg(feature = "cuda")]
        {
            py.detach(|| {
                guard(|| {
                    let dev = crate::engine::cuda::CudaDevice::open(device).py()?;
                    lock_region(&region).pin(dev.registrar()).py()
                })
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (py, device, region);
            Err(to_py(KvoffError::CudaUnavailable(
                "kvoff was built without the `cuda` feature".into(),
            )))
        }
    }

    /// Unregisters what `pin` registered (no-op when not pinned).
    fn unpin(&self, py: Python<'_>) -> PyResult<()> {
        let region = self.region()?;
        py.detach(|| guard(|| lock_region(&region).unpin().py()))
    }

    /// Removes the region's file name (shared regions); the mapping stays. Returns whether a name
    /// was removed.
    fn unlink(&self) -> PyResult<bool> {
        let region = self.region()?;
        guard(|| lock_region(&region).unlink().py())
    }

    /// Releases this object's hold on the mapping: unpins and unmaps now when no view is alive,
    /// otherwise when the last view is garbage-collected. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let taken = self
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(region) = taken else { return Ok(()) };
        match Arc::try_unwrap(region) {
            Ok(m) => {
                let mut r = m.into_inner().unwrap_or_else(PoisonError::into_inner);
                py.detach(|| guard(|| r.close().py()))
            }
            // Views are alive: the last one to go drops the region (its Drop closes it).
            Err(_) => Ok(()),
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "HostRegion(num_cpu_blocks={}, slot_bytes={}, world_size={}, rank={}, \
             row_stride_bytes={}, path={}, closed={})",
            self.num_cpu_blocks,
            self.slot_bytes,
            self.world_size,
            self.rank.map_or_else(|| "None".into(), |r| r.to_string()),
            self.row_stride_bytes,
            self.path
                .as_ref()
                .map_or_else(|| "None".to_owned(), |p| format!("{p:?}")),
            if self.closed() { "True" } else { "False" }
        )
    }
}

/// Exporter of one region view to numpy (`__array_interface__`); holds the region alive.
#[pyclass(name = "RegionBuffer", module = "kvoff._native", frozen)]
pub struct PyRegionBuffer {
    region: SharedRegion,
    ptr: u64,
    rows: u64,
    row_stride_bytes: u64,
    nbytes: u64,
}

#[pymethods]
impl PyRegionBuffer {
    /// numpy's array interface (version 3): a writable `uint8` 2-D strided array.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("typestr", "|u1")?;
        d.set_item("shape", (self.rows, self.nbytes))?;
        d.set_item("strides", (self.row_stride_bytes, 1u64))?;
        d.set_item("data", (self.ptr, false))?;
        Ok(d)
    }

    /// Address of row 0 of the view.
    #[getter]
    fn ptr(&self) -> u64 {
        self.ptr
    }

    fn __repr__(&self) -> String {
        let _ = &self.region;
        format!(
            "RegionBuffer(ptr={:#x}, rows={}, row_stride_bytes={}, nbytes={})",
            self.ptr, self.rows, self.row_stride_bytes, self.nbytes
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Tensors → descriptors
// ---------------------------------------------------------------------------------------------

/// What the handler needs to know about one byte-view tensor.
struct TensorInfo {
    desc: TensorDesc,
    is_cuda: bool,
    device_index: i64,
}

/// Reads a 2-D `torch.uint8` tensor `(num_blocks, row_bytes)` whose rows are contiguous, and checks
/// that its extent lies inside its untyped storage.
fn tensor_info(t: &Bound<'_, PyAny>, side: &str, i: usize) -> PyResult<TensorInfo> {
    let py = t.py();
    let torch = py.import("torch").map_err(|e| {
        PyTypeError::new_err(format!("the transfer handler needs torch tensors: {e}"))
    })?;
    let what = || format!("{side} tensor {i}");
    if !t.is_instance(&torch.getattr("Tensor")?)? {
        return Err(PyTypeError::new_err(format!(
            "{} must be a torch.Tensor, got {}",
            what(),
            type_name(t)
        )));
    }
    let dtype = t.getattr("dtype")?;
    if !dtype.eq(torch.getattr("uint8")?)? {
        return Err(PyValueError::new_err(format!(
            "{} must be a torch.uint8 byte view (num_blocks, page_bytes), got dtype {}; \
             use kvoff.canonicalize_kv_caches",
            what(),
            dtype.str()?
        )));
    }
    let shape: Vec<i64> = t.getattr("shape")?.extract()?;
    let strides: Vec<i64> = t.call_method0("stride")?.extract()?;
    if shape.len() != 2 {
        return Err(PyValueError::new_err(format!(
            "{} must be 2-D (num_blocks, page_bytes), got shape {shape:?}",
            what()
        )));
    }
    let (rows, cols) = (shape[0].unsigned_abs(), shape[1].unsigned_abs());
    if cols > 1 && strides[1] != 1 {
        return Err(PyValueError::new_err(format!(
            "{}: the bytes of a block must be contiguous (stride {:?}, shape {shape:?})",
            what(),
            strides
        )));
    }
    if strides[0] < 0 || strides[1] < 0 {
        return Err(PyValueError::new_err(format!(
            "{}: negative strides {strides:?} are not supported",
            what()
        )));
    }
    let row_stride = if rows > 1 {
        strides[0].unsigned_abs()
    } else {
        cols
    };
    let data_ptr: u64 = t.call_method0("data_ptr")?.extract()?;
    let storage = t.call_method0("untyped_storage")?;
    let storage_ptr: u64 = storage.call_method0("data_ptr")?.extract()?;
    let storage_bytes: u64 = storage.call_method0("nbytes")?.extract()?;
    let desc = TensorDesc::new(data_ptr, rows, row_stride, cols);
    if rows > 0 && cols > 0 {
        let inside = desc
            .extent_bytes()
            .and_then(|e| data_ptr.checked_add(e))
            .zip(storage_ptr.checked_add(storage_bytes))
            .is_some_and(|(end, send)| data_ptr >= storage_ptr && end <= send);
        if !inside {
            return Err(PyValueError::new_err(format!(
                "{}: shape {shape:?} with strides {strides:?} at {data_ptr:#x} does not lie \
                 inside its storage ({storage_bytes} bytes at {storage_ptr:#x})",
                what()
            )));
        }
    }
    let is_cuda: bool = t.getattr("is_cuda")?.extract()?;
    let device_index: i64 = t.call_method0("get_device")?.extract()?;
    Ok(TensorInfo {
        desc,
        is_cuda,
        device_index,
    })
}

/// Checks that no two tensors of one side share a byte. Exact for tensors with equal row strides
/// (interleaved column ranges, like the block-major host layout), conservative otherwise.
fn check_disjoint(descs: &[TensorDesc], side: &str) -> Result<(), KvoffError> {
    let range = |d: &TensorDesc| {
        let e = d.extent_bytes().unwrap_or(u64::MAX);
        (d.base_ptr, d.base_ptr.saturating_add(e))
    };
    for (a, da) in descs.iter().enumerate() {
        for (b, db) in descs.iter().enumerate().skip(a + 1) {
            if da.num_blocks == 0 || db.num_blocks == 0 {
                continue;
            }
            let (ra, rb) = (range(da), range(db));
            if ra.1 <= rb.0 || rb.1 <= ra.0 {
                continue;
            }
            let s = da.row_stride_bytes;
            let interleaved =
                s == db.row_stride_bytes && s > 0 && da.row_bytes <= s && db.row_bytes <= s && {
                    // Column intervals on a circle of circumference s.
                    let (ca, cb) = (da.base_ptr % s, db.base_ptr % s);
                    let d = (cb + s - ca) % s; // offset of b's column start after a's
                    d >= da.row_bytes && s - d >= db.row_bytes
                };
            if !interleaved {
                return Err(KvoffError::arg(format!(
                    "{side} tensors {a} and {b} overlap ({:#x}..{:#x} and {:#x}..{:#x}): every \
                     canonical KV-cache tensor must have its own bytes",
                    ra.0, ra.1, rb.0, rb.1
                )));
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Native transfer handler (SPEC §6)
// ---------------------------------------------------------------------------------------------

/// Engine names accepted by the handler.
const ENGINES: &str = "\"auto\", \"host\", \"cuda\", \"dma\", \"kernel\", \"staged\", \"loop\"";

fn cuda_unavailable(what: &str) -> PyErr {
    to_py(KvoffError::CudaUnavailable(format!(
        "engine {what:?} needs CUDA, but no CUDA driver or device is available; use engine=\"auto\" \
         or \"host\""
    )))
}

fn make_engine(
    engine: &str,
    direction: Direction,
    gpu: &[TensorInfo],
    cpu: &[TensorInfo],
    budget_bp: Option<u32>,
) -> PyResult<(Box<dyn TransferEngine>, String)> {
    let cuda_method = match engine {
        "host" => None,
        "auto" => {
            if gpu.iter().any(|t| t.is_cuda) {
                Some("auto")
            } else {
                None
            }
        }
        "cuda" | "dma" | "kernel" | "staged" | "loop" => Some(engine),
        _ => {
            return Err(PyValueError::new_err(format!(
                "unknown engine {engine:?}; valid choices: {ENGINES}"
            )))
        }
    };
    if let Some(i) = cpu.iter().position(|t| t.is_cuda) {
        return Err(PyValueError::new_err(format!(
            "CPU-side tensor {i} is on cuda:{}; CPU-side tensors must be host memory",
            cpu[i].device_index
        )));
    }
    let Some(method) = cuda_method else {
        if let Some(i) = gpu.iter().position(|t| t.is_cuda) {
            return Err(PyValueError::new_err(format!(
                "engine \"host\" copies with memcpy, but GPU-side tensor {i} is on cuda:{}; use \
                 engine=\"auto\" or \"cuda\" for GPU tensors",
                gpu[i].device_index
            )));
        }
        let e = HostEngine::new().py()?;
        return Ok((Box::new(e), "host".to_owned()));
    };
    cuda_engine(engine, method, direction, gpu, cpu, budget_bp)
}

#[cfg(feature = "cuda")]
fn cuda_engine(
    engine: &str,
    method: &str,
    direction: Direction,
    gpu: &[TensorInfo],
    cpu: &[TensorInfo],
    budget_bp: Option<u32>,
) -> PyResult<(Box<dyn TransferEngine>, String)> {
    use crate::engine::cuda::{CopyMethod, CudaDevice, CudaEngine, CudaEngineConfig};
    if !crate::engine::cuda::cuda_available() {
        return Err(cuda_unavailable(engine));
    }
    if let Some(i) = gpu.iter().position(|t| !t.is_cuda) {
        return Err(PyValueError::new_err(format!(
            "engine {engine:?} moves bytes between GPU and host memory, but GPU-side tensor {i} \
             is a CPU tensor; use engine=\"host\" (or \"auto\") for CPU tensors"
        )));
    }
    let ordinal = gpu.first().map_or(0, |t| t.device_index);
    if let Some(i) = gpu.iter().position(|t| t.device_index != ordinal) {
        return Err(PyValueError::new_err(format!(
            "GPU-side tensors are on different devices (tensor 0 on cuda:{ordinal}, tensor {i} on \
             cuda:{}); one handler serves one device",
            gpu[i].device_index
        )));
    }
    let ordinal = i32::try_from(ordinal)
        .map_err(|_| PyValueError::new_err(format!("bad CUDA device index {ordinal}")))?;
    let dev = CudaDevice::open(ordinal).py()?;
    for (i, t) in gpu.iter().enumerate() {
        if t.desc.num_blocks > 0 && !dev.is_device_ptr(t.desc.base_ptr).py()? {
            return Err(PyValueError::new_err(format!(
                "GPU-side tensor {i} ({:#x}) is not device memory of cuda:{ordinal}",
                t.desc.base_ptr
            )));
        }
    }
    let mut host_mapped = true;
    for t in cpu.iter().filter(|t| t.desc.num_blocks > 0) {
        host_mapped &= dev.host_ptr_is_mapped(t.desc.base_ptr).py()?;
    }
    let method = CopyMethod::parse(method).py()?;
    if method == CopyMethod::Kernel && !host_mapped {
        return Err(PyValueError::new_err(
            "engine \"kernel\" needs pinned, device-mapped host memory (HostRegion.pin); the \
             CPU tensors are not pinned",
        ));
    }
    let cfg = CudaEngineConfig {
        method,
        host_mapped,
        compute_budget_bp: budget_bp,
        ..CudaEngineConfig::default()
    };
    let e = CudaEngine::new(dev, direction, cfg).py()?;
    Ok((Box::new(e), format!("cuda:{}", method.name())))
}

#[cfg(not(feature = "cuda"))]
fn cuda_engine(
    engine: &str,
    _method: &str,
    _direction: Direction,
    _gpu: &[TensorInfo],
    _cpu: &[TensorInfo],
    _budget_bp: Option<u32>,
) -> PyResult<(Box<dyn TransferEngine>, String)> {
    Err(cuda_unavailable(engine))
}

fn list_arg<'py>(o: &Bound<'py, PyAny>, what: &str) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if !(o.is_instance_of::<PyList>() || o.is_instance_of::<PyTuple>()) {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a list, got {}",
            type_name(o)
        )));
    }
    o.try_iter()?.collect()
}

fn result_tuple(py: Python<'_>, r: JobResult) -> PyResult<Bound<'_, PyTuple>> {
    (r.job_id, r.success, r.bytes, r.seconds, r.error).into_pyobject(py)
}

/// The engine and the handler's own record of unreported jobs.
struct EngineState {
    engine: Box<dyn TransferEngine>,
    /// Ids submitted and not yet returned by `get_finished`.
    unreported: HashSet<i64>,
    /// Results collected while shutting down, returned before anything else.
    stash: Vec<JobResult>,
}

impl EngineState {
    fn poll(&mut self) -> Vec<JobResult> {
        let mut out = std::mem::take(&mut self.stash);
        out.extend(self.engine.poll());
        for r in &out {
            self.unreported.remove(&r.job_id);
        }
        out
    }

    /// Waits for every unreported job, keeps their results, then stops the engine. The results
    /// are collected first because an engine may release in-flight bookkeeping when it stops.
    fn shutdown(&mut self) {
        let ids: Vec<i64> = self.unreported.iter().copied().collect();
        let _ = self.engine.wait(&ids);
        let mut done = self.engine.poll();
        self.engine.shutdown();
        done.extend(self.engine.poll());
        self.stash.extend(done);
    }
}

/// One direction's transfers over a fixed set of tensors: a [`CopyPlanner`] and an engine.
#[pyclass(name = "TransferHandler", module = "kvoff._native", frozen)]
pub struct PyTransferHandler {
    direction: Direction,
    planner: CopyPlanner,
    engine: Mutex<EngineState>,
    engine_name: String,
    /// The tensors the planner's descriptors were taken from; released only after the engine has
    /// been shut down (see `Drop`).
    keepalive: Vec<Py<PyAny>>,
}

impl PyTransferHandler {
    fn lock(&self) -> MutexGuard<'_, EngineState> {
        // Engine calls run under `guard`; a panic there leaves the engine's own state consistent
        // (its contract reports failures as results), so recover the guard.
        self.engine.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for PyTransferHandler {
    fn drop(&mut self) {
        // Drain before `keepalive` releases the tensors the in-flight jobs point into.
        let e = self
            .engine
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| e.shutdown()));
    }
}

#[pymethods]
impl PyTransferHandler {
    /// `TransferHandler(direction, gpu_tensors, cpu_tensors, group_refs, block_size_factor,
    /// engine="auto")`: `direction` is `"gpu_to_cpu"` or `"cpu_to_gpu"`; the tensors are 2-D
    /// `torch.uint8` views `(num_blocks, page)` / `(num_cpu_blocks, page × factor)`; `group_refs[g]`
    /// lists `(tensor_idx, page_size_bytes)` of group `g`; `compute_budget` (a fraction, e.g.
    /// 0.02, or `None` for the idle-GPU policy) is the model slowdown a CUDA engine's `auto` may cost.
    #[new]
    #[pyo3(signature = (direction, gpu_tensors, cpu_tensors, group_refs, block_size_factor, engine="auto", compute_budget=None))]
    fn new(
        direction: &str,
        gpu_tensors: &Bound<'_, PyAny>,
        cpu_tensors: &Bound<'_, PyAny>,
        group_refs: &Bound<'_, PyAny>,
        block_size_factor: &Bound<'_, PyAny>,
        engine: &str,
        compute_budget: Option<f64>,
    ) -> PyResult<Self> {
        let budget_bp = match compute_budget {
            None => None,
            Some(b) if b.is_finite() && (0.0..=1.0).contains(&b) => {
                // In 0..=1, so the product fits a u32.
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                Some((b * 10_000.0).round() as u32)
            }
            Some(b) => {
                return Err(PyValueError::new_err(format!(
                    "compute_budget must be a fraction in [0, 1] or None, got {b}"
                )))
            }
        };
        let direction = match direction {
            "gpu_to_cpu" => Direction::GpuToCpu,
            "cpu_to_gpu" => Direction::CpuToGpu,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "direction must be \"gpu_to_cpu\" or \"cpu_to_gpu\", got {direction:?}"
                )))
            }
        };
        let gpu_objs = list_arg(gpu_tensors, "gpu_tensors")?;
        let cpu_objs = list_arg(cpu_tensors, "cpu_tensors")?;
        let gpu: Vec<TensorInfo> = gpu_objs
            .iter()
            .enumerate()
            .map(|(i, t)| tensor_info(t, "GPU-side", i))
            .collect::<PyResult<_>>()?;
        let cpu: Vec<TensorInfo> = cpu_objs
            .iter()
            .enumerate()
            .map(|(i, t)| tensor_info(t, "CPU-side", i))
            .collect::<PyResult<_>>()?;
        let mut groups: Vec<Vec<PlanRef>> = Vec::new();
        for (g, refs) in list_arg(group_refs, "group_refs")?.iter().enumerate() {
            let mut v = Vec::new();
            for (k, r) in list_arg(refs, &format!("group_refs[{g}]"))?
                .iter()
                .enumerate()
            {
                let (t, p): (Bound<'_, PyAny>, Bound<'_, PyAny>) = r.extract().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "group_refs[{g}][{k}] must be a (tensor_idx, page_size_bytes) pair, got {}",
                        type_name(r)
                    ))
                })?;
                v.push(PlanRef::new(
                    usize_arg(&t, "tensor_idx")?,
                    u64_arg(&p, "page_size_bytes")?,
                ));
            }
            groups.push(v);
        }
        let f = u64_arg(block_size_factor, "block_size_factor")?;
        let gpu_descs: Vec<TensorDesc> = gpu.iter().map(|t| t.desc).collect();
        let cpu_descs: Vec<TensorDesc> = cpu.iter().map(|t| t.desc).collect();
        guard(|| {
            check_disjoint(&gpu_descs, "GPU-side").py()?;
            check_disjoint(&cpu_descs, "CPU-side").py()?;
            let planner = CopyPlanner::new(gpu_descs, cpu_descs, groups, f).py()?;
            let (engine, engine_name) = make_engine(engine, direction, &gpu, &cpu, budget_bp)?;
            let keepalive = gpu_objs
                .iter()
                .chain(cpu_objs.iter())
                .map(|o| o.clone().unbind())
                .collect();
            Ok(Self {
                direction,
                planner,
                engine: Mutex::new(EngineState {
                    engine,
                    unreported: HashSet::new(),
                    stash: Vec::new(),
                }),
                engine_name,
                keepalive,
            })
        })
    }

    /// Validates and enqueues one job; returns at once. Nothing is enqueued when it raises.
    #[pyo3(signature = (job_id, gpu_block_ids, group_sizes, block_indices, cpu_block_ids, stream=None))]
    fn submit(
        &self,
        job_id: &Bound<'_, PyAny>,
        gpu_block_ids: &Bound<'_, PyAny>,
        group_sizes: Option<&Bound<'_, PyAny>>,
        block_indices: Option<&Bound<'_, PyAny>>,
        cpu_block_ids: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let jid = int_arg(job_id, "job_id")?;
        let jid = i64::try_from(jid)
            .map_err(|_| PyValueError::new_err(format!("job_id {jid} does not fit in int64")))?;
        let gids = ids_arg(gpu_block_ids, "block_ids of the GPU spec")?;
        let cids = ids_arg(cpu_block_ids, "block_ids of the CPU spec")?;
        let sizes = match group_sizes {
            Some(o) if !o.is_none() => Some(ids_arg(o, "group_sizes")?),
            _ => None,
        };
        let indices = match block_indices {
            Some(o) if !o.is_none() => Some(ids_arg(o, "block_indices")?),
            _ => None,
        };
        let stream = match stream {
            Some(o) if !o.is_none() => Some(u64_arg(o, "stream")?),
            _ => None,
        };
        let spec = GpuSpec {
            block_ids: gids.as_slice(),
            group_sizes: sizes.as_ref().map(Ids::as_slice),
            block_indices: indices.as_ref().map(Ids::as_slice),
        };
        let plan = guard(|| {
            self.planner
                .plan(self.direction, &spec, cids.as_slice())
                .py()
        })?;
        let job = Job {
            job_id: jid,
            plan,
            stream,
        };
        // The GIL is released while the engine submits: its driver calls can take milliseconds
        // (long batches) and must not stall the caller's other threads (a model's launches).
        job_id.py().detach(|| {
            guard(|| {
                let mut st = self.lock();
                // SAFETY: obligation 1 — every copy was validated by the planner against
                // descriptors taken from torch tensors whose extents lie inside their storages, and
                // `keepalive` holds those tensors until the engine is shut down
                // (`shutdown`/`Drop` drain first); obligation 2 — GPU-side and CPU-side tensors
                // were each checked disjoint (`check_disjoint`) and the planner rejects duplicate
                // destinations and GPU/CPU overlap; concurrent use of the same blocks by the caller
                // is excluded by the offloading protocol (a block being stored or loaded is not
                // read/written by anyone else).
                unsafe { st.engine.submit(job) }.py()?;
                st.unreported.insert(jid);
                Ok(())
            })
        })
    }

    /// Finished jobs not returned before, in submission order, as
    /// `(job_id, success, bytes, seconds, error)`. Never blocks: while another thread is in `wait`,
    /// returns what is available later.
    fn get_finished<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let results = match self.engine.try_lock() {
            Ok(mut e) => guard(|| Ok(e.poll()))?,
            Err(TryLockError::Poisoned(p)) => guard(|| Ok(p.into_inner().poll()))?,
            Err(TryLockError::WouldBlock) => Vec::new(),
        };
        let out = PyList::empty(py);
        for r in results {
            out.append(result_tuple(py, r)?)?;
        }
        Ok(out)
    }

    /// Blocks until the jobs `job_ids` finished (unknown ids are ignored), releasing the GIL.
    fn wait(&self, py: Python<'_>, job_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids: Vec<i64> = match ids_arg(job_ids, "job_ids") {
            Ok(ids) => ids.as_slice().to_vec(),
            Err(_) if job_ids.is_instance_of::<PyInt>() => vec![job_ids.extract()?],
            Err(e) => return Err(e),
        };
        py.detach(|| guard(|| self.lock().engine.wait(&ids).py()))
    }

    /// Drains in-flight work and stops the engine; idempotent. Results stay available.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            guard(|| {
                self.lock().shutdown();
                Ok(())
            })
        })
    }

    /// `"gpu_to_cpu"` or `"cpu_to_gpu"`.
    #[getter]
    fn direction(&self) -> &'static str {
        match self.direction {
            Direction::GpuToCpu => "gpu_to_cpu",
            Direction::CpuToGpu => "cpu_to_gpu",
        }
    }

    /// `("GPU", "CPU")` or `("CPU", "GPU")`.
    #[getter]
    fn transfer_type(&self) -> (&'static str, &'static str) {
        self.direction.transfer_type()
    }

    /// The engine in use: `"host"` or `"cuda:<method>"`.
    #[getter]
    fn engine(&self) -> String {
        self.engine_name.clone()
    }

    /// Number of tensors kept alive by the handler (GPU side + CPU side).
    #[getter]
    fn num_tensors(&self) -> usize {
        self.keepalive.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "TransferHandler(direction={:?}, engine={:?}, groups={}, block_size_factor={})",
            self.direction(),
            self.engine_name,
            self.planner.num_groups(),
            self.planner.block_size_factor()
        )
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_sizing, m)?)?;
    m.add_function(wrap_pyfunction!(expand_block_ids, m)?)?;
    m.add_function(wrap_pyfunction!(compute_sub_block_ptrs, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_class::<PyHostRegion>()?;
    m.add_class::<PyRegionBuffer>()?;
    m.add_class::<PyTransferHandler>()?;
    Ok(())
}
