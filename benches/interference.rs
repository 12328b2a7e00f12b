//! Transfers beside compute, in Rust (the native twin of `kvoff bench interference`): what kvoff's
//! copies cost a model that shares the GPU, and what they move meanwhile. No Python, so the launch
//! latency probe measures the driver, not a GIL.
//!
//! Per cell (page size × job size × directions × method): kvoff jobs loop on a transfer thread
//! (random distinct blocks of 64 KV tensors, kvoff's block-major pinned host layout) while the
//! main thread runs a compute proxy on its own stream — a cuBLAS bf16 8192³ GEMM loop, then a
//! memory-bound 1 GiB device-to-device copy loop (the driver runs it as a kernel on the SMs at the
//! HBM's peak, 3.0 TB/s counting reads and writes on an H100, like a `torch.add` over the same
//! bytes: `scripts/probe/mem_proxy.py`). The model's thread keeps at most ~20 ms of its work queued,
//! as a serving engine does (a second of GEMMs queued at once fills the driver's launch queue and
//! the model's thread then waits inside the driver, where every other thread's calls on that
//! stream wait behind it: kvoff's look at the model's stream took up to 375 ms). Each proxy is timed alone and beside the
//! transfers in bracketed rounds, A B A B … A (its slowdown: the median over rounds of beside /
//! the mean of the two alone rounds around it, − 1, so that the proxy's drift over the cell —
//! clocks, power, heat: a few percent, as much as the budget — cancels; `drift%` shows it, last
//! alone round / first − 1, GEMM / memory-bound). Also per cell: GB/s idle and beside each proxy,
//! the SMs kvoff's kernels may occupy and its longest driver call per submit (`SubmitStats`: p99
//! and max over the cell's submits of the wall-clock time, p99 and max of the thread CPU time, and
//! the entry point of the max), a control for those (`noise`: the most thread CPU time that a
//! fixed ~10 µs piece of arithmetic took beyond its median on another thread meanwhile — time the
//! machine took the vCPU away, which a driver call suffers too), the wall time of a tiny
//! kernel launch by a third thread every 200 µs while kvoff submits (against the same probe with
//! kvoff idle), the share of jobs `Auto` ran with its serving policy (`srv%`, idle / beside
//! compute: the engines watch the compute stream), and a byte-exact store → load round trip with
//! GEMMs queued.
//!
//! `cargo bench --bench interference` (skips without a GPU). cuBLAS is loaded at run time
//! (`libcublas.so.13`): put torch's `nvidia/cu13/lib` (or a CUDA toolkit's lib64) on
//! `LD_LIBRARY_PATH`; without it the GEMM proxy is skipped, saying so. Environment:
//! `KVOFF_BENCH_PAGES` (KiB, default `4,32`), `KVOFF_BENCH_JOBS` (MiB, default `8,128`),
//! `KVOFF_BENCH_DIRS` (`store,load,both`; default `store,both`), `KVOFF_BENCH_METHODS` (default
//! `dma,dma2d,kernel,staged,auto-idle,auto-serve,auto`; also `dma2d-lowload` and `auto-hiload`,
//! the two with the other load stream priority, and `auto-nocap`, `auto` without the staged cap), `KVOFF_BENCH_SECONDS` (per transfer phase and memory-bound round, default 0.3),
//! `KVOFF_BENCH_ROUNDS` (default 3), `KVOFF_BENCH_PREHEAT` (seconds of GEMMs before each
//! cell's GEMM rounds, default 1.5: the GPU's power controller settles), `KVOFF_BENCH_QUICK=1` (one small cell),
//! `KVOFF_BENCH_GEMM_SECONDS` (per GEMM round, default 1.0: the GEMM's power-capped clock
//! oscillates with a period of about a second), `KVOFF_BENCH_MEM_PROXY=scopy` (the memory-bound
//! proxy as cuBLAS `Scopy` of 1 GiB, a kernel at about 77% of the HBM's peak: beside it pitched DMA
//! of 4 KiB pages keeps its idle rate, beside the copy at the peak it loses about 40%), `KVOFF_BENCH_VERBOSE=1` (every round's times
//! on stderr), `KVOFF_BENCH_LAYOUT=perlayer` (one device allocation per KV tensor, as vLLM's
//! per-layer tensors; the driver refuses pitched copies across allocations, so no pitched run
//! spans two tensors). The default grid (56 cells) takes about 12 minutes on an H100 with 1 s GEMM rounds;
//! the 32-row grid of BENCHMARKS.md's "Transfers beside compute" (four methods) took 7.
// Benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(clippy::unwrap_used, clippy::pedantic)]
// Unsafe: raw driver and cuBLAS calls on buffers and streams this file owns, and kvoff submits
// over memory it keeps alive.
#![allow(unsafe_code)]
#![allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
#![cfg_attr(not(feature = "cuda"), allow(unused))]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(feature = "cuda")]
use kvoff::engine::cuda::{
    cuda_available, CopyMethod, CudaDevice, CudaEngine, CudaEngineConfig, CudaStream, DeviceBuffer,
    PinnedBuffer,
};
use kvoff::engine::{Job, TransferEngine};
use kvoff::plan::{CopyOp, CopyPlan, Direction};

