//! Argument conversion shared by the bindings: block-id arrays (borrowed from numpy without a
//! copy when they are int64 and contiguous), ints (never `bool`; out of range is a `ValueError`,
//! not an `OverflowError`), seconds, lists.
//!
//! Every converter runs with the GIL held and before any kvoff lock is taken (see [`super::enter`]).
#![forbid(unsafe_code)]

use numpy::{PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString, PyTuple};

use super::keys::type_name;

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
pub(crate) fn int_arg(o: &Bound<'_, PyAny>, name: &str) -> PyResult<i128> {
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
#[derive(Clone, Copy)]
pub(crate) struct Seconds(pub(crate) f64);

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
pub(crate) fn u64_arg(o: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    let v = int_arg(o, name)?;
    u64::try_from(v)
        .map_err(|_| PyValueError::new_err(format!("{name} must be in 0..2**64, got {v}")))
}

pub(crate) fn usize_arg(o: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    let v = u64_arg(o, name)?;
    usize::try_from(v).map_err(|_| PyValueError::new_err(format!("{name} is too large: {v}")))
}

pub(crate) fn opt_u64_arg(o: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<u64>> {
    match o {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => u64_arg(o, name).map(Some),
    }
}

pub(crate) fn opt_usize_arg(o: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<usize>> {
    match o {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => usize_arg(o, name).map(Some),
    }
}

/// Reinterprets pointers as `int64` (addresses are below 2^63 in practice; the bits are kept).
pub(crate) fn ptrs_to_i64(v: Vec<u64>) -> Vec<i64> {
    v.into_iter()
        .map(|p| i64::from_ne_bytes(p.to_ne_bytes()))
        .collect()
}

pub(crate) fn list_arg<'py>(o: &Bound<'py, PyAny>, what: &str) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if !(o.is_instance_of::<PyList>() || o.is_instance_of::<PyTuple>()) {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a list, got {}",
            type_name(o)
        )));
    }
    o.try_iter()?.collect()
}

/// An `int` argument (never `bool`) as extracted by PyO3: a non-int is a `TypeError` (PyO3 names
/// the argument); the range is checked by [`Int::get`] (a `ValueError` naming it), so that no
/// argument raises `OverflowError`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Int(Option<i128>);

impl Int {
    /// The default value `v` of an argument.
    pub(crate) const fn of(v: i128) -> Self {
        Self(Some(v))
    }

    /// The value in `T`'s range.
    ///
    /// # Errors
    /// `ValueError` naming `name` and the range when it does not fit.
    pub(crate) fn get<T>(self, name: &str) -> PyResult<T>
    where
        T: TryFrom<i128> + num_bounds::Bounds,
    {
        self.0.and_then(|v| T::try_from(v).ok()).ok_or_else(|| {
            PyValueError::new_err(format!(
                "{name} must be in {}..={}, got {}",
                T::MIN_I128,
                T::MAX_I128,
                self.0
                    .map_or_else(|| "an int beyond 128 bits".to_owned(), |v| v.to_string())
            ))
        })
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(o: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if o.is_instance_of::<PyBool>() || !o.is_instance_of::<PyInt>() {
            return Err(PyTypeError::new_err(format!(
                "must be an int, got {}",
                type_name(&o)
            )));
        }
        Ok(Self(o.extract::<i128>().ok()))
    }
}

/// Ranges of the integer types [`Int::get`] converts to (for its message).
pub(crate) mod num_bounds {
    /// The type's range as `i128`.
    pub(crate) trait Bounds {
        const MIN_I128: i128;
        const MAX_I128: i128;
    }
    macro_rules! bounds {
        ($($t:ty),*) => {$(
            impl Bounds for $t {
                const MIN_I128: i128 = <$t>::MIN as i128;
                #[allow(clippy::cast_lossless, clippy::cast_possible_wrap)]
                const MAX_I128: i128 = <$t>::MAX as i128;
            }
        )*};
    }
    bounds!(u32, u64, usize);
}

/// A number argument (`int` or `float`, never `bool`): a `TypeError` otherwise.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Float(pub(crate) f64);

impl<'a, 'py> FromPyObject<'a, 'py> for Float {
    type Error = PyErr;

    fn extract(o: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if o.is_instance_of::<PyBool>()
            || !(o.is_instance_of::<PyInt>() || o.is_instance_of::<pyo3::types::PyFloat>())
        {
            return Err(PyTypeError::new_err(format!(
                "must be a number, got {}",
                type_name(&o)
            )));
        }
        o.extract::<f64>()
            .map(Float)
            .map_err(|_| PyValueError::new_err("the number is out of range"))
    }
}

/// A filesystem path argument: a `str` or an `os.PathLike` whose `__fspath__` gives a `str`
/// (`bytes` paths are refused: a `TypeError`, never a directory named `b'...'`).
#[derive(Clone, Debug)]
pub(crate) struct PathArg(pub(crate) std::path::PathBuf);

impl<'a, 'py> FromPyObject<'a, 'py> for PathArg {
    type Error = PyErr;

    fn extract(o: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let s = if o.is_instance_of::<PyString>() {
            o.to_owned()
        } else if !o.is_instance_of::<PyBytes>() && o.hasattr("__fspath__")? {
            o.call_method0("__fspath__")?
        } else {
            return Err(PyTypeError::new_err(format!(
                "must be a str or an os.PathLike giving a str, got {}",
                type_name(&o)
            )));
        };
        if !s.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(format!(
                "must be a str or an os.PathLike giving a str; __fspath__ gave {}",
                type_name(&s)
            )));
        }
        let s: String = s.extract()?;
        if s.is_empty() || s.contains('\0') {
            return Err(PyValueError::new_err(format!(
                "must name a directory, got {s:?}"
            )));
        }
        Ok(Self(std::path::PathBuf::from(s)))
    }
}
