//! The tiered manager with the file tier (docs/spec.md §9 protocol, docs/tier.md "Tier chain"):
//! write-through after complete_store, promotion on lookup, docs/spec.md §2 semantics over the
//! combined tiers.
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvoff::key::{make_offload_key, ByteKey};
use kvoff::manager::{LruManager, ManagerConfig, ManagerStats, Presence};
use kvoff::tier::chain::{ChainConfig, ChainCounters, ChainManager, ChainTier};
use kvoff::tier::{FileTier, Layout, TierConfig, TierStats, VecMemory};

const BLOCK: usize = 16 * 1024;

fn tmpdir(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "kvoff-tiered-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn key(i: u64) -> ByteKey {
    ByteKey::new(&make_offload_key(format!("{i}").as_bytes(), 0))
}

fn content(i: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|j| (i as usize * 31 + j * 7 + 1) as u8)
        .collect()
}

type Tm = ChainManager<LruManager<ByteKey>>;

/// A manager with one file tier that writes a key once it was stored `disk_store_threshold` times.
fn make(
    dir: &Path,
    num_blocks: usize,
    disk_store_threshold: u32,
    events: bool,
) -> (Tm, Arc<VecMemory>) {
    let mem = Arc::new(VecMemory::new(num_blocks, BLOCK));
    let mut tc = TierConfig::new(
        dir,
        1 << 30,
        Layout {
            namespace: "m".into(),
            page_sizes_bytes: vec![BLOCK as u64],
            block_size_factor: 1,
            dtype: "bf16".into(),
            world_size: 1,
            rank: 0,
        },
    );
    tc.rescan_interval = None;
    let tier = FileTier::open(tc, mem.clone()).unwrap();
    let mut mc = ManagerConfig::new(num_blocks);
    mc.enable_events = events;
    let tiers = vec![ChainTier {
        tier: Box::new(tier),
        store_threshold: disk_store_threshold,
    }];
    (
        ChainManager::new(LruManager::new(mc), tiers, ChainConfig::default()),
        mem,
    )
}

/// The file tier behind the manager.
fn ft(m: &Tm) -> &FileTier {
    m.tier_as::<FileTier>().expect("a file tier")
}

/// Host gauges, the file tier's stats and the manager's counters for it.
fn stats(m: &mut Tm) -> (ManagerStats, TierStats, ChainCounters) {
    let (hs, tiers) = m.get_stats().unwrap();
    assert_eq!(tiers.len(), 1);
    (hs, ft(m).stats(), tiers[0].chain.clone())
}

fn counters(m: &mut Tm) -> ChainCounters {
    stats(m).2
}

/// Stores keys through the manager as an engine would: prepare, write the bytes, complete.
fn store(m: &mut Tm, mem: &VecMemory, ids: &[u64]) {
    let keys: Vec<ByteKey> = ids.iter().map(|&i| key(i)).collect();
    let out = m.prepare_store(&keys).unwrap().expect("room");
    for (k, b) in out.keys_to_store.iter().zip(&out.block_ids) {
        let i = ids[keys.iter().position(|x| x == k).unwrap()];
        mem.set_block(*b, &content(i)).unwrap();
    }
    m.complete_store(&out.keys_to_store, true).unwrap();
}

fn settle(m: &mut Tm) {
    m.flush();
    m.poll().unwrap();
}

