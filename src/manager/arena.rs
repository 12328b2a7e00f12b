//! Storage for manager entries: a node arena, the hash index from key to node ([`Index`]) and the
//! recency lists ([`Lists`]), all addressed by `u32` node indices (no raw pointers).
//!
//! Invariants:
//! - a live node (list T1, T2, B1 or B2) is on exactly that list and in the index exactly once,
//!   under its `tag`;
//! - a free node (list [`ListTag::Free`]) is on no list, not in the index, and its index is on the
//!   free stack exactly once, unless the caller detached it for immediate reuse
//!   ([`Arena::detach`] / [`Arena::reuse`]); its old key stays in place until the slot is reused;
//! - `prot` is set only while a `prepare_store` call runs (its present keys).
//!
//! Batched probes ([`Arena::find_chunk`]) process up to [`CHUNK`] keys in stages (hash all, load
//! every home slot of the index, take the first tag match of each, load every candidate node, then
//! compare keys), so that the CPU has many independent cache misses in flight instead of one
//! chain of dependent misses per key. The stages only read memory, so the result is exactly that
//! of probing the keys one by one.
#![forbid(unsafe_code)]

use std::hash::{BuildHasher, Hash};
use std::hint::black_box;

use super::index::{tag_of, Index};
use super::lists::Lists;

/// "No node" marker.
pub const NIL: u32 = u32::MAX;

/// Keys probed together by [`Arena::find_chunk`].
pub const CHUNK: usize = 64;

/// Nodes of the arena's first allocation (4 KiB of nodes for 48-byte keys).
const MIN_NODES: usize = 64;

/// Which list a node is on. LRU uses only `T1`; ARC uses all four.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ListTag {
    /// Resident, seen once (LRU's only list).
    T1 = 0,
    /// Resident, seen again (ARC).
    T2 = 1,
    /// Ghosts evicted from T1 (ARC).
    B1 = 2,
    /// Ghosts evicted from T2 (ARC).
    B2 = 3,
    /// Not in use.
    Free = 4,
}

impl ListTag {
    /// B1 or B2.
    #[inline]
    #[must_use]
    pub fn is_ghost(self) -> bool {
        matches!(self, ListTag::B1 | ListTag::B2)
    }

    /// T1 or T2.
    #[inline]
    #[must_use]
    pub fn is_resident(self) -> bool {
        matches!(self, ListTag::T1 | ListTag::T2)
    }

    #[inline]
    fn idx(self) -> usize {
        self as usize
    }
}

/// One entry: a resident key (T1/T2) or a ghost key (B1/B2). One cache line for 48-byte keys
/// (`ByteKey`): the key and every field a call reads sit together.
#[derive(Clone, Debug)]
#[repr(C, align(64))]
pub struct Node<K> {
    /// The key.
    pub key: K,
    /// CPU block id (meaningless for ghosts).
    pub block_id: u32,
    /// Number of in-flight loads pinning this block.
    pub loads: u32,
    /// Index tag of the key (the high half of its hash).
    pub tag: u32,
    /// Store in flight (not readable, not evictable).
    pub pending: bool,
    /// Among the keys of the `prepare_store` call being processed (not evictable by it).
    pub prot: bool,
    /// The list the node is on.
    pub list: ListTag,
}

impl<K> Node<K> {
    /// Ready, not loading, resident: may be evicted (if not protected).
    #[inline]
    pub fn is_evictable(&self) -> bool {
        !self.pending && self.loads == 0 && self.list.is_resident()
    }
}

/// Nodes + hash index + the four lists.
///
/// Storage grows with use, not with the manager's capacity: an empty arena holds a few hundred
/// bytes; the nodes (and the lists' per-node stamps) grow by doubling up to `max_nodes`, the most
/// the policy can keep (past it, if ever, by doubling again), and the index doubles as entries
/// come (see [`Index`]). Growth is amortised O(1) per inserted node.
pub struct Arena<K> {
    nodes: Vec<Node<K>>,
    free: Vec<u32>,
    index: Index,
    /// The four recency lists.
    pub lists: Lists,
    hasher: foldhash::fast::RandomState,
    /// Growth of `nodes` stops here first (a hint, not a limit).
    max_nodes: usize,
}

