//! The disk benchmark (`kvoff bench disk`, `benches/disk.rs`): the tier's write and read GB/s
//! against a plain sequential `O_DIRECT` write and read of the same bytes on the same filesystem in
//! the same run, promotion latency per block, CPU time per block, and the scheduler-side cost of a
//! lookup that hits a file.
//!
//! Method: `num_blocks` blocks of random bytes in host memory ([`AlignedRows`], 4 KiB-aligned rows as
//! in a `HostRegion`, so promotions read straight into the blocks); per repetition, in
//! turn: the tier writes them all (submitted at once, `io_threads` threads, fresh directory, every
//! write waited for), then promotes them all into a second set of blocks (checked byte for byte
//! after timing); right before each tier pass, the baseline writes (overwrites) or reads the same
//! bytes as one file sequentially with `O_DIRECT` (one thread, requests of `block_bytes` and of
//! 16 MiB; the faster is the reference). The tier runs at its capacity, so its timed writes
//! overwrite evicted files as the baseline overwrites its file; the first fill of the empty tier
//! (new files) is reported separately. Ratios are taken per repetition; medians over `reps`. CPU time is the process's user + system time (`/proc/self/stat`, 10 ms
//! ticks) over the phase, divided by the blocks. Promotion latency: one block at a time, submit →
//! completion seen by `poll`, idle tier. Lookup cost: a [`ChainManager`] with the file tier over the files just
//! written, each key's first `lookup` (host miss, file hit: `prepare_store` + queued read).
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{KvoffError, Result};
use crate::key::ByteKey;
use crate::manager::{LruManager, ManagerConfig, Presence};
use crate::tier::chain::{ChainConfig, ChainManager, ChainTier};
use crate::tier::{
    AlignedBuf, AlignedRows, BlockMemory, Completion, DirectIo, FileTier, Layout, TierConfig,
};

/// What to measure.
#[derive(Clone, Debug)]
pub struct DiskBenchConfig {
    /// Directory on the filesystem to measure (a scratch subdirectory is made and removed).
    pub dir: PathBuf,
    /// Name of the layout in the report.
    pub label: String,
    /// Page sizes of the layout (their sum is the block).
    pub page_sizes_bytes: Vec<u64>,
    /// Blocks per repetition.
    pub num_blocks: usize,
    /// Repetitions (median reported).
    pub reps: usize,
    /// I/O threads of the tier.
    pub io_threads: usize,
    /// `O_DIRECT` policy of the tier (the baseline always uses `O_DIRECT` where possible).
    pub direct_io: DirectIo,
}

/// One row of results.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DiskBenchRow {
    /// Layout name.
    pub label: String,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Blocks per repetition.
    pub num_blocks: u64,
    /// I/O threads of the tier.
    pub io_threads: u64,
    /// Whether the tier used `O_DIRECT`.
    pub direct_io: bool,
    /// Whether the baseline used `O_DIRECT`.
    pub baseline_direct_io: bool,
    /// Tier write GB/s into an empty directory (new files).
    pub fill_write_gbps: f64,
    /// Tier write GB/s at capacity (each write evicts an own file and overwrites it; 1e9 B/s,
    /// payload bytes).
    pub tier_write_gbps: f64,
    /// Tier read (promotion) GB/s.
    pub tier_read_gbps: f64,
    /// Sequential write GB/s of the same bytes (best request size).
    pub seq_write_gbps: f64,
    /// Sequential read GB/s of the same bytes (best request size).
    pub seq_read_gbps: f64,
    /// Sequential write GB/s with requests of one block (part of the reference above).
    pub seq_write_block_req_gbps: f64,
    /// Sequential read GB/s with requests of one block (part of the reference above).
    pub seq_read_block_req_gbps: f64,
    /// Scattered reference: `io_threads` threads overwriting the baseline file with block-size
    /// `O_DIRECT` requests at shuffled offsets (0 without `O_DIRECT`).
    pub scattered_write_gbps: f64,
    /// The same, reading.
    pub scattered_read_gbps: f64,
    /// Median over the repetitions of tier write / sequential write GB/s (same repetition).
    pub write_ratio: f64,
    /// Median over the repetitions of tier read / sequential read GB/s (same repetition).
    pub read_ratio: f64,
    /// Median latency of one promotion (submit → completion), microseconds.
    pub promotion_p50_us: f64,
    /// 90th percentile of the same.
    pub promotion_p90_us: f64,
    /// Process CPU time per block written, microseconds.
    pub write_cpu_us_per_block: f64,
    /// Process CPU time per block promoted, microseconds.
    pub read_cpu_us_per_block: f64,
    /// Process CPU time per block of the sequential baseline (write + read) / 2, microseconds.
    pub seq_cpu_us_per_block: f64,
    /// Scheduler-side nanoseconds per key of a lookup that hits a file.
    pub lookup_hit_ns_per_key: f64,
}

