//! Property / state-machine tests of the offloading managers (docs/spec.md §2) against a small reference
//! model.
//!
//! Random operation sequences over a small key universe and small capacities drive both the real
//! manager ([`LruManager`] / [`ArcManager`]) and [`Model`], a deliberately naive, `Vec`-based
//! transcription of docs/spec.md §2.2–§2.5 written for this test only. Every return value is compared
//! exactly (block ids, evicted keys and their order, lookups, stats, events, ARC's lists and `p`),
//! and after every step invariants that do not depend on the model are checked on the real manager:
//! present ≤ capacity; block ids unique and in range; pending, loading and offered keys are never
//! evicted; a `None` from `prepare_store` or an `Err` changes nothing; replaying the taken events
//! reproduces exactly the set of ready-or-loading keys.
//!
//! Operations pick their keys through [`Sel`]ectors resolved against the model's state ("a ready
//! key", "a loading key", "a ghost key", …), so that most generated calls are valid and deep states
//! (full caches, pinned blocks, ghost hits, admission) are reached, while some are deliberately
//! invalid.
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::hash::Hash;

use kvoff::manager::{
    Arc, ArcManager, Lru, LruManager, Manager, ManagerConfig, ManagerStats, OffloadingEvent,
    OffloadingManager, Policy, PrepareStoreOutput, Presence,
};
use proptest::prelude::*;
use proptest::test_runner::Config as PropConfig;

/// Keys are drawn from `0..UNIVERSE` (`0..BIG_UNIVERSE` in the larger-capacity runs).
const UNIVERSE: u64 = 12;
const BIG_UNIVERSE: u64 = 40;

// ---------------------------------------------------------------------------------------------
// Reference model
// ---------------------------------------------------------------------------------------------

/// A resident entry of the model.
#[derive(Clone, Debug, PartialEq)]
struct Ent<K> {
    key: K,
    id: u32,
    pending: bool,
    loads: u32,
}

/// Naive model of docs/spec.md §2. Lists are `Vec`s with the LRU end at index 0. LRU uses only `t1`.
#[derive(Clone, Debug)]
struct Model<K> {
    arc: bool,
    cap: usize,
    threshold: usize,
    max_tracker: usize,
    events_on: bool,
    ents: Vec<Ent<K>>,
    t1: Vec<K>,
    t2: Vec<K>,
    b1: Vec<K>,
    b2: Vec<K>,
    p: f64,
    next_fresh: u32,
    freed: Vec<u32>,
    /// Admission tracker: (key, offers), LRU end first.
    tracker: Vec<(K, usize)>,
    skipped: u64,
    /// (keys, removed)
    events: Vec<(Vec<K>, bool)>,
    shut: bool,
}

fn remove_item<K: PartialEq>(v: &mut Vec<K>, k: &K) -> bool {
    if let Some(i) = v.iter().position(|x| x == k) {
        v.remove(i);
        true
    } else {
        false
    }
}

#[allow(clippy::cast_precision_loss)]
impl<K: Clone + Eq + Debug> Model<K> {
    fn new(arc: bool, cfg: &ManagerConfig) -> Self {
        Self {
            arc,
            cap: cfg.num_blocks,
            threshold: cfg.store_threshold,
            max_tracker: cfg.max_tracker_size,
            events_on: cfg.enable_events,
            ents: Vec::new(),
            t1: Vec::new(),
            t2: Vec::new(),
            b1: Vec::new(),
            b2: Vec::new(),
            p: 0.0,
            next_fresh: 0,
            freed: Vec::new(),
            tracker: Vec::new(),
            skipped: 0,
            events: Vec::new(),
            shut: false,
        }
    }

    fn ent(&self, k: &K) -> Option<&Ent<K>> {
        self.ents.iter().find(|e| e.key == *k)
    }

    fn ent_mut(&mut self, k: &K) -> Option<&mut Ent<K>> {
        self.ents.iter_mut().find(|e| e.key == *k)
    }

    fn lookup(&self, k: &K) -> Presence {
        match self.ent(k) {
            None => Presence::Absent,
            Some(e) if e.pending => Presence::Pending,
            Some(_) => Presence::Ready,
        }
    }

    fn lookup_prefix(&self, keys: &[K]) -> Option<usize> {
        for (n, k) in keys.iter().enumerate() {
            match self.lookup(k) {
                Presence::Ready => {}
                Presence::Pending => return None,
                Presence::Absent => return Some(n),
            }
        }
        Some(keys.len())
    }

