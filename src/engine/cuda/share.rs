//! kvoff's share of the CUDA driver beside a model that launches eagerly (docs/performance.md,
//! "Transfers beside an eager model").
//!
//! The driver serializes a context's API calls: while one of kvoff's threads is inside a copy
//! call, a kernel launch of the model's thread waits for it. Batched DMA of small copies spends
//! about a microsecond of driver time per copy, so moving tens of GB/s keeps kvoff's threads in
//! the driver nearly all the time, and an eager forward (a thousand or more launches a step) then
//! waits at every launch and becomes launch-bound (measured: docs/performance.md). A forward
//! replayed from a CUDA graph launches once a step and does not notice.
//!
//! So each enqueueing thread of `auto` watches its own copy calls: a call that spent part of its
//! time off the CPU (the thread slept on the driver's lock), while no other kvoff copy call
//! overlapped it, waited for someone else's call — the model's launches (an eager forward keeps
//! its thread in the driver for a third of the time; a graph replay's thread mostly waits, and
//! its waits hold the lock only briefly). When such calls become frequent ([`CONTENDED_SHARE`] of
//! the recent ones), the device turns *polite* for
//! [`POLITE_HOLD`]: every enqueueing thread then makes short calls ([`POLITE_BATCH`] copies) and
//! after each waits outside the driver, so that kvoff holds the driver at most the configured
//! share of the time ([`Governor::gap`]) and the model's launches get in between; the share is the
//! device's: polite calls of kvoff's threads take turns through [`DriverShare`]'s gate, a call and
//! its wait at a time (both directions' feeders would otherwise hold the driver twice as long).
//! While the model keeps launching, the calls keep meeting its launches and the device stays
//! polite; a model that stops launching (a graph replay, an idle GPU) lets the device return to
//! full speed.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::telemetry::thread_cpu_ns;
use crate::engine::BLOCKED_BUCKETS;

/// How long the device stays polite after contention was last seen.
pub(super) const POLITE_HOLD: Duration = Duration::from_millis(200);
/// Share of recent sampled calls (of 1024) that must have slept on the driver's lock for the
/// device to turn polite: above a graph replay's, below an eager forward's (docs/performance.md,
/// "Transfers beside an eager model").
pub(super) const CONTENDED_SHARE: u32 = 100;
/// ... and, where set (`CudaEngineConfig::polite_slow_share`, e.g. this value), at least that
/// share (of 1024) of the sampled calls waited over a longer window ([`SLOW_SHIFT`]): an eager
/// forward keeps 10–12% of even polite calls waiting, the synthetic proxies of `kvoff bench
/// interference` (a launch every 200 µs, long kernels) 1–4%, whose bursts alone crossed
/// [`CONTENDED_SHARE`] (docs/performance.md, "Transfers beside an eager model").
#[cfg(test)]
pub(super) const SLOW_CONTENDED_SHARE: u32 = 40;
/// Weight of one sample in the slow share, as a shift (1/256).
const SLOW_SHIFT: u32 = 8;
/// Copies per batched call while polite (one call then holds the driver ~16 µs).
pub(super) const POLITE_BATCH: usize = 16;
/// A call waited when it took this many times the thread's recent fastest call of its size...
const WAIT_FACTOR: f64 = 1.5;
/// ... plus this much (ns), the driver's own jitter.
const WAIT_SLACK_NS: f64 = 2_000.0;
/// A call that spent this long off the CPU (ns) slept on the driver's lock.
const BLOCKED_NS: u64 = 3_000;
/// Weight of one sample in the contended share, as a shift (1/32).
const EWMA_SHIFT: u32 = 5;

/// When the engine makes its copy calls polite (`KVOFF_CUDA_TUNE` key `polite`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Polite {
    /// While contention with another thread's calls is seen (the serving policy's default).
    #[default]
    Auto,
    /// Always (for measuring).
    Always,
    /// Never: copy calls back to back (explicit methods).
    Off,
    /// Never, but the calls are watched as under `Auto` (for measuring the contention).
    Watch,
}

