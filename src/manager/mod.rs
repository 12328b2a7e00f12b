//! Offloading managers (scheduler side, docs/spec.md §2): which blocks live on the host and what to evict.
//!
//! A manager maps opaque keys to CPU block ids in `0..num_blocks` and tracks each present key's state:
//! **pending** (store in flight: not readable, not evictable), **ready** (readable, evictable) or
//! **loading n** (ready and pinned by `n` in-flight loads). It never touches bytes or CUDA; the only
//! thing it hands to the worker side is block ids.
//!
//! The protocol (one call per scheduler step, any order):
//! `lookup`/`lookup_prefix` (no side effects) → `prepare_load` … `complete_load` (pins blocks while
//! they are read) → `prepare_store` (admission, atomic eviction, id allocation; keys become pending)
//! … `complete_store` (pending → ready, or removed on failure) → `take_events` (removals before the
//! stores that reused their blocks).
//!
//! Two policies share one engine, [`Manager`], generic over the key type and the [`Policy`]:
//! [`LruManager`] (§2.4) and [`ArcManager`] (§2.5, Megiddo & Modha's ARC as adapted in vLLM's
//! `ARCOffloadingManager`). Entries live in a node arena addressed by `u32` indices (no raw
//! pointers) with an open-addressing hash index and recency lists kept as FIFO queues with lazy
//! deletion ([`arena`], [`index`], [`lists`]); every operation is amortised O(1) per key, except
//! that eviction walks past pinned (pending/loading) or protected entries, whose number is bounded
//! by the work in flight.
//!
//! Memory follows use, not capacity: a new manager allocates a few hundred bytes whatever its
//! `num_blocks` (2^24 blocks included, `tests/manager_alloc.rs`); nodes, index and lists grow by
//! amortised doubling as keys come, the nodes up to the most the policy can hold (`num_blocks`,
//! ARC: 3 × `num_blocks` with its ghosts) without slack.
//!
//! Speed: every call gets a batch of keys and probes them in chunks of 64 in stages (hash all, load
//! every index slot, load every candidate node, then compare and apply in the original order), so
//! that the cache misses of different keys overlap; the stages only read, so the effect of a call
//! is exactly that of processing its keys one by one.
//!
//! Invariants kept after every call (checked by the property tests in `tests/manager_props.rs`):
//! present ≤ capacity; block ids unique and in range; pending, loading and offered keys never evicted;
//! a call that returns an error or `None` changed nothing; replaying the events reproduces the set of
//! ready keys.
#![forbid(unsafe_code)]

mod any;
mod arc;
mod arena;
mod index;
mod lists;
mod lru;
mod policy;
mod protocol;
mod tracker;
mod types;

use std::hash::Hash;

pub use any::{AnyManager, PolicyKind};
pub use arc::Arc;
use arena::{Arena, ListTag, CHUNK, NIL};
use index::{tag_of, Index};
pub use lru::Lru;
pub use policy::{policy_api, Policy, TouchRule};
use tracker::Tracker;
pub use types::{
    ManagerConfig, ManagerStats, OffloadingEvent, PrepareStoreIndexed, PrepareStoreOutput, Presence,
};

use crate::error::{KvoffError, Result};

/// A CPU block id.
pub type BlockId = u32;

