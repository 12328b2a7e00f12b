//! Admission tracker for `store_threshold` (docs/spec.md §2.3 step 3): an LRU-ordered map from key to the
//! number of times it was offered, bounded by `max_tracker_size`. Keys offered by the call being
//! processed (mark = that call's epoch) are never dropped by it.
//!
//! Built from the managers' pieces: an [`Index`] from the key's hash tag to a slot, and one
//! [`Lists`] queue for the offer order. Hashes come from the manager (same hasher).
#![forbid(unsafe_code)]

use super::index::{tag_of, Index};
use super::lists::Lists;

const ORDER: usize = 0;

struct Slot<K> {
    key: K,
    tag: u32,
    offers: u32,
    mark: u32,
}

pub(crate) struct Tracker<K> {
    slots: Vec<Slot<K>>,
    free: Vec<u32>,
    index: Index,
    order: Lists,
}

impl<K: Eq + Clone> Tracker<K> {
    pub(crate) fn new() -> Self {
        Self {
            slots: Vec::new(),
            free: Vec::new(),
            index: Index::new(),
            order: Lists::new(),
        }
    }

    fn find(&self, key: &K, hash: u64) -> Option<u32> {
        let slots = &self.slots;
        self.index
            .find(tag_of(hash), |i| slots[i as usize].key == *key)
    }

    /// Offers recorded so far for `key` (whose manager hash is `hash`).
    pub(crate) fn count(&self, key: &K, hash: u64) -> usize {
        self.find(key, hash)
            .map_or(0, |i| self.slots[i as usize].offers as usize)
    }

    /// Counts one more offer of `key` (once per call: a key already marked with `epoch` is skipped,
    /// so duplicates within a call count once) and makes it most recently offered.
    pub(crate) fn offer(&mut self, key: &K, hash: u64, epoch: u32) {
        let i = if let Some(i) = self.find(key, hash) {
            i
        } else {
            let tag = tag_of(hash);
            let slot = Slot {
                key: key.clone(),
                tag,
                offers: 0,
                mark: 0,
            };
            let i = if let Some(i) = self.free.pop() {
                self.slots[i as usize] = slot;
                i
            } else {
                let i = u32::try_from(self.slots.len()).unwrap_or(u32::MAX);
                self.slots.push(slot);
                i
            };
            self.index.insert(tag, i);
            self.order.push_back(ORDER, i);
            i
        };
        let s = &mut self.slots[i as usize];
        if s.mark != epoch {
            s.mark = epoch;
            s.offers = s.offers.saturating_add(1);
            self.order.move_to_back(ORDER, ORDER, i);
        }
    }

    /// Drops least recently offered keys beyond `max`, never those marked with `epoch`.
    pub(crate) fn trim(&mut self, max: usize, epoch: u32) {
        while self.order.len(ORDER) > max {
            let Some(h) = self.order.iter(ORDER).next() else {
                break;
            };
            if self.slots[h as usize].mark == epoch {
                break; // everything left was offered by this call
            }
            self.order.pop_front(ORDER);
            self.index.remove(self.slots[h as usize].tag, h);
            self.free.push(h);
        }
    }

    pub(crate) fn clear_marks(&mut self) {
        for s in &mut self.slots {
            s.mark = 0;
        }
    }

    pub(crate) fn clear(&mut self) {
        self.slots.clear();
        self.free.clear();
        self.index.clear();
        self.order.clear();
    }
}