/// The device-wide state shared by every enqueueing thread of a device.
#[derive(Debug)]
pub struct DriverShare {
    /// kvoff threads inside a copy call now, and copy calls entered since the device was opened.
    inside: AtomicU32,
    entered: AtomicU64,
    /// Share of recent sampled calls that waited, of 1024 (exponentially weighted): by wall time
    /// against the thread's fastest calls, and by wall time beyond the thread's CPU time (a
    /// thread blocked on the driver's lock sleeps).
    contended: AtomicU32,
    blocked: AtomicU32,
    /// The blocked share over a longer window (1/256 per sample), of 1024, with [`SLOW_SHIFT`]
    /// fractional bits.
    slow_blocked: AtomicU32,
    /// The slow share polite needs (0: none; `CudaEngineConfig::polite_slow_share`).
    slow_min: AtomicU32,
    /// Share of the recent sampled calls' time spent off the CPU, of 1024 (exponentially
    /// weighted per call), for reports: it does not decide politeness (beside an eager model
    /// kvoff's long calls make the model's launches wait, not the other way round, so their
    /// blocked time stays low: docs/performance.md, "Transfers beside an eager model").
    blocked_time: AtomicU32,
    /// Polite until this time, µs since `epoch` (0: not polite).
    polite_until_us: AtomicU64,
    epoch: Instant,
    /// Copy calls made while polite, and in all (for reports and tests).
    polite_calls: AtomicU64,
    calls: AtomicU64,
    /// Sampled calls, and the blocked ones by time off the CPU (see `SubmitStats::driver_blocked`).
    sampled: AtomicU64,
    blocked_hist: [AtomicU64; BLOCKED_BUCKETS],
    /// Polite calls take turns through this gate, held from before a call to the end of its
    /// wait, where the duty is the device's (`CudaEngineConfig::polite_duty_device_wide`).
    gate: Mutex<()>,
    gate_wide: AtomicBool,
}

impl Default for DriverShare {
    fn default() -> Self {
        Self {
            inside: AtomicU32::new(0),
            entered: AtomicU64::new(0),
            contended: AtomicU32::new(0),
            blocked: AtomicU32::new(0),
            slow_blocked: AtomicU32::new(0),
            slow_min: AtomicU32::new(0),
            blocked_time: AtomicU32::new(0),
            polite_until_us: AtomicU64::new(0),
            epoch: Instant::now(),
            polite_calls: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            sampled: AtomicU64::new(0),
            blocked_hist: Default::default(),
            gate: Mutex::new(()),
            gate_wide: AtomicBool::new(true),
        }
    }
}

impl DriverShare {
    fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Whether the device is polite now: contention was seen within [`POLITE_HOLD`] and the slow
    /// share still holds.
    pub(super) fn polite_now(&self) -> bool {
        self.now_us() < self.polite_until_us.load(Relaxed)
            && self.slow_share() >= self.slow_min.load(Relaxed)
    }

    /// Sets the slow share polite needs (0: none).
    pub(super) fn set_slow_share(&self, min: u32) {
        self.slow_min.store(min.min(1024), Relaxed);
    }

    /// Sets whether the polite duty is the device's (polite calls take turns) or each thread's.
    pub(super) fn set_duty_device_wide(&self, wide: bool) {
        self.gate_wide.store(wide, Relaxed);
    }

    /// The blocked share over the longer window, of 1024.
    fn slow_share(&self) -> u32 {
        self.slow_blocked.load(Relaxed) >> SLOW_SHIFT
    }

    /// Counts one sampled call that spent `off_cpu_ns` off the CPU (for reports).
    fn count_blocked(&self, off_cpu_ns: u64) {
        self.sampled.fetch_add(1, Relaxed);
        if off_cpu_ns > BLOCKED_NS {
            let b = (off_cpu_ns / BLOCKED_NS).ilog2() as usize;
            self.blocked_hist[b.min(BLOCKED_BUCKETS - 1)].fetch_add(1, Relaxed);
        }
    }

