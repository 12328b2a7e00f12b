//! Expansion, planning and byte-exact round trips through the host engine (no GPU: "GPU" tensors
//! are plain `Vec<u8>` buffers).
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]
// Unsafe: submitting plans to engines over memory this file allocates and keeps alive.
#![allow(unsafe_code)]

use kvoff::engine::{HostEngine, Job, TransferEngine};
use kvoff::expand::{compute_sub_block_ptrs, expand_block_ids};
use kvoff::plan::{CopyPlanner, Direction, GpuSpec, PlanRef, TensorDesc};
use kvoff::KvoffError;

// ---------------------------------------------------------------------------------------------
// Expansion (docs/spec.md §4 examples)
// ---------------------------------------------------------------------------------------------

#[test]
fn expansion_spec_examples() {
    let ids = expand_block_ids(&[0, 1, 3], 4, 0, None).unwrap();
    assert_eq!(ids, vec![0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]);

    let (base, r, s) = (0x7f00_0000_0000u64, 4096u64, 1000u64);
    let ptrs = compute_sub_block_ptrs(&[7, 2], 3, base, r, 3 * s, 2, Some(4)).unwrap();
    assert_eq!(
        ptrs,
        vec![
            base + 7 * r + 2 * s,
            base + 2 * r,
            base + 2 * r + s,
            base + 2 * r + 2 * s
        ]
    );
}

#[test]
fn expansion_rejects_bad_input() {
    let bad = |r: kvoff::Result<Vec<i64>>| matches!(r, Err(KvoffError::InvalidArgument(_)));
    assert!(bad(expand_block_ids(&[1], 0, 0, None))); // factor 0
    assert!(bad(expand_block_ids(&[1], 4, 4, None))); // skip >= factor
    assert!(bad(expand_block_ids(&[1], 4, 1, Some(4)))); // count > available
    assert!(bad(expand_block_ids(&[-2], 4, 0, None))); // negative id
    assert!(bad(expand_block_ids(&[i64::MAX], 2, 0, None))); // overflow
    assert!(matches!(
        compute_sub_block_ptrs(&[1], 3, 0x1000, 64, 64, 0, None), // 64 % 3 != 0
        Err(KvoffError::InvalidArgument(_))
    ));
}

// ---------------------------------------------------------------------------------------------
// Plan validation
// ---------------------------------------------------------------------------------------------

const GPU_BASE: u64 = 0x10_0000_0000;
const CPU_BASE: u64 = 0x20_0000_0000;

/// Two tensors of 128-byte pages, GPU 100 blocks (row stride 192: padded), CPU 10 blocks, f = 4;
/// group 0 → tensor 0, group 1 → tensor 1 (only 100 of 128 bytes copied).
fn two_group_planner() -> CopyPlanner {
    let gpu = vec![
        TensorDesc::new(GPU_BASE, 100, 192, 128),
        TensorDesc::new(GPU_BASE + 0x10_0000, 100, 192, 128),
    ];
    let cpu = vec![
        TensorDesc::new(CPU_BASE, 10, 4096, 512),
        TensorDesc::new(CPU_BASE + 512, 10, 4096, 512),
    ];
    CopyPlanner::new(
        gpu,
        cpu,
        vec![vec![PlanRef::new(0, 128)], vec![PlanRef::new(1, 100)]],
        4,
    )
    .unwrap()
}

fn is_arg<T: std::fmt::Debug>(r: kvoff::Result<T>, needle: &str) {
    match r {
        Err(KvoffError::InvalidArgument(msg)) => {
            assert!(
                msg.contains(needle),
                "message {msg:?} should mention {needle:?}"
            )
        }
        other => panic!("expected InvalidArgument mentioning {needle:?}, got {other:?}"),
    }
}

#[test]
fn plan_ok_and_bytes() {
    let p = two_group_planner();
    let gpu = GpuSpec::with_groups(&[1, 2, 3, 50, 51], &[3, 2], Some(&[0, 3]));
    // group 0: 3 blocks, skip 0 → 1 CPU id; group 1: 2 blocks, skip 3 → 2 CPU ids.
    let plan = p.plan(Direction::GpuToCpu, &gpu, &[0, 1, 2]).unwrap();
    assert_eq!(plan.total_bytes(), 3 * 128 + 2 * 100);
    assert_eq!(plan.num_block_copies(), 5);
    // Padded GPU rows: nothing merges.
    assert_eq!(plan.len(), 5);
    let c = plan.copies();
    assert_eq!(
        (c[0].src_ptr, c[0].dst_ptr, c[0].bytes),
        (GPU_BASE + 192, CPU_BASE, 128)
    );
    // Group 1, first block → CPU id 1, sub-block 3.
    assert_eq!(c[3].dst_ptr, CPU_BASE + 512 + 4096 + 3 * 128);
    assert_eq!(c[4].dst_ptr, CPU_BASE + 512 + 2 * 4096);
}