/// The manager protocol of docs/spec.md §2.2, generic over the key type.
///
/// Every method returns [`KvoffError::InvalidState`] after [`shutdown`](Self::shutdown). A method that
/// returns an error changes nothing.
pub trait OffloadingManager<K> {
    /// `Ready` for ready or loading keys, `Pending` for stores in flight, else `Absent`.
    ///
    /// # Errors
    /// Only after shutdown.
    fn lookup(&self, key: &K) -> Result<Presence>;
    /// Number of leading keys that are ready; `None` if the first non-ready key is pending.
    ///
    /// # Errors
    /// Only after shutdown.
    fn lookup_prefix(&self, keys: &[K]) -> Result<Option<usize>>;
    /// Pins each key for a load (a key listed twice counts twice) and returns its block ids.
    ///
    /// # Errors
    /// [`KvoffError::InvalidState`] if any key is not ready or loading (nothing changes).
    fn prepare_load(&mut self, keys: &[K]) -> Result<Vec<BlockId>>;
    /// Recency update, last key first so the first key ends most recently used.
    ///
    /// # Errors
    /// Only after shutdown.
    fn touch(&mut self, keys: &[K]) -> Result<()>;
    /// Unpins keys after their load finished.
    ///
    /// # Errors
    /// [`KvoffError::InvalidState`] if any key is not loading (nothing changes).
    fn complete_load(&mut self, keys: &[K]) -> Result<()>;
    /// docs/spec.md §2.3: admission, atomic eviction, allocation. `None` = not enough evictable blocks
    /// (nothing changed).
    ///
    /// # Errors
    /// Only after shutdown.
    fn prepare_store(&mut self, keys: &[K]) -> Result<Option<PrepareStoreOutput<K>>>;
    /// Finishes stores: pending keys become ready (`success`) or are removed (failure).
    ///
    /// # Errors
    /// Only after shutdown.
    fn complete_store(&mut self, keys: &[K], success: bool) -> Result<()>;
    /// Drains recorded events in order.
    ///
    /// # Errors
    /// Only after shutdown.
    fn take_events(&mut self) -> Result<Vec<OffloadingEvent<K>>>;
    /// Gauges; resets `stores_skipped`.
    ///
    /// # Errors
    /// Only after shutdown.
    fn get_stats(&mut self) -> Result<ManagerStats>;
    /// Forgets every key, ghost, counter and the free list; pending events stay.
    ///
    /// # Errors
    /// Only after shutdown.
    fn reset(&mut self) -> Result<()>;
    /// Idempotent; afterwards every other method fails.
    fn shutdown(&mut self);
    /// Number of present keys.
    fn len(&self) -> usize;
    /// `true` when no key is present.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Capacity in blocks.
    fn num_blocks(&self) -> usize;
}

/// LRU manager (docs/spec.md §2.4).
pub type LruManager<K> = Manager<K, Lru>;
/// ARC manager (docs/spec.md §2.5).
pub type ArcManager<K> = Manager<K, Arc>;

/// A manager: shared bookkeeping plus a [`Policy`].
pub struct Manager<K, P> {
    cfg: ManagerConfig,
    arena: Arena<K>,
    policy: P,
    /// Next never-used block id.
    next_fresh: u32,
    /// Freed ids, reused last-freed-first.
    freed: Vec<u32>,
    num_present: usize,
    num_pending: usize,
    num_loading: usize,
    num_evictable: usize,
    events: Vec<OffloadingEvent<K>>,
    tracker: Tracker<K>,
    stores_skipped: u64,
    epoch: u32,
    shut_down: bool,
    // Scratch buffers reused across calls.
    scratch_victims: Vec<u32>,
    scratch_nodes: Vec<u32>,
    scratch_cands: Vec<Candidate>,
    /// Positions of the candidates of the `prepare_store` call being processed (duplicate filter).
    scratch_dedup: Index,
}

/// What [`Manager::prepare_store_with`] returns: (stored, block ids, evicted keys).
type StoreParts<T, K> = (Vec<T>, Vec<BlockId>, Vec<K>);

/// Calls of at most this many keys filter duplicates without a hash index.
const SMALL_CALL: usize = 256;

/// A key `prepare_store` will store: its position, hash, and its ghost node or [`NIL`].
#[derive(Clone, Copy, Debug)]
struct Candidate {
    pos: usize,
    hash: u64,
    ghost: u32,
}

impl<K: Hash + Eq + Clone, P: Policy> Manager<K, P> {
    /// A manager with the given settings.
    ///
    /// # Errors
    /// See [`ManagerConfig::validate`].
    pub fn try_new(cfg: ManagerConfig) -> Result<Self> {
        cfg.validate()?;
        // Storage grows with use (amortised doubling), not with the capacity: a 2^24-block
        // manager starts with a few hundred bytes. LRU keeps at most `num_blocks` nodes; ARC
        // also keeps up to `num_blocks` ghosts in each of B1 and B2.
        let max_nodes = cfg.num_blocks.saturating_mul(if P::GHOSTS { 3 } else { 1 });
        Ok(Self {
            arena: Arena::new(max_nodes),
            policy: P::default(),
            next_fresh: 0,
            freed: Vec::new(),
            num_present: 0,
            num_pending: 0,
            num_loading: 0,
            num_evictable: 0,
            events: Vec::new(),
            tracker: Tracker::new(),
            stores_skipped: 0,
            epoch: 1,
            shut_down: false,
            scratch_victims: Vec::new(),
            scratch_nodes: Vec::new(),
            scratch_cands: Vec::new(),
            scratch_dedup: Index::new(),
            cfg,
        })
    }

