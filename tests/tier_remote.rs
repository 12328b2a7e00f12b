//! The remote tier (docs/tier.md "Remote tier") against a real `redis-server` (Debian's, started here
//! on loopback at a random port, no persistence; the test command installs it — without it these
//! tests print why they skip): round trips through the tier chain, values that must not be served,
//! the password, and the faults of docs/tier.md "Remote tier: faults" (server killed, restarted
//! empty or with its data, stopped, stalled, evicting, a Cluster master killed). Every test is
//! bounded in time; the tests of this file run one at a time (a global lock), so the fd and thread
//! counts they compare are this file's.
// Tests: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvoff::key::ByteKey;
use kvoff::manager::BlockId;
use kvoff::manager::{LruManager, ManagerConfig};
use kvoff::tier::chain::{ChainConfig, ChainManager, ChainTier};
use kvoff::tier::remote::{redact, RemoteConfig, RemoteTier, INDEX_CAP};
use kvoff::tier::secondary::{Known, SecondaryTier};
use kvoff::tier::{FileTier, Layout, TierConfig, VecMemory};
use kvoff::KvoffError;

const BLOCK: usize = 8192;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The server to run: `$KVOFF_REDIS_SERVER` (the test command sets it to run these tests against
/// Valkey too), else `redis-server`.
fn server_bin() -> std::ffi::OsString {
    std::env::var_os("KVOFF_REDIS_SERVER").unwrap_or_else(|| "redis-server".into())
}

/// The client tool: `$KVOFF_REDIS_CLI`, else `redis-cli`.
fn cli_bin() -> std::ffi::OsString {
    std::env::var_os("KVOFF_REDIS_CLI").unwrap_or_else(|| "redis-cli".into())
}

fn have_redis() -> bool {
    let ok = Command::new(server_bin())
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        // The test command installs it and sets KVOFF_REQUIRE_REDIS: there a missing server is a
        // failure, not a skip that reports as a pass.
        assert!(
            std::env::var_os("KVOFF_REQUIRE_REDIS").is_none(),
            "redis-server is not installed, and KVOFF_REQUIRE_REDIS is set"
        );
        eprintln!("SKIP: redis-server is not installed (the test command installs Debian's)");
    }
    ok
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvoff-remote-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// One `redis-server` process on loopback; killed (SIGKILL) on drop.
struct Server {
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
    child: Option<Child>,
}

impl Server {
    fn start(tag: &str, extra: &[&str]) -> Self {
        let mut s = Self {
            port: free_port(),
            dir: tmpdir(tag),
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            child: None,
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new(server_bin());
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(cmd.spawn().unwrap());
        let t0 = Instant::now();
        loop {
            let r = self.cli(&["PING"]);
            if r.trim() == "PONG" || r.contains("NOAUTH") {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new(cli_bin())
            .args(["-p", &self.port.to_string(), "--no-auth-warning"])
            .args(args)
            .output()
            .unwrap();
        let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
        s.push_str(&String::from_utf8_lossy(&out.stderr));
        s
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().unwrap().id().to_string();
        assert!(Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success());
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Server {
    /// Calls of `cmd` (lower case) the server has served, from `INFO commandstats`.
    fn calls(&self, cmd: &str) -> u64 {
        let info = self.cli(&["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{cmd}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn layout(ns: &str) -> Layout {
    Layout {
        namespace: ns.into(),
        dtype: "bfloat16".into(),
        page_sizes_bytes: vec![BLOCK as u64],
        block_size_factor: 1,
        world_size: 1,
        rank: 0,
    }
}

fn quick(mut c: RemoteConfig) -> RemoteConfig {
    c.connect_timeout = Duration::from_millis(300);
    c.io_timeout = Duration::from_millis(500);
    c.negative_ttl = Duration::from_millis(200);
    c.backoff_min = Duration::from_millis(50);
    c.backoff_max = Duration::from_millis(400);
    c
}

type Chain = ChainManager<LruManager<ByteKey>>;

fn chain(url: &str, ns: &str, blocks: usize) -> (Chain, Arc<VecMemory>) {
    let mem = Arc::new(VecMemory::new(blocks, BLOCK));
    let tier = RemoteTier::open(quick(RemoteConfig::new(url, layout(ns))), mem.clone()).unwrap();
    let m = ChainManager::new(
        LruManager::new(ManagerConfig::new(blocks)),
        vec![ChainTier::new(Box::new(tier))],
        ChainConfig::default(),
    );
    (m, mem)
}

fn key(i: usize) -> ByteKey {
    ByteKey::new(format!("block-{i:06}").as_bytes())
}

fn pattern(i: usize) -> Vec<u8> {
    (0..BLOCK).map(|j| (i * 31 + j * 7) as u8).collect()
}

/// Stores `keys` through the chain (host block filled, then complete_store → write-through).
fn store(m: &mut Chain, mem: &VecMemory, keys: &[usize]) {
    let ks: Vec<ByteKey> = keys.iter().map(|&i| key(i)).collect();
    let out = m.prepare_store(&ks).unwrap().expect("room");
    for (k, b) in out.keys_to_store.iter().zip(&out.block_ids) {
        let i = keys[ks.iter().position(|x| x == k).unwrap()];
        mem.set_block(*b, &pattern(i)).unwrap();
    }
    m.complete_store(&out.keys_to_store, true).unwrap();
}

/// Polls `lookup_prefix` until it answers (bounded); returns the answer.
fn settle(m: &mut Chain, keys: &[ByteKey], limit: Duration) -> usize {
    let t0 = Instant::now();
    loop {
        if let Some(n) = m.lookup_prefix(keys).unwrap() {
            return n;
        }
        assert!(t0.elapsed() < limit, "lookup stayed pending for {limit:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn check_loaded(m: &mut Chain, mem: &VecMemory, idx: &[usize]) {
    let ks: Vec<ByteKey> = idx.iter().map(|&i| key(i)).collect();
    let ids = m.prepare_load(&ks).unwrap();
    for (&i, b) in idx.iter().zip(ids) {
        assert_eq!(
            mem.block(b).unwrap(),
            pattern(i),
            "block {i} served wrong bytes"
        );
    }
    m.complete_load(&ks).unwrap();
}

/// Engine A with blocks `0..n` stored and written through (flushed); the indices and keys.
fn stored_prefix(url: &str, ns: &str, n: usize) -> (Chain, Vec<usize>, Vec<ByteKey>) {
    let (mut a, mem_a) = chain(url, ns, n);
    let idx: Vec<usize> = (0..n).collect();
    store(&mut a, &mem_a, &idx);
    a.flush();
    let ks = idx.iter().map(|&i| key(i)).collect();
    (a, idx, ks)
}

fn remote_stats(m: &mut Chain) -> kvoff::tier::chain::ChainTierStats {
    m.get_stats().unwrap().1.pop().unwrap()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[test]
fn round_trip_between_two_engines() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("rt", &[]);
    let (mut a, mem_a) = chain(&srv.url(), "model-a", 16);
    store(&mut a, &mem_a, &[0, 1, 2, 3, 4, 5]);
    a.flush();
    a.poll().unwrap();
    let s = remote_stats(&mut a);
    assert_eq!(s.tier.writes, 6, "{s:?}");
    assert_eq!(s.tier.bytes_written, 6 * BLOCK as u64);
    // Every write pin was released.
    assert_eq!(a.get_stats().unwrap().0.num_evictable, 6);

    // Engine B: its own host memory, same server.
    let (mut b, mem_b) = chain(&srv.url(), "model-a", 16);
    let ks: Vec<ByteKey> = (0..8).map(key).collect();
    // The first lookup answers pending (one batched fetch of the prefix runs) ...
    assert_eq!(b.lookup_prefix(&ks).unwrap(), None);
    // ... and settles at the 6 stored blocks (the 7th is a remembered miss).
    assert_eq!(settle(&mut b, &ks, Duration::from_secs(5)), 6);
    check_loaded(&mut b, &mem_b, &[0, 1, 2, 3, 4, 5]);
    let s = remote_stats(&mut b);
    assert_eq!(s.chain.fetches, 1, "one batched fetch: {s:?}");
    assert_eq!(s.tier.promotions, 6);
    assert_eq!(s.tier.rejected, 0);
    assert!(s.chain.hits >= 6);
    // Another namespace (another model) sees nothing.
    let (mut c, _) = chain(&srv.url(), "model-b", 16);
    assert_eq!(settle(&mut c, &ks, Duration::from_secs(5)), 0);
    for m in [&mut a, &mut b, &mut c] {
        m.shutdown();
    }
}

/// A long prefix: the first lookup starts the fetch of the first key's batch; once the server is
/// seen to hold it, readahead reads the rest straight into host blocks, with no fetch (docs/tier.md
/// "Tier chain"); every block arrives byte for byte, each key asked for once; without readahead
/// one batch per lookup that reaches a new unknown key.
#[test]
fn readahead_keeps_the_prefix_in_flight() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("ra", &[]);
    let n = 200;
    let (mut a, idx, ks) = stored_prefix(&srv.url(), "ra", n);

    let (mut b, mem_b) = chain(&srv.url(), "ra", n);
    assert_eq!(b.lookup_prefix(&ks).unwrap(), None);
    let s = remote_stats(&mut b);
    // The first key's batch of 64 keys; readahead waits until the server is seen to hold the
    // prefix (no host block reserved for a prefix that may be nowhere).
    assert_eq!((s.chain.fetches, s.chain.fetch_keys), (1, 64), "{s:?}");
    assert_eq!(s.chain.promotions_started, 0, "{s:?}");
    // Once the first key is found and promoting, the next lookup reads the rest of the prefix
    // straight into host blocks, with no fetch before: all of it in flight at once.
    let t0 = Instant::now();
    while b.num_promoting() == 0 {
        assert_eq!(b.lookup_prefix(&ks).unwrap(), None);
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the first batch never came"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let s = remote_stats(&mut b);
    // (The keys of the first batch are promoted as their fetch jobs end.)
    assert!(s.chain.promotions_started >= n as u64 - 64, "{s:?}");
    assert_eq!(s.chain.fetch_keys, 64, "{s:?}");
    assert_eq!(settle(&mut b, &ks, Duration::from_secs(10)), n);
    check_loaded(&mut b, &mem_b, &idx);
    let s = remote_stats(&mut b);
    assert_eq!(s.tier.promotions, n as u64, "{s:?}");
    // Each key asked for once: 64 by the fetch, the rest by their reads.
    assert_eq!(s.tier.fetch_hits, n as u64, "{s:?}");
    assert_eq!((s.chain.hits, s.chain.misses), (n as u64, 0), "{s:?}");
    assert_eq!(s.tier.read_errors, 0, "{s:?}");
    assert_eq!(s.chain.fetch_keys, 64, "{s:?}");

    // Without readahead: one batch per lookup that reaches a new unknown key.
    let mem_c = Arc::new(VecMemory::new(n, BLOCK));
    let tier = RemoteTier::open(
        quick(RemoteConfig::new(srv.url(), layout("ra"))),
        mem_c.clone(),
    )
    .unwrap();
    let mut c = ChainManager::new(
        LruManager::new(ManagerConfig::new(n)),
        vec![ChainTier::new(Box::new(tier))],
        ChainConfig {
            readahead_keys: 0,
            ..ChainConfig::default()
        },
    );
    assert_eq!(c.lookup_prefix(&ks).unwrap(), None);
    let s = remote_stats(&mut c);
    assert_eq!((s.chain.fetches, s.chain.fetch_keys), (1, 64), "{s:?}");
    assert_eq!(settle(&mut c, &ks, Duration::from_secs(10)), n);
    check_loaded(&mut c, &mem_c, &idx);
    for m in [&mut a, &mut b, &mut c] {
        m.shutdown();
    }
}

/// Readahead's reads of keys the tier did not know (straight into host blocks, as `MGET`s on
/// one server): a key missing from the server is a miss (counted as one, not as a failed
/// promotion, its host block given back, remembered as absent), a value another client damaged
/// is rejected, deleted and never served, and every other block arrives byte for byte.
#[test]
fn readahead_reads_of_unknown_keys_miss_and_reject_cleanly() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("rd", &[]);
    let calls = |cmd: &str| srv.calls(cmd);
    let n = 200;
    let (mut a, _, ks) = stored_prefix(&srv.url(), "rd", n);
    let (mut b, mem_b) = chain(&srv.url(), "rd", n);
    let (hole, bad) = (100, 150);
    let rk = |i: usize| match b.tier_as::<RemoteTier>() {
        Some(t) => t.redis_key(&key(i)),
        None => unreachable!("the chain's tier is remote"),
    };
    let (k_hole, k_bad) = (rk(hole), rk(bad));
    assert_eq!(srv.cli(&["DEL", &k_hole]).trim(), "1");
    srv.cli(&["SETRANGE", &k_bad, "4000", "XXXX"]); // a payload byte range, header intact
    let gets = calls("get");

    // Ready up to the hole; the keys after it were read too (the whole prefix was in flight).
    assert_eq!(settle(&mut b, &ks, Duration::from_secs(10)), hole);
    check_loaded(&mut b, &mem_b, &(0..hole).collect::<Vec<_>>());
    b.flush();
    let s = remote_stats(&mut b);
    assert_eq!(
        s.chain.fetch_keys, 64,
        "only the first batch was fetched: {s:?}"
    );
    assert_eq!(
        s.tier.read_errors, 0,
        "a missing or damaged value is no read error: {s:?}"
    );
    assert_eq!(s.tier.rejected, 1, "{s:?}");
    assert_eq!(s.tier.fetch_misses, 2, "{s:?}");
    assert_eq!(s.chain.promotions_failed, 0, "{s:?}");
    assert_eq!(s.tier.promotions, n as u64 - 2, "{s:?}");
    assert_eq!(b.num_promoting(), 0);
    assert_eq!(
        calls("get"),
        gets,
        "reads of small values on one server go as MGETs"
    );
    // The damaged value is deleted; the hole and it are remembered as absent.
    assert_eq!(srv.cli(&["EXISTS", &k_bad]).trim(), "0");
    assert_eq!(b.lookup_prefix(&ks[hole..=hole]).unwrap(), Some(0));
    assert_eq!(b.lookup_prefix(&ks[bad..=bad]).unwrap(), Some(0));
    // The blocks between them were promoted and are served byte for byte.
    assert_eq!(
        b.lookup_prefix(&ks[hole + 1..]).unwrap(),
        Some(bad - hole - 1)
    );
    check_loaded(&mut b, &mem_b, &(hole + 1..bad).collect::<Vec<_>>());
    assert_eq!(b.lookup_prefix(&ks[bad + 1..]).unwrap(), Some(n - bad - 1));
    check_loaded(&mut b, &mem_b, &(bad + 1..n).collect::<Vec<_>>());
    // The two failed reads gave their host blocks back: n - 2 keys in host memory.
    let host = b.get_stats().unwrap().0;
    assert_eq!((host.num_present, host.num_free), (n - 2, 2), "{host:?}");
    a.shutdown();
    b.shutdown();
}

/// Fetches queued one key at a time (vLLM's connector looks up each block of a request in turn)
/// are merged by the I/O thread into jobs of up to 256 KiB of values: one `MGET` for many keys.
/// The server is paused (`CLIENT PAUSE`) while the single-key fetches queue up behind the first.
#[test]
fn single_key_fetches_share_mgets() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("merge", &[]);
    let calls = |cmd: &str| srv.calls(cmd);
    let n = 64;
    let (mut a, _, ks) = stored_prefix(&srv.url(), "merge", n);
    let mut cfg = quick(RemoteConfig::new(srv.url(), layout("merge")));
    cfg.io_threads = 1;
    let tier = RemoteTier::open(cfg, Arc::new(VecMemory::new(n, BLOCK))).unwrap();
    // Connected first (a miss), so that the paused server holds the next command.
    assert_eq!(tier.submit_fetch(&[key(1000)]), 1);
    tier.flush();
    let (gets, mgets) = (calls("get"), calls("mget"));
    srv.cli(&["CLIENT", "PAUSE", "300", "ALL"]);
    for k in &ks {
        assert_eq!(tier.submit_fetch(std::slice::from_ref(k)), 1);
    }
    // While the fetches wait on the paused server, the index says so, and asking again starts
    // nothing.
    for k in &ks {
        assert_eq!(tier.index(k), Known::Pending);
    }
    assert_eq!(tier.submit_fetch(&ks), 0);
    tier.flush();
    let _ = tier.poll();
    let c = tier.counters();
    assert_eq!((c.fetch_hits, c.fetch_errors), (n as u64, 0), "{c:?}");
    let per_job = (256 << 10) / tier.value_len();
    let (gets, mgets) = (calls("get") - gets, calls("mget") - mgets);
    assert!(gets <= 1, "{gets} GETs");
    assert!(
        mgets as usize <= (n - 1).div_ceil(per_job) + 1,
        "{mgets} MGETs for {n} keys in jobs of up to {per_job}"
    );
    for k in &ks {
        assert_eq!(tier.index(k), Known::Present);
    }
    a.shutdown();
}

/// Fetch jobs hold at most 32 keys however small the values (the scheduler's thread applies a
/// job's results in one call): 100 single-key fetches of 1.6 KB values queued behind a paused
/// server, which 256 KiB jobs alone would merge into one `MGET`, go as `MGET`s of up to 32 keys.
#[test]
fn fetch_jobs_hold_at_most_32_keys() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("cap", &[]);
    let n = 100;
    let small = Layout {
        page_sizes_bytes: vec![512],
        ..layout("cap")
    };
    let mut cfg = quick(RemoteConfig::new(srv.url(), small));
    cfg.io_threads = 1;
    let tier = RemoteTier::open(cfg, Arc::new(VecMemory::new(4, 512))).unwrap();
    assert!(
        (256 << 10) / tier.value_len() > n,
        "values of {} B",
        tier.value_len()
    );
    // Connected first (a miss), so that the paused server holds the next command.
    assert_eq!(tier.submit_fetch(&[key(1000)]), 1);
    tier.flush();
    let mgets = srv.calls("mget");
    srv.cli(&["CLIENT", "PAUSE", "300", "ALL"]);
    for i in 0..n {
        assert_eq!(tier.submit_fetch(&[key(i)]), 1);
    }
    tier.flush();
    let _ = tier.poll();
    let c = tier.counters();
    assert_eq!((c.fetch_misses, c.fetch_errors), (n as u64 + 1, 0), "{c:?}");
    // The first key's job may have been taken alone before the others queued.
    let mgets = (srv.calls("mget") - mgets) as usize;
    assert!(
        ((n - 1).div_ceil(32)..=(n - 1).div_ceil(32) + 1).contains(&mgets),
        "{mgets} MGETs for {n} keys"
    );
}

/// I/O threads that keep looking at the queues once they run out of jobs
/// (`RemoteConfig::idle_spin`) take the jobs queued meanwhile — the scheduler's side then rings
/// no bell, so nothing else would wake a thread for them — and stop at once at shutdown, however
/// long they would still spin.
#[test]
fn spinning_threads_take_jobs_and_stop_at_shutdown() {
    // One key at a time, each queued while the threads spin after the last one.
    idle_threads_take_jobs_one_at_a_time(
        "spin",
        |cfg| cfg.idle_spin = Duration::from_secs(60),
        |i| if i % 4 == 0 { 20 } else { 0 },
        "threads spinning",
    );
}

/// Opens a tier of `ns` on a server holding 16 blocks, with 1 and then 3 I/O threads set up by
/// `idle` for how they look at the queues when idle; fetches each key alone after a pause of
/// `pause_ms(i)`; asserts that every fetch is answered (a job no thread took would wait for an
/// idle thread's periodic look, 500 ms: 16 of them, 8 s) and that shutdown is prompt.
fn idle_threads_take_jobs_one_at_a_time(
    ns: &str,
    idle: impl Fn(&mut RemoteConfig),
    pause_ms: impl Fn(usize) -> u64,
    how: &str,
) {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start(ns, &[]);
    let n = 16;
    let (mut a, _, ks) = stored_prefix(&srv.url(), ns, n);
    for threads in [1, 3] {
        let mut cfg = quick(RemoteConfig::new(srv.url(), layout(ns)));
        cfg.io_threads = threads;
        idle(&mut cfg);
        let mut tier = RemoteTier::open(cfg, Arc::new(VecMemory::new(n, BLOCK))).unwrap();
        let t_all = Instant::now();
        for (i, k) in ks.iter().enumerate() {
            std::thread::sleep(Duration::from_millis(pause_ms(i)));
            assert_eq!(tier.submit_fetch(std::slice::from_ref(k)), 1);
            let deadline = Instant::now() + Duration::from_secs(10);
            while tier.index(k) != Known::Present {
                assert!(
                    Instant::now() < deadline,
                    "key {i} was never fetched ({threads} threads)"
                );
                std::thread::yield_now();
            }
        }
        assert!(
            t_all.elapsed() < Duration::from_secs(4),
            "{n} fetches one at a time took {:?} ({threads} threads)",
            t_all.elapsed()
        );
        let t0 = Instant::now();
        tier.shutdown();
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "shutdown took {:?} with {how}",
            t0.elapsed()
        );
    }
    a.shutdown();
}

/// One napping I/O thread (`RemoteConfig::idle_nap`: no spin, a look at the queues every 2 ms
/// for up to a minute after its last job) takes the jobs queued while it naps — the scheduler's
/// side rings no bell then — also after pauses longer than a nap, and stops at shutdown within a
/// nap.
#[test]
fn napping_thread_takes_jobs_and_stops_at_shutdown() {
    idle_threads_take_jobs_one_at_a_time(
        "nap",
        |cfg| {
            cfg.idle_spin = Duration::ZERO;
            cfg.idle_nap = Duration::from_millis(2);
            cfg.idle_nap_for = Duration::from_secs(60);
        },
        |i| if i % 4 == 0 { 20 } else { i as u64 % 3 },
        "a thread napping",
    );
}

/// A fetch queued while the only thread looking at the queues naps far longer than usual (as a
/// thread whose CPU was taken from it does) is not left to wait for it: a scheduler's call a
/// little later rings for another thread.
#[test]
fn a_job_left_by_a_stalled_napper_gets_a_wake_up() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("stall", &[]);
    let mut cfg = quick(RemoteConfig::new(srv.url(), layout("stall")));
    cfg.io_threads = 2;
    cfg.idle_spin = Duration::ZERO;
    cfg.idle_nap = Duration::from_secs(2);
    cfg.idle_nap_for = Duration::from_secs(60);
    let mut tier = RemoteTier::open(cfg, Arc::new(VecMemory::new(4, BLOCK))).unwrap();
    // Both threads idle: one naps (2 s between looks), the other waits for a wake-up (or its
    // periodic look, every 500 ms: eight fetches answered within 200 ms each by that alone would
    // be chance, 0.4^8).
    std::thread::sleep(Duration::from_millis(100));
    for i in 0..8 {
        let t0 = Instant::now();
        assert_eq!(tier.submit_fetch(&[key(i)]), 1);
        while tier.index(&key(i)) != Known::Absent {
            assert!(
                t0.elapsed() < Duration::from_millis(200),
                "fetch {i} waited for the napping thread"
            );
            let _ = tier.poll();
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    tier.shutdown();
}

/// A prefix looked up one key at a time, in order (vLLM's connector), with each key's
/// predecessor (`lookup_after`): one fetch for its first key, the rest read straight into host
/// blocks once the server is seen to hold the prefix, byte for byte; a prefix nowhere costs one
/// fetch; a key missing in the middle ends the prefix there as a miss (its host block given
/// back).
#[test]
fn keys_one_at_a_time_fetch_once_per_prefix() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("one", &[]);
    let n = 12;
    let (mut a, idx, ks) = stored_prefix(&srv.url(), "one", n);
    // One scheduler step: each key after its predecessor, up to the first absent one; the keys
    // ready at the start of the run, or `None` while any is pending.
    let scan = |m: &mut Chain, ks: &[ByteKey]| -> Option<usize> {
        let mut pending = false;
        for (i, k) in ks.iter().enumerate() {
            let p = if i == 0 {
                m.lookup(k).unwrap()
            } else {
                m.lookup_after(k, &ks[i - 1]).unwrap()
            };
            match p {
                kvoff::manager::Presence::Ready => {}
                kvoff::manager::Presence::Pending => pending = true,
                kvoff::manager::Presence::Absent => return (!pending).then_some(i),
            }
        }
        (!pending).then_some(ks.len())
    };
    let settle_scan = |m: &mut Chain, ks: &[ByteKey]| -> usize {
        let t0 = Instant::now();
        loop {
            if let Some(r) = scan(m, ks) {
                return r;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "stayed pending");
            std::thread::sleep(Duration::from_millis(2));
        }
    };

    let (mut b, mem_b) = chain(&srv.url(), "one", 64);
    assert_eq!(scan(&mut b, &ks), None);
    assert_eq!(
        remote_stats(&mut b).chain.fetch_keys,
        1,
        "only the first key is fetched"
    );
    assert_eq!(settle_scan(&mut b, &ks), n);
    check_loaded(&mut b, &mem_b, &idx);
    let s = remote_stats(&mut b);
    assert_eq!(s.chain.fetch_keys, 1, "{s:?}");
    assert_eq!(
        (s.tier.promotions, s.chain.hits, s.chain.misses),
        (n as u64, n as u64, 0),
        "{s:?}"
    );
    assert_eq!(s.tier.read_errors, 0, "{s:?}");

    // A prefix the server does not hold: one fetch, a miss, nothing reserved.
    let none: Vec<ByteKey> = (1000..1000 + n).map(key).collect();
    let before = remote_stats(&mut b).chain.fetch_keys;
    assert_eq!(settle_scan(&mut b, &none), 0);
    assert_eq!(remote_stats(&mut b).chain.fetch_keys, before + 1);
    assert_eq!(b.num_promoting(), 0);

    // A key missing in the middle: the prefix ends there (a miss, its host block given back).
    let (mut c, mem_c) = chain(&srv.url(), "one", 64);
    let hole = 5;
    let rk = c.tier_as::<RemoteTier>().unwrap().redis_key(&key(hole));
    assert_eq!(srv.cli(&["DEL", &rk]).trim(), "1");
    // The first scan fetches the first key. Once its answer is in, the server is paused while
    // the next scan looks at every key, so no read ends during that scan (the hole's miss
    // included): each key's predecessor is being read when the key is looked up, and the keys
    // after the hole are read too, as readahead reads them.
    assert_eq!(scan(&mut c, &ks), None);
    c.flush();
    srv.cli(&["CLIENT", "PAUSE", "300", "ALL"]);
    assert_eq!(scan(&mut c, &ks), None);
    // (The first key's fetched value may already be in its host block: no network.)
    assert!(
        c.num_promoting() >= n - 1,
        "the keys after the first are being read"
    );
    assert_eq!(settle_scan(&mut c, &ks), hole);
    check_loaded(&mut c, &mem_c, &idx[..hole]);
    c.flush();
    let s = remote_stats(&mut c);
    assert_eq!(
        (s.tier.read_errors, s.chain.promotions_failed),
        (0, 0),
        "{s:?}"
    );
    assert!(s.chain.misses >= 1, "{s:?}");
    // (The keys after it were read too: see the paused scan above.)
    let host = c.get_stats().unwrap().0;
    assert_eq!(host.num_present, n - 1, "{host:?}");
    for m in [&mut a, &mut b, &mut c] {
        m.shutdown();
    }
}

/// Readahead stays within the tier's staging room (no value fetched without room to keep it, so
/// none twice) and resumes past where it stopped once promotions free the room.
#[test]
fn readahead_stops_at_the_staging_room_and_resumes() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("room", &[]);
    let n = 200;
    let (mut a, idx, ks) = stored_prefix(&srv.url(), "room", n);
    let mem_b = Arc::new(VecMemory::new(n, BLOCK));
    let mut cfg = quick(RemoteConfig::new(srv.url(), layout("room")));
    let room = 40;
    cfg.max_staged_bytes = (room * (BLOCK + kvoff::tier::remote::VALUE_HEADER_BYTES)) as u64;
    let tier = RemoteTier::open(cfg, mem_b.clone()).unwrap();
    let mut b = ChainManager::new(
        LruManager::new(ManagerConfig::new(n)),
        vec![ChainTier::new(Box::new(tier))],
        ChainConfig::default(),
    );
    assert_eq!(b.lookup_prefix(&ks).unwrap(), None);
    let s = remote_stats(&mut b);
    assert!(
        s.chain.fetch_keys <= room as u64,
        "fetched beyond the staging room: {s:?}"
    );
    assert_eq!(settle(&mut b, &ks, Duration::from_secs(20)), n);
    check_loaded(&mut b, &mem_b, &idx);
    let s = remote_stats(&mut b);
    assert_eq!(s.tier.fetch_hits, n as u64, "each key fetched once: {s:?}");
    assert_eq!(s.tier.promotions, n as u64, "{s:?}");
    assert_eq!(s.tier.read_errors, 0, "{s:?}");
    for m in [&mut a, &mut b] {
        m.shutdown();
    }
}

/// A scheduler asking for new prefixes faster than the server answers (here: the server stopped,
/// no fetch ends) queues fetches only up to the staging room — not one key per call without end —
/// for small values (staged) and large ones (headers alone, 1024 in flight at most); every lookup
/// stays pending and returns at once.
#[test]
fn lookups_faster_than_the_server_queue_no_more_than_the_room() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("flood", &[]);
    for block in [BLOCK, 512 << 10] {
        let mut cfg = quick(RemoteConfig::new(
            srv.url(),
            Layout {
                page_sizes_bytes: vec![block as u64],
                ..layout("flood")
            },
        ));
        cfg.io_timeout = Duration::from_secs(5);
        let room = 32;
        cfg.max_staged_bytes = (room * (block + kvoff::tier::remote::VALUE_HEADER_BYTES)) as u64;
        let tier = RemoteTier::open(cfg, Arc::new(VecMemory::new(1, block))).unwrap();
        let cap = if block >= 256 << 10 { 1024 } else { room };
        srv.signal("-STOP");
        let mut accepted = 0;
        for i in 0..3000 {
            let ks: Vec<ByteKey> = (0..4).map(|j| key(100_000 + i * 4 + j)).collect();
            let t0 = Instant::now();
            accepted += tier.submit_fetch(&ks);
            assert!(
                t0.elapsed() < Duration::from_millis(50),
                "a submission waited"
            );
        }
        srv.signal("-CONT");
        assert!(
            accepted > 0 && accepted <= cap,
            "{accepted} keys queued (cap {cap})"
        );
        let mut tier = tier;
        tier.shutdown();
    }
}

#[test]
fn corrupted_or_foreign_values_are_rejected_and_deleted() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("bad", &[]);
    let (mut a, mem_a) = chain(&srv.url(), "m", 8);
    store(&mut a, &mem_a, &[0, 1, 2, 3]);
    a.flush();
    let tier = RemoteTier::open(
        quick(RemoteConfig::new(srv.url(), layout("m"))),
        Arc::new(VecMemory::new(1, BLOCK)),
    )
    .unwrap();
    // Block 0: truncated by another client; block 1: one payload byte flipped; block 2: intact.
    let k0 = tier.redis_key(&key(0));
    let k1 = tier.redis_key(&key(1));
    srv.cli(&["SETRANGE", &k0, "0", "garbage-not-a-header"]);
    let v1 = Command::new(cli_bin())
        .args(["-p", &srv.port.to_string(), "--no-raw", "STRLEN", &k1])
        .output()
        .unwrap();
    let len: usize = String::from_utf8_lossy(&v1.stdout)
        .trim()
        .trim_start_matches("(integer) ")
        .parse()
        .unwrap();
    assert_eq!(len, tier.value_len());
    srv.cli(&["SETRANGE", &k1, &(len - 10).to_string(), "XXXX"]);
    // Block 3: grown by another client to 20 MB (past what a connection keeps of a reply).
    let k3 = tier.redis_key(&key(3));
    srv.cli(&["SETRANGE", &k3, "20000000", "x"]);
    drop(tier);

    let (mut b, mem_b) = chain(&srv.url(), "m", 8);
    let ks_all: Vec<ByteKey> = (0..4).map(key).collect();
    let ks = &ks_all[..3];
    // Block 0 is rejected at the fetch: nothing is served.
    assert_eq!(settle(&mut b, ks, Duration::from_secs(5)), 0);
    let s = remote_stats(&mut b);
    assert!(s.tier.rejected >= 1, "{s:?}");
    // Rejected values are deleted (they are in this layout's key space).
    b.flush();
    assert_eq!(srv.cli(&["EXISTS", &k0]).trim(), "0");
    // Blocks 1 and 2 asked alone: 1 rejected, 2 served byte-exact.
    assert_eq!(settle(&mut b, &ks[1..2], Duration::from_secs(5)), 0);
    assert_eq!(settle(&mut b, &ks[2..3], Duration::from_secs(5)), 1);
    check_loaded(&mut b, &mem_b, &[2]);
    let s = remote_stats(&mut b);
    assert_eq!(s.tier.rejected, 2, "{s:?}");
    b.flush();
    assert_eq!(srv.cli(&["EXISTS", &k1]).trim(), "0");
    // Block 3: read past without keeping its 20 MB, rejected and deleted; the connection stays.
    assert_eq!(settle(&mut b, &ks_all[3..4], Duration::from_secs(5)), 0);
    b.flush();
    let s = remote_stats(&mut b);
    assert_eq!((s.tier.rejected, s.tier.reconnects), (3, 0), "{s:?}");
    assert_eq!(srv.cli(&["EXISTS", &k3]).trim(), "0");
    a.shutdown();
    b.shutdown();
}

/// Values of 256 KiB and more: a lookup fetches their headers alone (no payload staged) and the
/// promotion reads each payload from the socket straight into its host block (4 KiB-aligned rows,
/// as a `HostRegion`), checksummed there. Every block arrives byte for byte; a value whose header
/// is foreign is rejected at the fetch, one whose payload was altered by another client fails its
/// promotion (never served) — both counted and deleted.
/// CPU time (seconds) of this process's remote I/O threads (`kvoff-remote-*`), from
/// `/proc/self/task/*/stat` (utime + stime).
fn remote_threads_cpu_s() -> f64 {
    let tick = 100.0; // USER_HZ on Linux
    let mut total = 0u64;
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        if !head.contains("(kvoff-remote-") {
            continue;
        }
        let f: Vec<&str> = rest.split_whitespace().collect();
        // After the name: state is field 3 of stat(5), utime 14 and stime 15.
        total += f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    }
    total as f64 / tick
}

/// Large values (≥ 256 KiB) are written by at most two or three jobs at once (docs/tier.md
/// "Remote tier"); the other I/O threads checksum a few queued values ahead and must then sleep,
/// not spin on the write queue they may not take from: with the server stopped under the write
/// jobs and more queued, eight threads burn almost no CPU in a second. The values summed ahead
/// are then written and load back byte-exact (their checksums checked).
#[test]
fn capped_large_writes_leave_the_other_threads_asleep() {
    use kvoff::tier::{AlignedRows, BlockMemory};
    let _g = serial();
    if !have_redis() {
        return;
    }
    const BIG: usize = 512 << 10;
    let srv = Server::start("capped", &[]);
    let lay = Layout {
        page_sizes_bytes: vec![BIG as u64],
        ..layout("capped")
    };
    let n = 24;
    let mem = Arc::new(AlignedRows::new(n, BIG).unwrap());
    let mut cfg = quick(RemoteConfig::new(srv.url(), lay));
    cfg.io_threads = 8;
    cfg.io_timeout = Duration::from_secs(5);
    // As on a machine with 8 CPUs or more (the defaults there), whatever this one has.
    cfg.idle_spin = Duration::from_micros(50);
    cfg.idle_nap = Duration::from_micros(100);
    cfg.idle_nap_for = Duration::from_millis(50);
    let tier = RemoteTier::open(cfg, mem.clone()).unwrap();
    let mut m = ChainManager::new(
        LruManager::new(ManagerConfig::new(n)),
        vec![ChainTier::new(Box::new(tier))],
        ChainConfig::default(),
    );
    let ks: Vec<ByteKey> = (0..n).map(key).collect();
    let out = m.prepare_store(&ks).unwrap().expect("room");
    let pat = |k: &ByteKey| -> Vec<u8> {
        let i = ks.iter().position(|x| x == k).unwrap();
        (0..BIG)
            .map(|j| (i * 151 + j * 7 + j / 999) as u8)
            .collect()
    };
    for (k, b) in out.keys_to_store.iter().zip(&out.block_ids) {
        mem.copy_in(*b, &pat(k)).unwrap();
    }
    srv.signal("-STOP");
    m.complete_store(&out.keys_to_store, true).unwrap();
    // Let the two write jobs start (and block on the stopped server), the rest queue.
    std::thread::sleep(Duration::from_millis(300));
    let c0 = remote_threads_cpu_s();
    std::thread::sleep(Duration::from_secs(1));
    let burnt = remote_threads_cpu_s() - c0;
    srv.signal("-CONT");
    m.flush();
    let s = remote_stats(&mut m);
    assert_eq!(s.tier.writes, n as u64, "{s:?}");
    assert!(
        burnt < 0.2,
        "the I/O threads used {burnt:.2} s of CPU in 1 s while the large writes waited"
    );
    let extra: std::collections::HashMap<_, _> = m
        .tier("remote")
        .unwrap()
        .extra_stats()
        .into_iter()
        .collect();
    // 2 per writer (2 or 3 writers) were summed while the server was stopped.
    assert!(extra["writes_summed_ahead"] >= 4, "{extra:?}");
    m.shutdown();

    // Another engine loads every value: each checksum (computed ahead or not) checks out.
    let mem_b = Arc::new(AlignedRows::new(n, BIG).unwrap());
    let lay = Layout {
        page_sizes_bytes: vec![BIG as u64],
        ..layout("capped")
    };
    let tier = RemoteTier::open(quick(RemoteConfig::new(srv.url(), lay)), mem_b.clone()).unwrap();
    let mut b = ChainManager::new(
        LruManager::new(ManagerConfig::new(n)),
        vec![ChainTier::new(Box::new(tier))],
        ChainConfig::default(),
    );
    assert_eq!(settle(&mut b, &ks, Duration::from_secs(10)), n);
    let ids = b.prepare_load(&ks).unwrap();
    for (k, blk) in ks.iter().zip(&ids) {
        let mut got = vec![0u8; BIG];
        mem_b.copy_out(*blk, &mut got).unwrap();
        assert!(got == pat(k), "{k:?} served wrong bytes");
    }
    b.complete_load(&ks).unwrap();
    let s = remote_stats(&mut b);
    assert_eq!((s.tier.promotions, s.tier.rejected), (n as u64, 0), "{s:?}");
    b.shutdown();
}

#[test]
fn large_values_go_straight_into_host_blocks() {
    use kvoff::tier::{AlignedRows, BlockMemory};
    let _g = serial();
    if !have_redis() {
        return;
    }
    const BIG: usize = 512 << 10;
    let srv = Server::start("big", &[]);
    let lay = || Layout {
        page_sizes_bytes: vec![BIG as u64],
        ..layout("big")
    };
    let open = |blocks: usize| {
        let mem = Arc::new(AlignedRows::new(blocks, BIG).unwrap());
        let tier =
            RemoteTier::open(quick(RemoteConfig::new(srv.url(), lay())), mem.clone()).unwrap();
        let m = ChainManager::new(
            LruManager::new(ManagerConfig::new(blocks)),
            vec![ChainTier::new(Box::new(tier))],
            ChainConfig::default(),
        );
        (m, mem)
    };
    let pat = |i: usize| -> Vec<u8> {
        (0..BIG)
            .map(|j| (i * 131 + j * 17 + j / 4096) as u8)
            .collect()
    };
    let n = 12;
    let ks: Vec<ByteKey> = (0..n).map(key).collect();
    let (mut a, mem_a) = open(n);
    let out = a.prepare_store(&ks).unwrap().expect("room");
    for (k, b) in out.keys_to_store.iter().zip(&out.block_ids) {
        let i = ks.iter().position(|x| x == k).unwrap();
        mem_a.copy_in(*b, &pat(i)).unwrap();
    }
    a.complete_store(&out.keys_to_store, true).unwrap();
    a.flush();
    assert_eq!(remote_stats(&mut a).tier.writes, n as u64);

    // Engine B loads the whole prefix: nothing staged, every block byte-exact.
    let (mut b, mem_b) = open(n);
    assert_eq!(settle(&mut b, &ks, Duration::from_secs(10)), n);
    let ids = b.prepare_load(&ks).unwrap();
    for (i, blk) in ids.iter().enumerate() {
        let mut got = vec![0u8; BIG];
        mem_b.copy_out(*blk, &mut got).unwrap();
        assert!(got == pat(i), "block {i} served wrong bytes");
    }
    b.complete_load(&ks).unwrap();
    let s = remote_stats(&mut b);
    assert_eq!((s.tier.promotions, s.tier.rejected), (n as u64, 0), "{s:?}");
    assert!(s.tier.fetch_hits >= n as u64, "{s:?}");
    b.shutdown();

    // Another client damages two values: one header, one payload byte.
    let probe = RemoteTier::open(
        quick(RemoteConfig::new(srv.url(), lay())),
        Arc::new(VecMemory::new(1, BIG)),
    )
    .unwrap();
    let k0 = probe.redis_key(&key(0));
    let k1 = probe.redis_key(&key(1));
    let len = probe.value_len();
    drop(probe);
    srv.cli(&["SETRANGE", &k0, "0", "garbage-not-a-header"]);
    srv.cli(&["SETRANGE", &k1, &(len - 1000).to_string(), "XXXX"]);
    let (mut c, mem_c) = open(n);
    assert_eq!(settle(&mut c, &ks[..1], Duration::from_secs(5)), 0);
    assert_eq!(settle(&mut c, &ks[1..2], Duration::from_secs(5)), 0);
    assert_eq!(settle(&mut c, &ks[2..3], Duration::from_secs(5)), 1);
    let [blk] = c.prepare_load(&ks[2..3]).unwrap()[..] else {
        panic!()
    };
    let mut got = vec![0u8; BIG];
    mem_c.copy_out(blk, &mut got).unwrap();
    assert!(got == pat(2));
    c.complete_load(&ks[2..3]).unwrap();
    let s = remote_stats(&mut c);
    assert_eq!(s.tier.rejected, 2, "{s:?}");
    c.flush();
    assert_eq!(srv.cli(&["EXISTS", &k0]).trim(), "0");
    assert_eq!(srv.cli(&["EXISTS", &k1]).trim(), "0");
    a.shutdown();
    c.shutdown();
}

#[test]
fn password_from_env_never_printed() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let pw = "s3cret-Pa55:word@x";
    let srv = Server::start("auth", &["--requirepass", pw]);
    // Without a password: writes fail, counted; nothing blocks.
    let mem = Arc::new(VecMemory::new(4, BLOCK));
    let mut cfg = quick(RemoteConfig::new(srv.url(), layout("p")));
    cfg.password_env = "KVOFF_TEST_REMOTE_PW_UNSET".into();
    let tier = RemoteTier::open(cfg, mem.clone()).unwrap();
    mem.set_block(0, &pattern(0)).unwrap();
    assert_eq!(tier.submit_writes(&[(key(0), 0)]), vec![true]);
    tier.flush();
    let c = tier.counters();
    assert_eq!(c.writes, 0);
    assert_eq!(c.write_errors, 1);
    let err = c.last_error.unwrap_or_default();
    assert!(!err.contains(pw), "password in an error: {err}");
    drop(tier);

    // From the environment variable.
    std::env::set_var("KVOFF_TEST_REMOTE_PW", pw);
    let mut cfg = quick(RemoteConfig::new(srv.url(), layout("p")));
    cfg.password_env = "KVOFF_TEST_REMOTE_PW".into();
    let dbg = format!("{cfg:?}");
    let tier = RemoteTier::open(cfg, mem.clone()).unwrap();
    assert_eq!(tier.submit_writes(&[(key(0), 0)]), vec![true]);
    tier.flush();
    assert_eq!(tier.counters().writes, 1);
    let shown = format!("{dbg} {tier:?} {}", tier.url());
    assert!(!shown.contains(pw) && !shown.contains("s3cret"), "{shown}");
    drop(tier);

    // In the URL: redacted everywhere it is shown.
    let url = format!("redis://:s3cret-Pa55%3Aword%40x@127.0.0.1:{}", srv.port);
    assert_eq!(redact(&url), format!("redis://:***@127.0.0.1:{}", srv.port));
    let cfg = quick(RemoteConfig::new(url.clone(), layout("p")));
    let tier = RemoteTier::open(cfg.clone(), mem.clone()).unwrap();
    assert_eq!(tier.submit_writes(&[(key(1), 0)]), vec![true]);
    tier.flush();
    assert_eq!(tier.counters().writes, 1);
    let shown = format!("{cfg:?} {tier:?}");
    assert!(!shown.contains("s3cret"), "{shown}");
    // A bad URL is a configuration error that does not print the password either.
    let bad = RemoteTier::open(
        RemoteConfig::new("redis://:s3cret@", layout("p")),
        mem.clone(),
    )
    .unwrap_err();
    assert!(matches!(bad, KvoffError::Config(_)));
    assert!(!bad.to_string().contains("s3cret"), "{bad}");
    let bad = RemoteTier::open(RemoteConfig::new("http://x:1", layout("p")), mem).unwrap_err();
    assert!(matches!(bad, KvoffError::Config(_)), "{bad}");
    std::env::remove_var("KVOFF_TEST_REMOTE_PW");
}

/// On one server, a write batch of small values without a TTL goes as one `MSET` and a fetch of
/// several keys as one `MGET` (docs/tier.md "Remote tier"); a value that cannot be built (its
/// block out of range) is left out of its `MSET` and fails alone; with a TTL each value is a
/// `SET … PX` and its key expires; every value loads back byte for byte.
#[test]
fn small_values_go_as_mset_and_mget() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("mset", &[]);
    let calls = |cmd: &str| srv.calls(cmd);
    let mem = Arc::new(VecMemory::new(8, BLOCK));
    let tier = RemoteTier::open(
        quick(RemoteConfig::new(srv.url(), layout("ms"))),
        mem.clone(),
    )
    .unwrap();
    for i in 0..8 {
        mem.set_block(i as BlockId, &pattern(i)).unwrap();
    }
    // Block 99 does not exist: its value cannot be built.
    let items: Vec<(ByteKey, BlockId)> = (0..8)
        .map(|i| (key(i), i as BlockId))
        .chain([(key(99), 99)])
        .collect();
    assert_eq!(tier.submit_writes(&items), vec![true; 9]);
    tier.flush();
    let c = tier.counters();
    assert_eq!((c.writes, c.write_errors), (8, 1), "{c:?}");
    assert_eq!(tier.poll().len(), 9, "every host block handed back");
    assert!(calls("mset") >= 1, "{}", srv.cli(&["INFO", "commandstats"]));
    assert_eq!(calls("set"), 0);
    assert_eq!(srv.cli(&["DBSIZE"]).trim(), "8");
    assert_eq!(srv.cli(&["EXISTS", &tier.redis_key(&key(99))]).trim(), "0");

    // Another engine: one fetch of the prefix, as MGETs; every block byte for byte. (Only keys
    // that are there: a remembered miss asked again after its negative TTL would go as a GET.)
    let (mut b, mem_b) = chain(&srv.url(), "ms", 16);
    let ks: Vec<ByteKey> = (0..8).map(key).collect();
    assert_eq!(settle(&mut b, &ks, Duration::from_secs(5)), 8);
    check_loaded(&mut b, &mem_b, &(0..8).collect::<Vec<_>>());
    assert!(calls("mget") >= 1);
    assert_eq!(calls("get"), 0);
    assert_eq!(remote_stats(&mut b).tier.rejected, 0);

    // With a TTL: a SET with PX per value; the values without one do not expire.
    let mut cfg = quick(RemoteConfig::new(srv.url(), layout("ms")));
    cfg.ttl = Some(Duration::from_secs(60));
    let ttl = RemoteTier::open(cfg, mem.clone()).unwrap();
    let items: Vec<(ByteKey, BlockId)> = (0..3).map(|i| (key(20 + i), i as BlockId)).collect();
    assert_eq!(ttl.submit_writes(&items), vec![true; 3]);
    ttl.flush();
    assert_eq!(ttl.counters().writes, 3);
    assert_eq!(calls("set"), 3);
    for i in 20..23 {
        let ms: i64 = srv
            .cli(&["PTTL", &ttl.redis_key(&key(i))])
            .trim()
            .parse()
            .unwrap();
        assert!(ms > 0 && ms <= 60_000, "PTTL {ms}");
    }
    assert_eq!(srv.cli(&["PTTL", &ttl.redis_key(&key(0))]).trim(), "-1");
    b.shutdown();
}

/// A server out of memory (`maxmemory` with `noeviction`) refuses whole `MSET`s: every write of a
/// refused batch fails and is counted, its host blocks are handed back, the error names the
/// command and the server's reason, and what was stored before still loads byte for byte.
#[test]
fn a_full_server_fails_whole_mset_batches() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start(
        "oom",
        &["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"],
    );
    let n = 512;
    let mem = Arc::new(VecMemory::new(n, BLOCK));
    let tier = RemoteTier::open(
        quick(RemoteConfig::new(srv.url(), layout("oom"))),
        mem.clone(),
    )
    .unwrap();
    for i in 0..n {
        mem.set_block(i as BlockId, &pattern(i)).unwrap();
    }
    let mut released = 0;
    for chunk in (0..n).collect::<Vec<_>>().chunks(32) {
        let items: Vec<(ByteKey, BlockId)> =
            chunk.iter().map(|&i| (key(i), i as BlockId)).collect();
        assert_eq!(tier.submit_writes(&items), vec![true; items.len()]);
        tier.flush();
        released += tier.poll().len();
    }
    assert_eq!(released, n, "every host block handed back");
    let c = tier.counters();
    assert_eq!(c.writes + c.write_errors, n as u64, "{c:?}");
    assert!(c.writes > 0 && c.write_errors > 0, "{c:?}");
    let err = c.last_error.unwrap_or_default();
    assert!(err.contains("MSET") && err.contains("OOM"), "{err}");
    let kept: u64 = srv.cli(&["DBSIZE"]).trim().parse().unwrap();
    assert_eq!(
        kept, c.writes,
        "stored values are on the server, refused ones are not"
    );
    // A refused key (the server's memory can shrink between batches, so a late batch may still
    // fit: ask the server which keys it has).
    let refused = (0..n)
        .rev()
        .find(|&i| srv.cli(&["EXISTS", &tier.redis_key(&key(i))]).trim() == "0")
        .expect("some key was refused");
    drop(tier);
    // What was stored loads back byte for byte; refused keys are misses.
    let (mut b, mem_b) = chain(&srv.url(), "oom", 16);
    assert_eq!(settle(&mut b, &[key(0)], Duration::from_secs(5)), 1);
    check_loaded(&mut b, &mem_b, &[0]);
    assert_eq!(settle(&mut b, &[key(refused)], Duration::from_secs(5)), 0);
    assert_eq!(remote_stats(&mut b).tier.rejected, 0);
    b.shutdown();
}