#[test]
fn plan_validation_errors() {
    let p = two_group_planner();
    let d = Direction::GpuToCpu;
    let spec = |ids: &'static [i64], sizes: &'static [i64]| GpuSpec::with_groups(ids, sizes, None);
    is_arg(p.plan(d, &spec(&[100], &[1, 0]), &[0]), "out of range"); // GPU id too big
    is_arg(p.plan(d, &spec(&[-1], &[1, 0]), &[0]), "out of range"); // negative GPU id
    is_arg(p.plan(d, &spec(&[1], &[1, 0]), &[10]), "out of range"); // CPU id too big
    is_arg(p.plan(d, &spec(&[1], &[1, 0]), &[-3]), "out of range");
    is_arg(
        p.plan(d, &spec(&[1], &[1, 0]), &[]),
        "not enough CPU block ids",
    );
    is_arg(
        p.plan(d, &spec(&[1], &[1, 0]), &[1, 2]),
        "consume 1 CPU block ids but 2",
    );
    is_arg(p.plan(d, &spec(&[1, 2], &[1, 0]), &[1]), "sum to 1 but 2");
    is_arg(p.plan(d, &spec(&[1], &[2, 0]), &[1]), "sum to more");
    is_arg(
        p.plan(d, &spec(&[1], &[1]), &[1]),
        "group_sizes has 1 entries",
    );
    is_arg(p.plan(d, &spec(&[1], &[-1, 2]), &[1]), "must be >= 0");
    is_arg(
        p.plan(d, &GpuSpec::new(&[1]), &[1]),
        "group_sizes is required",
    );
    is_arg(
        p.plan(d, &GpuSpec::with_groups(&[1], &[1, 0], Some(&[0])), &[1]),
        "block_indices has 1",
    );
    is_arg(
        p.plan(
            d,
            &GpuSpec::with_groups(&[1], &[1, 0], Some(&[-4, 0])),
            &[1],
        ),
        "must be >= 0",
    );
    // Two copies into the same CPU sub-block / GPU block.
    is_arg(
        p.plan(d, &spec(&[1, 2, 3, 4, 5], &[5, 0]), &[3, 3]),
        "same destination",
    );
    is_arg(
        p.plan(Direction::CpuToGpu, &spec(&[1, 1], &[2, 0]), &[3]),
        "same destination",
    );
    // Empty groups are fine, whatever their block index.
    let e = p
        .plan(d, &GpuSpec::with_groups(&[], &[0, 0], Some(&[7, 9])), &[])
        .unwrap();
    assert!(e.is_empty());
    assert_eq!(e.total_bytes(), 0);
}

#[test]
fn planner_construction_errors() {
    let g = |n| TensorDesc::contiguous(GPU_BASE, n, 64);
    let c = |n| TensorDesc::contiguous(CPU_BASE, n, 128);
    let refs = || vec![vec![PlanRef::new(0, 64)]];
    is_arg(
        CopyPlanner::new(vec![g(4)], vec![c(4)], refs(), 0),
        "block_size_factor",
    );
    is_arg(
        CopyPlanner::new(vec![g(4)], vec![], refs(), 2),
        "one CPU tensor per GPU tensor",
    );
    is_arg(
        CopyPlanner::new(vec![g(4)], vec![c(4)], vec![vec![PlanRef::new(1, 64)]], 2),
        "tensor_idx 1 out of range",
    );
    is_arg(
        CopyPlanner::new(vec![g(4)], vec![c(4)], vec![vec![PlanRef::new(0, 65)]], 2),
        "page_size_bytes 65",
    );
    is_arg(
        CopyPlanner::new(vec![g(4)], vec![c(4)], vec![vec![PlanRef::new(0, 64)]], 3),
        "not a multiple of block_size_factor",
    );
    is_arg(
        CopyPlanner::new(
            vec![TensorDesc::new(GPU_BASE, 4, 32, 64)],
            vec![c(4)],
            refs(),
            2,
        ),
        "rows would overlap",
    );
    is_arg(
        CopyPlanner::new(
            vec![g(4)],
            vec![TensorDesc::contiguous(GPU_BASE + 64, 4, 128)],
            refs(),
            2,
        ),
        "overlaps",
    );
    is_arg(
        CopyPlanner::new(
            vec![TensorDesc::contiguous(u64::MAX - 100, 4, 64)],
            vec![c(4)],
            refs(),
            2,
        ),
        "overflows",
    );
    is_arg(
        CopyPlanner::new(
            vec![g(4)],
            vec![c(4)],
            vec![vec![PlanRef::new(0, 64), PlanRef::new(0, 32)]],
            2,
        ),
        "twice",
    );
}

