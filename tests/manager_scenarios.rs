//! docs/spec.md §2.6 reference scenarios, for each policy where they apply. Capacity 4 unless noted;
//! keys `K(i) = make_offload_key(str(i), 0)`.
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]

use kvoff::key::make_offload_key;
use kvoff::manager::{
    ArcManager, LruManager, Manager, ManagerConfig, OffloadingManager, Policy, Presence,
};

type Key = Vec<u8>;

fn k(i: u32) -> Key {
    make_offload_key(i.to_string().as_bytes(), 0)
}
fn ks(ids: &[u32]) -> Vec<Key> {
    ids.iter().map(|&i| k(i)).collect()
}
fn cfg(cap: usize) -> ManagerConfig {
    let mut c = ManagerConfig::new(cap);
    c.enable_events = true;
    c
}
fn store<P: Policy>(
    m: &mut Manager<Key, P>,
    ids: &[u32],
) -> Option<(Vec<Key>, Vec<u32>, Vec<Key>)> {
    m.prepare_store(&ks(ids))
        .unwrap()
        .map(|o| (o.keys_to_store, o.block_ids, o.evicted_keys))
}
fn store_complete<P: Policy>(m: &mut Manager<Key, P>, ids: &[u32]) {
    store(m, ids).expect("store must fit");
    m.complete_store(&ks(ids), true).unwrap();
}
fn lk<P: Policy>(m: &Manager<Key, P>, i: u32) -> Presence {
    m.lookup(&k(i)).unwrap()
}
fn lists(m: &ArcManager<Key>) -> [Vec<Key>; 4] {
    m.debug_lists()
}

/// Scenarios 1–8 run as one sequence on a capacity-4 manager.
fn sequence_1_to_8<P: Policy>() {
    let mut m: Manager<Key, P> = Manager::new(cfg(4));
    // 1: store [1,2] → ids [0,1]; pending.
    assert_eq!(
        store(&mut m, &[1, 2]),
        Some((ks(&[1, 2]), vec![0, 1], vec![]))
    );
    assert_eq!(lk(&m, 1), Presence::Pending);
    assert_eq!(lk(&m, 2), Presence::Pending);
    // 2: complete → one stored event {1,2}.
    m.complete_store(&ks(&[1, 2]), true).unwrap();
    let ev = m.take_events().unwrap();
    assert_eq!(ev.len(), 1);
    assert_eq!((ev[0].keys.clone(), ev[0].removed), (ks(&[1, 2]), false));
    assert_eq!(lk(&m, 1), Presence::Ready);
    assert_eq!(lk(&m, 2), Presence::Ready);
    assert_eq!(lk(&m, 3), Presence::Absent);
    // 3: store [2,3,4,5] → keys [3,4,5], ids [2,3,0], evicted [1]; removed event {1}.
    assert_eq!(
        store(&mut m, &[2, 3, 4, 5]),
        Some((ks(&[3, 4, 5]), vec![2, 3, 0], ks(&[1])))
    );
    let ev = m.take_events().unwrap();
    assert_eq!(ev.len(), 1);
    assert_eq!((ev[0].keys.clone(), ev[0].removed), (ks(&[1]), true));
    // 4: store [1,6] with 3,4,5 pending → None.
    assert_eq!(store(&mut m, &[1, 6]), None);
    // 5: complete [2,3,4,5]; load [2,3] → ids [1,2]; store [6,7,8] → None.
    m.complete_store(&ks(&[2, 3, 4, 5]), true).unwrap();
    assert_eq!(m.prepare_load(&ks(&[2, 3])).unwrap(), vec![1, 2]);
    assert_eq!(store(&mut m, &[6, 7, 8]), None);
    // 6: complete_load [2,3]; store [6,7,8] → evicted [2,3,4], ids [3,2,1].
    m.complete_load(&ks(&[2, 3])).unwrap();
    assert_eq!(
        store(&mut m, &[6, 7, 8]),
        Some((ks(&[6, 7, 8]), vec![3, 2, 1], ks(&[2, 3, 4])))
    );
    // 7: complete [6,7,8]; touch [5,6,7]; store [9] → evicted [8], ids [1].
    m.complete_store(&ks(&[6, 7, 8]), true).unwrap();
    m.touch(&ks(&[5, 6, 7])).unwrap();
    assert_eq!(store(&mut m, &[9]), Some((ks(&[9]), vec![1], ks(&[8]))));
    m.take_events().unwrap();
    // 8: complete_store [7,9] failed → 7 still ready, 9 gone, no stored event.
    m.complete_store(&ks(&[7, 9]), false).unwrap();
    assert_eq!(lk(&m, 7), Presence::Ready);
    assert_eq!(lk(&m, 9), Presence::Absent);
    assert!(m.take_events().unwrap().is_empty());
    assert_eq!(m.len(), 3);
}