    fn prepare_load(&mut self, keys: &[K]) -> Option<Vec<u32>> {
        if !keys.iter().all(|k| self.lookup(k) == Presence::Ready) {
            return None;
        }
        let mut ids = Vec::new();
        for k in keys {
            let e = self.ent_mut(k).unwrap();
            e.loads += 1;
            ids.push(e.id);
        }
        Some(ids)
    }

    fn complete_load(&mut self, keys: &[K]) -> bool {
        let mut next = self.ents.clone();
        for k in keys {
            match next.iter_mut().find(|e| e.key == *k) {
                Some(e) if e.loads > 0 => e.loads -= 1,
                _ => return false,
            }
        }
        self.ents = next;
        true
    }

    /// ARC's adaptation for a hit in ghost list `b1` (`true`) or `b2`, with the current sizes.
    fn adapt(&mut self, in_b1: bool) {
        let (b1, b2) = (self.b1.len() as f64, self.b2.len() as f64);
        if in_b1 {
            self.p = f64::min(self.p + f64::max(1.0, b2 / b1), self.cap as f64);
        } else {
            self.p = f64::max(self.p - f64::max(1.0, b1 / b2), 0.0);
        }
    }

    fn touch(&mut self, keys: &[K]) {
        for k in keys.iter().rev() {
            if !self.arc {
                if remove_item(&mut self.t1, k) {
                    self.t1.push(k.clone());
                }
                continue;
            }
            if self.t1.contains(k) {
                remove_item(&mut self.t1, k);
                if self.ent(k).unwrap().pending {
                    self.t1.push(k.clone());
                } else {
                    self.t2.push(k.clone());
                }
            } else if remove_item(&mut self.t2, k) {
                self.t2.push(k.clone());
            } else if self.b1.contains(k) {
                self.adapt(true);
                remove_item(&mut self.b1, k);
                self.b1.push(k.clone());
            } else if self.b2.contains(k) {
                self.adapt(false);
                remove_item(&mut self.b2, k);
                self.b2.push(k.clone());
            }
        }
    }

    fn alloc(&mut self) -> u32 {
        if (self.next_fresh as usize) < self.cap {
            self.next_fresh += 1;
            self.next_fresh - 1
        } else {
            self.freed.pop().expect("model: no free id")
        }
    }

    fn prepare_store(&mut self, keys: &[K]) -> Option<PrepareStoreOutput<K>> {
        // 1. Dedup.
        let mut uniq: Vec<K> = Vec::new();
        for k in keys {
            if !uniq.contains(k) {
                uniq.push(k.clone());
            }
        }
        // 2. Partition.
        let mut cands: Vec<K> = uniq
            .iter()
            .filter(|k| self.ent(k).is_none())
            .cloned()
            .collect();
        // 3. Admission (decided on a copy of the tracker, committed only on success).
        let mut tracker = self.tracker.clone();
        let mut skipped = 0u64;
        if self.threshold >= 2 {
            for k in &uniq {
                let c = match tracker.iter().position(|(x, _)| x == k) {
                    Some(i) => tracker.remove(i).1 + 1,
                    None => 1,
                };
                tracker.push((k.clone(), c));
            }
            while tracker.len() > self.max_tracker && !uniq.contains(&tracker[0].0) {
                tracker.remove(0);
            }
            let before = cands.len();
            cands.retain(|k| tracker.iter().any(|(x, c)| x == k && *c >= self.threshold));
            skipped = (before - cands.len()) as u64;
        }
        // 5. Room.
        let free = self.cap - self.ents.len();
        let need = cands.len().saturating_sub(free);
        let evictable = |m: &Self, k: &K| {
            let e = m.ent(k).unwrap();
            !e.pending && e.loads == 0 && !uniq.contains(k)
        };
        let mut victims: Vec<K> = Vec::new();
        if need > 0 {
            let n_evictable = self.ents.iter().filter(|e| evictable(self, &e.key)).count();
            if n_evictable < need {
                return None;
            }
            if self.arc {
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let target = self.p.floor() as usize;
                let mut c1 = self.t1.iter().filter(|k| evictable(self, k));
                let mut c2 = self.t2.iter().filter(|k| evictable(self, k));
                let mut t1_chosen = 0;
                for _ in 0..need {
                    let v = if self.t1.len() - t1_chosen >= target {
                        match c1.next() {
                            Some(k) => {
                                t1_chosen += 1;
                                k
                            }
                            None => c2.next().unwrap(),
                        }
                    } else {
                        match c2.next() {
                            Some(k) => k,
                            None => {
                                t1_chosen += 1;
                                c1.next().unwrap()
                            }
                        }
                    };
                    victims.push(v.clone());
                }
            } else {
                victims = self
                    .t1
                    .iter()
                    .filter(|k| evictable(self, k))
                    .take(need)
                    .cloned()
                    .collect();
            }
        }
        // Commit.
        if self.threshold >= 2 {
            self.tracker = tracker;
            self.skipped += skipped;
        }
        for v in &victims {
            let i = self.ents.iter().position(|e| e.key == *v).unwrap();
            let e = self.ents.remove(i);
            self.freed.push(e.id);
            if remove_item(&mut self.t1, v) {
                if self.arc {
                    self.b1.push(v.clone());
                }
            } else {
                assert!(remove_item(&mut self.t2, v));
                self.b2.push(v.clone());
            }
        }
        while self.b1.len() > self.cap {
            self.b1.remove(0);
        }
        while self.b2.len() > self.cap {
            self.b2.remove(0);
        }
        if self.events_on && !victims.is_empty() {
            self.events.push((victims.clone(), true));
        }
        let mut ids = Vec::new();
        for k in &cands {
            let id = self.alloc();
            ids.push(id);
            if self.b1.contains(k) {
                self.adapt(true);
                remove_item(&mut self.b1, k);
            } else if self.b2.contains(k) {
                self.adapt(false);
                remove_item(&mut self.b2, k);
            }
            self.t1.push(k.clone());
            self.ents.push(Ent {
                key: k.clone(),
                id,
                pending: true,
                loads: 0,
            });
        }
        Some(PrepareStoreOutput {
            keys_to_store: cands,
            block_ids: ids,
            evicted_keys: victims,
        })
    }