#[test]
fn contiguous_copies_merge() {
    // Unpadded pages, consecutive GPU ids ↔ consecutive CPU sub-blocks → one copy.
    let gpu = vec![TensorDesc::contiguous(GPU_BASE, 64, 256)];
    let cpu = vec![TensorDesc::contiguous(CPU_BASE, 8, 256 * 4)];
    let p = CopyPlanner::new(gpu, cpu, vec![vec![PlanRef::new(0, 256)]], 4).unwrap();
    let ids: Vec<i64> = (8..16).collect();
    let plan = p
        .plan(Direction::CpuToGpu, &GpuSpec::new(&ids), &[2, 3])
        .unwrap();
    assert_eq!(plan.len(), 1);
    assert_eq!(plan.copies()[0].bytes, 8 * 256);
    assert_eq!(plan.num_block_copies(), 8);
}

// ---------------------------------------------------------------------------------------------
// Randomized byte-exact round trips GPU-side → CPU → GPU-side
// ---------------------------------------------------------------------------------------------

/// SplitMix64: small, seeded, good enough for test data.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next().to_le_bytes());
        }
        for b in chunks.into_remainder() {
            *b = self.next() as u8;
        }
    }
    /// `k` distinct values in `0..n`.
    fn distinct(&mut self, k: usize, n: u64) -> Vec<i64> {
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::with_capacity(k);
        while out.len() < k {
            let v = self.below(n);
            if seen.insert(v) {
                out.push(v as i64);
            }
        }
        out
    }
}

struct Side {
    bufs: Vec<Vec<u8>>,
    descs: Vec<TensorDesc>,
}

/// Reference model of docs/spec.md §4: for every (group, ref, block i) the GPU bytes and CPU bytes that
/// correspond; returns (tensor, gpu offset, cpu offset, bytes).
#[allow(clippy::too_many_arguments)]
fn model(
    groups: &[Vec<PlanRef>],
    gpu_desc: &[TensorDesc],
    cpu_desc: &[TensorDesc],
    f: u64,
    gpu_ids: &[i64],
    sizes: &[i64],
    indices: &[i64],
    cpu_ids: &[i64],
) -> Vec<(usize, usize, usize, usize)> {
    let mut out = Vec::new();
    let (mut go, mut co) = (0usize, 0usize);
    for (g, refs) in groups.iter().enumerate() {
        let size = sizes[g] as usize;
        if size == 0 {
            continue;
        }
        let skip = (indices[g] as u64 % f) as usize;
        for r in refs {
            let t = r.tensor_idx;
            let sub = (cpu_desc[t].row_bytes / f) as usize;
            for i in 0..size {
                let gid = gpu_ids[go + i] as usize;
                let s = skip + i;
                let cid = cpu_ids[co + s / f as usize] as usize;
                let goff = gid * gpu_desc[t].row_stride_bytes as usize;
                let coff = cid * cpu_desc[t].row_stride_bytes as usize + (s % f as usize) * sub;
                out.push((t, goff, coff, r.page_size_bytes as usize));
            }
        }
        go += size;
        co += (size + skip).div_ceil(f as usize);
    }
    out
}

fn alloc_side(
    rng: &mut Rng,
    pages: &[u64],
    num_blocks: u64,
    mult: u64,
    pad_choices: &[u64],
) -> Side {
    let mut bufs = Vec::new();
    let mut descs = Vec::new();
    for &page in pages {
        let row = page * mult;
        let stride = row + pad_choices[rng.below(pad_choices.len() as u64) as usize];
        let len = ((num_blocks - 1) * stride + row) as usize;
        let mut b = vec![0u8; len];
        rng.fill(&mut b);
        descs.push(TensorDesc::new(
            b.as_mut_ptr() as u64,
            num_blocks,
            stride,
            row,
        ));
        bufs.push(b);
    }
    Side { bufs, descs }
}

