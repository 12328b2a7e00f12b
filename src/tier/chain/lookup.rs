//! The tiered manager's lookups (docs/tier.md "Tier chain"): host memory first, then the tiers in
//! order from their in-memory indexes; a hit starts promotions of the run of keys the tier holds,
//! an `Unknown` starts one batched fetch, and readahead starts the following keys' promotions.
#![forbid(unsafe_code)]

use super::{ChainManager, READAHEAD_MEMORY};
use crate::error::Result;
use crate::key::ByteKey;
use crate::manager::{BlockId, OffloadingManager, PrepareStoreOutput, Presence};
use crate::tier::secondary::Known;

impl<M: OffloadingManager<ByteKey>> ChainManager<M> {
    /// Promotes `keys` (all held by tier `t`, or, `unknown`, keys it may read without knowing
    /// them: [`SecondaryTier::may_read_unknown`]); `true` when the first one started.
    fn promote(&mut self, t: usize, keys: &[ByteKey], unknown: bool) -> Result<bool> {
        if !self.slots[t].tier.read_ready() {
            // No host block is taken (evicting another) for reads the tier would refuse.
            return Ok(false);
        }
        if !unknown {
            self.slots[t].counters.hits += keys.len() as u64;
        }
        let Some(out) = self.host.prepare_store(keys)? else {
            self.slots[t].counters.promotions_no_room += keys.len() as u64;
            return Ok(false);
        };
        let PrepareStoreOutput {
            keys_to_store,
            block_ids,
            ..
        } = out;
        let items: Vec<(ByteKey, BlockId)> = keys_to_store.into_iter().zip(block_ids).collect();
        let flags = self.slots[t].tier.submit_reads(&items);
        let mut first = false;
        let mut failed = Vec::new();
        for ((k, _), ok) in items.into_iter().zip(flags) {
            if ok {
                self.slots[t].counters.promotions_started += 1;
                first |= k == keys[0];
                if unknown {
                    self.unknown_reads.insert(k.clone());
                }
                self.promoting.insert(k, t);
            } else {
                failed.push(k);
            }
        }
        if !failed.is_empty() {
            self.host.complete_store(&failed, false)?;
        }
        Ok(first)
    }

