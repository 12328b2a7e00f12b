//! The [`Policy`] trait (the policy-specific part of a manager: list placement, victim choice,
//! touch rule) and what a policy works on ([`policy_api`]).
#![forbid(unsafe_code)]

use std::hash::Hash;

use super::arena::{Arena, ListTag};

/// Which keys a serving engine's adapter touches when a request finishes (the vLLM plug-in's
/// `on_request_finished`, exported to Python as `kvoff._native.POLICY_TOUCH_RULES`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TouchRule {
    /// Every key of the request (recency follows use: LRU).
    AllKeys,
    /// Only the keys the request reused (loaded or hit): a key seen once stays in T1 (ARC).
    ReusedOnly,
}

impl TouchRule {
    /// `"all"` or `"reused"` (the Python spelling).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::AllKeys => "all",
            Self::ReusedOnly => "reused",
        }
    }
}

/// What a [`Policy`] works on: the node arena and its lists. Public so that a policy can live
/// outside this module (a test's, a server's); the built-in ones are [`Lru`] and [`Arc`].
pub mod policy_api {
    pub use super::super::arena::{Arena, ListTag, Node};
}

/// The policy-specific part of a manager: list placement and victim choice. A new policy is one
/// module implementing this trait plus one line in the `policies!` list of `any.rs` (docs/design.md,
/// "Recipe: adding an eviction policy").
pub trait Policy: Default {
    /// The policy's name (lower case): `"lru"`, `"arc"`; what `PolicyKind::name` returns.
    const NAME: &'static str;
    /// Which keys the serving adapter touches when a request finishes.
    const TOUCH: TouchRule;
    /// Evicted keys stay as ghosts (ARC); otherwise (LRU) their nodes are detached by
    /// [`Policy::on_evicted`] and reused by the manager for the keys it stores.
    #[doc(hidden)]
    const GHOSTS: bool;
    /// Puts a node just stored (new, or a ghost hit of list `ghost`, still on it) on its list.
    #[doc(hidden)]
    fn on_insert<K: Hash + Eq>(
        &mut self,
        arena: &mut Arena<K>,
        i: u32,
        ghost: Option<ListTag>,
        cap: usize,
    );
    #[doc(hidden)]
    fn on_touch<K: Hash + Eq>(&mut self, arena: &mut Arena<K>, i: u32, cap: usize);
    /// Appends `need` victims (evictable, not protected) to `out` in eviction order without
    /// mutating; the caller has checked that enough exist.
    #[doc(hidden)]
    fn select_victims<K: Hash + Eq>(&self, arena: &Arena<K>, need: usize, out: &mut Vec<u32>);
    /// Removes the victims from the resident lists, already accounted for by the caller: into
    /// ghosts, their keys cloned into `evicted` (ARC), or detached for reuse (LRU, see
    /// [`Policy::GHOSTS`]).
    #[doc(hidden)]
    fn on_evicted<K: Hash + Eq + Clone>(
        &mut self,
        arena: &mut Arena<K>,
        victims: &[u32],
        cap: usize,
        evicted: &mut Vec<K>,
    );
    #[doc(hidden)]
    fn reset(&mut self);
    /// An adaptive target the policy keeps, for introspection (ARC's `p`); `None` by default.
    fn target(&self) -> Option<f64> {
        None
    }
}