#[test]
fn value_cap_refuses_huge_layouts() {
    let _g = serial();
    let mem = Arc::new(VecMemory::new(1, 64 << 20));
    let e =
        RemoteTier::open(RemoteConfig::new("redis://127.0.0.1:1", layout("x")), mem).unwrap_err();
    assert!(matches!(e, KvoffError::Config(_)), "{e}");
}

/// Scheduler-thread calls while the server is down, killed mid-store, stopped (SIGSTOP) and
/// restarted: every call returns at once, jobs end as failures, the tier reconnects, and the
/// process has no more fds or threads than before.
#[test]
fn server_killed_stopped_restarted() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let fds0 = open_fds();
    let threads0 = threads();
    let mut srv = Server::start("kill", &[]);
    {
        let (mut a, mem) = chain(&srv.url(), "k", 64);
        store(&mut a, &mem, &(0..8).collect::<Vec<_>>());
        a.flush();
        assert_eq!(remote_stats(&mut a).tier.writes, 8);

        // SIGKILL mid-store: a batch of writes is queued, the server dies under it.
        store(&mut a, &mem, &(8..24).collect::<Vec<_>>());
        srv.kill();
        let t0 = Instant::now();
        a.flush(); // bounded by the I/O timeout
        assert!(t0.elapsed() < Duration::from_secs(5));
        a.poll().unwrap();
        // Host memory keeps serving everything stored.
        let ks: Vec<ByteKey> = (0..24).map(key).collect();
        assert_eq!(a.lookup_prefix(&ks).unwrap(), Some(24));
        check_loaded(&mut a, &mem, &(0..24).collect::<Vec<_>>());

        // Down: lookups of unknown keys return at once (the server is not asked while its
        // backoff runs) and settle as misses; stores do not block.
        let unknown: Vec<ByteKey> = (100..140).map(key).collect();
        let mut worst = Duration::ZERO;
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(500) {
            for k in &unknown {
                let t = Instant::now();
                let _ = a.lookup(k).unwrap();
                worst = worst.max(t.elapsed());
            }
        }
        assert!(
            worst < Duration::from_millis(50),
            "a lookup took {worst:?} with the server down"
        );
        let t = Instant::now();
        store(&mut a, &mem, &[40, 41]);
        assert!(t.elapsed() < Duration::from_millis(50));
        a.flush();
        assert_eq!(settle(&mut a, &unknown[..1], Duration::from_secs(5)), 0);
        let s = remote_stats(&mut a);
        assert!(s.tier.write_errors + s.chain.writes_refused >= 1, "{s:?}");

        // Restarted empty: the tier reconnects (after its backoff) and writes again.
        srv.restart();
        let t0 = Instant::now();
        let mut next = 1000;
        loop {
            next += 1;
            store(&mut a, &mem, &[next]);
            a.flush();
            a.poll().unwrap();
            let s = remote_stats(&mut a);
            if s.tier.reconnects >= 1 && srv.cli(&["DBSIZE"]).trim() != "0" {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "no reconnect: {s:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // Blocks stored before the restart are gone from the server: engine B misses them, and
        // serves nothing wrong.
        let (mut b, mem_b) = chain(&srv.url(), "k", 64);
        assert_eq!(settle(&mut b, &ks[..4], Duration::from_secs(5)), 0);

        // Stopped (SIGSTOP): a fetch times out, lookups never wait, the fetch ends as a miss.
        store(&mut a, &mem, &[60]);
        a.flush();
        srv.signal("-STOP");
        let probe = [key(60)];
        let t0 = Instant::now();
        let mut worst = Duration::ZERO;
        let n = loop {
            let t = Instant::now();
            let r = b.lookup_prefix(&probe).unwrap();
            worst = worst.max(t.elapsed());
            if let Some(n) = r {
                break n;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "stalled fetch never ended"
            );
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(n, 0);
        assert!(worst < Duration::from_millis(50), "{worst:?}");
        assert!(
            t0.elapsed() >= Duration::from_millis(250),
            "answered before the timeout?"
        );
        srv.signal("-CONT");
        // After the backoff B finds the block.
        let t0 = Instant::now();
        loop {
            if settle(&mut b, &probe, Duration::from_secs(5)) == 1 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "block 60 never found"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        check_loaded(&mut b, &mem_b, &[60]);
        // Restarted with its data (SAVE, then SIGKILL, then start on the same dir).
        srv.cli(&["CONFIG", "SET", "dbfilename", "dump.rdb"]);
        assert_eq!(srv.cli(&["SAVE"]).trim(), "OK");
        srv.extra = vec!["--dbfilename".into(), "dump.rdb".into()];
        srv.restart();
        let (mut c, mem_c) = chain(&srv.url(), "k", 64);
        let t0 = Instant::now();
        loop {
            if settle(&mut c, &probe, Duration::from_secs(5)) == 1 {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(100));
        }
        check_loaded(&mut c, &mem_c, &[60]);
        for m in [&mut a, &mut b, &mut c] {
            m.shutdown();
        }
    }
    drop(srv);
    // Tests that don't take `serial()` run beside this one and start threads of their own, so
    // the count may be below or above the start's while they run (the spinning and napping
    // I/O-thread tests and the TLS CA file's open their own tiers): none of this test's may
    // remain. Its own I/O threads were
    // joined by `shutdown` above, so a leak of them would stay past any wait.
    let t0 = Instant::now();
    while threads() > threads0 && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        threads() <= threads0,
        "I/O threads left behind: {threads0} -> {}",
        threads()
    );
    assert!(open_fds() <= fds0 + 2, "fds grew: {fds0} -> {}", open_fds());
}

/// A loopback proxy that stalls (the network partition of docs/tier.md): data stops flowing
/// without a connection error, the I/O timeout ends the jobs.
#[test]
fn stalled_network_times_out() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, Ordering};
    let srv = Server::start("stall", &[]);
    let stall = Arc::new(AtomicBool::new(false));
    let lis = TcpListener::bind("127.0.0.1:0").unwrap();
    let pport = lis.local_addr().unwrap().port();
    let up = srv.port;
    {
        let stall = stall.clone();
        std::thread::spawn(move || {
            for c in lis.incoming() {
                let Ok(c) = c else { return };
                let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", up)) else {
                    return;
                };
                for (mut from, mut to) in [(c.try_clone().unwrap(), s.try_clone().unwrap()), (s, c)]
                {
                    let stall = stall.clone();
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 65536];
                        loop {
                            let Ok(n) = from.read(&mut buf) else { return };
                            if n == 0 {
                                return;
                            }
                            while stall.load(Ordering::Relaxed) {
                                std::thread::sleep(Duration::from_millis(10));
                            }
                            if to.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
    }
    let url = format!("redis://127.0.0.1:{pport}");
    let (mut a, mem) = chain(&url, "s", 16);
    store(&mut a, &mem, &[0, 1]);
    a.flush();
    assert_eq!(remote_stats(&mut a).tier.writes, 2);
    stall.store(true, std::sync::atomic::Ordering::Relaxed);
    let t = Instant::now();
    store(&mut a, &mem, &[2, 3]);
    assert!(t.elapsed() < Duration::from_millis(50));
    let t = Instant::now();
    a.flush();
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "a stalled write was not timed out"
    );
    let s = remote_stats(&mut a);
    assert_eq!(s.tier.writes, 2);
    assert!(s.tier.write_errors >= 1, "{s:?}");
    stall.store(false, std::sync::atomic::Ordering::Relaxed);
    // Reconnects after the backoff; writes flow again.
    let t0 = Instant::now();
    let mut i = 10;
    loop {
        store(&mut a, &mem, &[i]);
        i += 1;
        a.flush();
        let s = remote_stats(&mut a);
        if s.tier.writes > 2 {
            assert!(s.tier.reconnects >= 1);
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{s:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    a.shutdown();
}

/// A batch on a connection whose server stops answering costs one read timeout, not one per
/// command: redis-rs's pipeline reads every remaining reply after a timeout, each with the full
/// timeout, which held a 12-key fetch for 12 × 0.5 s. One I/O thread, so the fetch runs on the
/// connection the write opened.
#[test]
fn stalled_batch_costs_one_timeout() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let mut srv = Server::start("stallbatch", &[]);
    let mem = Arc::new(VecMemory::new(16, BLOCK));
    let mut cfg = quick(RemoteConfig::new(srv.url(), layout("sb")));
    cfg.io_threads = 1;
    let tier = RemoteTier::open(cfg, mem.clone()).unwrap();
    let mut a = ChainManager::new(
        LruManager::new(ManagerConfig::new(16)),
        vec![ChainTier::new(Box::new(tier))],
        ChainConfig::default(),
    );
    store(&mut a, &mem, &[0, 1]);
    a.flush();
    assert_eq!(remote_stats(&mut a).tier.writes, 2);
    srv.signal("-STOP");
    let ks: Vec<ByteKey> = (100..112).map(key).collect();
    assert_eq!(a.lookup_prefix(&ks).unwrap(), None);
    let t = Instant::now();
    a.flush();
    let took = t.elapsed();
    srv.signal("-CONT");
    assert!(
        took < Duration::from_millis(1500),
        "a stalled 12-key fetch took {took:?}"
    );
    assert!(remote_stats(&mut a).tier.fetch_errors >= 1);
    a.shutdown();
    srv.kill();
}

/// `maxmemory` + `allkeys-lru` evicts our values: lookups miss (nothing wrong is served).
#[test]
fn evicted_values_are_misses() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start(
        "lru",
        &["--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"],
    );
    let (mut a, mem) = chain(&srv.url(), "e", 256);
    for chunk in (0..200).collect::<Vec<_>>().chunks(20) {
        store(&mut a, &mem, chunk);
        a.flush();
    }
    let written = remote_stats(&mut a).tier.writes;
    assert!(written >= 100, "{written}");
    let kept: usize = srv.cli(&["DBSIZE"]).trim().parse().unwrap();
    assert!(kept < 200, "nothing evicted ({kept})");
    let (mut b, mem_b) = chain(&srv.url(), "e", 256);
    let mut served = 0;
    for i in 0..200 {
        if settle(&mut b, &[key(i)], Duration::from_secs(5)) == 1 {
            check_loaded(&mut b, &mem_b, &[i]);
            served += 1;
        }
    }
    assert!(
        served > 0 && served <= kept,
        "served {served}, server kept {kept}"
    );
    let s = remote_stats(&mut b);
    assert_eq!(s.tier.rejected, 0);
    a.shutdown();
    b.shutdown();
}

/// Bounded queues: a flood of writes beyond `max_queued_writes` is dropped and counted, never
/// blocking `complete_store`; the file tier in front keeps every block.
#[test]
fn files_then_remote_and_bounded_writes() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("chain", &[]);
    let dir = tmpdir("chain-files");
    let mem = Arc::new(VecMemory::new(64, BLOCK));
    let files = FileTier::open(TierConfig::new(&dir, 1 << 30, layout("c")), mem.clone()).unwrap();
    let mut rc = quick(RemoteConfig::new(srv.url(), layout("c")));
    rc.max_queued_writes = 4;
    let remote = RemoteTier::open(rc, mem.clone()).unwrap();
    let mut m = ChainManager::new(
        LruManager::new(ManagerConfig::new(64)),
        vec![
            ChainTier::new(Box::new(files)),
            ChainTier::new(Box::new(remote)),
        ],
        ChainConfig::default(),
    );
    let t = Instant::now();
    store(&mut m, &mem, &(0..32).collect::<Vec<_>>());
    assert!(t.elapsed() < Duration::from_millis(200));
    m.flush();
    m.poll().unwrap();
    let (_, st) = m.get_stats().unwrap();
    assert_eq!(st[0].kind, "disk");
    assert_eq!(st[0].tier.writes, 32);
    assert_eq!(st[1].kind, "remote");
    assert!(st[1].tier.writes_dropped > 0, "{:?}", st[1]);
    assert_eq!(
        st[1].tier.writes + st[1].tier.writes_dropped + st[1].tier.write_errors,
        32
    );
    assert_eq!(
        m.get_stats().unwrap().0.num_evictable,
        32,
        "write pins released"
    );
    m.shutdown();

    // A second engine without files finds the written ones remotely; a third with the files
    // finds all on disk first.
    let (mut b, mem_b) = chain(&srv.url(), "c", 64);
    let ks: Vec<ByteKey> = (0..32).map(key).collect();
    let n = settle(&mut b, &ks, Duration::from_secs(5));
    assert!(n >= 1);
    check_loaded(&mut b, &mem_b, &(0..n).collect::<Vec<_>>());
    b.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn known_answers_of_the_remote_index() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("idx", &[]);
    let mem = Arc::new(VecMemory::new(4, BLOCK));
    let tier = RemoteTier::open(
        quick(RemoteConfig::new(srv.url(), layout("i"))),
        mem.clone(),
    )
    .unwrap();
    assert_eq!(tier.index(&key(0)), Known::Unknown);
    assert_eq!(tier.submit_fetch(&[key(0)]), 1);
    tier.flush();
    assert_eq!(tier.index(&key(0)), Known::Absent);
    mem.set_block(0, &pattern(0)).unwrap();
    assert_eq!(tier.submit_writes(&[(key(0), 0)]), vec![true]);
    tier.flush();
    assert_eq!(tier.index(&key(0)), Known::Present);
    assert_eq!(tier.submit_reads(&[(key(0), 1)]), vec![true]);
    tier.flush();
    assert_eq!(mem.block(1).unwrap(), pattern(0));
}

/// A fetch's answer waits in its ticket's cell until its key is looked at again (a staged value
/// goes to the index when it comes); a key whose ticket later fetches took again while it was not
/// looked at is unknown again — asked again when looked up — and never answers wrong.
#[test]
fn answers_whose_tickets_went_again_are_asked_again() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("tickets", &[]);
    let mem = Arc::new(VecMemory::new(4, BLOCK));
    let mut cfg = quick(RemoteConfig::new(srv.url(), layout("tickets")));
    cfg.negative_ttl = Duration::from_secs(60);
    // Room for 8 values: the fewest tickets (1024).
    cfg.max_staged_bytes = 8 * (BLOCK + kvoff::tier::remote::VALUE_HEADER_BYTES) as u64;
    let tier = RemoteTier::open(cfg, mem.clone()).unwrap();
    mem.set_block(0, &pattern(7)).unwrap();
    let stored = key(7);
    assert_eq!(tier.submit_writes(&[(stored.clone(), 0)]), vec![true]);
    tier.flush();
    tier.forget(&stored);
    let absent = key(8);
    assert_eq!(tier.submit_fetch(&[absent.clone(), stored.clone()]), 2);
    tier.flush();
    // 2048 more keys, 4 at a time: the tickets go round twice.
    for r in 0..512 {
        let ks: Vec<ByteKey> = (0..4).map(|j| key(2_000_000 + r * 4 + j)).collect();
        assert_eq!(tier.submit_fetch(&ks), 4, "round {r}");
        tier.flush();
    }
    assert_eq!(tier.index(&stored), Known::Present);
    assert_eq!(tier.index(&absent), Known::Unknown);
    assert_eq!(tier.submit_fetch(std::slice::from_ref(&absent)), 1);
    tier.flush();
    assert_eq!(tier.index(&absent), Known::Absent);
    // The latest answers are still in their cells.
    assert_eq!(tier.index(&key(2_000_000 + 2047)), Known::Absent);
    assert_eq!(tier.submit_reads(&[(stored, 1)]), vec![true]);
    tier.flush();
    assert_eq!(mem.block(1).unwrap(), pattern(7));
}

/// The index stays bounded while a scheduler asks for ever new keys: past `INDEX_CAP` entries
/// the remembered misses are forgotten (those keys are fetched again when looked up, and answer
/// absent again), the latest ones are still remembered, and no answer is wrong.
#[test]
fn the_index_stays_bounded_under_ever_new_keys() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("bound", &[]);
    let mem = Arc::new(VecMemory::new(4, BLOCK));
    let tier = RemoteTier::open(
        quick(RemoteConfig::new(srv.url(), layout("bound"))),
        mem.clone(),
    )
    .unwrap();
    mem.set_block(0, &pattern(7)).unwrap();
    let stored = key(7);
    assert_eq!(tier.submit_writes(&[(stored.clone(), 0)]), vec![true]);
    tier.flush();
    let batch = 64;
    let rounds = 3 * INDEX_CAP / batch;
    for r in 0..rounds {
        let ks: Vec<ByteKey> = (0..batch).map(|j| key(1_000_000 + r * batch + j)).collect();
        assert_eq!(tier.submit_fetch(&ks), batch);
        tier.flush();
    }
    let stats: std::collections::HashMap<_, _> = tier.extra_stats().into_iter().collect();
    assert!(
        stats["known_absent"] + stats["known_present"] <= INDEX_CAP as u64,
        "{stats:?}"
    );
    // The latest misses are remembered; the first ones were forgotten and are asked again.
    assert_eq!(
        tier.index(&key(1_000_000 + (rounds - 1) * batch)),
        Known::Absent
    );
    let first = key(1_000_000);
    assert_eq!(tier.index(&first), Known::Unknown);
    assert_eq!(tier.submit_fetch(std::slice::from_ref(&first)), 1);
    tier.flush();
    assert_eq!(tier.index(&first), Known::Absent);
    // A key on the server is found again once its answer was forgotten, and loads byte for byte.
    if tier.index(&stored) == Known::Unknown {
        assert_eq!(tier.submit_fetch(std::slice::from_ref(&stored)), 1);
        tier.flush();
    }
    assert_eq!(tier.index(&stored), Known::Present);
    assert_eq!(tier.submit_reads(&[(stored, 1)]), vec![true]);
    tier.flush();
    assert_eq!(mem.block(1).unwrap(), pattern(7));
}

