//! Worker-side benchmarks: pointer expansion, transfer planning, host engine bandwidth.
//!
//! `cargo bench --bench worker`. The host engine figure is compared with a single-thread
//! `copy_from_slice` of the same number of bytes measured in the same run (target: ≥ 70%).
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]
// Unsafe: submitting plans to engines over memory this file allocates and keeps alive.
#![allow(unsafe_code)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvoff::engine::{HostEngine, Job, TransferEngine};
use kvoff::expand::compute_sub_block_ptrs_into;
use kvoff::plan::{CopyPlan, CopyPlanner, Direction, GpuSpec, PlanRef, TensorDesc};

/// Deterministic shuffle (SplitMix64 + Fisher-Yates).
fn shuffled(n: usize, seed: u64) -> Vec<i64> {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut v: Vec<i64> = (0..n as i64).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

fn expansion(c: &mut Criterion) {
    let mut g = c.benchmark_group("expand");
    g.measurement_time(Duration::from_secs(2));
    let ids = shuffled(4096, 1);
    let mut out = Vec::with_capacity(16384);
    g.throughput(Throughput::Elements(16384));
    g.bench_function("sub_block_ptrs_4096ids_f4", |b| {
        b.iter(|| {
            out.clear();
            compute_sub_block_ptrs_into(
                black_box(&ids),
                4,
                0x7f00_0000_0000,
                4 * 32768 + 4096,
                4 * 32768,
                1,
                None,
                &mut out,
            )
            .unwrap();
            black_box(out.len())
        })
    });
    g.finish();
}

/// A planner over fake (never dereferenced) addresses.
fn fake_planner(
    ntensors: usize,
    gpu_blocks: u64,
    cpu_blocks: u64,
    page: u64,
    f: u64,
) -> CopyPlanner {
    let gpu = (0..ntensors)
        .map(|t| TensorDesc::contiguous(0x10_0000_0000 + t as u64 * (1 << 32), gpu_blocks, page))
        .collect();
    let cpu = (0..ntensors)
        .map(|t| {
            TensorDesc::contiguous(
                0x9000_0000_0000 + t as u64 * (1 << 36),
                cpu_blocks,
                page * f,
            )
        })
        .collect();
    let refs = vec![(0..ntensors).map(|t| PlanRef::new(t, page)).collect()];
    CopyPlanner::new(gpu, cpu, refs, f).unwrap()
}

fn planning(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_16384_copies");
    g.measurement_time(Duration::from_secs(2));
    g.throughput(Throughput::Elements(16384));
    // 64 tensors (32 layers x K,V) x 256 blocks, f = 4, unaligned start.
    let p = fake_planner(64, 100_000, 50_000, 32768, 4);
    let gpu_ids: Vec<i64> = shuffled(100_000, 2)[..256].to_vec();
    let cpu_ids: Vec<i64> = shuffled(50_000, 3)[..65].to_vec();
    let sizes = [256i64];
    let indices = [1i64];
    let spec = GpuSpec::with_groups(&gpu_ids, &sizes, Some(&indices));
    let mut plan = CopyPlan::new(Direction::GpuToCpu);
    p.plan_into(Direction::GpuToCpu, &spec, &cpu_ids, &mut plan)
        .unwrap();
    assert_eq!(plan.num_block_copies(), 16384);
    g.bench_function("64_tensors_x_256_blocks_store", |b| {
        b.iter(|| {
            p.plan_into(
                Direction::GpuToCpu,
                black_box(&spec),
                black_box(&cpu_ids),
                &mut plan,
            )
            .unwrap();
            black_box(plan.len())
        })
    });
    g.bench_function("64_tensors_x_256_blocks_load", |b| {
        b.iter(|| {
            p.plan_into(
                Direction::CpuToGpu,
                black_box(&spec),
                black_box(&cpu_ids),
                &mut plan,
            )
            .unwrap();
            black_box(plan.len())
        })
    });
    // One tensor x 16384 blocks, f = 1.
    let p1 = fake_planner(1, 100_000, 100_000, 4096, 1);
    let gids = shuffled(100_000, 4)[..16384].to_vec();
    let cids = shuffled(100_000, 5)[..16384].to_vec();
    let spec1 = GpuSpec::new(&gids);
    g.bench_function("1_tensor_x_16384_blocks_store", |b| {
        b.iter(|| {
            p1.plan_into(
                Direction::GpuToCpu,
                black_box(&spec1),
                black_box(&cids),
                &mut plan,
            )
            .unwrap();
            black_box(plan.len())
        })
    });
    g.finish();
}

fn host_engine(c: &mut Criterion) {
    const PAGE: u64 = 32 << 10;
    const BLOCKS: u64 = 4096; // 128 MiB per job
    const F: u64 = 4;
    let bytes = PAGE * BLOCKS;
    let mut gpu = vec![0u8; bytes as usize];
    for (i, b) in gpu.iter_mut().enumerate() {
        *b = (i * 31 + i / 4099) as u8;
    }
    let mut cpu = vec![0u8; bytes as usize];
    let planner = CopyPlanner::new(
        vec![TensorDesc::contiguous(
            gpu.as_mut_ptr() as u64,
            BLOCKS,
            PAGE,
        )],
        vec![TensorDesc::contiguous(
            cpu.as_mut_ptr() as u64,
            BLOCKS / F,
            PAGE * F,
        )],
        vec![vec![PlanRef::new(0, PAGE)]],
        F,
    )
    .unwrap();
    let gpu_ids = shuffled(BLOCKS as usize, 6);
    let cpu_ids = shuffled((BLOCKS / F) as usize, 7);
    let spec = GpuSpec::new(&gpu_ids);
    let plan = planner.plan(Direction::GpuToCpu, &spec, &cpu_ids).unwrap();

    let mut g = c.benchmark_group("host_copy_128MiB");
    g.measurement_time(Duration::from_secs(3));
    g.sample_size(10);
    g.throughput(Throughput::Bytes(bytes));
    let mut dst = vec![0u8; bytes as usize];
    g.bench_function("single_thread_memcpy_contiguous", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&gpu)))
    });
    drop(dst);
    let mut engine = HostEngine::new().unwrap();
    let mut id = 0i64;
    g.bench_function(
        format!(
            "host_engine_scattered_32KiB_x4096_{}threads",
            engine.threads()
        ),
        |b| {
            b.iter(|| {
                id += 1;
                // SAFETY: `gpu` and `cpu` are live, disjoint, and untouched until `wait` returns.
                unsafe { engine.submit(Job::new(id, plan.clone())).unwrap() };
                engine.wait(&[id]).unwrap();
                let r = engine.poll();
                assert!(r[0].success);
            })
        },
    );
    g.finish();
    // What was timed copied the right bytes (when it ran: a filter may have skipped it).
    for (k, &gid) in gpu_ids.iter().enumerate().step_by(97) {
        let (cb, j) = (cpu_ids[k / F as usize] as u64, k as u64 % F);
        let c0 = ((cb * F + j) * PAGE) as usize;
        let g0 = (gid as u64 * PAGE) as usize;
        assert!(id == 0 || cpu[c0..c0 + PAGE as usize] == gpu[g0..g0 + PAGE as usize]);
    }
    engine.shutdown();
}

criterion_group!(benches, expansion, planning, host_engine);
criterion_main!(benches);