impl<K: Hash + Eq> Arena<K> {
    /// An empty arena for at most about `max_nodes` nodes (allocates nothing for them yet).
    #[must_use]
    pub fn new(max_nodes: usize) -> Self {
        Self {
            nodes: Vec::new(),
            free: Vec::new(),
            index: Index::new(),
            lists: Lists::new(),
            hasher: foldhash::fast::RandomState::default(),
            max_nodes,
        }
    }

    /// Makes room for one more node: doubles the node storage, but not past `max_nodes` while
    /// below it, and reserves the lists' stamps alongside.
    #[cold]
    fn grow_nodes(&mut self) {
        let len = self.nodes.len();
        let doubled = len.saturating_mul(2).max(MIN_NODES);
        let want = if len < self.max_nodes {
            doubled.min(self.max_nodes)
        } else {
            doubled
        };
        self.nodes.reserve_exact(want.max(len + 1) - len);
        self.lists.reserve_nodes(self.nodes.capacity());
    }

    #[inline]
    /// The hash of `key` (the index's).
    pub fn hash_of(&self, key: &K) -> u64 {
        self.hasher.hash_one(key)
    }

    /// Node holding `key`, if any (resident or ghost).
    #[inline]
    pub fn find(&self, key: &K) -> Option<u32> {
        let tag = tag_of(self.hash_of(key));
        let nodes = &self.nodes;
        self.index.find(tag, |i| nodes[i as usize].key == *key)
    }

    /// Probes up to [`CHUNK`] keys at once: `hashes[k]` = hash of `keys[k]`, `found[k]` = node
    /// holding `keys[k]` or [`NIL`].
    pub fn find_chunk(&self, keys: &[K], hashes: &mut [u64; CHUNK], found: &mut [u32; CHUNK]) {
        let n = keys.len().min(CHUNK);
        let keys = &keys[..n];
        for (h, k) in hashes.iter_mut().zip(keys) {
            *h = self.hash_of(k);
        }
        let hashes = &hashes[..n];
        // Load each key's home slot: independent misses, overlapped by the CPU.
        let mut acc = 0u64;
        for &h in hashes {
            acc ^= self.index.home_entry(tag_of(h));
        }
        black_box(acc);
        // First tag match of each key (the home lines are cached now).
        let mut slots = [0usize; CHUNK];
        for k in 0..n {
            match self.index.first_candidate(tag_of(hashes[k])) {
                Some((s, i)) => {
                    slots[k] = s;
                    found[k] = i;
                }
                None => found[k] = NIL,
            }
        }
        // Load each candidate node.
        let mut acc = 0u32;
        for &i in &found[..n] {
            if let Some(node) = self.nodes.get(i as usize) {
                acc ^= node.block_id;
            }
        }
        black_box(acc);
        // Confirm by key; a tag collision continues the probe.
        let nodes = &self.nodes;
        for k in 0..n {
            let i = found[k];
            if i != NIL && nodes[i as usize].key != keys[k] {
                found[k] = self
                    .index
                    .find_from(slots[k] + 1, tag_of(hashes[k]), |j| {
                        nodes[j as usize].key == keys[k]
                    })
                    .unwrap_or(NIL);
            }
        }
    }

    /// Loads the cache lines of the given nodes' list stamps (before a batch of list moves).
    #[inline]
    pub fn warm_stamps(&self, nodes: &[u32]) {
        let mut acc = 0u32;
        for &i in nodes {
            acc ^= self.lists.stamp_word(i);
        }
        black_box(acc);
    }

    /// Loads the cache lines of the index home slots of the given hashes (before inserting them).
    #[inline]
    pub fn warm_index_homes(&self, hashes: impl Iterator<Item = u64>) {
        let mut acc = 0u64;
        for h in hashes {
            acc ^= self.index.home_entry(tag_of(h));
        }
        black_box(acc);
    }