/// A Cluster of real `redis-server` nodes joined with `redis-cli --cluster create`.
struct Cluster {
    nodes: Vec<Server>,
}

impl Cluster {
    /// `masters` masters with `replicas` replicas each; `node_timeout_ms` is how long a master may
    /// be silent before it is failed over.
    fn start(tag: &str, masters: usize, replicas: usize, node_timeout_ms: u32) -> Self {
        let nodes: Vec<Server> = (0..masters * (1 + replicas))
            .map(|i| {
                let dir = tmpdir(&format!("{tag}{i}"));
                let mut s = Server {
                    port: 0,
                    extra: vec![
                        "--cluster-enabled".into(),
                        "yes".into(),
                        "--cluster-node-timeout".into(),
                        node_timeout_ms.to_string(),
                        "--cluster-require-full-coverage".into(),
                        "no".into(),
                        "--cluster-config-file".into(),
                        dir.join("nodes.conf").display().to_string(),
                    ],
                    dir,
                    child: None,
                };
                // The bus port (port + 10000) must be free too.
                loop {
                    let p = free_port();
                    if p < 55000 && TcpListener::bind(("127.0.0.1", p + 10000)).is_ok() {
                        s.port = p;
                        break;
                    }
                }
                s.spawn();
                s
            })
            .collect();
        let c = Self { nodes };
        let out = Command::new(cli_bin())
            .args(["--cluster", "create"])
            .args(c.addrs(None))
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        c.wait_ok(Duration::from_secs(30));
        c
    }