fn cpu_seconds() -> f64 {
    // utime and stime are fields 14 and 15 of /proc/self/stat, in clock ticks (USER_HZ = 100).
    let Ok(s) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    let Some(after) = s.rsplit_once(')').map(|x| x.1) else {
        return 0.0;
    };
    let f: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // After ")": state is field 3, so utime (14) is index 11 and stime (15) index 12.
    #[allow(clippy::cast_precision_loss)]
    let t = (tick(11) + tick(12)) as f64 / 100.0;
    t
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn io_err(what: &str, e: &std::io::Error) -> KvoffError {
    KvoffError::Config(format!("disk bench: {what}: {e}"))
}

fn fill_random(mem: &dyn BlockMemory, n: usize, bytes: usize, seed: u64) -> Result<()> {
    let mut x = seed | 1;
    let mut buf = vec![0u8; bytes];
    for b in 0..n {
        for c in buf.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let w = x.to_le_bytes();
            c.copy_from_slice(&w[..c.len()]);
        }
        mem.copy_in(
            u32::try_from(b).map_err(|_| KvoffError::arg("too many blocks"))?,
            &buf,
        )?;
    }
    Ok(())
}

fn key(i: usize) -> ByteKey {
    let mut k = [0u8; 36];
    k[..8].copy_from_slice(&(i as u64).to_le_bytes());
    k[8..16].copy_from_slice(&0x6b76_6f66_6662_656e_u64.to_le_bytes());
    ByteKey::new(&k)
}

fn wait_all(t: &FileTier, want: usize, nap: Duration) -> usize {
    let mut seen = 0;
    let mut ok = 0;
    while seen < want {
        let done = t.poll();
        if done.is_empty() {
            std::thread::sleep(nap);
        }
        for c in done {
            seen += 1;
            if matches!(
                c,
                Completion::Promoted { ok: true, .. } | Completion::Released { .. }
            ) {
                ok += 1;
            }
        }
    }
    ok
}

/// Sequential baseline: one file, `O_DIRECT` when accepted, requests of `req` bytes, one thread.
/// `write`: the file is written once untimed if it is new (allocation), then overwritten in place
/// (timed), the same situation as the tier's writes at capacity, which overwrite evicted files.
/// Otherwise the file is read (timed). Returns (seconds, direct).
fn sequential(
    path: &Path,
    total: usize,
    req: usize,
    src: &AlignedBuf,
    write: bool,
) -> Result<(f64, bool)> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let open = |direct: bool| {
        let mut o = std::fs::OpenOptions::new();
        if write {
            o.write(true).create(true).truncate(false);
        } else {
            o.read(true);
        }
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(path)
    };
    let (f, direct) = match open(true) {
        Ok(f) => (f, true),
        Err(_) => (open(false).map_err(|e| io_err("baseline file", &e))?, false),
    };
    if write {
        let data = &src.as_slice()[..req];
        let write_pass = || -> Result<()> {
            let mut off = 0;
            while off < total {
                let n = req.min(total - off);
                f.write_all_at(&data[..n], off as u64)
                    .map_err(|e| io_err("baseline write", &e))?;
                off += n;
            }
            Ok(())
        };
        if f.metadata().map_or(0, |m| m.len()) < total as u64 {
            write_pass()?;
        }
        let t0 = Instant::now();
        write_pass()?;
        return Ok((t0.elapsed().as_secs_f64(), direct));
    }
    let mut dst = AlignedBuf::new(req);
    let t0 = Instant::now();
    let mut off = 0;
    while off < total {
        let n = req.min(total - off);
        f.read_exact_at(&mut dst.as_mut_slice()[..n], off as u64)
            .map_err(|e| io_err("baseline read", &e))?;
        off += n;
    }
    Ok((t0.elapsed().as_secs_f64(), direct))
}

