//! Batched DMA (`cuMemcpyBatchAsync`, split so that no call holds the driver long) with pitched
//! runs (`cuMemcpy2DAsync`, see `pitched`), or a per-copy loop where the driver lacks the batch
//! API; the pacing of long jobs ([`Pace`]); and the parallel enqueue of `Auto`'s large DMA jobs.
//!
//! Why parallel: the driver spends about a microsecond of CPU per copy in `cuMemcpyBatchAsync`,
//! so one thread feeding 32 KiB copies keeps the copy engines at ~33 GB/s whatever the batch size
//! (measured on an H100: the submit's CPU time equals the job's device time). Two threads
//! enqueueing halves of the job on two streams reach 42–46 GB/s (BENCHMARKS.md). So a DMA job of
//! `Auto` with at least [`CudaEngineConfig::dma_split_min_copies`] copies is forked: the second
//! half goes to the engine's DMA helper thread, which enqueues it on an auxiliary stream (forked
//! from the engine's stream with an event and joined back before the job's end event), while the
//! caller enqueues the first half. `submit` returns once both halves are enqueued.
//!
//! [`CudaEngineConfig::dma_split_min_copies`]: super::CudaEngineConfig::dma_split_min_copies
// Unsafe: driver calls through `ffi` on handles this engine owns (each block says why it is sound).
#![allow(unsafe_code)]

use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use super::device::SendPtr;
use super::engine::CudaEngine;
use super::handles::{Event, Stream};
use super::pitched::Pitched;
use super::{ffi, CudaDevice};
use crate::error::{KvoffError, Result};
use crate::plan::CopyOp;

/// How long pacing waits for the device to finish one batch before the job fails (a device that
/// makes no progress for this long is hung; the submit returns an error instead of hanging).
const PACE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Pacing of long DMA jobs: the copies a job keeps queued on its stream are bounded, so that the
/// driver never waits inside a call for room in the stream's queue.
///
/// Measured on an H100 (BENCHMARKS.md, session 6): with 32768 copies of 4 KiB enqueued in calls
/// of 64, the calls after the first few thousand copies took 300–820 µs of CPU each where the
/// first took ~60: the driver spins inside the call until the device has drained enough of the
/// queue. Here an event is recorded after each batch call, and before the call `k` batches later
/// kvoff waits for it itself (polling `cuEventQuery`, then sleeping in short steps), outside the
/// driver, so that no call holds the driver longer than a batch of copies takes to describe.
#[derive(Default)]
pub(super) struct Pace {
    events: Vec<Event>,
}

impl Pace {
    /// Makes sure there are at least `k` events.
    ///
    /// # Safety
    /// The device's context is current on this thread.
    unsafe fn ensure(&mut self, k: usize) -> Result<()> {
        while self.events.len() < k {
            // SAFETY: the caller's obligation.
            self.events.push(unsafe { Event::new(false) }?);
        }
        Ok(())
    }

    /// Waits outside the driver until event `i` (recorded on a stream of the current context)
    /// has completed; the wait is added to the thread's call record.
    fn wait(&self, i: usize) -> Result<()> {
        let e = self
            .events
            .get(i)
            .ok_or_else(|| KvoffError::state("pacing event missing (a kvoff bug)"))?
            .raw();
        let t = std::time::Instant::now();
        let mut polls = 0u32;
        // SAFETY: a live event of this pace; a query has no effect on it.
        while !unsafe { ffi::event_done(e) }? {
            if t.elapsed() > PACE_TIMEOUT {
                return Err(KvoffError::state(format!(
                    "the device did not finish a batch of copies within {} s (hung?)",
                    PACE_TIMEOUT.as_secs()
                )));
            }
            polls += 1;
            if polls < 32 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
        }
        ffi::add_paced_ns(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
        Ok(())
    }

    /// Releases the events (their streams must have drained).
    pub(super) fn release(self) -> Vec<Result<()>> {
        self.events.into_iter().map(Event::release).collect()
    }
}

/// Pacing units of a pitched copy: one per 32 KiB it moves (a batch entry is one unit), so that
/// the bound keeps about as much work queued either way (512 units: 16 MiB, a few hundred µs of
/// the link, far more than kvoff needs to wake up).
pub(super) fn pitched_units(p: &Pitched) -> usize {
    let bytes = p.rows.saturating_mul(p.width);
    usize::try_from(bytes.div_ceil(32 << 10))
        .unwrap_or(usize::MAX)
        .max(1)
}

/// The work of one enqueue call that is still queued on its stream: an event after each
/// operation, waited for (outside the driver) before more than `bound` units would be queued.
struct Queue<'a> {
    pace: &'a mut Pace,
    s: ffi::CUstream,
    bound: usize,
    queued: usize,
    pending: std::collections::VecDeque<(usize, usize)>,
    free: Vec<usize>,
}

