//! The tier recipe (docs/design.md "Recipe: adding a tier"): a tier is its folder under
//! `src/tier/` plus one line in `kvoff::tier::registry::TIERS`. Checked here: every tier folder
//! (a folder that implements `SecondaryTier`) is registered exactly once and registered nowhere
//! else, kinds are unique, and each registered tier reports its registered kind and stats names;
//! and a tier defined outside the crate (`MapTier` below, in memory) runs through the tiered
//! manager with no change to it, as the policy recipe's `Fifo` runs through the generic manager
//! (`tests/manager_policy.rs`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]

use std::any::Any;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kvoff::key::ByteKey;
use kvoff::manager::{BlockId, LruManager, ManagerConfig, OffloadingManager, Presence};
use kvoff::tier::chain::{ChainConfig, ChainManager, ChainTier};
use kvoff::tier::object::{Credentials, ObjectConfig, ObjectTier};
use kvoff::tier::registry::{by_kind, TIERS};
use kvoff::tier::remote::{RemoteConfig, RemoteTier};
use kvoff::tier::secondary::{Known, SecondaryCounters, SecondaryTier, TierInfo};
use kvoff::tier::{BlockMemory, Completion, FileTier, Layout, TierConfig, VecMemory};

fn tier_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/tier")
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}

/// The folders of `src/tier/` that hold a tier: those with an `impl SecondaryTier for`.
fn tier_folders() -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(tier_dir()).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir()
            && rust_files(&p).iter().any(|f| {
                std::fs::read_to_string(f)
                    .unwrap()
                    .contains("impl SecondaryTier for")
            })
        {
            out.push(p.file_name().unwrap().to_string_lossy().into_owned());
        }
    }
    out.sort();
    out
}

#[test]
fn every_tier_folder_is_registered_once() {
    let folders = tier_folders();
    assert!(folders.contains(&"file".to_owned()) && folders.contains(&"remote".to_owned()));
    let mut registered: Vec<String> = TIERS.iter().map(|t| t.folder.to_owned()).collect();
    registered.sort();
    assert_eq!(
        registered, folders,
        "each folder of src/tier/ that implements SecondaryTier is one line of registry::TIERS"
    );
    let mut kinds: Vec<&str> = TIERS.iter().map(|t| t.kind).collect();
    kinds.sort_unstable();
    kinds.dedup();
    assert_eq!(kinds.len(), TIERS.len(), "kinds are unique");
    for t in TIERS {
        assert_eq!(by_kind(t.kind), Some(*t));
    }
    assert_eq!(by_kind("no such tier"), None);

    // Registration is one place: the registry's list is the only code that names a tier's
    // `INFO` from outside the tier's own folder.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for f in rust_files(&src) {
        let text = std::fs::read_to_string(&f).unwrap();
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
        for t in TIERS {
            let own = rel.starts_with(&format!("tier/{}/", t.folder));
            let named = text.contains(&format!("{}::INFO", t.folder));
            if named && !own && rel != "tier/registry.rs" {
                panic!(
                    "{rel} names {}::INFO: read registry::TIERS instead",
                    t.folder
                );
            }
        }
    }
    let registry = std::fs::read_to_string(tier_dir().join("registry.rs")).unwrap();
    for t in TIERS {
        let line = format!("&{}::INFO,", t.folder);
        assert_eq!(
            registry.matches(&line).count(),
            1,
            "{line} once in registry.rs"
        );
    }
}

fn layout(ns: &str) -> Layout {
    Layout {
        namespace: ns.into(),
        world_size: 1,
        ..Layout::default()
    }
}

/// A tier of each registered kind, over `mem`. A new tier adds the way to open it here.
fn open(info: &TierInfo, dir: &Path, mem: Arc<dyn BlockMemory>) -> Box<dyn SecondaryTier> {
    match info.kind {
        "disk" => {
            Box::new(FileTier::open(TierConfig::new(dir, 1 << 20, layout("recipe")), mem).unwrap())
        }
        // Opening does not connect (the first job does): no server needed here.
        "remote" => Box::new(
            RemoteTier::open(
                RemoteConfig::new("redis://127.0.0.1:1", layout("recipe")),
                mem,
            )
            .unwrap(),
        ),
        // Nor does the object tier (its first listing runs in the background).
        "object" => {
            let mut c = ObjectConfig::new("s3://recipe/kv", 1 << 20, layout("recipe"));
            c.endpoint = Some("http://127.0.0.1:1".into());
            c.credentials = Some(Credentials {
                access_key: "recipe".into(),
                secret_key: "recipe".into(),
                token: None,
            });
            Box::new(ObjectTier::open(c, mem).unwrap())
        }
        other => panic!("tests/tier_recipe.rs: open a tier of kind {other:?} here"),
    }
}

