//! LRU policy (docs/spec.md §2.4): one recency list; insertion and `touch` make a key most recently used;
//! loads and store completion leave recency alone. Eviction takes the least recently used
//! evictable, unprotected keys.
#![forbid(unsafe_code)]

use std::hash::Hash;

use super::arena::{Arena, ListTag};
use super::{Policy, TouchRule};

/// Least-recently-used eviction.
#[derive(Clone, Copy, Debug, Default)]
pub struct Lru;

impl Policy for Lru {
    const NAME: &'static str = "lru";
    const TOUCH: TouchRule = TouchRule::AllKeys;
    const GHOSTS: bool = false;

    #[inline]
    fn on_insert<K: Hash + Eq>(
        &mut self,
        arena: &mut Arena<K>,
        i: u32,
        _ghost: Option<ListTag>,
        _cap: usize,
    ) {
        arena.push_mru(i, ListTag::T1);
    }

    #[inline]
    fn on_touch<K: Hash + Eq>(&mut self, arena: &mut Arena<K>, i: u32, _cap: usize) {
        arena.move_to_mru(i, ListTag::T1);
    }

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

    /// Detaches the victims (off the list and the index); the manager reuses their nodes for the
    /// keys it stores and moves the evicted keys out then.
    fn on_evicted<K: Hash + Eq + Clone>(
        &mut self,
        arena: &mut Arena<K>,
        victims: &[u32],
        _cap: usize,
        _evicted: &mut Vec<K>,
    ) {
        arena.warm_index_of(victims);
        arena.warm_stamps(victims);
        for &v in victims {
            arena.detach(v);
        }
        arena.trim_front(ListTag::T1);
    }

    fn reset(&mut self) {}
}