const TENSORS: u64 = 64;

fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_owned())
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
}

/// A proxy's slowdown from bracketed rounds: `alone` has one more round than `beside`, and beside
/// round `i` ran between alone rounds `i` and `i + 1`; the median over rounds of beside / the mean
/// of its neighbours, − 1.
fn bracketed(alone: &[f64], beside: &[f64]) -> f64 {
    let r: Vec<f64> = beside
        .iter()
        .zip(alone.windows(2))
        .map(|(b, a)| b / ((a[0] + a[1]) / 2.0))
        .collect();
    median(&r) - 1.0
}

fn pct(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(((q * s.len() as f64) as usize).min(s.len().saturating_sub(1)))
        .copied()
        .unwrap_or(f64::NAN)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// `k` distinct values of `base..base + n`.
    fn distinct(&mut self, base: u64, n: u64, k: usize) -> Vec<u64> {
        let mut v: Vec<u64> = (0..n).collect();
        for i in 0..k {
            let j = i as u64 + self.next() % (n - i as u64);
            v.swap(i, j as usize);
        }
        v.truncate(k);
        v.into_iter().map(|x| x + base).collect()
    }
}

/// The method column: a label and the engine settings.
fn method_cfg(label: &str) -> Option<CudaEngineConfig> {
    let d = CudaEngineConfig::default();
    Some(match label {
        // Plain batched DMA, one batch entry per page (how vLLM moves blocks): the baseline.
        "dma" => CudaEngineConfig {
            method: CopyMethod::Dma,
            dma_pitched: false,
            ..d
        },
        // kvoff's DMA: regular runs of pages as pitched copies.
        "dma2d" => CudaEngineConfig {
            method: CopyMethod::Dma,
            ..d
        },
        // The same with loads on the lowest-priority stream, as `auto` has them beside a model
        // (does the priority move DMA? docs/performance.md, "Stream priority": it does not).
        "dma2d-lowload" => CudaEngineConfig {
            method: CopyMethod::Dma,
            load_high_priority: Some(false),
            ..d
        },
        // `auto` with loads on the highest-priority stream.
        "auto-hiload" => CudaEngineConfig {
            compute_budget_bp: Some(200),
            load_high_priority: Some(true),
            ..d
        },
        "kernel" => CudaEngineConfig {
            method: CopyMethod::Kernel,
            ..d
        },
        "staged" => CudaEngineConfig {
            method: CopyMethod::Staged,
            ..d
        },
        "auto-idle" => d,
        // What the Python handlers and the vLLM plug-in use by default: a 2% budget (the serving
        // policy while the model is seen computing, the idle-GPU policy otherwise).
        "auto" => CudaEngineConfig {
            compute_budget_bp: Some(200),
            ..d
        },
        // The serving policy on every job, idle GPU or not.
        "auto-serve" => CudaEngineConfig {
            compute_budget_bp: Some(200),
            idle_after_us: 0,
            ..d
        },
        // `auto` without the serving policy's cap on the staged pipeline (the default before the
        // cap; docs/performance.md, "Serving policy").
        "auto-nocap" => CudaEngineConfig {
            compute_budget_bp: Some(200),
            serving_staged_cap_mb_s: Some(0),
            ..d
        },
        // The serving policy with large small-copy stores by DMA while loads run (the former
        // default; docs/performance.md, "Serving policy").
        "auto-stdma" => CudaEngineConfig {
            compute_budget_bp: Some(200),
            serving_store_dma_beside_loads: true,
            ..d
        },
        _ => return None,
    })
}

/// cuBLAS, loaded at run time.
#[cfg(feature = "cuda")]
struct Gemm {
    handle: cudarc::cublas::sys::cublasHandle_t,
    a: DeviceBuffer,
    b: DeviceBuffer,
    c: DeviceBuffer,
}

#[cfg(feature = "cuda")]
impl Gemm {
    const N: i32 = 8192;

    fn new(dev: &Arc<CudaDevice>, stream: &CudaStream) -> Option<Self> {
        use cudarc::cublas::sys as cb;
        // SAFETY: only tries to dlopen the library.
        if !unsafe { cb::is_culib_present() } {
            eprintln!(
                "interference: cuBLAS (libcublas.so.13) not found: put torch's nvidia/cu13/lib on \
                 LD_LIBRARY_PATH; the GEMM proxy is skipped"
            );
            return None;
        }
        let bytes = (Self::N as usize).pow(2) * 2;
        let (a, b, c) = (
            DeviceBuffer::new(dev, bytes).unwrap(),
            DeviceBuffer::new(dev, bytes).unwrap(),
            DeviceBuffer::new(dev, bytes).unwrap(),
        );
        // Small random bf16 values (any bytes with a zero exponent top bit are finite).
        let mut host = vec![0u8; bytes];
        let mut r = Rng(7);
        for p in host.chunks_exact_mut(2) {
            let v = 0x3c00u16 | (r.next() as u16 & 0x00ff);
            p.copy_from_slice(&v.to_le_bytes());
        }
        a.write(0, &host).unwrap();
        b.write(0, &host).unwrap();
        let mut handle = std::ptr::null_mut();
        // SAFETY: the device's context is current on this thread (create_stream bound it).
        unsafe {
            assert_eq!(
                cb::cublasCreate_v2(&mut handle),
                cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            );
            assert_eq!(
                cb::cublasSetStream_v2(handle, stream.handle() as cb::cudaStream_t),
                cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            );
        }
        Some(Self { handle, a, b, c })
    }

