//! Typed errors of the whole crate.
//!
//! One enum, [`KvoffError`], with a variant per failure class. The Python bindings map each variant to
//! one exception class in a single `match` (`src/python/errors.rs`); nothing here depends on pyo3.
//! Messages say what was wrong and, where it helps, what to do about it.
#![forbid(unsafe_code)]

use std::fmt;
use std::sync::Arc;

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
    #[error("{message}")]
    Region {
        /// What failed, with the path and sizes involved.
        message: String,
        /// The operating system's error, when one caused it (`ENOSPC`, `EACCES`, …).
        #[source]
        source: Option<IoSource>,
    },
    /// CUDA was asked for but there is no driver or device. Python: `CudaUnavailableError`.
    #[error("{0}")]
    CudaUnavailable(String),
    /// A CUDA call failed. Python: `CudaError`.
    #[error("{message}")]
    Cuda {
        /// What failed.
        message: String,
        /// The driver call and its result code, when a driver call failed.
        #[source]
        source: Option<CudaStatus>,
    },
}

/// An [`std::io::Error`] kept as the source of a [`KvoffError`] (shared, so errors stay `Clone`;
/// equal when kind and OS error number are).
#[derive(Debug, Clone)]
pub struct IoSource(pub Arc<std::io::Error>);

impl IoSource {
    /// The error.
    #[must_use]
    pub fn get(&self) -> &std::io::Error {
        &self.0
    }
}

impl PartialEq for IoSource {
    fn eq(&self, other: &Self) -> bool {
        self.0.kind() == other.0.kind() && self.0.raw_os_error() == other.0.raw_os_error()
    }
}

impl Eq for IoSource {}

impl fmt::Display for IoSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for IoSource {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// A CUDA driver call that failed: its name and result code (`CUresult`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaStatus {
    /// The driver call, e.g. `cuMemcpyBatchAsync`.
    pub call: String,
    /// The driver's result code (`CUDA_ERROR_OUT_OF_MEMORY` is 2).
    pub code: i32,
    /// The code's name and description, as the driver gives them.
    pub text: String,
}

impl fmt::Display for CudaStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} returned {} ({})", self.call, self.code, self.text)
    }
}

impl std::error::Error for CudaStatus {}

/// The entry of `all` whose `name` is exactly `s`, else [`KvoffError::InvalidArgument`]
/// "unknown {what} {s:?}; valid choices: {list of the names}" (the list as `choices` writes it):
/// the parser of every closed set of names (`EngineKind`, `PolicyKind`).
pub(crate) fn parse_name<T: Copy>(
    s: &str,
    all: &[T],
    name: fn(T) -> &'static str,
    what: &str,
    choices: fn(&[&'static str]) -> String,
) -> Result<T> {
    all.iter().copied().find(|&k| name(k) == s).ok_or_else(|| {
        let names: Vec<&'static str> = all.iter().map(|&k| name(k)).collect();
        KvoffError::arg(format!(
            "unknown {what} {s:?}; valid choices: {}",
            choices(&names)
        ))
    })
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
    /// A [`KvoffError::Region`] without an OS error behind it.
    pub fn region(msg: impl Into<String>) -> Self {
        Self::Region {
            message: msg.into(),
            source: None,
        }
    }
    /// A [`KvoffError::Region`] caused by `e`.
    pub fn region_io(msg: impl Into<String>, e: std::io::Error) -> Self {
        Self::Region {
            message: msg.into(),
            source: Some(IoSource(Arc::new(e))),
        }
    }
    /// A [`KvoffError::Cuda`] without a driver status (a kvoff-side check).
    pub fn cuda(msg: impl Into<String>) -> Self {
        Self::Cuda {
            message: msg.into(),
            source: None,
        }
    }
    /// The OS error behind a [`KvoffError::Region`], if any.
    #[must_use]
    pub fn io_error(&self) -> Option<&std::io::Error> {
        match self {
            Self::Region {
                source: Some(s), ..
            } => Some(s.get()),
            _ => None,
        }
    }
    /// The failed driver call behind a [`KvoffError::Cuda`], if any.
    #[must_use]
    pub fn cuda_status(&self) -> Option<&CudaStatus> {
        match self {
            Self::Cuda {
                source: Some(s), ..
            } => Some(s),
            _ => None,
        }
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::KvoffError;
    use std::error::Error;

    #[test]
    fn sources_are_kept() {
        let e = KvoffError::region_io(
            "cannot create /dev/shm/x",
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert_eq!(
            e.io_error().and_then(std::io::Error::raw_os_error),
            Some(libc::ENOSPC)
        );
        assert!(e.source().is_some());
        assert_eq!(e.to_string(), "cannot create /dev/shm/x");
        let same = KvoffError::region_io(
            "cannot create /dev/shm/x",
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert_eq!(e, same.clone());
        assert!(KvoffError::region("x").io_error().is_none());
    }
}
