//! Recency lists as FIFO queues with lazy deletion (replaces intrusive doubly-linked lists).
//!
//! Each of the four lists (LRU uses one; ARC's T1, T2, B1, B2) is a queue of `(node, stamp)`
//! entries, front = least recently used. Every push takes a fresh stamp from one counter shared by
//! all lists, and `stamps[node]` holds the stamp of the node's one live entry (0 = the node is on no
//! list). An entry is live iff its stamp equals its node's current stamp; any other entry is stale
//! and is skipped. "Move to MRU" is a push of a new entry (the old one turns stale); removal only
//! clears the node's stamp. The live entries of a queue, front to back, are exactly the list a
//! doubly-linked list would hold, in the same order.
//!
//! Costs: push, remove and move are O(1) and touch no neighbour; stale entries are dropped from the
//! front when met and by compaction once a queue holds more than twice as many stale as live entries
//! (plus slack),
//! so memory stays O(live) and the work is amortised O(1) per operation. When the stamp counter
//! would wrap, all queues are compacted and renumbered (amortised O(1) too), so a stale entry can
//! never be mistaken for a live one.
#![forbid(unsafe_code)]

use std::collections::VecDeque;

/// No list.
const NO_STAMP: u32 = 0;
/// A queue is compacted when its stale entries exceed `STALE_FACTOR` × its live entries + `SLACK`
/// (each compaction reads the stamps of all entries; a larger factor compacts less often).
const STALE_FACTOR: usize = 2;
/// See [`STALE_FACTOR`].
const SLACK: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    node: u32,
    stamp: u32,
}

/// The queues of one manager, indexed by list number (`0..4`).
#[derive(Clone, Debug)]
pub struct Lists {
    queues: [VecDeque<Entry>; 4],
    live: [usize; 4],
    /// Current stamp of each node (indexed by node), [`NO_STAMP`] when on no list.
    stamps: Vec<u32>,
    /// Last stamp handed out.
    last: u32,
    /// Counter limit (`u32::MAX` except in tests of the renumbering).
    limit: u32,
}

impl Default for Lists {
    fn default() -> Self {
        Self::new()
    }
}

impl Lists {
    pub fn new() -> Self {
        Self {
            queues: Default::default(),
            live: [0; 4],
            stamps: Vec::new(),
            last: NO_STAMP,
            limit: u32::MAX,
        }
    }

    /// Makes room for node indices below `n`.
    #[inline]
    pub fn ensure_nodes(&mut self, n: usize) {
        if self.stamps.len() < n {
            self.stamps.resize(n, NO_STAMP);
        }
    }

    /// Reserves stamps for node indices below `n` without filling them (exactly: the arena
    /// decides how its node storage grows).
    pub fn reserve_nodes(&mut self, n: usize) {
        if self.stamps.capacity() < n {
            self.stamps.reserve_exact(n - self.stamps.len());
        }
    }

    /// Capacity of the stamps (tests).
    #[cfg(test)]
    pub fn stamps_capacity(&self) -> usize {
        self.stamps.capacity()
    }

    /// Live length of `list`.
    #[inline]
    pub fn len(&self, list: usize) -> usize {
        self.live[list]
    }

    /// The stamp word of `node` (to warm its cache line before a batch of moves).
    #[inline]
    pub fn stamp_word(&self, node: u32) -> u32 {
        self.stamps.get(node as usize).copied().unwrap_or(NO_STAMP)
    }

    /// `true` if `node` is on some list.
    #[cfg(test)]
    pub fn is_listed(&self, node: u32) -> bool {
        self.stamp_word(node) != NO_STAMP
    }

    #[inline]
    fn next_stamp(&mut self) -> u32 {
        if self.last >= self.limit - 1 {
            self.renumber();
        }
        self.last += 1;
        self.last
    }

