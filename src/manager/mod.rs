//! Offloading managers (scheduler side, SPEC §2): which blocks live on the host and what to evict.
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
//! `ARCOffloadingManager`). Entries live in an index-linked slab (no raw pointers); every operation is
//! O(1) per key, except that eviction walks past pinned (pending/loading) or protected entries, whose
//! number is bounded by the work in flight.
//!
//! Invariants kept after every call (checked by the property tests in `tests/manager_props.rs`):
//! present ≤ capacity; block ids unique and in range; pending, loading and offered keys never evicted;
//! a call that returns an error or `None` changed nothing; replaying the events reproduces the set of
//! ready keys.
#![forbid(unsafe_code)]

mod arc;
mod lru;
mod slab;
mod tracker;

use std::hash::Hash;

pub use arc::Arc;
pub use lru::Lru;
use slab::{ListTag, Slab, NIL};
use tracker::Tracker;

use crate::error::{KvoffError, Result};

/// A CPU block id.
pub type BlockId = u32;

/// What `lookup` says about a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Presence {
    /// Not present (Python `False`).
    Absent,
    /// Store in flight: retry later (Python `None`).
    Pending,
    /// Ready or loading: can be loaded (Python `True`).
    Ready,
}

/// Manager settings (SPEC §2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManagerConfig {
    /// Capacity in CPU blocks.
    pub num_blocks: usize,
    /// GPU block size reported in events (tokens); not used otherwise.
    pub block_size: usize,
    /// Record events for [`OffloadingManager::take_events`].
    pub enable_events: bool,
    /// Admit a key for storing only once it was offered this many times (`< 2` = admit at once).
    pub store_threshold: usize,
    /// Keys remembered by the admission tracker (LRU-bounded).
    pub max_tracker_size: usize,
}

impl ManagerConfig {
    /// Defaults of SPEC §2 with the given capacity.
    #[must_use]
    pub fn new(num_blocks: usize) -> Self {
        Self {
            num_blocks,
            block_size: 0,
            enable_events: false,
            store_threshold: 0,
            max_tracker_size: 64_000,
        }
    }

    /// Checks ranges.
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] if `num_blocks` does not fit a block id (≥ 2^32 − 1).
    pub fn validate(&self) -> Result<()> {
        if self.num_blocks >= NIL as usize {
            return Err(KvoffError::arg(format!(
                "num_blocks must be < {NIL}, got {}",
                self.num_blocks
            )));
        }
        Ok(())
    }
}

/// Result of a successful `prepare_store` (SPEC §2.3 step 8).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrepareStoreOutput<K> {
    /// Keys to store, in input order (the absent, admitted ones).
    pub keys_to_store: Vec<K>,
    /// Block id of each key of `keys_to_store` (co-indexed): the CPU store spec.
    pub block_ids: Vec<BlockId>,
    /// Keys evicted to make room, in eviction order.
    pub evicted_keys: Vec<K>,
}

/// [`PrepareStoreOutput`] with the stored keys given as positions in the input slice (lets bindings
/// hand back the caller's own key objects without copying).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrepareStoreIndexed<K> {
    /// Positions in the input of the keys to store, ascending.
    pub positions: Vec<usize>,
    /// Block id of each stored key (co-indexed with `positions`).
    pub block_ids: Vec<BlockId>,
    /// Keys evicted to make room, in eviction order.
    pub evicted_keys: Vec<K>,
}

/// A change of the set of ready blocks (SPEC §2.2 `take_events`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadingEvent<K> {
    /// The keys stored or removed.
    pub keys: Vec<K>,
    /// The manager's `block_size`.
    pub block_size: usize,
    /// Always `"CPU"`.
    pub medium: &'static str,
    /// `true` for removals (evictions), `false` for completed stores.
    pub removed: bool,
}

/// Gauges and counters (SPEC §2.2 `get_stats`).
#[derive(Clone, Debug, PartialEq)]
pub struct ManagerStats {
    /// Blocks pinned by pending stores or loads / `num_blocks` (0 when `num_blocks` is 0).
    pub usage: f64,
    /// Pending blocks / `num_blocks`.
    pub write_usage: f64,
    /// `usage − write_usage`.
    pub read_usage: f64,
    /// Capacity.
    pub num_blocks: usize,
    /// Present keys (pending, ready or loading).
    pub num_present: usize,
    /// Unused block ids.
    pub num_free: usize,
    /// Ready keys not pinned by loads.
    pub num_evictable: usize,
    /// Candidates skipped by admission since the last `get_stats`.
    pub stores_skipped: u64,
}

/// The manager protocol of SPEC §2.2, generic over the key type.
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
    /// SPEC §2.3: admission, atomic eviction, allocation. `None` = not enough evictable blocks
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

