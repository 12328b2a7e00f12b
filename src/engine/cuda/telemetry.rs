//! Timing of driver calls (docs/performance.md: no call over 200 µs): each thread's record of its
//! enqueue calls (how many, the longest in wall-clock and CPU time, the pacing waits), which
//! `submit` takes for [`SubmitStats`](crate::engine::SubmitStats). The calls themselves are in `ffi`.
// Unsafe: one `clock_gettime` (the block says why it is sound).
#![allow(unsafe_code)]

use std::cell::Cell;
use std::time::Instant;

/// Enqueue calls made on a thread: how many, and the longest one in wall-clock and in the
/// thread's own CPU time (a call that waits for queue space in the driver shows wall time without
/// CPU time). What a `submit` holds the driver for (docs/performance.md: no call over 200 µs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CallRecord {
    pub(crate) calls: u32,
    pub(crate) longest_ns: u64,
    pub(crate) longest_cpu_ns: u64,
    /// The driver entry point of the call with the most CPU time ("" if none).
    pub(crate) longest_name: &'static str,
    /// Time spent outside the driver waiting for the device to drain the stream's queue
    /// (the pacing of long DMA jobs, see `feed::Pace`), ns.
    pub(crate) paced_ns: u64,
}

impl CallRecord {
    fn merge(self, o: Self) -> Self {
        Self {
            calls: self.calls.saturating_add(o.calls),
            longest_ns: self.longest_ns.max(o.longest_ns),
            longest_cpu_ns: self.longest_cpu_ns.max(o.longest_cpu_ns),
            longest_name: if o.longest_cpu_ns > self.longest_cpu_ns || self.longest_name.is_empty()
            {
                o.longest_name
            } else {
                self.longest_name
            },
            paced_ns: self.paced_ns.saturating_add(o.paced_ns),
        }
    }
}

thread_local! {
    /// This thread's calls since the last [`take_call_record`].
    static CALLS: Cell<CallRecord> = const {
        Cell::new(CallRecord {
            calls: 0,
            longest_ns: 0,
            longest_cpu_ns: 0,
            longest_name: "",
            paced_ns: 0,
        })
    };
}

/// CPU time of the calling thread, ns (0 if the clock is unavailable).
pub(super) fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-parameter; the clock id is a constant the kernel knows.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut ts) } != 0 {
        return 0;
    }
    u64::try_from(ts.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(ts.tv_nsec).unwrap_or(0))
}

/// Runs one enqueue call named `name`, adding it to this thread's call record.
pub(super) fn timed<T>(name: &'static str, f: impl FnOnce() -> T) -> T {
    let (t, c0) = (Instant::now(), thread_cpu_ns());
    let r = f();
    let one = CallRecord {
        calls: 1,
        longest_ns: u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX),
        longest_cpu_ns: thread_cpu_ns().saturating_sub(c0),
        longest_name: name,
        paced_ns: 0,
    };
    CALLS.with(|c| c.set(c.get().merge(one)));
    r
}

/// This thread's call record since the last take; resets it.
pub(crate) fn take_call_record() -> CallRecord {
    CALLS.with(|c| c.replace(CallRecord::default()))
}

/// Adds `ns` of pacing (waiting outside the driver for queue room) to this thread's record.
pub(crate) fn add_paced_ns(ns: u64) {
    CALLS.with(|c| {
        let mut r = c.get();
        r.paced_ns = r.paced_ns.saturating_add(ns);
        c.set(r);
    });
}

/// Adds another thread's call record (its calls made for this thread's job) to this thread's.
pub(crate) fn add_call_record(other: CallRecord) {
    CALLS.with(|c| c.set(c.get().merge(other)));
}