    /// Appends `node` (on no list) at the MRU end of `list`.
    #[inline]
    pub fn push_back(&mut self, list: usize, node: u32) {
        let stamp = self.next_stamp();
        self.ensure_nodes(node as usize + 1);
        self.stamps[node as usize] = stamp;
        self.queues[list].push_back(Entry { node, stamp });
        self.live[list] += 1;
        self.maybe_compact(list);
    }

    /// Takes `node` off `list` (the list it is on).
    #[inline]
    pub fn remove(&mut self, list: usize, node: u32) {
        self.stamps[node as usize] = NO_STAMP;
        self.live[list] -= 1;
        self.maybe_compact(list);
    }

    /// Moves `node` from list `from` to the MRU end of list `to` (a no-op when it already is the
    /// MRU entry of `to`).
    #[inline]
    pub fn move_to_back(&mut self, from: usize, to: usize, node: u32) {
        if from == to
            && self.queues[to]
                .back()
                .is_some_and(|e| e.node == node && e.stamp == self.stamps[node as usize])
        {
            return;
        }
        self.remove(from, node);
        self.push_back(to, node);
    }

    /// Drops stale entries at the LRU end of `list`.
    #[inline]
    pub fn trim_front(&mut self, list: usize) {
        let q = &mut self.queues[list];
        while let Some(e) = q.front() {
            if self.stamps[e.node as usize] == e.stamp {
                break;
            }
            q.pop_front();
        }
    }

    /// Removes and returns the LRU-most node of `list`.
    pub fn pop_front(&mut self, list: usize) -> Option<u32> {
        self.trim_front(list);
        let e = self.queues[list].pop_front()?;
        self.stamps[e.node as usize] = NO_STAMP;
        self.live[list] -= 1;
        self.maybe_compact(list);
        Some(e.node)
    }

