//! Open-addressing hash index from a key's hash to a node index (`u32`), for the managers' node
//! arena (and for the per-call duplicate filter of `prepare_store`).
//!
//! Layout: a power-of-two `Vec<u64>` of entries `tag << 32 | node`, where `tag` is the high 32
//! bits of the key's 64-bit hash, and [`EMPTY`] marks a free slot (no node index is `u32::MAX`, so
//! no entry equals it). Eight entries share a cache line, so a probe usually costs one miss.
//! Linear probing from the *home slot*, which is derived from the tag alone (its top bits), so
//! that resizing and deletion never need the key or its full hash. Deletion shifts the following
//! entries of the cluster back (no tombstones). The index never compares keys: [`Index::find`]
//! hands every tag match to the caller's predicate, which compares the key stored in the node.
//!
//! Invariants: every stored entry is reachable from its home slot without crossing an [`EMPTY`]
//! slot; `len ≤ slots / 4` while the table may still grow (up to 2^32 slots), and at least one slot
//! is always [`EMPTY`], so every probe ends.
//!
//! Load factor: at most 1/4 (power-of-two tables, so 0.15–0.25 in practice; 32–64 bytes per key).
//! Measured side by side on the managers' benchmark (2-core VM) against ≤ 1/2 and against ≤ 3/8
//! with exact (non-power-of-two) sizing: 1/4 gives the fastest `prepare_store` (+20–25%) and
//! `complete_store` (+25–30%), equal `lookup_prefix` and `touch`; the bigger table costs single
//! (unbatched) `lookup`s at 10^5 keys, which ran ~25% slower than at ≤ 1/2 (their probe misses
//! cache more often).
#![forbid(unsafe_code)]

/// A free slot.
pub const EMPTY: u64 = u64::MAX;

/// The load factor is kept ≤ 2^-LOAD_SHIFT (see the module docs).
const LOAD_SHIFT: u32 = 2;

/// Largest table: 2^32 slots (the home slot is taken from the 32-bit tag).
const MAX_BITS: u32 = 32;

/// The tag (high half) of a 64-bit hash.
#[inline]
#[allow(clippy::cast_possible_truncation)] // the high half fits
pub fn tag_of(hash: u64) -> u32 {
    (hash >> 32) as u32
}

#[inline]
fn entry(tag: u32, node: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(node)
}

#[inline]
#[allow(clippy::cast_possible_truncation)] // the low half is the node index
fn node_of(e: u64) -> u32 {
    e as u32
}

/// The hash index.
#[derive(Clone, Debug)]
pub struct Index {
    slots: Vec<u64>,
    /// `slots.len() == 1 << bits`.
    bits: u32,
    mask: usize,
    len: usize,
}

impl Default for Index {
    fn default() -> Self {
        Self::new()
    }
}

impl Index {
    /// An empty index of 8 slots.
    #[must_use]
    pub fn new() -> Self {
        Self::with_capacity(0)
    }

    /// An empty index that holds `n` entries without growing.
    #[must_use]
    pub fn with_capacity(n: usize) -> Self {
        let bits = Self::bits_for(n);
        Self {
            slots: vec![EMPTY; 1 << bits],
            bits,
            mask: (1 << bits) - 1,
            len: 0,
        }
    }

    /// Table bits for `n` entries at load factor ≤ 2^-[`LOAD_SHIFT`] (at least 8 slots, at most
    /// 2^32).
    fn bits_for(n: usize) -> u32 {
        let want = n
            .saturating_mul(1 << LOAD_SHIFT)
            .max(8)
            .checked_next_power_of_two();
        want.map_or(MAX_BITS, |w| w.trailing_zeros().min(MAX_BITS))
    }