    fn addrs(&self, only: Option<usize>) -> Vec<String> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(i, _)| only.is_none_or(|o| o == *i))
            .map(|(_, n)| format!("127.0.0.1:{}", n.port))
            .collect()
    }

    /// `redis+cluster://` with every node as a seed, or only node `only`.
    fn url(&self, only: Option<usize>) -> String {
        format!("redis+cluster://{}", self.addrs(only).join(","))
    }

    fn running(&self) -> impl Iterator<Item = &Server> {
        self.nodes.iter().filter(|n| n.child.is_some())
    }

    /// Until every running node says `cluster_state:ok`.
    fn wait_ok(&self, limit: Duration) {
        let t0 = Instant::now();
        while !self
            .running()
            .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
        {
            assert!(t0.elapsed() < limit, "cluster not ok");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Indexes of the running nodes that are masters now.
    fn masters(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| {
                self.nodes[i].child.is_some()
                    && self.nodes[i].cli(&["ROLE"]).lines().next() == Some("master")
            })
            .collect()
    }

    fn dbsize(&self, i: usize) -> usize {
        self.nodes[i].cli(&["DBSIZE"]).trim().parse().unwrap()
    }
}

/// Stats, asserting the Cluster ran without a rejected value.
fn no_rejects(m: &mut Chain) -> kvoff::tier::chain::ChainTierStats {
    let s = remote_stats(m);
    assert_eq!(s.tier.rejected, 0, "{s:?}");
    s
}

