//! [`Manager`]'s calls of the offloading protocol (docs/spec.md §2): the [`OffloadingManager`]
//! impl — lookups, loads, stores with admission and atomic eviction, events, stats — over the
//! state, arena and policy hooks of the parent module.
#![forbid(unsafe_code)]

use std::hash::Hash;

use super::arena::{CHUNK, NIL};
use super::{
    BlockId, Manager, ManagerStats, OffloadingEvent, OffloadingManager, Policy, PrepareStoreOutput,
    Presence,
};
use crate::error::{KvoffError, Result};

impl<K: Hash + Eq + Clone, P: Policy> OffloadingManager<K> for Manager<K, P> {
    fn lookup(&self, key: &K) -> Result<Presence> {
        self.check_live()?;
        Ok(self.presence_of_node(self.arena.find(key).unwrap_or(NIL)))
    }

    fn lookup_prefix(&self, keys: &[K]) -> Result<Option<usize>> {
        self.check_live()?;
        let mut hashes = [0u64; CHUNK];
        let mut found = [NIL; CHUNK];
        for (c, chunk) in keys.chunks(CHUNK).enumerate() {
            self.arena.find_chunk(chunk, &mut hashes, &mut found);
            for (k, &i) in found[..chunk.len()].iter().enumerate() {
                match self.presence_of_node(i) {
                    Presence::Ready => {}
                    Presence::Pending => return Ok(None),
                    Presence::Absent => return Ok(Some(c * CHUNK + k)),
                }
            }
        }
        Ok(Some(keys.len()))
    }

    fn prepare_load(&mut self, keys: &[K]) -> Result<Vec<BlockId>> {
        self.check_live()?;
        let mut nodes = std::mem::take(&mut self.scratch_nodes);
        self.find_all(keys, &mut nodes);
        for (pos, &i) in nodes.iter().enumerate() {
            let what = match self.presence_of_node(i) {
                Presence::Ready => continue,
                Presence::Pending => "pending (store in flight)",
                Presence::Absent => "not present",
            };
            self.scratch_nodes = nodes;
            return Err(KvoffError::state(format!(
                "prepare_load: key #{pos} is {what}; only ready keys can be loaded"
            )));
        }
        let mut ids = Vec::with_capacity(nodes.len());
        for &i in &nodes {
            let n = self.arena.node_mut(i);
            if n.loads == 0 {
                self.num_loading += 1;
                self.num_evictable -= 1;
            }
            n.loads += 1;
            ids.push(n.block_id);
        }
        self.scratch_nodes = nodes;
        Ok(ids)
    }

    fn touch(&mut self, keys: &[K]) -> Result<()> {
        self.check_live()?;
        let cap = self.cfg.num_blocks;
        let mut hashes = [0u64; CHUNK];
        let mut found = [NIL; CHUNK];
        // Last key first: chunks from the end, each in reverse. Touches never change the index,
        // so probing a chunk before applying the later ones finds the same nodes.
        let mut end = keys.len();
        while end > 0 {
            let start = end.saturating_sub(CHUNK);
            let chunk = &keys[start..end];
            self.arena.find_chunk(chunk, &mut hashes, &mut found);
            let found = &found[..chunk.len()];
            self.arena.warm_stamps(found);
            for &i in found.iter().rev() {
                if i != NIL {
                    self.policy.on_touch(&mut self.arena, i, cap);
                }
            }
            end = start;
        }
        Ok(())
    }

    fn complete_load(&mut self, keys: &[K]) -> Result<()> {
        self.check_live()?;
        let mut nodes = std::mem::take(&mut self.scratch_nodes);
        self.find_all(keys, &mut nodes);
        let mut unpinned = 0usize;
        for (pos, &i) in nodes.iter().enumerate() {
            if i != NIL && self.arena.node(i).list.is_resident() && self.arena.node(i).loads > 0 {
                let n = self.arena.node_mut(i);
                n.loads -= 1;
                if n.loads == 0 {
                    unpinned += 1;
                }
            } else {
                // Roll back the decrements made so far: nothing changes on error.
                for &j in &nodes[..pos] {
                    self.arena.node_mut(j).loads += 1;
                }
                self.scratch_nodes = nodes;
                return Err(KvoffError::state(format!(
                    "complete_load: key #{pos} has no load in flight"
                )));
            }
        }
        self.scratch_nodes = nodes;
        // A node reaches 0 loads at most once per call, so `unpinned` counts distinct keys.
        self.num_loading -= unpinned;
        self.num_evictable += unpinned;
        Ok(())
    }

    fn prepare_store(&mut self, keys: &[K]) -> Result<Option<PrepareStoreOutput<K>>> {
        Ok(self.prepare_store_with(keys, |_, key| key.clone())?.map(
            |(keys_to_store, block_ids, evicted_keys)| PrepareStoreOutput {
                keys_to_store,
                block_ids,
                evicted_keys,
            },
        ))
    }

    fn complete_store(&mut self, keys: &[K], success: bool) -> Result<()> {
        self.check_live()?;
        let mut nodes = std::mem::take(&mut self.scratch_nodes);
        self.find_all(keys, &mut nodes);
        if success {
            let mut stored = Vec::new();
            for (k, &i) in nodes.iter().enumerate() {
                if self.presence_of_node(i) == Presence::Pending {
                    self.arena.node_mut(i).pending = false;
                    self.num_pending -= 1;
                    self.num_evictable += 1;
                    if self.cfg.enable_events {
                        stored.push(keys[k].clone());
                    }
                }
            }
            self.push_event(stored, false);
        } else {
            // A key listed twice finds its node freed (list Free) the second time: ignored.
            for &i in &nodes {
                if self.presence_of_node(i) == Presence::Pending {
                    self.freed.push(self.arena.node(i).block_id);
                    self.arena.remove(i);
                    self.num_pending -= 1;
                    self.num_present -= 1;
                }
            }
        }
        self.scratch_nodes = nodes;
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
        self.arena.clear();
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
            self.arena.clear();
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