#[test]
fn s01_08_lru() {
    sequence_1_to_8::<kvoff::manager::Lru>();
}
#[test]
fn s01_08_arc() {
    sequence_1_to_8::<kvoff::manager::Arc>();
}

fn s09<P: Policy>() {
    let mut m: Manager<Key, P> = Manager::new(cfg(4));
    store_complete(&mut m, &[1, 2, 3, 4]);
    m.touch(&ks(&[1])).unwrap();
    assert_eq!(store(&mut m, &[5]), Some((ks(&[5]), vec![1], ks(&[2]))));
}
#[test]
fn s09_lru() {
    s09::<kvoff::manager::Lru>();
}
#[test]
fn s09_arc() {
    s09::<kvoff::manager::Arc>();
}

fn s10<P: Policy>() {
    let mut m: Manager<Key, P> = Manager::new(cfg(4));
    store_complete(&mut m, &[1, 2]);
    m.touch(&ks(&[1])).unwrap();
    // 2 is among the offered keys: protected even though it is the LRU one.
    assert_eq!(
        store(&mut m, &[2, 3, 4, 5]),
        Some((ks(&[3, 4, 5]), vec![2, 3, 0], ks(&[1])))
    );
    assert_eq!(lk(&m, 2), Presence::Ready);
}
#[test]
fn s10_lru() {
    s10::<kvoff::manager::Lru>();
}
#[test]
fn s10_arc() {
    s10::<kvoff::manager::Arc>();
}

#[test]
fn s11_lru_touch_order() {
    let mut m: LruManager<Key> = Manager::new(cfg(4));
    store_complete(&mut m, &[1, 2, 3, 4]);
    m.touch(&ks(&[1, 2])).unwrap();
    assert_eq!(m.debug_lists()[0], ks(&[3, 4, 2, 1]));
    let mut evicted = vec![];
    for new in 10..14 {
        let (_, _, ev) = store(&mut m, &[new]).unwrap();
        m.complete_store(&ks(&[new]), true).unwrap();
        evicted.extend(ev);
    }
    assert_eq!(evicted, ks(&[3, 4, 2, 1]));
}

fn s13_15<P: Policy>() {
    // 13: cap 2, both loading → None.
    let mut m: Manager<Key, P> = Manager::new(cfg(2));
    store_complete(&mut m, &[1, 2]);
    m.prepare_load(&ks(&[1, 2])).unwrap();
    assert_eq!(store(&mut m, &[3]), None);
    // 14: cap 2, 2 loading, 1 offered (protected) → None.
    let mut m: Manager<Key, P> = Manager::new(cfg(2));
    store_complete(&mut m, &[1, 2]);
    m.prepare_load(&ks(&[2])).unwrap();
    assert_eq!(store(&mut m, &[1, 3]), None);
    // 15: cap 3: not enough evictable for three → None, nothing evicted.
    let mut m: Manager<Key, P> = Manager::new(cfg(3));
    store_complete(&mut m, &[1, 2, 3]);
    m.prepare_load(&ks(&[1])).unwrap();
    m.take_events().unwrap();
    assert_eq!(store(&mut m, &[4, 5, 6]), None);
    for i in 1..=3 {
        assert_eq!(lk(&m, i), Presence::Ready);
    }
    assert!(m.take_events().unwrap().is_empty());
}
#[test]
fn s13_15_lru() {
    s13_15::<kvoff::manager::Lru>();
}
#[test]
fn s13_15_arc() {
    s13_15::<kvoff::manager::Arc>();
}

#[test]
fn s17_18_arc_ghost_hit() {
    let mut m: ArcManager<Key> = Manager::new(cfg(2));
    store_complete(&mut m, &[1, 2]);
    assert_eq!(store(&mut m, &[3]), Some((ks(&[3]), vec![0], ks(&[1]))));
    m.complete_store(&ks(&[3]), true).unwrap();
    let [t1, t2, b1, b2] = lists(&m);
    assert_eq!((t1, t2, b1, b2), (ks(&[2, 3]), vec![], ks(&[1]), vec![]));
    assert!((m.policy().p - 0.0).abs() < f64::EPSILON);
    // 18: touching a B1 ghost adapts p.
    m.touch(&ks(&[1])).unwrap();
    assert!((m.policy().p - 1.0).abs() < f64::EPSILON);
    assert_eq!(lk(&m, 1), Presence::Absent);
}