    /// A manager with the given settings; a capacity that does not fit a block id is clamped to
    /// the largest valid one (use [`Manager::try_new`] to get an error instead).
    #[must_use]
    pub fn new(mut cfg: ManagerConfig) -> Self {
        cfg.num_blocks = cfg.num_blocks.min(NIL as usize - 1);
        match Self::try_new(cfg) {
            Ok(m) => m,
            Err(_) => Self::try_new(ManagerConfig::new(0)).unwrap_or_else(|_| unreachable!()), // allow-panic: 0 is valid
        }
    }

    /// The settings.
    #[must_use]
    pub fn config(&self) -> &ManagerConfig {
        &self.cfg
    }

    /// The policy state (e.g. ARC's target `p`).
    #[must_use]
    pub fn policy(&self) -> &P {
        &self.policy
    }

    fn check_live(&self) -> Result<()> {
        if self.shut_down {
            return Err(KvoffError::state(
                "the manager was shut down; create a new one",
            ));
        }
        Ok(())
    }

    /// The node of a resident (non-ghost) key.
    #[inline]
    fn resident(&self, key: &K) -> Option<u32> {
        self.arena
            .find(key)
            .filter(|&i| self.arena.node(i).list.is_resident())
    }

    /// Presence of the key held by node `i` ([`NIL`]: absent).
    #[inline]
    fn presence_of_node(&self, i: u32) -> Presence {
        if i == NIL {
            return Presence::Absent;
        }
        let n = self.arena.node(i);
        if !n.list.is_resident() {
            Presence::Absent
        } else if n.pending {
            Presence::Pending
        } else {
            Presence::Ready
        }
    }

    /// Nodes of `keys` (resident or ghost, [`NIL`] when absent) into `out`, probed in chunks.
    fn find_all(&self, keys: &[K], out: &mut Vec<u32>) {
        out.clear();
        let mut hashes = [0u64; CHUNK];
        let mut found = [NIL; CHUNK];
        for chunk in keys.chunks(CHUNK) {
            self.arena.find_chunk(chunk, &mut hashes, &mut found);
            out.extend_from_slice(&found[..chunk.len()]);
        }
    }

    /// Epoch of the admission tracker's marks.
    fn next_epoch(&mut self) -> u32 {
        if self.epoch == u32::MAX {
            self.tracker.clear_marks();
            self.epoch = 0;
        }
        self.epoch += 1;
        self.epoch
    }

    fn alloc_id(&mut self) -> u32 {
        if (self.next_fresh as usize) < self.cfg.num_blocks {
            let id = self.next_fresh;
            self.next_fresh += 1;
            id
        } else {
            // Callers check `num_free` first; a fresh-id fallback keeps this total.
            self.freed.pop().unwrap_or(NIL)
        }
    }

    fn num_free(&self) -> usize {
        self.cfg.num_blocks - self.num_present
    }

    fn push_event(&mut self, keys: Vec<K>, removed: bool) {
        if self.cfg.enable_events && !keys.is_empty() {
            self.events.push(OffloadingEvent {
                keys,
                block_size: self.cfg.block_size,
                medium: "CPU",
                removed,
            });
        }
    }

    /// `prepare_store` returning the stored keys as positions in `keys`.
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn prepare_store_indexed(&mut self, keys: &[K]) -> Result<Option<PrepareStoreIndexed<K>>> {
        Ok(self.prepare_store_with(keys, |pos, _| pos)?.map(
            |(positions, block_ids, evicted_keys)| PrepareStoreIndexed {
                positions,
                block_ids,
                evicted_keys,
            },
        ))
    }

