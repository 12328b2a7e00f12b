//! A Rust inference server's KV-offloading loop, using the kvoff crate directly (no Python).
//!
//! The pieces, as a server would wire them:
//! - scheduler side: an [`ArcManager`] decides which blocks live on the host and what to evict;
//! - worker side: one call, [`OffloadingHandlers::new`] (the Rust counterpart of Python's
//!   `CpuGpuOffloadingHandlers`), sets up the host region holding the host copies (one row per CPU
//!   block, one slot per tensor page), the planner that turns block ids into a bounds-checked copy
//!   plan, and an engine per direction: CUDA engines when a GPU is present, else the host engine,
//!   with plain host memory standing in for GPU memory.
//!
//! The model: Llama-3-8B's KV shapes (32 layers × K, V = 64 tensors of 32 KiB pages per 16-token
//! block), a small GPU block pool with its own LRU prefix cache, and requests that share
//! Pareto-distributed prefixes. Blocks evicted from the GPU pool are stored on the host; a request
//! whose prefix is on the host loads it back, and every reloaded block is compared byte for byte
//! with the pattern its key was filled with.
//!
//! Run: `cargo run --release --example server_loop` (a few seconds; `-- --requests N` for more).
// Unsafe: submitting plans to engines over memory this file allocates and keeps alive.
#![allow(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use kvoff::engine::{EngineOptions, EngineTensor, JobResult, DEFAULT_COMPUTE_BUDGET_BP};
use kvoff::handlers::{HandlersConfig, OffloadingHandlers};
use kvoff::manager::{ArcManager, ManagerConfig, OffloadingManager};
use kvoff::plan::{Direction, GpuSpec, PlanRef, TensorDesc};
use kvoff::{KvoffError, Result};

#[cfg(feature = "cuda")]
use kvoff::engine::cuda::{cuda_available, CudaDevice, DeviceBuffer};

const TENSORS: usize = 64; // 32 layers × (K, V)
const PAGE_BYTES: usize = 16 * 8 * 128 * 2; // 16 tokens × 8 KV heads × head_dim 128 × bf16 = 32 KiB
const BLOCK_BYTES: usize = TENSORS * PAGE_BYTES; // 2 MiB per block

/// Workload and pool sizes (blocks of 16 tokens).
struct Config {
    requests: usize,
    blocks_per_request: usize,
    num_prefixes: u64,
    gpu_blocks: usize,
    cpu_blocks: usize,
}

/// The "GPU" KV cache: tensor `t` is `gpu_blocks` contiguous pages at `t × gpu_blocks × PAGE_BYTES`.
enum GpuMemory {
    /// Host memory standing in for GPU memory (no GPU on this machine).
    Host(Vec<u8>),
    #[cfg(feature = "cuda")]
    Cuda(DeviceBuffer),
}

impl GpuMemory {
    fn ptr(&mut self) -> u64 {
        match self {
            Self::Host(v) => v.as_mut_ptr() as u64,
            #[cfg(feature = "cuda")]
            Self::Cuda(b) => b.ptr(),
        }
    }

    #[cfg_attr(not(feature = "cuda"), allow(clippy::unnecessary_wraps))] // fails only on a GPU
    fn write(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        match self {
            Self::Host(v) => {
                v[offset..offset + data.len()].copy_from_slice(data);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Self::Cuda(b) => b.write(offset, data),
        }
    }

    #[cfg_attr(not(feature = "cuda"), allow(clippy::unnecessary_wraps))] // fails only on a GPU
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        match self {
            Self::Host(v) => {
                out.copy_from_slice(&v[offset..offset + out.len()]);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Self::Cuda(b) => b.read(offset, out),
        }
    }
}

/// splitmix64: a tiny deterministic generator (no dependencies).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    #[allow(clippy::cast_precision_loss)]
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Python's `random.paretovariate(alpha)`.
    fn pareto(&mut self, alpha: f64) -> f64 {
        (1.0 - self.unit()).powf(-1.0 / alpha)
    }
}

fn hash(parts: &[u64]) -> u64 {
    let mut r = Rng(0x006b_766f_6666);
    for &p in parts {
        r.0 ^= p;
        r.next_u64();
    }
    r.next_u64()
}