fn wait_ready(m: &mut Tm, k: &ByteKey) {
    let t0 = Instant::now();
    while m.lookup(k).unwrap() != Presence::Ready {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "promotion never finished"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn write_through_then_restart_promotes_on_lookup() {
    let dir = tmpdir("restart");
    {
        let (mut m, mem) = make(&dir, 8, 0, false);
        store(&mut m, &mem, &[1, 2, 3]);
        // The write pins the blocks only until they are copied out.
        settle(&mut m);
        let (hs, ts, c) = stats(&mut m);
        assert_eq!(hs.read_usage, 0.0, "write pins released");
        assert_eq!(hs.num_evictable, 3);
        assert_eq!(ts.files_written, 3);
        assert_eq!(c.writes_started, 3);
        m.shutdown();
    }
    let (mut m, mem) = make(&dir, 8, 0, true);
    assert_eq!(m.lookup(&key(9)).unwrap(), Presence::Absent);
    // Host miss + file hit: pending while the file is promoted.
    assert_eq!(m.lookup(&key(2)).unwrap(), Presence::Pending);
    assert_eq!(m.len(), 1);
    wait_ready(&mut m, &key(2));
    let ids = m.prepare_load(&[key(2)]).unwrap();
    assert_eq!(mem.block(ids[0]).unwrap(), content(2));
    m.complete_load(&[key(2)]).unwrap();
    // The promotion is a store: one stored event; it is not written back to disk.
    let ev = m.take_events().unwrap();
    assert_eq!(ev.len(), 1);
    assert!(!ev[0].removed);
    assert_eq!(ev[0].keys, vec![key(2)]);
    settle(&mut m);
    let (_, ts, c) = stats(&mut m);
    assert_eq!(ts.files_written, 0);
    assert_eq!(c.hits, 1);
    assert_eq!(c.promotions_started, 1);
    // lookup_prefix: host prefix [2], then 1 and 3 on disk: pending, both promoted at once.
    let keys = [key(2), key(1), key(3), key(9)];
    assert_eq!(m.lookup_prefix(&keys).unwrap(), None);
    assert_eq!(m.num_promoting(), 2);
    let t0 = Instant::now();
    loop {
        let n = m.lookup_prefix(&keys).unwrap();
        if n == Some(3) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "prefix never became ready: {n:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let ids = m.prepare_load(&keys[..3]).unwrap();
    for (i, b) in [2, 1, 3].into_iter().zip(ids) {
        assert_eq!(mem.block(b).unwrap(), content(i));
    }
    m.complete_load(&keys[..3]).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn host_eviction_falls_back_to_disk() {
    let dir = tmpdir("evict");
    let (mut m, mem) = make(&dir, 2, 0, true);
    store(&mut m, &mem, &[1, 2]);
    settle(&mut m);
    store(&mut m, &mem, &[3, 4]); // evicts 1 and 2 from host memory
    settle(&mut m);
    let ev = m.take_events().unwrap();
    assert!(ev
        .iter()
        .any(|e| e.removed && e.keys == vec![key(1), key(2)]));
    assert_eq!(m.lookup(&key(1)).unwrap(), Presence::Pending);
    wait_ready(&mut m, &key(1));
    let ids = m.prepare_load(&[key(1)]).unwrap();
    assert_eq!(mem.block(ids[0]).unwrap(), content(1));
    // While 1 is loading, promoting 2 needs a block: 3 or 4 is evicted (still on disk).
    assert_eq!(m.lookup(&key(2)).unwrap(), Presence::Pending);
    wait_ready(&mut m, &key(2));
    let ids2 = m.prepare_load(&[key(2)]).unwrap();
    assert_eq!(mem.block(ids2[0]).unwrap(), content(2));
    // Both blocks pinned by loads: no room to promote 3/4, so the lookup answers absent.
    let (k3, k4) = (key(3), key(4));
    let other = if m.lookup(&k3).unwrap() == Presence::Ready {
        k4
    } else {
        k3
    };
    assert_eq!(m.lookup(&other).unwrap(), Presence::Absent);
    assert!(counters(&mut m).promotions_no_room >= 1);
    m.complete_load(&[key(1), key(2)]).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn disk_admission_threshold_and_failed_stores() {
    let dir = tmpdir("thr");
    let (mut m, mem) = make(&dir, 1, 2, false);
    store(&mut m, &mem, &[1]);
    settle(&mut m);
    assert!(
        !ft(&m).contains(&key(1)),
        "first store is below the threshold"
    );
    assert_eq!(counters(&mut m).writes_below_threshold, 1);
    store(&mut m, &mem, &[2]); // evicts 1 from host memory
    store(&mut m, &mem, &[1]);
    settle(&mut m);
    assert!(ft(&m).contains(&key(1)), "second store reaches the disk");
    // A failed store writes nothing; complete_store of a ready key again is not a second write.
    let out = m.prepare_store(&[key(5)]).unwrap().unwrap();
    m.complete_store(&out.keys_to_store, false).unwrap();
    store(&mut m, &mem, &[1]);
    m.complete_store(&[key(1)], true).unwrap();
    settle(&mut m);
    assert!(!ft(&m).has_or_writing(&key(5)));
    assert_eq!(stats(&mut m).1.files_written, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_corrupt_file_is_a_miss_after_pending() {
    let dir = tmpdir("corrupt");
    {
        let (mut m, mem) = make(&dir, 4, 0, false);
        store(&mut m, &mem, &[1]);
        settle(&mut m);
        let p = ft(&m).path_of(&key(1));
        let mut b = std::fs::read(&p).unwrap();
        b[4096 + 100] ^= 0x80;
        std::fs::write(&p, b).unwrap();
        m.shutdown();
    }
    let (mut m, _) = make(&dir, 4, 0, true);
    assert_eq!(m.lookup(&key(1)).unwrap(), Presence::Pending);
    settle(&mut m);
    assert_eq!(m.lookup(&key(1)).unwrap(), Presence::Absent, "never served");
    let (hs, ts, c) = stats(&mut m);
    assert_eq!(ts.corrupt_files, 1);
    assert_eq!(c.promotions_failed, 1);
    assert_eq!(hs.num_present, 0);
    assert!(
        m.take_events().unwrap().is_empty(),
        "a failed promotion emits no event"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A key pending because the tier promotes it is not the caller's store: completing it would make
/// it readable before its bytes arrive, or free a block a read is landing in (docs/spec.md §9).
#[test]
fn completes_of_promoting_keys_raise_and_change_nothing() {
    let dir = tmpdir("promoting");
    {
        let (mut m, mem) = make(&dir, 4, 0, false);
        let out = m.prepare_store(&[key(1), key(2)]).unwrap().unwrap();
        for (k, b) in out.keys_to_store.iter().zip(&out.block_ids) {
            let i = if *k == key(1) { 1 } else { 2 };
            mem.set_block(*b, &content(i)).unwrap();
        }
        m.complete_store(&out.keys_to_store, true).unwrap();
        m.shutdown();
    }
    let (mut m, mem) = make(&dir, 4, 0, false);
    assert_eq!(m.lookup_prefix(&[key(1), key(2)]).unwrap(), None);
    assert_eq!(m.num_promoting(), 2);
    for success in [true, false] {
        let e = m.complete_store(&[key(1)], success).unwrap_err();
        assert!(matches!(e, kvoff::KvoffError::InvalidState(_)), "{e:?}");
    }
    let e = m.complete_load(&[key(2)]).unwrap_err();
    assert!(matches!(e, kvoff::KvoffError::InvalidState(_)), "{e:?}");
    assert_eq!(m.num_promoting(), 2);
    ft(&m).flush();
    for i in [1, 2] {
        assert_eq!(m.lookup(&key(i)).unwrap(), Presence::Ready);
        let ids = m.prepare_load(&[key(i)]).unwrap();
        assert_eq!(mem.block(ids[0]).unwrap(), content(i));
        m.complete_load(&[key(i)]).unwrap();
    }
    m.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two file tiers in one chain (docs/tier.md "Tier chain"): a key missing from the first and found
/// in the second is promoted from the second, counted as the first's miss and the second's hit,
/// and then written through to the first.
#[test]
fn a_key_found_in_the_second_tier_lands_in_the_first() {
    let (near, far) = (tmpdir("near"), tmpdir("far"));
    let open = |dir: &Path, mem: &Arc<VecMemory>| {
        let mut tc = TierConfig::new(
            dir,
            1 << 30,
            Layout {
                namespace: "m".into(),
                page_sizes_bytes: vec![BLOCK as u64],
                world_size: 1,
                ..Layout::default()
            },
        );
        tc.rescan_interval = None;
        ChainTier::new(Box::new(FileTier::open(tc, mem.clone()).unwrap()))
    };
    {
        // Only the far tier holds the block.
        let mem = Arc::new(VecMemory::new(4, BLOCK));
        let tiers = vec![open(&far, &mem)];
        let mut m = ChainManager::new(
            LruManager::new(ManagerConfig::new(4)),
            tiers,
            ChainConfig::default(),
        );
        store(&mut m, &mem, &[7]);
        m.shutdown();
    }
    let mem = Arc::new(VecMemory::new(4, BLOCK));
    let tiers = vec![open(&near, &mem), open(&far, &mem)];
    let mut m = ChainManager::new(
        LruManager::new(ManagerConfig::new(4)),
        tiers,
        ChainConfig::default(),
    );
    assert_eq!(m.lookup(&key(7)).unwrap(), Presence::Pending);
    wait_ready(&mut m, &key(7));
    let ids = m.prepare_load(&[key(7)]).unwrap();
    assert_eq!(mem.block(ids[0]).unwrap(), content(7));
    m.complete_load(&[key(7)]).unwrap();
    settle(&mut m);
    let (_, tiers) = m.get_stats().unwrap();
    assert_eq!((tiers[0].chain.misses, tiers[0].chain.hits), (1, 0));
    assert_eq!((tiers[1].chain.hits, tiers[1].tier.promotions), (1, 1));
    assert_eq!(tiers[0].tier.writes, 1, "written through to the near tier");
    assert_eq!(
        tiers[1].tier.writes, 0,
        "not written back to where it came from"
    );
    m.shutdown();
    let _ = std::fs::remove_dir_all(&near);
    let _ = std::fs::remove_dir_all(&far);
}