    /// Loads the cache lines of the index home slots of the given nodes (before removing them).
    #[inline]
    pub fn warm_index_of(&self, nodes: &[u32]) {
        let mut acc = 0u64;
        for &i in nodes {
            acc ^= self.index.home_entry(self.nodes[i as usize].tag);
        }
        black_box(acc);
    }

    #[inline]
    /// Node `i`.
    #[must_use]
    pub fn node(&self, i: u32) -> &Node<K> {
        &self.nodes[i as usize]
    }

    #[inline]
    /// Node `i`, mutably.
    pub fn node_mut(&mut self, i: u32) -> &mut Node<K> {
        &mut self.nodes[i as usize]
    }

    /// A new pending node for `key` (absent), indexed under `tag`, on no list yet.
    pub fn insert(&mut self, key: K, tag: u32, block_id: u32) -> u32 {
        let node = Node {
            key,
            block_id,
            loads: 0,
            tag,
            pending: true,
            prot: false,
            list: ListTag::Free,
        };
        let i = if let Some(i) = self.free.pop() {
            self.nodes[i as usize] = node;
            i
        } else {
            // More than 2^32 − 1 nodes (> 256 GiB of them) is out of reach in practice; NIL would
            // fail loudly at its first use.
            let i = u32::try_from(self.nodes.len()).unwrap_or(NIL);
            if self.nodes.len() == self.nodes.capacity() {
                self.grow_nodes();
            }
            self.nodes.push(node);
            i
        };
        self.index.insert(tag, i);
        i
    }

    /// Reuses a detached node (see [`Arena::detach`]) for the absent `key`, like
    /// [`Arena::insert`]; returns the node's old key.
    pub fn reuse(&mut self, i: u32, key: K, tag: u32, block_id: u32) -> K {
        let n = &mut self.nodes[i as usize];
        let old = std::mem::replace(&mut n.key, key);
        n.block_id = block_id;
        n.loads = 0;
        n.tag = tag;
        n.pending = true;
        n.prot = false;
        n.list = ListTag::Free;
        self.index.insert(tag, i);
        old
    }

    /// Takes node `i` off its list and out of the index without freeing it: the caller reuses it
    /// with [`Arena::reuse`] in the same call.
    pub fn detach(&mut self, i: u32) {
        let n = &mut self.nodes[i as usize];
        let (list, tag) = (n.list, n.tag);
        n.list = ListTag::Free;
        self.lists.remove(list.idx(), i);
        self.index.remove(tag, i);
    }

    /// Frees a node taken out by [`Arena::detach`] (its key stays in place until the slot is
    /// reused).
    pub fn free_detached(&mut self, i: u32) {
        self.free.push(i);
    }

    /// Takes node `i` off its list and out of the index and frees it (its key stays in place until
    /// the slot is reused).
    pub fn remove(&mut self, i: u32) {
        self.detach(i);
        self.free.push(i);
    }

    /// Links node `i` (on no list) at the MRU end of list `tag`.
    #[inline]
    pub fn push_mru(&mut self, i: u32, tag: ListTag) {
        self.nodes[i as usize].list = tag;
        self.lists.push_back(tag.idx(), i);
    }

    /// Moves node `i` to the MRU end of list `tag`.
    #[inline]
    pub fn move_to_mru(&mut self, i: u32, tag: ListTag) {
        let n = &mut self.nodes[i as usize];
        let from = n.list;
        n.list = tag;
        self.lists.move_to_back(from.idx(), tag.idx(), i);
    }

    /// Live length of list `tag`.
    #[inline]
    #[must_use]
    pub fn len(&self, tag: ListTag) -> usize {
        self.lists.len(tag.idx())
    }