/// kvoff's slot of a key is the server's (`CLUSTER KEYSLOT`), hash tags included.
/// The test command runs these tests on Debian's Redis 7 and again on Valkey 8
/// (`KVOFF_REDIS_SERVER`, `KVOFF_EXPECT_SERVER=valkey`): the server started must be the product
/// asked for (the other tests then run on it).
#[test]
fn server_is_the_product_asked_for() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("product", &[]);
    let info = srv.cli(&["INFO", "server"]);
    let product = if info.contains("valkey_version:") {
        "valkey"
    } else {
        "redis"
    };
    if let Some(want) = std::env::var_os("KVOFF_EXPECT_SERVER") {
        assert_eq!(want.to_str(), Some(product), "{info}");
    }
}

#[test]
fn key_slot_is_the_servers() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let dir = tmpdir("slot");
    let srv = Server::start(
        "slot",
        &[
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            &dir.join("nodes.conf").display().to_string(),
        ],
    );
    let mem = Arc::new(VecMemory::new(1, BLOCK));
    let tier = RemoteTier::open(RemoteConfig::new(srv.url(), layout("slot")), mem).unwrap();
    let mut keys: Vec<String> = (0..40).map(|i| tier.redis_key(&key(i))).collect();
    keys.extend(
        [
            "",
            "a",
            "123456789",
            "{user1000}.following",
            "foo{}{bar}",
            "foo{{bar}}zap",
            "{}x",
            "x{y",
            "ü{é}",
        ]
        .map(String::from),
    );
    for k in &keys {
        let server: u16 = srv.cli(&["CLUSTER", "KEYSLOT", k]).trim().parse().unwrap();
        assert_eq!(
            kvoff::tier::remote::route::key_slot(k.as_bytes()),
            server,
            "{k:?}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A 3-master Cluster (`redis-cli --cluster create`): values spread over the masters, a second
/// engine reads them back byte-exact through slot routing. Then one master is killed (no
/// replica): its blocks become misses while the other two masters' blocks are still served —
/// exactly those, to an engine connected before and to one started after — lookups never wait,
/// and writes to the live masters go on.
#[test]
fn cluster_round_trip_and_a_dead_shard() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let mut cl = Cluster::start("cl", 3, 0, 2000);
    let url = cl.url(None);
    let (mut a, mem) = chain(&url, "cl", 128);
    store(&mut a, &mem, &(0..40).collect::<Vec<_>>());
    a.flush();
    let s = remote_stats(&mut a);
    assert_eq!(s.tier.writes, 40, "{s:?}");
    let sizes: Vec<usize> = (0..3).map(|i| cl.dbsize(i)).collect();
    assert_eq!(sizes.iter().sum::<usize>(), 40);
    assert!(sizes.iter().all(|&n| n > 0), "{sizes:?}");
    let (mut b, mem_b) = chain(&url, "cl", 128);
    let ks: Vec<ByteKey> = (0..40).map(key).collect();
    assert_eq!(settle(&mut b, &ks, Duration::from_secs(10)), 40);
    check_loaded(&mut b, &mem_b, &(0..40).collect::<Vec<_>>());
    b.reset().unwrap();
    // One master killed (no replica).
    cl.nodes[0].kill();
    let (mut c, mem_c) = chain(&url, "cl", 128);
    for (name, m, mem) in [
        ("connected before", &mut b, &mem_b),
        ("new", &mut c, &mem_c),
    ] {
        let t0 = Instant::now();
        let mut served = 0;
        for i in 0..40 {
            let t = Instant::now();
            let n = settle(m, &[key(i)], Duration::from_secs(5));
            assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
            if n == 1 {
                check_loaded(m, mem, &[i]);
                served += 1;
            }
        }
        eprintln!(
            "engine {name}: served {served} of 40 with one of 3 masters down in {:?}",
            t0.elapsed()
        );
        assert_eq!(
            served,
            40 - sizes[0],
            "the live shards' blocks, all of them"
        );
        no_rejects(m);
    }
    // Writes: those to the live masters succeed, those to the dead one fail.
    store(&mut a, &mem, &(40..80).collect::<Vec<_>>());
    a.flush();
    let s = no_rejects(&mut a);
    let live: usize = (1..3).map(|i| cl.dbsize(i)).sum();
    assert_eq!(s.tier.writes as usize - 40, live - (40 - sizes[0]), "{s:?}");
    assert!(s.tier.writes > 40 + 10, "{s:?}");
    assert_eq!(s.tier.writes + s.tier.write_errors, 80, "{s:?}");
    for m in [&mut a, &mut b, &mut c] {
        m.shutdown();
    }
}

/// A master killed with a replica to take over, and the engine's only seed is that master: the
/// engine carries on through the nodes it learned from the Cluster (reads of what it stored
/// before — the replica has it — and new writes), without a restart.
#[test]
fn cluster_single_seed_killed_failover() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let mut cl = Cluster::start("fo", 3, 1, 1000);
    let m0 = cl.masters()[0];
    let (mut a, mem) = chain(&cl.url(Some(m0)), "fo", 256);
    store(&mut a, &mem, &(0..40).collect::<Vec<_>>());
    a.flush();
    assert_eq!(no_rejects(&mut a).tier.writes, 40);
    // The replicas have every value before the kill.
    let t0 = Instant::now();
    loop {
        let replicated: usize = (0..cl.nodes.len())
            .filter(|i| !cl.masters().contains(i))
            .map(|i| cl.dbsize(i))
            .sum();
        if replicated == 40 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "not replicated");
        std::thread::sleep(Duration::from_millis(50));
    }
    cl.nodes[m0].kill();
    let t0 = Instant::now();
    while cl.masters().len() < 3 {
        assert!(t0.elapsed() < Duration::from_secs(30), "no failover");
        std::thread::sleep(Duration::from_millis(100));
    }
    cl.wait_ok(Duration::from_secs(30));
    eprintln!("failover after {:?}", t0.elapsed());
    // Reads of the old blocks through the promoted replica (the host copies forgotten first).
    a.reset().unwrap();
    let t0 = Instant::now();
    loop {
        let mut served = 0;
        for i in 0..40 {
            if settle(&mut a, &[key(i)], Duration::from_secs(5)) == 1 {
                check_loaded(&mut a, &mem, &[i]);
                served += 1;
            }
        }
        if served == 40 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{served} of 40 after the failover"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    // New writes: every one succeeds (the first batch included: a write to the dead master reads
    // the map again and goes to the new one).
    let before = no_rejects(&mut a).tier;
    store(&mut a, &mem, &(100..140).collect::<Vec<_>>());
    a.flush();
    let s = no_rejects(&mut a).tier;
    assert_eq!(s.writes - before.writes, 40, "{s:?}");
    let (mut b, mem_b) = chain(&cl.url(None), "fo", 256);
    let ks: Vec<ByteKey> = (100..140).map(key).collect();
    assert_eq!(settle(&mut b, &ks, Duration::from_secs(10)), 40);
    check_loaded(&mut b, &mem_b, &(100..140).collect::<Vec<_>>());
    no_rejects(&mut b);
    a.shutdown();
    b.shutdown();
}