    /// Number of entries.
    #[cfg(test)]
    #[inline]
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` when no entry is stored.
    #[cfg(test)]
    #[inline]
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of slots.
    #[cfg(test)]
    #[must_use]
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Home slot of a tag: its top `bits` bits.
    #[inline]
    #[allow(clippy::cast_possible_truncation)] // < 2^bits ≤ 2^32 slots
    fn home(&self, tag: u32) -> usize {
        ((u64::from(tag) << self.bits) >> 32) as usize
    }

    /// The entry in the home slot of `tag` (to warm the cache line before probing a batch: loading
    /// it for many keys in a row lets the CPU overlap the misses).
    #[inline]
    #[must_use]
    pub fn home_entry(&self, tag: u32) -> u64 {
        self.slots[self.home(tag)]
    }

    /// Removes every entry and makes room for `n` entries (keeps the allocation when it is big
    /// enough, shrinks it when it is more than 4× too big).
    pub fn clear_for(&mut self, n: usize) {
        let bits = Self::bits_for(n);
        if bits > self.bits || bits + 2 < self.bits {
            *self = Self::with_capacity(n);
        } else {
            self.slots.fill(EMPTY);
            self.len = 0;
        }
    }

    /// Removes every entry, keeping the allocation.
    pub fn clear(&mut self) {
        self.slots.fill(EMPTY);
        self.len = 0;
    }

    /// The first node, in probe order, whose tag is `tag` and for which `eq` holds.
    #[inline]
    pub fn find(&self, tag: u32, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let mut s = self.home(tag);
        loop {
            let e = self.slots[s];
            if e == EMPTY {
                return None;
            }
            if tag_of(e) == tag && eq(node_of(e)) {
                return Some(node_of(e));
            }
            s = (s + 1) & self.mask;
        }
    }

    /// First probe step of [`Index::find`] without the predicate: the first entry with this tag
    /// (`Some((slot, node))`) or `None` if the probe meets an empty slot first. A caller that
    /// rejects the node continues with [`Index::find_from`] at `slot + 1`.
    #[inline]
    pub fn first_candidate(&self, tag: u32) -> Option<(usize, u32)> {
        let mut s = self.home(tag);
        loop {
            let e = self.slots[s];
            if e == EMPTY {
                return None;
            }
            if tag_of(e) == tag {
                return Some((s, node_of(e)));
            }
            s = (s + 1) & self.mask;
        }
    }

    /// [`Index::find`] continued from slot `start` (the slot after a rejected candidate).
    pub fn find_from(
        &self,
        start: usize,
        tag: u32,
        mut eq: impl FnMut(u32) -> bool,
    ) -> Option<u32> {
        let mut s = start & self.mask;
        loop {
            let e = self.slots[s];
            if e == EMPTY {
                return None;
            }
            if tag_of(e) == tag && eq(node_of(e)) {
                return Some(node_of(e));
            }
            s = (s + 1) & self.mask;
        }
    }

    /// Adds `node` under `tag`. The caller guarantees that the key is not indexed yet.
    #[inline]
    pub fn insert(&mut self, tag: u32, node: u32) {
        if (self.len + 1) << LOAD_SHIFT > self.slots.len() && self.bits < MAX_BITS {
            self.grow();
        }
        let mut s = self.home(tag);
        while self.slots[s] != EMPTY {
            s = (s + 1) & self.mask;
        }
        self.slots[s] = entry(tag, node);
        self.len += 1;
    }

    /// Doubles the table, re-placing entries by their tags (no key is hashed).
    #[cold]
    fn grow(&mut self) {
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; 1 << (self.bits + 1)]);
        self.bits += 1;
        self.mask = (1 << self.bits) - 1;
        for e in old {
            if e != EMPTY {
                let mut s = self.home(tag_of(e));
                while self.slots[s] != EMPTY {
                    s = (s + 1) & self.mask;
                }
                self.slots[s] = e;
            }
        }
    }

    /// Removes the entry `(tag, node)`; `false` if it is not there.
    pub fn remove(&mut self, tag: u32, node: u32) -> bool {
        let want = entry(tag, node);
        let mut s = self.home(tag);
        loop {
            let e = self.slots[s];
            if e == EMPTY {
                return false;
            }
            if e == want {
                break;
            }
            s = (s + 1) & self.mask;
        }
        // Backward shift: move later entries of the cluster into the hole when their home slot
        // is not cyclically after the hole.
        let mut hole = s;
        let mut j = (s + 1) & self.mask;
        loop {
            let e = self.slots[j];
            if e == EMPTY {
                break;
            }
            let h = self.home(tag_of(e));
            if (j.wrapping_sub(h) & self.mask) >= (j.wrapping_sub(hole) & self.mask) {
                self.slots[hole] = e;
                hole = j;
            }
            j = (j + 1) & self.mask;
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
        true
    }

    /// Checks the invariants (tests).
    #[cfg(test)]
    pub fn check(&self) {
        let mut n = 0;
        for (s, &e) in self.slots.iter().enumerate() {
            if e == EMPTY {
                continue;
            }
            n += 1;
            let mut p = self.home(tag_of(e));
            while p != s {
                assert_ne!(
                    self.slots[p], EMPTY,
                    "entry at {s} unreachable from home {p}"
                );
                p = (p + 1) & self.mask;
            }
        }
        assert_eq!(n, self.len);
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// Finds `node` by tag, accepting only that node (as a key comparison would).
    fn find(ix: &Index, tag: u32, node: u32) -> Option<u32> {
        ix.find(tag, |n| n == node)
    }

    #[test]
    fn insert_find_remove() {
        let mut ix = Index::new();
        assert_eq!(ix.slots(), 8);
        ix.insert(0x1234_0000, 7);
        ix.insert(0x8000_0000, 9);
        assert_eq!(find(&ix, 0x1234_0000, 7), Some(7));
        assert_eq!(find(&ix, 0x8000_0000, 9), Some(9));
        assert_eq!(find(&ix, 0x8000_0000, 7), None);
        assert!(ix.remove(0x1234_0000, 7));
        assert!(!ix.remove(0x1234_0000, 7));
        assert_eq!(find(&ix, 0x1234_0000, 7), None);
        assert_eq!(ix.len(), 1);
        ix.check();
    }

    #[test]
    fn collisions_and_backward_shift_across_wrap() {
        let mut ix = Index::with_capacity(4);
        let n = ix.slots();
        let bits = n.trailing_zeros();
        let top = n - 1; // the last slot
        let last = u32::try_from(top).unwrap() << (32 - bits); // home slot: the last one
        let zero = 1_u32; // home slot 0
        ix.insert(last, 1); // last slot
        ix.insert(last | 1, 2); // wraps to slot 0
        ix.insert(last | 2, 3); // slot 1
        ix.insert(zero, 4); // home 0 is taken: slot 2
        assert_eq!(ix.slots(), n, "no growth in this test");
        ix.check();
        assert_eq!(ix.slots[top] as u32, 1);
        assert_eq!(ix.slots[0] as u32, 2);
        assert_eq!(ix.slots[1] as u32, 3);
        assert_eq!(ix.slots[2] as u32, 4);
        // Removing the head of the cluster shifts everything back across the wrap.
        assert!(ix.remove(last, 1));
        ix.check();
        assert_eq!(ix.slots[top] as u32, 2);
        assert_eq!(ix.slots[0] as u32, 3);
        assert_eq!(ix.slots[1] as u32, 4);
        assert_eq!(ix.slots[2], EMPTY);
        for (t, n) in [(last | 1, 2), (last | 2, 3), (zero, 4)] {
            assert_eq!(find(&ix, t, n), Some(n));
        }
        // An entry at its home slot does not move into an earlier hole.
        assert!(ix.remove(last | 1, 2));
        assert!(ix.remove(last | 2, 3));
        ix.check();
        assert_eq!(ix.slots[0] as u32, 4);
        assert_eq!(find(&ix, zero, 4), Some(4));
    }

    #[test]
    fn same_tag_many_nodes() {
        // Equal tags (full 64-bit hash collisions in the high half): the predicate decides.
        let mut ix = Index::new();
        for n in 0..100 {
            ix.insert(42, n);
        }
        ix.check();
        for n in 0..100 {
            assert_eq!(find(&ix, 42, n), Some(n));
        }
        for n in (0..100).step_by(3) {
            assert!(ix.remove(42, n));
        }
        ix.check();
        for n in 0..100 {
            assert_eq!(find(&ix, 42, n).is_some(), n % 3 != 0);
        }
    }

    #[test]
    fn grows_and_keeps_entries() {
        let mut ix = Index::new();
        for n in 0..10_000u32 {
            ix.insert(n.wrapping_mul(0x9E37_79B9), n);
            assert!(ix.len() << LOAD_SHIFT <= ix.slots());
        }
        ix.check();
        for n in 0..10_000u32 {
            assert_eq!(find(&ix, n.wrapping_mul(0x9E37_79B9), n), Some(n));
        }
        let slots = ix.slots();
        ix.clear_for(10);
        assert!(ix.slots() < slots && ix.is_empty());
        ix.clear_for(100);
        assert!(ix.slots() >= 100 << LOAD_SHIFT);
    }

    #[test]
    fn candidate_then_continue() {
        let mut ix = Index::new();
        ix.insert(5, 1);
        ix.insert(5, 2);
        let (s, n) = ix.first_candidate(5).unwrap();
        assert_eq!(n, 1);
        assert_eq!(ix.find_from(s + 1, 5, |n| n == 2), Some(2));
        assert_eq!(ix.find_from(s + 1, 5, |n| n == 1), None);
        assert_eq!(ix.first_candidate(6), None);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u16),
        Remove(u16),
        Find(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..300u16).prop_map(Op::Insert),
            (0..300u16).prop_map(Op::Remove),
            (0..300u16).prop_map(Op::Find),
        ]
    }

    proptest! {
        /// The index against a std `HashMap` from key to node, with few distinct tags so that
        /// clusters, wrap-around and equal tags are frequent.
        #[test]
        fn matches_hashmap(ops in proptest::collection::vec(op(), 1..400), tag_bits in 1u32..12) {
            let tag = |k: u16| -> u32 {
                let h = u32::from(k).wrapping_mul(0x9E37_79B9) >> (32 - tag_bits);
                h.rotate_right(tag_bits) // few distinct values, spread over the home bits
            };
            let mut ix = Index::new();
            let mut model: HashMap<u16, u32> = HashMap::new();
            let mut next = 0u32;
            for op in ops {
                match op {
                    Op::Insert(k) => {
                        if let std::collections::hash_map::Entry::Vacant(e) = model.entry(k) {
                            ix.insert(tag(k), next);
                            e.insert(next);
                            next += 1;
                        }
                    }
                    Op::Remove(k) => {
                        let had = model.remove(&k);
                        prop_assert_eq!(had.is_some(), had.is_some_and(|n| ix.remove(tag(k), n)));
                    }
                    Op::Find(k) => {
                        let want = model.get(&k).copied();
                        // The predicate plays the key comparison: only k's own node matches.
                        let got = ix.find(tag(k), |n| Some(n) == want);
                        prop_assert_eq!(got, want);
                    }
                }
                prop_assert_eq!(ix.len(), model.len());
            }
            ix.check();
            for (&k, &n) in &model {
                prop_assert_eq!(ix.find(tag(k), |m| m == n), Some(n));
            }
        }
    }
}