    /// Nodes of list `tag` from LRU to MRU.
    #[inline]
    pub fn iter(&self, tag: ListTag) -> impl Iterator<Item = u32> + '_ {
        self.lists.iter(tag.idx())
    }

    /// Removes and returns the LRU-most node of list `tag` from the list (not from the index).
    #[inline]
    pub fn pop_lru(&mut self, tag: ListTag) -> Option<u32> {
        let i = self.lists.pop_front(tag.idx())?;
        self.nodes[i as usize].list = ListTag::Free;
        Some(i)
    }

    /// Drops stale entries at the LRU end of list `tag` (after removals there).
    #[inline]
    pub fn trim_front(&mut self, tag: ListTag) {
        self.lists.trim_front(tag.idx());
    }

    /// Takes an unlisted node (from [`Arena::pop_lru`]) out of the index and frees it.
    pub fn unindex_and_free(&mut self, i: u32) {
        let tag = self.nodes[i as usize].tag;
        self.index.remove(tag, i);
        self.free.push(i);
    }

    /// Keys of list `tag` from LRU to MRU (for tests and introspection).
    #[must_use]
    pub fn list_keys(&self, tag: ListTag) -> Vec<&K> {
        self.iter(tag)
            .map(|i| &self.nodes[i as usize].key)
            .collect()
    }

    /// Empties the arena (every node, list and index entry).
    pub fn clear(&mut self) {
        self.nodes.clear();
        self.free.clear();
        self.index.clear();
        self.lists.clear();
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;
    use crate::key::ByteKey;

    #[test]
    fn node_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Node<ByteKey>>(), 64);
        assert_eq!(std::mem::align_of::<Node<ByteKey>>(), 64);
        assert_eq!(std::mem::size_of::<Node<[u8; 36]>>(), 64);
    }

    /// Node storage doubles, but stops at the policy's bound first (no slack for nodes the
    /// manager can never hold), and the lists' stamps follow it.
    #[test]
    fn node_storage_stops_at_the_bound() {
        let mut a: Arena<u64> = Arena::new(5000);
        assert_eq!(a.nodes.capacity(), 0);
        for k in 0..5000u64 {
            let tag = tag_of(a.hash_of(&k));
            let i = a.insert(k, tag, 0);
            a.push_mru(i, ListTag::T1);
        }
        assert_eq!(a.nodes.capacity(), 5000);
        assert!(a.lists.stamps_capacity() <= 5000);
        // Past the bound (never in a manager), it doubles again.
        a.insert(5000, 0, 0);
        assert_eq!(a.nodes.capacity(), 10_000);
    }

    #[test]
    fn find_chunk_matches_find() {
        let mut a: Arena<u64> = Arena::new(0);
        for k in 0..1000u64 {
            let tag = tag_of(a.hash_of(&k));
            let i = a.insert(k, tag, 0);
            a.push_mru(i, ListTag::T1);
        }
        for k in (0..1000u64).step_by(3) {
            let i = a.find(&k).unwrap();
            a.remove(i);
        }
        let keys: Vec<u64> = (500..700).collect();
        let mut hashes = [0u64; CHUNK];
        let mut found = [0u32; CHUNK];
        for chunk in keys.chunks(CHUNK) {
            a.find_chunk(chunk, &mut hashes, &mut found);
            for (k, key) in chunk.iter().enumerate() {
                assert_eq!(found[k], a.find(key).unwrap_or(NIL));
                assert_eq!(hashes[k], a.hash_of(key));
                assert_eq!(found[k] == NIL, key % 3 == 0);
            }
        }
        assert_eq!(a.len(ListTag::T1), 666);
    }

    /// Keys whose hashes collide in the tag: `find_chunk` must go past the first tag match.
    #[derive(PartialEq, Eq, Clone, Debug)]
    struct Colliding(u32);
    impl Hash for Colliding {
        fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
            (self.0 % 4).hash(state);
        }
    }

    #[test]
    fn find_chunk_with_tag_collisions() {
        let mut a: Arena<Colliding> = Arena::new(4);
        for k in 0..40 {
            let key = Colliding(k);
            let tag = tag_of(a.hash_of(&key));
            a.insert(key, tag, k);
        }
        let keys: Vec<Colliding> = (0..50).rev().map(Colliding).collect();
        let mut hashes = [0u64; CHUNK];
        let mut found = [0u32; CHUNK];
        a.find_chunk(&keys, &mut hashes, &mut found);
        for (k, key) in keys.iter().enumerate() {
            if key.0 < 40 {
                assert_eq!(a.node(found[k]).block_id, key.0);
            } else {
                assert_eq!(found[k], NIL);
            }
        }
    }
}
