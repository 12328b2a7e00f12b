//! One interface for the tiers behind host memory (docs/tier.md "Secondary tiers"): every tier —
//! each a folder of `src/tier/`, none named here — implements [`SecondaryTier`] and registers a
//! [`TierInfo`], so a new tier is its folder plus one registration (docs/design.md "Recipe: adding
//! a tier") and the tiered manager (`chain::ChainManager`) needs no change.
//!
//! **The contract.** Every method is called on the owner's thread (the engine's scheduler) and
//! must return without waiting for I/O — no disk access, no network round trip, no lock held by
//! an I/O thread across I/O. The tier does its work on its own threads and reports finished jobs
//! through [`SecondaryTier::poll`], which the owner calls at the start of each of its calls.
//!
//! - **Index.** [`SecondaryTier::index`] answers from memory: [`Known::Present`],
//!   [`Known::Absent`] or, for a tier whose index lives elsewhere (a remote store),
//!   [`Known::Unknown`]. The owner then asks [`SecondaryTier::submit_fetch`] for a batch of keys
//!   (one round trip for the keys of a prefix); while the answers are on their way the index says
//!   [`Known::Pending`] (a scheduler asking every step starts nothing more), and when they arrive
//!   `Present` or `Absent` (a tier may remember misses for a while and forget hits it cannot
//!   keep).
//! - **Writes** ([`SecondaryTier::submit_writes`]): a batch of `(key, host block)`; the tier copies
//!   each block's bytes out of its [`super::BlockMemory`] on an I/O thread. The owner keeps the
//!   block unchanged (pinned) until [`Completion::Released`] for it comes out of `poll`. A write
//!   the tier cannot queue (full queue, bounded bytes in flight, shut down) is refused at once
//!   (`false`) and counted in [`SecondaryCounters::writes_dropped`] when it was a drop.
//! - **Reads** ([`SecondaryTier::submit_reads`]): a batch of `(key, host block)` for keys whose
//!   index says `Present`; the block is a pending store the owner reserved. The bytes are valid
//!   once [`Completion::Promoted`] with `ok` arrives; a value that fails its checks (header,
//!   layout fingerprint, key, length, checksum) is never copied into the block, is counted in
//!   [`SecondaryCounters::rejected`] and ends as `ok == false`.
//! - **Counters** ([`SecondaryTier::counters`]): the same fields for every tier, so metrics are
//!   exported per tier with one code path (`kvoff_disk_*`, `kvoff_remote_*`).
#![forbid(unsafe_code)]

use std::any::Any;

use super::Completion;
use crate::key::ByteKey;
use crate::manager::BlockId;

/// What a tier registers (docs/design.md "Recipe: adding a tier"): a `pub const INFO` in the
/// tier's folder, listed once in `registry::TIERS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierInfo {
    /// The tier's [`SecondaryTier::kind`]: the label of its metrics (`kvoff_<kind>_…`) and of its
    /// group of settings.
    pub kind: &'static str,
    /// Its folder under `src/tier/`.
    pub folder: &'static str,
    /// The names [`SecondaryTier::extra_stats`] reports, in that order.
    pub extra_stats: &'static [&'static str],
}

/// What a tier's in-memory index knows about a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Known {
    /// The tier holds the key: a read may be submitted.
    Present,
    /// The tier does not hold it (or remembers a recent miss).
    Absent,
    /// The tier cannot tell without I/O: submit a fetch, then ask again.
    Unknown,
    /// The tier is finding out (a fetch of the key, or a write of it, is in flight): nothing to
    /// start; ask again later.
    Pending,
}

/// Counters and gauges common to every secondary tier. Counters only grow; per-direction GB/s =
/// bytes / seconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SecondaryCounters {
    /// Values (files, remote keys) written by this instance.
    pub writes: u64,
    /// Payload bytes written.
    pub bytes_written: u64,
    /// Seconds the I/O threads spent writing, summed over threads.
    pub write_seconds: f64,
    /// Writes that failed (I/O error, server error, timeout).
    pub write_errors: u64,
    /// Writes refused because a queue or the in-flight byte bound was full.
    pub writes_dropped: u64,
    /// Reads that reached host memory.
    pub promotions: u64,
    /// Payload bytes promoted.
    pub bytes_read: u64,
    /// Seconds the I/O threads spent reading, summed over threads.
    pub read_seconds: f64,
    /// Reads that failed (value vanished, I/O error, timeout).
    pub read_errors: u64,
    /// Values rejected by a header, layout, key, length or checksum check (and removed if ours).
    pub rejected: u64,
    /// Keys asked for by [`SecondaryTier::submit_fetch`] that were found.
    pub fetch_hits: u64,
    /// Keys asked for by [`SecondaryTier::submit_fetch`] that were not found.
    pub fetch_misses: u64,
    /// Keys whose fetch failed (server or node unreachable, timeout, error reply) or was skipped
    /// while it was down: remembered as absent for a while, never as present.
    pub fetch_errors: u64,
    /// Recoveries of a remote store (of each of its nodes) after a failure.
    pub reconnects: u64,
    /// Reads queued or running.
    pub queued_reads: u64,
    /// Writes queued or running.
    pub queued_writes: u64,
    /// The last error, for diagnosis (never contains a password).
    pub last_error: Option<String>,
}