    /// The body of `prepare_store`: each stored key is reported as `stored(position, key)`, in
    /// input order, so that `prepare_store` clones the keys while they are at hand instead of
    /// going through a vector of positions. Returns (stored, block ids, evicted keys).
    #[inline]
    fn prepare_store_with<T>(
        &mut self,
        keys: &[K],
        stored: impl Fn(usize, &K) -> T,
    ) -> Result<Option<StoreParts<T, K>>> {
        self.check_live()?;
        if u64::try_from(keys.len()).map_or(true, |n| n > 1 << 32) {
            return Err(KvoffError::arg(
                "prepare_store takes at most 2^32 keys per call",
            ));
        }
        let epoch = self.next_epoch();
        let cap = self.cfg.num_blocks;
        // 1–2: dedup and partition. Present keys are protected (`prot`, cleared before this call
        // returns); absent keys (including ghosts) are candidates, each once.
        let mut cands = std::mem::take(&mut self.scratch_cands);
        let mut protected = std::mem::take(&mut self.scratch_nodes);
        cands.clear();
        protected.clear();
        // Duplicate filter for the candidates: a 1024-bit filter plus an exact scan of the
        // candidates on a hit for small calls, a hash index of positions for large ones.
        let small = keys.len() <= SMALL_CALL;
        let mut filter = [0u64; 16];
        if !small {
            self.scratch_dedup.clear_for(keys.len());
        }
        let mut protected_evictable = 0usize;
        let mut hashes = [0u64; CHUNK];
        let mut found = [NIL; CHUNK];
        for (c, chunk) in keys.chunks(CHUNK).enumerate() {
            self.arena.find_chunk(chunk, &mut hashes, &mut found);
            for (k, key) in chunk.iter().enumerate() {
                let i = found[k];
                if i != NIL && self.arena.node(i).list.is_resident() {
                    let n = self.arena.node_mut(i);
                    if !n.prot {
                        n.prot = true;
                        protected.push(i);
                        if n.is_evictable() {
                            protected_evictable += 1;
                        }
                    }
                } else {
                    let pos = c * CHUNK + k;
                    let h = hashes[k];
                    let dup = if small {
                        // A clear filter bit proves the key new; a set one is checked exactly.
                        let b = (h & 1023) as usize;
                        let (word, bit) = (b >> 6, 1u64 << (b & 63));
                        if filter[word] & bit == 0 {
                            filter[word] |= bit;
                            false
                        } else {
                            cands.iter().any(|c| c.hash == h && keys[c.pos] == *key)
                        }
                    } else {
                        let tag = tag_of(h);
                        let dup = self
                            .scratch_dedup
                            .find(tag, |p| keys[p as usize] == *key)
                            .is_some();
                        if !dup {
                            // pos < 2^32: checked above.
                            self.scratch_dedup
                                .insert(tag, u32::try_from(pos).unwrap_or(u32::MAX));
                        }
                        dup
                    };
                    if !dup {
                        cands.push(Candidate {
                            pos,
                            hash: h,
                            ghost: i,
                        });
                    }
                }
            }
        }
        // 3: admission, decided without mutating.
        let admit_threshold = self.cfg.store_threshold;
        let mut skipped = 0u64;
        if admit_threshold >= 2 {
            let tracker = &self.tracker;
            let before = cands.len();
            cands.retain(|c| tracker.count(&keys[c.pos], c.hash) + 1 >= admit_threshold);
            skipped = (before - cands.len()) as u64;
        }
        // 5: room.
        let need = cands.len().saturating_sub(self.num_free());
        let mut victims = std::mem::take(&mut self.scratch_victims);
        victims.clear();
        let enough = need == 0 || self.num_evictable - protected_evictable >= need;
        if need > 0 && enough {
            self.policy.select_victims(&self.arena, need, &mut victims);
        }
        for &i in &protected {
            self.arena.node_mut(i).prot = false;
        }
        self.scratch_nodes = protected;
        if !enough {
            self.scratch_cands = cands;
            self.scratch_victims = victims;
            return Ok(None);
        }
        // From here on the call succeeds: commit.
        if admit_threshold >= 2 {
            self.commit_offers(keys, epoch);
            self.stores_skipped += skipped;
        }
        for &v in &victims {
            self.freed.push(self.arena.node(v).block_id);
        }
        self.num_present -= victims.len();
        self.num_evictable -= victims.len();
        let mut evicted_keys = Vec::with_capacity(victims.len());
        self.policy
            .on_evicted(&mut self.arena, &victims, cap, &mut evicted_keys);
        self.arena.warm_index_homes(cands.iter().map(|c| c.hash));
        // 6–7: allocate and insert. LRU victims' nodes take the first candidates (there are at
        // least as many candidates as victims), which moves the evicted keys out in order.
        let reuse = if P::GHOSTS { 0 } else { victims.len() };
        let mut reused = 0usize;
        let mut stored_out: Vec<T> = Vec::with_capacity(cands.len());
        let mut block_ids = Vec::with_capacity(cands.len());
        for c in &cands {
            let id = self.alloc_id();
            let key = &keys[c.pos];
            stored_out.push(stored(c.pos, key));
            block_ids.push(id);
            // A ghost found above may have been trimmed by the eviction.
            let ghost = (c.ghost != NIL)
                .then(|| self.arena.node(c.ghost))
                .filter(|n| n.list.is_ghost() && n.key == *key)
                .map(|n| n.list);
            if let Some(g) = ghost {
                let n = self.arena.node_mut(c.ghost);
                n.block_id = id;
                n.pending = true;
                n.loads = 0;
                self.policy
                    .on_insert(&mut self.arena, c.ghost, Some(g), cap);
            } else {
                let tag = tag_of(c.hash);
                let i = if reused < reuse {
                    let v = victims[reused];
                    reused += 1;
                    evicted_keys.push(self.arena.reuse(v, key.clone(), tag, id));
                    v
                } else {
                    self.arena.insert(key.clone(), tag, id)
                };
                self.policy.on_insert(&mut self.arena, i, None, cap);
            }
        }
        // Not reached while only LRU detaches victims (it has no ghosts, so every candidate takes
        // a victim's node); kept so that a detached node can never leak.
        for &v in &victims[reused..reuse] {
            evicted_keys.push(self.arena.node(v).key.clone());
            self.arena.free_detached(v);
        }
        self.num_present += cands.len();
        self.num_pending += cands.len();
        self.scratch_victims = victims;
        self.scratch_cands = cands;
        if self.cfg.enable_events && !evicted_keys.is_empty() {
            self.push_event(evicted_keys.clone(), true);
        }
        Ok(Some((stored_out, block_ids, evicted_keys)))
    }

