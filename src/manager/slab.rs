//! Index-linked storage for manager entries: a slab of nodes, a hash index from key to node, and
//! intrusive doubly-linked lists threaded through the nodes by `u32` indices (no raw pointers).
//!
//! Invariants:
//! - every live node is in exactly one list (its `list` tag) and in the hash index exactly once;
//! - a list's `head` is its LRU end and `tail` its MRU end; `prev`/`next` are [`NIL`] at the ends;
//! - free slots are chained through `next` and hold no key.
#![forbid(unsafe_code)]

use std::hash::{BuildHasher, Hash};

use hashbrown::HashTable;

/// "No node" marker for links.
pub const NIL: u32 = u32::MAX;

/// Which list a node is on. LRU uses only `T1`; ARC uses all four.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListTag {
    T1 = 0,
    T2 = 1,
    B1 = 2,
    B2 = 3,
}

impl ListTag {
    pub fn is_ghost(self) -> bool {
        matches!(self, ListTag::B1 | ListTag::B2)
    }
}

/// One entry: a resident key (T1/T2) or a ghost key (B1/B2).
#[derive(Clone, Debug)]
pub struct Node<K> {
    pub key: K,
    pub hash: u64,
    pub prev: u32,
    pub next: u32,
    /// CPU block id (meaningless for ghosts).
    pub block_id: u32,
    /// Number of in-flight loads pinning this block.
    pub loads: u32,
    /// Store in flight (not readable, not evictable).
    pub pending: bool,
    pub list: ListTag,
    /// Protection epoch: equal to the manager's current epoch while the key is among the keys of
    /// the `prepare_store` call being processed.
    pub mark: u32,
}

impl<K> Node<K> {
    /// Ready, not loading: may be evicted (if not protected).
    #[inline]
    pub fn is_evictable(&self) -> bool {
        !self.pending && self.loads == 0 && !self.list.is_ghost()
    }
}

/// A doubly-linked list over slab indices.
#[derive(Clone, Copy, Debug)]
pub struct List {
    pub head: u32,
    pub tail: u32,
    pub len: usize,
}

impl List {
    pub const EMPTY: List = List {
        head: NIL,
        tail: NIL,
        len: 0,
    };
}

/// Slab + hash index + the four lists.
pub struct Slab<K> {
    nodes: Vec<Option<Node<K>>>,
    free_slot: Vec<u32>,
    index: HashTable<u32>,
    hasher: foldhash::fast::RandomState,
    pub lists: [List; 4],
}

impl<K: Hash + Eq> Slab<K> {
    pub fn new() -> Self {
        Self {
            nodes: Vec::new(),
            free_slot: Vec::new(),
            index: HashTable::new(),
            hasher: foldhash::fast::RandomState::default(),
            lists: [List::EMPTY; 4],
        }
    }

    pub fn with_capacity(n: usize) -> Self {
        let mut s = Self::new();
        s.nodes.reserve(n);
        s.index.reserve(n, |_| 0);
        s
    }

    #[inline]
    pub fn hash_of(&self, key: &K) -> u64 {
        self.hasher.hash_one(key)
    }

    /// Index of the node holding `key`, if any (resident or ghost).
    #[inline]
    pub fn find(&self, key: &K) -> Option<u32> {
        let h = self.hash_of(key);
        self.find_hashed(key, h)
    }

    #[inline]
    pub fn find_hashed(&self, key: &K, h: u64) -> Option<u32> {
        let nodes = &self.nodes;
        self.index
            .find(h, |&i| {
                nodes[i as usize]
                    .as_ref()
                    .is_some_and(|n| n.hash == h && n.key == *key)
            })
            .copied()
    }

    #[inline]
    pub fn node(&self, i: u32) -> &Node<K> {
        match &self.nodes[i as usize] {
            Some(n) => n,
            None => unreachable_node(i),
        }
    }

    #[inline]
    pub fn node_mut(&mut self, i: u32) -> &mut Node<K> {
        match &mut self.nodes[i as usize] {
            Some(n) => n,
            None => unreachable_node(i),
        }
    }

