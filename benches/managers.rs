//! Manager throughput (key-ops/s, single thread) for LRU and ARC at 10^4, 10^5 and 10^6 blocks.
//!
//! Keys are real offload keys: a 32-byte block hash ‖ 4-byte group index (`make_offload_key`,
//! 36 bytes) held as `ByteKey` (inline, no allocation), the type the Python bindings use. Every case
//! starts from a full manager (all blocks ready) and passes batches of 64 keys, the way a scheduler
//! step does.
//!
//! **Key-ops** (docs/performance.md): the number of keys passed to the measured calls. Criterion's throughput
//! is set to exactly that per iteration:
//!
//! - `lookup_prefix`: one `lookup_prefix` over 64 present keys (64 key-ops);
//! - `lookup`: 64 single `lookup` calls on present keys (64 key-ops);
//! - `touch`: one `touch` of 64 present keys (64 key-ops);
//! - `prepare_store`: only `prepare_store` of 64 new keys on a full manager, which evicts 64 keys
//!   (64 key-ops); timed per call with `iter_custom`, the `complete_store` of the batch runs
//!   untimed;
//! - `complete_store`: only `complete_store` of the 64 keys just prepared (64 key-ops); the
//!   `prepare_store` runs untimed;
//! - `store`: the whole cycle, `prepare_store` of 64 new keys (64 evictions) + `complete_store` of
//!   them (128 key-ops: 64 keys passed to each call);
//! - `store_indexed`: the same cycle with `prepare_store_indexed` (positions instead of cloned keys,
//!   what the bindings use; 128 key-ops).
//!
//! Present keys are visited in a shuffled order so that hash-table and node accesses are not
//! sequential. Stored keys cycle through a ring of 2·N keys, so each batch is absent (evicted N
//! stores ago) and, for ARC, usually a ghost hit.
//!
//! For comparison, the `*-inline36` cases run the lookup_prefix, touch and store cases with the same
//! 36 bytes held as a plain `[u8; 36]` key, to measure what `ByteKey`'s length tag costs.
//!
//! `baseline/hashmap_get` (64 `get`s on a `std` `HashMap<ByteKey, u32>` with foldhash, same keys and
//! order) calibrates what one unbatched hash-table probe costs on the machine at each size, and
//! `baseline/hashmap_evict` what the bare hash-table work of a store with eviction costs: per new
//! key, `remove_entry` of the oldest key (moved out, as an evicted key is) and `insert` of the new
//! one, on a full map of N keys (64 key-ops per iteration, no recency list, no ids, no checks).
//!
//! Run: `cargo bench --bench managers` (about five minutes; append `-- <filter>` to run a subset,
//! e.g. `-- lru/touch`).
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]

use std::collections::HashMap;
use std::hash::Hash;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use kvoff::key::{make_offload_key, ByteKey};
use kvoff::manager::{Arc, Lru, Manager, ManagerConfig, OffloadingManager, Policy};

type Key = ByteKey;

const BATCH: usize = 64;
const SIZES: [usize; 3] = [10_000, 100_000, 1_000_000];

fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Key `i` held inline.
fn key_inline(i: u64) -> [u8; 36] {
    let mut k = [0u8; 36];
    k.copy_from_slice(key(i).as_bytes());
    k
}

/// Key `i`: a pseudo-random 32-byte hash ‖ group 0.
fn key(i: u64) -> Key {
    let mut s = i.wrapping_mul(0x2545_F491_4F6C_DD1D);
    let mut hash = [0u8; 32];
    for chunk in hash.chunks_exact_mut(8) {
        chunk.copy_from_slice(&splitmix64(&mut s).to_le_bytes());
    }
    ByteKey::new(&make_offload_key(&hash, 0))
}

