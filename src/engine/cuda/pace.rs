//! The serving policy's cap on the staged pipeline's rate: what the model's device memory can
//! spare.
//!
//! Every byte the staged pipeline moves crosses the GPU's memory three times (the pack kernel
//! reads the KV page and writes the staging slot, the DMA reads the slot; loads the same in
//! reverse), where batched DMA crosses it once. Beside a model that runs at the memory's peak
//! that is what the model loses: measured on an H100 (3.35 TB/s peak; docs/performance.md,
//! 4 KiB pages, per-layer tensors, stores and loads at once, beside an add at the HBM's peak),
//! the kernel slowed by 0.12–0.14% per GB/s of staged traffic (+4.1…+5.0% at 33.6–36.9 GB/s,
//! +7.2% at 50.3), about 4.4 bytes of its memory traffic per staged byte. Beside a GEMM the same
//! traffic costs 0.05% per GB/s.
//!
//! So under the serving policy the staged pipeline of all engines of a device shares one rate
//! cap, weighted by [`STAGED_COST_BYTES`] against the device's peak memory bandwidth so that a
//! model at the memory's peak loses at most [`CAP_SHARE_OF_BUDGET`] of its memory-bound budget
//! (2.5 × `compute_budget`): 30.5 GB/s on an H100 with the default 2% budget (about 44 on an
//! H200 by its datasheet's 4.8 TB/s; not read on one).
//!
//! Pacing runs on the device timeline and costs the submitting thread nothing: before a staged
//! job the engine queues a host function (`cuLaunchHostFunc`) that reserves the job's bytes in
//! the device's token bucket when the stream reaches it and sleeps until its slot, so the job
//! starts no earlier than the cap allows. No SM is held while it waits, and `submit` still
//! returns at once. A host function costs the job its round trip through the driver's callback
//! thread (measured on an H100 beside a GEMM: per-chunk host functions took 8 MiB jobs from 11.0
//! to 5.4 GB/s, about 250 µs each), so there is one per job, and only while the device's staged
//! jobs arrive at [`PACE_FROM`] of the cap or more (an exponentially weighted rate of submitted
//! staged bytes, time constant [`RATE_TAU_NS`]): jobs well under the cap run as before.
//!
//! Caveats of the host function: the driver runs a context's host functions on its own thread,
//! so while one sleeps (for the reservations of both directions ahead of its job: a few ms at the
//! default cap, never beyond [`MAX_WAIT_NS`]) host functions that other code in the process queued
//! wait behind it; loads are paced too, so a load queued behind paced stores waits for its slot;
//! a stream being captured into a CUDA graph is not paced (a captured host function would run,
//! and free its ticket, at every replay); and after a sticky device error the driver may never
//! run it, leaving its ticket (a pointer and a number) unfreed.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::ffi;
use crate::error::Result;

/// Bytes of a memory-bound model's device-memory traffic one staged byte costs it (three passes,
/// fitted to 4.4 on an H100; see the module docs).
pub(super) const STAGED_COST_BYTES: f64 = 4.4;

/// Share of the memory-bound budget the cap aims at, leaving the rest for measurement noise and
/// for the DMA (one pass per byte) that runs beside the staged pipeline.
pub(super) const CAP_SHARE_OF_BUDGET: f64 = 0.8;

/// A memory-bound model sees about this multiple of the compute budget (the 2% for a
/// GEMM, 5% for a memory-bound kernel; the config's `compute_budget_bp` docs).
pub(super) const MEMORY_BOUND_FACTOR: f64 = 2.5;

/// Bytes the bucket lets through at once after an idle spell, as time at the cap: a short job
/// runs at full speed (the average rate is what costs the model).
const BURST_NS: u64 = 1_000_000;

/// Longest a single host function sleeps (a bound against a clock gone wrong or a cap far below
/// the job sizes); a wait cut to it also pulls the bucket back, so no debt builds up beyond it.
const MAX_WAIT_NS: u64 = 50_000_000;

/// Time constant of the submitted-rate estimate (a few staged jobs of a serving step).
pub(super) const RATE_TAU_NS: u64 = 20_000_000;

