//! Key helpers (docs/spec.md §1) and extraction of key lists from Python.
#![forbid(unsafe_code)]

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use super::errors::IntoPyResult;
use crate::key::{self, ByteKey};

/// The offload key of a block: `block_hash` followed by `group_idx` as 4 big-endian bytes.
#[pyfunction]
fn make_offload_key<'py>(
    py: Python<'py>,
    block_hash: &Bound<'py, PyAny>,
    group_idx: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let hash = bytes_arg(block_hash, "block_hash")?;
    if group_idx.is_instance_of::<pyo3::types::PyBool>()
        || !group_idx.is_instance_of::<pyo3::types::PyInt>()
    {
        return Err(PyTypeError::new_err(format!(
            "group_idx must be an int, got {}",
            type_name(group_idx)
        )));
    }
    // An int beyond i128 is out of range like any other: ValueError below.
    let g: i128 = group_idx.extract().unwrap_or(i128::MAX);
    let k = key::make_offload_key_checked(hash, g).py()?;
    Ok(PyBytes::new(py, &k))
}

/// The block hash part of an offload key (all but its last 4 bytes).
#[pyfunction]
fn get_offload_block_hash<'py>(
    py: Python<'py>,
    key: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let k = bytes_arg(key, "key")?;
    Ok(PyBytes::new(py, key::get_offload_block_hash(k).py()?))
}

/// The KV-cache group index of an offload key (its last 4 bytes, big-endian).
#[pyfunction]
fn get_offload_group_idx(key: &Bound<'_, PyAny>) -> PyResult<u32> {
    key::get_offload_group_idx(bytes_arg(key, "key")?).py()
}

pub(crate) fn type_name(o: &Bound<'_, PyAny>) -> String {
    o.get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string())
}

fn bytes_arg<'a>(o: &'a Bound<'_, PyAny>, what: &str) -> PyResult<&'a [u8]> {
    o.cast::<PyBytes>()
        .map(PyBytesMethods::as_bytes)
        .map_err(|_| PyTypeError::new_err(format!("{what} must be bytes, got {}", type_name(o))))
}

/// Reads a sequence of `bytes` keys into `out` (cleared first).
///
/// # Errors
/// `TypeError` if `keys` is not iterable or an item is not `bytes`.
pub(crate) fn extract_keys(keys: &Bound<'_, PyAny>, out: &mut Vec<ByteKey>) -> PyResult<()> {
    out.clear();
    let push = |out: &mut Vec<ByteKey>, i: usize, item: &Bound<'_, PyAny>| -> PyResult<()> {
        match item.cast::<PyBytes>() {
            Ok(b) => {
                out.push(ByteKey::new(b.as_bytes()));
                Ok(())
            }
            Err(_) => Err(PyTypeError::new_err(format!(
                "keys must be bytes (see make_offload_key); item {i} is {}",
                type_name(item)
            ))),
        }
    };
    if let Ok(list) = keys.cast::<PyList>() {
        out.reserve(list.len());
        for (i, item) in list.iter().enumerate() {
            push(out, i, &item)?;
        }
    } else if let Ok(t) = keys.cast::<PyTuple>() {
        out.reserve(t.len());
        for (i, item) in t.iter().enumerate() {
            push(out, i, &item)?;
        }
    } else if keys.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(
            "keys must be a sequence of bytes keys, not a single bytes object",
        ));
    } else {
        let it = keys.try_iter().map_err(|_| {
            PyTypeError::new_err(format!(
                "keys must be a sequence of bytes, got {}",
                type_name(keys)
            ))
        })?;
        for (i, item) in it.enumerate() {
            push(out, i, &item?)?;
        }
    }
    Ok(())
}

/// A single key argument.
pub(crate) fn extract_key(key: &Bound<'_, PyAny>) -> PyResult<ByteKey> {
    bytes_arg(key, "key").map(ByteKey::new)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(make_offload_key, m)?)?;
    m.add_function(wrap_pyfunction!(get_offload_block_hash, m)?)?;
    m.add_function(wrap_pyfunction!(get_offload_group_idx, m)?)?;
    Ok(())
}