/// Second reference: `threads` threads read or overwrite the sequential baseline's file with
/// `O_DIRECT` requests of `req` bytes at shuffled offsets (the access pattern of one file per block,
/// without the files). Returns GB/s.
#[allow(clippy::many_single_char_names)]
fn scattered(path: &Path, total: usize, req: usize, threads: usize, write: bool) -> Result<f64> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let mut offs: Vec<usize> = (0..total / req).map(|i| i * req).collect();
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    for i in (1..offs.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        #[allow(clippy::cast_possible_truncation)]
        offs.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let next = AtomicUsize::new(0);
    let mut o = std::fs::OpenOptions::new();
    if write {
        o.write(true);
    } else {
        o.read(true);
    }
    o.custom_flags(libc::O_DIRECT);
    let f = o.open(path).map_err(|e| io_err("scattered baseline", &e))?;
    let t0 = Instant::now();
    let failed = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads.max(1))
            .map(|_| {
                sc.spawn(|| {
                    let mut b = AlignedBuf::new(req);
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&off) = offs.get(i) else {
                            return false;
                        };
                        let r = if write {
                            f.write_all_at(&b.as_slice()[..req], off as u64)
                        } else {
                            f.read_exact_at(&mut b.as_mut_slice()[..req], off as u64)
                        };
                        if r.is_err() {
                            return true;
                        }
                    }
                })
            })
            .collect();
        hs.into_iter().any(|h| h.join().unwrap_or(true))
    });
    if failed {
        return Err(KvoffError::state(
            "disk bench: the scattered baseline failed",
        ));
    }
    #[allow(clippy::cast_precision_loss)]
    Ok((offs.len() * req) as f64 / t0.elapsed().as_secs_f64() / 1e9)
}

