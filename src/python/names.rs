//! The file tier's `direct_io` setting by name: the one list of its spellings
//! (`kvoff._native.DIRECT_IO`, which the Python settings and the `kvoff` command read) and the one
//! parser every binding that takes `direct_io=` uses. (The policy and engine names come from
//! `PolicyKind` and `EngineKind`, exported by [`super::manager`] and [`super::handler`].)
#![forbid(unsafe_code)]

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::errors::to_py;
use crate::error::KvoffError;
use crate::tier::DirectIo;

/// Every mode, in the order the documentation lists them.
pub(crate) const DIRECT_IO_MODES: [DirectIo; 3] = [DirectIo::Auto, DirectIo::On, DirectIo::Off];

/// The setting's spelling of `d` (exhaustive: a new mode does not compile until it has a name).
pub(crate) const fn direct_io_name(d: DirectIo) -> &'static str {
    match d {
        DirectIo::Auto => "auto",
        DirectIo::On => "on",
        DirectIo::Off => "off",
    }
}

/// Parses a `direct_io=` argument.
///
/// # Errors
/// `kvoff.ConfigError` (a `ValueError`) naming the valid choices.
pub(crate) fn parse_direct_io(s: &str) -> PyResult<DirectIo> {
    DIRECT_IO_MODES
        .into_iter()
        .find(|&d| direct_io_name(d) == s)
        .ok_or_else(|| {
            let names: Vec<String> = DIRECT_IO_MODES
                .iter()
                .map(|&d| format!("'{}'", direct_io_name(d)))
                .collect();
            to_py(KvoffError::Config(format!(
                "direct_io must be one of {}, got {s:?}",
                names.join(", ")
            )))
        })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add(
        "DIRECT_IO",
        PyTuple::new(m.py(), DIRECT_IO_MODES.map(direct_io_name))?,
    )
}