impl<'a> Queue<'a> {
    /// Pacing for a call of `total` units: off (`None`) when they all fit under the bound.
    fn new(pace: &'a mut Pace, s: ffi::CUstream, bound: usize, total: usize) -> Option<Self> {
        (bound > 0 && total > bound).then(|| Self {
            pace,
            s,
            bound,
            queued: 0,
            pending: std::collections::VecDeque::new(),
            free: Vec::new(),
        })
    }

    /// Waits until `units` more fit under the bound (or nothing of this call is queued).
    fn before(&mut self, units: usize) -> Result<()> {
        while self.queued.saturating_add(units) > self.bound {
            let Some((slot, u)) = self.pending.pop_front() else {
                break;
            };
            self.pace.wait(slot)?;
            self.queued -= u;
            self.free.push(slot);
        }
        Ok(())
    }

    /// Records that `units` were just enqueued.
    ///
    /// # Safety
    /// The context of the stream is current on this thread.
    unsafe fn after(&mut self, units: usize) -> Result<()> {
        let slot = if let Some(i) = self.free.pop() {
            i
        } else {
            let i = self.pace.events.len();
            // SAFETY: the caller's obligation.
            unsafe { self.pace.ensure(i + 1) }?;
            i
        };
        let e = self.pace.events.get(slot).map(Event::raw);
        let e = e.ok_or_else(|| KvoffError::state("pacing event missing (a kvoff bug)"))?;
        // SAFETY: a live event of this pace, not pending (its earlier recording was waited for, or
        // it is new); the stream is live (the caller's obligation).
        unsafe { ffi::event_record(e, self.s) }?;
        self.pending.push_back((slot, units));
        self.queued += units;
        Ok(())
    }
}

/// The bound of pitched runs ([`Limit`](super::pitched::Limit)) for a job of `direction`: its
/// device side stays in one allocation (asked of the driver once per allocation, then cached in
/// `ranges`); its host side is unbounded (kvoff's host memory is one region; a run the driver
/// refuses anyway goes as batch entries, see `enqueue_batches`).
pub(super) fn device_limit(
    ranges: &mut super::pitched::AllocRanges,
    direction: crate::plan::Direction,
) -> impl FnMut(u64, u64) -> (u64, u64) + '_ {
    let d2h = direction == crate::plan::Direction::GpuToCpu;
    move |src, dst| {
        let dev = if d2h { src } else { dst };
        // SAFETY: DMA is planned on the engine's thread after `submit` bound its context.
        let end = ranges.end_of(dev, |p| unsafe { ffi::device_alloc_range(p) });
        if d2h {
            (end, u64::MAX)
        } else {
            (u64::MAX, end)
        }
    }
}