/// Runs the benchmark for one layout.
///
/// # Errors
/// [`KvoffError::Config`] when the directory cannot be used; [`KvoffError::InvalidState`] when a
/// write or read failed or a promoted block differs from what was written.
#[allow(clippy::too_many_lines, clippy::cast_precision_loss)]
pub fn run(cfg: &DiskBenchConfig) -> Result<DiskBenchRow> {
    let block: usize = cfg
        .page_sizes_bytes
        .iter()
        .map(|&p| usize::try_from(p).unwrap_or(usize::MAX))
        .fold(0usize, usize::saturating_add);
    let n = cfg.num_blocks.max(1);
    let reps = cfg.reps.max(1);
    if block == 0 || block > (1 << 30) {
        return Err(KvoffError::arg("block size must be in 1 B..1 GiB"));
    }
    let scratch = cfg
        .dir
        .join(format!("kvoff-disk-bench-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(|e| io_err("scratch directory", &e))?;
    let result = run_in(cfg, &scratch, block, n, reps);
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

#[allow(
    clippy::too_many_lines,
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::similar_names
)]
fn run_in(
    cfg: &DiskBenchConfig,
    scratch: &Path,
    block: usize,
    n: usize,
    reps: usize,
) -> Result<DiskBenchRow> {
    let src = Arc::new(AlignedRows::new(n, block)?);
    fill_random(src.as_ref(), n, block, 0x5eed)?;
    let dst = Arc::new(AlignedRows::new(n, block)?);
    let layout = Layout {
        namespace: format!("bench-{}", cfg.label),
        page_sizes_bytes: cfg.page_sizes_bytes.clone(),
        block_size_factor: 1,
        dtype: "bytes".into(),
        world_size: 1,
        rank: 0,
    };
    let total = n * block;
    let bytes = total as f64;
    let mut seq_src = AlignedBuf::new(16 << 20);
    for (i, b) in seq_src.as_mut_slice().iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()[7];
    }
    let (mut tw, mut tr, mut sw, mut sr) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut wcpu, mut rcpu, mut scpu) = (Vec::new(), Vec::new(), Vec::new());
    let direct;
    let seq_direct = std::cell::Cell::new(false);
    // The tier runs at its capacity (n files), as a long-running engine's does: every timed write
    // evicts an own file and overwrites it. The first fill (new files) is timed separately.
    let dir = scratch.join("tier");
    let flen = crate::tier::file_len(block as u64);
    let tier_cfg = |mem: Arc<dyn crate::tier::BlockMemory>| {
        let mut tc = TierConfig::new(&dir, flen * n as u64, layout.clone());
        tc.io_threads = cfg.io_threads;
        tc.max_queued_writes = n + 1;
        tc.direct_io = cfg.direct_io;
        tc.rescan_interval = None;
        FileTier::open(tc, mem)
    };
    let write_all = |t: &FileTier, base: usize| -> Result<f64> {
        let t0 = Instant::now();
        for i in 0..n {
            #[allow(clippy::cast_possible_truncation)]
            if !t.submit_write(&key(base + i), i as u32) {
                return Err(KvoffError::state("disk bench: a write was refused"));
            }
        }
        wait_all(t, n, Duration::from_micros(500));
        t.flush();
        let dt = t0.elapsed().as_secs_f64();
        let s = t.stats();
        if s.write_errors > 0 || s.writes_dropped > 0 {
            return Err(KvoffError::state(format!(
                "disk bench: {} writes failed, {} dropped: {:?}",
                s.write_errors, s.writes_dropped, s.last_error
            )));
        }
        Ok(bytes / dt / 1e9)
    };
    let fill_write_gbps = {
        let mut t = tier_cfg(src.clone())?;
        direct = t.direct_io();
        let g = write_all(&t, 1 << 40)?;
        t.shutdown();
        g
    };
    let seq_path = scratch.join("seq.bin");
    let seq_total = total.next_multiple_of(4096);
    let seq_reqs = [block.next_multiple_of(4096).min(16 << 20), 16 << 20];
    // Sequential baseline, two request sizes; the faster is the reference. Measured next to the
    // tier's pass of the same direction in every repetition; the ratio is taken per repetition.
    let (mut sw_block, mut sr_block) = (Vec::new(), Vec::new());
    let seq = |write: bool, cpu: &mut Vec<f64>, at_block: &mut Vec<f64>| -> Result<f64> {
        let c0 = cpu_seconds();
        let mut best = f64::MAX;
        for (i, req) in seq_reqs.into_iter().enumerate() {
            let (t, d) = sequential(&seq_path, seq_total, req, &seq_src, write)?;
            seq_direct.set(d);
            best = best.min(t);
            if i == 0 {
                at_block.push(bytes / t / 1e9);
            }
        }
        cpu.push((cpu_seconds() - c0) / (2 * n) as f64 * 1e6);
        Ok(bytes / best / 1e9)
    };
    let (mut wr, mut rr) = (Vec::new(), Vec::new());
    let (mut xw, mut xr) = (Vec::new(), Vec::new());
    let xreq = block.next_multiple_of(4096);
    for rep in 0..reps {
        sw.push(seq(true, &mut scpu, &mut sw_block)?);
        if seq_direct.get() {
            xw.push(scattered(&seq_path, seq_total, xreq, cfg.io_threads, true)?);
        }
        let mut t = tier_cfg(src.clone())?;
        // Write.
        let c0 = cpu_seconds();
        tw.push(write_all(&t, rep * n)?);
        wcpu.push((cpu_seconds() - c0) / n as f64 * 1e6);
        if t.stats().own_files != n as u64 {
            return Err(KvoffError::state(
                "disk bench: the tier is not at its capacity",
            ));
        }
        t.shutdown();
        drop(t);
        // Read (promote) into the second memory.
        sr.push(seq(false, &mut scpu, &mut sr_block)?);
        if seq_direct.get() {
            xr.push(scattered(
                &seq_path,
                seq_total,
                xreq,
                cfg.io_threads,
                false,
            )?);
        }
        let t = tier_cfg(dst.clone())?;
        let c0 = cpu_seconds();
        let t0 = Instant::now();
        for i in 0..n {
            #[allow(clippy::cast_possible_truncation)]
            if !t.submit_read(&key(rep * n + i), i as u32) {
                return Err(KvoffError::state(format!(
                    "disk bench: the file of block {i} was not indexed after restart"
                )));
            }
        }
        let ok = wait_all(&t, n, Duration::from_micros(500));
        let dt = t0.elapsed().as_secs_f64();
        rcpu.push((cpu_seconds() - c0) / n as f64 * 1e6);
        if ok != n {
            return Err(KvoffError::state(format!(
                "disk bench: {} of {n} promotions failed",
                n - ok
            )));
        }
        tr.push(bytes / dt / 1e9);
        for i in 0..n {
            #[allow(clippy::cast_possible_truncation)]
            let (mut a, mut b) = (vec![0u8; block], vec![0u8; block]);
            src.copy_out(i as u32, &mut a)?;
            dst.copy_out(i as u32, &mut b)?;
            if a != b {
                return Err(KvoffError::state(format!(
                    "disk bench: promoted block {i} differs"
                )));
            }
        }
        drop(t);
        wr.push(tw[rep] / sw[rep]);
        rr.push(tr[rep] / sr[rep]);
    }
    // Promotion latency, one block at a time, and the lookup cost, over one more set of files.
    let dir = scratch.join("latency");
    let mut tc = TierConfig::new(&dir, u64::MAX, layout.clone());
    tc.io_threads = cfg.io_threads;
    tc.max_queued_writes = n + 1;
    tc.direct_io = cfg.direct_io;
    tc.rescan_interval = None;
    let src_dyn: Arc<dyn crate::tier::BlockMemory> = src.clone();
    let mut t = FileTier::open(tc.clone(), src_dyn)?;
    for i in 0..n {
        #[allow(clippy::cast_possible_truncation)]
        let _ = t.submit_write(&key(i), i as u32);
    }
    wait_all(&t, n, Duration::from_micros(500));
    t.flush();
    t.shutdown();
    drop(t);
    let dst_dyn: Arc<dyn crate::tier::BlockMemory> = dst.clone();
    let t = FileTier::open(tc.clone(), dst_dyn)?;
    let mut lat = Vec::new();
    for i in 0..n.min(64) {
        let t0 = Instant::now();
        #[allow(clippy::cast_possible_truncation)]
        let _ = t.submit_read(&key(i), i as u32);
        wait_all(&t, 1, Duration::from_micros(20));
        lat.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    drop(t);
    lat.sort_by(f64::total_cmp);
    let p = |q: f64| {
        lat.get(((lat.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or(0.0)
    };
    let dst_dyn: Arc<dyn crate::tier::BlockMemory> = dst.clone();
    let tier = FileTier::open(tc, dst_dyn)?;
    let host = LruManager::new(ManagerConfig::new(n));
    let mut m = ChainManager::new(
        host,
        vec![ChainTier::new(Box::new(tier))],
        ChainConfig::default(),
    );
    let keys: Vec<ByteKey> = (0..n).map(key).collect();
    let t0 = Instant::now();
    for k in &keys {
        if m.lookup(k)? != Presence::Pending {
            return Err(KvoffError::state(
                "disk bench: a lookup of a file did not answer pending",
            ));
        }
    }
    let lookup_ns = t0.elapsed().as_secs_f64() * 1e9 / n as f64;
    m.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
    let (tw, tr, sw, sr) = (
        median(&mut tw),
        median(&mut tr),
        median(&mut sw),
        median(&mut sr),
    );
    Ok(DiskBenchRow {
        label: cfg.label.clone(),
        block_bytes: block as u64,
        num_blocks: n as u64,
        io_threads: cfg.io_threads as u64,
        direct_io: direct,
        baseline_direct_io: seq_direct.get(),
        fill_write_gbps,
        tier_write_gbps: tw,
        tier_read_gbps: tr,
        seq_write_gbps: sw,
        seq_read_gbps: sr,
        seq_write_block_req_gbps: median(&mut sw_block),
        seq_read_block_req_gbps: median(&mut sr_block),
        scattered_write_gbps: median(&mut xw),
        scattered_read_gbps: median(&mut xr),
        write_ratio: median(&mut wr),
        read_ratio: median(&mut rr),
        promotion_p50_us: p(0.5),
        promotion_p90_us: p(0.9),
        write_cpu_us_per_block: median(&mut wcpu),
        read_cpu_us_per_block: median(&mut rcpu),
        seq_cpu_us_per_block: median(&mut scpu),
        lookup_hit_ns_per_key: lookup_ns,
    })
}
