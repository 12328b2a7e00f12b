//! A manager's memory grows with the blocks it holds, not with its capacity (issue #11: a manager
//! of 2^20 blocks used to take ~36 MB before its first key). Measured with a counting global
//! allocator that counts per thread (the managers are single-threaded), so the tests may run in
//! parallel.
// Sets its own global allocator: not built with the Python extension's (feature `mimalloc`).
#![cfg(not(feature = "mimalloc"))]
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]
// Unsafe: the counting global allocator below (a GlobalAlloc impl is unsafe by definition).
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kvoff::key::{make_offload_key, ByteKey};
use kvoff::manager::{
    AnyManager, ArcManager, LruManager, ManagerConfig, OffloadingManager, PolicyKind,
};

struct Counting;

thread_local! {
    /// Bytes this thread holds (allocated minus freed by it); const-initialised, so reading it
    /// never allocates.
    static LIVE: Cell<i64> = const { Cell::new(0) };
}

fn note(delta: i64) {
    let _ = LIVE.try_with(|l| l.set(l.get() + delta));
}

fn live() -> i64 {
    LIVE.with(Cell::get)
}

// SAFETY: delegates to the system allocator unchanged; only counts the live bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size() as i64);
        // SAFETY: the caller's obligations for `alloc` are passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note(-(layout.size() as i64));
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size as i64 - layout.size() as i64);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

#[test]
fn memory_grows_with_use_not_with_capacity() {
    for kind in PolicyKind::ALL {
        let before = live();
        let mut m = AnyManager::<u64>::try_new(kind, ManagerConfig::new(1 << 24)).unwrap();
        let empty = live() - before;
        assert!(
            empty < 1 << 20,
            "{kind:?}: an empty manager of 2^24 blocks took {empty} bytes"
        );
        // Filling 10 000 blocks grows it as needed, and every key is served.
        let keys: Vec<u64> = (0..10_000).collect();
        for chunk in keys.chunks(64) {
            let out = m.prepare_store(chunk).unwrap().unwrap();
            assert_eq!(out.block_ids.len(), chunk.len());
            m.complete_store(chunk, true).unwrap();
        }
        assert_eq!(m.len(), 10_000);
        assert_eq!(m.lookup_prefix(&keys).unwrap(), Some(10_000));
        let used = live() - before;
        assert!(used < 8 << 20, "{kind:?}: 10 000 blocks took {used} bytes");
        drop(m);
    }
}

/// With the keys the bindings use (`ByteKey`) and every optional part (events, the admission
/// tracker), a 2^24-block manager still starts with a few hundred bytes (before #11: 104,857,728
/// bytes requested, 36 MiB of them written).
#[test]
fn huge_managers_start_with_a_few_hundred_bytes() {
    let huge = 1usize << 24;
    let measure = |f: &dyn Fn() -> Box<dyn std::any::Any>| {
        let before = live();
        let m = f();
        let bytes = live() - before;
        drop(m);
        bytes
    };
    let lru =
        measure(&|| Box::new(LruManager::<ByteKey>::try_new(ManagerConfig::new(huge)).unwrap()));
    let arc =
        measure(&|| Box::new(ArcManager::<ByteKey>::try_new(ManagerConfig::new(huge)).unwrap()));
    let full = measure(&|| {
        let mut c = ManagerConfig::new(huge);
        c.enable_events = true;
        c.store_threshold = 2;
        Box::new(AnyManager::<ByteKey>::try_new(PolicyKind::Arc, c).unwrap())
    });
    eprintln!("bytes held by an empty 2^24-block manager (its boxed struct included): LRU {lru}, ARC {arc}, ARC with events and a store threshold {full}");
    for (what, b) in [("LRU", lru), ("ARC", arc), ("ARC+events+threshold", full)] {
        assert!(b < 4096, "{what}: {b} bytes before the first key");
    }
    // And they work: a key stored in the huge ARC manager is served.
    let mut m = ArcManager::<ByteKey>::try_new(ManagerConfig::new(huge)).unwrap();
    let k = ByteKey::new(&make_offload_key(b"block", 0));
    let out = m.prepare_store(std::slice::from_ref(&k)).unwrap().unwrap();
    assert_eq!(out.block_ids, vec![0]);
    m.complete_store(std::slice::from_ref(&k), true).unwrap();
    assert_eq!(m.lookup_prefix(&[k]).unwrap(), Some(1));
}
