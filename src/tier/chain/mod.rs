//! The tiered manager: an offloading manager with an ordered list of secondary tiers behind host
//! memory (docs/tier.md "Tier chain", docs/spec.md §9): host memory → files (optional) → remote
//! (optional), or any [`SecondaryTier`]s. A file tier alone is a chain of one. The combined tiers
//! behave as one manager of docs/spec.md §2, with these additions.
//!
//! - **Write-through.** When `complete_store(keys, true)` makes a key ready, a write of its block
//!   is queued to every tier that does not hold it and whose admission threshold
//!   ([`ChainTier::store_threshold`]: written once stored to host memory that many times, a bounded
//!   counter map cleared when it holds `max_tracker_size` keys) it passes. Each write pins the host
//!   block (`prepare_load`) until that tier releases it ([`Completion::Released`]: the file tier
//!   releases it after the `O_DIRECT` write straight from 4 KiB-aligned host memory, or, for other
//!   memory, as soon as an I/O thread has copied the block into its own buffer). A tier that
//!   refuses a write (full queue, bounded in-flight bytes, server down) counts it and
//!   `complete_store` goes on: it never waits. Write-back on host eviction was not chosen: the
//!   victim's block is handed to the new store in the same `prepare_store` call (docs/spec.md §2.3
//!   is atomic), so write-back would either delay that call by the write (or a copy) of every
//!   victim or break the atomicity — the same work as write-through, but on the scheduler's
//!   critical path at the moment host memory is short. Write-through also means a block is in the
//!   tiers before host memory needs its space, and is shared with other engines at once.
//! - **Lookup.** `lookup_prefix(keys)` answers from host memory; for the first key that misses, the
//!   tiers are asked in order from their in-memory index ([`SecondaryTier::index`]): the first that
//!   says `Present` promotes the run of following keys it also holds (at most `max_promotions`;
//!   host blocks reserved by `prepare_store` as pending stores, so docs/spec.md §2's protection
//!   holds: not readable, not evictable; filled by its I/O threads) and the answer is `None`
//!   (pending); a tier that answers `Unknown` (a remote store) gets one batched fetch of the key and
//!   the following keys of the prefix ([`SecondaryTier::submit_fetch`]) and the answer is `None`
//!   while it runs; the next lookup sees the answer (found: promote; missed: the next tier,
//!   remembered as a miss for a while). A key no tier holds answers as host memory does; when host
//!   memory has no evictable block, a hit answers absent. These lookups therefore have a side
//!   effect, unlike docs/spec.md §2.2's. Readahead (`readahead`) starts the following keys'
//!   promotions too, reading keys a tier does not know yet straight into host blocks once a tier
//!   is seen to hold the prefix (a missing value there is a miss).
//! - **Promotion** completes on a later call (`complete_store(ok)`, emitting the usual stored
//!   event); the key then answers `True` and loads as usual. A failed promotion (value vanished,
//!   rejected) removes the pending key: the next lookup is a miss. A promoted key is then written
//!   through to the tiers before the one it came from (a block found remote lands in the file tier
//!   too). A key being promoted is not the caller's store: `complete_store` / `complete_load` of it
//!   are refused ([`crate::KvoffError::InvalidState`], nothing changed).
//! - **Completions** are applied at the start of every call (no thread calls the manager), so a
//!   caller that stops calling sees no progress; [`ChainManager::poll`] applies them explicitly.
//!   Nothing here waits for I/O except `reset`/`shutdown` ([`SecondaryTier::flush`]), which are
//!   not scheduler-step operations. In a `fork()`ed child ([`SecondaryTier::forked`]) `shutdown`
//!   takes no lock of the tiers and waits for nothing (docs/spec.md §9).
#![forbid(unsafe_code)]

mod lookup;

use std::collections::{HashMap, HashSet};

use super::secondary::{SecondaryCounters, SecondaryTier};
use super::Completion;
use crate::error::{KvoffError, Result};
use crate::key::ByteKey;
use crate::manager::{
    BlockId, ManagerStats, OffloadingEvent, OffloadingManager, PrepareStoreOutput, Presence,
};

type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
type Set<K> = HashSet<K, foldhash::fast::RandomState>;

/// One tier of the chain and its write admission.
#[derive(Debug)]
pub struct ChainTier {
    /// The tier.
    pub tier: Box<dyn SecondaryTier>,
    /// Write a key to this tier only after it was stored to host memory this many times (`< 2`:
    /// always).
    pub store_threshold: u32,
}

