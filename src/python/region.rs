//! `HostRegion` (docs/spec.md §5): private (anonymous) or shared by name in `/dev/shm`, and the exporter of
//! its zero-copy views.
//!
//! Views reach numpy/torch through a small exporter object (`__array_interface__`) that holds an
//! `Arc` of the region, so the mapping outlives every view: `HostRegion.close()` releases the
//! region's own hold and unmaps at once when no view is alive, otherwise when the last view is
//! garbage-collected. Every call that takes the region's lock or may wait (creation, joining,
//! pinning, unmapping) goes through [`super::enter`].
#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::{opt_u64_arg, u64_arg, Seconds};
use super::enter::{blocking, locked, Hold};
use super::errors::to_py;
use crate::error::KvoffError;
use crate::region::{HostRegion, RegionOptions};

pub(crate) type SharedRegion = Arc<Mutex<HostRegion>>;

/// Runs `f` on the region under its lock (see [`super::enter::locked`]).
fn with_region<R: Send>(
    py: Python<'_>,
    r: &SharedRegion,
    hold: Hold,
    f: impl FnOnce(&mut HostRegion) -> crate::Result<R> + Send,
) -> PyResult<R> {
    // A panic leaves nothing half-done that later calls could trip on: region methods validate
    // before they change anything.
    locked(py, r, hold, |_| {}, f)
}

/// Checked [`RegionOptions`] from the Python arguments of `shared`/`attach`.
fn region_options(
    timeout: Seconds,
    directory: Option<std::path::PathBuf>,
    unlink_when_all_joined: bool,
    prefault: bool,
) -> PyResult<RegionOptions> {
    let Seconds(timeout) = timeout;
    if directory.as_ref().is_some_and(|d| d.as_os_str().is_empty()) {
        return Err(PyValueError::new_err(
            "directory must name a directory (None: /dev/shm), got ''",
        ));
    }
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
    Ok(opts)
}

/// A host memory region (docs/spec.md §5): private (anonymous) or shared by name in `/dev/shm`.
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

    /// The region (an `Arc` that keeps it mapped), for other bindings that copy into it.
    ///
    /// # Errors
    /// `InvalidStateError` once the region is closed.
    pub(crate) fn shared_region(&self) -> PyResult<SharedRegion> {
        self.region()
    }

    fn region(&self) -> PyResult<SharedRegion> {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| to_py(KvoffError::state("the host region is closed")))
    }

    fn view_exporter(
        &self,
        py: Python<'_>,
        rank: u64,
        offset: u64,
        nbytes: u64,
    ) -> PyResult<PyRegionBuffer> {
        let region = self.region()?;
        let v = with_region(py, &region, Hold::Brief, |r| r.view(rank, offset, nbytes))?;
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
        let r = blocking(py, || HostRegion::private(n, s, w))?;
        Ok(Self::wrap(r))
    }

    /// Creates or joins the shared region `name` (a file in `directory`, default `/dev/shm`) as
    /// `rank`, waiting up to `timeout` seconds for its creator. Releases the GIL while waiting.
    #[staticmethod]
    #[pyo3(signature = (name, num_cpu_blocks, slot_bytes, world_size, rank, timeout=Seconds(60.0), directory=None, unlink_when_all_joined=true, prefault=true))]
    #[pyo3(
        text_signature = "(name, num_cpu_blocks, slot_bytes, world_size, rank, timeout=60.0, directory=None, unlink_when_all_joined=True, prefault=True)"
    )]
    #[allow(clippy::too_many_arguments, clippy::needless_pass_by_value)] // the Python signature
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
        let opts = region_options(timeout, directory, unlink_when_all_joined, prefault)?;
        let n = u64_arg(num_cpu_blocks, "num_cpu_blocks")?;
        let s = u64_arg(slot_bytes, "slot_bytes")?;
        let w = u64_arg(world_size, "world_size")?;
        let r = u64_arg(rank, "rank")?;
        let name = name.to_owned();
        let region = blocking(py, || {
            HostRegion::create_or_join_with(&name, n, s, w, r, &opts)
        })?;
        Ok(Self::wrap(region))
    }

    /// Attaches to the shared region `name` that an engine's ranks created, as an observer (no
    /// rank; the geometry is read from the region), waiting up to `timeout` seconds for it: how the
    /// scheduler's process reaches the host rows to move blocks to and from a tier behind them.
    /// The ranks must create it with `unlink_when_all_joined=False`; `unlink()` it once attached.
    #[staticmethod]
    #[pyo3(signature = (name, timeout=Seconds(60.0), directory=None))]
    #[pyo3(text_signature = "(name, timeout=60.0, directory=None)")]
    #[allow(clippy::needless_pass_by_value)] // the Python signature
    fn attach(
        py: Python<'_>,
        name: &str,
        timeout: Seconds,
        directory: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let opts = region_options(timeout, directory, true, false)?;
        let name = name.to_owned();
        let region = blocking(py, move || HostRegion::attach(&name, &opts))?;
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
    fn ptr(&self, py: Python<'_>) -> PyResult<u64> {
        with_region(py, &self.region()?, Hold::Brief, |r| Ok(r.as_ptr()))
    }
    /// Whether the region is registered (page-locked) with CUDA.
    #[getter]
    fn is_pinned(&self, py: Python<'_>) -> bool {
        self.region()
            .and_then(|r| with_region(py, &r, Hold::Brief, |r| Ok(r.is_pinned())))
            .unwrap_or(false)
    }
    /// Why the last `pin` failed, if it did.
    #[getter]
    fn pin_error(&self, py: Python<'_>) -> Option<String> {
        self.region()
            .and_then(|r| {
                with_region(py, &r, Hold::Brief, |r| {
                    Ok(r.pin_error().map(str::to_owned))
                })
            })
            .ok()
            .flatten()
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
            py,
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
            let dev = blocking(py, || crate::engine::cuda::CudaDevice::open(device))?;
            with_region(py, &region, Hold::Long, |r| r.pin(dev.registrar()))
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
        with_region(py, &region, Hold::Long, HostRegion::unpin)
    }

    /// Removes the region's file name (shared regions); the mapping stays. Returns whether a name
    /// was removed.
    fn unlink(&self, py: Python<'_>) -> PyResult<bool> {
        let region = self.region()?;
        with_region(py, &region, Hold::Brief, HostRegion::unlink)
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
                blocking(py, move || r.close())
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

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyHostRegion>()?;
    m.add_class::<PyRegionBuffer>()?;
    Ok(())
}
