//! An offloading manager with a [`FileTier`] behind it (docs/spec.md §9): the combined tiers behave as one
//! manager of docs/spec.md §2, with these additions.
//!
//! - **Write-through.** When `complete_store(keys, true)` makes a key ready, the key is pinned in the
//!   host manager as a load (`prepare_load`) and a write of its block is queued; the pin is released
//!   (`complete_load`) when the tier no longer reads the block: after the `O_DIRECT` write straight
//!   from 4 KiB-aligned host memory, or, for other memory, as soon as an I/O thread has copied the
//!   block into its own buffer (before the disk write). Write-back on host eviction was not chosen:
//!   the victim's block is handed to the new store in the same `prepare_store` call (docs/spec.md §2.3 is
//!   atomic), so write-back would either delay that call by the write (or a copy) of every victim or
//!   break the atomicity — the same work as write-through, but on the scheduler's critical path at
//!   the moment host memory is short. Write-through also means a block is on
//!   disk before host memory needs its space, and is shared with other engines at once.
//! - **Admission.** With `disk_store_threshold ≥ 2`, a key is written only once it has been stored to
//!   host memory that many times (a bounded counter map, cleared when it holds `max_tracker_size`
//!   keys), sparing the disk one-off blocks.
//! - **Promotion.** `lookup(key)` or `lookup_prefix(keys)` that misses host memory but finds a file
//!   answers "pending" (`Presence::Pending` / `None`) and starts a promotion: `prepare_store` of the
//!   run of consecutive on-disk keys (at most `max_promotions`) reserves host blocks (pending, so
//!   docs/spec.md §2's protection holds: not readable, not evictable), an I/O thread reads and checks each file
//!   into its block, and the next call completes the store (`complete_store(ok)`), which emits the
//!   usual stored event. The key then answers `True` and loads as usual. These lookups therefore have
//!   a side effect, unlike docs/spec.md §2.2's. When host memory has no evictable block, the lookup answers
//!   absent. A failed promotion (file vanished, corrupt) removes the pending key: the next lookup is a miss.
//! - **Completions** are applied at the start of every call (no thread calls the manager), so a
//!   caller that stops calling sees no progress; [`TieredManager::poll`] applies them explicitly.
//! - `reset` and `shutdown` wait for the I/O in flight (they are not scheduler-step operations).
//!
//! Everything on the caller's thread is in-memory bookkeeping; file I/O runs on the tier's threads.
#![forbid(unsafe_code)]

use std::collections::HashMap;

use super::{Completion, FileTier, TierStats};
use crate::error::{KvoffError, Result};
use crate::key::ByteKey;
use crate::manager::{
    BlockId, ManagerStats, OffloadingEvent, OffloadingManager, PrepareStoreOutput, Presence,
};

/// Settings of a [`TieredManager`] beyond its manager and tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TieredConfig {
    /// Write a key to disk only after it was stored to host memory this many times (`< 2`: always).
    pub disk_store_threshold: u32,
    /// Bound of the admission counter map.
    pub max_tracker_size: usize,
    /// Most keys one lookup promotes (the run of on-disk keys after the host hit prefix).
    pub max_promotions: usize,
}

impl Default for TieredConfig {
    fn default() -> Self {
        Self {
            disk_store_threshold: 0,
            max_tracker_size: 64_000,
            max_promotions: 256,
        }
    }
}

/// Counters of the tiered protocol (beyond the tier's own).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TieredCounters {
    /// Lookups (keys) that missed host memory and found a file.
    pub disk_hits: u64,
    /// Promotions started.
    pub promotions_started: u64,
    /// Promotions that failed (file vanished or corrupt): the key was removed again.
    pub promotions_failed: u64,
    /// Disk hits that could not be promoted: no evictable host block (or host admission skipped them).
    pub promotions_no_room: u64,
    /// Writes started (write-through).
    pub writes_started: u64,
    /// Keys not written because of the disk admission threshold.
    pub writes_below_threshold: u64,
}

/// A host manager with a file tier behind it. See the module docs.
#[derive(Debug)]
pub struct TieredManager<M> {
    host: M,
    tier: FileTier,
    cfg: TieredConfig,
    promoting: HashMap<ByteKey, BlockId, foldhash::fast::RandomState>,
    offers: HashMap<ByteKey, u32, foldhash::fast::RandomState>,
    counters: TieredCounters,
}

impl<M: OffloadingManager<ByteKey>> TieredManager<M> {
    /// Puts `tier` behind `host`. The tier's memory must be the host blocks `host` hands out.
    pub fn new(host: M, tier: FileTier, cfg: TieredConfig) -> Self {
        Self {
            host,
            tier,
            cfg,
            promoting: HashMap::default(),
            offers: HashMap::default(),
            counters: TieredCounters::default(),
        }
    }

    /// The host manager.
    pub fn host(&self) -> &M {
        &self.host
    }

    /// The file tier.
    pub fn tier(&self) -> &FileTier {
        &self.tier
    }

    /// Protocol counters.
    pub fn counters(&self) -> &TieredCounters {
        &self.counters
    }

    /// Number of promotions in flight.
    pub fn num_promoting(&self) -> usize {
        self.promoting.len()
    }

