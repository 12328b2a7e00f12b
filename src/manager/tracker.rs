//! Admission tracker for `store_threshold` (SPEC §2.3 step 3): an LRU-ordered map from key to the
//! number of times it was offered, bounded by `max_tracker_size`. Keys offered by the call being
//! processed (mark = that call's epoch) are never dropped by it.
#![forbid(unsafe_code)]

use std::hash::Hash;

use super::slab::{ListTag, Slab};

pub(crate) struct Tracker<K> {
    slab: Slab<K>,
}

impl<K: Hash + Eq + Clone> Tracker<K> {
    pub(crate) fn new() -> Self {
        Self { slab: Slab::new() }
    }

    /// Offers recorded so far for `key`.
    pub(crate) fn count(&self, key: &K) -> usize {
        self.slab
            .find(key)
            .map_or(0, |i| self.slab.node(i).loads as usize)
    }

    /// Counts one more offer of `key` (once per call: a key already marked with `epoch` is skipped,
    /// so duplicates within a call count once) and makes it most recently offered.
    pub(crate) fn offer(&mut self, key: &K, _hint: u64, epoch: u32) {
        let i = match self.slab.find(key) {
            Some(i) => i,
            None => {
                let h = self.slab.hash_of(key);
                let i = self.slab.insert(key.clone(), h, 0);
                self.slab.push_mru(i, ListTag::T1);
                i
            }
        };
        let n = self.slab.node_mut(i);
        if n.mark != epoch {
            n.mark = epoch;
            n.loads = n.loads.saturating_add(1);
            self.slab.move_to_mru(i, ListTag::T1);
        }
    }

    /// Drops least recently offered keys beyond `max`, never those marked with `epoch`.
    pub(crate) fn trim(&mut self, max: usize, epoch: u32) {
        while self.slab.lists[ListTag::T1 as usize].len > max {
            let h = self.slab.head_of(ListTag::T1);
            if self.slab.node(h).mark == epoch {
                break; // everything left was offered by this call
            }
            self.slab.remove(h);
        }
    }

    pub(crate) fn clear_marks(&mut self) {
        self.slab.for_each_node_mut(|n| n.mark = 0);
    }

    pub(crate) fn clear(&mut self) {
        self.slab.clear();
    }
}
