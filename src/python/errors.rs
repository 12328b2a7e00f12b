//! The one mapping from [`KvoffError`] to Python exception classes, and the internal error a
//! caught panic becomes (see [`super::enter`]).
//!
//! The exception classes are defined in Python (`kvoff/errors.py`) so that `ConfigError` can be both
//! a `KvoffError` and a `ValueError`; they are imported lazily on first use.
#![forbid(unsafe_code)]

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::error::KvoffError;

/// The Python exception classes of `kvoff.errors`.
pub(crate) mod exc {
    pyo3::import_exception!(kvoff.errors, InvalidStateError);
    pyo3::import_exception!(kvoff.errors, ConfigError);
    pyo3::import_exception!(kvoff.errors, RegionError);
    pyo3::import_exception!(kvoff.errors, CudaUnavailableError);
    pyo3::import_exception!(kvoff.errors, CudaError);
    pyo3::import_exception!(kvoff.errors, KvoffError);
}
use exc::{ConfigError, CudaError, CudaUnavailableError, InvalidStateError, RegionError};

/// Converts a crate error into the matching Python exception.
pub(crate) fn to_py(e: KvoffError) -> PyErr {
    match e {
        KvoffError::InvalidState(m) => InvalidStateError::new_err(m),
        KvoffError::InvalidArgument(m) => PyValueError::new_err(m),
        KvoffError::InvalidType(m) => PyTypeError::new_err(m),
        KvoffError::Config(m) => ConfigError::new_err(m),
        KvoffError::Region { message, .. } => RegionError::new_err(message),
        KvoffError::CudaUnavailable(m) => CudaUnavailableError::new_err(m),
        KvoffError::Cuda { message, .. } => CudaError::new_err(message),
    }
}

/// The text of a panic payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned())
}

/// The exception for a caught panic: a kvoff bug, reported as such.
pub(crate) fn internal_error(what: &str) -> PyErr {
    exc::KvoffError::new_err(format!("internal error in kvoff (please report): {what}"))
}

/// `Result<T, KvoffError>` → `PyResult<T>`.
pub(crate) trait IntoPyResult<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for crate::error::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