    /// Inserts a new node (not linked into any list yet) and indexes it. The key must be absent.
    pub fn insert(&mut self, key: K, hash: u64, block_id: u32) -> u32 {
        let node = Node {
            key,
            hash,
            prev: NIL,
            next: NIL,
            block_id,
            loads: 0,
            pending: true,
            list: ListTag::T1,
            mark: 0,
        };
        let i = if let Some(i) = self.free_slot.pop() {
            self.nodes[i as usize] = Some(node);
            i
        } else {
            let i = u32::try_from(self.nodes.len()).unwrap_or(NIL);
            self.nodes.push(Some(node));
            i
        };
        let nodes = &self.nodes;
        self.index.insert_unique(hash, i, |&j| {
            nodes[j as usize].as_ref().map_or(0, |n| n.hash)
        });
        i
    }

    /// Unlinks (from its list), unindexes and frees node `i`, returning it.
    pub fn remove(&mut self, i: u32) -> Node<K> {
        self.unlink(i);
        let h = self.node(i).hash;
        if let Ok(entry) = self.index.find_entry(h, |&j| j == i) {
            entry.remove();
        }
        self.free_slot.push(i);
        match self.nodes[i as usize].take() {
            Some(n) => n,
            None => unreachable_node(i),
        }
    }

    /// Links node `i` at the MRU end (tail) of list `tag`. The node must be unlinked.
    pub fn push_mru(&mut self, i: u32, tag: ListTag) {
        let l = self.lists[tag as usize];
        {
            let n = self.node_mut(i);
            n.list = tag;
            n.prev = l.tail;
            n.next = NIL;
        }
        if l.tail == NIL {
            self.lists[tag as usize].head = i;
        } else {
            self.node_mut(l.tail).next = i;
        }
        let l = &mut self.lists[tag as usize];
        l.tail = i;
        l.len += 1;
    }

    /// Removes node `i` from its list (it stays in the slab and the index).
    pub fn unlink(&mut self, i: u32) {
        let (prev, next, tag) = {
            let n = self.node(i);
            (n.prev, n.next, n.list)
        };
        if prev == NIL {
            self.lists[tag as usize].head = next;
        } else {
            self.node_mut(prev).next = next;
        }
        if next == NIL {
            self.lists[tag as usize].tail = prev;
        } else {
            self.node_mut(next).prev = prev;
        }
        let n = self.node_mut(i);
        n.prev = NIL;
        n.next = NIL;
        self.lists[tag as usize].len -= 1;
    }

    /// Moves node `i` to the MRU end of list `tag`.
    pub fn move_to_mru(&mut self, i: u32, tag: ListTag) {
        let n = self.node(i);
        if n.list == tag && n.next == NIL {
            return;
        }
        self.unlink(i);
        self.push_mru(i, tag);
    }

    /// Keys of list `tag` from LRU to MRU (for tests and introspection).
    pub fn list_keys(&self, tag: ListTag) -> Vec<&K> {
        let mut out = Vec::with_capacity(self.lists[tag as usize].len);
        let mut i = self.lists[tag as usize].head;
        while i != NIL {
            let n = self.node(i);
            out.push(&n.key);
            i = n.next;
        }
        out
    }

    pub fn for_each_node_mut(&mut self, mut f: impl FnMut(&mut Node<K>)) {
        for n in self.nodes.iter_mut().flatten() {
            f(n);
        }
    }

    /// LRU-most node of list `tag` ([`NIL`] when empty).
    pub fn head_of(&self, tag: ListTag) -> u32 {
        self.lists[tag as usize].head
    }

    pub fn clear(&mut self) {
        self.nodes.clear();
        self.free_slot.clear();
        self.index.clear();
        self.lists = [List::EMPTY; 4];
    }
}

#[cold]
#[inline(never)]
fn unreachable_node(i: u32) -> ! {
    // The slab only hands out indices of live nodes; reaching this is a bug in this module.
    unreachable!("kvoff manager slab: node {i} is not live") // allow-panic: internal invariant
}