fn round_trip_case(seed: u64, engine: &mut HostEngine) {
    let mut rng = Rng(seed);
    let page_choices = [8u64, 24, 64, 200, 4096, 32 << 10, 2 << 20];
    let page = page_choices[rng.below(page_choices.len() as u64) as usize];
    // Keep each case to about BUDGET bytes per side (tests run unoptimized).
    const BUDGET: u64 = 3 << 20;
    let mut f = [1u64, 3, 4, 16][rng.below(4) as usize];
    if page * f * 4 > BUDGET {
        f = 1;
    }
    let max_tensors = 64u64.min((BUDGET / (page * f * 4)).max(1));
    let ntensors = 1 + rng.below(max_tensors) as usize;
    let pages: Vec<u64> = (0..ntensors)
        .map(|_| {
            if rng.below(4) == 0 && page < (1 << 20) {
                page * 2
            } else {
                page
            }
        })
        .collect();
    let tensor_bytes: u64 = pages.iter().sum();
    let num_gpu = (BUDGET / tensor_bytes).clamp(2, 8 + rng.below(24));
    let num_cpu = (BUDGET / (tensor_bytes * f)).clamp(2, 4 + rng.below(8));
    let mut gpu = alloc_side(&mut rng, &pages, num_gpu, 1, &[0, 0, 8, 64]);
    let cpu = alloc_side(&mut rng, &pages, num_cpu, f, &[0, 4096]);

    // Groups: 1-4, tensors dealt round-robin-ish; some refs copy only part of the page.
    let ngroups = 1 + rng.below(4) as usize;
    let mut groups: Vec<Vec<PlanRef>> = vec![Vec::new(); ngroups];
    for (t, &p) in pages.iter().enumerate() {
        let g = rng.below(ngroups as u64) as usize;
        let bytes = if rng.below(3) == 0 {
            1 + rng.below(p)
        } else {
            p
        };
        groups[g].push(PlanRef::new(t, bytes));
    }
    let planner =
        CopyPlanner::new(gpu.descs.clone(), cpu.descs.clone(), groups.clone(), f).unwrap();

    // Job: sizes (one group forced empty when there are several), unaligned block indices.
    let mut sizes = Vec::new();
    let mut indices = Vec::new();
    let mut cpu_needed = 0u64;
    let empty = if ngroups > 1 {
        rng.below(ngroups as u64) as usize
    } else {
        usize::MAX
    };
    for g in 0..ngroups {
        let idx = rng.below(40);
        let skip = idx % f;
        // Keep within the CPU blocks left (distinct CPU ids across the job) and GPU blocks.
        let cap_cpu = (num_cpu - cpu_needed) * f;
        let max_size = cap_cpu.saturating_sub(skip).min(num_gpu / ngroups as u64);
        let size = if g == empty || max_size == 0 {
            0
        } else {
            1 + rng.below(max_size)
        };
        if size > 0 {
            cpu_needed += (size + skip).div_ceil(f);
        }
        sizes.push(size as i64);
        indices.push(idx as i64);
    }
    let total_gpu: u64 = sizes.iter().map(|&s| s as u64).sum();
    let gpu_ids = rng.distinct(total_gpu as usize, num_gpu);
    let cpu_ids = rng.distinct(cpu_needed as usize, num_cpu);
    let spec = GpuSpec::with_groups(&gpu_ids, &sizes, Some(&indices));
    let pairs = model(
        &groups, &gpu.descs, &cpu.descs, f, &gpu_ids, &sizes, &indices, &cpu_ids,
    );
    let want_bytes: usize = pairs.iter().map(|p| p.3).sum();

    // Store: GPU → CPU.
    let gpu_before = gpu.bufs.clone();
    let mut cpu_expected = cpu.bufs.clone();
    for &(t, go, co, n) in &pairs {
        cpu_expected[t][co..co + n].copy_from_slice(&gpu.bufs[t][go..go + n]);
    }
    let plan = planner.plan(Direction::GpuToCpu, &spec, &cpu_ids).unwrap();
    assert_eq!(plan.total_bytes() as usize, want_bytes, "seed {seed}");
    let id = seed as i64;
    // SAFETY: the planner's descriptors describe `gpu.bufs` / `cpu.bufs`, which stay alive and
    // untouched until `wait` returns.
    unsafe { engine.submit(Job::new(id, plan)).unwrap() };
    engine.wait(&[id]).unwrap();
    let r = engine.poll();
    assert_eq!(r.len(), 1);
    assert!(
        r[0].success && r[0].bytes as usize == want_bytes,
        "seed {seed}: {r:?}"
    );
    assert!(
        gpu.bufs == gpu_before,
        "seed {seed}: store changed its source"
    );
    assert!(cpu.bufs == cpu_expected, "seed {seed}: store wrong bytes");

    // Load back into freshly randomized GPU buffers: CPU → GPU.
    for b in &mut gpu.bufs {
        rng.fill(b);
    }
    let cpu_before = cpu.bufs.clone();
    let mut gpu_expected = gpu.bufs.clone();
    for &(t, go, co, n) in &pairs {
        gpu_expected[t][go..go + n].copy_from_slice(&cpu.bufs[t][co..co + n]);
        // Round trip: the loaded bytes are the originally stored ones.
        assert_eq!(&gpu_expected[t][go..go + n], &gpu_before[t][go..go + n]);
    }
    let plan = planner.plan(Direction::CpuToGpu, &spec, &cpu_ids).unwrap();
    // SAFETY: as above.
    unsafe { engine.submit(Job::new(id, plan)).unwrap() };
    engine.wait(&[id]).unwrap();
    let r = engine.poll();
    assert!(r[0].success, "seed {seed}: {r:?}");
    assert!(
        cpu.bufs == cpu_before,
        "seed {seed}: load changed its source"
    );
    assert!(gpu.bufs == gpu_expected, "seed {seed}: load wrong bytes");
}

