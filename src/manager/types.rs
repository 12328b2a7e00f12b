//! The manager's settings and the values its calls return (docs/spec.md §2.2).
#![forbid(unsafe_code)]

use super::arena::NIL;
use super::BlockId;
use crate::error::{KvoffError, Result};

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

/// Manager settings (docs/spec.md §2).
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
    /// Defaults of docs/spec.md §2 with the given capacity.
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

/// Result of a successful `prepare_store` (docs/spec.md §2.3 step 8).
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

/// A change of the set of ready blocks (docs/spec.md §2.2 `take_events`).
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

/// Gauges and counters (docs/spec.md §2.2 `get_stats`).
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
