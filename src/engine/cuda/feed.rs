//! The resources of batched DMA (the enqueue itself is `dma`): `cuMemcpyBatchAsync`, split so that no call holds the driver long) with pitched
//! runs (`cuMemcpy2DAsync`, see `pitched`), or a per-copy loop where the driver lacks the batch
//! API; the pacing of long jobs ([`Pace`]); and the parallel enqueue of `Auto`'s large DMA jobs.
//!
//! Why parallel: the driver spends about a microsecond of CPU per copy in `cuMemcpyBatchAsync`,
//! so one thread feeding 32 KiB copies keeps the copy engines at ~33 GB/s whatever the batch size
//! (measured on an H100: the submit's CPU time equals the job's device time). Two threads
//! enqueueing halves of the job on two streams reach 42–46 GB/s (docs/performance.md). So a DMA job of
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

use super::device::CudaDevice;
use super::ffi;
use super::handles::{Event, SendPtr, Stream};
use super::kernel::DESC_BYTES;
use super::pitched::Pitched;
use super::share::{CallBase, Governor, Polite};
use super::staged::StagedChunks;
use super::telemetry;
use crate::error::{KvoffError, Result};
use crate::plan::CopyPlan;

/// How long pacing waits for the device to finish one batch before the job fails (a device that
/// makes no progress for this long is hung; the submit returns an error instead of hanging).
const PACE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Pacing of long DMA jobs: the copies a job keeps queued on its stream are bounded, so that the
/// driver never waits inside a call for room in the stream's queue.
///
/// Measured on an H100 (docs/performance.md, "Hardware facts the code relies on"): with 32768 copies of 4 KiB enqueued in calls
/// of 64, the calls after the first few thousand copies took 300–820 µs of CPU each where the
/// first took ~60: the driver spins inside the call until the device has drained enough of the
/// queue. Here an event is recorded after each batch call, and before the call `k` batches later
/// kvoff waits for it itself (polling `cuEventQuery`, then sleeping in short steps), outside the
/// driver, so that no call holds the driver longer than a batch of copies takes to describe.
#[derive(Default)]
pub(super) struct Pace {
    events: Vec<Event>,
    /// The enqueueing thread's fastest recent batched calls (see `share`).
    base: CallBase,
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
            // Few queries in a row: each holds the driver, where another thread's launch may wait
            // (see `share`).
            if polls < 3 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
        }
        telemetry::add_paced_ns(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
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
#[allow(clippy::too_many_arguments)] // the job's copies, its stream and the thread's pacing state
pub(super) unsafe fn enqueue_batches(
    f: ffi::MemcpyBatchFn,
    bufs: &mut DmaBufs,
    step: usize,
    host_to_device: bool,
    s: ffi::CUstream,
    pace: &mut Pace,
    max_queued: usize,
    gov: &Governor<'_>,
) -> Result<()> {
    let total = bufs.units();
    let mut base = pace.base;
    let mut q = Queue::new(pace, s, max_queued, total);
    // Pitched runs first; a run the driver refuses (a pitch over its limit on some device) goes
    // as batch entries instead.
    for r in std::mem::take(&mut bufs.pitched) {
        let u = pitched_units(&r);
        if let Some(q) = q.as_mut() {
            q.before(u)?;
        }
        let e = gov.enter();
        // SAFETY: the rows are copies of the job (obligation 1), pitches ≥ width by construction.
        let ok = unsafe { ffi::memcpy_2d(r.dst, r.dpitch, r.src, r.spitch, r.width, r.rows, s) };
        gov.leave(e, 0, &mut base);
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
        if let Some(q) = q {
            q.pace.base = base;
        } else {
            pace.base = base;
        }
        return Ok(());
    }
    // Split so that no call holds the driver for long (32768 copies in one call take tens of ms
    // of CPU, stalling every other thread's launches meanwhile); shorter still while the device is
    // polite (`share`).
    let n = bufs.sizes.len();
    let mut i = 0;
    let mut r = Ok(());
    while i < n {
        let step = gov.batch(step);
        let j = if step == 0 { n } else { (i + step).min(n) };
        let u = j - i;
        if let Some(q) = q.as_mut() {
            if let Err(e) = q.before(u) {
                r = Err(e);
                break;
            }
        }
        let e = gov.enter();
        // SAFETY: co-indexed arrays; the rest is this function's obligation 1.
        let c = unsafe {
            ffi::memcpy_batch(
                f,
                &mut bufs.dsts[i..j],
                &mut bufs.srcs[i..j],
                &mut bufs.sizes[i..j],
                host_to_device,
                s,
            )
        };
        gov.leave(e, u, &mut base);
        if let Err(e) = c {
            r = Err(e);
            break;
        }
        if let Some(q) = q.as_mut() {
            // SAFETY: obligation 1.
            if let Err(e) = unsafe { q.after(u) } {
                r = Err(e);
                break;
            }
        }
        i = j;
    }
    if let Some(q) = q {
        q.pace.base = base;
    } else {
        pace.base = base;
    }
    r
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
    pub(super) fn fill(
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
    pub(super) fn units(&self) -> usize {
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
pub(super) struct Work {
    pub(super) bufs: DmaBufs,
    pub(super) pace: Pace,
    pub(super) host_to_device: bool,
    pub(super) stream: SendPtr<ffi::CUstream>,
    /// The job's end event, recorded after the last copy (the feeder), or none (the helper).
    pub(super) end: Option<SendPtr<ffi::CUevent>>,
    /// Whether the enqueueing thread's calls may turn polite, and its share of the driver then
    /// (see `share`).
    pub(super) polite: Polite,
    pub(super) duty_pct: u32,
    /// A staged job's chunks, enqueued instead of `bufs` (see [`StagedWork`]).
    pub(super) staged: Option<StagedWork>,
}

/// What the feeder needs to pack a staged job's chunks itself (see [`StagedChunks`]).
pub(super) struct StagedPack {
    /// The job's copies (shared with the engine's record of the job).
    pub(super) plan: Arc<CopyPlan>,
    /// The job's pinned descriptor buffer: host address, length in words, and the address the
    /// kernel reads it at (pinned memory is device-mapped).
    pub(super) words: SendPtr<*mut u64>,
    pub(super) n_words: usize,
    pub(super) desc_base: u64,
    /// Device addresses of the staging slots (each `cap` bytes), the job's first slot and chunks.
    pub(super) slots: Vec<u64>,
    pub(super) first_slot: usize,
    pub(super) n_chunks: usize,
    pub(super) cap: u64,
    /// Most CTAs of one chunk's kernel; whether the staging leg groups pitched runs.
    pub(super) ctas: u32,
    pub(super) pitched: bool,
}

/// A staged job for the feeder (docs/performance.md "How `auto` chooses a copy method", "The
/// cost of a submit"): the feeder packs each chunk and enqueues it at once, so the caller's
/// thread (in vLLM the model's) spends neither the packing nor a driver call or a polite wait on
/// them. The engine forked the auxiliary stream from the main one before handing the job over;
/// the feeder joins it back after the last chunk (also after an error, so the job's end event
/// covers both streams).
pub(super) struct StagedWork {
    pub(super) kernel: SendPtr<ffi::CUfunction>,
    pub(super) threads: u32,
    /// Device to host: each chunk's kernel gathers into staging before its DMA; else the DMA
    /// fills staging before the kernel scatters.
    pub(super) d2h: bool,
    pub(super) pack: StagedPack,
    pub(super) aux: SendPtr<ffi::CUstream>,
    pub(super) join: SendPtr<ffi::CUevent>,
}

/// Packs and enqueues `st`'s chunks in order (chunk `k` on the main stream for even slots, the
/// auxiliary one for odd), then joins the auxiliary stream back into `main`.
///
/// # Safety
/// As [`enqueue_batches`] for every chunk's runs; the job's descriptor buffer (`st.pack.words`,
/// `n_words` 8-byte words of pinned memory) is this job's alone until it completes and is
/// written by nothing else meanwhile; the copies' memory and the staging slots stay alive until
/// the job completes; the streams and the event are live handles of the current context.
unsafe fn enqueue_staged_work(
    f: ffi::MemcpyBatchFn,
    st: &mut StagedWork,
    main: ffi::CUstream,
    step: usize,
    pace: &mut Pace,
    bound: usize,
    gov: &Governor<'_>,
) -> Result<()> {
    let p = &st.pack;
    // SAFETY: the caller's obligation: the buffer is the job's alone, `n_words` long and
    // aligned; a chunk's kernel reads its descriptors only after they were written here (its
    // launch is enqueued afterwards).
    let words = unsafe { std::slice::from_raw_parts_mut(p.words.0, p.n_words) };
    let mut chunks = StagedChunks::new(
        p.plan.copies(),
        st.d2h,
        p.cap,
        &p.slots,
        p.first_slot,
        p.n_chunks,
    );
    let (mut runs, mut bufs) = (Vec::new(), DmaBufs::default());
    let warps = u64::from(st.threads / 32).max(1);
    let d2h = st.d2h;
    let r = (|| {
        while let Some(c) = chunks.next_chunk(words, &mut runs)? {
            let stream = if c.slot % 2 == 0 { main } else { st.aux.0 };
            // The staging side of a run lies in its slot, one allocation of `cap` bytes.
            let slot_end = p.slots.get(c.slot).map_or(0, |b| b.saturating_add(p.cap));
            bufs.fill(runs.iter().copied(), p.pitched, &mut |_, _| {
                if d2h {
                    (slot_end, u64::MAX)
                } else {
                    (u64::MAX, slot_end)
                }
            });
            let n_descs = c.n_descs as u64;
            let grid = u32::try_from(n_descs.div_ceil(warps).min(u64::from(p.ctas)))
                .unwrap_or(1)
                .max(1);
            let descs = p.desc_base + (c.first_desc * DESC_BYTES) as u64;
            // SAFETY: the caller's obligations (descriptors written above, slots and memory
            // alive).
            let launch = || unsafe {
                ffi::launch_copy(st.kernel.0, grid, st.threads, descs, n_descs, stream)
            };
            // SAFETY: as above.
            let mut dma =
                || unsafe { enqueue_batches(f, &mut bufs, step, !d2h, stream, pace, bound, gov) };
            if d2h {
                launch()?;
                dma()?;
            } else {
                dma()?;
                launch()?;
            }
        }
        Ok(())
    })();
    // SAFETY: live handles of the current context (the caller's obligation).
    let j = unsafe {
        ffi::event_record(st.join.0, st.aux.0).and_then(|()| ffi::stream_wait(main, st.join.0))
    };
    r.and(j)
}

/// An enqueuing thread's answer: the enqueue result, its driver-call record, and the buffers
/// and pacing events back.
type Done = (Result<()>, telemetry::CallRecord, DmaBufs, Pace);

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
            crate::affinity::place_current_thread();
            while let Ok(mut w) = work_rx.recv() {
                let _ = telemetry::take_call_record();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    dev.bind()?;
                    // SAFETY: the engine that sent the work keeps the job's memory alive until the
                    // job completes (its end event follows every copy: recorded below, or by the
                    // engine after this answer) and enqueues nothing that must follow this work
                    // before the answer; the stream is the engine's; the context was made current
                    // just above.
                    let gov = Governor::new(&dev.driver, w.polite, w.duty_pct);
                    let r = match w.staged.as_mut() {
                        // SAFETY: as above; the engine keeps the staged job's descriptor buffer
                        // and staging slots until the job completes.
                        Some(st) => unsafe {
                            enqueue_staged_work(f, st, w.stream.0, step, &mut w.pace, bound, &gov)
                        },
                        // SAFETY: as above.
                        None => unsafe {
                            enqueue_batches(
                                f,
                                &mut w.bufs,
                                step,
                                w.host_to_device,
                                w.stream.0,
                                &mut w.pace,
                                bound,
                                &gov,
                            )
                        },
                    };
                    match &w.end {
                        // SAFETY: live event and stream of the current context.
                        Some(e) => r.and(unsafe { ffi::event_record(e.0, w.stream.0) }),
                        None => r,
                    }
                }))
                .unwrap_or_else(|_| Err(KvoffError::state(format!("the {what} thread panicked"))));
                if done_tx
                    .send((r, telemetry::take_call_record(), w.bufs, w.pace))
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
    pub(super) worker: Worker,
    pub(super) rx: mpsc::Receiver<Done>,
    pub(super) aux: Stream,
    pub(super) fork: Event,
    pub(super) join: Event,
    pub(super) spare: Option<DmaBufs>,
    /// The helper thread's pacing events (moved to the thread with each half-job and back).
    pub(super) pace: Option<Pace>,
}

impl DmaHelper {
    /// Starts the helper thread and creates its stream and events.
    ///
    /// # Safety
    /// The device's context is current on this thread.
    pub(super) unsafe fn new(
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
pub(super) struct Worker {
    pub(super) tx: Option<mpsc::Sender<Work>>,
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
    pub(super) worker: Worker,
    pub(super) rx: mpsc::Receiver<Done>,
    /// The job being fed, if any.
    pub(super) busy: Option<i64>,
    pub(super) spare: Option<(DmaBufs, Pace)>,
    pub(super) last: Option<FeedStats>,
}

impl Feeder {
    pub(super) fn new(device: &Arc<CudaDevice>, step: usize, bound: usize) -> Result<Self> {
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