    fn complete_store(&mut self, keys: &[K], success: bool) {
        let mut stored = Vec::new();
        for k in keys {
            if self.lookup(k) != Presence::Pending {
                continue;
            }
            if success {
                self.ent_mut(k).unwrap().pending = false;
                stored.push(k.clone());
            } else {
                let i = self.ents.iter().position(|e| e.key == *k).unwrap();
                self.freed.push(self.ents.remove(i).id);
                assert!(remove_item(&mut self.t1, k), "pending keys live in T1");
            }
        }
        if self.events_on && !stored.is_empty() {
            self.events.push((stored, false));
        }
    }

    fn take_events(&mut self) -> Vec<(Vec<K>, bool)> {
        std::mem::take(&mut self.events)
    }

    #[allow(clippy::cast_precision_loss)]
    fn get_stats(&mut self) -> ManagerStats {
        let pending = self.ents.iter().filter(|e| e.pending).count();
        let loading = self.ents.iter().filter(|e| e.loads > 0).count();
        let (write, usage) = if self.cap == 0 {
            (0.0, 0.0)
        } else {
            (
                pending as f64 / self.cap as f64,
                (pending + loading) as f64 / self.cap as f64,
            )
        };
        ManagerStats {
            usage,
            write_usage: write,
            read_usage: usage - write,
            num_blocks: self.cap,
            num_present: self.ents.len(),
            num_free: self.cap - self.ents.len(),
            num_evictable: self.ents.len() - pending - loading,
            stores_skipped: std::mem::take(&mut self.skipped),
        }
    }

    fn reset(&mut self) {
        let events = std::mem::take(&mut self.events);
        let shut = self.shut;
        *self = Self {
            events,
            shut,
            ents: Vec::new(),
            t1: Vec::new(),
            t2: Vec::new(),
            b1: Vec::new(),
            b2: Vec::new(),
            p: 0.0,
            next_fresh: 0,
            freed: Vec::new(),
            tracker: Vec::new(),
            skipped: 0,
            ..self.clone()
        };
    }

    fn lists(&self) -> [Vec<K>; 4] {
        [
            self.t1.clone(),
            self.t2.clone(),
            self.b1.clone(),
            self.b2.clone(),
        ]
    }

