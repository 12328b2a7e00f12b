//! The native transfer handler (docs/spec.md §6) that `kvoff.handlers` builds its public classes on: torch
//! tensors → checked descriptors, the engine choice, and one direction's jobs.
//!
//! Memory safety at the Python boundary. The engine's `submit` (unsafe) is sound because a
//! [`PyTransferHandler`]:
//! 1. is built from **torch tensors**, not raw pointers: every descriptor is derived from a tensor's
//!    `data_ptr`/shape/strides and checked to lie inside that tensor's untyped storage;
//! 2. keeps every one of those tensors alive (a strong reference) until its engine has been shut
//!    down (drained), which happens in `shutdown()` or, at the latest, in `Drop` before the
//!    references are released;
//! 3. checks that the GPU-side tensors are mutually disjoint, and so are the CPU-side tensors (byte
//!    exact for equal-stride interleaved views such as the block-major host layout), so that the
//!    planner's plans satisfy the engine's no-overlap obligation;
//! 4. checks every job with a [`CopyPlanner`] before queuing it, and has the same planner build
//!    the checked job's copies on the submit thread ([`super::submitter`]); every copy lies inside
//!    those extents.
//!
//! The engine's `submit` itself runs on the submit thread ([`super::submitter`]); `shutdown` and
//! `Drop` hand every queued job over before draining.
//!
//! A storage that shrinks after the handler was built (`untyped_storage().resize_(0)`) is caught
//! by `kvoff.handlers` before each submit (it re-reads the storages' extents); this class keeps the
//! tensors, not their sizes.
//!
//! Which engine serves is decided in one place, [`EngineKind::resolve`], reached from Python both
//! through this class and through `resolve_engine` (which `kvoff.handlers` calls before it
//! allocates host memory), so both give the same answer and the same errors.
// Unsafe: recording the caller's stream position (`StreamMarks::mark`).
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex, PoisonError, TryLockError};
use std::thread::JoinHandle;

use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList, PyTuple};

use super::args::{ids_arg, int_arg, list_arg, u64_arg, usize_arg};
use super::enter::{blocking, locked, try_locked, Hold};
use super::errors::IntoPyResult;
use super::keys::type_name;
use super::submitter::{self, EngineState, Pending, Shared};
use crate::engine::{
    budget_bp, cuda_usable, open, EngineKind, EngineOptions, EngineTensor, JobResult, StreamMarks,
};
use crate::plan::{CopyPlanner, Direction, PlanRef, TensorDesc};

/// What the handler needs to know about one byte-view tensor.
struct TensorInfo {
    desc: TensorDesc,
    is_cuda: bool,
    device_index: i64,
}

