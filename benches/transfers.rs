//! GPU ↔ host transfer benchmark (docs/performance.md's scattered-block scenarios), one run, every column
//! measured side by side (device work only: each timed job waits behind a gate kernel until the
//! CPU has enqueued all of it): kvoff auto / dma / kernel, the per-copy `cuMemcpyAsync` loop, one
//! `cuMemcpyBatchAsync` call over the same descriptors (= kvoff dma), and one contiguous copy of the
//! same byte count (the limit). Device-timed with CUDA events, median of 5 after a warm-up; the
//! destination of every timed method is verified byte for byte afterwards.
//!
//! `cargo bench --bench transfers` (skips without a GPU). `KVOFF_BENCH_QUICK=1` runs one small
//! scenario, `KVOFF_BENCH_ONLY=4KiB` the scenarios whose name contains that text. Set
//! `KVOFF_BENCH_JSON=path` to also write the rows as JSON lines.
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]
// Unsafe: submitting plans to engines over memory this file allocates and keeps alive.
#![allow(unsafe_code)]
#![allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
#![cfg_attr(not(feature = "cuda"), allow(unused))]

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

#[cfg(feature = "cuda")]
use kvoff::engine::cuda::{
    cuda_available, CopyMethod, CudaDevice, CudaEngine, CudaEngineConfig, DeviceBuffer,
    PinnedBuffer,
};
use kvoff::engine::{Job, TransferEngine};
use kvoff::plan::{CopyOp, CopyPlan, Direction};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn distinct(&mut self, n: u64, k: usize) -> Vec<u64> {
        let mut v: Vec<u64> = (0..n).collect();
        for i in 0..k {
            let j = i as u64 + self.next() % (n - i as u64);
            v.swap(i, j as usize);
        }
        v.truncate(k);
        v
    }
}

struct Scenario {
    name: &'static str,
    page: u64,
    tensors: u64,
    blocks: u64,
}

#[cfg(feature = "cuda")]
struct Setup {
    dev: Arc<CudaDevice>,
    gpu: DeviceBuffer,
    host: PinnedBuffer,
    gpu_init: Vec<u8>,
    tensor_rows: u64,
    page: u64,
    tensors: u64,
}

#[cfg(feature = "cuda")]
impl Setup {
    fn tensor_bytes(&self) -> u64 {
        self.tensor_rows * self.page
    }
    /// Copies of `blocks` (gpu id, cpu id) pairs over every tensor.
    fn copies(&self, dir: Direction, gids: &[u64], cids: &[u64]) -> Vec<CopyOp> {
        // Block-major, as kvoff's planner emits them: for each block, every tensor's page.
        let mut v = Vec::with_capacity(gids.len() * self.tensors as usize);
        for (&g, &c) in gids.iter().zip(cids) {
            for t in 0..self.tensors {
                let gp = self.gpu.ptr() + t * self.tensor_bytes() + g * self.page;
                // kvoff's host layout is block-major: one CPU block's pages of every tensor are
                // contiguous (a region row / one slot).
                let hp = self.host.ptr() + c * self.tensors * self.page + t * self.page;
                v.push(match dir {
                    Direction::GpuToCpu => CopyOp {
                        src_ptr: gp,
                        dst_ptr: hp,
                        bytes: self.page,
                    },
                    Direction::CpuToGpu => CopyOp {
                        src_ptr: hp,
                        dst_ptr: gp,
                        bytes: self.page,
                    },
                });
            }
        }
        v
    }
    /// Checks that every copy's destination equals its source (host sides read directly, GPU side
    /// read back once).
    fn verify(&self, dir: Direction, copies: &[CopyOp]) -> bool {
        match dir {
            Direction::GpuToCpu => copies.iter().all(|c| {
                let s = (c.src_ptr - self.gpu.ptr()) as usize;
                let d = (c.dst_ptr - self.host.ptr()) as usize;
                self.host.as_slice()[d..d + c.bytes as usize]
                    == self.gpu_init[s..s + c.bytes as usize]
            }),
            Direction::CpuToGpu => {
                let mut got = vec![0u8; self.gpu.len()];
                if self.gpu.read(0, &mut got).is_err() {
                    return false;
                }
                copies.iter().all(|c| {
                    let s = (c.src_ptr - self.host.ptr()) as usize;
                    let d = (c.dst_ptr - self.gpu.ptr()) as usize;
                    got[d..d + c.bytes as usize] == self.host.as_slice()[s..s + c.bytes as usize]
                })
            }
        }
    }
}

