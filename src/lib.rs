//! # kvoff — KV-cache offloading for LLM inference engines
//!
//! kvoff keeps KV-cache blocks in host memory when GPU memory runs out and moves them between GPU and
//! host at the speed of the link. It follows the design of vLLM's KV offloading (manager/handler split),
//! with its known defects fixed.
//!
//! ```text
//!  scheduler side (no CUDA)                 worker side (bytes)
//!  ┌──────────────────────────┐   specs    ┌────────────────────────────────────────────┐
//!  │ manager: LRU | ARC       │──────────▶│ plan: specs × canonical tensors → CopyPlan │
//!  │ (keys ↔ CPU block ids,   │ block ids  │   (expand: ids → sub-block pointers)       │
//!  │  ref states, events)     │            │ engine: host (memcpy) | cuda (DMA / kernel)│
//!  └──────────────────────────┘            │ region: mmap rows, per-rank slots, pinned  │
//!                                           └────────────────────────────────────────────┘
//! ```
//! The manager never sees pointers; the engine never decides what to evict. The only currency between
//! them is block ids inside load/store specs.
//!
//! | module | job | unsafe? |
//! |---|---|---|
//! | [`error`] | typed errors ([`KvoffError`]) | no |
//! | [`key`] | offload keys: block hash ‖ group index | no |
//! | [`manager`] | LRU and ARC offloading managers (scheduler side) | no |
//! | [`sizing`] | host budget → row stride and number of CPU blocks | no |
//! | [`expand`] | block ids → sub-block ids / pointers | no |
//! | [`plan`] | specs × tensor descriptors → bounds-checked, merged [`plan::CopyPlan`] | no |
//! | [`affinity`] | the CPUs of kvoff's own threads (one process-wide setting) | yes |
//! | [`region`] | host memory: private or shared-by-name mmap, rank slots, prefault, pinning hook | yes |
//! | [`engine`] | transfer engines: job queue, results, host memcpy engine | yes |
//! | [`tier`] | the tiers behind host memory (docs/spec.md §9): files, Redis/Valkey, the tiered manager; one folder per tier | only `tier::memory` (aligned buffers, raw host rows) and `tier::file::io` (libc file calls) |
//! | `engine::cuda` (feature `cuda`, default) | CUDA engine: batched DMA, copy kernel, staged pipeline, calibration | yes |
//!
//! ## Moving bytes
//! A worker describes its tensors once ([`plan::TensorDesc`], [`plan::PlanRef`]) in a
//! [`plan::CopyPlanner`], turns each job's block ids into a validated [`plan::CopyPlan`]
//! (every copy inside its tensor, ids consumed exactly) and submits it to a
//! [`engine::TransferEngine`]: [`engine::HostEngine`] (memcpy on all cores) or, with a GPU,
//! `engine::cuda::CudaEngine`, which picks per job between batched DMA, a gather/scatter copy kernel
//! and a staged kernel + DMA pipeline from a calibration measured on the device. Results come back
//! in submission order from `poll`. `examples/server_loop.rs` wires it all together.
//!
//! ## Safety model
//! Unsafe code lives only in the modules that touch raw memory or FFI (`region`, `engine`, `tier::memory`, `tier::file::io`); every other
//! module is `#![forbid(unsafe_code)]`. Every `unsafe fn` has a numbered `# Safety` list and every
//! `unsafe {}` block a `// SAFETY:` comment naming the obligation it meets. No library code panics on
//! bad input: errors are [`KvoffError`] values, which the Python bindings map to exception classes.
//!
//! ## Example: a manager
//! ```
//! use kvoff::manager::{LruManager, ManagerConfig, OffloadingManager, Presence};
//! let mut m: LruManager<u64> = LruManager::new(ManagerConfig::new(4));
//! let out = m.prepare_store(&[1, 2]).unwrap().expect("room for two blocks");
//! assert_eq!(out.block_ids, vec![0, 1]);
//! m.complete_store(&[1, 2], true).unwrap();
//! assert_eq!(m.lookup(&1).unwrap(), Presence::Ready);
//! assert_eq!(m.lookup_prefix(&[1, 2, 3]).unwrap(), Some(2));
//! ```

pub mod affinity;
pub mod engine;
pub mod error;
pub mod expand;
pub mod handlers;
pub mod key;
pub mod manager;
pub mod plan;
pub mod process;
pub mod region;
pub mod sizing;
pub mod tier;

#[cfg(feature = "python")]
mod python;

pub use error::{KvoffError, Result};

// kvoff addresses memory with 64-bit sizes and offsets throughout; on a 64-bit target every `u64`
// converts to `usize` without loss, which `usize_from` relies on.
#[cfg(not(target_pointer_width = "64"))]
compile_error!("kvoff needs a 64-bit target");

/// `u64` → `usize` without loss (kvoff builds only for 64-bit targets).
#[inline]
#[must_use]
pub(crate) const fn usize_from(v: u64) -> usize {
    #[allow(clippy::cast_possible_truncation)] // 64-bit targets only (see above)
    {
        v as usize
    }
}