    fn commit_offers(&mut self, keys: &[K], epoch: u32) {
        for key in keys {
            let h = self.arena.hash_of(key);
            self.tracker.offer(key, h, epoch);
        }
        self.tracker.trim(self.cfg.max_tracker_size, epoch);
    }

    /// Keys of each list from LRU to MRU: `[T1, T2, B1, B2]` for ARC, `[order, [], [], []]` for LRU
    /// (for tests and introspection).
    #[must_use]
    pub fn debug_lists(&self) -> [Vec<K>; 4] {
        [ListTag::T1, ListTag::T2, ListTag::B1, ListTag::B2]
            .map(|t| self.arena.list_keys(t).into_iter().cloned().collect())
    }

    /// Block id of a present key.
    #[must_use]
    pub fn block_id(&self, key: &K) -> Option<BlockId> {
        self.resident(key).map(|i| self.arena.node(i).block_id)
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;

    /// Large calls (more than `SMALL_CALL` keys) filter duplicates through the position index,
    /// small ones through the bit filter: both give what the duplicate-free call gives.
    fn dedup_case<P: Policy>(n_keys: u64) {
        let cfg = ManagerConfig::new(2000);
        let mut a: Manager<u64, P> = Manager::new(cfg.clone());
        let mut b: Manager<u64, P> = Manager::new(cfg);
        for m in [&mut a, &mut b] {
            m.prepare_store(&[3, 5]).unwrap().unwrap();
        }
        // Every key three times, interleaved, plus present keys.
        let with_dups: Vec<u64> = (0..3 * n_keys).map(|i| (i * 7) % n_keys).collect();
        let mut seen = std::collections::HashSet::new();
        let unique: Vec<u64> = with_dups
            .iter()
            .copied()
            .filter(|k| seen.insert(*k))
            .collect();
        let out_a = a.prepare_store_indexed(&with_dups).unwrap().unwrap();
        let out_b = b.prepare_store(&unique).unwrap().unwrap();
        let stored_a: Vec<u64> = out_a.positions.iter().map(|&p| with_dups[p]).collect();
        assert_eq!(stored_a, out_b.keys_to_store);
        assert_eq!(out_a.block_ids, out_b.block_ids);
        assert_eq!(a.len(), b.len());
        assert_eq!(a.debug_lists(), b.debug_lists());
        assert!(!stored_a.contains(&3) && !stored_a.contains(&5));
    }

    #[test]
    fn duplicates_small_and_large_calls() {
        for n in [10, 85, 300, 1000] {
            dedup_case::<Lru>(n);
            dedup_case::<Arc>(n);
        }
    }
}