/// The policy-specific part of a manager: list placement and victim choice.
pub trait Policy: Default {
    /// `"lru"` or `"arc"`.
    const NAME: &'static str;
    #[doc(hidden)]
    fn on_insert<K: Hash + Eq>(
        &mut self,
        slab: &mut Slab<K>,
        i: u32,
        ghost: Option<ListTag>,
        cap: usize,
    );
    #[doc(hidden)]
    fn on_touch<K: Hash + Eq>(&mut self, slab: &mut Slab<K>, i: u32, cap: usize);
    /// Appends `need` victims (evictable, mark ≠ `epoch`) to `out` in eviction order without
    /// mutating; the caller has checked that enough exist.
    #[doc(hidden)]
    fn select_victims<K: Hash + Eq>(
        &self,
        slab: &Slab<K>,
        need: usize,
        epoch: u32,
        out: &mut Vec<u32>,
    );
    /// Removes (or turns into ghosts) the victims, already accounted for by the caller, and
    /// appends their keys to `evicted` in victim order (moved out where the node goes away).
    #[doc(hidden)]
    fn on_evicted<K: Hash + Eq + Clone>(
        &mut self,
        slab: &mut Slab<K>,
        victims: &[u32],
        cap: usize,
        evicted: &mut Vec<K>,
    );
    #[doc(hidden)]
    fn reset(&mut self);
}

/// LRU manager (SPEC §2.4).
pub type LruManager<K> = Manager<K, Lru>;
/// ARC manager (SPEC §2.5).
pub type ArcManager<K> = Manager<K, Arc>;

/// A manager: shared bookkeeping plus a [`Policy`].
pub struct Manager<K, P> {
    cfg: ManagerConfig,
    slab: Slab<K>,
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
    scratch_hashes: Vec<u64>,
    scratch_dedup: hashbrown::HashTable<u32>,
}