#[test]
fn randomized_round_trips_are_byte_exact() {
    let mut engine = HostEngine::new().unwrap();
    for seed in 0..100 {
        round_trip_case(seed, &mut engine);
    }
    engine.shutdown();
}

#[test]
fn big_job_round_trip_uses_threads() {
    // 64 tensors x 96 blocks x 4 KiB = 24 MiB: above the parallel threshold.
    let mut rng = Rng(99);
    let pages = vec![4096u64; 64];
    let gpu = alloc_side(&mut rng, &pages, 96, 1, &[0]);
    let cpu = alloc_side(&mut rng, &pages, 24, 4, &[0]);
    let groups = vec![(0..64).map(|t| PlanRef::new(t, 4096)).collect::<Vec<_>>()];
    let planner =
        CopyPlanner::new(gpu.descs.clone(), cpu.descs.clone(), groups.clone(), 4).unwrap();
    let gpu_ids = rng.distinct(96, 96);
    let cpu_ids = rng.distinct(24, 24);
    let sizes = [96i64];
    let pairs = model(
        &groups,
        &gpu.descs,
        &cpu.descs,
        4,
        &gpu_ids,
        &sizes,
        &[0],
        &cpu_ids,
    );
    let mut expected = cpu.bufs.clone();
    for &(t, go, co, n) in &pairs {
        expected[t][co..co + n].copy_from_slice(&gpu.bufs[t][go..go + n]);
    }
    let plan = planner
        .plan(Direction::GpuToCpu, &GpuSpec::new(&gpu_ids), &cpu_ids)
        .unwrap();
    assert_eq!(plan.total_bytes(), 24 << 20);
    let mut engine = HostEngine::with_threads(4).unwrap();
    // SAFETY: buffers outlive the wait and are untouched meanwhile.
    unsafe { engine.submit(Job::new(1, plan)).unwrap() };
    engine.wait(&[1]).unwrap();
    assert!(engine.poll()[0].success);
    assert!(cpu.bufs == expected);
}

#[test]
fn too_many_tensors_is_a_clean_error_not_a_hang() {
    // The overlap checks are pairwise: a hostile tensor count is refused before them.
    let n = kvoff::plan::MAX_TENSORS + 1;
    let desc = |i: usize, base: u64| TensorDesc::new(base + i as u64 * 4096, 1, 4096, 4096);
    let gpu: Vec<TensorDesc> = (0..n).map(|i| desc(i, 1 << 40)).collect();
    let cpu: Vec<TensorDesc> = (0..n).map(|i| desc(i, 1 << 44)).collect();
    let t0 = std::time::Instant::now();
    let e = CopyPlanner::new(gpu, cpu, vec![], 1).unwrap_err();
    assert!(e.to_string().contains("at most 32768"), "{e}");
    assert!(t0.elapsed() < std::time::Duration::from_secs(1));
}
