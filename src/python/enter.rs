//! The one way binding code enters kvoff for anything that may wait: a kvoff lock, a driver call,
//! file or shared-memory I/O, a job.
//!
//! The discipline (the README's "Reliability" section) it makes hard to break:
//! - no Python object is built or touched and no Python code runs while a kvoff lock is held:
//!   the closures here take and return plain Rust values; arguments are converted before and
//!   results (and exceptions) are built after;
//! - nothing waits with the GIL held: [`blocking`] always releases it; [`locked`] takes a lock
//!   without waiting while the GIL is held and, when another thread holds it, waits with the GIL
//!   released, so a thread that holds the lock and needs the GIL can always finish;
//! - a Rust panic (a kvoff bug) never unwinds into Python: it becomes `kvoff.KvoffError`
//!   ("internal error … please report"), and [`locked`] lets the owner put the guarded state out of
//!   service (`on_panic`) so that later calls fail cleanly instead of using a half-updated value.
//!
//! This is what polars' `enter_polars` does for its calls; here it replaces the
//! `py.detach(|| guard(..))` pairs the bindings used to write out at every call.
#![forbid(unsafe_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, PoisonError, TryLockError};

use pyo3::prelude::*;

use super::errors::{internal_error, panic_message, to_py};
use crate::error::KvoffError;

/// How long the work under a lock may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hold {
    /// Short and CPU-bound (a manager operation): when the lock is free it runs with the GIL kept,
    /// saving the GIL round trip on the common path.
    Brief,
    /// May wait (driver calls, I/O, jobs): the GIL is always released first.
    Long,
}

/// A failure inside kvoff, in Rust terms: the Python exception is built only once no lock is held.
enum Failure {
    Kvoff(KvoffError),
    Panic(String),
}

impl Failure {
    fn into_py(self) -> PyErr {
        match self {
            Self::Kvoff(e) => to_py(e),
            Self::Panic(what) => internal_error(&what),
        }
    }
}

fn catch<R>(f: impl FnOnce() -> crate::Result<R>) -> Result<R, Failure> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(Failure::Kvoff),
        Err(payload) => Err(Failure::Panic(panic_message(&*payload))),
    }
}

/// Runs `f` with the GIL released and panics caught.
///
/// # Errors
/// `f`'s error as its exception class; a panic as the internal error.
pub(crate) fn blocking<R: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> crate::Result<R> + Send,
) -> PyResult<R> {
    py.detach(|| catch(f)).map_err(Failure::into_py)
}

/// Runs `f` on the value behind `lock` (see the module docs). A panic in `f` runs `on_panic` on
/// the value, still under the lock, before the lock is released; its own panic is swallowed (the
/// internal error is reported either way). The mutex is never left poisoned by `f` (its panics are
/// caught), so a poisoned one can only come from outside and is recovered.
///
/// # Errors
/// `f`'s error as its exception class; a panic as the internal error.
pub(crate) fn locked<S: Send, R: Send>(
    py: Python<'_>,
    lock: &Mutex<S>,
    hold: Hold,
    on_panic: impl FnOnce(&mut S) + Send,
    f: impl FnOnce(&mut S) -> crate::Result<R> + Send,
) -> PyResult<R> {
    let run = |s: &mut S| -> Result<R, Failure> {
        let r = catch(|| f(s));
        if matches!(r, Err(Failure::Panic(_))) {
            let _ = catch_unwind(AssertUnwindSafe(|| on_panic(s)));
        }
        r
    };
    let res = if hold == Hold::Brief {
        match lock.try_lock() {
            Ok(mut g) => run(&mut g),
            Err(TryLockError::Poisoned(p)) => run(&mut p.into_inner()),
            Err(TryLockError::WouldBlock) => {
                py.detach(|| run(&mut lock.lock().unwrap_or_else(PoisonError::into_inner)))
            }
        }
    } else {
        py.detach(|| run(&mut lock.lock().unwrap_or_else(PoisonError::into_inner)))
    };
    res.map_err(Failure::into_py)
}

/// Runs `f` on the value behind `lock` only if the lock is free now (`None` otherwise): for calls
/// that must never wait, such as polling for finished jobs while another thread waits on them.
///
/// # Errors
/// As [`locked`]; nothing happens to the value when `f` panics.
pub(crate) fn try_locked<S, R>(
    lock: &Mutex<S>,
    f: impl FnOnce(&mut S) -> crate::Result<R>,
) -> PyResult<Option<R>> {
    let res = match lock.try_lock() {
        Ok(mut g) => catch(|| f(&mut g)).map(Some),
        Err(TryLockError::Poisoned(p)) => catch(|| f(&mut p.into_inner())).map(Some),
        Err(TryLockError::WouldBlock) => Ok(None),
    };
    res.map_err(Failure::into_py)
}

/// Runs quick, non-blocking crate code with the GIL held, panics caught.
///
/// # Errors
/// As [`blocking`].
pub(crate) fn quick<R>(f: impl FnOnce() -> crate::Result<R>) -> PyResult<R> {
    catch(f).map_err(Failure::into_py)
}