    /// Sampled calls since the device was opened, and the blocked ones by time off the CPU.
    #[must_use]
    pub(super) fn blocked_histogram(&self) -> (u64, [u64; BLOCKED_BUCKETS]) {
        (
            self.sampled.load(Relaxed),
            std::array::from_fn(|i| self.blocked_hist[i].load(Relaxed)),
        )
    }

    /// Records one sampled call (`waited`: it waited for another thread's call; `blocked`: it
    /// slept meanwhile; `blocked_share`: the share of its time it spent off the CPU, of 1024).
    fn sample(&self, waited: bool, blocked: bool, blocked_share: u32) {
        ewma(&self.contended, waited);
        let cur = ewma(&self.blocked, blocked);
        ewma_fine(&self.blocked_time, blocked_share.min(1024));
        let slow = ewma_slow(&self.slow_blocked, blocked);
        if cur > CONTENDED_SHARE && slow >= self.slow_min.load(Relaxed) {
            let until = self
                .now_us()
                .saturating_add(u64::try_from(POLITE_HOLD.as_micros()).unwrap_or(u64::MAX));
            self.polite_until_us.fetch_max(until, Relaxed);
        }
    }

    /// Shares of recent sampled copy calls, of 1024, that waited for another thread's driver
    /// call: (by their wall time, by their wall time beyond their CPU time), and the share of
    /// their time spent off the CPU.
    #[must_use]
    pub(super) fn contention(&self) -> (u32, u32, u32) {
        (
            self.contended.load(Relaxed),
            self.blocked.load(Relaxed),
            self.blocked_time.load(Relaxed) >> EWMA_SHIFT,
        )
    }

    /// (calls made while polite, all governed calls) since the device was opened.
    #[cfg(test)]
    pub(super) fn polite_calls(&self) -> (u64, u64) {
        (self.polite_calls.load(Relaxed), self.calls.load(Relaxed))
    }
}

/// Adds `v` to the exponentially weighted value in `a` (weight 1/2^`shift` per sample:
/// `a ← a − a/2^shift + v`); returns the value before it.
fn ewma_add(a: &AtomicU32, shift: u32, v: u32) -> u32 {
    // The closure never returns None: both arms hold the previous value.
    match a.fetch_update(Relaxed, Relaxed, |c| Some(c - (c >> shift) + v)) {
        Ok(c) | Err(c) => c,
    }
}

/// Adds one sample `v` (of 1024) to an exponentially weighted share kept in units of
/// 1/(1024 << EWMA_SHIFT), so that samples below 1/32 still count; returns the share before it,
/// of 1024.
fn ewma_fine(a: &AtomicU32, v: u32) -> u32 {
    ewma_add(a, EWMA_SHIFT, v) >> EWMA_SHIFT
}

/// Adds one sample to the slow share (kept with [`SLOW_SHIFT`] fractional bits); returns the
/// share after it, of 1024.
fn ewma_slow(a: &AtomicU32, hit: bool) -> u32 {
    let add = if hit { 1024 } else { 0 };
    let before = ewma_add(a, SLOW_SHIFT, add);
    (before - (before >> SLOW_SHIFT) + add) >> SLOW_SHIFT
}

/// Adds one sample to an exponentially weighted share of 1024; returns the share before it.
fn ewma(a: &AtomicU32, hit: bool) -> u32 {
    ewma_add(a, EWMA_SHIFT, if hit { 1024 >> EWMA_SHIFT } else { 0 })
}

/// The per-thread memory of the governor: the fastest recent time per copy of a batched call,
/// ns (kept with the thread's pacing state across jobs).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct CallBase {
    ns_per_copy: Option<f64>,
}

