//! LRU policy (SPEC §2.4): one recency list; insertion and `touch` make a key most recently used;
//! loads and store completion leave recency alone. Eviction takes the least recently used
//! evictable, unprotected keys.
#![forbid(unsafe_code)]

use std::hash::Hash;

use super::slab::{ListTag, Slab, NIL};
use super::Policy;

/// Least-recently-used eviction.
#[derive(Clone, Copy, Debug, Default)]
pub struct Lru;

impl Policy for Lru {
    const NAME: &'static str = "lru";

    fn on_insert<K: Hash + Eq>(
        &mut self,
        slab: &mut Slab<K>,
        i: u32,
        _ghost: Option<ListTag>,
        _cap: usize,
    ) {
        slab.push_mru(i, ListTag::T1);
    }

    fn on_touch<K: Hash + Eq>(&mut self, slab: &mut Slab<K>, i: u32, _cap: usize) {
        slab.move_to_mru(i, ListTag::T1);
    }

    fn select_victims<K: Hash + Eq>(
        &self,
        slab: &Slab<K>,
        need: usize,
        epoch: u32,
        out: &mut Vec<u32>,
    ) {
        let mut i = slab.head_of(ListTag::T1);
        while i != NIL && out.len() < need {
            let n = slab.node(i);
            if n.is_evictable() && n.mark != epoch {
                out.push(i);
            }
            i = n.next;
        }
    }

    fn on_evicted<K: Hash + Eq + Clone>(
        &mut self,
        slab: &mut Slab<K>,
        victims: &[u32],
        _cap: usize,
        evicted: &mut Vec<K>,
    ) {
        for &v in victims {
            evicted.push(slab.remove(v).key);
        }
    }

    fn reset(&mut self) {}
}