    /// Keys a selector may pick from.
    fn pool(&self, src: Src, universe: &[K]) -> Vec<K> {
        let pool: Vec<K> = match src {
            Src::Any => return universe.to_vec(),
            Src::Absent => universe
                .iter()
                .filter(|k| self.ent(k).is_none())
                .cloned()
                .collect(),
            Src::Present => self.ents.iter().map(|e| e.key.clone()).collect(),
            Src::Ready => self
                .ents
                .iter()
                .filter(|e| !e.pending)
                .map(|e| e.key.clone())
                .collect(),
            Src::Evictable => self
                .ents
                .iter()
                .filter(|e| !e.pending && e.loads == 0)
                .map(|e| e.key.clone())
                .collect(),
            Src::Pending => self
                .ents
                .iter()
                .filter(|e| e.pending)
                .map(|e| e.key.clone())
                .collect(),
            Src::Loading => self
                .ents
                .iter()
                .filter(|e| e.loads > 0)
                .map(|e| e.key.clone())
                .collect(),
            Src::Ghost => self.b1.iter().chain(&self.b2).cloned().collect(),
        };
        if pool.is_empty() {
            universe.to_vec()
        } else {
            pool
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Operations
// ---------------------------------------------------------------------------------------------

/// Where a selector draws its key from (resolved against the model; falls back to the universe
/// when that set is empty).
#[derive(Clone, Copy, Debug)]
enum Src {
    Any,
    Absent,
    Present,
    Ready,
    Evictable,
    Pending,
    Loading,
    Ghost,
}

/// A key selector: `pool(src)[idx % len]`.
#[derive(Clone, Copy, Debug)]
struct Sel(Src, u8);

#[derive(Clone, Debug)]
enum Op {
    Lookup(Sel),
    LookupPrefix(Vec<Sel>),
    PrepareLoad(Vec<Sel>),
    Touch(Vec<Sel>),
    CompleteLoad(Vec<Sel>),
    PrepareStore { keys: Vec<Sel>, check_stats: bool },
    CompleteStore { keys: Vec<Sel>, success: bool },
    TakeEvents,
    GetStats,
    Reset,
    Shutdown,
}

fn sel(weights: [u32; 8]) -> impl Strategy<Value = Sel> {
    let srcs = [
        Src::Any,
        Src::Absent,
        Src::Present,
        Src::Ready,
        Src::Evictable,
        Src::Pending,
        Src::Loading,
        Src::Ghost,
    ];
    let choices: Vec<(u32, Just<Src>)> = srcs
        .iter()
        .zip(weights)
        .filter(|(_, w)| *w > 0)
        .map(|(s, w)| (w, Just(*s)))
        .collect();
    (
        proptest::strategy::Union::new_weighted(choices),
        any::<u8>(),
    )
        .prop_map(|(s, i)| Sel(s, i))
}

fn sels(weights: [u32; 8], max: usize) -> impl Strategy<Value = Vec<Sel>> {
    proptest::collection::vec(sel(weights), 0..=max)
}

//                    Any Abs Pres Rdy Evi Pend Load Ghost
const W_LOOKUP: [u32; 8] = [3, 1, 2, 2, 0, 2, 1, 1];
const W_LOAD: [u32; 8] = [1, 0, 0, 12, 6, 1, 3, 0];
const W_TOUCH: [u32; 8] = [2, 1, 3, 3, 0, 1, 1, 3];
const W_CLOAD: [u32; 8] = [1, 0, 0, 1, 0, 0, 14, 0];
const W_STORE: [u32; 8] = [2, 10, 2, 1, 1, 1, 1, 6];
const W_CSTORE: [u32; 8] = [1, 0, 1, 1, 0, 12, 0, 0];

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => sel(W_LOOKUP).prop_map(Op::Lookup),
        4 => sels(W_LOOKUP, 5).prop_map(Op::LookupPrefix),
        8 => sels(W_LOAD, 3).prop_map(Op::PrepareLoad),
        8 => sels(W_TOUCH, 4).prop_map(Op::Touch),
        8 => sels(W_CLOAD, 3).prop_map(Op::CompleteLoad),
        20 => (sels(W_STORE, 4), proptest::bool::weighted(0.3))
            .prop_map(|(keys, check_stats)| Op::PrepareStore { keys, check_stats }),
        24 => (sels(W_CSTORE, 5), proptest::bool::weighted(0.85))
            .prop_map(|(keys, success)| Op::CompleteStore { keys, success }),
        4 => Just(Op::TakeEvents),
        3 => Just(Op::GetStats),
        1 => Just(Op::Reset),
        // Rare: everything after it must fail.
        1 => proptest::bool::weighted(0.25).prop_map(|s| if s { Op::Shutdown } else { Op::GetStats }),
    ]
}

fn config() -> impl Strategy<Value = ManagerConfig> {
    (
        prop_oneof![1 => Just(0usize), 2 => Just(1), 12 => 2usize..=6],
        prop_oneof![5 => Just(0usize), 1 => Just(1), 2 => Just(2), 1 => Just(3)],
        prop_oneof![Just(0usize), Just(1), Just(2), Just(3), Just(64_000)],
        proptest::bool::weighted(0.85),
        prop_oneof![Just(0usize), Just(16)],
    )
        .prop_map(|(cap, threshold, max_tracker, events, block_size)| {
            let mut c = ManagerConfig::new(cap);
            c.store_threshold = threshold;
            c.max_tracker_size = max_tracker;
            c.enable_events = events;
            c.block_size = block_size;
            c
        })
}

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

/// Policy-specific introspection: ARC's `p`.
trait PolicyExt: Policy {
    const IS_ARC: bool;
    fn p<K: Hash + Eq + Clone>(m: &Manager<K, Self>) -> f64;
}

impl PolicyExt for Lru {
    const IS_ARC: bool = false;
    fn p<K: Hash + Eq + Clone>(_: &Manager<K, Self>) -> f64 {
        0.0
    }
}

impl PolicyExt for Arc {
    const IS_ARC: bool = true;
    fn p<K: Hash + Eq + Clone>(m: &Manager<K, Self>) -> f64 {
        m.policy().p
    }
}

/// Everything observable without side effects.
#[derive(Debug, PartialEq)]
struct Snapshot<K> {
    lists: [Vec<K>; 4],
    presence: Vec<Presence>,
    ids: Vec<Option<u32>>,
    len: usize,
    p_bits: u64,
}

fn snapshot<K: Hash + Eq + Clone, P: PolicyExt>(m: &Manager<K, P>, universe: &[K]) -> Snapshot<K> {
    Snapshot {
        lists: m.debug_lists(),
        presence: universe.iter().map(|k| m.lookup(k).unwrap()).collect(),
        ids: universe.iter().map(|k| m.block_id(k)).collect(),
        len: m.len(),
        p_bits: P::p(m).to_bits(),
    }
}

fn model_snapshot<K: Clone + Eq + Debug>(md: &Model<K>, universe: &[K]) -> Snapshot<K> {
    let mut lists = md.lists();
    if !md.arc {
        // LRU reports `[order, [], [], []]`.
        lists[1].clear();
        lists[2].clear();
        lists[3].clear();
    }
    Snapshot {
        lists,
        presence: universe.iter().map(|k| md.lookup(k)).collect(),
        ids: universe.iter().map(|k| md.ent(k).map(|e| e.id)).collect(),
        len: md.ents.len(),
        p_bits: md.p.to_bits(),
    }
}

fn ev_pairs<K: Clone>(evs: &[OffloadingEvent<K>]) -> Vec<(Vec<K>, bool)> {
    evs.iter().map(|e| (e.keys.clone(), e.removed)).collect()
}

/// Invariants of the real manager that do not depend on the model.
fn check_invariants<K: Hash + Eq + Clone + Debug + Ord, P: PolicyExt>(
    m: &Manager<K, P>,
    universe: &[K],
) -> Result<(), TestCaseError> {
    let cap = m.num_blocks();
    prop_assert!(m.len() <= cap, "present {} > capacity {cap}", m.len());
    let mut ids = BTreeSet::new();
    let mut present = 0;
    for k in universe {
        let pres = m.lookup(k).unwrap();
        match m.block_id(k) {
            Some(id) => {
                prop_assert!(pres != Presence::Absent, "{k:?} has an id but is absent");
                prop_assert!((id as usize) < cap, "id {id} out of range for {k:?}");
                prop_assert!(ids.insert(id), "id {id} used twice");
                present += 1;
            }
            None => prop_assert_eq!(pres, Presence::Absent),
        }
    }
    prop_assert_eq!(present, m.len());
    let [t1, t2, b1, b2] = m.debug_lists();
    prop_assert_eq!(t1.len() + t2.len(), m.len(), "T1+T2 = present");
    if P::IS_ARC {
        prop_assert!(
            b1.len() <= cap && b2.len() <= cap,
            "ghost lists over capacity"
        );
        let p = P::p(m);
        #[allow(clippy::cast_precision_loss)]
        let capf = cap as f64;
        prop_assert!((0.0..=capf).contains(&p), "p = {p} outside [0, {cap}]");
        for g in b1.iter().chain(&b2) {
            prop_assert_eq!(
                m.lookup(g).unwrap(),
                Presence::Absent,
                "ghost {:?} present",
                g
            );
        }
    } else {
        prop_assert!(t2.is_empty() && b1.is_empty() && b2.is_empty());
    }
    let all: BTreeSet<_> = t1.iter().chain(&t2).chain(&b1).chain(&b2).collect();
    prop_assert_eq!(
        all.len(),
        t1.len() + t2.len() + b1.len() + b2.len(),
        "a key on two lists"
    );
    Ok(())
}

/// Every method fails after shutdown; shutdown itself stays idempotent.
fn check_shut_down<K: Hash + Eq + Clone, P: PolicyExt>(
    m: &mut Manager<K, P>,
    universe: &[K],
) -> Result<(), TestCaseError> {
    let ks = &universe[..1];
    prop_assert!(m.lookup(&ks[0]).is_err());
    prop_assert!(m.lookup_prefix(ks).is_err());
    prop_assert!(m.prepare_load(ks).is_err());
    prop_assert!(m.touch(ks).is_err());
    prop_assert!(m.complete_load(ks).is_err());
    prop_assert!(m.prepare_store(ks).is_err());
    prop_assert!(m.complete_store(ks, true).is_err());
    prop_assert!(m.take_events().is_err());
    prop_assert!(m.get_stats().is_err());
    prop_assert!(m.reset().is_err());
    m.shutdown();
    prop_assert!(m.lookup(&ks[0]).is_err());
    Ok(())
}

fn resolve<K: Clone + Eq + Debug>(md: &Model<K>, universe: &[K], s: &[Sel]) -> Vec<K> {
    s.iter()
        .map(|&Sel(src, i)| {
            let pool = md.pool(src, universe);
            pool[usize::from(i) % pool.len()].clone()
        })
        .collect()
}

#[allow(clippy::too_many_lines)]
fn run<K, P>(
    cfg: &ManagerConfig,
    ops: &[Op],
    mk: fn(u64) -> K,
    universe_size: u64,
) -> Result<(), TestCaseError>
where
    K: Hash + Eq + Clone + Debug + Ord,
    P: PolicyExt,
{
    let universe: Vec<K> = (0..universe_size).map(mk).collect();
    let mut m: Manager<K, P> = Manager::try_new(cfg.clone()).unwrap();
    let mut md: Model<K> = Model::new(P::IS_ARC, cfg);
    // Keys reproduced by replaying the events taken so far.
    let mut replay: BTreeSet<K> = BTreeSet::new();

    let apply_events = |replay: &mut BTreeSet<K>, evs: &[OffloadingEvent<K>]| {
        for e in evs {
            prop_assert_eq!(e.medium, "CPU");
            prop_assert_eq!(e.block_size, cfg.block_size);
            prop_assert!(!e.keys.is_empty(), "empty event");
            for k in &e.keys {
                if e.removed {
                    prop_assert!(replay.remove(k), "removed event for unknown {:?}", k);
                } else {
                    prop_assert!(replay.insert(k.clone()), "stored event twice for {:?}", k);
                }
            }
        }
        Ok(())
    };
    let check_replay = |m: &Manager<K, P>, replay: &BTreeSet<K>| {
        let ready: BTreeSet<K> = universe
            .iter()
            .filter(|k| m.lookup(k).unwrap() == Presence::Ready)
            .cloned()
            .collect();
        prop_assert_eq!(replay, &ready, "replayed events != ready-or-loading keys");
        Ok(())
    };

    for (step, op) in ops.iter().enumerate() {
        if md.shut {
            return check_shut_down(&mut m, &universe);
        }
        let before = snapshot(&m, &universe);
        let md_before = md.clone();
        let ctx = || format!("step {step}: {op:?}");
        match op {
            Op::Lookup(s) => {
                let k = &resolve(&md, &universe, std::slice::from_ref(s))[0];
                prop_assert_eq!(m.lookup(k).unwrap(), md.lookup(k), "{}", ctx());
            }
            Op::LookupPrefix(s) => {
                let ks = resolve(&md, &universe, s);
                prop_assert_eq!(
                    m.lookup_prefix(&ks).unwrap(),
                    md.lookup_prefix(&ks),
                    "{} keys {:?}",
                    ctx(),
                    ks
                );
            }
            Op::PrepareLoad(s) => {
                let ks = resolve(&md, &universe, s);
                let got = m.prepare_load(&ks);
                let want = md.prepare_load(&ks);
                match (&got, &want) {
                    (Ok(ids), Some(w)) => prop_assert_eq!(ids, w, "{} keys {:?}", ctx(), ks),
                    (Err(_), None) => {
                        prop_assert_eq!(snapshot(&m, &universe), before, "Err changed state");
                    }
                    _ => prop_assert!(
                        false,
                        "{} keys {:?}: got {:?}, want {:?}",
                        ctx(),
                        ks,
                        got,
                        want
                    ),
                }
            }
            Op::Touch(s) => {
                let ks = resolve(&md, &universe, s);
                m.touch(&ks).unwrap();
                md.touch(&ks);
            }
            Op::CompleteLoad(s) => {
                let ks = resolve(&md, &universe, s);
                let got = m.complete_load(&ks);
                let want = md.complete_load(&ks);
                prop_assert_eq!(got.is_ok(), want, "{} keys {:?}: {:?}", ctx(), ks, got);
                if !want {
                    prop_assert_eq!(snapshot(&m, &universe), before, "Err changed state");
                }
            }
            Op::PrepareStore { keys, check_stats } => {
                let ks = resolve(&md, &universe, keys);
                let stats_before = if *check_stats {
                    let s = m.get_stats().unwrap();
                    prop_assert_eq!(&s, &md.get_stats(), "{}", ctx());
                    Some(s)
                } else {
                    None
                };
                let got = m.prepare_store(&ks).unwrap();
                let want = md.prepare_store(&ks);
                prop_assert_eq!(
                    &got,
                    &want,
                    "{} keys {:?}\nmodel before: {:?}",
                    ctx(),
                    ks,
                    md_before
                );
                match &got {
                    None => {
                        prop_assert_eq!(snapshot(&m, &universe), before, "None changed state");
                        if let Some(s) = stats_before {
                            let after = m.get_stats().unwrap();
                            md.get_stats();
                            // (`stores_skipped` was reset by the first `get_stats`.)
                            let s = ManagerStats {
                                stores_skipped: 0,
                                ..s
                            };
                            prop_assert_eq!(after, s, "None changed stats");
                        }
                    }
                    Some(out) => {
                        // Model-independent checks of the output.
                        prop_assert_eq!(out.keys_to_store.len(), out.block_ids.len());
                        let mut it = ks.iter();
                        for k in &out.keys_to_store {
                            prop_assert!(it.any(|x| x == k), "keys_to_store not in input order");
                        }
                        for (k, id) in out.keys_to_store.iter().zip(&out.block_ids) {
                            let i = universe.iter().position(|u| u == k).unwrap();
                            prop_assert_eq!(before.presence[i], Presence::Absent);
                            prop_assert_eq!(m.lookup(k).unwrap(), Presence::Pending);
                            prop_assert_eq!(m.block_id(k), Some(*id));
                        }
                        for v in &out.evicted_keys {
                            let i = universe.iter().position(|u| u == v).unwrap();
                            prop_assert!(!ks.contains(v), "offered key {:?} evicted", v);
                            prop_assert_eq!(
                                before.presence[i],
                                Presence::Ready,
                                "evicted {:?} was not ready",
                                v
                            );
                            prop_assert_eq!(
                                md_before.ent(v).unwrap().loads,
                                0,
                                "loading {:?} evicted",
                                v
                            );
                            prop_assert_eq!(m.lookup(v).unwrap(), Presence::Absent);
                        }
                    }
                }
            }
            Op::CompleteStore { keys, success } => {
                let ks = resolve(&md, &universe, keys);
                m.complete_store(&ks, *success).unwrap();
                md.complete_store(&ks, *success);
            }
            Op::TakeEvents => {
                let evs = m.take_events().unwrap();
                prop_assert_eq!(ev_pairs(&evs), md.take_events(), "{}", ctx());
                apply_events(&mut replay, &evs)?;
                if cfg.enable_events {
                    check_replay(&m, &replay)?;
                }
            }
            Op::GetStats => {
                prop_assert_eq!(m.get_stats().unwrap(), md.get_stats(), "{}", ctx());
            }
            Op::Reset => {
                m.reset().unwrap();
                md.reset();
                // Pending events survive a reset; after draining them nothing is present.
                let evs = m.take_events().unwrap();
                prop_assert_eq!(ev_pairs(&evs), md.take_events(), "{}", ctx());
                replay.clear();
                prop_assert_eq!(m.len(), 0);
            }
            Op::Shutdown => {
                m.shutdown();
                md.shut = true;
                continue;
            }
        }
        check_invariants(&m, &universe)?;
        prop_assert_eq!(
            snapshot(&m, &universe),
            model_snapshot(&md, &universe),
            "state differs after {}",
            ctx()
        );
    }
    if md.shut {
        return check_shut_down(&mut m, &universe);
    }
    // Drain: the events replay to exactly the ready-or-loading keys; stats agree.
    let evs = m.take_events().unwrap();
    prop_assert_eq!(ev_pairs(&evs), md.take_events());
    apply_events(&mut replay, &evs)?;
    if cfg.enable_events {
        check_replay(&m, &replay)?;
    }
    prop_assert_eq!(m.get_stats().unwrap(), md.get_stats());
    Ok(())
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(op(), 1..=60)
}

fn prop_config(cases: u32) -> PropConfig {
    PropConfig {
        cases,
        failure_persistence: None,
        ..PropConfig::default()
    }
}

fn key_u64(i: u64) -> u64 {
    i
}

/// Real offload keys (`make_offload_key`), as the Python layer passes them.
fn key_bytes(i: u64) -> Vec<u8> {
    kvoff::key::make_offload_key(&i.to_le_bytes(), u32::from(i % 2 == 0))
}

proptest! {
    #![proptest_config(prop_config(512))]

    #[test]
    fn lru_matches_model(cfg in config(), ops in ops()) {
        run::<u64, Lru>(&cfg, &ops, key_u64, UNIVERSE)?;
    }

    #[test]
    fn arc_matches_model(cfg in config(), ops in ops()) {
        run::<u64, Arc>(&cfg, &ops, key_u64, UNIVERSE)?;
    }
}

proptest! {
    #![proptest_config(prop_config(64))]

    #[test]
    fn lru_matches_model_bytes_keys(cfg in config(), ops in ops()) {
        run::<Vec<u8>, Lru>(&cfg, &ops, key_bytes, UNIVERSE)?;
    }

    #[test]
    fn arc_matches_model_bytes_keys(cfg in config(), ops in ops()) {
        run::<Vec<u8>, Arc>(&cfg, &ops, key_bytes, UNIVERSE)?;
    }
}

/// Larger capacities (8..=24) over 40 keys and longer sequences with bigger batches: long
/// recency lists, ghost lists of different sizes (fractional ARC adaptation steps), many evictions
/// per call.
fn big_config() -> impl Strategy<Value = ManagerConfig> {
    (8usize..=24, prop_oneof![3 => Just(0usize), 1 => Just(2)]).prop_map(|(cap, threshold)| {
        let mut c = ManagerConfig::new(cap);
        c.store_threshold = threshold;
        c.max_tracker_size = 16;
        c.enable_events = true;
        c
    })
}

fn big_ops() -> impl Strategy<Value = Vec<Op>> {
    let big_op = prop_oneof![
        3 => op(),
        1 => (sels(W_STORE, 12), proptest::bool::weighted(0.1))
            .prop_map(|(keys, check_stats)| Op::PrepareStore { keys, check_stats }),
        1 => sels(W_CSTORE, 12).prop_map(|keys| Op::CompleteStore { keys, success: true }),
        1 => sels(W_TOUCH, 10).prop_map(Op::Touch),
    ];
    proptest::collection::vec(big_op, 1..=150)
}

proptest! {
    #![proptest_config(prop_config(64))]

    #[test]
    fn lru_matches_model_big(cfg in big_config(), ops in big_ops()) {
        run::<u64, Lru>(&cfg, &ops, key_u64, BIG_UNIVERSE)?;
    }

    #[test]
    fn arc_matches_model_big(cfg in big_config(), ops in big_ops()) {
        run::<u64, Arc>(&cfg, &ops, key_u64, BIG_UNIVERSE)?;
    }
}

/// The type aliases used by the bindings are the generic manager.
#[test]
fn aliases_are_the_generic_manager() {
    let _: LruManager<u64> = Manager::<u64, Lru>::new(ManagerConfig::new(1));
    let _: ArcManager<u64> = Manager::<u64, Arc>::new(ManagerConfig::new(1));
}
