//! `PyO3` bindings: the private module `kvoff._native` (only with the `python` feature).
//!
//! All PyO3 code lives under `src/python/`; the rest of the crate knows nothing of Python. Errors are
//! mapped to exception classes in one place ([`errors`]); no Rust panic reaches Python: every entry
//! point that runs crate code goes through [`enter`], which also keeps the lock and GIL
//! discipline (no Python object touched under a kvoff lock, no wait with the GIL held).
//!
//! Modules by concept: [`args`] (argument conversion), [`functions`] (sizing, expansion),
//! [`region`] (host regions), [`handler`] (the transfer handler and engine choice), [`manager`],
//! [`specs`] (its value types) and [`keys`] (scheduler side), [`tier`] (the tiered manager: file
//! and remote tiers) with [`tier_stats`] (its `get_stats()` dict), [`tiers`] (each tier's
//! settings, read once for every constructor), [`tier_bench`] (`bench_disk`),
//! [`blockstore`] (the file or remote tier as a block store for engines that own their host memory),
//! [`names`] (the `direct_io` modes by name).

/// The extension's allocator: mimalloc frees memory another thread allocated without a lock, where
/// glibc's malloc locks that thread's arena (a scheduler call then waited on an I/O thread: measured
/// in `lookup_prefix`'s p99 with the remote tier, BENCHMARKS.md "Remote tier"). Only the
/// extension module's own Rust allocations use it; the crate as a library leaves the choice to the
/// program (and tests that count allocations set their own).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod args;
mod blockstore;
mod enter;
mod errors;
mod functions;
mod handler;
mod keys;
mod manager;
mod names;
mod region;
mod specs;
mod submitter;
mod tier;
mod tier_bench;
mod tier_stats;
mod tiers;

use pyo3::prelude::*;

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    keys::register(m)?;
    manager::register(m)?;
    functions::register(m)?;
    region::register(m)?;
    handler::register(m)?;
    tier::register(m)?;
    tier_bench::register(m)?;
    tiers::register(m)?;
    blockstore::register(m)?;
    names::register(m)?;
    Ok(())
}
