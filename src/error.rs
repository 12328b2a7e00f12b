//! Typed errors of the whole crate.
//!
//! One enum, [`KvoffError`], with a variant per failure class. The Python bindings map each variant to
//! one exception class in a single `match` (`src/python/errors.rs`); nothing here depends on pyo3.
//! Messages say what was wrong and, where it helps, what to do about it.
#![forbid(unsafe_code)]

/// Every error kvoff reports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvoffError {
    /// A call is not valid in the current state (a key that is not ready, a shut-down object, …).
    /// Python: `InvalidStateError`.
    #[error("{0}")]
    InvalidState(String),
    /// An argument has a bad value (range, length, shape). Python: `ValueError`.
    #[error("{0}")]
    InvalidArgument(String),
    /// An argument has the wrong type. Python: `TypeError`.
    #[error("{0}")]
    InvalidType(String),
    /// A configuration value is missing or invalid. Python: `ConfigError` (also a `ValueError`).
    #[error("{0}")]
    Config(String),
    /// A host memory region could not be created, joined, sized or mapped. Python: `RegionError`.
    #[error("{0}")]
    Region(String),
    /// CUDA was asked for but there is no driver or device. Python: `CudaUnavailableError`.
    #[error("{0}")]
    CudaUnavailable(String),
    /// A CUDA call failed. Python: `CudaError`.
    #[error("{0}")]
    Cuda(String),
}

/// Result alias used throughout the crate.
pub type Result<T, E = KvoffError> = std::result::Result<T, E>;

impl KvoffError {
    /// Shorthand for [`KvoffError::InvalidArgument`].
    pub fn arg(msg: impl Into<String>) -> Self {
        Self::InvalidArgument(msg.into())
    }
    /// Shorthand for [`KvoffError::InvalidState`].
    pub fn state(msg: impl Into<String>) -> Self {
        Self::InvalidState(msg.into())
    }
}