/// A Cluster node that stops answering (SIGSTOP) costs a batch one I/O timeout, not one per
/// command sent to it (redis-rs's ClusterPipeline read every remaining reply of the node, each
/// with the full timeout), and the other nodes' keys of the batch are still found.
#[test]
fn cluster_stalled_node_costs_one_timeout() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    let cl = Cluster::start("cs", 3, 0, 60_000);
    let url = cl.url(None);
    let (mut a, mem) = chain(&url, "cs", 64);
    store(&mut a, &mem, &(0..30).collect::<Vec<_>>());
    a.flush();
    assert_eq!(no_rejects(&mut a).tier.writes, 30);
    let on0 = cl.dbsize(0);
    assert!(on0 >= 3, "{on0} of 30 on node 0");
    let (mut b, _mem_b) = chain(&url, "cs", 64);
    // b connects to every node first.
    assert_eq!(settle(&mut b, &[key(1000)], Duration::from_secs(5)), 0);
    cl.nodes[0].signal("-STOP");
    let ks: Vec<ByteKey> = (0..30).map(key).collect();
    assert_eq!(b.lookup_prefix(&ks).unwrap(), None);
    let t = Instant::now();
    b.flush();
    let took = t.elapsed();
    cl.nodes[0].signal("-CONT");
    let s = no_rejects(&mut b).tier;
    eprintln!("a 30-key fetch with {on0} keys on a stopped node took {took:?}: {s:?}");
    assert!(
        took < Duration::from_millis(1500),
        "a fetch with {on0} keys on a stopped node took {took:?}"
    );
    assert_eq!(s.fetch_hits as usize, 30 - on0, "{s:?}");
    assert_eq!(s.fetch_errors as usize, on0, "{s:?}");
    a.shutdown();
    b.shutdown();
}