/// The bytes of tensor `t`'s page of the block with key `key` (what "prefill" writes).
fn pattern(key: u64, t: usize, out: &mut [u8]) {
    let mut r = Rng(hash(&[key, t as u64]));
    for w in out.chunks_exact_mut(8) {
        w.copy_from_slice(&r.next_u64().to_le_bytes());
    }
}

/// Requests of block keys: a shared prefix (Pareto-distributed id, random length), then unique
/// blocks. Keys are chained like block hashes: block `j` of prefix `p` is the same key everywhere.
fn make_requests(cfg: &Config, rng: &mut Rng) -> Vec<Vec<u64>> {
    (0..cfg.requests as u64)
        .map(|r| {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let p = (rng.pareto(1.2) as u64 - 1).min(cfg.num_prefixes - 1);
            let n = cfg.blocks_per_request as u64;
            let len = 2 + rng.next_u64() % (n - 1); // 2..=n blocks
            (0..n)
                .map(|j| {
                    if j < len {
                        hash(&[1, p, j])
                    } else {
                        hash(&[2, r, j])
                    }
                })
                .collect()
        })
        .collect()
}

/// Byte and time totals of one direction.
#[derive(Default)]
struct Moved {
    bytes: u64,
    seconds: f64,
    jobs: u64,
}

/// The worker side: GPU memory and kvoff's handlers (host region, planner, one engine per
/// direction), set up in one call ([`OffloadingHandlers::new`]).
struct Worker {
    /// Declared before `gpu`: dropped first (the engines drain before the GPU memory goes).
    handlers: OffloadingHandlers,
    gpu: GpuMemory,
    gpu_blocks: usize,
    next_job: i64,
    moved: [Moved; 2],
    page: Vec<u8>,
    expect: Vec<u8>,
}

impl Worker {
    fn new(gpu_blocks: usize, cpu_blocks: usize) -> Result<(Self, String)> {
        let gpu_len = gpu_blocks * BLOCK_BYTES;
        #[cfg(feature = "cuda")]
        let (mut gpu, device) = if cuda_available() {
            let dev = CudaDevice::open(0)?;
            let name = dev.name().to_owned();
            (
                GpuMemory::Cuda(DeviceBuffer::new(&dev, gpu_len)?),
                Some(name),
            )
        } else {
            (GpuMemory::Host(vec![0u8; gpu_len]), None)
        };
        #[cfg(not(feature = "cuda"))]
        let (mut gpu, device): (GpuMemory, Option<String>) =
            (GpuMemory::Host(vec![0u8; gpu_len]), None);

        // The canonical tensors: GPU tensor t = gpu_blocks pages at t × gpu_blocks × PAGE_BYTES;
        // on a CUDA device when there is one (then `auto` picks a CUDA engine), else host memory
        // standing in for GPU memory (the host engine).
        let base = gpu.ptr();
        let tensors: Vec<EngineTensor> = (0..TENSORS)
            .map(|t| {
                let desc = TensorDesc::contiguous(
                    base + (t * gpu_blocks * PAGE_BYTES) as u64,
                    gpu_blocks as u64,
                    PAGE_BYTES as u64,
                );
                match device {
                    Some(_) => EngineTensor::cuda(desc, 0),
                    None => EngineTensor::host(desc),
                }
            })
            .collect();
        // One KV-cache group whose layers are all 64 tensors; CPU block = 1 GPU block.
        let refs = vec![(0..TENSORS)
            .map(|t| PlanRef::new(t, PAGE_BYTES as u64))
            .collect()];
        let cfg = HandlersConfig {
            num_cpu_blocks: cpu_blocks as u64,
            // The environment's `KVOFF_CUDA_TUNE`, as the Python handlers apply it.
            options: EngineOptions::from_env(Some(DEFAULT_COMPUTE_BUDGET_BP)),
            ..HandlersConfig::default()
        };
        let handlers = OffloadingHandlers::new(&tensors, refs, &cfg)?;
        let what = match (&device, handlers.pin_error()) {
            (Some(name), None) => format!("{} engine on {name}", handlers.engine_name()),
            (Some(name), Some(e)) => format!(
                "{} engine on {name} (host memory not pinned: {e})",
                handlers.engine_name()
            ),
            (None, _) => "host engine (no GPU: host memory stands in for GPU memory)".to_owned(),
        };
        Ok((
            Self {
                handlers,
                gpu,
                gpu_blocks,
                next_job: 0,
                moved: [Moved::default(), Moved::default()],
                page: vec![0; PAGE_BYTES],
                expect: vec![0; PAGE_BYTES],
            },
            what,
        ))
    }

