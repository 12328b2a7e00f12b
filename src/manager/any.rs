//! Choosing a policy at run time: [`PolicyKind`], the closed set of policy names (the one list the
//! bindings, `kvoff.create_manager`, the tiered manager and the vLLM plug-in's settings take them
//! from, as `kvoff._native.POLICIES` and `kvoff._native.POLICY_TOUCH_RULES`), and [`AnyManager`], a
//! manager of any of them behind one type.
//!
//! Adding a policy: implement [`super::Policy`] in its own module (with its tests) and add one line
//! to the `policies!` list below; the names, parsing, error messages, [`AnyManager`] and the Python
//! names follow (docs/design.md, "Recipe: adding an eviction policy").

use std::hash::Hash;

use super::{
    BlockId, Manager, ManagerConfig, ManagerStats, OffloadingEvent, OffloadingManager, Policy,
    PrepareStoreIndexed, PrepareStoreOutput, Presence, TouchRule,
};
use crate::error::Result;

/// Defines [`PolicyKind`] and [`AnyManager`] over the registered policies (`Variant => Type`).
macro_rules! policies {
    ($($(#[$doc:meta])* $variant:ident => $ty:ty,)*) => {
        /// An eviction policy, by name.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum PolicyKind {
            $($(#[$doc])* $variant,)*
        }

        impl PolicyKind {
            /// Every policy, in the order the documentation lists them.
            pub const ALL: [Self; [$(stringify!($variant)),*].len()] = [$(Self::$variant),*];

            /// The policy's name (lower case, as configured): its [`Policy::NAME`].
            #[must_use]
            pub const fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => <$ty as Policy>::NAME,)*
                }
            }

            /// Which keys a serving adapter touches when a request finishes: its
            /// [`Policy::TOUCH`].
            #[must_use]
            pub const fn touch_rule(self) -> TouchRule {
                match self {
                    $(Self::$variant => <$ty as Policy>::TOUCH,)*
                }
            }
        }

        /// A manager of any registered policy.
        pub enum AnyManager<K> {
            $($(#[$doc])* $variant(Manager<K, $ty>),)*
        }

        impl<K: Hash + Eq + Clone> AnyManager<K> {
            /// A manager of policy `kind`.
            ///
            /// # Errors
            /// As [`super::Manager::try_new`].
            pub fn try_new(kind: PolicyKind, cfg: ManagerConfig) -> Result<Self> {
                Ok(match kind {
                    $(PolicyKind::$variant => Self::$variant(Manager::try_new(cfg)?),)*
                })
            }

            /// The policy.
            #[must_use]
            pub const fn kind(&self) -> PolicyKind {
                match self {
                    $(Self::$variant(_) => PolicyKind::$variant,)*
                }
            }
        }

        /// Forwards to the manager of whichever policy.
        macro_rules! each {
            ($m:expr, $v:ident => $e:expr) => {
                match $m {
                    $(AnyManager::$variant($v) => $e,)*
                }
            };
        }
    };
}

policies! {
    /// Least recently used (`"lru"`, docs/spec.md §2.4).
    Lru => super::Lru,
    /// Adaptive replacement cache (`"arc"`, docs/spec.md §2.5).
    Arc => super::Arc,
}

impl PolicyKind {
    /// Parses a name of [`ALL`](Self::ALL), exactly (`"LRU"` is not a policy name).
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`](crate::KvoffError::InvalidArgument) naming the valid choices.
    pub fn parse(s: &str) -> Result<Self> {
        crate::error::parse_name(s, &Self::ALL, Self::name, "eviction policy", |names| {
            let quoted: Vec<String> = names.iter().map(|n| format!("'{n}'")).collect();
            format!("[{}]", quoted.join(", "))
        })
    }
}

impl<K: Hash + Eq + Clone> AnyManager<K> {
    /// The policy's adaptive target ([`Policy::target`]: ARC's `p`; `None` for LRU).
    #[must_use]
    pub fn arc_target(&self) -> Option<f64> {
        each!(self, m => m.policy().target())
    }

    /// As [`super::Manager::prepare_store_indexed`].
    ///
    /// # Errors
    /// As [`super::Manager::prepare_store_indexed`].
    pub fn prepare_store_indexed(&mut self, keys: &[K]) -> Result<Option<PrepareStoreIndexed<K>>> {
        each!(self, m => m.prepare_store_indexed(keys))
    }

    /// As [`super::Manager::debug_lists`].
    #[must_use]
    pub fn debug_lists(&self) -> [Vec<K>; 4] {
        each!(self, m => m.debug_lists())
    }
}

impl<K: Hash + Eq + Clone> OffloadingManager<K> for AnyManager<K> {
    fn lookup(&self, key: &K) -> Result<Presence> {
        each!(self, m => m.lookup(key))
    }
    fn lookup_prefix(&self, keys: &[K]) -> Result<Option<usize>> {
        each!(self, m => m.lookup_prefix(keys))
    }
    fn prepare_load(&mut self, keys: &[K]) -> Result<Vec<BlockId>> {
        each!(self, m => m.prepare_load(keys))
    }
    fn touch(&mut self, keys: &[K]) -> Result<()> {
        each!(self, m => m.touch(keys))
    }
    fn complete_load(&mut self, keys: &[K]) -> Result<()> {
        each!(self, m => m.complete_load(keys))
    }
    fn prepare_store(&mut self, keys: &[K]) -> Result<Option<PrepareStoreOutput<K>>> {
        each!(self, m => m.prepare_store(keys))
    }
    fn complete_store(&mut self, keys: &[K], success: bool) -> Result<()> {
        each!(self, m => m.complete_store(keys, success))
    }
    fn take_events(&mut self) -> Result<Vec<OffloadingEvent<K>>> {
        each!(self, m => m.take_events())
    }
    fn get_stats(&mut self) -> Result<ManagerStats> {
        each!(self, m => m.get_stats())
    }
    fn reset(&mut self) -> Result<()> {
        each!(self, m => m.reset())
    }
    fn shutdown(&mut self) {
        each!(self, m => m.shutdown());
    }
    fn len(&self) -> usize {
        each!(self, m => m.len())
    }
    fn num_blocks(&self) -> usize {
        each!(self, m => m.num_blocks())
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::{AnyManager, PolicyKind};
    use crate::manager::{ManagerConfig, OffloadingManager};

    #[test]
    fn names_parse_exactly() {
        for k in PolicyKind::ALL {
            assert_eq!(PolicyKind::parse(k.name()).unwrap(), k);
        }
        for bad in ["LRU", "Arc", "", "fifo"] {
            let e = PolicyKind::parse(bad).unwrap_err().to_string();
            assert!(e.contains("valid choices: ['lru', 'arc']"), "{e}");
        }
    }

    #[test]
    fn any_manager_serves_either_policy() {
        for k in PolicyKind::ALL {
            let cfg = ManagerConfig::new(4);
            let mut m = AnyManager::<u64>::try_new(k, cfg).unwrap();
            assert_eq!(m.kind(), k);
            assert_eq!(m.arc_target().is_some(), k == PolicyKind::Arc);
            assert_eq!(
                k.touch_rule(),
                if k == PolicyKind::Arc {
                    crate::manager::TouchRule::ReusedOnly
                } else {
                    crate::manager::TouchRule::AllKeys
                }
            );
            let out = m.prepare_store(&[1, 2]).unwrap().unwrap();
            assert_eq!(out.block_ids.len(), 2);
            m.complete_store(&[1, 2], true).unwrap();
            assert_eq!(m.len(), 2);
        }
    }
}