/// Enqueues a job's DMA: its pitched runs (one `cuMemcpy2DAsync` each), then its other copies as
/// batched calls of at most `step` copies each (0: one call), keeping at most `max_queued` units
/// of this call queued at once (0: no bound; see [`Pace`], [`pitched_units`]).
///
/// # Safety
/// 1. `f` came from the device's batch entry point; every copy satisfies the contract of
///    `ffi::memcpy_batch` (memory validated by a plan, or owned by the engine, alive until the
///    job completes); `s` is a live stream of the context current on this thread.
unsafe fn enqueue_batches(
    f: ffi::MemcpyBatchFn,
    bufs: &mut DmaBufs,
    step: usize,
    host_to_device: bool,
    s: ffi::CUstream,
    pace: &mut Pace,
    max_queued: usize,
) -> Result<()> {
    let total = bufs.units();
    let mut q = Queue::new(pace, s, max_queued, total);
    // Pitched runs first; a run the driver refuses (a pitch over its limit on some device) goes
    // as batch entries instead.
    for r in std::mem::take(&mut bufs.pitched) {
        let u = pitched_units(&r);
        if let Some(q) = q.as_mut() {
            q.before(u)?;
        }
        // SAFETY: the rows are copies of the job (obligation 1), pitches ≥ width by construction.
        let ok = unsafe { ffi::memcpy_2d(r.dst, r.dpitch, r.src, r.spitch, r.width, r.rows, s) };
        match (ok, q.as_mut()) {
            (Err(_), _) => {
                for (src, dst, n) in r.rows() {
                    bufs.push(src, dst, n);
                }
            }
            // SAFETY: obligation 1 (the context is current).
            (Ok(()), Some(q)) => unsafe { q.after(u) }?,
            (Ok(()), None) => {}
        }
    }
    if bufs.sizes.is_empty() {
        return Ok(());
    }
    // Split so that no call holds the driver for long (32768 copies in one call take tens of ms
    // of CPU, stalling every other thread's launches meanwhile).
    let step = if step == 0 { bufs.sizes.len() } else { step };
    for ((d, sr), sz) in bufs
        .dsts
        .chunks_mut(step)
        .zip(bufs.srcs.chunks_mut(step))
        .zip(bufs.sizes.chunks_mut(step))
    {
        let u = sz.len();
        if let Some(q) = q.as_mut() {
            q.before(u)?;
        }
        // SAFETY: co-indexed arrays; the rest is this function's obligation 1.
        unsafe { ffi::memcpy_batch(f, d, sr, sz, host_to_device, s) }?;
        if let Some(q) = q.as_mut() {
            // SAFETY: obligation 1.
            unsafe { q.after(u) }?;
        }
    }
    Ok(())
}

/// Reused argument arrays of the batch call (sources, destinations, sizes) and the job's pitched
/// runs.
#[derive(Default)]
pub(super) struct DmaBufs {
    srcs: Vec<u64>,
    dsts: Vec<u64>,
    sizes: Vec<usize>,
    pitched: Vec<Pitched>,
    triples: Vec<(u64, u64, u64)>,
}

impl DmaBufs {
    /// Takes a job's copies: with `pitched`, the runs that form a regular grid become pitched
    /// copies (see `pitched`) and the rest batch entries.
    fn fill(
        &mut self,
        runs: impl Iterator<Item = (u64, u64, u64)>,
        pitched: bool,
        limit: super::pitched::Limit<'_>,
    ) {
        self.srcs.clear();
        self.dsts.clear();
        self.sizes.clear();
        self.pitched.clear();
        if pitched {
            let mut t = std::mem::take(&mut self.triples);
            t.clear();
            t.extend(runs);
            super::pitched::group(&mut t, &mut self.pitched, limit);
            for &(src, dst, n) in &t {
                self.push(src, dst, n);
            }
            self.triples = t;
        } else {
            for (src, dst, n) in runs {
                self.push(src, dst, n);
            }
        }
    }

    /// Pacing units of the job (see [`pitched_units`]).
    fn units(&self) -> usize {
        self.pitched
            .iter()
            .map(pitched_units)
            .fold(self.sizes.len(), usize::saturating_add)
    }

    fn push(&mut self, src: u64, dst: u64, n: u64) {
        self.srcs.push(src);
        self.dsts.push(dst);
        self.sizes.push(usize::try_from(n).unwrap_or(usize::MAX));
    }
}

/// One half-job for the helper thread.
struct Work {
    bufs: DmaBufs,
    pace: Pace,
    host_to_device: bool,
    stream: SendPtr<ffi::CUstream>,
    /// The job's end event, recorded after the last copy (the feeder), or none (the helper).
    end: Option<SendPtr<ffi::CUevent>>,
}