    /// Applies finished I/O: releases write pins, completes promotions. Never blocks on I/O.
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn poll(&mut self) -> Result<()> {
        for c in self.tier.poll() {
            match c {
                Completion::Released { key, .. } => {
                    // The key may have been removed meanwhile by `reset`: then there is no pin.
                    if self.host.lookup(&key)? == Presence::Ready {
                        let _ = self.host.complete_load(std::slice::from_ref(&key));
                    }
                }
                Completion::Promoted { key, ok, .. } => {
                    if self.promoting.remove(&key).is_some() {
                        if !ok {
                            self.counters.promotions_failed += 1;
                        }
                        self.host.complete_store(std::slice::from_ref(&key), ok)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn promote(&mut self, keys: &[ByteKey]) -> Result<bool> {
        self.counters.disk_hits += keys.len() as u64;
        let Some(out) = self.host.prepare_store(keys)? else {
            self.counters.promotions_no_room += keys.len() as u64;
            return Ok(false);
        };
        let PrepareStoreOutput {
            keys_to_store,
            block_ids,
            ..
        } = out;
        let mut first = false;
        let mut failed = Vec::new();
        for (k, b) in keys_to_store.into_iter().zip(block_ids) {
            if self.tier.submit_read(&k, b) {
                self.counters.promotions_started += 1;
                first |= k == keys[0];
                self.promoting.insert(k, b);
            } else {
                failed.push(k);
            }
        }
        if !failed.is_empty() {
            self.host.complete_store(&failed, false)?;
        }
        if !first {
            self.counters.promotions_no_room += 1;
        }
        Ok(first)
    }

    /// `Ready`/`Pending` as the host manager says; a host miss that finds a file starts its
    /// promotion and answers `Pending`.
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn lookup(&mut self, key: &ByteKey) -> Result<Presence> {
        self.poll()?;
        match self.host.lookup(key)? {
            Presence::Absent if self.tier.contains(key) => {
                Ok(if self.promote(std::slice::from_ref(key))? {
                    Presence::Pending
                } else {
                    Presence::Absent
                })
            }
            p => Ok(p),
        }
    }

    /// Number of leading keys ready in host memory; `None` if the first non-ready one is pending —
    /// including when it was found on disk and its promotion (with the on-disk keys after it) starts.
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn lookup_prefix(&mut self, keys: &[ByteKey]) -> Result<Option<usize>> {
        self.poll()?;
        let Some(n) = self.host.lookup_prefix(keys)? else {
            return Ok(None);
        };
        if n == keys.len() || !self.tier.contains(&keys[n]) {
            return Ok(Some(n));
        }
        let mut end = n + 1;
        while end < keys.len()
            && end - n < self.cfg.max_promotions.max(1)
            && self.host.lookup(&keys[end])? == Presence::Absent
            && self.tier.contains(&keys[end])
        {
            end += 1;
        }
        Ok(if self.promote(&keys[n..end])? {
            None
        } else {
            Some(n)
        })
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

    /// Refuses a call that names a key the tier is promoting: its host block is still being read
    /// into, and only the tier completes that store (docs/spec.md §9).
    fn check_not_promoting(&self, keys: &[ByteKey], call: &str) -> Result<()> {
        if let Some(k) = keys.iter().find(|k| self.promoting.contains_key(*k)) {
            return Err(KvoffError::state(format!(
                "{call}: key {k:?} is pending because the disk tier is promoting it (not a store \
                 of the caller's); nothing was changed"
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

    fn admitted(&mut self, key: &ByteKey) -> bool {
        if self.cfg.disk_store_threshold < 2 {
            return true;
        }
        if self.offers.len() >= self.cfg.max_tracker_size.max(1) && !self.offers.contains_key(key) {
            self.offers.clear();
        }
        let n = self.offers.entry(key.clone()).or_insert(0);
        *n += 1;
        if *n >= self.cfg.disk_store_threshold {
            self.offers.remove(key);
            true
        } else {
            false
        }
    }

    /// docs/spec.md §2.2 `complete_store`; on success every key that became ready is written through to
    /// the tier (unless it has a file, or is below the disk admission threshold).
    ///
    /// # Errors
    /// After shutdown; [`KvoffError::InvalidState`] (nothing changed) for a key being promoted:
    /// completing it would serve or free a block the tier is still reading into.
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
            for (k, pending) in keys.iter().zip(was_pending) {
                if !pending
                    || self.tier.has_or_writing(k)
                    || self.host.lookup(k)? != Presence::Ready
                {
                    continue;
                }
                if !self.admitted(k) {
                    self.counters.writes_below_threshold += 1;
                    continue;
                }
                let block = self.host.prepare_load(std::slice::from_ref(k))?[0];
                if self.tier.submit_write(k, block) {
                    self.counters.writes_started += 1;
                } else {
                    self.host.complete_load(std::slice::from_ref(k))?;
                }
            }
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

    /// Host gauges, tier counters, protocol counters.
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn get_stats(&mut self) -> Result<(ManagerStats, TierStats, TieredCounters)> {
        self.poll()?;
        Ok((
            self.host.get_stats()?,
            self.tier.stats(),
            self.counters.clone(),
        ))
    }

    /// Waits for the I/O in flight, then forgets every host key (files stay).
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn reset(&mut self) -> Result<()> {
        self.tier.flush();
        self.poll()?;
        self.promoting.clear();
        self.offers.clear();
        self.host.reset()
    }

    /// Waits for the I/O in flight, stops the tier and shuts the host manager down. Idempotent. In
    /// a `fork()`ed child it takes no lock of the tier (a parent thread may have held one at the
    /// fork) and waits for nothing (docs/spec.md §9).
    pub fn shutdown(&mut self) {
        if self.tier.forked() {
            self.tier.shutdown();
            self.promoting.clear();
            self.host.shutdown();
            return;
        }
        self.tier.flush();
        let _ = self.poll();
        self.tier.shutdown();
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