/// Fisher–Yates with splitmix64.
fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut s = seed;
    for i in (1..v.len()).rev() {
        #[allow(clippy::cast_possible_truncation)] // i < 2^32 here
        let j = (splitmix64(&mut s) % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

/// A full manager of `n` ready blocks holding `ring[..n]`.
fn full_manager<K: Hash + Eq + Clone, P: Policy>(n: usize, ring: &[K]) -> Manager<K, P> {
    let mut m: Manager<K, P> = Manager::new(ManagerConfig::new(n));
    let out = m
        .prepare_store(&ring[..n])
        .expect("live")
        .expect("fits when empty");
    assert_eq!(out.keys_to_store.len(), n);
    m.complete_store(&ring[..n], true).expect("live");
    assert_eq!(m.len(), n);
    m
}

/// Present keys in a shuffled order, cycled through in batches of [`BATCH`].
struct Batches<K> {
    keys: Vec<K>,
    pos: usize,
}

impl<K: Clone> Batches<K> {
    fn new(present: &[K]) -> Self {
        let mut keys = present.to_vec();
        shuffle(&mut keys, 42);
        Self { keys, pos: 0 }
    }

    fn next(&mut self) -> &[K] {
        if self.pos + BATCH > self.keys.len() {
            self.pos = 0;
        }
        let b = &self.keys[self.pos..self.pos + BATCH];
        self.pos += BATCH;
        b
    }
}

/// Ring of new keys for the store cases: after `ring[..n]` were stored, `ring[n..]` are absent and
/// each batch taken in ring order evicts the oldest ones.
struct Ring<'a, K> {
    ring: &'a [K],
    pos: usize,
}

impl<K> Ring<'_, K> {
    fn next(&mut self) -> &[K] {
        if self.pos + BATCH > self.ring.len() {
            self.pos = 0;
        }
        let b = &self.ring[self.pos..self.pos + BATCH];
        self.pos += BATCH;
        b
    }
}

fn bench_policy<K: Hash + Eq + Clone, P: Policy>(
    g: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    n: usize,
    ring: &[K],
    suffix: &str,
) {
    let name = format!("{}{suffix}", P::NAME);
    let full = suffix.is_empty();
    let present = &ring[..n];
    g.throughput(Throughput::Elements(BATCH as u64));

    // Read-only cases share one manager.
    {
        let m: Manager<K, P> = full_manager(n, ring);
        let mut batches = Batches::new(present);
        assert_eq!(m.lookup_prefix(batches.next()).expect("live"), Some(BATCH));
        g.bench_function(format!("{name}/lookup_prefix/{n}"), |b| {
            b.iter(|| black_box(m.lookup_prefix(black_box(batches.next()))));
        });
        if full {
            g.bench_function(format!("{name}/lookup/{n}"), |b| {
                b.iter(|| {
                    for k in batches.next() {
                        black_box(m.lookup(black_box(k)).ok());
                    }
                });
            });
        }
    }
    {
        let mut m: Manager<K, P> = full_manager(n, ring);
        let mut batches = Batches::new(present);
        g.bench_function(format!("{name}/touch/{n}"), |b| {
            b.iter(|| m.touch(black_box(batches.next())).ok());
        });
    }
    {
        let mut m: Manager<K, P> = full_manager(n, ring);
        let mut r = Ring { ring, pos: n };
        // Sanity: each batch is new and evicts a full batch.
        for _ in 0..4 {
            let keys = r.next();
            let out = m.prepare_store(keys).expect("live").expect("room");
            assert_eq!(out.keys_to_store.len(), BATCH);
            assert_eq!(out.evicted_keys.len(), BATCH);
            m.complete_store(keys, true).expect("live");
        }
        g.throughput(Throughput::Elements(2 * BATCH as u64));
        g.bench_function(format!("{name}/store/{n}"), |b| {
            b.iter(|| {
                let keys = r.next();
                let out = m.prepare_store(black_box(keys)).ok().flatten();
                m.complete_store(black_box(keys), true).ok();
                out
            });
        });
        if full {
            g.bench_function(format!("{name}/store_indexed/{n}"), |b| {
                b.iter(|| {
                    let keys = r.next();
                    let out = m.prepare_store_indexed(black_box(keys)).ok().flatten();
                    m.complete_store(black_box(keys), true).ok();
                    out
                });
            });
        }
        g.throughput(Throughput::Elements(BATCH as u64));
        if full {
            g.bench_function(format!("{name}/prepare_store/{n}"), |b| {
                b.iter_custom(|iters| {
                    let mut timed = Duration::ZERO;
                    for _ in 0..iters {
                        let keys = r.next();
                        let t0 = Instant::now();
                        let out = m.prepare_store(black_box(keys)).ok().flatten();
                        timed += t0.elapsed();
                        debug_assert_eq!(out.as_ref().map(|o| o.evicted_keys.len()), Some(BATCH));
                        drop(black_box(out));
                        m.complete_store(keys, true).ok();
                    }
                    timed
                });
            });
            g.bench_function(format!("{name}/complete_store/{n}"), |b| {
                b.iter_custom(|iters| {
                    let mut timed = Duration::ZERO;
                    for _ in 0..iters {
                        let keys = r.next();
                        drop(black_box(m.prepare_store(keys).ok().flatten()));
                        let t0 = Instant::now();
                        black_box(m.complete_store(black_box(keys), true).ok());
                        timed += t0.elapsed();
                    }
                    timed
                });
            });
        }
        let keys = r.next();
        let out = m.prepare_store(keys).expect("live").expect("room");
        assert_eq!(out.keys_to_store.len(), BATCH, "store batches stayed new");
    }
}