/// `rediss://` end to end: a `redis-server` serving TLS only, with a certificate from a throwaway
/// CA made here with `openssl`. With the CA (`tls_ca_file`) values round-trip byte-exact between
/// two engines; without it (the system's roots) the certificate is refused and nothing is written;
/// a CA file with a plain `redis://` URL, or one that cannot be read, is a configuration error.
#[test]
fn tls_round_trip_with_a_private_ca() {
    let _g = serial();
    if !have_redis() {
        return;
    }
    if Command::new("openssl").arg("version").output().is_err() {
        eprintln!("SKIP: openssl is not installed");
        return;
    }
    let dir = tmpdir("tls");
    let ossl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    ossl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=kvoff-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    ]);
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    ossl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    ossl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
    ]);
    let port = free_port();
    let d = |f: &str| dir.join(f).display().to_string();
    let mut child = Command::new(server_bin())
        .args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .args([
            "--tls-cert-file",
            &d("server.crt"),
            "--tls-key-file",
            &d("server.key"),
        ])
        .args([
            "--tls-ca-cert-file",
            &d("ca.crt"),
            "--tls-auth-clients",
            "no",
        ])
        .args(["--save", "", "--appendonly", "no", "--dir", &d("")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let cli = |args: &[&str]| {
        let out = Command::new(cli_bin())
            .args(["-p", &port.to_string(), "--tls", "--cacert", &d("ca.crt")])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let t0 = Instant::now();
    while cli(&["PING"]).trim() != "PONG" {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "TLS redis-server did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let url = format!("rediss://127.0.0.1:{port}");
    let open = |url: &str, ca: Option<PathBuf>| {
        let mem = Arc::new(VecMemory::new(16, BLOCK));
        let mut cfg = quick(RemoteConfig::new(url, layout("tls")));
        cfg.tls_ca_file = ca;
        RemoteTier::open(cfg, mem.clone()).map(|t| {
            let m = ChainManager::new(
                LruManager::new(ManagerConfig::new(16)),
                vec![ChainTier::new(Box::new(t))],
                ChainConfig::default(),
            );
            (m, mem)
        })
    };
    let ca = Some(dir.join("ca.crt"));
    let (mut a, mem_a) = open(&url, ca.clone()).unwrap();
    store(&mut a, &mem_a, &[0, 1, 2, 3, 4, 5]);
    a.flush();
    let s = remote_stats(&mut a);
    assert_eq!(s.tier.writes, 6, "{s:?}");
    assert_eq!(cli(&["DBSIZE"]).trim(), "6");
    let (mut b, mem_b) = open(&url, ca.clone()).unwrap();
    let ks: Vec<ByteKey> = (0..6).map(key).collect();
    assert_eq!(settle(&mut b, &ks, Duration::from_secs(5)), 6);
    check_loaded(&mut b, &mem_b, &[0, 1, 2, 3, 4, 5]);
    assert_eq!(remote_stats(&mut b).tier.rejected, 0);
    // Without the CA the server's certificate is not trusted: nothing is written.
    let (mut c, mem_c) = open(&url, None).unwrap();
    store(&mut c, &mem_c, &[10, 11]);
    c.flush();
    let s = remote_stats(&mut c);
    assert_eq!(s.tier.writes, 0, "{s:?}");
    assert!(s.tier.write_errors >= 1, "{s:?}");
    eprintln!("without the CA: {:?}", s.tier.last_error);
    assert_eq!(cli(&["DBSIZE"]).trim(), "6");
    // Over a link that turns slow once set up (a proxy passing the server's bytes one per 50 ms
    // once `slow` is set, each read within the I/O timeout, a whole reply never), a fetch, a
    // flush and shutdown end within their bounds on TLS as on TCP (docs/tier.md "Faults"):
    // every socket read and write of the TLS session checks the exchange's deadline.
    let proxy = TrickleProxy::start(port);
    let purl = format!("rediss://127.0.0.1:{}", proxy.port);
    let (mut d, mem_d) = open(&purl, ca.clone()).unwrap();
    assert_eq!(settle(&mut d, &ks[..1], Duration::from_secs(5)), 1);
    check_loaded(&mut d, &mem_d, &[0]);
    proxy.slow.store(true, std::sync::atomic::Ordering::Relaxed);
    let rest = ks[1..].to_vec();
    let (n, mut d) = bounded("a fetch over slow TLS", move || {
        (settle(&mut d, &rest, Duration::from_secs(4)), d)
    });
    assert_eq!(n, 0);
    store(&mut d, &mem_d, &[30, 31]);
    let mut d = bounded("flush() over slow TLS", move || {
        d.flush();
        d
    });
    let s = remote_stats(&mut d);
    assert!(s.tier.write_errors >= 1, "{s:?}");
    assert!(
        s.tier
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("timed out"),
        "{s:?}"
    );
    store(&mut d, &mem_d, &[32]);
    bounded("shutdown() over slow TLS", move || d.shutdown());
    drop(proxy);
    // A CA file needs rediss://, and must be readable.
    let plain = format!("redis://127.0.0.1:{port}");
    assert!(matches!(open(&plain, ca), Err(KvoffError::Config(_))));
    assert!(matches!(
        open(&url, Some(dir.join("missing.crt"))),
        Err(KvoffError::Config(_))
    ));
    // A CA file without a certificate, and TLS without checking the certificate, are refused.
    std::fs::write(dir.join("empty.crt"), "not a certificate\n").unwrap();
    let e = open(&url, Some(dir.join("empty.crt")))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("TLS CA file") && e.contains("no PEM certificate"),
        "{e}"
    );
    let e = open(&format!("{url}/#insecure"), None)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("#insecure"), "{e}");
    for m in [&mut a, &mut b, &mut c] {
        m.shutdown();
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A TCP proxy to `127.0.0.1:upstream` that passes the server's bytes one per 50 ms once `slow`
/// is set (the client's go through at once): a TLS server that trickles.
struct TrickleProxy {
    port: u16,
    slow: Arc<std::sync::atomic::AtomicBool>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl TrickleProxy {
    fn start(upstream: u16) -> Self {
        use std::io::{Read, Write};
        use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        l.set_nonblocking(true).unwrap();
        let slow = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (sl, st) = (slow.clone(), stop.clone());
        std::thread::spawn(move || {
            while !st.load(Relaxed) {
                let Ok((c, _)) = l.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                c.set_nonblocking(false).unwrap();
                let Ok(u) = std::net::TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                c.set_nodelay(true).unwrap();
                u.set_nodelay(true).unwrap();
                let (mut c2, mut u2) = (c.try_clone().unwrap(), u.try_clone().unwrap());
                let (mut c, mut u) = (c, u);
                // Client to server: at once.
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut c2, &mut u2);
                    let _ = u2.shutdown(std::net::Shutdown::Both);
                });
                // Server to client: at once, or a byte per 50 ms once slow.
                let (sl, st) = (sl.clone(), st.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 << 10];
                    let mut pending: std::collections::VecDeque<u8> = Default::default();
                    u.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
                    while !st.load(Relaxed) {
                        match u.read(&mut buf) {
                            Ok(0) => break,
                            Ok(n) => pending.extend(&buf[..n]),
                            Err(_) => {}
                        }
                        if sl.load(Relaxed) {
                            if let Some(b) = pending.pop_front() {
                                if c.write_all(&[b]).is_err() {
                                    break;
                                }
                            }
                            std::thread::sleep(Duration::from_millis(50));
                        } else if !pending.is_empty() {
                            let all: Vec<u8> = pending.drain(..).collect();
                            if c.write_all(&all).is_err() {
                                break;
                            }
                        }
                    }
                    let _ = c.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        Self { port, slow, stop }
    }
}

impl Drop for TrickleProxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Host memory whose copies panic on demand: stands in for any panic inside an I/O thread's job.
struct PanickyMemory {
    inner: Arc<VecMemory>,
    panic_out: std::sync::atomic::AtomicBool,
    panic_in: std::sync::atomic::AtomicBool,
}

impl kvoff::tier::BlockMemory for PanickyMemory {
    fn block_bytes(&self) -> usize {
        self.inner.block_bytes()
    }
    fn num_blocks(&self) -> u64 {
        self.inner.num_blocks()
    }
    fn copy_out(&self, block: BlockId, out: &mut [u8]) -> kvoff::Result<()> {
        assert!(
            !self.panic_out.load(std::sync::atomic::Ordering::SeqCst),
            "copy_out panics (test)"
        );
        self.inner.copy_out(block, out)
    }
    fn copy_in(&self, block: BlockId, data: &[u8]) -> kvoff::Result<()> {
        assert!(
            !self.panic_in.load(std::sync::atomic::Ordering::SeqCst),
            "copy_in panics (test)"
        );
        self.inner.copy_in(block, data)
    }
}

/// A panic inside a write or a read job fails that job (blocks released, keys absent, errors
/// counted, the reason in `last_error`); `flush` still returns, the thread keeps working, and
/// nothing wrong is served.
#[test]
fn a_panic_in_an_io_job_fails_the_job_only() {
    use std::sync::atomic::Ordering::SeqCst;
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("panic", &[]);
    let mk = || {
        let inner = Arc::new(VecMemory::new(16, BLOCK));
        let mem = Arc::new(PanickyMemory {
            inner: inner.clone(),
            panic_out: false.into(),
            panic_in: false.into(),
        });
        let tier = RemoteTier::open(
            quick(RemoteConfig::new(srv.url(), layout("pn"))),
            mem.clone(),
        )
        .unwrap();
        let m = ChainManager::new(
            LruManager::new(ManagerConfig::new(16)),
            vec![ChainTier::new(Box::new(tier))],
            ChainConfig::default(),
        );
        (m, inner, mem)
    };
    let (mut a, inner_a, mem_a) = mk();
    mem_a.panic_out.store(true, SeqCst);
    store(&mut a, &inner_a, &[0, 1]);
    let t = Instant::now();
    a.flush();
    assert!(t.elapsed() < Duration::from_secs(3));
    let s = remote_stats(&mut a);
    assert_eq!(s.tier.writes, 0);
    assert!(s.tier.write_errors >= 2, "{s:?}");
    // The host blocks were released: they can be evicted for new stores.
    assert_eq!(a.get_stats().unwrap().0.num_evictable, 2);
    mem_a.panic_out.store(false, SeqCst);
    store(&mut a, &inner_a, &[2, 3]);
    a.flush();
    assert_eq!(
        remote_stats(&mut a).tier.writes,
        2,
        "the thread stopped working"
    );
    // A read job panics on a second engine: the promotion fails, nothing is served.
    let (mut b, inner_b, mem_b) = mk();
    mem_b.panic_in.store(true, SeqCst);
    let ks: Vec<ByteKey> = [2, 3].iter().map(|&i| key(i)).collect();
    let n = settle(&mut b, &ks, Duration::from_secs(10));
    b.flush();
    let s = remote_stats(&mut b);
    if n > 0 {
        // Promotions were scheduled before the copy panicked: they failed, and a new lookup
        // no longer counts them.
        assert!(s.tier.read_errors >= 1, "{s:?}");
    }
    mem_b.panic_in.store(false, SeqCst);
    std::thread::sleep(Duration::from_millis(300)); // negative TTL
    let n = settle(&mut b, &ks, Duration::from_secs(10));
    assert_eq!(n, 2, "not served after the panicking reads");
    b.flush();
    check_loaded(&mut b, &inner_b, &[2, 3]);
    a.shutdown();
    b.shutdown();
}

/// How [`Rogue`] answers a command other than `PING`, `AUTH`, `SELECT` and `HELLO`.
#[derive(Clone)]
enum Misbehave {
    /// An endless bulk string reply, one byte every 50 ms (each read well within the timeout).
    Trickle,
    /// `-MOVED <slot> 127.0.0.1:<port>`.
    Moved(u16),
    /// This error reply, whole.
    Error(Vec<u8>),
}

/// A misbehaving "server" on loopback (docs/tier.md "Faults"): `PING` is answered at once, `AUTH`
/// as `auth` says (`None`: `+OK`), every other command as `how` says. Records whether any
/// connection was made (`hits`).
struct Rogue {
    port: u16,
    hits: Arc<std::sync::atomic::AtomicUsize>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Rogue {
    fn start(how: Misbehave, auth: Option<Vec<u8>>) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
        let lis = TcpListener::bind("127.0.0.1:0").unwrap();
        lis.set_nonblocking(true).unwrap();
        let port = lis.local_addr().unwrap().port();
        let hits = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (h, st) = (hits.clone(), stop.clone());
        std::thread::spawn(move || {
            while !st.load(Relaxed) {
                let Ok((s, _)) = lis.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                h.fetch_add(1, Relaxed);
                let (how, auth, st) = (how.clone(), auth.clone(), st.clone());
                std::thread::spawn(move || Self::serve(s, port, &how, auth.as_deref(), &st));
            }
        });
        Self { port, hits, stop }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Reads one command (a RESP array of bulk strings); `None` at the end of the stream.
    fn command(r: &mut impl std::io::BufRead) -> Option<Vec<Vec<u8>>> {
        let mut line = String::new();
        let head = |r: &mut dyn std::io::BufRead, line: &mut String| -> Option<usize> {
            line.clear();
            if r.read_line(line).ok()? == 0 {
                return None;
            }
            line.trim_end()[1..].parse().ok()
        };
        let n = head(r, &mut line)?;
        let mut args = Vec::with_capacity(n);
        for _ in 0..n {
            let len = head(r, &mut line)?;
            let mut b = vec![0u8; len + 2];
            r.read_exact(&mut b).ok()?;
            b.truncate(len);
            args.push(b);
        }
        Some(args)
    }

    fn serve(
        s: std::net::TcpStream,
        me: u16,
        how: &Misbehave,
        auth: Option<&[u8]>,
        stop: &std::sync::atomic::AtomicBool,
    ) {
        use std::io::Write;
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut w = s.try_clone().unwrap();
        let mut r = std::io::BufReader::new(s);
        while let Some(args) = Self::command(&mut r) {
            let name = String::from_utf8_lossy(&args[0]).to_ascii_uppercase();
            let reply: Vec<u8> = match name.as_str() {
                "PING" => b"+PONG\r\n".to_vec(),
                "SELECT" | "HELLO" => b"+OK\r\n".to_vec(),
                // A one-node Cluster: every slot on this "server".
                "CLUSTER" => {
                    format!("*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:{me}\r\n")
                        .into_bytes()
                }
                "AUTH" => auth.map_or_else(|| b"+OK\r\n".to_vec(), <[u8]>::to_vec),
                _ => match how {
                    Misbehave::Trickle => {
                        let _ = w.write_all(b"$100000000\r\n");
                        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                            if w.write_all(b"x").is_err() {
                                return;
                            }
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        return;
                    }
                    Misbehave::Moved(port) => format!("-MOVED 1 127.0.0.1:{port}\r\n").into_bytes(),
                    Misbehave::Error(e) => e.clone(),
                },
            };
            if w.write_all(&reply).is_err() {
                return;
            }
        }
    }
}

impl Drop for Rogue {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Runs `f` on a thread of its own; fails the test when it takes longer than `limit` (the thread
/// is left behind: the process ends with the test run).
fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} took longer than {limit:?}"))
}

/// Runs `f` as [`within`] does, and fails the test unless it ended within 2.5 s: a job's bound
/// against a server that trickles or stalls (0.5 s I/O timeouts: a connect, and a pipeline
/// written and its replies read, plus the jobs that ran beside it; docs/tier.md "Faults").
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let t = Instant::now();
    let out = within(Duration::from_secs(5), what, f);
    assert!(
        t.elapsed() < Duration::from_millis(2500),
        "{what} took {:?}",
        t.elapsed()
    );
    out
}

/// A server that answers `PING` at once and every other reply one byte at a time (each read
/// within the I/O timeout, the whole reply never): writes, `flush()`, lookups' fetches and
/// shutdown end within their bounds (docs/tier.md "Faults": a node's pipeline is written, and its
/// replies read, within one I/O timeout each), the failures counted.
#[test]
fn trickling_server_bounds_flush_fetch_and_shutdown() {
    let _g = serial();
    let rogue = Rogue::start(Misbehave::Trickle, None);
    let (mut a, mem) = chain(&rogue.url(), "tr", 16);
    store(&mut a, &mem, &(0..8).collect::<Vec<_>>());
    // One write job's replies (0.5 s I/O timeout, plus an eighth) and those that ran beside it.
    let mut a = bounded("flush()", move || {
        a.flush();
        a
    });
    let s = remote_stats(&mut a);
    assert_eq!(s.tier.writes, 0, "{s:?}");
    assert!(s.tier.write_errors >= 1, "{s:?}");
    assert!(
        s.tier
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("timed out"),
        "{s:?}"
    );
    // A lookup's fetch ends too (the node is down, or its fetch times out): a miss, not pending.
    let ks: Vec<ByteKey> = (100..104).map(key).collect();
    let (n, mut a) = bounded("a lookup", move || {
        let n = settle(&mut a, &ks, Duration::from_secs(4));
        (n, a)
    });
    assert_eq!(n, 0);
    store(&mut a, &mem, &[20, 21]);
    bounded("shutdown()", move || a.shutdown());
}

/// A standalone server that answers `MOVED`: the command fails (counted, the reason kept), and
/// nothing — no connection, no `AUTH` with the password, no data — goes to the host it names. In
/// Cluster mode a redirect to a node the Cluster never announced is not followed either.
#[test]
fn redirects_never_leave_the_named_servers() {
    let _g = serial();
    let target = Rogue::start(Misbehave::Error(b"+OK\r\n".to_vec()), None);
    let liar = Rogue::start(Misbehave::Moved(target.port), None);
    use std::sync::atomic::Ordering::Relaxed;
    for url in [
        format!("redis://:hunter2@127.0.0.1:{}", liar.port),
        format!("redis+cluster://:hunter2@127.0.0.1:{}", liar.port),
    ] {
        let mem = Arc::new(VecMemory::new(4, BLOCK));
        let tier = RemoteTier::open(
            quick(RemoteConfig::new(url.clone(), layout("mv"))),
            mem.clone(),
        )
        .unwrap();
        mem.set_block(0, &pattern(0)).unwrap();
        assert_eq!(tier.submit_writes(&[(key(0), 0)]), vec![true]);
        tier.flush();
        let c = tier.counters();
        assert_eq!((c.writes, c.write_errors), (0, 1), "{url}: {c:?}");
        let err = c.last_error.unwrap_or_default();
        assert!(
            err.contains("MOVED") || err.contains("redirected"),
            "{url}: {err}"
        );
        assert!(!err.contains("hunter2"), "{err}");
        assert_eq!(
            target.hits.load(Relaxed),
            0,
            "{url}: the redirect was followed"
        );
    }
}

/// One redaction rule (docs/tier.md "Faults"): no password in a `ConfigError`, `Debug`, the URL
/// shown or `last_error`, whatever characters it holds (`,` `@` `:` raw) and whatever a server
/// echoes (an `AUTH` refused by echoing the command); error texts kept are capped (an 8 MiB
/// error reply is not an 8 MiB `last_error`).
#[test]
fn passwords_never_shown_and_errors_capped() {
    let _g = serial();
    for (url, shown) in [
        ("redis://:hunter2,xyz@h:1", "redis://:***@h:1"),
        (
            "redis+cluster://:hunter2,xyz@h:1,h2:2",
            "redis+cluster://:***@h:1,h2:2",
        ),
        (
            "redis+cluster://u:a,b@h:1,:c@d@h2:2",
            "redis+cluster://u:***@h:1,:***@h2:2",
        ),
        ("redis://u:p@ss:1@h:1", "redis://u:***@h:1"),
        ("redis://:p,h:1,q@h:1", "redis://:***@h:1"),
        ("redis://h:1", "redis://h:1"),
    ] {
        assert_eq!(redact(url), shown, "{url}");
    }
    let mem = Arc::new(VecMemory::new(4, BLOCK));
    for url in [
        "redis://:hunter2,xyz@",
        "redis+cluster://:hunter2,xyz@127.0.0.1:1,",
        "redis://:hunter2,xyz@127.0.0.1:1,127.0.0.1:2",
    ] {
        let cfg = quick(RemoteConfig::new(url, layout("pw")));
        let shown = format!("{cfg:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("xyz"),
            "{shown}"
        );
        let e = RemoteTier::open(cfg, mem.clone()).unwrap_err().to_string();
        assert!(!e.contains("hunter2") && !e.contains("xyz"), "{e}");
    }
    // A server that refuses AUTH by echoing it.
    let pw = "hunter2,s3cr@t";
    let echo = Rogue::start(
        Misbehave::Error(b"+OK\r\n".to_vec()),
        Some(format!("-ERR invalid password 'AUTH {pw}'\r\n").into_bytes()),
    );
    let url = format!("redis://:hunter2%2Cs3cr%40t@127.0.0.1:{}", echo.port);
    let tier = RemoteTier::open(quick(RemoteConfig::new(url, layout("pw"))), mem.clone()).unwrap();
    mem.set_block(0, &pattern(0)).unwrap();
    assert_eq!(tier.submit_writes(&[(key(0), 0)]), vec![true]);
    tier.flush();
    let c = tier.counters();
    assert_eq!(c.write_errors, 1, "{c:?}");
    let shown = format!("{c:?} {tier:?} {}", tier.url());
    assert!(shown.contains("AUTH"), "{shown}");
    assert!(
        !shown.contains("hunter2") && !shown.contains("s3cr"),
        "{shown}"
    );
    drop(tier);
    // An 8 MiB error reply to GET: last_error stays short.
    let mut huge = b"-ERR ".to_vec();
    huge.extend(std::iter::repeat_n(b'e', 8 << 20));
    huge.extend_from_slice(b"\r\n");
    let big = Rogue::start(Misbehave::Error(huge), None);
    let (mut a, _mem) = chain(&big.url(), "pw", 4);
    assert_eq!(settle(&mut a, &[key(1)], Duration::from_secs(5)), 0);
    let s = remote_stats(&mut a);
    let e = s.tier.last_error.clone().unwrap_or_default();
    assert!(e.contains("a reply line over"), "{e:.200}");
    assert!(
        e.len() <= kvoff::tier::remote::MAX_ERROR_BYTES + 32,
        "{} bytes",
        e.len()
    );
    a.shutdown();
    // A 60 KiB error reply (a reply, not a broken stream): kept, capped.
    let mut long = b"-ERR ".to_vec();
    long.extend(std::iter::repeat_n(b'e', 60 << 10));
    long.extend_from_slice(b"\r\n");
    let srv = Rogue::start(Misbehave::Error(long), None);
    let (mut a, _mem) = chain(&srv.url(), "pw", 4);
    assert_eq!(settle(&mut a, &[key(1)], Duration::from_secs(5)), 0);
    let e = remote_stats(&mut a).tier.last_error.unwrap_or_default();
    assert!(e.contains("ERR eee"), "{e:.200}");
    assert!(
        e.len() <= kvoff::tier::remote::MAX_ERROR_BYTES + 32,
        "{} bytes",
        e.len()
    );
    a.shutdown();
}

/// A file a setting names is read like the file tier's files (docs/tier.md "Faults"): a FIFO,
/// `/dev/zero`, a directory or an oversized file is a `ConfigError` at once (before: a FIFO never
/// returned from the open, `/dev/zero` was read until memory ran out).
#[test]
fn setting_files_are_regular_bounded_and_never_block() {
    let dir = tmpdir("cafile");
    let fifo = dir.join("fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let big = dir.join("big.pem");
    std::fs::write(&big, vec![b'a'; (2 << 20) as usize]).unwrap();
    for path in [fifo, PathBuf::from("/dev/zero"), dir.clone(), big] {
        let p = path.clone();
        let t = Instant::now();
        let e = within(Duration::from_secs(5), "opening", move || {
            let mut cfg = quick(RemoteConfig::new("rediss://127.0.0.1:1", layout("ca")));
            cfg.tls_ca_file = Some(p);
            RemoteTier::open(cfg, Arc::new(VecMemory::new(2, BLOCK))).map(|_| ())
        })
        .unwrap_err();
        assert!(matches!(e, KvoffError::Config(_)), "{path:?}: {e}");
        assert!(e.to_string().contains("TLS CA file"), "{e}");
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{path:?}: {:?}",
            t.elapsed()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A value shorter than its header is a rejected value whichever read finds it (docs/tier.md
/// "Values"): an empty string written over a 512 KiB block's value by another client is found
/// by the header fetch (where `GETRANGE` answers "" as for a missing key), counted as rejected and
/// deleted (before: a miss, neither counted nor deleted); a 10-byte value likewise.
#[test]
fn values_shorter_than_their_header_are_rejected() {
    use kvoff::tier::AlignedRows;
    let _g = serial();
    if !have_redis() {
        return;
    }
    const BIG: usize = 512 << 10;
    let srv = Server::start("short", &[]);
    let lay = || Layout {
        page_sizes_bytes: vec![BIG as u64],
        ..layout("short")
    };
    let open = |blocks: usize| {
        let mem = Arc::new(AlignedRows::new(blocks, BIG).unwrap());
        let tier =
            RemoteTier::open(quick(RemoteConfig::new(srv.url(), lay())), mem.clone()).unwrap();
        let keyname = |i: usize| tier.redis_key(&key(i));
        let names: Vec<String> = (0..4).map(keyname).collect();
        let m = ChainManager::new(
            LruManager::new(ManagerConfig::new(blocks)),
            vec![ChainTier::new(Box::new(tier))],
            ChainConfig::default(),
        );
        (m, mem, names)
    };
    let ks: Vec<ByteKey> = (0..3).map(key).collect();
    let (mut a, _mem_a, names) = open(4);
    let out = a.prepare_store(&ks).unwrap().expect("room");
    a.complete_store(&out.keys_to_store, true).unwrap();
    a.flush();
    assert_eq!(remote_stats(&mut a).tier.writes, 3);
    srv.cli(&["SET", &names[0], ""]);
    srv.cli(&["SET", &names[1], "0123456789"]);
    let (mut b, _mem_b, _) = open(4);
    for (i, k) in ks[..2].iter().enumerate() {
        assert_eq!(
            settle(&mut b, std::slice::from_ref(k), Duration::from_secs(5)),
            0
        );
        b.flush();
        let s = remote_stats(&mut b);
        assert_eq!(s.tier.rejected, i as u64 + 1, "{s:?}");
        assert_eq!(
            srv.cli(&["EXISTS", &names[i]]).trim(),
            "0",
            "value {i} kept"
        );
    }
    a.shutdown();
    b.shutdown();
}

/// `kvoff bench remote`'s native-client reference (`tier::remote::native_ref`): values of 2 MiB,
/// 32 KiB and an odd size round-trip byte for byte from 1 and 4 threads, with a password; the
/// server serves one `SET` and one `GET` per value per pass (one request per key, no header) and
/// one untimed `SET` per value before the first pass (timed `SET`s replace values, as kvoff's
/// timed stores do), and no key of the reference is left at the end. A Cluster or TLS URL and empty sizes are refused.
#[test]
fn native_reference_moves_every_value_once_and_cleans_up() {
    use kvoff::tier::remote::native_ref::NativeRef;
    let _g = serial();
    if !have_redis() {
        return;
    }
    let srv = Server::start("native", &["--requirepass", "pw"]);
    let url = format!("redis://:pw@127.0.0.1:{}", srv.port);
    let auth = |args: &[&str]| {
        let mut a = vec!["-a", "pw"];
        a.extend_from_slice(args);
        srv.cli(&a)
    };
    for (vb, n) in [(2 << 20, 9), (32 << 10, 300), (1000, 7)] {
        let before = (calls_auth(&auth, "set"), calls_auth(&auth, "get"));
        let mut r = NativeRef::new(&url, vb, n).unwrap();
        for threads in [1, 4] {
            let p = r.pass(threads).unwrap();
            assert!(p.verified, "{vb} B, {threads} threads: loaded bytes differ");
            assert_eq!(p.threads, threads);
            assert!(p.set_gb_s > 0.0 && p.get_gb_s > 0.0, "{p:?}");
        }
        let after = (calls_auth(&auth, "set"), calls_auth(&auth, "get"));
        assert_eq!(after.0 - before.0, 3 * n as u64, "{vb} B: SETs");
        assert_eq!(after.1 - before.1, 2 * n as u64, "{vb} B: GETs");
        r.cleanup().unwrap();
        assert_eq!(auth(&["DBSIZE"]).trim(), "0", "{vb} B: keys left");
    }
    // A wrong password is a clean error that does not show it.
    let bad = format!("redis://:nope-secret@127.0.0.1:{}", srv.port);
    let e = NativeRef::new(&bad, 64, 1)
        .unwrap()
        .pass(1)
        .unwrap_err()
        .to_string();
    assert!(!e.contains("nope-secret"), "{e}");
    for url in ["redis+cluster://127.0.0.1:1", "rediss://127.0.0.1:1"] {
        assert!(NativeRef::new(url, 64, 1).is_err(), "{url}");
    }
    assert!(NativeRef::new(&url, 0, 1).is_err());
    assert!(NativeRef::new(&url, 64, 0).is_err());
    assert!(NativeRef::new(&url, 1 << 30, 1 << 20).is_err());
}

/// Calls of `cmd` from `INFO commandstats`, through `cli` (a server with a password).
fn calls_auth(cli: &dyn Fn(&[&str]) -> String, cmd: &str) -> u64 {
    let info = cli(&["INFO", "commandstats"]);
    let prefix = format!("cmdstat_{cmd}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}