    /// Nodes of `list` from LRU to MRU.
    pub fn iter(&self, list: usize) -> impl Iterator<Item = u32> + '_ {
        let stamps = &self.stamps;
        self.queues[list]
            .iter()
            .filter(move |e| stamps[e.node as usize] == e.stamp)
            .map(|e| e.node)
    }

    #[inline]
    fn maybe_compact(&mut self, list: usize) {
        if self.queues[list].len() > (STALE_FACTOR + 1) * self.live[list] + SLACK {
            self.compact(list);
        }
    }

    #[cold]
    fn compact(&mut self, list: usize) {
        let stamps = &self.stamps;
        self.queues[list].retain(|e| stamps[e.node as usize] == e.stamp);
    }

    /// Compacts every queue and hands out stamps `1..` again (front to back, list by list).
    #[cold]
    fn renumber(&mut self) {
        // Compact all first: once renumbering starts, old and new stamps could coincide.
        for list in 0..4 {
            self.compact(list);
        }
        let mut s = NO_STAMP;
        for list in 0..4 {
            for e in &mut self.queues[list] {
                s += 1;
                e.stamp = s;
                self.stamps[e.node as usize] = s;
            }
        }
        self.last = s;
    }

    /// Forgets every list (keeps allocations).
    pub fn clear(&mut self) {
        for q in &mut self.queues {
            q.clear();
        }
        self.live = [0; 4];
        self.stamps.fill(NO_STAMP);
        self.last = NO_STAMP;
    }

    /// Entries held by `list`, live or stale (tests).
    #[cfg(test)]
    fn raw_len(&self, list: usize) -> usize {
        self.queues[list].len()
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn order(l: &Lists, list: usize) -> Vec<u32> {
        l.iter(list).collect()
    }

    #[test]
    fn order_moves_and_stale_skipping() {
        let mut l = Lists::new();
        for n in 0..5 {
            l.push_back(0, n);
        }
        assert_eq!(order(&l, 0), [0, 1, 2, 3, 4]);
        l.move_to_back(0, 0, 1);
        l.move_to_back(0, 0, 1); // already MRU: no new entry
        assert_eq!(l.raw_len(0), 6);
        l.move_to_back(0, 2, 3);
        l.remove(0, 0);
        assert_eq!(order(&l, 0), [2, 4, 1]);
        assert_eq!(order(&l, 2), [3]);
        assert_eq!((l.len(0), l.len(2)), (3, 1));
        assert!(!l.is_listed(0));
        // The stale front entry (node 0) and the stale copy of 1 are skipped and trimmed.
        l.trim_front(0);
        assert_eq!(l.raw_len(0), 4); // 2 3(stale) 4 1
        assert_eq!(l.pop_front(0), Some(2));
        assert_eq!(l.pop_front(0), Some(4));
        assert_eq!(l.pop_front(0), Some(1));
        assert_eq!(l.pop_front(0), None);
        assert_eq!(l.raw_len(0), 0);
        // A node put back on a list after leaving it is found only at its new place.
        l.push_back(0, 0);
        l.push_back(0, 2);
        l.move_to_back(2, 0, 3);
        l.move_to_back(0, 0, 0);
        assert_eq!(order(&l, 0), [2, 3, 0]);
    }

    #[test]
    fn compaction_bounds_memory() {
        let mut l = Lists::new();
        for n in 0..10 {
            l.push_back(1, n);
        }
        for round in 0..10_000u32 {
            l.move_to_back(1, 1, round % 10);
            assert!(l.raw_len(1) <= (STALE_FACTOR + 1) * 10 + SLACK + 1);
        }
        let mut want: Vec<u32> = (0..10).collect();
        want.rotate_left((10_000 % 10) as usize);
        assert_eq!(order(&l, 1), want);
    }

    #[test]
    fn renumbering_keeps_order() {
        let mut l = Lists::new();
        l.limit = 20; // wrap every few pushes
        for n in 0..6 {
            l.push_back(usize::from(n % 2 == 1) * 3, n);
        }
        for i in 0..200u32 {
            let n = (i * 7) % 6;
            let from = l
                .queues
                .iter()
                .position(|q| {
                    q.iter()
                        .any(|e| e.node == n && l.stamps[n as usize] == e.stamp)
                })
                .unwrap();
            l.move_to_back(from, (i % 4) as usize, n);
            assert!(l.last < 20);
        }
        let total: usize = (0..4).map(|q| order(&l, q).len()).sum();
        assert_eq!(total, 6);
        assert_eq!((0..4).map(|q| l.len(q)).sum::<usize>(), 6);
    }

    proptest! {
        /// The queues against `Vec` lists (front = LRU), with a tiny stamp limit so that
        /// renumbering happens often.
        #[test]
        fn matches_vec_lists(ops in proptest::collection::vec((0u8..4, 0u32..12, 0usize..4), 1..300), limit in 8u32..100) {
            let mut l = Lists::new();
            l.limit = limit.max(16);
            let mut model: [Vec<u32>; 4] = Default::default();
            for (kind, node, list) in ops {
                let at = model.iter().position(|v| v.contains(&node));
                match (kind, at) {
                    (0, None) => { l.push_back(list, node); model[list].push(node); }
                    (1, Some(from)) => {
                        l.move_to_back(from, list, node);
                        model[from].retain(|&x| x != node);
                        model[list].push(node);
                    }
                    (2, Some(from)) => { l.remove(from, node); model[from].retain(|&x| x != node); }
                    (3, _) => {
                        let got = l.pop_front(list);
                        let want = if model[list].is_empty() { None } else { Some(model[list].remove(0)) };
                        prop_assert_eq!(got, want);
                    }
                    _ => {}
                }
                for (q, want) in model.iter().enumerate() {
                    prop_assert_eq!(&order(&l, q), want);
                    prop_assert_eq!(l.len(q), want.len());
                    prop_assert!(l.raw_len(q) <= (STALE_FACTOR + 1) * want.len() + SLACK + 1);
                }
            }
        }
    }
}
