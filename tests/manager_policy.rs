//! A policy defined outside the crate runs through the generic manager (docs/design.md, "Recipe:
//! adding an eviction policy"): `Fifo` below implements `kvoff::manager::Policy` over the public
//! `policy_api`, and the same protocol-conformance checks run over it, LRU and ARC — every
//! invariant of docs/spec.md §2 that holds whatever the eviction order: present ≤ capacity, block
//! ids unique and in range, pending and loading keys never evicted, a `None` from `prepare_store`
//! changes nothing, and replaying the events gives the set of ready keys.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]

use std::collections::{HashMap, HashSet};
use std::hash::Hash;

use kvoff::manager::policy_api::{Arena, ListTag};
use kvoff::manager::{
    Arc, Lru, Manager, ManagerConfig, OffloadingManager, Policy, Presence, TouchRule,
};

/// First in, first out: recency is the order of insertion; `touch` changes nothing.
#[derive(Clone, Copy, Debug, Default)]
struct Fifo;

impl Policy for Fifo {
    const NAME: &'static str = "fifo";
    const TOUCH: TouchRule = TouchRule::AllKeys;
    const GHOSTS: bool = false;

    fn on_insert<K: Hash + Eq>(
        &mut self,
        arena: &mut Arena<K>,
        i: u32,
        _ghost: Option<ListTag>,
        _cap: usize,
    ) {
        arena.push_mru(i, ListTag::T1);
    }

    fn on_touch<K: Hash + Eq>(&mut self, _arena: &mut Arena<K>, _i: u32, _cap: usize) {}

    fn select_victims<K: Hash + Eq>(&self, arena: &Arena<K>, need: usize, out: &mut Vec<u32>) {
        for i in arena.iter(ListTag::T1) {
            let n = arena.node(i);
            if n.is_evictable() && !n.prot {
                out.push(i);
                if out.len() == need {
                    break;
                }
            }
        }
    }

    fn on_evicted<K: Hash + Eq + Clone>(
        &mut self,
        arena: &mut Arena<K>,
        victims: &[u32],
        _cap: usize,
        _evicted: &mut Vec<K>,
    ) {
        for &v in victims {
            arena.detach(v);
        }
        arena.trim_front(ListTag::T1);
    }

    fn reset(&mut self) {}
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }

    fn keys(&mut self, universe: u64, max: u64) -> Vec<u64> {
        (0..1 + self.below(max))
            .map(|_| self.below(universe))
            .collect()
    }
}

/// Random protocol traffic over `Manager<u64, P>` with every invariant checked after each call.
fn conformance<P: Policy>(seed: u64) {
    let cap = 8;
    let mut cfg = ManagerConfig::new(cap);
    cfg.enable_events = true;
    let mut m: Manager<u64, P> = Manager::try_new(cfg).unwrap();
    let mut rng = Rng(seed | 1);
    let mut pending: HashSet<u64> = HashSet::new();
    let mut loading: HashMap<u64, usize> = HashMap::new();
    let mut replay: HashSet<u64> = HashSet::new();
    for step in 0..3000 {
        match rng.below(5) {
            0 | 1 => {
                let keys = rng.keys(40, 6);
                let before: Vec<Presence> = (0..40).map(|k| m.lookup(&k).unwrap()).collect();
                match m.prepare_store(&keys).unwrap() {
                    Some(out) => {
                        for k in &out.evicted_keys {
                            assert!(!pending.contains(k), "step {step}: evicted pending {k}");
                            assert!(!loading.contains_key(k), "step {step}: evicted loading {k}");
                        }
                        let ids: HashSet<u32> = out.block_ids.iter().copied().collect();
                        assert_eq!(ids.len(), out.block_ids.len(), "step {step}: ids unique");
                        assert!(out.block_ids.iter().all(|&b| (b as usize) < cap));
                        pending.extend(out.keys_to_store.iter().copied());
                    }
                    None => {
                        let after: Vec<Presence> = (0..40).map(|k| m.lookup(&k).unwrap()).collect();
                        assert_eq!(before, after, "step {step}: None changed the manager");
                    }
                }
            }
            2 => {
                let keys: Vec<u64> = pending.iter().copied().collect();
                if !keys.is_empty() {
                    let ok = rng.below(4) != 0;
                    m.complete_store(&keys, ok).unwrap();
                    pending.clear();
                }
            }
            3 => {
                let ready: Vec<u64> = (0..40)
                    .filter(|k| m.lookup(k).unwrap() == Presence::Ready)
                    .take(3)
                    .collect();
                if !ready.is_empty() {
                    m.prepare_load(&ready).unwrap();
                    for k in ready {
                        *loading.entry(k).or_default() += 1;
                    }
                }
            }
            _ => {
                let keys: Vec<u64> = loading.keys().copied().collect();
                if !keys.is_empty() {
                    m.complete_load(&keys).unwrap();
                    loading.clear();
                }
                m.touch(&rng.keys(40, 4)).unwrap();
            }
        }
        assert!(m.len() <= cap, "step {step}: present > capacity");
        let mut ids = HashSet::new();
        for k in 0..40u64 {
            if let Some(b) = m.block_id(&k) {
                assert!(
                    (b as usize) < cap && ids.insert(b),
                    "step {step}: block id {b}"
                );
            }
        }
        for k in &pending {
            assert_eq!(m.lookup(k).unwrap(), Presence::Pending, "step {step}");
        }
        for k in loading.keys() {
            assert_eq!(m.lookup(k).unwrap(), Presence::Ready, "step {step}");
        }
        for ev in m.take_events().unwrap() {
            for k in ev.keys {
                if ev.removed {
                    replay.remove(&k);
                } else {
                    replay.insert(k);
                }
            }
        }
        let ready: HashSet<u64> = (0..40)
            .filter(|k| m.lookup(k).unwrap() == Presence::Ready)
            .collect();
        assert_eq!(replay, ready, "step {step}: events replay to the ready set");
    }
}

#[test]
fn a_policy_defined_here_runs_through_the_generic_manager() {
    for seed in 1..6 {
        conformance::<Fifo>(seed);
    }
}

#[test]
fn the_built_in_policies_pass_the_same_checks() {
    for seed in 1..6 {
        conformance::<Lru>(seed);
        conformance::<Arc>(seed);
    }
}

#[test]
fn fifo_evicts_in_insertion_order_whatever_the_touches() {
    let mut m: Manager<u64, Fifo> = Manager::try_new(ManagerConfig::new(2)).unwrap();
    m.prepare_store(&[1, 2]).unwrap().unwrap();
    m.complete_store(&[1, 2], true).unwrap();
    m.touch(&[1]).unwrap();
    let out = m.prepare_store(&[3]).unwrap().unwrap();
    assert_eq!(out.evicted_keys, vec![1]);
    assert_eq!(Fifo::NAME, "fifo");
}