    fn gpu_offset(&self, t: usize, block: usize) -> usize {
        (t * self.gpu_blocks + block) * PAGE_BYTES
    }

    /// "Prefill": writes the key's pattern into a GPU block.
    fn compute(&mut self, block: usize, key: u64) -> Result<()> {
        for t in 0..TENSORS {
            pattern(key, t, &mut self.page);
            let off = self.gpu_offset(t, block);
            self.gpu.write(off, &self.page)?;
        }
        Ok(())
    }

    /// Whether a GPU block holds exactly the key's pattern.
    fn verify(&mut self, block: usize, key: u64) -> Result<bool> {
        for t in 0..TENSORS {
            pattern(key, t, &mut self.expect);
            let off = self.gpu_offset(t, block);
            self.gpu.read(off, &mut self.page)?;
            if self.page != self.expect {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Plans, submits and waits for one job; returns its result.
    fn transfer(&mut self, dir: Direction, gpu_ids: &[i64], cpu_ids: &[i64]) -> Result<JobResult> {
        self.next_job += 1;
        let id = self.next_job;
        // SAFETY: (1) the GPU-side tensors are `self.gpu`, alive until `self` drops (after the
        // handlers, which drain first), and we wait for the job below; (2) nothing else touches
        // those blocks until `wait` returns.
        unsafe {
            self.handlers
                .submit(id, dir, &GpuSpec::new(gpu_ids), cpu_ids, None)
        }?;
        self.handlers.wait(dir, &[id])?;
        let res = self
            .handlers
            .poll(dir)
            .into_iter()
            .find(|r| r.job_id == id)
            .ok_or_else(|| KvoffError::state("a waited job has no result"))?;
        let m = &mut self.moved[usize::from(dir == Direction::CpuToGpu)];
        m.bytes += res.bytes;
        m.seconds += res.seconds;
        m.jobs += 1;
        Ok(res)
    }
}

/// A GPU block index as the planner's id (the pool is small).
fn block_id(b: usize) -> i64 {
    i64::try_from(b).unwrap_or(i64::MAX)
}

#[allow(clippy::too_many_lines)]
fn main() -> Result<()> {
    let mut cfg = Config {
        requests: 300,
        blocks_per_request: 16,
        num_prefixes: 64,
        gpu_blocks: 32,
        cpu_blocks: 160,
    };
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--requests") {
        cfg.requests = args
            .get(i + 1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(cfg.requests);
    }
    let (mut worker, what) = Worker::new(cfg.gpu_blocks, cfg.cpu_blocks)?;
    let mut manager: ArcManager<u64> = ArcManager::try_new(ManagerConfig::new(cfg.cpu_blocks))?;
    let requests = make_requests(&cfg, &mut Rng(0));
    println!("kvoff server_loop: {what}");
    println!(
        "  KV: 64 tensors x {} KiB pages = {} MiB per 16-token block; GPU pool {} blocks, host {} blocks (ARC)",
        PAGE_BYTES >> 10,
        BLOCK_BYTES >> 20,
        cfg.gpu_blocks,
        cfg.cpu_blocks
    );

    // GPU prefix cache: key → GPU block, LRU order in `lru` (front = least recently used).
    let mut on_gpu: HashMap<u64, usize> = HashMap::new();
    let mut lru: VecDeque<u64> = VecDeque::new();
    let mut free: Vec<usize> = (0..cfg.gpu_blocks).rev().collect();
    let (mut gpu_hits, mut cpu_hits, mut computed, mut stored, mut bad) = (0, 0, 0, 0, 0);
    let t0 = Instant::now();

    for keys in &requests {
        // 1. Leading blocks already on the GPU (moved to the MRU end: safe from eviction below).
        let g = keys.iter().take_while(|k| on_gpu.contains_key(k)).count();
        for k in &keys[..g] {
            lru.retain(|x| x != k);
            lru.push_back(*k);
        }
        gpu_hits += g;
        // Later blocks are recomputed or loaded into fresh GPU blocks; drop stale GPU copies.
        for k in &keys[g..] {
            if let Some(b) = on_gpu.remove(k) {
                lru.retain(|x| x != k);
                free.push(b);
            }
        }
        // 2. The offloaded part of the prefix, pinned before any eviction can take it.
        let c = manager.lookup_prefix(&keys[g..])?.unwrap_or(0);
        let load_keys = &keys[g..g + c];
        let cpu_ids: Vec<i64> = manager
            .prepare_load(load_keys)?
            .into_iter()
            .map(i64::from)
            .collect();
        // 3. Free GPU blocks by LRU and offload the victims.
        let need = keys.len() - g;
        let mut victims = Vec::new();
        while free.len() < need {
            let k = lru
                .pop_front()
                .ok_or_else(|| KvoffError::arg("a request needs more blocks than the GPU pool"))?;
            let b = on_gpu
                .remove(&k)
                .ok_or_else(|| KvoffError::state("an LRU key is not cached"))?;
            victims.push((k, b));
            free.push(b);
        }
        let vkeys: Vec<u64> = victims.iter().map(|v| v.0).collect();
        if let Some(out) = manager.prepare_store(&vkeys)? {
            if !out.keys_to_store.is_empty() {
                let where_: HashMap<u64, usize> = victims.iter().copied().collect();
                let gids: Vec<i64> = out
                    .keys_to_store
                    .iter()
                    .map(|k| block_id(where_[k]))
                    .collect();
                let cids: Vec<i64> = out.block_ids.iter().map(|&b| i64::from(b)).collect();
                let res = worker.transfer(Direction::GpuToCpu, &gids, &cids)?;
                manager.complete_store(&out.keys_to_store, res.success)?;
                stored += if res.success { gids.len() } else { 0 };
            }
        } // `None`: the host is full of pinned blocks; the victims are simply dropped.

        // 4. Load the offloaded prefix into fresh blocks, compute the rest.
        let mut fresh: Vec<usize> = free.split_off(free.len() - need);
        fresh.reverse(); // taken from the end of `free`, last first
        if c > 0 {
            let gids: Vec<i64> = fresh[..c].iter().map(|&b| block_id(b)).collect();
            let res = worker.transfer(Direction::CpuToGpu, &gids, &cpu_ids)?;
            manager.complete_load(load_keys)?;
            assert!(res.success, "load failed: {:?}", res.error);
            // 5. Every reloaded block must hold exactly what was stored.
            for (&b, &k) in fresh[..c].iter().zip(load_keys) {
                if !worker.verify(b, k)? {
                    bad += 1;
                    worker.compute(b, k)?;
                }
            }
            cpu_hits += c;
        }
        for (&b, &k) in fresh[c..].iter().zip(&keys[g + c..]) {
            worker.compute(b, k)?;
            computed += 1;
        }
        manager.touch(keys)?;
        for (&b, &k) in fresh.iter().zip(&keys[g..]) {
            on_gpu.insert(k, b);
            lru.push_back(k);
        }
    }

    let wall = t0.elapsed().as_secs_f64();
    let total = requests.len() * cfg.blocks_per_request;
    #[allow(clippy::cast_precision_loss)]
    let pct = |n: usize| 100.0 * n as f64 / total as f64;
    println!(
        "  {} requests, {total} blocks: GPU hits {gpu_hits} ({:.1}%), loaded from host {cpu_hits} ({:.1}%), computed {computed} ({:.1}%)",
        requests.len(),
        pct(gpu_hits),
        pct(cpu_hits),
        pct(computed)
    );
    for (name, m) in [
        ("stores GPU->CPU", &worker.moved[0]),
        ("loads  CPU->GPU", &worker.moved[1]),
    ] {
        #[allow(clippy::cast_precision_loss)]
        let gbs = if m.seconds > 0.0 {
            m.bytes as f64 / m.seconds / 1e9
        } else {
            0.0
        };
        println!(
            "  {name}: {} MiB in {} jobs, {:.3} s -> {gbs:.2} GB/s",
            m.bytes >> 20,
            m.jobs,
            m.seconds
        );
    }
    let stats = manager.get_stats()?;
    println!(
        "  host cache: {} of {} blocks present ({stored} stored in total)",
        stats.num_present, stats.num_blocks
    );
    println!(
        "  verification: {} of {cpu_hits} reloaded blocks byte-identical to what was stored{}",
        cpu_hits - bad,
        if bad == 0 { " (OK)" } else { " (FAILED)" }
    );
    println!("  wall time {wall:.2} s");
    worker.handlers.shutdown();
    if bad > 0 {
        std::process::exit(1);
    }
    Ok(())
}