#[test]
fn registered_tiers_report_their_kind_and_stats() {
    let dir = std::env::temp_dir().join(format!("kvoff-recipe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for info in TIERS {
        let mem: Arc<dyn BlockMemory> = Arc::new(VecMemory::new(4, 4096));
        let mut tier = open(info, &dir, mem);
        assert_eq!(tier.kind(), info.kind);
        let names: Vec<&str> = tier.extra_stats().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, info.extra_stats, "{} extra_stats", info.kind);
        tier.shutdown();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tier that keeps values in a map, defined outside the crate: writes and reads complete
/// at once (reported by the next `poll`).
#[derive(Debug)]
struct MapTier {
    mem: Arc<VecMemory>,
    values: Arc<Mutex<HashMap<ByteKey, Vec<u8>>>>,
    done: Mutex<Vec<Completion>>,
    counters: Mutex<SecondaryCounters>,
}

const MAP_INFO: TierInfo = TierInfo {
    kind: "map",
    folder: "map",
    extra_stats: &["values"],
};

impl SecondaryTier for MapTier {
    fn kind(&self) -> &'static str {
        MAP_INFO.kind
    }

    fn index(&self, key: &ByteKey) -> Known {
        if self.values.lock().unwrap().contains_key(key) {
            Known::Present
        } else {
            Known::Absent
        }
    }

    fn has_or_writing(&self, key: &ByteKey) -> bool {
        self.index(key) == Known::Present
    }

    fn submit_writes(&self, items: &[(ByteKey, BlockId)]) -> Vec<bool> {
        let mut done = self.done.lock().unwrap();
        let mut c = self.counters.lock().unwrap();
        items
            .iter()
            .map(|(key, block)| {
                let v = self.mem.block(*block).unwrap();
                c.writes += 1;
                c.bytes_written += v.len() as u64;
                self.values.lock().unwrap().insert(key.clone(), v);
                done.push(Completion::Released {
                    key: key.clone(),
                    block: *block,
                });
                true
            })
            .collect()
    }

    fn submit_reads(&self, items: &[(ByteKey, BlockId)]) -> Vec<bool> {
        let mut done = self.done.lock().unwrap();
        let mut c = self.counters.lock().unwrap();
        items
            .iter()
            .map(|(key, block)| {
                let v = self.values.lock().unwrap().get(key).cloned();
                let ok = v.is_some_and(|v| self.mem.set_block(*block, &v).is_ok());
                c.promotions += u64::from(ok);
                done.push(Completion::Promoted {
                    key: key.clone(),
                    block: *block,
                    ok,
                });
                true
            })
            .collect()
    }

    fn poll(&self) -> Vec<Completion> {
        std::mem::take(&mut *self.done.lock().unwrap())
    }

    fn busy(&self) -> bool {
        !self.done.lock().unwrap().is_empty()
    }

    fn flush(&self) {}

    fn shutdown(&mut self) {}

    fn counters(&self) -> SecondaryCounters {
        self.counters.lock().unwrap().clone()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn extra_stats(&self) -> Vec<(&'static str, u64)> {
        let n = self.values.lock().unwrap().len() as u64;
        MAP_INFO.extra_stats.iter().copied().zip([n]).collect()
    }
}

type Chain = ChainManager<LruManager<ByteKey>>;

fn map_chain(values: &Arc<Mutex<HashMap<ByteKey, Vec<u8>>>>) -> (Chain, Arc<VecMemory>) {
    let mem = Arc::new(VecMemory::new(4, 64));
    let tier = MapTier {
        mem: mem.clone(),
        values: values.clone(),
        done: Mutex::new(Vec::new()),
        counters: Mutex::new(SecondaryCounters::default()),
    };
    let m = ChainManager::new(
        LruManager::new(ManagerConfig::new(4)),
        vec![ChainTier::new(Box::new(tier))],
        ChainConfig::default(),
    );
    (m, mem)
}

#[test]
fn a_tier_defined_outside_the_crate_runs_through_the_chain() {
    let values = Arc::new(Mutex::new(HashMap::new()));
    let keys: Vec<ByteKey> = (0u8..6).map(|i| ByteKey::new(&[b'k', i])).collect();
    let bytes = |i: usize| vec![i as u8 + 1; 64];
    {
        // Six blocks through four host blocks: each is written through to the tier when stored.
        let (mut m, mem) = map_chain(&values);
        for (i, k) in keys.iter().enumerate() {
            let out = m.prepare_store(std::slice::from_ref(k)).unwrap().unwrap();
            mem.set_block(out.block_ids[0], &bytes(i)).unwrap();
            m.complete_store(&out.keys_to_store, true).unwrap();
            m.poll().unwrap();
        }
        m.flush();
        m.poll().unwrap();
        let (_, tiers) = m.get_stats().unwrap();
        assert_eq!(tiers.len(), 1);
        m.shutdown();
    }
    assert_eq!(values.lock().unwrap().len(), 6);
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(values.lock().unwrap()[k], bytes(i));
    }

    // Empty host memory: a lookup promotes from the tier, the next one finds the block ready,
    // and a load reads the tier's bytes.
    let (mut m, mem) = map_chain(&values);
    assert_eq!(m.tier("map").map(|t| t.kind()), Some("map"));
    assert_eq!(m.lookup(&keys[2]).unwrap(), Presence::Pending);
    m.poll().unwrap();
    assert_eq!(m.lookup(&keys[2]).unwrap(), Presence::Ready);
    let ids = m.prepare_load(&keys[2..3]).unwrap();
    assert_eq!(mem.block(ids[0]).unwrap(), bytes(2));
    m.complete_load(&keys[2..3]).unwrap();
    assert_eq!(m.host().lookup(&keys[2]).unwrap(), Presence::Ready);
    assert_eq!(
        m.tier_as::<MapTier>().unwrap().extra_stats(),
        vec![("values", 6)]
    );
    m.shutdown();
}
