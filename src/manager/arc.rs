//! ARC policy (SPEC §2.5): Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache"
//! (FAST 2003), as adapted in vLLM's `ARCOffloadingManager`.
//!
//! Resident lists T1 (seen once) and T2 (seen again), ghost lists B1 and B2 (keys only, each at most
//! `num_blocks` long), and the target size `p` of T1 in `[0, num_blocks]`. A ghost hit (on insert or
//! touch) adapts `p` towards the list that would have kept the key. Victims are chosen before any
//! list is changed, so an eviction that cannot complete changes nothing.
#![forbid(unsafe_code)]

use std::hash::Hash;

use super::slab::{ListTag, Slab, NIL};
use super::Policy;

/// Adaptive replacement.
#[derive(Clone, Copy, Debug, Default)]
pub struct Arc {
    /// Target size of T1.
    pub p: f64,
}

impl Arc {
    #[allow(clippy::cast_precision_loss)] // list lengths < 2^32 are exact in f64
    fn adapt<K: Hash + Eq>(&mut self, slab: &Slab<K>, ghost: ListTag, cap: usize) {
        let b1 = slab.lists[ListTag::B1 as usize].len as f64;
        let b2 = slab.lists[ListTag::B2 as usize].len as f64;
        match ghost {
            ListTag::B1 => self.p = (self.p + (b2 / b1).max(1.0)).min(cap as f64),
            ListTag::B2 => self.p = (self.p - (b1 / b2).max(1.0)).max(0.0),
            ListTag::T1 | ListTag::T2 => {}
        }
    }

    fn trim<K: Hash + Eq>(slab: &mut Slab<K>, tag: ListTag, cap: usize) {
        while slab.lists[tag as usize].len > cap {
            let h = slab.head_of(tag);
            slab.remove(h);
        }
    }
}

/// Next evictable, unprotected node of a list starting at `i`.
fn next_eligible<K: Hash + Eq>(slab: &Slab<K>, mut i: u32, epoch: u32) -> u32 {
    while i != NIL {
        let n = slab.node(i);
        if n.is_evictable() && n.mark != epoch {
            return i;
        }
        i = n.next;
    }
    NIL
}

impl Policy for Arc {
    const NAME: &'static str = "arc";

    fn on_insert<K: Hash + Eq>(
        &mut self,
        slab: &mut Slab<K>,
        i: u32,
        ghost: Option<ListTag>,
        cap: usize,
    ) {
        if let Some(g) = ghost {
            // Ghost sizes are taken before the deletion; the node was unlinked by the caller, so
            // count it back in.
            let mut b = [
                slab.lists[ListTag::B1 as usize].len,
                slab.lists[ListTag::B2 as usize].len,
            ];
            match g {
                ListTag::B1 => b[0] += 1,
                ListTag::B2 => b[1] += 1,
                _ => {}
            }
            #[allow(clippy::cast_precision_loss)]
            let (b1, b2) = (b[0] as f64, b[1] as f64);
            #[allow(clippy::cast_precision_loss)]
            match g {
                ListTag::B1 => self.p = (self.p + (b2 / b1).max(1.0)).min(cap as f64),
                ListTag::B2 => self.p = (self.p - (b1 / b2).max(1.0)).max(0.0),
                _ => {}
            }
        }
        slab.push_mru(i, ListTag::T1);
    }

    fn on_touch<K: Hash + Eq>(&mut self, slab: &mut Slab<K>, i: u32, cap: usize) {
        let n = slab.node(i);
        match n.list {
            ListTag::T1 if n.pending => slab.move_to_mru(i, ListTag::T1),
            ListTag::T1 | ListTag::T2 => slab.move_to_mru(i, ListTag::T2),
            g @ (ListTag::B1 | ListTag::B2) => {
                self.adapt(slab, g, cap);
                slab.move_to_mru(i, g);
            }
        }
    }

    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // p is in [0, num_blocks]
    fn select_victims<K: Hash + Eq>(
        &self,
        slab: &Slab<K>,
        need: usize,
        epoch: u32,
        out: &mut Vec<u32>,
    ) {
        let target = self.p.floor() as usize;
        let t1_len = slab.lists[ListTag::T1 as usize].len;
        let mut c1 = next_eligible(slab, slab.head_of(ListTag::T1), epoch);
        let mut c2 = next_eligible(slab, slab.head_of(ListTag::T2), epoch);
        let mut t1_chosen = 0usize;
        while out.len() < need {
            let prefer_t1 = t1_len - t1_chosen >= target;
            let take_t1 = if prefer_t1 { c1 != NIL } else { c2 == NIL };
            if take_t1 {
                if c1 == NIL {
                    return; // cannot happen: the caller checked there are enough
                }
                out.push(c1);
                t1_chosen += 1;
                c1 = next_eligible(slab, slab.node(c1).next, epoch);
            } else {
                if c2 == NIL {
                    return;
                }
                out.push(c2);
                c2 = next_eligible(slab, slab.node(c2).next, epoch);
            }
        }
    }

    fn on_evicted<K: Hash + Eq + Clone>(
        &mut self,
        slab: &mut Slab<K>,
        victims: &[u32],
        cap: usize,
        evicted: &mut Vec<K>,
    ) {
        for &v in victims {
            evicted.push(slab.node(v).key.clone());
            let ghost = if slab.node(v).list == ListTag::T1 {
                ListTag::B1
            } else {
                ListTag::B2
            };
            slab.move_to_mru(v, ghost);
        }
        Self::trim(slab, ListTag::B1, cap);
        Self::trim(slab, ListTag::B2, cap);
    }

    fn reset(&mut self) {
        self.p = 0.0;
    }
}
