//! Free functions of `kvoff._native`: host sizing (docs/spec.md §3), block-id and sub-block pointer
//! expansion (docs/spec.md §4), CUDA detection and the CPUs of kvoff's threads (`crate::affinity`). Pure computations on converted arguments; no lock.
#![forbid(unsafe_code)]

use numpy::PyArray1;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt};

use super::args::{ids_arg, opt_u64_arg, opt_usize_arg, ptrs_to_i64, u64_arg, usize_arg};
use super::enter::quick;
use super::errors::to_py;
use super::keys::type_name;
use crate::error::KvoffError;

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
    let s = quick(|| crate::sizing::cpu_sizing(&pages, f, w, budget))?;
    Ok((s.slot_bytes, s.row_stride_bytes, s.num_cpu_blocks))
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
    let out = quick(|| crate::expand::expand_block_ids(ids.as_slice(), f, skip, count))?;
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
    let out = quick(|| {
        crate::expand::compute_sub_block_ptrs(ids.as_slice(), f, base, stride, row, skip, count)
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
        quick(|| Ok(crate::engine::cuda::cuda_available())).unwrap_or(false)
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// `set_thread_cpus(cpus)`: the CPUs of the threads kvoff starts from now on (copy, I/O and feeder
/// threads), process-wide: a list of CPU numbers, a Linux CPU list string such as `"1,3,8-11"`, or
/// `None` / `"inherit"` to keep the creator's (the default; `KVOFF_THREAD_CPUS` sets it at start).
#[pyfunction]
fn set_thread_cpus(cpus: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
    let list: Option<Vec<usize>> = match cpus {
        None => None,
        Some(o) if o.is_none() => None,
        Some(o) => {
            if let Ok(text) = o.extract::<String>() {
                quick(|| crate::affinity::parse_cpu_list(&text))?
            } else {
                let items: Vec<Bound<'_, PyAny>> = o
                    .try_iter()
                    .map_err(|_| {
                        PyTypeError::new_err(format!(
                            "cpus must be a list of CPU numbers, a CPU list string or None, not {}",
                            type_name(o)
                        ))
                    })?
                    .collect::<PyResult<_>>()?;
                Some(
                    items
                        .iter()
                        .map(|c| usize_arg(c, "cpu"))
                        .collect::<PyResult<_>>()?,
                )
            }
        }
    };
    quick(|| crate::affinity::set_thread_cpus(list.as_deref()))
}

/// The CPUs set for kvoff's threads, or `None` when they inherit their creator's.
#[pyfunction]
fn thread_cpus() -> Option<Vec<usize>> {
    crate::affinity::thread_cpus()
}

/// Why the CPU setting could not be applied to one of kvoff's threads (the last time), or `None`.
#[pyfunction]
fn thread_placement_error() -> Option<String> {
    crate::affinity::last_placement_error()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(set_thread_cpus, m)?)?;
    m.add_function(wrap_pyfunction!(thread_cpus, m)?)?;
    m.add_function(wrap_pyfunction!(thread_placement_error, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_sizing, m)?)?;
    m.add_function(wrap_pyfunction!(expand_block_ids, m)?)?;
    m.add_function(wrap_pyfunction!(compute_sub_block_ptrs, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    Ok(())
}
