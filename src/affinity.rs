//! Which CPUs kvoff's own threads run on (docs/performance.md, "kvoff's threads and the model's
//! CPUs").
//!
//! A thread starts with its creator's CPU affinity. An engine that binds its compute threads to some
//! CPUs (vLLM's CPU build binds its OpenMP threads, the engine's main thread among them, and keeps a
//! CPU free for everything else) would otherwise pull kvoff's copy and I/O threads onto the model's
//! cores, where they take time from the model and wait for it. A process-wide setting names the CPUs
//! for kvoff's threads instead: [`set_thread_cpus`], or the `KVOFF_THREAD_CPUS` environment variable
//! (a list such as `1,3,8-11`; `inherit` or empty for the default). Every thread kvoff starts calls
//! [`place_current_thread`] first. Without a setting nothing changes: threads keep the affinity they
//! inherited (the right choice for an unbound process, e.g. a GPU server).
//!
//! A setting that cannot be applied (no CPU of the list is allowed to the process, or the system
//! call fails) leaves the thread where it was and is recorded ([`last_placement_error`]); it never
//! fails the work the thread does.
// Unsafe: sched_getaffinity / sched_setaffinity through libc (a plain `cpu_set_t` on the stack).
#![allow(unsafe_code)]

use std::sync::{Mutex, OnceLock, PoisonError};

use crate::error::{KvoffError, Result};

/// CPU numbers a `cpu_set_t` can hold.
const MAX_CPUS: usize = libc::CPU_SETSIZE as usize;

/// The process-wide setting: `None` = inherit.
fn setting() -> &'static Mutex<Option<Vec<usize>>> {
    static S: OnceLock<Mutex<Option<Vec<usize>>>> = OnceLock::new();
    S.get_or_init(|| {
        let from_env = std::env::var("KVOFF_THREAD_CPUS")
            .ok()
            .and_then(|v| parse_cpu_list(&v).ok().flatten());
        Mutex::new(from_env)
    })
}

fn last_error() -> &'static Mutex<Option<String>> {
    static E: OnceLock<Mutex<Option<String>>> = OnceLock::new();
    E.get_or_init(|| Mutex::new(None))
}

/// Parses a CPU list as Linux prints it (`0-3,8,10-11`). `inherit` or an empty string is `None`.
///
/// # Errors
/// [`KvoffError::InvalidArgument`] for anything else than numbers, ranges and commas, a range
/// that runs backwards, or a CPU number of [`libc::CPU_SETSIZE`] or more.
pub fn parse_cpu_list(text: &str) -> Result<Option<Vec<usize>>> {
    let t = text.trim();
    if t.is_empty() || t.eq_ignore_ascii_case("inherit") {
        return Ok(None);
    }
    let bad = || {
        KvoffError::arg(format!(
            "bad CPU list {text:?}: expected CPU numbers and ranges such as \"1,3,8-11\" (below {MAX_CPUS}), or \"inherit\""
        ))
    };
    let mut out = Vec::new();
    for part in t.split(',') {
        let part = part.trim();
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let lo: usize = lo.parse().map_err(|_| bad())?;
        let hi: usize = hi.parse().map_err(|_| bad())?;
        if lo > hi || hi >= MAX_CPUS {
            return Err(bad());
        }
        out.extend(lo..=hi);
    }
    out.sort_unstable();
    out.dedup();
    Ok(Some(out))
}

/// Sets the CPUs of the threads kvoff starts from now on (`None`: inherit the creator's). Threads
/// already running keep theirs.
///
/// # Errors
/// [`KvoffError::InvalidArgument`] for an empty list or a CPU number of [`libc::CPU_SETSIZE`] or
/// more.
pub fn set_thread_cpus(cpus: Option<&[usize]>) -> Result<()> {
    if let Some(c) = cpus {
        if c.is_empty() {
            return Err(KvoffError::arg(
                "an empty CPU list: pass None to inherit the creator's CPUs",
            ));
        }
        if let Some(&x) = c.iter().find(|&&x| x >= MAX_CPUS) {
            return Err(KvoffError::arg(format!(
                "CPU {x} is beyond what the system can address ({MAX_CPUS})"
            )));
        }
    }
    let mut v = cpus.map(<[usize]>::to_vec);
    if let Some(v) = v.as_mut() {
        v.sort_unstable();
        v.dedup();
    }
    *setting().lock().unwrap_or_else(PoisonError::into_inner) = v;
    Ok(())
}

/// The CPUs set for kvoff's threads (`None`: they inherit their creator's).
#[must_use]
pub fn thread_cpus() -> Option<Vec<usize>> {
    setting()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

/// The last setting that could not be applied to a thread, with the reason.
#[must_use]
pub fn last_placement_error() -> Option<String> {
    last_error()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

/// The CPUs the calling thread may run on.
///
/// # Errors
/// The operating system's error when `sched_getaffinity` fails.
pub fn current_thread_cpus() -> std::io::Result<Vec<usize>> {
    // SAFETY: an all-zero cpu_set_t is a valid (empty) set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live cpu_set_t of the size passed; pid 0 is the calling thread.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw mut set) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((0..MAX_CPUS)
        .filter(|&c| {
            // SAFETY: CPU_ISSET reads `set`, a valid cpu_set_t; `c < CPU_SETSIZE`.
            unsafe { libc::CPU_ISSET(c, &set) }
        })
        .collect())
}

/// Moves the calling thread to the CPUs set for kvoff's threads, if any (see the module docs).
/// Called first by every thread kvoff starts; never fails (a failure is recorded).
pub fn place_current_thread() {
    let Some(cpus) = thread_cpus() else { return };
    if let Err(e) = apply(&cpus) {
        *last_error().lock().unwrap_or_else(PoisonError::into_inner) = Some(format!(
            "kvoff's threads stay on their inherited CPUs: setting CPUs {cpus:?} failed: {e}"
        ));
    }
}

fn apply(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: an all-zero cpu_set_t is a valid (empty) set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus.iter().filter(|&&c| c < MAX_CPUS) {
        // SAFETY: `set` is a valid cpu_set_t and `c < CPU_SETSIZE`.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: `set` is a live cpu_set_t of the size passed; pid 0 is the calling thread.
    let rc = unsafe {
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw const set)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parses_linux_cpu_lists() {
        assert_eq!(
            parse_cpu_list("0-3,8, 10-11").unwrap(),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("2,2,1").unwrap(), Some(vec![1, 2]));
        assert_eq!(parse_cpu_list("inherit").unwrap(), None);
        assert_eq!(parse_cpu_list(" ").unwrap(), None);
        for bad in ["x", "3-1", "1,,2", "-1", "1-", "99999"] {
            assert!(parse_cpu_list(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_placed_thread_runs_on_the_set_cpus_only() {
        let mine = current_thread_cpus().unwrap();
        assert!(!mine.is_empty());
        let want = vec![*mine.last().unwrap()];
        // Applied in a thread of its own (the setting is process-wide; other tests don't set it).
        let got = std::thread::spawn(move || {
            apply(&want).unwrap();
            (want, current_thread_cpus().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!(got.0, got.1);
        assert!(set_thread_cpus(Some(&[])).is_err());
        assert!(set_thread_cpus(Some(&[MAX_CPUS])).is_err());
    }
}