/// Jobs are paced once the submitted staged rate reaches this share of the cap.
pub(super) const PACE_FROM: f64 = 0.75;

/// The exponentially weighted rate (bytes/s) after `bytes` more arrive `dt_ns` after the last
/// update of `rate`: `rate · e^(−dt/τ) + bytes/τ`, sampled at arrivals. A steady stream of `r`
/// bytes/s whose jobs arrive `dt` apart reads `r · x / (1 − e^(−x))`, `x = dt/τ`: `r` for jobs
/// much closer than τ, more for sparser ones (1 GiB every 100 ms reads 5× its rate). The error
/// is on the side of pacing: a sparse job reads as near the cap, pays its host function, and waits
/// only if the bucket is truly behind.
#[must_use]
pub(super) fn decayed_rate(rate: f64, dt_ns: u64, tau_ns: u64, bytes: u64) -> f64 {
    #[allow(clippy::cast_precision_loss)] // ns and bytes far below 2^52 matter here
    let (dt, tau, b) = (dt_ns as f64, tau_ns.max(1) as f64, bytes as f64);
    rate * (-dt / tau).exp() + b / (tau / 1e9)
}

/// The staged-pipeline cap in MB/s for a compute budget of `budget_bp` basis points on a device
/// whose memory peaks at `peak_gbps` (0 when there is nothing to cap: no budget or no reading).
#[must_use]
pub(super) fn derived_cap_mb_s(budget_bp: u32, peak_gbps: Option<f64>) -> u32 {
    let Some(peak) = peak_gbps.filter(|p| p.is_finite() && *p > 0.0) else {
        return 0;
    };
    let mem_budget = f64::from(budget_bp) / 10_000.0 * MEMORY_BOUND_FACTOR;
    let gbps = peak * mem_budget * CAP_SHARE_OF_BUDGET / STAGED_COST_BYTES;
    // A budget so large the cap exceeds any link: no cap.
    if gbps >= 1000.0 {
        return 0;
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 0 ≤ MB/s < 1e6
    let mb = (gbps * 1000.0).round().max(1.0) as u32;
    mb
}

/// One token-bucket reservation: a job of `dur` ns at the cap, asked at `now`, with the bucket
/// next free at `next` (all ns on one clock). Returns (ns to wait, the bucket's new `next`).
/// After an idle spell the bucket holds up to `burst` ns of credit; a wait is cut to `max_wait`,
/// and the job's reservation then starts there (the bucket never runs more than `max_wait` ahead
/// of the clock plus one job).
#[must_use]
pub(super) fn reserve_slot(next: u64, now: u64, dur: u64, burst: u64, max_wait: u64) -> (u64, u64) {
    let start = next
        .max(now.saturating_sub(burst))
        .min(now.saturating_add(max_wait));
    (start.saturating_sub(now), start.saturating_add(dur))
}

/// The device's token bucket for the staged pipeline under the serving policy (shared by the
/// engines of both directions: they share the device memory).
#[derive(Debug)]
pub(super) struct StagedPacer {
    epoch: Instant,
    /// When the bucket is next free, ns since `epoch`.
    next_ns: AtomicU64,
    /// The submitted staged rate: (ns since `epoch` of the last update, bytes/s).
    submitted: Mutex<(u64, f64)>,
}

impl StagedPacer {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            epoch: Instant::now(),
            next_ns: AtomicU64::new(0),
            submitted: Mutex::new((0, 0.0)),
        })
    }

    /// Counts a staged job of `bytes` submitted under a cap of `cap_mb_s` (0: none) and says
    /// whether it is to be paced: the device's submitted staged rate, this job included, is at
    /// least [`PACE_FROM`] of the cap.
    pub(super) fn note_submit(&self, bytes: u64, cap_mb_s: u32) -> bool {
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        // A poisoned lock only means another thread panicked between two plain stores.
        let mut g = self
            .submitted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let rate = decayed_rate(g.1, now.saturating_sub(g.0), RATE_TAU_NS, bytes);
        *g = (now, rate);
        drop(g);
        cap_mb_s > 0 && rate >= PACE_FROM * f64::from(cap_mb_s) * 1e6
    }

    /// Reserves `dur_ns` of the bucket now; returns how long to wait before starting.
    fn reserve(&self, dur_ns: u64) -> u64 {
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let mut cur = self.next_ns.load(Ordering::Relaxed);
        loop {
            let (wait, next) = reserve_slot(cur, now, dur_ns, BURST_NS, MAX_WAIT_NS);
            match self.next_ns.compare_exchange_weak(
                cur,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return wait,
                Err(seen) => cur = seen,
            }
        }
    }

    /// Queues on `s` a wait that lets `bytes` start no earlier than `mb_s` MB/s allows (measured
    /// from this device's other paced chunks).
    ///
    /// # Safety
    /// 1. A live context is current; `s` is a live stream of it.
    pub(super) unsafe fn enqueue(
        self: &Arc<Self>,
        s: ffi::CUstream,
        bytes: u64,
        mb_s: u32,
    ) -> Result<()> {
        // SAFETY: obligation 1.
        if mb_s == 0 || bytes == 0 || unsafe { ffi::stream_capturing(s) } {
            return Ok(());
        }
        // bytes / (MB/s) = bytes × 1000 / mb_s ns.
        let dur_ns = bytes.saturating_mul(1000) / u64::from(mb_s);
        let ticket = Box::into_raw(Box::new(Ticket {
            pacer: Arc::clone(self),
            dur_ns,
        }));
        // SAFETY: obligation 1; `pace_host` makes no CUDA call, catches any unwind, and takes
        // over the ticket, which lives on the heap until then.
        let r = unsafe { ffi::launch_host_func(s, pace_host, ticket.cast::<c_void>()) };
        if r.is_err() {
            // Not queued: the function will not run, so the ticket is still ours.
            // SAFETY: `ticket` came from `Box::into_raw` above and was not handed over.
            drop(unsafe { Box::from_raw(ticket) });
        }
        r
    }
}