#[cfg(feature = "cuda")]
fn time_method(
    setup: &Setup,
    method: CopyMethod,
    dir: Direction,
    copies: &[CopyOp],
    reps: usize,
) -> (f64, bool, u32, f64) {
    let cfg = CudaEngineConfig {
        method,
        ..cfg_default()
    };
    let mut eng = tuned_engine(Arc::clone(&setup.dev), dir, cfg).expect("engine");
    // The gate: a sleep kernel on the "caller's" stream that every timed job waits on, so the GPU
    // starts a job only after the CPU has enqueued all of it and the events time device work only
    // (the batch and loop baselines spend milliseconds of CPU inside the driver per job).
    let gate = setup.dev.create_stream().expect("stream");
    let mut secs = Vec::new();
    let mut submit_us = Vec::new();
    let mut pack_us = Vec::new();
    for r in 0..=reps {
        let plan = CopyPlan::from_copies(dir, copies.to_vec()).expect("plan");
        if r > 0 {
            let last: f64 = submit_us.last().copied().unwrap_or(0.0);
            gate.sleep((3.0 * last * 1e3).clamp(2e6, 1e8) as u64)
                .expect("gate");
        }
        let mut job = Job::new(r as i64, plan);
        job.stream = (r > 0).then(|| gate.handle());
        let t0 = Instant::now();
        // SAFETY: buffers live in `setup` for the whole run.
        unsafe { eng.submit(job) }.expect("submit");
        submit_us.push(t0.elapsed().as_secs_f64() * 1e6);
        pack_us.push(eng.last_submit_timing_ns().1 as f64 / 1e3);
        eng.wait(&[r as i64]).expect("wait");
        let res = eng.poll();
        assert!(res[0].success, "{method:?}: {:?}", res[0].error);
        if r > 0 {
            secs.push(res[0].seconds);
        }
    }
    // End to end: host clock from submission to completion, no gate (CPU work included).
    let mut walls = Vec::new();
    for r in 0..=reps {
        let plan = CopyPlan::from_copies(dir, copies.to_vec()).expect("plan");
        let id = 1000 + r as i64;
        let t0 = Instant::now();
        // SAFETY: buffers live in `setup` for the whole run.
        unsafe { eng.submit(Job::new(id, plan)) }.expect("submit");
        eng.wait(&[id]).expect("wait");
        let w = t0.elapsed().as_secs_f64();
        assert!(eng.poll()[0].success);
        if r > 0 {
            walls.push(w);
        }
    }
    walls.sort_by(f64::total_cmp);
    secs.sort_by(f64::total_cmp);
    submit_us.sort_by(f64::total_cmp);
    pack_us.sort_by(f64::total_cmp);
    SUBMIT_LOG.with(|l| {
        l.borrow_mut().push((
            method.name(),
            submit_us[submit_us.len() / 2],
            pack_us[pack_us.len() / 2],
        ));
    });
    if method == CopyMethod::Auto {
        // The method `auto` picked for this job (every job of the scenario is the same).
        let counts = eng.method_counts();
        let best = counts
            .iter()
            .max_by_key(|(_, n)| *n)
            .map_or("dma", |(m, _)| m.name());
        AUTO_METHOD.with(|m| *m.borrow_mut() = best);
    }
    let ok = setup.verify(dir, copies);
    let bytes: u64 = copies.iter().map(|c| c.bytes).sum();
    E2E_LOG.with(|l| {
        l.borrow_mut()
            .push((method.name(), bytes as f64 / walls[walls.len() / 2] / 1e9));
    });
    (
        bytes as f64 / secs[secs.len() / 2] / 1e9,
        ok,
        eng.last_kernel_ctas(),
        submit_us[submit_us.len() / 2],
    )
}