impl<K: Hash + Eq + Clone, P: Policy> Manager<K, P> {
    /// A manager with the given settings.
    ///
    /// # Errors
    /// See [`ManagerConfig::validate`].
    pub fn try_new(cfg: ManagerConfig) -> Result<Self> {
        cfg.validate()?;
        let cap = cfg.num_blocks;
        Ok(Self {
            slab: Slab::with_capacity(cap.min(1 << 20)),
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
            scratch_hashes: Vec::new(),
            scratch_dedup: hashbrown::HashTable::new(),
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
        self.slab
            .find(key)
            .filter(|&i| !self.slab.node(i).list.is_ghost())
    }

    fn presence_of(&self, key: &K) -> Presence {
        match self.resident(key) {
            None => Presence::Absent,
            Some(i) if self.slab.node(i).pending => Presence::Pending,
            Some(_) => Presence::Ready,
        }
    }

    fn next_epoch(&mut self) -> u32 {
        if self.epoch == u32::MAX {
            self.slab.for_each_node_mut(|n| n.mark = 0);
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
        self.check_live()?;
        let epoch = self.next_epoch();
        // 1–2: dedup and partition. Present keys are marked (protected); absent keys (including
        // ghosts) are candidates, each once.
        // (position, was a ghost): only ghosts need a second lookup at insertion, since eviction
        // may trim them; a key absent now stays absent (eviction only touches present keys).
        let mut candidates: Vec<(usize, bool)> = Vec::with_capacity(keys.len());
        let mut protected_evictable = 0usize;
        self.scratch_hashes.clear();
        self.scratch_dedup.clear();
        for (pos, key) in keys.iter().enumerate() {
            let h = self.slab.hash_of(key);
            self.scratch_hashes.push(h);
            let found = self.slab.find_hashed(key, h);
            match found {
                Some(i) if !self.slab.node(i).list.is_ghost() => {
                    let n = self.slab.node_mut(i);
                    if n.mark != epoch {
                        n.mark = epoch;
                        if n.is_evictable() {
                            protected_evictable += 1;
                        }
                    }
                }
                _ => {
                    let hashes = &self.scratch_hashes;
                    let dup = self
                        .scratch_dedup
                        .find(h, |&p| hashes[p as usize] == h && keys[p as usize] == *key)
                        .is_some();
                    if !dup {
                        let p = u32::try_from(pos).map_err(|_| {
                            KvoffError::arg("prepare_store takes at most 2^32 keys per call")
                        })?;
                        self.scratch_dedup
                            .insert_unique(h, p, |&q| hashes[q as usize]);
                        candidates.push((pos, found.is_some()));
                    }
                }
            }
        }
        // 3: admission, decided without mutating.
        let admit_threshold = self.cfg.store_threshold;
        let mut skipped = 0u64;
        if admit_threshold >= 2 {
            let tracker = &self.tracker;
            let before = candidates.len();
            candidates.retain(|&(pos, _)| tracker.count(&keys[pos]) + 1 >= admit_threshold);
            skipped = (before - candidates.len()) as u64;
        }
        // 5: room.
        let need = candidates.len().saturating_sub(self.num_free());
        let mut victims = std::mem::take(&mut self.scratch_victims);
        victims.clear();
        if need > 0 {
            if self.num_evictable - protected_evictable < need {
                self.scratch_victims = victims;
                return Ok(None);
            }
            self.policy
                .select_victims(&self.slab, need, epoch, &mut victims);
        }
        // From here on the call succeeds: commit.
        if admit_threshold >= 2 {
            self.commit_offers(keys, epoch);
            self.stores_skipped += skipped;
        }
        let mut evicted_keys = Vec::with_capacity(victims.len());
        for &v in &victims {
            self.freed.push(self.slab.node(v).block_id);
        }
        self.num_present -= victims.len();
        self.num_evictable -= victims.len();
        self.policy.on_evicted(
            &mut self.slab,
            &victims,
            self.cfg.num_blocks,
            &mut evicted_keys,
        );
        self.scratch_victims = victims;
        if self.cfg.enable_events && !evicted_keys.is_empty() {
            self.push_event(evicted_keys.clone(), true);
        }
        // 6–7: allocate and insert.
        let mut block_ids = Vec::with_capacity(candidates.len());
        for &(pos, was_ghost) in &candidates {
            let id = self.alloc_id();
            block_ids.push(id);
            let key = &keys[pos];
            let h = self.scratch_hashes[pos];
            let ghost = if was_ghost {
                self.slab.find_hashed(key, h)
            } else {
                None
            };
            let (i, ghost_tag) = match ghost {
                Some(i) => {
                    let tag = self.slab.node(i).list;
                    self.slab.unlink(i);
                    let n = self.slab.node_mut(i);
                    n.block_id = id;
                    n.pending = true;
                    n.loads = 0;
                    n.mark = epoch;
                    (i, Some(tag))
                }
                None => {
                    let i = self.slab.insert(key.clone(), h, id);
                    self.slab.node_mut(i).mark = epoch;
                    (i, None)
                }
            };
            self.policy
                .on_insert(&mut self.slab, i, ghost_tag, self.cfg.num_blocks);
            self.num_present += 1;
            self.num_pending += 1;
        }
        Ok(Some(PrepareStoreIndexed {
            positions: candidates.iter().map(|&(pos, _)| pos).collect(),
            block_ids,
            evicted_keys,
        }))
    }

    fn commit_offers(&mut self, keys: &[K], epoch: u32) {
        for (pos, key) in keys.iter().enumerate() {
            self.tracker.offer(key, self.scratch_hashes[pos], epoch);
        }
        self.tracker.trim(self.cfg.max_tracker_size, epoch);
    }

    /// Keys of each list from LRU to MRU: `[T1, T2, B1, B2]` for ARC, `[order, [], [], []]` for LRU
    /// (for tests and introspection).
    #[must_use]
    pub fn debug_lists(&self) -> [Vec<K>; 4] {
        [ListTag::T1, ListTag::T2, ListTag::B1, ListTag::B2]
            .map(|t| self.slab.list_keys(t).into_iter().cloned().collect())
    }

    /// Block id of a present key.
    #[must_use]
    pub fn block_id(&self, key: &K) -> Option<BlockId> {
        self.resident(key).map(|i| self.slab.node(i).block_id)
    }
}

impl<K: Hash + Eq + Clone, P: Policy> OffloadingManager<K> for Manager<K, P> {
    fn lookup(&self, key: &K) -> Result<Presence> {
        self.check_live()?;
        Ok(self.presence_of(key))
    }

    fn lookup_prefix(&self, keys: &[K]) -> Result<Option<usize>> {
        self.check_live()?;
        for (n, key) in keys.iter().enumerate() {
            match self.presence_of(key) {
                Presence::Ready => {}
                Presence::Pending => return Ok(None),
                Presence::Absent => return Ok(Some(n)),
            }
        }
        Ok(Some(keys.len()))
    }

    fn prepare_load(&mut self, keys: &[K]) -> Result<Vec<BlockId>> {
        self.check_live()?;
        let mut nodes = Vec::with_capacity(keys.len());
        for (pos, key) in keys.iter().enumerate() {
            match self.resident(key) {
                Some(i) if !self.slab.node(i).pending => nodes.push(i),
                other => {
                    let what = if other.is_some() {
                        "pending (store in flight)"
                    } else {
                        "not present"
                    };
                    return Err(KvoffError::state(format!(
                        "prepare_load: key #{pos} is {what}; only ready keys can be loaded"
                    )));
                }
            }
        }
        let mut ids = Vec::with_capacity(nodes.len());
        for &i in &nodes {
            let n = self.slab.node_mut(i);
            if n.loads == 0 {
                self.num_loading += 1;
                self.num_evictable -= 1;
            }
            n.loads += 1;
            ids.push(n.block_id);
        }
        Ok(ids)
    }

    fn touch(&mut self, keys: &[K]) -> Result<()> {
        self.check_live()?;
        for key in keys.iter().rev() {
            if let Some(i) = self.slab.find(key) {
                self.policy.on_touch(&mut self.slab, i, self.cfg.num_blocks);
            }
        }
        Ok(())
    }

    fn complete_load(&mut self, keys: &[K]) -> Result<()> {
        self.check_live()?;
        let mut done: Vec<u32> = Vec::with_capacity(keys.len());
        let mut unpinned = 0usize;
        for (pos, key) in keys.iter().enumerate() {
            match self.resident(key) {
                Some(i) if self.slab.node(i).loads > 0 => {
                    let n = self.slab.node_mut(i);
                    n.loads -= 1;
                    if n.loads == 0 {
                        unpinned += 1;
                    }
                    done.push(i);
                }
                _ => {
                    // Roll back the decrements made so far: nothing changes on error.
                    for &j in &done {
                        self.slab.node_mut(j).loads += 1;
                    }
                    return Err(KvoffError::state(format!(
                        "complete_load: key #{pos} has no load in flight"
                    )));
                }
            }
        }
        // A node reaches 0 loads at most once per call, so `unpinned` counts distinct keys.
        self.num_loading -= unpinned;
        self.num_evictable += unpinned;
        Ok(())
    }

    fn prepare_store(&mut self, keys: &[K]) -> Result<Option<PrepareStoreOutput<K>>> {
        Ok(self
            .prepare_store_indexed(keys)?
            .map(|out| PrepareStoreOutput {
                keys_to_store: out.positions.iter().map(|&p| keys[p].clone()).collect(),
                block_ids: out.block_ids,
                evicted_keys: out.evicted_keys,
            }))
    }

    fn complete_store(&mut self, keys: &[K], success: bool) -> Result<()> {
        self.check_live()?;
        if success {
            let mut stored = Vec::new();
            for key in keys {
                if let Some(i) = self.resident(key) {
                    let n = self.slab.node_mut(i);
                    if n.pending {
                        n.pending = false;
                        self.num_pending -= 1;
                        self.num_evictable += 1;
                        if self.cfg.enable_events {
                            stored.push(key.clone());
                        }
                    }
                }
            }
            self.push_event(stored, false);
        } else {
            for key in keys {
                if let Some(i) = self.resident(key) {
                    if self.slab.node(i).pending {
                        let n = self.slab.remove(i);
                        self.freed.push(n.block_id);
                        self.num_pending -= 1;
                        self.num_present -= 1;
                    }
                }
            }
        }
        Ok(())
    }

    fn take_events(&mut self) -> Result<Vec<OffloadingEvent<K>>> {
        self.check_live()?;
        Ok(std::mem::take(&mut self.events))
    }

    #[allow(clippy::cast_precision_loss)] // block counts < 2^32 are exact in f64
    fn get_stats(&mut self) -> Result<ManagerStats> {
        self.check_live()?;
        let cap = self.cfg.num_blocks;
        let (write, usage) = if cap == 0 {
            (0.0, 0.0)
        } else {
            (
                self.num_pending as f64 / cap as f64,
                (self.num_pending + self.num_loading) as f64 / cap as f64,
            )
        };
        let skipped = std::mem::take(&mut self.stores_skipped);
        Ok(ManagerStats {
            usage,
            write_usage: write,
            read_usage: usage - write,
            num_blocks: cap,
            num_present: self.num_present,
            num_free: self.num_free(),
            num_evictable: self.num_evictable,
            stores_skipped: skipped,
        })
    }

    fn reset(&mut self) -> Result<()> {
        self.check_live()?;
        self.slab.clear();
        self.policy.reset();
        self.next_fresh = 0;
        self.freed.clear();
        self.num_present = 0;
        self.num_pending = 0;
        self.num_loading = 0;
        self.num_evictable = 0;
        self.tracker.clear();
        self.stores_skipped = 0;
        Ok(())
    }

    fn shutdown(&mut self) {
        if !self.shut_down {
            self.shut_down = true;
            self.slab.clear();
            self.tracker.clear();
            self.freed = Vec::new();
            self.num_present = 0;
        }
    }

    fn len(&self) -> usize {
        self.num_present
    }

    fn num_blocks(&self) -> usize {
        self.cfg.num_blocks
    }
}