impl ChainTier {
    /// `tier` with no admission threshold.
    #[must_use]
    pub fn new(tier: Box<dyn SecondaryTier>) -> Self {
        Self {
            tier,
            store_threshold: 0,
        }
    }
}

/// Settings of a [`ChainManager`] beyond its manager and tiers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainConfig {
    /// Bound of each tier's admission counter map.
    pub max_tracker_size: usize,
    /// Most keys one lookup promotes.
    pub max_promotions: usize,
    /// Most keys of one fetch (the first missing key and the following keys of the prefix).
    pub max_fetch_keys: usize,
    /// Keys past the first pending one that a lookup keeps the tiers busy with (docs/tier.md
    /// "Tier chain", readahead): promotions of the keys a tier holds and, for the keys no tier
    /// knows yet, reads straight into host blocks (once a tier is seen to hold the prefix) or
    /// fetches start before the caller asks for them (`0`: only the first missing key's batch).
    pub readahead_keys: usize,
}

impl Default for ChainConfig {
    fn default() -> Self {
        Self {
            max_tracker_size: 64_000,
            max_promotions: 256,
            max_fetch_keys: 64,
            readahead_keys: 256,
        }
    }
}

/// Protocol counters of one tier of the chain (beyond the tier's own [`SecondaryCounters`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChainCounters {
    /// Keys that missed host memory (and earlier tiers) and were found in this tier.
    pub hits: u64,
    /// Keys this tier was asked about (index or fetch) and did not hold.
    pub misses: u64,
    /// Fetches started (batches) and keys in them.
    pub fetches: u64,
    /// Keys asked for in fetches.
    pub fetch_keys: u64,
    /// Promotions started.
    pub promotions_started: u64,
    /// Promotions that failed (value vanished, rejected, server gone): the key was removed again.
    pub promotions_failed: u64,
    /// Hits that could not be promoted: no evictable host block.
    pub promotions_no_room: u64,
    /// Writes queued.
    pub writes_started: u64,
    /// Writes refused by the tier (queue or bytes bound full, server down).
    pub writes_refused: u64,
    /// Keys not written because of the admission threshold.
    pub writes_below_threshold: u64,
}

/// Stats of one tier: its kind, its counters and the chain's counters for it.
#[derive(Clone, Debug, PartialEq)]
pub struct ChainTierStats {
    /// [`SecondaryTier::kind`].
    pub kind: &'static str,
    /// The tier's counters.
    pub tier: SecondaryCounters,
    /// The chain's counters for it.
    pub chain: ChainCounters,
}

#[derive(Debug)]
struct Slot {
    tier: Box<dyn SecondaryTier>,
    threshold: u32,
    offers: Map<ByteKey, u32>,
    counters: ChainCounters,
}

/// A host manager with an ordered list of secondary tiers. See the module docs.
#[derive(Debug)]
pub struct ChainManager<M> {
    host: M,
    slots: Vec<Slot>,
    cfg: ChainConfig,
    /// Keys being promoted and the tier they come from.
    promoting: Map<ByteKey, usize>,
    /// Promotions of keys the tier's index did not know ([`SecondaryTier::may_read_unknown`]):
    /// their end is the hit or the miss.
    unknown_reads: Set<ByteKey>,
    /// Keys promoted lately (cleared at `RECENT_MEMORY` entries): a prefix a tier is seen to hold
    /// (`lookup_after`), also once its key's promotion has ended.
    recent: Set<ByteKey>,
    /// Write pins held per key (one per tier write in flight).
    pins: Map<ByteKey, u32>,
    /// Per prefix (by its last key): how far readahead has looked (see `readahead`).
    readahead_seen: Map<ByteKey, usize>,
}

/// Prefixes whose readahead position is remembered before the memory is cleared.
const READAHEAD_MEMORY: usize = 4096;
/// Promoted keys remembered (`ChainManager::lookup_after`) before the memory is cleared.
const RECENT_MEMORY: usize = 16_384;

impl<M: OffloadingManager<ByteKey>> ChainManager<M> {
    /// Puts `tiers` (in lookup order) behind `host`. Every tier's memory must be the host blocks
    /// `host` hands out.
    pub fn new(host: M, tiers: Vec<ChainTier>, cfg: ChainConfig) -> Self {
        Self {
            host,
            slots: tiers
                .into_iter()
                .map(|t| Slot {
                    tier: t.tier,
                    threshold: t.store_threshold,
                    offers: Map::default(),
                    counters: ChainCounters::default(),
                })
                .collect(),
            cfg,
            promoting: Map::default(),
            unknown_reads: Set::default(),
            recent: Set::default(),
            pins: Map::default(),
            readahead_seen: Map::default(),
        }
    }

