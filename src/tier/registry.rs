//! The one list of tiers (docs/design.md "Recipe: adding a tier"): each tier's registration
//! ([`TierInfo`]: its kind, folder and the names of its own stats), one line per tier. The
//! bindings and tools that enumerate tiers read this list; `tests/tier_recipe.rs` checks that
//! every tier folder is in it exactly once.
#![forbid(unsafe_code)]

use super::secondary::TierInfo;
use super::{file, object, remote};

/// Every tier, in the order of a chain (host memory → files → remote → object).
pub const TIERS: &[&TierInfo] = &[
    &file::INFO,   // src/tier/file/
    &remote::INFO, // src/tier/remote/
    &object::INFO, // src/tier/object/
];

/// The registered tier of kind `kind` (`"disk"`, `"remote"`, `"object"`).
#[must_use]
pub fn by_kind(kind: &str) -> Option<&'static TierInfo> {
    TIERS.iter().copied().find(|t| t.kind == kind)
}