/// An enqueuing thread's answer: the enqueue result, its driver-call record, and the buffers
/// and pacing events back.
type Done = (Result<()>, ffi::CallRecord, DmaBufs, Pace);

/// Starts a thread named `name` that enqueues each [`Work`] it receives (paced at `bound`
/// units, in batch calls of `step`), records the work's end event if it has one (also after an
/// error, so the job completes), and answers with a [`Done`].
fn spawn_enqueuer(
    device: &Arc<CudaDevice>,
    name: &str,
    step: usize,
    bound: usize,
) -> Result<(Worker, mpsc::Receiver<Done>)> {
    let f = device
        .batch
        .ok_or_else(|| KvoffError::state("no batched copy entry point"))?;
    let (tx, work_rx) = mpsc::channel::<Work>();
    let (done_tx, rx) = mpsc::channel::<Done>();
    let dev = Arc::clone(device);
    let what = name.to_owned();
    let thread = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            while let Ok(mut w) = work_rx.recv() {
                let _ = ffi::take_call_record();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    dev.bind()?;
                    // SAFETY: the engine that sent the work keeps the job's memory alive until the
                    // job completes (its end event follows every copy: recorded below, or by the
                    // engine after this answer) and enqueues nothing that must follow this work
                    // before the answer; the stream is the engine's; the context was made current
                    // just above.
                    let r = unsafe {
                        enqueue_batches(
                            f,
                            &mut w.bufs,
                            step,
                            w.host_to_device,
                            w.stream.0,
                            &mut w.pace,
                            bound,
                        )
                    };
                    match &w.end {
                        // SAFETY: live event and stream of the current context.
                        Some(e) => r.and(unsafe { ffi::event_record(e.0, w.stream.0) }),
                        None => r,
                    }
                }))
                .unwrap_or_else(|_| Err(KvoffError::state(format!("the {what} thread panicked"))));
                if done_tx
                    .send((r, ffi::take_call_record(), w.bufs, w.pace))
                    .is_err()
                {
                    break;
                }
            }
        })
        .map_err(|e| KvoffError::state(format!("cannot start the {name} thread: {e}")))?;
    Ok((
        Worker {
            tx: Some(tx),
            thread: Some(thread),
        },
        rx,
    ))
}

/// The DMA helper of one engine: a thread that enqueues the second half of large DMA jobs on
/// its own stream, plus the fork/join events. Created on the first split job.
pub(super) struct DmaHelper {
    worker: Worker,
    rx: mpsc::Receiver<Done>,
    pub(super) aux: Stream,
    fork: Event,
    join: Event,
    spare: Option<DmaBufs>,
    /// The helper thread's pacing events (moved to the thread with each half-job and back).
    pace: Option<Pace>,
}

impl DmaHelper {
    /// Starts the helper thread and creates its stream and events.
    ///
    /// # Safety
    /// The device's context is current on this thread.
    unsafe fn new(
        device: &Arc<CudaDevice>,
        step: usize,
        max_queued: usize,
        high: bool,
    ) -> Result<Self> {
        // SAFETY: the caller's obligation. On an error below, what was created is dropped.
        let aux = unsafe { Stream::new(high) }?;
        // SAFETY: as above.
        let fork = unsafe { Event::new(false) }?;
        // SAFETY: as above.
        let join = unsafe { Event::new(false) }?;
        let (worker, rx) = spawn_enqueuer(device, "kvoff-dma", step, max_queued)?;
        Ok(Self {
            worker,
            rx,
            aux,
            fork,
            join,
            spare: Some(DmaBufs::default()),
            pace: Some(Pace::default()),
        })
    }

    /// Stops the thread and releases the stream and events (the stream must have drained);
    /// returns the driver's errors.
    pub(super) fn release(self) -> Vec<Result<()>> {
        drop(self.worker);
        let mut errs = self.pace.map(Pace::release).unwrap_or_default();
        errs.extend([self.fork.release(), self.join.release(), self.aux.release()]);
        errs
    }
}

