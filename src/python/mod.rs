//! PyO3 bindings: the private module `kvoff._native` (only with the `python` feature).
//!
//! All PyO3 code lives under `src/python/`; the rest of the crate knows nothing of Python. Errors are
//! mapped to exception classes in one place ([`errors`]); no Rust panic reaches Python (every entry
//! point that runs crate code goes through [`errors::guard`]).

mod errors;
mod keys;
mod manager;
mod tier;
mod worker;

use pyo3::prelude::*;

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    keys::register(m)?;
    manager::register(m)?;
    worker::register(m)?;
    tier::register(m)?;
    Ok(())
}