#[test]
fn s19_21_arc_promotion() {
    let mut m: ArcManager<Key> = Manager::new(cfg(4));
    store_complete(&mut m, &[1, 2, 3, 4]);
    m.touch(&ks(&[3, 4])).unwrap();
    let [t1, t2, _, _] = lists(&m);
    assert_eq!((t1, t2), (ks(&[1, 2]), ks(&[4, 3])));
    // 21
    m.touch(&ks(&[1, 3, 4])).unwrap();
    assert_eq!(lists(&m)[1], ks(&[4, 3, 1]));
    assert_eq!(store(&mut m, &[5]), Some((ks(&[5]), vec![1], ks(&[2]))));
}

#[test]
fn s22_arc_ghost_trim() {
    let mut m: ArcManager<Key> = Manager::new(cfg(2));
    store_complete(&mut m, &[1, 2]);
    for i in 3..=19 {
        store_complete(&mut m, &[i]);
    }
    let [t1, _, b1, _] = lists(&m);
    assert_eq!((t1, b1), (ks(&[18, 19]), ks(&[16, 17])));
}

#[test]
fn arc_pending_touch_stays_in_t1_and_b2_hit_lowers_p() {
    let mut m: ArcManager<Key> = Manager::new(cfg(2));
    store(&mut m, &[1]).unwrap();
    m.touch(&ks(&[1])).unwrap(); // pending: stays in T1
    assert_eq!(lists(&m)[0], ks(&[1]));
    m.complete_store(&ks(&[1]), true).unwrap();
    m.touch(&ks(&[1])).unwrap(); // ready: to T2
    assert_eq!(lists(&m)[1], ks(&[1]));
    store_complete(&mut m, &[2]);
    // p = 0 and |T1| = 1 ≥ 0: T1's 2 goes first, then T2's 1.
    store_complete(&mut m, &[3, 4]);
    let [_, _, b1, b2] = lists(&m);
    assert_eq!((b1, b2), (ks(&[2]), ks(&[1])));
    m.touch(&ks(&[2])).unwrap(); // B1 hit: p = 0 + max(1, 1/1) = 1
    assert!((m.policy().p - 1.0).abs() < f64::EPSILON);
    // Re-inserting 1 (B2 ghost): p = max(1 - max(1, |B1|/|B2|), 0) = 0; 1 goes to T1.
    store_complete(&mut m, &[1]);
    assert!(m.policy().p.abs() < f64::EPSILON);
    assert!(lists(&m)[0].contains(&k(1)));
    // Failed stores leave no ghost.
    store(&mut m, &[7]).unwrap();
    m.complete_store(&ks(&[7]), false).unwrap();
    let [t1, t2, b1, b2] = lists(&m);
    assert!(![t1, t2, b1, b2].iter().any(|l| l.contains(&k(7))));
}

fn admission<P: Policy>() {
    let mut c = cfg(4);
    c.store_threshold = 2;
    c.max_tracker_size = 3;
    let mut m: Manager<Key, P> = Manager::new(c);
    // 25
    assert_eq!(store(&mut m, &[1, 2, 3]), Some((vec![], vec![], vec![])));
    assert_eq!(m.get_stats().unwrap().stores_skipped, 3);
    assert_eq!(m.get_stats().unwrap().stores_skipped, 0);
    // 26
    assert_eq!(store(&mut m, &[1, 2]).unwrap().0, ks(&[1, 2]));
    // Tracker bounded: offering 4, 5, 6 drops 3 (the LRU one), so 3 needs two more offers.
    assert_eq!(store(&mut m, &[4, 5, 6]).unwrap().0, Vec::<Key>::new());
    assert_eq!(store(&mut m, &[3]).unwrap().0, Vec::<Key>::new());
    assert_eq!(store(&mut m, &[3]).unwrap().0, ks(&[3]));
}
#[test]
fn s25_26_admission_lru() {
    admission::<kvoff::manager::Lru>();
}
#[test]
fn s25_26_admission_arc() {
    admission::<kvoff::manager::Arc>();
}

fn gauges<P: Policy>() {
    let mut m: Manager<Key, P> = Manager::new(cfg(4));
    let g = |m: &mut Manager<Key, P>| {
        let s = m.get_stats().unwrap();
        (s.write_usage, s.read_usage, s.usage)
    };
    store(&mut m, &[1, 2]).unwrap();
    assert_eq!(g(&mut m), (0.5, 0.0, 0.5));
    m.complete_store(&ks(&[1, 2]), true).unwrap();
    assert_eq!(g(&mut m), (0.0, 0.0, 0.0));
    m.prepare_load(&ks(&[1])).unwrap();
    assert_eq!(g(&mut m), (0.0, 0.25, 0.25));
    m.complete_load(&ks(&[1])).unwrap();
    store(&mut m, &[3, 4]).unwrap();
    m.prepare_load(&ks(&[2])).unwrap();
    assert_eq!(g(&mut m), (0.5, 0.25, 0.75));
    let s = m.get_stats().unwrap();
    assert_eq!(
        (s.num_blocks, s.num_present, s.num_free, s.num_evictable),
        (4, 4, 0, 1)
    );
}
#[test]
fn s27_gauges_lru() {
    gauges::<kvoff::manager::Lru>();
}
#[test]
fn s27_gauges_arc() {
    gauges::<kvoff::manager::Arc>();
}