    /// Readahead (see [`ChainConfig::readahead_keys`]): past `first` (the first key of `keys`
    /// not ready in host memory), starts promotions of the keys a tier holds and, for those the
    /// tiers do not know yet, reads straight into host blocks (once a tier is promoting `first`;
    /// [`SecondaryTier::may_read_unknown`]) or fetches (in-flight promotions bounded by
    /// `max_promotions`), up to `readahead_keys` keys and stopping at a key no tier holds. Each key is looked at once
    /// per prefix: where the last call stopped is remembered by the prefix's last key (block
    /// keys chain their prefix, so it names the whole prefix), so a scheduler that asks every
    /// step pays only for keys not seen before. Never waits.
    fn readahead(&mut self, keys: &[ByteKey], first: usize, covered: usize) -> Result<()> {
        let window = self.cfg.readahead_keys;
        let Some(last) = keys.last() else {
            return Ok(());
        };
        if window == 0 || self.slots.is_empty() {
            return Ok(());
        }
        let end = keys.len().min(first.saturating_add(window));
        let seen = self.readahead_seen.get(last).copied().unwrap_or(0);
        let i = first.saturating_add(covered).max(seen);
        if i >= end {
            if covered > 0 {
                // Where this call's fetch ended is where the next readahead of the prefix starts.
                self.remember_readahead(last, i.min(end));
            }
            return Ok(());
        }
        let batch_max = self.cfg.max_fetch_keys.max(1);
        // Room now: promotions in flight are bounded, and a tier keeps only the fetched values it
        // has room for; readahead stops where either runs out and resumes there on a later call.
        let mut promote_room = self
            .cfg
            .max_promotions
            .max(1)
            .saturating_sub(self.promoting.len());
        let mut fetch_room: Vec<usize> = self.slots.iter().map(|s| s.tier.fetch_room()).collect();
        let mut fetch: Vec<Vec<ByteKey>> = vec![Vec::new(); self.slots.len()];
        // Consecutive keys promoted from one tier, and whether the tier's index did not know them.
        let mut run: Option<(usize, bool, Vec<ByteKey>)> = None;
        let mut stop = end;
        // Whether a tier is promoting the first pending key: the prefix is in the tiers, so the
        // keys after it that a tier does not know yet are read straight into host blocks (no
        // fetch and staged copy before; `SecondaryTier::may_read_unknown`). Until a tier is seen
        // to hold it, readahead stops at such keys rather than reserve host blocks (evicting
        // others) for a prefix that may be nowhere.
        let confirmed = keys
            .get(first)
            .is_some_and(|k| self.promoting.contains_key(k));
        'keys: for (idx, k) in keys.iter().enumerate().take(end).skip(i) {
            if self.host.lookup(k)? != Presence::Absent || self.promoting.contains_key(k) {
                continue; // ready, pending or being promoted
            }
            let mut holder = None;
            let mut unknown = None;
            for t in 0..self.slots.len() {
                match self.slots[t].tier.index(k) {
                    Known::Present => {
                        holder = Some(t);
                        break;
                    }
                    Known::Unknown => {
                        unknown = Some(t);
                        break;
                    }
                    // A fetch of it is on its way: the lookups after it promote it.
                    Known::Pending => continue 'keys,
                    Known::Absent => {}
                }
            }
            let direct = match (holder, unknown) {
                (None, Some(t)) if self.slots[t].tier.may_read_unknown(k) => {
                    if !confirmed {
                        stop = idx; // until a tier is seen to hold the prefix (above)
                        break;
                    }
                    true
                }
                _ => false,
            };
            let out_of_room = match (holder, unknown) {
                (Some(_), _) => promote_room == 0,
                (None, Some(_)) if direct => promote_room == 0,
                (None, Some(t)) => fetch_room[t] == 0,
                (None, None) => false,
            };
            if out_of_room {
                stop = idx;
                break;
            }
            let reader = if direct { unknown } else { holder };
            if run
                .as_ref()
                .is_some_and(|(t, d, _)| Some(*t) != reader || *d != direct)
            {
                if let Some((t, d, ks)) = run.take() {
                    self.promote_ahead(t, &ks, d)?;
                }
            }
            match (holder, unknown) {
                (Some(t), _) => {
                    promote_room -= 1;
                    run.get_or_insert_with(|| (t, false, Vec::new()))
                        .2
                        .push(k.clone());
                }
                (None, Some(t)) if direct => {
                    promote_room -= 1;
                    run.get_or_insert_with(|| (t, true, Vec::new()))
                        .2
                        .push(k.clone());
                }
                (None, Some(t)) => {
                    fetch_room[t] -= 1;
                    fetch[t].push(k.clone());
                    if fetch[t].len() == batch_max {
                        self.fetch_ahead(t, &std::mem::take(&mut fetch[t]));
                    }
                }
                (None, None) => break, // no tier holds it: the prefix ends here
            }
        }
        if let Some((t, d, ks)) = run {
            self.promote_ahead(t, &ks, d)?;
        }
        for (t, ks) in fetch.into_iter().enumerate() {
            if !ks.is_empty() {
                self.fetch_ahead(t, &ks);
            }
        }
        self.remember_readahead(last, stop);
        Ok(())
    }

    /// Remembers where the readahead of the prefix ending in `last` stopped.
    fn remember_readahead(&mut self, last: &ByteKey, stop: usize) {
        if self.readahead_seen.len() >= READAHEAD_MEMORY {
            self.readahead_seen.clear();
        }
        self.readahead_seen.insert(last.clone(), stop);
    }

    fn promote_ahead(&mut self, t: usize, keys: &[ByteKey], unknown: bool) -> Result<()> {
        let room = self
            .cfg
            .max_promotions
            .max(1)
            .saturating_sub(self.promoting.len());
        let n = keys.len().min(room);
        if n > 0 {
            self.promote(t, &keys[..n], unknown)?;
        }
        Ok(())
    }

    fn fetch_ahead(&mut self, t: usize, keys: &[ByteKey]) {
        let n = self.slots[t].tier.submit_fetch(keys);
        if n > 0 {
            self.slots[t].counters.fetches += 1;
            self.slots[t].counters.fetch_keys += n as u64;
        }
    }

    /// The tiers' answer for `keys[0]` (host-absent): `true` pending (promotion or fetch
    /// started), `false` no tier holds it (or it could not be promoted); and how many keys of
    /// `keys` a fetch handed to the first tier covered (0 if none), so that readahead starts
    /// after them.
    fn consult(&mut self, keys: &[ByteKey]) -> Result<(bool, usize)> {
        let first = &keys[0];
        for t in 0..self.slots.len() {
            let mut known = self.slots[t].tier.index(first);
            if known == Known::Unknown {
                // One batched fetch of the key and the following host-absent keys of the prefix.
                let most = self
                    .cfg
                    .max_fetch_keys
                    .min(self.slots[t].tier.fetch_batch_max())
                    .max(1);
                let mut batch = Vec::with_capacity(keys.len().min(most));
                batch.push(first.clone());
                for k in keys.iter().skip(1).take(most - 1) {
                    if self.host.lookup(k)? != Presence::Absent {
                        break;
                    }
                    batch.push(k.clone());
                }
                let n = self.slots[t].tier.submit_fetch(&batch);
                if n > 0 {
                    self.slots[t].counters.fetches += 1;
                    self.slots[t].counters.fetch_keys += n as u64;
                }
                if n == batch.len() {
                    // Each key of the batch is fetching now, the first too: pending. (A tier
                    // further down is asked only for keys the ones before it miss, so only the
                    // first tier's batch moves the readahead; a batch a tier took in part — no
                    // room, or keys it knows — leaves it as it was.)
                    return Ok((true, if t == 0 { n } else { 0 }));
                }
                known = self.slots[t].tier.index(first);
                if known == Known::Unknown {
                    return Ok((true, 0)); // the fetch (this one or one in flight) answers later
                }
            }
            match known {
                // A fetch (or write) of the key is in flight: it answers later. No batch is
                // built, so a scheduler asking every step pays one probe per waiting request.
                Known::Pending => return Ok((true, 0)),
                // The tier holds it but refuses reads now (down): a miss here, the tiers below
                // asked.
                Known::Present if !self.slots[t].tier.read_ready() => {
                    self.slots[t].counters.misses += 1;
                }
                Known::Present => {
                    let mut end = 1;
                    while end < keys.len()
                        && end < self.cfg.max_promotions.max(1)
                        && self.host.lookup(&keys[end])? == Presence::Absent
                        && self.slots[t].tier.index(&keys[end]) == Known::Present
                    {
                        end += 1;
                    }
                    let first = self.promote(t, &keys[..end], false)?;
                    if !first {
                        self.slots[t].counters.promotions_no_room += 1;
                    }
                    return Ok((first, 0));
                }
                Known::Absent | Known::Unknown => self.slots[t].counters.misses += 1,
            }
        }
        Ok((false, 0))
    }

    /// `Ready`/`Pending` as the host manager says; a host miss asks the tiers (see the module
    /// docs) and answers `Pending` while a promotion or fetch runs.
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn lookup(&mut self, key: &ByteKey) -> Result<Presence> {
        self.poll()?;
        match self.host.lookup(key)? {
            Presence::Absent => self.consult_absent(key),
            p => Ok(p),
        }
    }

    /// [`ChainManager::lookup`] of `key` for a caller that looks a prefix up one key at a time,
    /// in order (vLLM's connector does), where `prev` is the key before `key` in the prefix,
    /// looked up just before. What `prev`'s state says decides (docs/tier.md "Tier chain",
    /// keys one at a time):
    /// - `prev` is not in host memory (its own lookup started a fetch, or waits for one):
    ///   `Pending`, and nothing starts for `key` until the tiers have answered for `prev` — a
    ///   prefix the tiers do not hold costs one fetch, not one per key;
    /// - a tier is promoting `prev`, or promoted it lately: it holds the prefix, so a key no tier
    ///   knows yet is read straight into a host block as readahead reads it (no fetch and staged
    ///   copy before; `Pending`), where a tier may ([`SecondaryTier::may_read_unknown`](crate::tier::secondary::SecondaryTier::may_read_unknown)) and
    ///   promotions in flight leave room (else `Pending`, for a later call);
    /// - otherwise (`prev` ready, or being stored by the caller), as [`ChainManager::lookup`].
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn lookup_after(&mut self, key: &ByteKey, prev: &ByteKey) -> Result<Presence> {
        self.poll()?;
        match self.host.lookup(key)? {
            Presence::Absent => {}
            p => return Ok(p),
        }
        if !self.promoting.contains_key(prev) {
            match self.host.lookup(prev)? {
                Presence::Absent => return Ok(Presence::Pending),
                Presence::Ready if self.recent.contains(prev) => {} // promoted: held below
                _ => return self.consult_absent(key),
            }
        }
        for t in 0..self.slots.len() {
            match self.slots[t].tier.index(key) {
                Known::Absent => {}
                Known::Present => break,
                Known::Pending => return Ok(Presence::Pending),
                Known::Unknown => {
                    if !self.slots[t].tier.may_read_unknown(key) {
                        break;
                    }
                    if self.promoting.len() >= self.cfg.max_promotions.max(1) {
                        return Ok(Presence::Pending);
                    }
                    if self.promote(t, std::slice::from_ref(key), true)? {
                        return Ok(Presence::Pending);
                    }
                    break;
                }
            }
        }
        self.consult_absent(key)
    }

    /// [`ChainManager::lookup`]'s answer for a key host memory does not hold (the completions
    /// already applied).
    fn consult_absent(&mut self, key: &ByteKey) -> Result<Presence> {
        Ok(if self.consult(std::slice::from_ref(key))?.0 {
            Presence::Pending
        } else {
            Presence::Absent
        })
    }

    /// Number of leading keys ready in host memory; `None` if the first non-ready one is pending,
    /// is being promoted, or a tier is fetching it.
    ///
    /// # Errors
    /// Only after shutdown.
    pub fn lookup_prefix(&mut self, keys: &[ByteKey]) -> Result<Option<usize>> {
        self.poll()?;
        let mut covered = 0;
        // The host manager's `lookup_prefix`, one key at a time, to know where it stopped.
        let mut n = 0;
        while n < keys.len() {
            match self.host.lookup(&keys[n])? {
                Presence::Ready => n += 1,
                Presence::Pending => break,
                Presence::Absent => {
                    let (pending, fetched) = self.consult(&keys[n..])?;
                    if !pending {
                        return Ok(Some(n));
                    }
                    covered = fetched;
                    break;
                }
            }
        }
        if n == keys.len() {
            return Ok(Some(n));
        }
        // Pending: keep the tiers busy with what follows (readahead), past the keys the
        // consultation's fetch covered (looking at them again would find them fetching).
        self.readahead(keys, n, covered)?;
        Ok(None)
    }
}