/// The helper thread: closing its channel ends it; dropping joins it (it is idle then: the
/// engine waits for every answer before going on).
struct Worker {
    tx: Option<mpsc::Sender<Work>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the feeder did for the last job it fed (see [`CudaEngine::last_feed_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FeedStats {
    /// The job fed.
    pub job_id: i64,
    /// Driver calls the feeder made for it.
    pub driver_calls: u32,
    /// Its longest driver call, wall-clock ns.
    pub longest_call_ns: u64,
    /// Its most CPU-hungry driver call, thread CPU ns.
    pub longest_call_cpu_ns: u64,
    /// That call's driver entry point.
    pub longest_call: Option<&'static str>,
    /// Time the feeder waited outside the driver for queue room, ns.
    pub paced_ns: u64,
}

/// The feeder of one engine: a thread that enqueues the DMA of jobs too long to queue at once,
/// pacing them ([`Pace`]) so that `submit` returns at once — without it a paced `submit` blocks its
/// caller until most of the job has moved, and a store and a load submitted from one thread (as
/// vLLM's worker does) no longer overlap: measured on an H100, 32 KiB × 128 MiB pitched DMA both
/// ways at once fell from 73 to 37 GB/s idle. The engine's next submit, `wait` and `shutdown`
/// first collect the feed, so jobs stay in submission order on the stream.
pub(super) struct Feeder {
    worker: Worker,
    rx: mpsc::Receiver<Done>,
    /// The job being fed, if any.
    pub(super) busy: Option<i64>,
    spare: Option<(DmaBufs, Pace)>,
    pub(super) last: Option<FeedStats>,
}

impl Feeder {
    fn new(device: &Arc<CudaDevice>, step: usize, bound: usize) -> Result<Self> {
        let (worker, rx) = spawn_enqueuer(device, "kvoff-feed", step, bound)?;
        Ok(Self {
            worker,
            rx,
            busy: None,
            spare: Some((DmaBufs::default(), Pace::default())),
            last: None,
        })
    }

    /// Waits for the job being fed (if any); returns its id and enqueue result.
    pub(super) fn collect(&mut self) -> Option<(i64, Result<()>)> {
        let job_id = self.busy.take()?;
        Some((job_id, self.absorb(self.rx.recv().ok(), job_id)))
    }

    /// The job being fed, if it was fully enqueued (does not block).
    pub(super) fn try_collect(&mut self) -> Option<(i64, Result<()>)> {
        let job_id = self.busy?;
        match self.rx.try_recv() {
            Ok(d) => {
                self.busy = None;
                Some((job_id, self.absorb(Some(d), job_id)))
            }
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => {
                self.busy = None;
                Some((job_id, self.absorb(None, job_id)))
            }
        }
    }

    fn absorb(&mut self, d: Option<Done>, job_id: i64) -> Result<()> {
        let Some((r, calls, bufs, pace)) = d else {
            return Err(KvoffError::state("the DMA feeder thread stopped"));
        };
        self.spare = Some((bufs, pace));
        self.last = Some(FeedStats {
            job_id,
            driver_calls: calls.calls,
            longest_call_ns: calls.longest_ns,
            longest_call_cpu_ns: calls.longest_cpu_ns,
            longest_call: (!calls.longest_name.is_empty()).then_some(calls.longest_name),
            paced_ns: calls.paced_ns,
        });
        r
    }

    /// Stops the thread (idle: the engine collected every feed) and releases the pacing events.
    pub(super) fn release(mut self) -> Vec<Result<()>> {
        drop(std::mem::replace(
            &mut self.worker,
            Worker {
                tx: None,
                thread: None,
            },
        ));
        self.spare
            .take()
            .map(|(_, p)| p.release())
            .unwrap_or_default()
    }
}

impl CudaEngine {
    /// The DMA of a whole job on `s`: a job of more pacing units than
    /// [`CudaEngineConfig::max_queued_copies`] goes to the feeder thread, which also records the
    /// job's `end` event (then `Ok(true)`); else enqueued here (`Ok(false)`: the caller records it).
    ///
    /// [`CudaEngineConfig::max_queued_copies`]: super::CudaEngineConfig::max_queued_copies
    pub(super) fn dma_job(
        &mut self,
        copies: &[CopyOp],
        host_to_device: bool,
        s: ffi::CUstream,
        end: ffi::CUevent,
    ) -> Result<bool> {
        let bound = self.cfg.max_queued_copies;
        let Some(f) = self
            .device
            .batch
            .filter(|_| bound > 0 && self.cfg.dma_feeder)
        else {
            self.dma(
                copies.iter().map(|c| (c.src_ptr, c.dst_ptr, c.bytes)),
                host_to_device,
                self.job_group_pitched,
                s,
            )?;
            return Ok(false);
        };
        let mut bufs = std::mem::take(&mut self.scratch_dma);
        bufs.fill(
            copies.iter().map(|c| (c.src_ptr, c.dst_ptr, c.bytes)),
            self.job_group_pitched,
            &mut device_limit(&mut self.alloc_ranges, self.direction),
        );
        if bufs.units() <= bound {
            // Short enough to queue at once: enqueued here, unpaced.
            let mut p = std::mem::take(&mut self.pace);
            // SAFETY: memory validated by the plan, alive until the job completes; `s` is a
            // created stream; submit binds first.
            let r = unsafe {
                enqueue_batches(
                    f,
                    &mut bufs,
                    self.cfg.max_batch_copies,
                    host_to_device,
                    s,
                    &mut p,
                    bound,
                )
            };
            self.pace = p;
            self.scratch_dma = bufs;
            return r.map(|()| false);
        }
        if self.feeder.is_none() {
            self.feeder = Some(Feeder::new(&self.device, self.cfg.max_batch_copies, bound)?);
        }
        let fd = self
            .feeder
            .as_mut()
            .ok_or_else(|| KvoffError::state("DMA feeder missing"))?;
        let (spare, pace) = fd.spare.take().unwrap_or_default();
        self.scratch_dma = spare;
        let tx = fd
            .worker
            .tx
            .as_ref()
            .ok_or_else(|| KvoffError::state("the DMA feeder thread stopped"))?;
        tx.send(Work {
            bufs,
            pace,
            host_to_device,
            stream: SendPtr(s),
            end: Some(SendPtr(end)),
        })
        .map_err(|_| KvoffError::state("the DMA feeder thread stopped"))?;
        fd.busy = Some(self.submitting);
        Ok(true)
    }

    /// Batched DMA of `(src, dst, bytes)` triples on `s` (a per-copy loop without the batch API),
    /// grouping regular runs into pitched copies when `pitched`.
    pub(super) fn dma(
        &mut self,
        runs: impl Iterator<Item = (u64, u64, u64)> + Clone,
        host_to_device: bool,
        pitched: bool,
        s: ffi::CUstream,
    ) -> Result<()> {
        if let Some(f) = self.device.batch {
            let mut bufs = std::mem::take(&mut self.scratch_dma);
            let mut pace = std::mem::take(&mut self.pace);
            bufs.fill(
                runs,
                pitched,
                &mut device_limit(&mut self.alloc_ranges, self.direction),
            );
            // SAFETY: memory validated by the plan (or staging owned by this engine) and kept
            // alive until the job completes; `s` is a created stream; callers bind first.
            let r = unsafe {
                enqueue_batches(
                    f,
                    &mut bufs,
                    self.cfg.max_batch_copies,
                    host_to_device,
                    s,
                    &mut pace,
                    self.cfg.max_queued_copies,
                )
            };
            self.scratch_dma = bufs;
            self.pace = pace;
            r
        } else {
            for (src, dst, n) in runs {
                // SAFETY: as above.
                unsafe { ffi::memcpy_async(dst, src, n, s) }?;
            }
            Ok(())
        }
    }

    /// Whether a DMA job of `n` copies is enqueued by two threads on two streams.
    /// (Not when most of the job goes as pitched copies: those cost the CPU little. Nor beside a
    /// model while the other direction runs: the link beside the model, not one thread's driver
    /// calls, limits each direction there, and four DMA streams moved less than two — on an H100,
    /// 32 KiB × 128 MiB jobs both ways, per-layer tensors: 33.6 / 29.7 GB/s beside a GEMM / a
    /// memory-bound kernel split, 37.3 / 33.9 not; 36.2 / 30.8 against 37.9 / 42.7 in another run.)
    pub(super) fn splits_dma(&self, n: usize) -> bool {
        self.cfg.method == super::CopyMethod::Auto
            && self.cfg.dma_split_min_copies > 0
            && n >= self.cfg.dma_split_min_copies
            && self.device.batch.is_some()
            && !self.job_mostly_pitched(n)
            && !(self.job_serving && self.device.other_direction_active(self.direction))
    }

    /// Whether at least half of the job's `n` copies form pitched runs (in order) of at least
    /// [`CHOICE_MIN_RUN_BYTES`](super::pitched::CHOICE_MIN_RUN_BYTES) each.
    pub(super) fn job_mostly_pitched(&self, n: usize) -> bool {
        self.cfg.dma_pitched && n >= super::pitched::MIN_ROWS && 2 * self.job_pitched >= n
    }

    /// A DMA job enqueued in two halves at once: the second by the helper thread on its stream
    /// (forked from `s`, joined back into it, also after an error, so the job's end event covers
    /// both), the first by the caller on `s`.
    pub(super) fn dma_split(
        &mut self,
        copies: &[CopyOp],
        host_to_device: bool,
        s: ffi::CUstream,
    ) -> Result<()> {
        if self.dma_helper.is_none() {
            let high = self.direction == crate::plan::Direction::CpuToGpu && !self.cfg.serving();
            // SAFETY: the context is current (submit binds first).
            self.dma_helper = Some(unsafe {
                DmaHelper::new(
                    &self.device,
                    self.cfg.max_batch_copies,
                    self.cfg.max_queued_copies,
                    high,
                )
            }?);
        }
        let h = self
            .dma_helper
            .as_mut()
            .ok_or_else(|| KvoffError::state("DMA helper missing"))?;
        let (aux, fork, join) = (h.aux.raw(), h.fork.raw(), h.join.raw());
        let mut bufs = h.spare.take().unwrap_or_default();
        let pace = h.pace.take().unwrap_or_default();
        let half = copies.len() / 2;
        bufs.fill(
            copies[half..]
                .iter()
                .map(|c| (c.src_ptr, c.dst_ptr, c.bytes)),
            self.job_group_pitched,
            &mut device_limit(&mut self.alloc_ranges, self.direction),
        );
        // SAFETY: live handles of the current context.
        unsafe {
            ffi::event_record(fork, s)?;
            ffi::stream_wait(aux, fork)?;
        }
        let sent = h
            .worker
            .tx
            .as_ref()
            .ok_or_else(|| KvoffError::state("the DMA helper thread stopped"))?
            .send(Work {
                bufs,
                pace,
                host_to_device,
                stream: SendPtr(aux),
                end: None,
            })
            .map_err(|_| KvoffError::state("the DMA helper thread stopped"));
        let mine = sent.and_then(|()| {
            self.dma(
                copies[..half]
                    .iter()
                    .map(|c| (c.src_ptr, c.dst_ptr, c.bytes)),
                host_to_device,
                self.job_group_pitched,
                s,
            )
        });
        let h = self
            .dma_helper
            .as_mut()
            .ok_or_else(|| KvoffError::state("DMA helper missing"))?;
        // Wait for the helper's half (with the GIL released by the bindings): the join event
        // must follow everything it enqueued.
        let theirs = match h.rx.recv() {
            Ok((r, calls, bufs, pace)) => {
                h.spare = Some(bufs);
                h.pace = Some(pace);
                ffi::add_call_record(calls);
                r
            }
            Err(_) => Err(KvoffError::state("the DMA helper thread stopped")),
        };
        // SAFETY: live handles of the current context.
        let j = unsafe { ffi::event_record(join, aux).and_then(|()| ffi::stream_wait(s, join)) };
        mine.and(theirs).and(j)
    }
}