impl CallBase {
    /// Whether a call of `copies` that took `ns` waited, and the base updated: it falls to a
    /// faster call at once and rises slowly (1/256 of the gap per call), so a change of machine
    /// load is followed without one slow call raising it.
    fn observe(&mut self, ns: f64, copies: usize) -> bool {
        #[allow(clippy::cast_precision_loss)] // copies per call: far below 2^52
        let n = copies.max(1) as f64;
        let per = ns / n;
        let Some(base) = self.ns_per_copy else {
            self.ns_per_copy = Some(per);
            return false;
        };
        let waited = ns > base * n * WAIT_FACTOR + WAIT_SLACK_NS;
        self.ns_per_copy = Some(if per < base {
            per
        } else {
            base + (per - base) / 256.0
        });
        waited
    }
}

/// One enqueueing thread's use of the device's [`DriverShare`] for one job.
pub(super) struct Governor<'a> {
    share: &'a DriverShare,
    mode: Polite,
    duty_pct: u32,
}

/// A copy call in progress ([`Governor::enter`]).
pub(super) struct Entry<'a> {
    start: Instant,
    cpu_ns: u64,
    /// Another kvoff thread was inside a copy call when this one started.
    others: bool,
    /// The device's count of entered calls, this one included.
    seq: u64,
    /// The device's polite gate, held until the call's wait ends ([`Governor::leave`]).
    turn: Option<MutexGuard<'a, ()>>,
}

impl<'a> Governor<'a> {
    pub(super) fn new(share: &'a DriverShare, mode: Polite, duty_pct: u32) -> Self {
        Self {
            share,
            mode,
            duty_pct,
        }
    }

    /// Whether this job's calls are polite now.
    pub(super) fn polite(&self) -> bool {
        match self.mode {
            Polite::Off | Polite::Watch => false,
            Polite::Always => true,
            Polite::Auto => self.share.polite_now(),
        }
    }

    /// Copies per batched call: `step`, or at most [`POLITE_BATCH`] while polite.
    pub(super) fn batch(&self, step: usize) -> usize {
        if self.polite() && (step == 0 || step > POLITE_BATCH) {
            POLITE_BATCH
        } else {
            step
        }
    }

    /// Before a copy call: while polite with the device's duty, first waits (outside the driver)
    /// for the other kvoff threads' polite calls and their waits to end.
    pub(super) fn enter(&self) -> Entry<'a> {
        let turn = (self.polite() && self.share.gate_wide.load(Relaxed)).then(|| {
            // A thread that panicked while holding the gate left nothing to repair.
            self.share
                .gate
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        });
        let others = self.share.inside.fetch_add(1, Relaxed) > 0;
        let seq = self.share.entered.fetch_add(1, Relaxed).wrapping_add(1);
        Entry {
            start: Instant::now(),
            cpu_ns: if matches!(self.mode, Polite::Auto | Polite::Watch) {
                thread_cpu_ns()
            } else {
                0
            },
            others,
            seq,
            turn,
        }
    }

    /// After the copy call `e` of `copies` batch entries (0: a pitched copy, not sampled): takes
    /// a sample under `Auto` (only when no other kvoff copy call overlapped it, so kvoff's own
    /// threads — the other direction's, the helper — are not taken for the model), and while
    /// polite (or holding the gate) waits outside the driver ([`Governor::gap`]), then lets the
    /// next thread's polite call in.
    pub(super) fn leave(&self, e: Entry<'_>, copies: usize, base: &mut CallBase) {
        let dt = e.start.elapsed();
        let overlapped = e.others || self.share.entered.load(Relaxed) != e.seq;
        self.share.inside.fetch_sub(1, Relaxed);
        if self.mode == Polite::Off {
            return;
        }
        self.share.calls.fetch_add(1, Relaxed);
        if matches!(self.mode, Polite::Auto | Polite::Watch) && copies > 0 {
            #[allow(clippy::cast_precision_loss)] // ns of one call: far below 2^52
            let waited = base.observe(dt.as_nanos() as f64, copies);
            let off_cpu = u64::try_from(dt.as_nanos())
                .unwrap_or(u64::MAX)
                .saturating_sub(thread_cpu_ns().saturating_sub(e.cpu_ns));
            if !overlapped {
                let total = u64::try_from(dt.as_nanos()).unwrap_or(u64::MAX).max(1);
                let share = u32::try_from(off_cpu.min(total) * 1024 / total).unwrap_or(1024);
                self.share.sample(waited, off_cpu > BLOCKED_NS, share);
                self.share.count_blocked(off_cpu);
            }
        }
        if self.polite() || e.turn.is_some() {
            self.share.polite_calls.fetch_add(1, Relaxed);
            wait_outside_driver(self.gap(dt));
        }
        drop(e.turn);
    }

    /// The wait after a call of `dt` that keeps the thread inside the driver at most `duty_pct`
    /// percent of the time (at least 10 µs, time for a waiting launch to take the driver).
    pub(super) fn gap(&self, dt: Duration) -> Duration {
        let duty = self.duty_pct.clamp(1, 100);
        (dt * (100 - duty) / duty).max(Duration::from_micros(10))
    }
}