thread_local! {
    /// The method the last timed `auto` engine used.
    static AUTO_METHOD: std::cell::RefCell<&'static str> = const { std::cell::RefCell::new("") };
    /// (method, end-to-end GB/s: host clock from submission to completion, ungated).
    static E2E_LOG: std::cell::RefCell<Vec<(&'static str, f64)>> = const { std::cell::RefCell::new(Vec::new()) };
    /// (method, median submit µs, median staged-pack µs) of every timed method, for the report.
    static SUBMIT_LOG: std::cell::RefCell<Vec<(&'static str, f64, f64)>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(feature = "cuda")]
fn main() {
    if !cuda_available() {
        println!("transfers: SKIP (no CUDA driver or device); the host engine is benchmarked by `cargo bench --bench worker`");
        return;
    }
    let dev = CudaDevice::open(0).expect("device");
    let quick = std::env::var("KVOFF_BENCH_QUICK").is_ok_and(|v| v == "1");
    let scenarios: Vec<Scenario> = if quick {
        vec![Scenario {
            name: "32KiB x 64 tensors",
            page: 32 << 10,
            tensors: 64,
            blocks: 64,
        }]
    } else {
        vec![
            Scenario {
                name: "4KiB x 64 tensors",
                page: 4 << 10,
                tensors: 64,
                blocks: 512,
            },
            Scenario {
                name: "32KiB x 64 tensors",
                page: 32 << 10,
                tensors: 64,
                blocks: 256,
            },
            Scenario {
                name: "128KiB x 64 tensors",
                page: 128 << 10,
                tensors: 64,
                blocks: 64,
            },
            Scenario {
                name: "2MiB x 1 tensor",
                page: 2 << 20,
                tensors: 1,
                blocks: 256,
            },
        ]
    };
    let mut out = String::new();
    let mut json = String::new();
    let mut json_e2e = String::new();
    let _ = writeln!(
        out,
        "device: {} ({} SMs), batch memcpy: {}",
        dev.name(),
        dev.sm_count(),
        dev.has_batch_memcpy()
    );
    let _ = writeln!(
        out,
        "{:<22}{:<5}{:>8}{:>9}{:>9}{:>9}{:>9}{:>9}{:>9}{:>8}{:>8}{:>6}{:>9}",
        "scenario",
        "dir",
        "copies",
        "auto",
        "dma",
        "kernel",
        "staged",
        "loop",
        "contig",
        "auto%",
        "xbatch",
        "CTAs",
        "submit"
    );
    if let Some(cal) = dev.calibration() {
        let _ = writeln!(
            out,
            "calibration (auto's table, GB/s by copy size / staged run):"
        );
        for r in &cal.rows {
            let _ = writeln!(
                out,
                "    {:?} {:<7} {:>8} B (pages {:>6} B) {:>6.1}",
                r.direction,
                r.method.name(),
                r.bytes,
                r.page,
                r.gbps
            );
        }
    }
    let mut rng = Rng(42);
    let only = std::env::var("KVOFF_BENCH_ONLY").unwrap_or_default();
    for sc in scenarios
        .iter()
        .filter(|sc| sc.name.contains(only.as_str()))
    {
        let rows = sc.blocks * 4;
        let total = (rows * sc.page * sc.tensors) as usize;
        let gpu = DeviceBuffer::new(&dev, total).expect("gpu alloc");
        let mut host = PinnedBuffer::new(&dev, total).expect("host alloc");
        let mut gpu_init = vec![0u8; total];
        for chunk in gpu_init.chunks_mut(8) {
            let v = rng.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
        gpu.write(0, &gpu_init).expect("init gpu");
        for chunk in host.as_mut_slice().chunks_mut(8) {
            let v = rng.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
        let setup = Setup {
            dev: Arc::clone(&dev),
            gpu,
            host,
            gpu_init,
            tensor_rows: rows,
            page: sc.page,
            tensors: sc.tensors,
        };
        let ids = rng.distinct(rows, 2 * sc.blocks as usize);
        let (g1, g2) = ids.split_at(sc.blocks as usize);
        let cids = rng.distinct(rows, 2 * sc.blocks as usize);
        let (c1, c2) = cids.split_at(sc.blocks as usize);
        for dir in [Direction::GpuToCpu, Direction::CpuToGpu] {
            let copies = setup.copies(dir, g1, c1);
            let bytes: u64 = copies.iter().map(|c| c.bytes).sum();
            let mut gbs = Vec::new();
            let mut all_ok = true;
            let mut ctas = 0;
            let mut submit = 0.0;
            for m in [
                CopyMethod::Auto,
                CopyMethod::Dma,
                CopyMethod::Kernel,
                CopyMethod::Staged,
                CopyMethod::Loop,
            ] {
                let (g, ok, c, s) = time_method(&setup, m, dir, &copies, 5);
                all_ok &= ok;
                if m == CopyMethod::Kernel {
                    ctas = c;
                }
                if m == CopyMethod::Auto {
                    submit = s;
                }
                gbs.push(g);
            }
            // The limit: one contiguous copy of the same byte count.
            let (s0, d0) = match dir {
                Direction::GpuToCpu => (setup.gpu.ptr(), setup.host.ptr()),
                Direction::CpuToGpu => (setup.host.ptr(), setup.gpu.ptr()),
            };
            let contig = vec![CopyOp {
                src_ptr: s0,
                dst_ptr: d0,
                bytes,
            }];
            let (gc, okc, _, _) = time_method(&setup, CopyMethod::Loop, dir, &contig, 5);
            all_ok &= okc;
            let d = if dir == Direction::GpuToCpu {
                "D2H"
            } else {
                "H2D"
            };
            let _ = writeln!(
                out,
                "{:<22}{:<5}{:>8}{:>9.1}{:>9.1}{:>9.1}{:>9.1}{:>9.1}{:>9.1}{:>7.0}%{:>7.2}x{:>6}{:>7.0}us{}",
                sc.name, d, copies.len(), gbs[0], gbs[1], gbs[2], gbs[3], gbs[4], gc,
                100.0 * gbs[0] / gc, gbs[0] / gbs[1], ctas, submit,
                if all_ok { "" } else { "  VERIFY FAILED" }
            );
            let _ = writeln!(
                json,
                "{{\"scenario\":\"{}\",\"dir\":\"{d}\",\"copies\":{},\"auto_method\":\"{}\",\"auto\":{:.2},\"dma\":{:.2},\"kernel\":{:.2},\"staged\":{:.2},\"loop\":{:.2},\"contiguous\":{:.2},\"kernel_ctas\":{ctas},\"submit_us\":{submit:.1},\"verified\":{all_ok}}}",
                sc.name, copies.len(), AUTO_METHOD.with(|m| *m.borrow()), gbs[0], gbs[1], gbs[2], gbs[3], gbs[4], gc
            );
            let _ = writeln!(out, "    auto used: {}", AUTO_METHOD.with(|m| *m.borrow()));
            let log = SUBMIT_LOG.with(|l| std::mem::take(&mut *l.borrow_mut()));
            let mut line = String::from("    submit CPU µs (pack µs):");
            for (m, sub, pack) in &log[..log.len() - 1] {
                let _ = write!(line, " {m} {sub:.0} ({pack:.0})");
            }
            let _ = writeln!(out, "{line}");
            let e2e = E2E_LOG.with(|l| std::mem::take(&mut *l.borrow_mut()));
            let mut line = String::from("    end-to-end GB/s (submit → done):");
            for (i, (m, g)) in e2e.iter().enumerate() {
                let name = if i + 1 == e2e.len() { "contig" } else { m };
                let _ = write!(line, " {name} {g:.1}");
            }
            if let (Some(a), Some(c)) = (e2e.first(), e2e.last()) {
                let _ = write!(line, "  → auto {:.0}% of contig", 100.0 * a.1 / c.1);
            }
            if let (Some(a), Some(d)) = (e2e.first(), e2e.get(1)) {
                let _ = write!(line, ", {:.2}x the batch call", a.1 / d.1);
            }
            json_e2e.push_str(&format!(
                "{{\"scenario\":\"{}\",\"dir\":\"{:?}\",\"e2e\":{:?}}}\n",
                sc.name, dir, e2e
            ));
            let _ = writeln!(out, "{line}");
            // Restore the source-side contents for the next direction's checks.
            setup.gpu.write(0, &setup.gpu_init).expect("restore");
        }
        // Store and load at the same time, per method pair (store, load).
        let store_copies = setup.copies(Direction::GpuToCpu, g1, c1);
        let load_copies = setup.copies(Direction::CpuToGpu, g2, c2);
        let bytes: u64 = store_copies
            .iter()
            .chain(&load_copies)
            .map(|c| c.bytes)
            .sum();
        for (ms, ml) in [
            (CopyMethod::Auto, CopyMethod::Auto),
            (CopyMethod::Dma, CopyMethod::Dma),
            (CopyMethod::Kernel, CopyMethod::Kernel),
            (CopyMethod::Staged, CopyMethod::Staged),
            (CopyMethod::Staged, CopyMethod::Kernel),
            (CopyMethod::Kernel, CopyMethod::Staged),
            (CopyMethod::Dma, CopyMethod::Kernel),
        ] {
            let mk = |m, d| {
                tuned_engine(
                    Arc::clone(&dev),
                    d,
                    CudaEngineConfig {
                        method: m,
                        ..cfg_default()
                    },
                )
                .expect("engine")
            };
            let mut st = mk(ms, Direction::GpuToCpu);
            let mut ld = mk(ml, Direction::CpuToGpu);
            let mut walls = Vec::new();
            for r in 0..6i64 {
                let t0 = Instant::now();
                // SAFETY: buffers live in `setup`.
                unsafe {
                    st.submit(Job::new(
                        r,
                        CopyPlan::from_copies(Direction::GpuToCpu, store_copies.clone())
                            .expect("plan"),
                    ))
                    .expect("submit");
                    ld.submit(Job::new(
                        r,
                        CopyPlan::from_copies(Direction::CpuToGpu, load_copies.clone())
                            .expect("plan"),
                    ))
                    .expect("submit");
                }
                st.wait(&[r]).expect("wait");
                ld.wait(&[r]).expect("wait");
                let w = t0.elapsed().as_secs_f64();
                let a = st.poll();
                let b = ld.poll();
                assert!(a[0].success && b[0].success);
                if r > 0 {
                    walls.push(w);
                }
            }
            walls.sort_by(f64::total_cmp);
            let ok = setup.verify(Direction::GpuToCpu, &store_copies)
                && setup.verify(Direction::CpuToGpu, &load_copies);
            let total = bytes as f64 / walls[walls.len() / 2] / 1e9;
            let _ = writeln!(
                out,
                "{:<22}both store={} load={}: {:.1} GB/s total{}",
                sc.name,
                ms.name(),
                ml.name(),
                total,
                if ok { "" } else { "  VERIFY FAILED" }
            );
            let _ = writeln!(
                json,
                "{{\"scenario\":\"{}\",\"dir\":\"both\",\"store\":\"{}\",\"load\":\"{}\",\"total\":{total:.2},\"verified\":{ok}}}",
                sc.name, ms.name(), ml.name()
            );
        }
    }
    println!("{out}");
    println!("columns: GB/s (1e9 B/s), event-timed median of 5; auto% = auto / contiguous; xbatch = auto / one cuMemcpyBatchAsync call (= dma); CTAs = SMs used by the kernel; submit = CPU time to submit one job (auto)");
    if let Ok(p) = std::env::var("KVOFF_BENCH_JSON") {
        let _ = std::fs::write(p, json + &json_e2e);
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("transfers: SKIP (built without the `cuda` feature)");
}

/// Engine defaults, with `KVOFF_KERNEL_THREADS` / `KVOFF_MAX_CTAS` overrides for sweeps.
#[cfg(feature = "cuda")]
fn cfg_default() -> CudaEngineConfig {
    fn env<T: std::str::FromStr>(name: &str) -> Option<T> {
        std::env::var(name).ok().and_then(|v| v.parse().ok())
    }
    let mut c = CudaEngineConfig::default();
    if let Some(t) = env("KVOFF_KERNEL_THREADS") {
        c.kernel_threads = t;
    }
    if let Some(t) = env("KVOFF_MAX_CTAS") {
        c.max_ctas = t;
    }
    if let Some(t) = env::<u64>("KVOFF_STAGING_SLOT_MB") {
        c.staging_slot_bytes = t << 20;
    }
    if let Some(t) = env("KVOFF_STAGING_SLOTS") {
        c.staging_slots = t;
    }
    if let Some(t) = env::<u8>("KVOFF_KERNEL_NC") {
        c.read_only_loads = t == 1;
    }
    c
}

/// `CudaEngine::new` with the environment's `KVOFF_CUDA_TUNE` applied (the engine does not read it).
#[cfg(feature = "cuda")]
fn tuned_engine(
    dev: Arc<CudaDevice>,
    direction: Direction,
    mut cfg: CudaEngineConfig,
) -> kvoff::Result<CudaEngine> {
    cfg.apply_env_tuning()?;
    CudaEngine::new(dev, direction, cfg)
}