/// Reads a 2-D `torch.uint8` tensor `(num_blocks, row_bytes)` whose rows are contiguous, and checks
/// that its extent lies inside its untyped storage.
fn tensor_info(t: &Bound<'_, PyAny>, side: &str, i: usize) -> PyResult<TensorInfo> {
    if let Ok(a) = t.cast::<PyUntypedArray>() {
        return array_info(a, side, i);
    }
    let py = t.py();
    let torch = py.import("torch").map_err(|e| {
        PyTypeError::new_err(format!(
            "the transfer handler needs torch tensors (or numpy arrays in host memory): {e}"
        ))
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

/// Reads a 2-D `uint8` numpy array `(num_blocks, row_bytes)` whose rows are contiguous: host memory
/// (for the host engine, e.g. benchmarks on a machine without torch). numpy guarantees that the
/// memory its shape and strides describe belongs to the array (kept alive by the handler), and it
/// refuses to resize an array that other objects reference.
fn array_info(a: &Bound<'_, PyUntypedArray>, side: &str, i: usize) -> PyResult<TensorInfo> {
    let what = || format!("{side} array {i}");
    if a.dtype().kind() != b'u' || a.dtype().itemsize() != 1 || a.ndim() != 2 {
        return Err(PyValueError::new_err(format!(
            "{} must be a 2-D uint8 numpy array (num_blocks, page_bytes), got dtype {} and shape {:?}",
            what(),
            a.dtype(),
            a.shape()
        )));
    }
    let (rows, cols) = (a.shape()[0] as u64, a.shape()[1] as u64);
    let strides: Vec<isize> = a.strides().to_vec();
    if strides.iter().any(|&s| s < 0) || (cols > 1 && strides[1] != 1) {
        return Err(PyValueError::new_err(format!(
            "{}: the bytes of a block must be contiguous with non-negative strides (strides {strides:?})",
            what()
        )));
    }
    let row_stride = if rows > 1 {
        strides[0].unsigned_abs() as u64
    } else {
        cols
    };
    let iface = a.getattr("__array_interface__")?;
    let (ptr, readonly): (u64, bool) = iface.get_item("data")?.extract()?;
    if readonly {
        // Either side is written by one of the two directions.
        return Err(PyValueError::new_err(format!(
            "{} is read-only; the transfer handler writes both sides",
            what()
        )));
    }
    Ok(TensorInfo {
        desc: TensorDesc::new(ptr, rows, row_stride, cols),
        is_cuda: false,
        device_index: -1,
    })
}

// ---------------------------------------------------------------------------------------------
// Native transfer handler (docs/spec.md §6)
// ---------------------------------------------------------------------------------------------

/// `resolve_engine(engine, placements, names=None) -> "host" | "cuda"`: the engine that
/// `TransferHandler(..., engine)` will use for GPU-side tensors placed as `placements` (per tensor:
/// its CUDA device index, `None` for host memory), with the same errors; `names[i]` describes
/// tensor `i` in messages. `kvoff.handlers` asks before it allocates (and pins) host memory.
#[pyfunction]
#[pyo3(signature = (engine, placements, names=None))]
fn resolve_engine(
    py: Python<'_>,
    engine: &str,
    placements: Vec<Option<i64>>,
    names: Option<Vec<String>>,
) -> PyResult<&'static str> {
    let kind = EngineKind::parse(engine).py()?;
    let names = names.unwrap_or_default();
    let cuda = blocking(py, move || kind.resolve(&placements, &names, cuda_usable()))?;
    Ok(if cuda { "cuda" } else { "host" })
}

fn result_tuple(py: Python<'_>, r: JobResult) -> PyResult<Bound<'_, PyTuple>> {
    (r.job_id, r.success, r.bytes, r.seconds, r.error).into_pyobject(py)
}

/// One direction's transfers over a fixed set of tensors: a [`CopyPlanner`] and an engine.
#[pyclass(name = "TransferHandler", module = "kvoff._native", frozen)]
pub struct PyTransferHandler {
    direction: Direction,
    /// The planner, the engine and the queue of checked jobs, shared with the submit thread.
    shared: Arc<Shared>,
    /// The submit thread (`None` once joined).
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Records the caller's stream position at each submit (CUDA engines).
    marks: Option<Arc<dyn StreamMarks>>,
    /// The process that made the handler: a `fork()`ed child has no submit thread.
    pid: u32,
    engine_name: String,
    /// The tensors the planner's descriptors were taken from; released only after the engine has
    /// been shut down (see `Drop`).
    keepalive: Vec<Py<PyAny>>,
}

impl PyTransferHandler {
    /// Runs `f` on the engine under its lock with the GIL released ([`locked`]). A panic leaves
    /// the engine's own state consistent (its contract reports failures as results), so nothing
    /// is put out of service.
    fn with_engine<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut EngineState) -> crate::Result<R> + Send,
    ) -> PyResult<R> {
        locked(py, &self.shared.engine, Hold::Long, |_| {}, f)
    }

    /// Waits (the GIL released) until every job accepted so far was handed to the engine.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let target = locked(
            py,
            &self.shared.queue,
            Hold::Brief,
            |_| {},
            |q| Ok(q.asked()),
        )?;
        blocking(py, || {
            self.shared.flush(target);
            Ok(())
        })
    }

    /// The submit thread, taken for joining (the first caller gets it).
    fn take_thread(&self) -> Option<JoinHandle<()>> {
        self.thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Refuses calls in a `fork()`ed child: the engine, its threads and streams are the parent's
    /// (`kvoff.handlers` says so first, with the processes' ids).
    fn check_process(&self) -> PyResult<()> {
        if crate::process::id() == self.pid {
            Ok(())
        } else {
            Err(crate::KvoffError::state(
                "this transfer handler belongs to the process that made it, not to a fork()ed child",
            ))
            .py()
        }
    }
}

