//! Which process this is, for `fork()` detection on hot paths (docs/spec.md §7 "fork()": a
//! `fork()`ed child refuses the parent's handlers and tiered managers).
//!
//! Objects remember the id of the process that made them and compare it with [`id`] at each
//! call. `std::process::id()` is a system call each time (glibc no longer caches the pid), and the
//! scheduler's path made several per lookup; [`id`] reads a cached value that a `pthread_atfork`
//! child handler refreshes in every child, before `fork()` returns there.
// Unsafe: registering the `pthread_atfork` handler through libc.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Once;

/// The cached id (0: not cached yet).
static PID: AtomicU32 = AtomicU32::new(0);

extern "C" fn refresh_in_child() {
    // Async-signal-safe: getpid and an atomic store.
    PID.store(std::process::id(), Relaxed);
}

/// This process's id, without a system call once cached.
#[must_use]
pub fn id() -> u32 {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // SAFETY: the handler is a plain `extern "C" fn()` with no captured state that stays
        // valid for the life of the process; only the child handler is given. Registered before
        // the first caching below, so no fork can come between the cache and the handler.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(refresh_in_child)) };
        if rc == 0 {
            PID.store(std::process::id(), Relaxed);
        }
    });
    match PID.load(Relaxed) {
        0 => std::process::id(), // the handler could not be registered: ask each time
        p => p,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cached_id_is_the_process_id() {
        assert_eq!(super::id(), std::process::id());
        assert_eq!(super::id(), std::process::id());
    }
}