    fn enqueue(&self) {
        use cudarc::cublas::sys as cb;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: three live 8192² bf16 buffers; the handle's stream is live.
        let st = unsafe {
            cb::cublasGemmEx(
                self.handle,
                cb::cublasOperation_t::CUBLAS_OP_N,
                cb::cublasOperation_t::CUBLAS_OP_N,
                Self::N,
                Self::N,
                Self::N,
                (&alpha as *const f32).cast(),
                self.a.ptr() as *const _,
                cb::cudaDataType::CUDA_R_16BF,
                Self::N,
                self.b.ptr() as *const _,
                cb::cudaDataType::CUDA_R_16BF,
                Self::N,
                (&beta as *const f32).cast(),
                self.c.ptr() as *mut _,
                cb::cudaDataType::CUDA_R_16BF,
                Self::N,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        assert_eq!(st, cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS);
    }
}

/// The compute proxies on one stream of the main thread.
#[cfg(feature = "cuda")]
struct Compute {
    stream: CudaStream,
    gemm: Option<Gemm>,
    x: DeviceBuffer,
    y: DeviceBuffer,
    n: [usize; 2],
    /// The memory-bound proxy as cuBLAS `Scopy` (`KVOFF_BENCH_MEM_PROXY=scopy`) instead of the
    /// driver's device-to-device copy.
    sm_mem: bool,
    /// Ops per ~5 ms chunk of `run` (1 until measured).
    chunk: [usize; 2],
    /// Events bounding `run`'s queue (made on first use, kept for the run).
    marks: Vec<cudarc::driver::sys::CUevent>,
}

#[cfg(feature = "cuda")]
impl Compute {
    fn op(&self, kind: usize) {
        if kind == 0 {
            self.gemm.as_ref().unwrap().enqueue();
        } else {
            if self.sm_mem {
                use cudarc::cublas::sys as cb;
                let g = self.gemm.as_ref().unwrap();
                // SAFETY: two live 1 GiB device buffers (2^28 f32 each); the handle's stream is
                // this stream.
                let st = unsafe {
                    cb::cublasScopy_v2(
                        g.handle,
                        1 << 28,
                        self.x.ptr() as *const f32,
                        1,
                        self.y.ptr() as *mut f32,
                        1,
                    )
                };
                assert_eq!(st, cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS);
                return;
            }
            // SAFETY: two live 1 GiB device buffers; the stream is live; the context is current.
            let r = unsafe {
                cudarc::driver::sys::cuMemcpyDtoDAsync_v2(
                    self.y.ptr(),
                    self.x.ptr(),
                    self.x.len(),
                    self.stream.handle() as cudarc::driver::sys::CUstream,
                )
            };
            assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
        }
    }
    /// Milliseconds per op of `n` back-to-back ops, at most `DEPTH` chunks of ~5 ms queued at once
    /// (the thread sleeps on an event meanwhile, as a serving engine's thread waits on its step).
    fn run(&mut self, kind: usize, n: usize) -> f64 {
        use cudarc::driver::sys as d;
        const DEPTH: usize = 4;
        self.stream.synchronize().unwrap();
        if self.marks.is_empty() {
            for _ in 0..DEPTH {
                let mut e = std::ptr::null_mut();
                // SAFETY: an out-pointer; the device's context is current on this thread.
                let r = unsafe {
                    d::cuEventCreate(
                        &mut e,
                        d::CUevent_flags_enum::CU_EVENT_BLOCKING_SYNC as u32
                            | d::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32,
                    )
                };
                assert_eq!(r, d::CUresult::CUDA_SUCCESS);
                self.marks.push(e);
            }
        }
        let chunk = self.chunk[kind].max(1);
        let t = Instant::now();
        for i in 0..n {
            self.op(kind);
            if (i + 1) % chunk == 0 {
                let e = self.marks[((i + 1) / chunk) % DEPTH];
                // SAFETY: a live event of this context; waiting for its previous recording (DEPTH
                // chunks ago) before recording it again bounds the queue; the stream is live.
                unsafe {
                    assert_eq!(d::cuEventSynchronize(e), d::CUresult::CUDA_SUCCESS);
                    let r = d::cuEventRecord(e, self.stream.handle() as d::CUstream);
                    assert_eq!(r, d::CUresult::CUDA_SUCCESS);
                }
            }
        }
        self.stream.synchronize().unwrap();
        t.elapsed().as_secs_f64() * 1e3 / n as f64
    }
}

/// Percentage of jobs run with the serving policy, or "-" when no job chose by policy.
#[cfg(feature = "cuda")]
fn share(serving: u64, idle: u64) -> String {
    if serving + idle == 0 {
        "-".into()
    } else {
        format!("{:.0}", 100.0 * serving as f64 / (serving + idle) as f64)
    }
}

/// A short name for a driver entry point (the benchmark's `by` column).
fn short_call(name: &str) -> &str {
    match name {
        "cuMemcpyBatchAsync" => "batch",
        "cuLaunchKernel" => "launch",
        "cuEventRecord" => "record",
        "cuStreamWaitEvent" => "wait",
        "cuStreamQuery" | "cuStreamIsCapturing" => "query",
        "cuMemcpyHtoDAsync" => "htod",
        "cuMemcpyAsync" => "memcpy",
        other => other,
    }
}

/// What one phase of transfers did.
#[derive(Default)]
struct Moved {
    gb_s: f64,
    failed: u64,
    sms: u32,
    /// Per submit: its longest driver call, wall-clock and thread CPU µs.
    calls: Vec<(f64, f64)>,
    /// The driver call with the most CPU time of the phase (µs, entry point).
    worst: (f64, &'static str),
    /// Time the submits waited outside the driver for queue room (pacing), µs.
    paced_us: f64,
    /// Jobs that `Auto` ran with its serving policy / with its idle-GPU policy.
    serving: u64,
    idle: u64,
    /// Jobs run staged / in all (beside compute: which method the feedback kept).
    staged: u64,
    jobs: u64,
}

/// One cell's buffers: GPU KV (tensors × blocks × page: one allocation, or one per tensor with
/// `KVOFF_BENCH_LAYOUT=perlayer`) and pinned host rows.
#[cfg(feature = "cuda")]
struct Cell {
    gpu: Vec<DeviceBuffer>,
    host: PinnedBuffer,
    page: u64,
    blocks: u64,
    ngpu: u64,
    ncpu: u64,
}

#[cfg(feature = "cuda")]
impl Cell {
    /// Tensor `t`'s GPU block `g`: (its buffer, byte offset in it).
    fn at(&self, t: u64, g: u64) -> (usize, u64) {
        if self.gpu.len() == 1 {
            (0, (t * self.ngpu + g) * self.page)
        } else {
            (t as usize, g * self.page)
        }
    }

    fn copies(&self, dir: Direction, g: &[u64], c: &[u64]) -> Vec<CopyOp> {
        let mut v = Vec::with_capacity(g.len() * TENSORS as usize);
        for (&g, &c) in g.iter().zip(c) {
            for t in 0..TENSORS {
                let (b, off) = self.at(t, g);
                let gp = self.gpu[b].ptr() + off;
                let hp = self.host.ptr() + (c * TENSORS + t) * self.page;
                let (src_ptr, dst_ptr) = match dir {
                    Direction::GpuToCpu => (gp, hp),
                    Direction::CpuToGpu => (hp, gp),
                };
                v.push(CopyOp {
                    src_ptr,
                    dst_ptr,
                    bytes: self.page,
                });
            }
        }
        v
    }

    /// Loops jobs (stores from/to the first halves, loads into the second halves) until `stop`.
    fn transfer_loop(
        &self,
        engines: &mut [CudaEngine; 2],
        dirs: &str,
        stop: &AtomicBool,
        rng: &mut Rng,
    ) -> Moved {
        let (mut bytes, mut m, mut job) = (0u64, Moved::default(), 0i64);
        let t = Instant::now();
        let (hg, hc) = (self.ngpu / 2, self.ncpu / 2);
        while !stop.load(Ordering::Relaxed) {
            let mut ids = Vec::new();
            for (i, dir) in [Direction::GpuToCpu, Direction::CpuToGpu]
                .into_iter()
                .enumerate()
            {
                let on = match dir {
                    Direction::GpuToCpu => dirs != "load",
                    Direction::CpuToGpu => dirs != "store",
                };
                if !on {
                    continue;
                }
                let (g, c) = match dir {
                    Direction::GpuToCpu => (
                        rng.distinct(0, hg, self.blocks as usize),
                        rng.distinct(0, hc, self.blocks as usize),
                    ),
                    Direction::CpuToGpu => (
                        rng.distinct(hg, hg, self.blocks as usize),
                        rng.distinct(hc, hc, self.blocks as usize),
                    ),
                };
                let plan = CopyPlan::from_copies(dir, self.copies(dir, &g, &c)).unwrap();
                // SAFETY: the buffers live in `self` for the whole run; store and load blocks are
                // disjoint halves.
                unsafe { engines[i].submit(Job::new(job, plan)) }.unwrap();
                let s = engines[i].last_submit_stats();
                m.sms = m.sms.max(s.sms);
                match s.policy {
                    Some("serving") => m.serving += 1,
                    Some(_) => m.idle += 1,
                    None => {}
                }
                m.calls.push((
                    s.longest_call_ns as f64 / 1e3,
                    s.longest_call_cpu_ns as f64 / 1e3,
                ));
                if s.longest_call_cpu_ns as f64 / 1e3 > m.worst.0 {
                    m.worst = (
                        s.longest_call_cpu_ns as f64 / 1e3,
                        s.longest_call.unwrap_or("-"),
                    );
                }
                m.paced_us += s.paced_ns as f64 / 1e3;
                m.jobs += 1;
                m.staged += u64::from(s.method == Some("staged"));
                ids.push((i, job, s.fed));
                job += 1;
            }
            for (i, j, fed) in ids {
                engines[i].wait(&[j]).unwrap();
                // A long DMA job's calls were made by the engine's feeder thread.
                if let Some(f) = engines[i]
                    .last_feed_stats()
                    .filter(|f| fed && f.job_id == j)
                {
                    let cpu = f.longest_call_cpu_ns as f64 / 1e3;
                    m.calls.push((f.longest_call_ns as f64 / 1e3, cpu));
                    if cpu > m.worst.0 {
                        m.worst = (cpu, f.longest_call.unwrap_or("-"));
                    }
                    m.paced_us += f.paced_ns as f64 / 1e3;
                }
                for r in engines[i].poll() {
                    if r.success {
                        bytes += r.bytes;
                    } else {
                        m.failed += 1;
                    }
                }
            }
        }
        m.gb_s = bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
        m
    }

    /// A store then a load into other GPU blocks, with GEMMs queued before; byte-exact?
    fn round_trip(&self, engines: &mut [CudaEngine; 2], comp: &Compute, rng: &mut Rng) -> bool {
        let n = self.blocks as usize;
        let src = rng.distinct(0, self.ngpu / 2, n);
        let dst = rng.distinct(self.ngpu / 2, self.ngpu / 2, n);
        let cpu = rng.distinct(0, self.ncpu, n);
        let read = || {
            self.gpu
                .iter()
                .map(|b| {
                    let mut v = vec![0u8; b.len()];
                    b.read(0, &mut v).unwrap();
                    v
                })
                .collect::<Vec<_>>()
        };
        let before = read();
        for _ in 0..4 {
            comp.op(if comp.gemm.is_some() { 0 } else { 1 });
        }
        let stream = Some(comp.stream.handle());
        for (i, dir, g) in [
            (0, Direction::GpuToCpu, &src),
            (1, Direction::CpuToGpu, &dst),
        ] {
            let plan = CopyPlan::from_copies(dir, self.copies(dir, g, &cpu)).unwrap();
            let mut j = Job::new(1 << 40, plan);
            j.stream = stream;
            // SAFETY: as in `transfer_loop`.
            unsafe { engines[i].submit(j) }.unwrap();
            engines[i].wait(&[1 << 40]).unwrap();
            if !engines[i].poll().iter().all(|r| r.success) {
                return false;
            }
        }
        let after = read();
        let p = self.page as usize;
        (0..TENSORS).all(|t| {
            src.iter().zip(&dst).all(|(&s, &d)| {
                let ((bs, s), (bd, d)) = (self.at(t, s), self.at(t, d));
                let (s, d) = (s as usize, d as usize);
                after[bd][d..d + p] == before[bs][s..s + p]
            })
        })
    }
}

/// The link's reference on an idle GPU, same run: GB/s of contiguous 128 MiB copies (one DMA copy
/// per job) device → host, host → device, and both at once (summed).
#[cfg(feature = "cuda")]
fn contiguous(dev: &Arc<CudaDevice>, secs: f64) -> [f64; 3] {
    const LEN: u64 = 128 << 20;
    let gpu = DeviceBuffer::new(dev, 2 * LEN as usize).unwrap();
    let host = PinnedBuffer::new(dev, 2 * LEN as usize).unwrap();
    let cfg = CudaEngineConfig {
        method: CopyMethod::Dma,
        ..CudaEngineConfig::default()
    };
    let mut engines = [
        CudaEngine::new(Arc::clone(dev), Direction::GpuToCpu, cfg.clone()).unwrap(),
        CudaEngine::new(Arc::clone(dev), Direction::CpuToGpu, cfg).unwrap(),
    ];
    let mut out = [0.0; 3];
    for (slot, on) in [[true, false], [false, true], [true, true]]
        .iter()
        .enumerate()
    {
        let (t, mut bytes, mut job) = (Instant::now(), 0u64, 0i64);
        while t.elapsed().as_secs_f64() < secs {
            let mut ids = Vec::new();
            for (i, dir) in [Direction::GpuToCpu, Direction::CpuToGpu]
                .into_iter()
                .enumerate()
            {
                if !on[i] {
                    continue;
                }
                let off = i as u64 * LEN;
                let (src_ptr, dst_ptr) = match dir {
                    Direction::GpuToCpu => (gpu.ptr() + off, host.ptr() + off),
                    Direction::CpuToGpu => (host.ptr() + off, gpu.ptr() + off),
                };
                let plan = CopyPlan::from_copies(
                    dir,
                    vec![CopyOp {
                        src_ptr,
                        dst_ptr,
                        bytes: LEN,
                    }],
                )
                .unwrap();
                // SAFETY: the buffers outlive the jobs (waited for below); the halves are disjoint.
                unsafe { engines[i].submit(Job::new(job, plan)) }.unwrap();
                ids.push((i, job));
                job += 1;
            }
            for (i, j) in ids {
                engines[i].wait(&[j]).unwrap();
                bytes += engines[i]
                    .poll()
                    .iter()
                    .filter(|r| r.success)
                    .map(|r| r.bytes)
                    .sum::<u64>();
            }
        }
        out[slot] = bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
    }
    for e in &mut engines {
        e.shutdown();
    }
    out
}

/// CPU microseconds of one tiny kernel launch every 200 µs on its own stream, until `stop`.
#[cfg(feature = "cuda")]
fn probe(dev: &Arc<CudaDevice>, stop: &AtomicBool) -> Vec<f64> {
    let s = dev.create_stream().unwrap();
    let mut out = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        s.sleep(1).unwrap();
        out.push(t.elapsed().as_secs_f64() * 1e6);
        std::thread::sleep(Duration::from_micros(200));
    }
    s.synchronize().unwrap();
    out
}

/// Thread CPU time, µs.
fn thread_cpu_us() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer for the call's duration.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut ts) };
    ts.tv_sec as f64 * 1e6 + ts.tv_nsec as f64 / 1e3
}

/// The machine's own noise, a control for the driver-call columns: the thread CPU time of a fixed
/// piece of arithmetic (no system call, no lock; about 10 µs) repeated every ~50 µs until `stop`,
/// beside kvoff's submits. What a piece takes beyond its median is time the vCPU was taken away
/// while the thread's clock ran (a virtual machine's host), which a driver call can suffer too.
/// Returns (median, max) µs.
fn noise(stop: &AtomicBool) -> (f64, f64) {
    let mut out = Vec::new();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    while !stop.load(Ordering::Relaxed) {
        let t = thread_cpu_us();
        for _ in 0..20_000 {
            x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1));
        }
        out.push(thread_cpu_us() - t);
        std::thread::sleep(Duration::from_micros(50));
    }
    (median(&out), out.iter().copied().fold(0.0, f64::max))
}