/// A tier behind host memory. See the module docs for the contract (no method waits for I/O).
pub trait SecondaryTier: Send + std::fmt::Debug + 'static {
    /// A short name for metrics and logs (`"disk"`, `"remote"`).
    fn kind(&self) -> &'static str;

    /// What the in-memory index knows about `key` (no I/O).
    fn index(&self, key: &ByteKey) -> Known;

    /// Asks the tier to find out whether it holds `keys` (one batch, in the background). Returns
    /// the number of keys it started to look up (0 when none needed it, the tier does not do
    /// fetches, or it is busy or down). The default does nothing: the index is always known.
    fn submit_fetch(&self, keys: &[ByteKey]) -> usize {
        let _ = keys;
        0
    }

    /// About how many more keys a fetch could take now (room to keep their values); readahead
    /// stops there and comes back to the rest on a later lookup. The default: no bound.
    fn fetch_room(&self) -> usize {
        usize::MAX
    }

    /// Whether reads may start now: `false` while the tier refuses every read (its store is down
    /// for a backoff, it is shut down or in a `fork()`ed child). The chain then starts no
    /// promotion from it — none that would take host blocks (evicting others) only to give them
    /// back. The default: always.
    fn read_ready(&self) -> bool {
        true
    }

    /// The most keys one fetch of this tier should take ([`SecondaryTier::submit_fetch`] from
    /// the chain's consultation of an unknown key): where each key costs a request of its own,
    /// 1 — the rest of a prefix the tier holds is then read by readahead once the first key is
    /// found ([`SecondaryTier::may_read_unknown`]), and a prefix the tier does not hold costs one
    /// request, not one per key (docs/tier.md "Tier chain"). The default: no bound (the chain's
    /// `max_fetch_keys`).
    fn fetch_batch_max(&self) -> usize {
        usize::MAX
    }

    /// Whether a read of `key`, which the index does not know ([`Known::Unknown`], no fetch or
    /// write of it in flight), may be submitted ([`SecondaryTier::submit_reads`]) with no fetch
    /// before: the read itself finds out, a missing value failing its promotion (then
    /// remembered as absent, like a fetch's miss). The chain reads the rest of a prefix the tier
    /// is seen to hold this way, straight into host blocks (docs/tier.md "Tier chain",
    /// readahead). The default: never.
    fn may_read_unknown(&self, key: &ByteKey) -> bool {
        let _ = key;
        false
    }

    /// Whether the tier holds `key` or is writing it (the owner then does not write it again).
    fn has_or_writing(&self, key: &ByteKey) -> bool;

    /// Queues writes of host blocks; one flag per item, `true` when queued (then the block stays
    /// pinned until its [`Completion::Released`]).
    fn submit_writes(&self, items: &[(ByteKey, BlockId)]) -> Vec<bool>;

    /// Queues reads into pending host blocks; one flag per item, `true` when queued (a
    /// [`Completion::Promoted`] follows).
    fn submit_reads(&self, items: &[(ByteKey, BlockId)]) -> Vec<bool>;

    /// Takes the finished jobs.
    fn poll(&self) -> Vec<Completion>;

    /// Whether jobs are queued, running or not yet polled.
    fn busy(&self) -> bool;

    /// Blocks until the queued jobs have run (tests, tools, shutdown — never a scheduler step).
    fn flush(&self);

    /// Finishes or abandons the queued jobs (a remote tier gives up after its timeouts) and stops
    /// the I/O threads. Idempotent.
    fn shutdown(&mut self);

    /// Counters and gauges.
    fn counters(&self) -> SecondaryCounters;

    /// Whether this is a `fork()`ed copy of the tier (its I/O threads exist only in the parent):
    /// then [`SecondaryTier::shutdown`] must take no lock and wait for nothing. The default: never.
    fn forked(&self) -> bool {
        false
    }

    /// The tier as [`Any`], so an owner can reach a tier's own methods
    /// (`ChainManager::tier_as`).
    fn as_any(&self) -> &dyn Any;

    /// Tier-specific gauges and counters beyond [`SecondaryCounters`], as `(name, value)` (the
    /// metrics prefix them with [`SecondaryTier::kind`]). The default has none.
    fn extra_stats(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}