/// A plain hash map of the same keys: the cost of one probe, and of one remove + insert.
fn baseline(g: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>, n: usize, ring: &[Key]) {
    let present = &ring[..n];
    let mut map: HashMap<Key, u32, foldhash::fast::RandomState> =
        HashMap::with_capacity_and_hasher(n, foldhash::fast::RandomState::default());
    for (i, k) in present.iter().enumerate() {
        map.insert(k.clone(), u32::try_from(i).expect("small"));
    }
    {
        // Remove the oldest key and insert a new one, 64 times per iteration: the ring of new keys
        // and the FIFO of present ones are those of the managers' store cases.
        let mut map = map.clone();
        let mut r = Ring { ring, pos: n };
        let mut fifo: std::collections::VecDeque<usize> = (0..n).collect();
        let mut evicted: Vec<Key> = Vec::with_capacity(BATCH);
        g.throughput(Throughput::Elements(BATCH as u64));
        g.bench_function(format!("baseline/hashmap_evict/{n}"), |b| {
            b.iter(|| {
                let start = r.pos;
                let keys = r.next();
                let start = if start + BATCH > ring.len() { 0 } else { start };
                evicted.clear();
                for (j, k) in keys.iter().enumerate() {
                    let old = fifo.pop_front().expect("full");
                    let (key, v) = map.remove_entry(&ring[old]).expect("present");
                    evicted.push(key);
                    map.insert(black_box(k).clone(), v);
                    fifo.push_back(start + j);
                }
                black_box(&evicted);
            });
        });
        assert_eq!(map.len(), n);
    }
    let mut batches = Batches::new(present);
    g.throughput(Throughput::Elements(BATCH as u64));
    g.bench_function(format!("baseline/hashmap_get/{n}"), |b| {
        b.iter(|| {
            for k in batches.next() {
                black_box(map.get(black_box(k)));
            }
        });
    });
}

fn managers(c: &mut Criterion) {
    for n in SIZES {
        let mut g = c.benchmark_group("managers");
        let ring: Vec<Key> = (0..2 * n as u64).map(key).collect();
        baseline(&mut g, n, &ring);
        bench_policy::<_, Lru>(&mut g, n, &ring, "");
        bench_policy::<_, Arc>(&mut g, n, &ring, "");
        drop(ring);
        let ring: Vec<[u8; 36]> = (0..2 * n as u64).map(key_inline).collect();
        bench_policy::<_, Lru>(&mut g, n, &ring, "-inline36");
        bench_policy::<_, Arc>(&mut g, n, &ring, "-inline36");
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    targets = managers
}
criterion_main!(benches);