/// The results the submit thread collected, then `more`, their ids forgotten: the queue's lock
/// taken without waiting while the GIL is held (waited for with it released otherwise).
fn report(py: Python<'_>, shared: &Shared, more: Vec<JobResult>) -> Vec<JobResult> {
    match shared.queue.try_lock() {
        Ok(mut q) => q.report(more),
        Err(TryLockError::Poisoned(p)) => p.into_inner().report(more),
        Err(TryLockError::WouldBlock) => py.detach(|| shared.lock_queue().report(more)),
    }
}

impl Drop for PyTransferHandler {
    fn drop(&mut self) {
        if crate::process::id() != self.pid {
            // A `fork()`ed child: the engine, its threads and streams are the parent's, and its
            // locks may be held by threads that do not exist here. Nothing of it is touched (the
            // shared state is leaked, so the engine is not dropped either).
            std::mem::forget(Arc::clone(&self.shared));
            std::mem::forget(
                self.thread
                    .get_mut()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take(),
            );
            return;
        }
        // Hand over and drain before `keepalive` releases the tensors the jobs point into.
        let thread = self.take_thread();
        let shared = &self.shared;
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| shared.shutdown(thread)));
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
    #[allow(clippy::too_many_arguments)] // the Python signature
    fn new(
        py: Python<'_>,
        direction: &str,
        gpu_tensors: &Bound<'_, PyAny>,
        cpu_tensors: &Bound<'_, PyAny>,
        group_refs: &Bound<'_, PyAny>,
        block_size_factor: &Bound<'_, PyAny>,
        engine: &str,
        compute_budget: Option<f64>,
    ) -> PyResult<Self> {
        let kind = EngineKind::parse(engine).py()?;
        let budget_bp = compute_budget.map(budget_bp).transpose().py()?;
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
        let (planner, engine, engine_name) = blocking(py, move || {
            crate::handlers::check_disjoint(&gpu_descs, "GPU-side")?;
            crate::handlers::check_disjoint(&cpu_descs, "CPU-side")?;
            let planner = CopyPlanner::new(gpu_descs, cpu_descs, groups, f)?;
            let side = |v: &[TensorInfo]| -> Vec<EngineTensor> {
                v.iter()
                    .map(|t| EngineTensor {
                        desc: t.desc,
                        cuda_device: t.is_cuda.then_some(t.device_index),
                    })
                    .collect()
            };
            // The caller applies the environment's overrides (`KVOFF_CUDA_TUNE`).
            let options = EngineOptions::from_env(budget_bp);
            let (engine, name) = open(kind, direction, &side(&gpu), &side(&cpu), &options)?;
            Ok((planner, engine, name))
        })?;
        let keepalive = gpu_objs
            .iter()
            .chain(cpu_objs.iter())
            .map(|o| o.clone().unbind())
            .collect();
        let marks = engine.stream_marks();
        let shared = Arc::new(Shared::new(direction, planner, EngineState::new(engine)));
        let thread = match submitter::start(&shared) {
            Ok(t) => t,
            Err(e) => {
                blocking(py, || {
                    shared.shutdown(None);
                    Ok(())
                })?;
                return Err(e).py();
            }
        };
        Ok(Self {
            direction,
            shared,
            thread: Mutex::new(Some(thread)),
            marks,
            pid: crate::process::id(),
            engine_name,
            keepalive,
        })
    }

    /// Checks and queues one job for the handler's submit thread (which plans it and hands it to
    /// the engine); returns at once. Nothing is queued when it raises; a failure after queuing is
    /// the job's failed result. Raises `InvalidStateError` in a fork()ed child.
    #[pyo3(signature = (job_id, gpu_block_ids, group_sizes, block_indices, cpu_block_ids, stream=None))]
    #[allow(clippy::too_many_arguments)] // the Python signature
    fn submit(
        &self,
        py: Python<'_>,
        job_id: &Bound<'_, PyAny>,
        gpu_block_ids: &Bound<'_, PyAny>,
        group_sizes: Option<&Bound<'_, PyAny>>,
        block_indices: Option<&Bound<'_, PyAny>>,
        cpu_block_ids: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.check_process()?;
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
        // Checked here (O(blocks), the GIL kept: nothing waits), planned and handed to the engine
        // by the submit thread (O(pages): `submitter`'s docs), from owned copies of the ids (a
        // borrowed numpy view must not be read without the GIL).
        let spec = self
            .shared
            .planner
            .check(
                self.direction,
                gids.as_slice().to_vec(),
                sizes.as_ref().map(|v| v.as_slice().to_vec()),
                indices.as_ref().map(|v| v.as_slice().to_vec()),
                cids.as_slice().to_vec(),
            )
            .py()?;
        // The job follows the work queued on the caller's stream now, not when the thread
        // submits it: the point is recorded here (one driver call, the GIL released).
        let after = match (stream, &self.marks) {
            (Some(st), Some(m)) => Some(blocking(py, || {
                // SAFETY: the caller passes a live stream of this device (the torch shim passes
                // the current stream), as for `Job::stream`.
                unsafe { m.mark(st) }
            })?),
            _ => None,
        };
        let pending = Pending {
            job_id: jid,
            spec,
            stream,
            after,
        };
        locked(
            py,
            &self.shared.queue,
            Hold::Brief,
            |_| {},
            move |q| q.push(pending),
        )?;
        self.shared.notify();
        Ok(())
    }

    /// Finished jobs not returned before, in submission order, as
    /// `(job_id, success, bytes, seconds, error)`. Never blocks: while another thread is in `wait`,
    /// returns what is available later.
    fn get_finished<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.check_process()?;
        let shared = &*self.shared;
        // The engine's results are taken together with those the submit thread collected, under
        // the engine's lock, which keeps them in order (`Queue::ready`); while the lock is busy,
        // the collected ones alone.
        let polled = try_locked(&shared.engine, |e| {
            let more = e.poll();
            Ok(report(py, shared, more))
        })?;
        let results = match polled {
            Some(r) => r,
            None => report(py, shared, Vec::new()),
        };
        let out = PyList::empty(py);
        for r in results {
            out.append(result_tuple(py, r)?)?;
        }
        Ok(out)
    }

    /// Blocks until the jobs `job_ids` finished (unknown ids are ignored), releasing the GIL;
    /// queued jobs are handed to the engine first.
    fn wait(&self, py: Python<'_>, job_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids: Vec<i64> = match ids_arg(job_ids, "job_ids") {
            Ok(ids) => ids.as_slice().to_vec(),
            Err(_) if job_ids.is_instance_of::<PyInt>() => vec![job_ids.extract()?],
            Err(e) => return Err(e),
        };
        self.check_process()?;
        // Jobs still queued for the submit thread are handed over first. The engine stays locked
        // while it waits: `get_finished` from another thread returns nothing meanwhile.
        self.flush(py)?;
        self.with_engine(py, move |st| st.engine.wait(&ids))
    }

    /// `set_compute_streams(streams)`: raw CUDA stream handles (ints; 0 = the legacy default
    /// stream) on which the model computes, watched by the CUDA engine's serving policy at each
    /// submit besides the job's own ordering stream (ignored by the host engine). The caller keeps
    /// the streams alive while the handler lives (`kvoff.handlers` holds the torch streams); as
    /// with `submit`'s stream, a handle that is not a live stream of the device is undefined
    /// behaviour.
    fn set_compute_streams(&self, py: Python<'_>, streams: &Bound<'_, PyAny>) -> PyResult<()> {
        let handles: Vec<u64> = list_arg(streams, "streams")?
            .iter()
            .map(|o| u64_arg(o, "stream"))
            .collect::<PyResult<_>>()?;
        self.check_process()?;
        self.with_engine(py, move |st| {
            // SAFETY: the caller's obligation (documented above): live streams of the engine's
            // device, kept alive by the Python wrapper for the handler's life.
            unsafe { st.engine.set_compute_streams(&handles) };
            Ok(())
        })
    }

    /// Hands queued jobs over, drains in-flight work and stops the engine; idempotent. Results
    /// stay available. Does nothing in a fork()ed child.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        if crate::process::id() != self.pid {
            return Ok(()); // a fork()ed child: the parent's engine, nothing to do here
        }
        let thread = self.take_thread();
        blocking(py, || {
            self.shared.shutdown(thread);
            Ok(())
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

    /// What the most recent `submit` did (once queued jobs were handed to the engine), as a dict:
    /// `method` (the copy method, or None before the first), `sms` (SMs its copy kernels can occupy at once; 0 = copy engines only), `policy`
    /// (`"serving"` or `"idle"`: which policy of the CUDA engine's `auto` chose; None otherwise),
    /// `submit_ns` (CPU time of the submit), `longest_call_ns` / `longest_call_cpu_ns` (its
    /// longest single driver call, wall-clock / thread CPU time), `driver_calls`, `longest_call`
    /// (the driver entry point of the most CPU-hungry call, or None), `paced_ns` (time waited
    /// outside the driver for the device to drain the stream's queue), `fed` (a long DMA job
    /// handed to the engine's feeder thread, which enqueues it paced while the submit returns),
    /// `reason` (which rule of the CUDA engine chose the method, e.g. `"serving: pitched runs"`;
    /// None for the host engine), `staged_cap_mb_s` (the rate cap the job's staged pipeline was
    /// paced at, shared by the device's engines while the model computes; 0 when not paced),
    /// `polite` (the device's copy calls were short and spaced because the model was seen
    /// launching beside them), `driver_contention` (shares of 1024 of the device's recent copy
    /// calls that waited for another thread's driver call: by wall time, by time off the CPU;
    /// and the share of those calls' time spent off the CPU), `driver_blocked` (the device's
    /// sampled copy calls since it was opened, and a list of the blocked ones by time off the
    /// CPU: 3–6, 6–12, …, 192–384 µs and longer).
    #[getter]
    fn last_submit_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.check_process()?;
        self.flush(py)?;
        let s = self.with_engine(py, |st| Ok(st.engine.last_submit_stats()))?;
        let d = PyDict::new(py);
        d.set_item("method", s.method)?;
        d.set_item("sms", s.sms)?;
        d.set_item("policy", s.policy)?;
        d.set_item("submit_ns", s.submit_ns)?;
        d.set_item("longest_call_ns", s.longest_call_ns)?;
        d.set_item("longest_call_cpu_ns", s.longest_call_cpu_ns)?;
        d.set_item("driver_calls", s.driver_calls)?;
        d.set_item("longest_call", s.longest_call)?;
        d.set_item("paced_ns", s.paced_ns)?;
        d.set_item("fed", s.fed)?;
        d.set_item("reason", s.reason)?;
        d.set_item("staged_cap_mb_s", s.staged_cap_mb_s)?;
        d.set_item("polite", s.polite)?;
        d.set_item("driver_contention", s.driver_contention)?;
        d.set_item(
            "driver_blocked",
            (s.driver_blocked.0, s.driver_blocked.1.to_vec()),
        )?;
        Ok(d)
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
            self.shared.planner.num_groups(),
            self.shared.planner.block_size_factor()
        )
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add(
        "DEFAULT_COMPUTE_BUDGET",
        f64::from(crate::engine::DEFAULT_COMPUTE_BUDGET_BP) / 10_000.0,
    )?;
    m.add(
        "ENGINES",
        PyTuple::new(m.py(), EngineKind::ALL.map(EngineKind::name))?,
    )?;
    m.add_function(wrap_pyfunction!(resolve_engine, m)?)?;
    m.add_class::<PyTransferHandler>()?;
    Ok(())
}