#[cfg(feature = "cuda")]
fn main() {
    if !cuda_available() {
        println!("interference: skipped (no CUDA device)");
        return;
    }
    let quick = std::env::var("KVOFF_BENCH_QUICK").is_ok();
    let pages = env_list("KVOFF_BENCH_PAGES", if quick { "32" } else { "4,32" });
    let jobs = env_list("KVOFF_BENCH_JOBS", if quick { "8" } else { "8,128" });
    let dirs = env_list(
        "KVOFF_BENCH_DIRS",
        if quick { "both" } else { "store,both" },
    );
    let methods = env_list(
        "KVOFF_BENCH_METHODS",
        if quick {
            "dma,auto"
        } else {
            "dma,dma2d,kernel,staged,auto-idle,auto-serve,auto"
        },
    );
    let secs: f64 = std::env::var("KVOFF_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.3);
    let rounds: usize = std::env::var("KVOFF_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3)
        .max(1);
    // Seconds of GEMMs before each cell's GEMM rounds: an 8192³ bf16 GEMM loop runs an H100 SXM
    // at its 700 W cap, and the power controller takes about a second to settle (SM clock
    // 1245–1980 MHz seen); rounds measured while it settles drift by ±8% whatever kvoff does.
    let preheat: f64 = std::env::var("KVOFF_BENCH_PREHEAT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.5);
    // Seconds of each GEMM round: at its power cap (700 W on an H100 SXM) a GEMM loop's SM clock
    // oscillates by ±8% with a period of about a second (nvidia-smi every 100 ms: 1245–1575 MHz,
    // SW power cap), so rounds much shorter than that read the phase, not kvoff: 0.2 s rounds in a
    // fixed schedule read every method, plain DMA included, 1–4% *faster* beside the transfers.
    let gemm_secs: f64 = std::env::var("KVOFF_BENCH_GEMM_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    let round_secs = [gemm_secs, secs];
    let dev = CudaDevice::open(0).unwrap();
    let stream = dev.create_stream().unwrap();
    let gemm = Gemm::new(&dev, &stream);
    let x = DeviceBuffer::new(&dev, 1 << 30).unwrap();
    let y = DeviceBuffer::new(&dev, 1 << 30).unwrap();
    let sm_mem =
        gemm.is_some() && std::env::var("KVOFF_BENCH_MEM_PROXY").is_ok_and(|v| v == "scopy");
    let verbose = std::env::var("KVOFF_BENCH_VERBOSE").is_ok();
    let mut comp = Compute {
        stream,
        gemm,
        x,
        y,
        n: [0; 2],
        sm_mem,
        chunk: [1; 2],
        marks: Vec::new(),
    };
    let kinds: Vec<usize> = if comp.gemm.is_some() {
        vec![0, 1]
    } else {
        vec![1]
    };
    let mut alone0 = [f64::NAN; 2];
    for &k in &kinds {
        comp.run(k, 3);
        let ms = comp.run(k, 5);
        comp.chunk[k] = ((5.0 / ms).ceil() as usize).max(1);
        comp.n[k] = ((round_secs[k] * 1e3 / ms) as usize).max(5);
        alone0[k] = comp.run(k, comp.n[k]);
    }
    let stop = AtomicBool::new(false);
    let lat0 = std::thread::scope(|sc| {
        let h = sc.spawn(|| probe(&dev, &stop));
        std::thread::sleep(Duration::from_secs_f64(secs.max(0.3)));
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap()
    });
    let link = contiguous(&dev, secs.max(0.3));
    // One allocation per tensor (vLLM's per-layer tensors), else all tensors in one allocation.
    let per_layer = std::env::var("KVOFF_BENCH_LAYOUT").is_ok_and(|v| v == "perlayer");
    println!(
        "transfers beside compute (Rust): {}; GEMM 8192³ bf16 {:.3} ms, 1 GiB device copy ({}) {:.3} ms; \
         launch alone p50 {:.1} µs, p99 {:.1} µs, max {:.0} µs; {rounds} rounds of {secs} s; KV: {}; \
         memory peak {:?} GB/s, serving staged cap {} MB/s",
        dev.name(),
        alone0[0],
        if sm_mem { "cuBLAS Scopy" } else { "cuMemcpyDtoDAsync" },
        alone0[1],
        median(&lat0),
        pct(&lat0, 0.99),
        lat0.iter().copied().fold(0.0, f64::max),
        if per_layer { "one allocation per tensor" } else { "one allocation" },
        dev.memory_peak_gbps(),
        method_cfg("auto").map_or(0, |c| c.staged_cap_mb_s(dev.memory_peak_gbps())),
    );
    println!(
        "contiguous copy (128 MiB DMA jobs, idle): device→host {:.1} GB/s, host→device {:.1} GB/s, \
         both at once {:.1} GB/s",
        link[0], link[1], link[2]
    );
    println!(
        "{:>6}{:>6}{:>7} {:<6}{:<10}{:>7}{:>8}{:>7}{:>8}{:>7}{:>12}{:>9}{:>5}{:>5}{:>7}{:>7}{:>7}{:>7} {:<8}{:>6}{:>7}{:>7}{:>7}{:>8} ok",
        "page",
        "job",
        "copies",
        "dirs",
        "method",
        "idle",
        "gemm%",
        "GB/s",
        "mem%",
        "GB/s",
        "drift%",
        "srv%",
        "sms",
        "st%",
        "call99",
        "callmx",
        "cpu99",
        "cpumx",
        "by",
        "noise",
        "pace%",
        "lat50",
        "lat99",
        "latmax"
    );
    let mut bad = false;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for page_kib in &pages {
        for job_mib in &jobs {
            let page = page_kib.parse::<u64>().unwrap() << 10;
            let blocks = ((job_mib.parse::<u64>().unwrap() << 20) / (TENSORS * page)).max(1);
            let (ngpu, ncpu) = (4 * blocks, 4 * blocks);
            let gpu: Vec<DeviceBuffer> = if per_layer {
                (0..TENSORS)
                    .map(|_| DeviceBuffer::new(&dev, (ngpu * page) as usize).unwrap())
                    .collect()
            } else {
                vec![DeviceBuffer::new(&dev, (TENSORS * ngpu * page) as usize).unwrap()]
            };
            for b in &gpu {
                let mut init = vec![0u8; b.len()];
                for w in init.chunks_exact_mut(8) {
                    w.copy_from_slice(&rng.next().to_le_bytes());
                }
                b.write(0, &init).unwrap();
            }
            let host = PinnedBuffer::new(&dev, (TENSORS * ncpu * page) as usize).unwrap();
            let cell = Cell {
                gpu,
                host,
                page,
                blocks,
                ngpu,
                ncpu,
            };
            for label in &methods {
                let Some(cfg) = method_cfg(label) else {
                    eprintln!("interference: unknown method {label:?}");
                    continue;
                };
                let mut engines = [
                    CudaEngine::new(Arc::clone(&dev), Direction::GpuToCpu, cfg.clone()).unwrap(),
                    CudaEngine::new(Arc::clone(&dev), Direction::CpuToGpu, cfg).unwrap(),
                ];
                // The transfers are not ordered after the model's stream (they run on a thread of
                // their own), so the engines are told where the model computes.
                for e in &mut engines {
                    // SAFETY: the compute stream outlives the engines (shut down below).
                    unsafe { e.set_compute_streams(&[comp.stream.handle()]) };
                }
                for d in &dirs {
                    // Idle, with the launch probe; after the serving policy's idle window
                    // (100 ms), so that the phase measures the idle GPU, not the window's end.
                    std::thread::sleep(Duration::from_millis(150));
                    let stop = AtomicBool::new(false);
                    let (idle, lat, ns) = std::thread::scope(|sc| {
                        let p = sc.spawn(|| probe(&dev, &stop));
                        let n = sc.spawn(|| noise(&stop));
                        let t = sc.spawn(|| {
                            let mut r = Rng(rng.0 ^ 1);
                            cell.transfer_loop(&mut engines, d, &stop, &mut r)
                        });
                        std::thread::sleep(Duration::from_secs_f64(secs));
                        stop.store(true, Ordering::Relaxed);
                        (t.join().unwrap(), p.join().unwrap(), n.join().unwrap())
                    });
                    let (noise_med, mut noise_max) = ns;
                    let (mut sms, mut failed) = (idle.sms, idle.failed);
                    let mut calls = idle.calls.clone();
                    let mut worst = idle.worst;
                    let (mut paced_us, mut phase_us) = (idle.paced_us, secs * 1e6);
                    let mut pol = [0u64; 2];
                    let mut mix = [0u64; 2];
                    let mut slow = [f64::NAN; 2];
                    let mut drift = [f64::NAN; 2];
                    let mut gbs = [f64::NAN; 2];
                    for &k in &kinds {
                        let (mut a, mut b, mut g) = (Vec::new(), Vec::new(), Vec::new());
                        // ~50 ms of ops queued before each timed run, alone and beside: beside,
                        // the model computes before the transfers start (steady state); alone, the
                        // same warm-up keeps the reference comparable (a GEMM loop's clock falls
                        // as the GPU heats).
                        let per_s = comp.n[k] as f64 / round_secs[k];
                        let warm = ((per_s * 0.05).ceil() as usize).max(1);
                        if k == 0 && preheat > 0.0 {
                            comp.run(k, (per_s * preheat).ceil() as usize);
                        }
                        // Alone rounds bracket the beside rounds (A B A B … A): each beside
                        // round is compared with the mean of its two neighbours, so a drift of the
                        // proxy during the cell (clocks, power, heat) cancels to first order.
                        for _ in 0..warm {
                            comp.op(k);
                        }
                        a.push(comp.run(k, comp.n[k]));
                        for _ in 0..rounds {
                            let stop = AtomicBool::new(false);
                            for _ in 0..warm {
                                comp.op(k);
                            }
                            let (m, ms, ns) = std::thread::scope(|sc| {
                                let n = sc.spawn(|| noise(&stop));
                                let t = sc.spawn(|| {
                                    let mut r = Rng(rng.0 ^ 2);
                                    cell.transfer_loop(&mut engines, d, &stop, &mut r)
                                });
                                let ms = comp.run(k, comp.n[k]);
                                stop.store(true, Ordering::Relaxed);
                                (t.join().unwrap(), ms, n.join().unwrap())
                            });
                            noise_max = noise_max.max(ns.1);
                            b.push(ms);
                            for _ in 0..warm {
                                comp.op(k);
                            }
                            a.push(comp.run(k, comp.n[k]));
                            g.push(m.gb_s);
                            sms = sms.max(m.sms);
                            calls.extend_from_slice(&m.calls);
                            if m.worst.0 > worst.0 {
                                worst = m.worst;
                            }
                            paced_us += m.paced_us;
                            phase_us += ms * 1e3 * comp.n[k] as f64;
                            pol[0] += m.serving;
                            pol[1] += m.idle;
                            mix[0] += m.staged;
                            mix[1] += m.jobs;
                            failed += m.failed;
                        }
                        if verbose {
                            eprintln!(
                                "{page_kib}K {job_mib}M {d} {label} proxy {k}: alone {a:.3?} beside {b:.3?} GB/s {g:.1?}"
                            );
                        }
                        slow[k] = bracketed(&a, &b);
                        drift[k] = a[a.len() - 1] / a[0] - 1.0;
                        gbs[k] = median(&g);
                    }
                    let ok = failed == 0 && cell.round_trip(&mut engines, &comp, &mut rng);
                    let wall: Vec<f64> = calls.iter().map(|c| c.0).collect();
                    let cpu: Vec<f64> = calls.iter().map(|c| c.1).collect();
                    bad |= !ok;
                    println!(
                        "{:>5}K{:>5}M{:>7} {:<6}{:<10}{:>7.1}{:>+7.1}%{:>7.1}{:>+7.1}%{:>7.1}{:>12}{:>9}{:>5}{:>5}{:>7.0}{:>7.0}{:>7.0}{:>7.0} {:<8}{:>6.0}{:>7.1}{:>7.0}{:>7.0}{:>8.0} {}",
                        page_kib,
                        job_mib,
                        blocks * TENSORS,
                        d,
                        label,
                        idle.gb_s,
                        slow[0] * 100.0,
                        gbs[0],
                        slow[1] * 100.0,
                        gbs[1],
                        format!("{:+.1}/{:+.1}", drift[0] * 100.0, drift[1] * 100.0),
                        format!("{}/{}", share(idle.serving, idle.idle), share(pol[0], pol[1])),
                        sms,
                        share(mix[0], mix[1] - mix[0]),
                        pct(&wall, 0.99),
                        wall.iter().copied().fold(0.0, f64::max),
                        pct(&cpu, 0.99),
                        worst.0,
                        short_call(worst.1),
                        noise_max - noise_med,
                        100.0 * paced_us / phase_us,
                        median(&lat),
                        pct(&lat, 0.99),
                        lat.iter().copied().fold(0.0, f64::max),
                        if ok { "ok" } else { "FAIL" }
                    );
                }
                for e in &mut engines {
                    e.shutdown();
                }
            }
        }
    }
    if bad {
        eprintln!("interference: a job failed or a round trip was not byte-exact");
        std::process::exit(1);
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("interference: skipped (built without the cuda feature)");
}
