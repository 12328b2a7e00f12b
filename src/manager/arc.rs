//! ARC policy (docs/spec.md §2.5): Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache"
//! (FAST 2003), as adapted in vLLM's `ARCOffloadingManager`.
//!
//! Resident lists T1 (seen once) and T2 (seen again), ghost lists B1 and B2 (keys only, each at most
//! `num_blocks` long), and the target size `p` of T1 in `[0, num_blocks]`. A ghost hit (on insert or
//! touch) adapts `p` towards the list that would have kept the key. Victims are chosen before any
//! list is changed, so an eviction that cannot complete changes nothing.
#![forbid(unsafe_code)]

use std::hash::Hash;

use super::arena::{Arena, ListTag};
use super::{Policy, TouchRule};

/// Adaptive replacement.
#[derive(Clone, Copy, Debug, Default)]
pub struct Arc {
    /// Target size of T1.
    pub p: f64,
}

impl Arc {
    /// Adapts `p` for a hit in ghost list `ghost` (sizes taken with the key still on it).
    #[allow(clippy::cast_precision_loss)] // list lengths < 2^32 are exact in f64
    fn adapt<K: Hash + Eq>(&mut self, arena: &Arena<K>, ghost: ListTag, cap: usize) {
        let b1 = arena.len(ListTag::B1) as f64;
        let b2 = arena.len(ListTag::B2) as f64;
        match ghost {
            ListTag::B1 => self.p = (self.p + (b2 / b1).max(1.0)).min(cap as f64),
            ListTag::B2 => self.p = (self.p - (b1 / b2).max(1.0)).max(0.0),
            ListTag::T1 | ListTag::T2 | ListTag::Free => {}
        }
    }

    fn trim<K: Hash + Eq>(arena: &mut Arena<K>, tag: ListTag, cap: usize) {
        while arena.len(tag) > cap {
            match arena.pop_lru(tag) {
                Some(i) => arena.unindex_and_free(i),
                None => break,
            }
        }
    }
}

impl Policy for Arc {
    const NAME: &'static str = "arc";
    const TOUCH: TouchRule = TouchRule::ReusedOnly;
    const GHOSTS: bool = true;

    fn on_insert<K: Hash + Eq>(
        &mut self,
        arena: &mut Arena<K>,
        i: u32,
        ghost: Option<ListTag>,
        cap: usize,
    ) {
        match ghost {
            Some(g) => {
                // Ghost sizes are taken before the deletion: the node is still on its ghost list.
                self.adapt(arena, g, cap);
                arena.move_to_mru(i, ListTag::T1);
            }
            None => arena.push_mru(i, ListTag::T1),
        }
    }

    #[inline]
    fn on_touch<K: Hash + Eq>(&mut self, arena: &mut Arena<K>, i: u32, cap: usize) {
        let n = arena.node(i);
        match n.list {
            ListTag::T1 if n.pending => arena.move_to_mru(i, ListTag::T1),
            ListTag::T1 | ListTag::T2 => arena.move_to_mru(i, ListTag::T2),
            g @ (ListTag::B1 | ListTag::B2) => {
                self.adapt(arena, g, cap);
                arena.move_to_mru(i, g);
            }
            ListTag::Free => {}
        }
    }

    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // p is in [0, num_blocks]
    fn select_victims<K: Hash + Eq>(&self, arena: &Arena<K>, need: usize, out: &mut Vec<u32>) {
        let target = self.p.floor() as usize;
        let t1_len = arena.len(ListTag::T1);
        let eligible = |i: &u32| {
            let n = arena.node(*i);
            n.is_evictable() && !n.prot
        };
        let mut it1 = arena.iter(ListTag::T1).filter(eligible);
        let mut it2 = arena.iter(ListTag::T2).filter(eligible);
        let mut c1 = it1.next();
        let mut c2 = it2.next();
        let mut t1_chosen = 0usize;
        while out.len() < need {
            let prefer_t1 = t1_len - t1_chosen >= target;
            let take_t1 = if prefer_t1 {
                c1.is_some()
            } else {
                c2.is_none()
            };
            if take_t1 {
                let Some(v) = c1 else {
                    return; // cannot happen: the caller checked there are enough
                };
                out.push(v);
                t1_chosen += 1;
                c1 = it1.next();
            } else {
                let Some(v) = c2 else {
                    return;
                };
                out.push(v);
                c2 = it2.next();
            }
        }
    }

    /// Victims become ghosts (T1 → MRU of B1, T2 → MRU of B2; their keys are cloned into
    /// `evicted`), then each ghost list is trimmed to `cap` from its LRU end.
    fn on_evicted<K: Hash + Eq + Clone>(
        &mut self,
        arena: &mut Arena<K>,
        victims: &[u32],
        cap: usize,
        evicted: &mut Vec<K>,
    ) {
        for &v in victims {
            let n = arena.node(v);
            evicted.push(n.key.clone());
            let ghost = if n.list == ListTag::T1 {
                ListTag::B1
            } else {
                ListTag::B2
            };
            arena.move_to_mru(v, ghost);
        }
        Self::trim(arena, ListTag::B1, cap);
        Self::trim(arena, ListTag::B2, cap);
        arena.trim_front(ListTag::T1);
        arena.trim_front(ListTag::T2);
    }

    fn reset(&mut self) {
        self.p = 0.0;
    }

    fn target(&self) -> Option<f64> {
        Some(self.p)
    }
}