/// Waits `d` without a driver call: sleeps for the part above the timer's slack (a sleep of a
/// few µs takes ~50 µs on Linux), spins the rest.
pub(super) fn wait_outside_driver(d: Duration) {
    let end = Instant::now() + d;
    let slack = Duration::from_micros(80);
    if let Some(sleep) = d.checked_sub(slack).filter(|s| !s.is_zero()) {
        std::thread::sleep(sleep);
    }
    while Instant::now() < end {
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests {
    use super::{
        CallBase, DriverShare, Governor, Polite, CONTENDED_SHARE, POLITE_BATCH,
        SLOW_CONTENDED_SHARE,
    };
    use std::time::Duration;

    #[test]
    fn base_falls_at_once_and_rises_slowly() {
        let mut b = CallBase::default();
        assert!(!b.observe(16_000.0, 16)); // first call sets the base: 1000 ns per copy
        assert!(!b.observe(17_000.0, 16)); // within 1.5x + 2 µs
        assert!(b.observe(40_000.0, 16)); // waited
        assert!(!b.observe(8_000.0, 16)); // faster: the base falls to 500 ns
        assert!(b.observe(16_000.0, 16)); // now 2x the base: waited
        let before = b.ns_per_copy.unwrap_or(0.0);
        assert!(before < 600.0, "{before}");
    }

    #[test]
    fn frequent_blocked_calls_make_the_device_polite_and_rare_ones_do_not() {
        let s = DriverShare::default();
        for i in 0..2000 {
            s.sample(true, i % 20 == 0, 0); // 5% blocked: below the threshold (100/1024 = 9.8%)
        }
        assert!(!s.polite_now());
        let (wall, blocked, _) = s.contention();
        assert!(wall > 900, "{wall}");
        assert!(blocked <= CONTENDED_SHARE, "{blocked}");
        for _ in 0..40 {
            s.sample(false, true, 1024);
        }
        assert!(s.polite_now());
    }

    /// Bursts of blocked calls among rare ones (the synthetic proxies' pattern: 1–3% on
    /// average) do not make the device polite; a steady 10% (an eager forward's, even while
    /// polite) does, and keeps it so.
    #[test]
    fn bursts_do_not_make_the_device_polite_a_steady_share_does() {
        let s = DriverShare::default();
        s.set_slow_share(SLOW_CONTENDED_SHARE);
        let mut fast = 0;
        for i in 0..4000 {
            // 2%: a burst of 6 blocked calls every 300.
            s.sample(false, i % 300 < 6, 0);
            assert!(!s.polite_now(), "call {i}: slow {}", s.slow_share());
            fast = fast.max(s.contention().1);
        }
        assert!(
            fast > CONTENDED_SHARE,
            "the fast share crossed in the bursts: {fast}"
        );
        for i in 0..4000 {
            s.sample(false, i % 10 == 0, 0); // 10%
        }
        assert!(s.polite_now(), "slow {}", s.slow_share());
    }

    #[test]
    fn blocked_calls_are_counted_by_time_off_the_cpu() {
        let s = DriverShare::default();
        for ns in [0, 2_999, 3_001, 5_999, 6_000, 100_000, 1_000_000_000] {
            s.count_blocked(ns);
        }
        let (n, h) = s.blocked_histogram();
        assert_eq!(n, 7);
        assert_eq!(h, [2, 1, 0, 0, 0, 1, 0, 1]);
    }

    #[test]
    fn the_blocked_time_share_is_kept_finely() {
        let s = DriverShare::default();
        for _ in 0..2000 {
            s.sample(true, true, 51); // each call blocked 5% of its time
        }
        let (_, blocked, time) = s.contention();
        assert!(
            blocked > CONTENDED_SHARE && (45..=55).contains(&time),
            "{blocked} {time}"
        );
    }

    #[test]
    fn polite_calls_are_short_and_spaced() {
        let s = DriverShare::default();
        let g = Governor::new(&s, Polite::Always, 50);
        assert_eq!(g.batch(64), POLITE_BATCH);
        assert_eq!(g.batch(0), POLITE_BATCH);
        assert_eq!(g.batch(8), 8);
        assert_eq!(g.gap(Duration::from_micros(20)), Duration::from_micros(20));
        assert_eq!(g.gap(Duration::from_micros(1)), Duration::from_micros(10));
        let g = Governor::new(&s, Polite::Off, 50);
        assert_eq!(g.batch(64), 64);
        let g = Governor::new(&s, Polite::Auto, 25);
        assert!(!g.polite());
        assert_eq!(g.gap(Duration::from_micros(20)), Duration::from_micros(60));
    }

    #[test]
    fn other_kvoff_threads_are_not_taken_for_the_model() {
        let s = DriverShare::default();
        let g = Governor::new(&s, Polite::Auto, 50);
        let mut base = CallBase::default();
        let outer = g.enter(); // another kvoff thread inside
        for _ in 0..200 {
            let e = g.enter();
            assert!(e.others);
            std::thread::sleep(Duration::from_micros(if base.ns_per_copy.is_some() {
                200
            } else {
                1
            }));
            g.leave(e, 16, &mut base);
        }
        g.leave(outer, 0, &mut base);
        assert!(!s.polite_now());
        assert_eq!(s.polite_calls(), (0, 201));
    }

    /// Two threads' polite calls (both directions' feeders) take turns, each call followed by
    /// its wait: together they hold the "driver" at most the duty's share of the time, as one
    /// thread alone would.
    #[test]
    fn polite_calls_of_two_threads_take_turns_under_the_device_duty() {
        use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
        const CALL: Duration = Duration::from_micros(300);
        const CALLS: u32 = 40;
        let s = DriverShare::default();
        let inside = AtomicU32::new(0);
        let overlaps = AtomicU32::new(0);
        let t0 = std::time::Instant::now();
        std::thread::scope(|sc| {
            for _ in 0..2 {
                sc.spawn(|| {
                    let g = Governor::new(&s, Polite::Always, 50);
                    let mut base = CallBase::default();
                    for _ in 0..CALLS {
                        let e = g.enter();
                        if inside.fetch_add(1, SeqCst) > 0 {
                            overlaps.fetch_add(1, SeqCst);
                        }
                        let end = std::time::Instant::now() + CALL;
                        while std::time::Instant::now() < end {
                            std::hint::spin_loop();
                        }
                        inside.fetch_sub(1, SeqCst);
                        g.leave(e, 16, &mut base);
                    }
                });
            }
        });
        let took = t0.elapsed();
        let busy = CALL * 2 * CALLS;
        assert_eq!(overlaps.load(SeqCst), 0, "polite calls overlapped");
        assert!(
            took >= busy * 2,
            "{took:?} for {busy:?} of calls at a 50% duty"
        );
        assert_eq!(s.polite_calls(), (80, 80));
        // With each thread's own duty (`dutywide=0`) the calls no longer wait for each other.
        s.set_duty_device_wide(false);
        let g = Governor::new(&s, Polite::Always, 50);
        let held = g.enter();
        let other = g.enter();
        assert!(other.turn.is_none() && held.turn.is_none());
    }
}