/// What one queued wait needs (owned by the host function once queued).
struct Ticket {
    pacer: Arc<StagedPacer>,
    dur_ns: u64,
}

/// The host function: reserve the chunk's time in the bucket, sleep until its slot.
unsafe extern "C" fn pace_host(user_data: *mut c_void) {
    // SAFETY: the driver passes back the pointer `enqueue` queued, once; it came from
    // `Box::into_raw` of a `Ticket` and nothing else frees it.
    let ticket = unsafe { Box::from_raw(user_data.cast::<Ticket>()) };
    // Nothing below panics (saturating arithmetic, Instant, sleep); an unwind would abort the
    // process at this boundary, so it is caught regardless.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let wait = ticket.pacer.reserve(ticket.dur_ns);
        if wait > 0 {
            std::thread::sleep(Duration::from_nanos(wait));
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::{decayed_rate, derived_cap_mb_s, reserve_slot, StagedPacer, RATE_TAU_NS};

    #[test]
    fn submitted_rate_tracks_a_steady_stream_and_decays() {
        // 128 MiB every 4 ms (33.6 GB/s) settles at that rate.
        let mut r = 0.0;
        for _ in 0..200 {
            r = decayed_rate(r, 4_000_000, RATE_TAU_NS, 128 << 20);
        }
        let steady = 134_217_728.0 / 4e-3;
        assert!((r / steady - 1.0).abs() < 0.15, "{r} vs {steady}");
        // After ten time constants of silence, nothing is left.
        let quiet = decayed_rate(r, 10 * RATE_TAU_NS, RATE_TAU_NS, 0);
        assert!(quiet < steady * 1e-4);
        // A lone job reads as its bytes over τ.
        assert!((decayed_rate(0.0, 0, RATE_TAU_NS, 20_000_000) - 1e9).abs() < 1.0);
    }

    #[test]
    fn only_jobs_near_the_cap_are_paced() {
        let p = StagedPacer::new();
        // One 8 MiB job: 0.42 GB/s over τ, far under a 30 GB/s cap.
        assert!(!p.note_submit(8 << 20, 30_000));
        // A burst of 128 MiB jobs well over the cap.
        let paced = (0..16).filter(|_| p.note_submit(128 << 20, 30_000)).count();
        assert!(paced >= 12, "{paced}");
        // No cap: never, however fast the jobs come.
        let q = StagedPacer::new();
        assert!((0..16).all(|_| !q.note_submit(128 << 20, 0)));
    }

    #[test]
    fn cap_follows_budget_and_memory_peak() {
        // H100 SXM (3352 GB/s), 2%: 3352 × 0.05 × 0.8 / 4.4 = 30.5 GB/s.
        assert_eq!(derived_cap_mb_s(200, Some(3352.0)), 30_473);
        // A 4800 GB/s device (an H200 by its datasheet): 43.6 GB/s.
        assert_eq!(derived_cap_mb_s(200, Some(4800.0)), 43_636);
        // Linear in the budget.
        assert_eq!(derived_cap_mb_s(100, Some(3352.0)), 15_236);
        // No reading, a zero or absurd peak, or a budget that caps nothing: 0 (no cap).
        assert_eq!(derived_cap_mb_s(200, None), 0);
        assert_eq!(derived_cap_mb_s(200, Some(0.0)), 0);
        assert_eq!(derived_cap_mb_s(200, Some(f64::NAN)), 0);
        assert_eq!(derived_cap_mb_s(u32::MAX, Some(3352.0)), 0);
        // A tiny budget still paces (at least 1 MB/s), never divides by zero.
        assert_eq!(derived_cap_mb_s(0, Some(3352.0)), 1);
    }

    #[test]
    fn bucket_spaces_chunks_at_the_cap() {
        let burst = 1_000;
        // Idle bucket: the first chunk starts at once, with `burst` of credit.
        let (w, next) = reserve_slot(0, 10_000, 500, burst, u64::MAX);
        assert_eq!((w, next), (0, 9_500));
        let (w, next) = reserve_slot(next, 10_000, 500, burst, u64::MAX);
        assert_eq!((w, next), (0, 10_000), "within the credit");
        let (w, next) = reserve_slot(next, 10_000, 500, burst, u64::MAX);
        assert_eq!((w, next), (0, 10_500));
        let (w, next) = reserve_slot(next, 10_000, 500, burst, u64::MAX);
        assert_eq!((w, next), (500, 11_000), "credit spent: wait for the slot");
        // Long idle: credit is bounded by `burst`, not by the idle time.
        let (w, next) = reserve_slot(next, 1_000_000, 5_000, burst, u64::MAX);
        assert_eq!((w, next), (0, 1_004_000));
        let (w, _) = reserve_slot(next, 1_000_000, 5_000, burst, u64::MAX);
        assert_eq!(w, 4_000);
        // A wait is cut to `max_wait`, and the bucket pulled back with it (no debt builds up).
        let (w, next) = reserve_slot(1_000_000, 0, 500_000, burst, 2_000);
        assert_eq!((w, next), (2_000, 502_000));
        // Saturates instead of wrapping.
        assert_eq!(
            reserve_slot(u64::MAX, u64::MAX - 5, 10, burst, u64::MAX),
            (5, u64::MAX)
        );
    }

    #[test]
    fn reservations_from_threads_never_overlap() {
        let p = StagedPacer::new();
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..50 {
                        let _ = p.reserve(100_000);
                    }
                });
            }
        });
        // 400 reservations of 0.1 ms each, none lost to a race: the bucket ends at least 40 ms
        // minus the 1 ms credit past its first reservation (all under the 50 ms bound on a
        // wait), and at most that bound plus one job past the clock.
        let next = p.next_ns.load(std::sync::atomic::Ordering::Relaxed);
        assert!(next >= 39_000_000, "{next}");
        let now = u64::try_from(p.epoch.elapsed().as_nanos()).unwrap();
        assert!(next <= now + 50_000_000 + 100_000, "{next} vs {now}");
    }
}
