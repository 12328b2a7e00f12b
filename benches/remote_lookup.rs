//! The scheduler's side of the remote tier, from Rust (harness-less): p50 / p99 of
//! `ChainManager::lookup_prefix` over 16 keys the tier does not know (each call starts a fetch),
//! beside a reference measured in the same loop: the same call over 16 keys in the host memory of
//! a second chain whose tier has no work (its server at a port where nothing listens). As fast as
//! the loop goes ("tight"), with a pause of `PACE_US` before each call, and with a pause of 10 ms
//! (a scheduler's step); the process's CPU time over each phase. A pause is spent two ways:
//! asleep (the CPU idles: its caches and clocks go cold, as on an idle machine), and busy (the
//! thread spins, writing 1 MiB of other memory first, as a serving engine's scheduler thread
//! works or spins on the GPU's stream between its calls). `kvoff bench remote` measures the
//! same calls through Python (BENCHMARKS.md "Remote tier"); this one leaves the interpreter out.
//!
//! `cargo bench --bench remote_lookup -- [URL|-] [SECS] [PACE_US] [BLOCK_BYTES]` (defaults: `-`, a
//! private `redis-server` on loopback started here; 2 s per phase, 200 µs, 31 672 bytes).
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvoff::key::ByteKey;
use kvoff::manager::{LruManager, ManagerConfig};
use kvoff::tier::chain::{ChainConfig, ChainManager, ChainTier};
use kvoff::tier::remote::{RemoteConfig, RemoteTier};
use kvoff::tier::{Layout, VecMemory};

type Chain = ChainManager<LruManager<ByteKey>>;

fn chain(url: &str, ns: &str, blocks: usize, block: usize) -> Chain {
    let layout = Layout {
        namespace: ns.into(),
        dtype: "bfloat16".into(),
        page_sizes_bytes: vec![block as u64],
        block_size_factor: 1,
        world_size: 1,
        rank: 0,
    };
    let mut cfg = RemoteConfig::new(url, layout);
    cfg.connect_timeout = Duration::from_millis(500);
    cfg.io_timeout = Duration::from_millis(500);
    let tier = RemoteTier::open(cfg, Arc::new(VecMemory::new(blocks, block))).unwrap();
    let mut t = ChainTier::new(Box::new(tier));
    t.store_threshold = 1 << 30; // the reference's blocks stay in host memory
    ChainManager::new(
        LruManager::new(ManagerConfig::new(blocks)),
        vec![t],
        ChainConfig::default(),
    )
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * q) as usize).min(v.len() - 1)]
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let free_port = || {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    // Without a URL: a private server on loopback, killed at the end.
    let mut own = None;
    let url = match args.first() {
        Some(u) if u != "-" => u.clone(),
        _ => {
            let port = free_port();
            let child = std::process::Command::new("redis-server")
                .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
                .args(["--save", "", "--appendonly", "no"])
                .stdout(std::process::Stdio::null())
                .spawn();
            let Ok(child) = child else {
                println!("remote_lookup: no URL given and no redis-server to start");
                return;
            };
            own = Some(child);
            let t0 = Instant::now();
            while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "redis-server did not start"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            format!("redis://127.0.0.1:{port}")
        }
    };
    let url = &url;
    let secs: f64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2.0);
    let pace_us: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(200);
    let block: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(31_672);
    let dead = format!("redis://127.0.0.1:{}", free_port());
    let key = |ns: &str, i: usize| ByteKey::new(format!("{ns}-{i}\0\0\0\0").as_bytes());
    let cpu_s = || -> f64 {
        let st = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        let f: Vec<&str> = st.rsplit(") ").next().unwrap_or("").split(' ').collect();
        let t = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
        (t(11) + t(12)) / 100.0 // utime + stime, in clock ticks of 10 ms
    };
    println!("remote tier lookups at {url}: 16 unknown keys per call, {block}-byte blocks");
    // Busy pauses write one byte per cache line of this (other work's data, evicting part of the
    // caches the call would find warm), then spin until the pause is over.
    let mut other = vec![0u8; 1 << 20];
    let mut pause = |us: u64, busy: bool| {
        if us == 0 {
            return;
        }
        if !busy {
            std::thread::sleep(Duration::from_micros(us));
            return;
        }
        let t0 = Instant::now();
        for (i, b) in other.iter_mut().step_by(64).enumerate() {
            *b = b.wrapping_add(i as u8);
        }
        std::hint::black_box(&mut other);
        while t0.elapsed() < Duration::from_micros(us) {
            std::hint::spin_loop();
        }
    };
    let phases = [
        (0, false),
        (pace_us, false),
        (pace_us, true),
        (10_000, false),
        (10_000, true),
    ];
    for (pace, busy) in phases {
        let ns = format!("lk-{}-{}-{}", std::process::id(), pace, busy);
        let mut e = chain(url, &ns, 64, block);
        let mut h = chain(&dead, &format!("{ns}-ref"), 64, block);
        let ready: Vec<ByteKey> = (0..16).map(|j| key("ready", j)).collect();
        let out = h.prepare_store(&ready).unwrap().unwrap();
        h.complete_store(&out.keys_to_store, true).unwrap();
        assert_eq!(h.lookup_prefix(&ready).unwrap(), Some(16));
        let (mut up, mut rf) = (Vec::new(), Vec::new());
        let (c0, w0) = (cpu_s(), Instant::now());
        let end = Instant::now() + Duration::from_secs_f64(secs);
        let mut i = 0;
        while Instant::now() < end {
            let ks: Vec<ByteKey> = (0..16).map(|j| key(&ns, i + j)).collect();
            i += 16;
            pause(pace, busy);
            let t = Instant::now();
            std::hint::black_box(e.lookup_prefix(&ks).unwrap());
            up.push(t.elapsed().as_secs_f64() * 1e6);
            pause(pace, busy);
            let t = Instant::now();
            std::hint::black_box(h.lookup_prefix(&ready).unwrap());
            rf.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let cpu = (cpu_s() - c0) / w0.elapsed().as_secs_f64() * 100.0;
        println!(
            "{} (pause {pace} µs, {} calls, process CPU {cpu:.0}%): kvoff p50 {:.1} p99 {:.1} µs | ref p50 {:.1} p99 {:.1} µs",
            match (pace, busy) {
                (0, _) => "tight",
                (_, false) => "asleep",
                (_, true) => "busy",
            },
            up.len(),
            pct(&mut up, 0.5),
            pct(&mut up, 0.99),
            pct(&mut rf, 0.5),
            pct(&mut rf, 0.99)
        );
        e.shutdown();
        h.shutdown();
    }
    if let Some(mut c) = own {
        let _ = c.kill();
        let _ = c.wait();
    }
}
