//! The object tier (src/tier/object/, docs/tier.md "Object tier") against a real SeaweedFS S3
//! gateway started on loopback at random ports (tests/support/seaweed.rs): round trips between
//! engines, a value corrupted by another client, the byte budget under 10× its size, TTL,
//! namespaces, and the faults — server killed mid-PUT and mid-GET, restarted empty and with its
//! data, stopped (SIGSTOP), unreachable, bucket deleted, credentials refused — each ending as
//! misses or failed stores, counted, nothing wrong served, threads bounded, every call of the
//! scheduler's side returning at once.
#![allow(
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

#[path = "support/seaweed.rs"]
mod seaweed;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvoff::key::ByteKey;
use kvoff::manager::{LruManager, ManagerConfig};
use kvoff::tier::chain::{ChainConfig, ChainManager, ChainTier};
use kvoff::tier::object::{Credentials, ObjectConfig, ObjectTier};
use kvoff::tier::secondary::{Known, SecondaryTier};
use kvoff::tier::{Layout, VecMemory};
use object_store::path::Path;
use object_store::ObjectStore;

const BLOCK: usize = 64 << 10;

type Chain = ChainManager<LruManager<ByteKey>>;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn layout(ns: &str) -> Layout {
    Layout {
        namespace: ns.into(),
        page_sizes_bytes: vec![BLOCK as u64],
        block_size_factor: 1,
        dtype: "bfloat16".into(),
        world_size: 1,
        rank: 0,
    }
}

/// A config for `srv`'s bucket with quick timeouts.
fn cfg(srv: &seaweed::Seaweed, bucket: &str, ns: &str, budget: u64) -> ObjectConfig {
    let mut c = ObjectConfig::new(format!("s3://{bucket}/kv"), budget, layout(ns));
    c.endpoint = Some(srv.endpoint());
    c.credentials = Some(Credentials {
        access_key: srv.access_key.clone(),
        secret_key: srv.secret_key.clone(),
        token: None,
    });
    c.io_timeout = Duration::from_millis(1500);
    c.connect_timeout = Duration::from_millis(300);
    c.max_retries = 1;
    c.negative_ttl = Duration::from_millis(200);
    c.backoff_min = Duration::from_millis(100);
    c.backoff_max = Duration::from_millis(400);
    c
}