fn capacity_zero<P: Policy>() {
    let mut m: Manager<Key, P> = Manager::new(cfg(0));
    assert_eq!(store(&mut m, &[1]), None);
    assert_eq!(m.get_stats().unwrap().usage, 0.0);
    assert_eq!(store(&mut m, &[]), Some((vec![], vec![], vec![])));
}
#[test]
fn s30_capacity_zero_lru() {
    capacity_zero::<kvoff::manager::Lru>();
}
#[test]
fn s30_capacity_zero_arc() {
    capacity_zero::<kvoff::manager::Arc>();
}

fn errors_change_nothing<P: Policy>() {
    let mut m: Manager<Key, P> = Manager::new(cfg(4));
    store_complete(&mut m, &[1, 2]);
    store(&mut m, &[3]).unwrap();
    let before = (m.debug_lists(), m.get_stats().unwrap());
    // prepare_load of a pending or absent key fails and pins nothing.
    assert!(m.prepare_load(&ks(&[1, 3])).is_err());
    assert!(m.prepare_load(&ks(&[1, 9])).is_err());
    // complete_load without loads fails; with too many duplicates fails and rolls back.
    assert!(m.complete_load(&ks(&[1])).is_err());
    assert_eq!((m.debug_lists(), m.get_stats().unwrap()), before);
    m.prepare_load(&ks(&[1])).unwrap();
    assert!(m.complete_load(&ks(&[1, 1])).is_err());
    m.complete_load(&ks(&[1])).unwrap();
    assert_eq!((m.debug_lists(), m.get_stats().unwrap()), before);
    // Duplicated loads count twice.
    m.prepare_load(&ks(&[2, 2])).unwrap();
    m.complete_load(&ks(&[2])).unwrap();
    assert_eq!(m.get_stats().unwrap().num_evictable, 1);
    m.complete_load(&ks(&[2])).unwrap();
    assert_eq!((m.debug_lists(), m.get_stats().unwrap()), before);
    // Shutdown: idempotent, then everything fails.
    m.shutdown();
    m.shutdown();
    assert!(m.lookup(&k(1)).is_err());
    assert!(m.prepare_store(&ks(&[5])).is_err());
    assert!(m.get_stats().is_err());
}
#[test]
fn errors_lru() {
    errors_change_nothing::<kvoff::manager::Lru>();
}
#[test]
fn errors_arc() {
    errors_change_nothing::<kvoff::manager::Arc>();
}

fn misc<P: Policy>() {
    let mut m: Manager<Key, P> = Manager::new(cfg(4));
    // Duplicates in prepare_store count once; lookup_prefix stops at pending (None) or absent.
    assert_eq!(store(&mut m, &[1, 1, 2]).unwrap().1, vec![0, 1]);
    assert_eq!(m.lookup_prefix(&ks(&[1, 2])).unwrap(), None);
    m.complete_store(&ks(&[1]), true).unwrap();
    assert_eq!(m.lookup_prefix(&ks(&[1, 2])).unwrap(), None);
    assert_eq!(m.lookup_prefix(&ks(&[1, 5, 2])).unwrap(), Some(1));
    m.complete_store(&ks(&[2, 2, 9]), true).unwrap();
    assert_eq!(m.lookup_prefix(&ks(&[1, 2])).unwrap(), Some(2));
    // Stored event of the second completion lists 2 once.
    let ev = m.take_events().unwrap();
    assert_eq!(
        ev.iter().map(|e| e.keys.clone()).collect::<Vec<_>>(),
        vec![ks(&[1]), ks(&[2])]
    );
    // Reset: ids start again from 0; events stay.
    store(&mut m, &[3]).unwrap();
    m.reset().unwrap();
    assert_eq!(m.len(), 0);
    assert_eq!(store(&mut m, &[7]).unwrap().1, vec![0]);
}
#[test]
fn misc_lru() {
    misc::<kvoff::manager::Lru>();
}
#[test]
fn misc_arc() {
    misc::<kvoff::manager::Arc>();
}