    /// The host manager.
    pub fn host(&self) -> &M {
        &self.host
    }

    /// The tiers, in lookup order.
    pub fn tiers(&self) -> impl Iterator<Item = &dyn SecondaryTier> {
        self.slots.iter().map(|s| s.tier.as_ref())
    }

    /// The first tier of kind `kind` (`"disk"`, `"remote"`).
    pub fn tier(&self, kind: &str) -> Option<&dyn SecondaryTier> {
        self.tiers().find(|t| t.kind() == kind)
    }

    /// The first tier of type `T` (e.g. [`super::FileTier`], for its own methods).
    pub fn tier_as<T: SecondaryTier>(&self) -> Option<&T> {
        self.tiers().find_map(|t| t.as_any().downcast_ref::<T>())
    }

    /// Whether a tier is a `fork()`ed copy (its I/O threads exist only in the parent).
    pub fn forked(&self) -> bool {
        self.tiers().any(SecondaryTier::forked)
    }

    /// Number of promotions in flight.
    pub fn num_promoting(&self) -> usize {
        self.promoting.len()
    }

    fn unpin(&mut self, key: &ByteKey) -> Result<()> {
        if let Some(n) = self.pins.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                self.pins.remove(key);
            }
            self.host.complete_load(std::slice::from_ref(key))?;
        }
        Ok(())
    }

    /// Applies finished I/O of every tier: releases write pins, completes promotions. Never
    /// blocks on I/O.
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn poll(&mut self) -> Result<()> {
        for t in 0..self.slots.len() {
            for c in self.slots[t].tier.poll() {
                match c {
                    Completion::Released { key, .. } => self.unpin(&key)?,
                    Completion::Promoted { key, ok, .. } => {
                        if self.promoting.remove(&key).is_some() {
                            let c = &mut self.slots[t].counters;
                            match (self.unknown_reads.remove(&key), ok) {
                                (true, true) => c.hits += 1,
                                (true, false) => c.misses += 1,
                                (false, true) => {}
                                (false, false) => c.promotions_failed += 1,
                            }
                            self.host.complete_store(std::slice::from_ref(&key), ok)?;
                            if ok {
                                if self.recent.len() >= RECENT_MEMORY {
                                    self.recent.clear();
                                }
                                self.recent.insert(key.clone());
                            }
                            if ok && t > 0 {
                                self.write_through(std::slice::from_ref(&key), 0..t)?;
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// docs/spec.md §2.2 `prepare_load` (host blocks).
    ///
    /// # Errors
    /// As the host manager's.
    pub fn prepare_load(&mut self, keys: &[ByteKey]) -> Result<Vec<BlockId>> {
        self.poll()?;
        self.host.prepare_load(keys)
    }

    /// docs/spec.md §2.2 `touch`.
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn touch(&mut self, keys: &[ByteKey]) -> Result<()> {
        self.host.touch(keys)
    }

    /// Refuses a call that names a key a tier is promoting: its host block is still being read
    /// into, and only the tier completes that store (docs/spec.md §9).
    fn check_not_promoting(&self, keys: &[ByteKey], call: &str) -> Result<()> {
        if let Some((k, &t)) = keys.iter().find_map(|k| self.promoting.get_key_value(k)) {
            let kind = self.slots.get(t).map_or("secondary", |s| s.tier.kind());
            return Err(KvoffError::state(format!(
                "{call}: key {k:?} is pending because the {kind} tier is promoting it (not a \
                 store of the caller's); nothing was changed"
            )));
        }
        Ok(())
    }

    /// docs/spec.md §2.2 `complete_load`.
    ///
    /// # Errors
    /// As the host manager's; [`KvoffError::InvalidState`] (nothing changed) for a key being
    /// promoted.
    pub fn complete_load(&mut self, keys: &[ByteKey]) -> Result<()> {
        self.check_not_promoting(keys, "complete_load")?;
        self.host.complete_load(keys)?;
        self.poll()
    }

    /// docs/spec.md §2.3 `prepare_store` (host blocks).
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn prepare_store(
        &mut self,
        keys: &[ByteKey],
    ) -> Result<Option<PrepareStoreOutput<ByteKey>>> {
        self.poll()?;
        self.host.prepare_store(keys)
    }

    fn admitted(&mut self, t: usize, key: &ByteKey) -> bool {
        let cap = self.cfg.max_tracker_size.max(1);
        let s = &mut self.slots[t];
        if s.threshold < 2 {
            return true;
        }
        if s.offers.len() >= cap && !s.offers.contains_key(key) {
            s.offers.clear();
        }
        let n = s.offers.entry(key.clone()).or_insert(0);
        *n += 1;
        if *n >= s.threshold {
            s.offers.remove(key);
            true
        } else {
            false
        }
    }

    /// Queues writes of ready `keys` to tiers `range` (each tier one batch).
    fn write_through(&mut self, keys: &[ByteKey], range: std::ops::Range<usize>) -> Result<()> {
        for t in range {
            let mut items = Vec::new();
            for k in keys {
                if self.slots[t].tier.has_or_writing(k) {
                    continue;
                }
                if !self.admitted(t, k) {
                    self.slots[t].counters.writes_below_threshold += 1;
                    continue;
                }
                let block = self.host.prepare_load(std::slice::from_ref(k))?[0];
                *self.pins.entry(k.clone()).or_insert(0) += 1;
                items.push((k.clone(), block));
            }
            if items.is_empty() {
                continue;
            }
            let flags = self.slots[t].tier.submit_writes(&items);
            for ((k, _), ok) in items.iter().zip(flags) {
                if ok {
                    self.slots[t].counters.writes_started += 1;
                } else {
                    self.slots[t].counters.writes_refused += 1;
                    self.unpin(k)?;
                }
            }
        }
        Ok(())
    }

    /// docs/spec.md §2.2 `complete_store`; on success every key that became ready is written
    /// through to the tiers (see the module docs).
    ///
    /// # Errors
    /// After shutdown; [`KvoffError::InvalidState`] (nothing changed) for a key being promoted:
    /// completing it would serve or free a block a tier is still reading into.
    pub fn complete_store(&mut self, keys: &[ByteKey], success: bool) -> Result<()> {
        self.check_not_promoting(keys, "complete_store")?;
        let was_pending: Vec<bool> =
            if success {
                keys.iter()
                    .map(|k| {
                        Ok(self.host.lookup(k)? == Presence::Pending
                            && !self.promoting.contains_key(k))
                    })
                    .collect::<Result<_>>()?
            } else {
                Vec::new()
            };
        self.host.complete_store(keys, success)?;
        if success {
            let mut ready = Vec::new();
            for (k, pending) in keys.iter().zip(was_pending) {
                if pending && self.host.lookup(k)? == Presence::Ready {
                    ready.push(k.clone());
                }
            }
            self.write_through(&ready, 0..self.slots.len())?;
        }
        self.poll()
    }

    /// docs/spec.md §2.2 `take_events` (host events; promotions appear as stores).
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn take_events(&mut self) -> Result<Vec<OffloadingEvent<ByteKey>>> {
        self.poll()?;
        self.host.take_events()
    }

    /// Host gauges and, per tier, its counters and the chain's.
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn get_stats(&mut self) -> Result<(ManagerStats, Vec<ChainTierStats>)> {
        self.poll()?;
        let tiers = self
            .slots
            .iter()
            .map(|s| ChainTierStats {
                kind: s.tier.kind(),
                tier: s.tier.counters(),
                chain: s.counters.clone(),
            })
            .collect();
        Ok((self.host.get_stats()?, tiers))
    }

    /// Waits for every tier's I/O in flight (bounded by their timeouts; not a scheduler-step
    /// operation).
    pub fn flush(&self) {
        for s in &self.slots {
            s.tier.flush();
        }
    }

    /// Waits for the I/O in flight, then forgets every host key (the tiers keep their values).
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn reset(&mut self) -> Result<()> {
        self.flush();
        self.poll()?;
        self.promoting.clear();
        self.unknown_reads.clear();
        self.recent.clear();
        self.pins.clear();
        self.readahead_seen.clear();
        for s in &mut self.slots {
            s.offers.clear();
        }
        self.host.reset()
    }

    /// Waits for the I/O in flight, stops the tiers and shuts the host manager down. Idempotent. In
    /// a `fork()`ed child it takes no lock of the tiers (a parent thread may have held one at the
    /// fork) and waits for nothing (docs/spec.md §9).
    pub fn shutdown(&mut self) {
        if self.forked() {
            for s in &mut self.slots {
                s.tier.shutdown();
            }
            self.promoting.clear();
            self.unknown_reads.clear();
            self.recent.clear();
            self.pins.clear();
            self.host.shutdown();
            return;
        }
        self.flush();
        let _ = self.poll();
        for s in &mut self.slots {
            s.tier.shutdown();
        }
        self.host.shutdown();
    }

    /// Present host keys (pending promotions included).
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// `true` when no host key is present.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// Host capacity in blocks.
    pub fn num_blocks(&self) -> usize {
        self.host.num_blocks()
    }
}