fn chain_of(c: ObjectConfig, blocks: usize) -> (Chain, Arc<VecMemory>) {
    let mem = Arc::new(VecMemory::new(blocks, BLOCK));
    let tier = ObjectTier::open(c, mem.clone()).unwrap();
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

fn store(m: &mut Chain, mem: &VecMemory, keys: &[usize]) {
    let ks: Vec<ByteKey> = keys.iter().map(|&i| key(i)).collect();
    let out = m.prepare_store(&ks).unwrap().expect("room");
    for (k, b) in out.keys_to_store.iter().zip(&out.block_ids) {
        let i = keys[ks.iter().position(|x| x == k).unwrap()];
        mem.set_block(*b, &pattern(i)).unwrap();
    }
    m.complete_store(&out.keys_to_store, true).unwrap();
}

/// Polls `lookup_prefix` until it answers (bounded), timing every call.
fn settle(m: &mut Chain, keys: &[ByteKey], limit: Duration) -> usize {
    let t0 = Instant::now();
    loop {
        let t = Instant::now();
        let r = m.lookup_prefix(keys).unwrap();
        assert!(
            t.elapsed() < Duration::from_millis(50),
            "a lookup took {:?}",
            t.elapsed()
        );
        if let Some(n) = r {
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
        assert_eq!(mem.block(b).unwrap(), pattern(i), "block {i} served wrong");
    }
    m.complete_load(&ks).unwrap();
}

fn stats(m: &mut Chain) -> kvoff::tier::chain::ChainTierStats {
    m.get_stats().unwrap().1.pop().unwrap()
}

fn object(m: &Chain) -> &ObjectTier {
    m.tier_as::<ObjectTier>().unwrap()
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// A plain client of the same bucket (another writer, the test's eyes).
fn client(srv: &seaweed::Seaweed, bucket: &str) -> (tokio::runtime::Runtime, impl ObjectStore) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let s = object_store::aws::AmazonS3Builder::new()
        .with_bucket_name(bucket)
        .with_region("us-east-1")
        .with_endpoint(srv.endpoint())
        .with_allow_http(true)
        .with_access_key_id(&srv.access_key)
        .with_secret_access_key(&srv.secret_key)
        .build()
        .unwrap();
    (rt, s)
}

/// Bytes and count of the objects under `prefix`.
fn listed(rt: &tokio::runtime::Runtime, s: &impl ObjectStore, prefix: &str) -> (u64, usize) {
    use futures::StreamExt;
    rt.block_on(async {
        let mut st = s.list(Some(&Path::from(prefix)));
        let (mut b, mut n) = (0, 0);
        while let Some(m) = st.next().await {
            b += m.unwrap().size;
            n += 1;
        }
        (b, n)
    })
}

#[test]
fn engines_share_values_and_namespaces_stay_apart() {
    let _g = serial();
    if !seaweed::have_weed() {
        return;
    }
    let srv = seaweed::Seaweed::start(&["share"]);
    let (mut a, mem_a) = chain_of(cfg(&srv, "share", "ns-a", 1 << 30), 32);
    let idx: Vec<usize> = (0..16).collect();
    store(&mut a, &mem_a, &idx);
    a.flush();
    let s = stats(&mut a);
    assert_eq!(s.tier.writes, 16, "{s:?}");
    let ks: Vec<ByteKey> = idx.iter().map(|&i| key(i)).collect();

    // Engine B (same namespace, empty host memory): finds the prefix by listing or fetching,
    // serves it byte for byte.
    let (mut b, mem_b) = chain_of(cfg(&srv, "share", "ns-a", 1 << 30), 32);
    let t0 = Instant::now();
    let mut n = 0;
    while n < 16 {
        n = settle(&mut b, &ks, Duration::from_secs(10));
        b.flush();
        assert!(t0.elapsed() < Duration::from_secs(10), "only {n} found");
    }
    check_loaded(&mut b, &mem_b, &idx);
    let sb = stats(&mut b);
    assert_eq!(sb.tier.promotions, 16, "{sb:?}");
    assert_eq!(sb.tier.rejected, 0);

    // Engine C in another namespace: nothing.
    let (mut c, _) = chain_of(cfg(&srv, "share", "ns-other", 1 << 30), 32);
    assert_eq!(settle(&mut c, &ks, Duration::from_secs(10)), 0);
    c.flush();
    assert_eq!(settle(&mut c, &ks, Duration::from_secs(10)), 0);
    assert_eq!(stats(&mut c).tier.promotions, 0);

    // A restart (a fresh engine) rebuilds its index by listing: every value known without a fetch.
    let (d, _) = chain_of(cfg(&srv, "share", "ns-a", 1 << 30), 32);
    object(&d).rescan();
    assert!(ks.iter().all(|k| object(&d).index(k) == Known::Present));
    assert_eq!(object(&d).stats().known_bytes, 16 * object(&d).value_len());
    for mut m in [a, b, c, d] {
        m.shutdown();
    }
}

#[test]
fn corrupted_values_are_rejected_counted_and_deleted() {
    let _g = serial();
    if !seaweed::have_weed() {
        return;
    }
    let srv = seaweed::Seaweed::start(&["corrupt"]);
    let (mut a, mem_a) = chain_of(cfg(&srv, "corrupt", "ns", 1 << 30), 8);
    store(&mut a, &mem_a, &[1, 2, 3]);
    a.flush();
    let (rt, cli) = client(&srv, "corrupt");
    // Another client overwrites block 2 with a flipped payload byte (same length), block 3 with
    // a value one byte short.
    let name2 = object(&a).object_name(&key(2));
    let name3 = object(&a).object_name(&key(3));
    rt.block_on(async {
        let mut v = cli
            .get(&Path::from(name2.as_str()))
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap()
            .to_vec();
        let last = v.len() - 1;
        v[last] ^= 0xff;
        cli.put(&Path::from(name2.as_str()), v.into())
            .await
            .unwrap();
        cli.put(&Path::from(name3.as_str()), vec![7u8; 100].into())
            .await
            .unwrap();
    });
    let (mut b, mem_b) = chain_of(cfg(&srv, "corrupt", "ns", 1 << 30), 8);
    object(&b).rescan();
    // Block 3's wrong length is rejected at the listing; block 2 at its read.
    let ks: Vec<ByteKey> = [1, 2].iter().map(|&i| key(i)).collect();
    let mut n = settle(&mut b, &ks, Duration::from_secs(10));
    b.flush();
    n = n.max(settle(&mut b, &ks, Duration::from_secs(10)));
    assert_eq!(n, 1, "the corrupt block 2 must never be served");
    check_loaded(&mut b, &mem_b, &[1]);
    let s = stats(&mut b);
    assert_eq!(s.tier.rejected, 2, "{s:?}");
    // Both are gone from the store (deleted by the reader).
    assert_eq!(
        listed(&rt, &cli, object(&b).base()).1,
        1,
        "rejected values deleted"
    );
    a.shutdown();
    b.shutdown();
}

#[test]
fn the_namespace_stays_within_its_budget_under_ten_times_its_size() {
    let _g = serial();
    if !seaweed::have_weed() {
        return;
    }
    let srv = seaweed::Seaweed::start(&["budget"]);
    let (rt, cli) = client(&srv, "budget");
    let mem_probe = Arc::new(VecMemory::new(1, BLOCK));
    let probe = ObjectTier::open(cfg(&srv, "budget", "ns", 1 << 30), mem_probe).unwrap();
    let value = probe.value_len();
    let base = probe.base().to_owned();
    drop(probe);
    let budget = 20 * value;
    let (mut a, mem) = chain_of(cfg(&srv, "budget", "ns", budget), 16);
    let mut worst = 0;
    for round in 0..25 {
        let idx: Vec<usize> = (round * 8..round * 8 + 8).collect();
        store(&mut a, &mem, &idx);
        a.flush();
        let (bytes, _) = listed(&rt, &cli, &base);
        worst = worst.max(bytes);
        assert!(bytes <= budget, "round {round}: {bytes} > {budget}");
    }
    let s = stats(&mut a);
    assert_eq!(s.tier.writes, 200, "{s:?}");
    let os = object(&a).stats();
    assert!(os.evictions >= 180, "{os:?}");
    assert!(os.known_bytes <= budget);
    assert_eq!(worst, budget, "the budget is used, not only bounded");
    // The most recent values are the ones kept.
    let (mut b, mem_b) = chain_of(cfg(&srv, "budget", "ns", budget), 32);
    object(&b).rescan();
    let recent: Vec<usize> = (180..200).collect();
    let ks: Vec<ByteKey> = recent.iter().map(|&i| key(i)).collect();
    let mut n = 0;
    let t0 = Instant::now();
    while n < 20 && t0.elapsed() < Duration::from_secs(10) {
        n = settle(&mut b, &ks, Duration::from_secs(10));
        b.flush();
    }
    assert_eq!(n, 20);
    check_loaded(&mut b, &mem_b, &recent);
    // A second engine with a smaller budget enforces it on everything it lists.
    let (c, _) = chain_of(cfg(&srv, "budget", "ns", 5 * value), 4);
    object(&c).rescan();
    object(&c).flush();
    std::thread::sleep(Duration::from_millis(200));
    assert!(listed(&rt, &cli, &base).0 <= 5 * value);
    for mut m in [a, b, c] {
        m.shutdown();
    }
}

/// Two engines writing one namespace, each 10× the budget: together never more than what each
/// keeps (2× the budget) even between listings, and within the budget once both have listed.
#[test]
fn engines_sharing_a_namespace_stay_bounded() {
    let _g = serial();
    if !seaweed::have_weed() {
        return;
    }
    let srv = seaweed::Seaweed::start(&["shared"]);
    let (rt, cli) = client(&srv, "shared");
    let mut c = cfg(&srv, "shared", "ns", 1);
    let probe = ObjectTier::open(c.clone(), Arc::new(VecMemory::new(1, BLOCK))).unwrap();
    let (value, base) = (probe.value_len(), probe.base().to_owned());
    drop(probe);
    c.bytes_to_use = 12 * value;
    c.list_interval = Some(Duration::from_millis(200));
    let (mut a, mem_a) = chain_of(c.clone(), 8);
    let (mut b, mem_b) = chain_of(c, 8);
    let mut worst = 0;
    for round in 0..15 {
        store(
            &mut a,
            &mem_a,
            &(round * 16..round * 16 + 8).collect::<Vec<_>>(),
        );
        store(
            &mut b,
            &mem_b,
            &(round * 16 + 8..round * 16 + 16).collect::<Vec<_>>(),
        );
        a.flush();
        b.flush();
        worst = worst.max(listed(&rt, &cli, &base).0);
    }
    assert!(worst <= 24 * value, "{worst} > 2 x budget");
    object(&a).rescan();
    object(&b).rescan();
    object(&a).flush();
    object(&b).flush();
    let (bytes, n) = listed(&rt, &cli, &base);
    assert!(
        bytes <= 12 * value,
        "{n} values, {bytes} bytes after both listed"
    );
    for mut m in [a, b] {
        m.shutdown();
    }
}

#[test]
fn values_past_their_ttl_are_neither_served_nor_kept() {
    let _g = serial();
    if !seaweed::have_weed() {
        return;
    }
    let srv = seaweed::Seaweed::start(&["ttl"]);
    let mut c = cfg(&srv, "ttl", "ns", 1 << 30);
    c.ttl = Some(Duration::from_millis(1500));
    let (mut a, mem) = chain_of(c.clone(), 8);
    store(&mut a, &mem, &[1, 2]);
    a.flush();
    let ks = [key(1), key(2)];
    assert!(object(&a).index(&ks[0]) == Known::Present);
    std::thread::sleep(Duration::from_millis(1600));
    assert_eq!(object(&a).index(&ks[0]), Known::Absent);
    let (b, _) = chain_of(c, 8);
    object(&b).rescan();
    assert_eq!(object(&b).stats().expired, 2);
    let (rt, cli) = client(&srv, "ttl");
    assert_eq!(listed(&rt, &cli, object(&b).base()).1, 0);
    for mut m in [a, b] {
        m.shutdown();
    }
}

/// Unreachable, killed mid-PUT and mid-GET, stopped, restarted empty and with its data: every
/// scheduler call returns at once, jobs end as failures or misses, the tier comes back, threads
/// are bounded.
#[test]
fn server_faults_end_as_misses_and_failed_stores() {
    let _g = serial();
    if !seaweed::have_weed() {
        return;
    }
    let mut srv = seaweed::Seaweed::start(&["faults"]);
    let threads0 = threads();
    {
        let (mut a, mem) = chain_of(cfg(&srv, "faults", "ns", 1 << 30), 64);
        store(&mut a, &mem, &(0..8).collect::<Vec<_>>());
        a.flush();
        assert_eq!(stats(&mut a).tier.writes, 8);

        // Killed mid-PUT: a batch of writes is queued, the server dies under it.
        store(&mut a, &mem, &(8..24).collect::<Vec<_>>());
        srv.kill();
        let t0 = Instant::now();
        a.flush();
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        // Down: lookups of unknown keys settle as misses at once; stores do not block.
        let unknown: Vec<ByteKey> = (100..140).map(key).collect();
        assert_eq!(settle(&mut a, &unknown, Duration::from_secs(5)), 0);
        let t = Instant::now();
        store(&mut a, &mem, &[40, 41]);
        assert!(t.elapsed() < Duration::from_millis(50));
        let s = stats(&mut a);
        assert!(s.tier.write_errors + s.tier.fetch_errors >= 1, "{s:?}");
        assert!(s.tier.last_error.is_some());

        // Restarted with its data: B finds the first 8 blocks.
        srv.restart();
        let (mut b, mem_b) = chain_of(cfg(&srv, "faults", "ns", 1 << 30), 64);
        let ks: Vec<ByteKey> = (0..8).map(key).collect();
        let t0 = Instant::now();
        loop {
            let n = settle(&mut b, &ks, Duration::from_secs(10));
            b.flush();
            if n == 8 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "only {n} after restart"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        check_loaded(&mut b, &mem_b, &(0..8).collect::<Vec<_>>());
        // A recovers and writes again.
        let t0 = Instant::now();
        let mut next = 1000;
        while stats(&mut a).tier.reconnects == 0 || object(&a).stats().known_bytes == 0 {
            next += 1;
            store(&mut a, &mem, &[next]);
            a.flush();
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "no reconnect: {:?}\n{:?}\nprobe {:?}\nweed: {}",
                stats(&mut a),
                object(&a).stats(),
                srv.write_probe("faults"),
                srv.log_tail()
            );
            std::thread::sleep(Duration::from_millis(100));
        }

        // Killed mid-GET: an engine that knows the values (listing) starts their promotions, the
        // server dies under the reads: they end within the timeouts as failed promotions or whole,
        // checked blocks — never a wrong one.
        let (mut g, mem_g) = chain_of(cfg(&srv, "faults", "ns", 1 << 30), 64);
        object(&g).rescan();
        assert!(
            g.lookup_prefix(&ks).unwrap().is_none_or(|n| n < 8),
            "promotions started"
        );
        srv.kill();
        let t0 = Instant::now();
        g.flush();
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        let served = settle(&mut g, &ks, Duration::from_secs(10));
        if served > 0 {
            check_loaded(&mut g, &mem_g, &(0..served).collect::<Vec<_>>());
        }
        g.shutdown();
        srv.restart();

        // Stopped (SIGSTOP) mid-GET: the read ends as a failed promotion within the timeouts,
        // lookups never wait.
        let (mut c, mem_c) = chain_of(cfg(&srv, "faults", "ns", 1 << 30), 64);
        object(&c).rescan();
        srv.stop();
        let t0 = Instant::now();
        let n = settle(&mut c, &ks, Duration::from_secs(10));
        c.flush();
        assert!(t0.elapsed() < Duration::from_secs(10));
        let n2 = settle(&mut c, &ks, Duration::from_secs(10));
        if n2 > 0 {
            check_loaded(&mut c, &mem_c, &(0..n2).collect::<Vec<_>>());
        }
        let _ = n;
        let sc = stats(&mut c);
        assert!(
            sc.tier.read_errors >= 1 || sc.tier.fetch_errors >= 1,
            "{sc:?}"
        );
        srv.cont();

        // Restarted empty: values are gone, B's reads fail as misses, nothing wrong served.
        srv.restart_empty();
        let (mut d, _) = chain_of(cfg(&srv, "faults", "ns", 1 << 30), 64);
        assert_eq!(settle(&mut d, &ks, Duration::from_secs(10)), 0);
        d.flush();
        assert_eq!(settle(&mut d, &ks, Duration::from_secs(10)), 0);
        let t0 = Instant::now();
        for mut m in [a, b, c, d] {
            m.shutdown();
        }
        assert!(t0.elapsed() < Duration::from_secs(15));
    }
    let t0 = Instant::now();
    while threads() > threads0 && t0.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(threads() <= threads0, "threads left behind");
}

#[test]
fn a_down_store_takes_no_host_blocks_for_promotions() {
    let _g = serial();
    if !seaweed::have_weed() {
        return;
    }
    let mut srv = seaweed::Seaweed::start(&["downhost"]);
    let mut c = cfg(&srv, "downhost", "ns", 1 << 30);
    c.backoff_min = Duration::from_secs(5);
    c.backoff_max = Duration::from_secs(5);
    let (mut m, mem) = chain_of(c, 8);
    store(&mut m, &mem, &(0..8).collect::<Vec<_>>());
    m.flush();
    store(&mut m, &mem, &(8..16).collect::<Vec<_>>()); // 0..8 leave host memory
    m.flush();
    assert_eq!(stats(&mut m).tier.writes, 16);
    let held: Vec<ByteKey> = (8..16).map(key).collect();
    let below: Vec<ByteKey> = (0..8).map(key).collect();
    assert_eq!(m.lookup_prefix(&held).unwrap(), Some(8));
    assert!(below.iter().all(|k| object(&m).index(k) == Known::Present));
    srv.kill();
    // A fetch fails: the store is down for the backoff.
    assert_eq!(settle(&mut m, &[key(500)], Duration::from_secs(5)), 0);
    assert!(!object(&m).read_ready());
    // Keys the store holds and host memory does not: a miss now, and no host block is taken
    // (evicting the ones held) for reads the down store would refuse.
    assert_eq!(m.lookup_prefix(&below).unwrap(), Some(0));
    assert_eq!(
        m.lookup(&below[0]).unwrap(),
        kvoff::manager::Presence::Absent
    );
    assert_eq!(
        m.lookup_prefix(&held).unwrap(),
        Some(8),
        "host blocks were evicted for promotions a down store refuses"
    );
    check_loaded(&mut m, &mem, &(8..16).collect::<Vec<_>>());
    assert_eq!(stats(&mut m).chain.promotions_started, 0);
}

#[test]
fn an_unreachable_endpoint_and_refused_credentials_are_counted_not_raised() {
    let _g = serial();
    if !seaweed::have_weed() {
        return;
    }
    let srv = seaweed::Seaweed::start(&["auth"]);
    // Nothing listens on this port.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut gone = cfg(&srv, "auth", "ns", 1 << 30);
    gone.endpoint = Some(format!("http://127.0.0.1:{port}"));
    let mut wrong = cfg(&srv, "auth", "ns", 1 << 30);
    wrong.credentials = Some(Credentials {
        access_key: "nobody".into(),
        secret_key: "wrong-secret-123".into(),
        token: None,
    });
    let mut missing = cfg(&srv, "no-such-bucket", "ns", 1 << 30);
    missing.url = "s3://no-such-bucket/kv".into();
    for c in [gone, wrong, missing] {
        let (mut m, mem) = chain_of(c, 8);
        store(&mut m, &mem, &[1]);
        m.flush();
        let unknown: Vec<ByteKey> = (10..20).map(key).collect();
        let mut worst = Duration::ZERO;
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(300) {
            for k in &unknown {
                let t = Instant::now();
                let _ = m.lookup(k).unwrap();
                worst = worst.max(t.elapsed());
            }
        }
        assert!(worst < Duration::from_millis(20), "{worst:?}");
        m.flush();
        let s = stats(&mut m);
        assert!(
            s.tier.write_errors >= 1 || s.tier.fetch_errors >= 1,
            "{s:?}"
        );
        let e = s.tier.last_error.unwrap_or_default();
        assert!(!e.contains("wrong-secret-123"), "{e}");
        assert_eq!(s.tier.promotions, 0);
        let t = Instant::now();
        m.shutdown();
        assert!(t.elapsed() < Duration::from_secs(10));
    }
}

#[test]
fn bad_settings_are_config_errors() {
    let mem = Arc::new(VecMemory::new(1, 4096));
    let creds = Credentials {
        access_key: "a".into(),
        secret_key: "b".into(),
        token: None,
    };
    let with = |url: &str, f: &dyn Fn(&mut ObjectConfig)| {
        let mut c = ObjectConfig::new(url, 1 << 20, layout("x"));
        c.credentials = Some(creds.clone());
        c.endpoint = Some("http://127.0.0.1:9".into());
        f(&mut c);
        ObjectTier::open(c, mem.clone()).map(|_| ())
    };
    assert!(with("s3://bkt/p", &|_| {}).is_ok());
    for (url, f) in [
        (
            "s3:///p",
            &(|_: &mut ObjectConfig| {}) as &dyn Fn(&mut ObjectConfig),
        ),
        ("http://bkt/p", &|_| {}),
        ("s3://bkt/p", &|c| c.bytes_to_use = 0),
        ("s3://bkt/p", &|c| c.endpoint = Some("ftp://x".into())),
        ("s3://bkt/p", &|c| c.io_threads = 0),
        ("s3://bkt/p", &|c| c.layout.rank = 3),
    ] {
        let e = with(url, f).unwrap_err();
        assert!(matches!(e, kvoff::KvoffError::Config(_)), "{url}: {e:?}");
    }
}
