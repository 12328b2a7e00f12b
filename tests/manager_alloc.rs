//! A manager's memory grows with the blocks it holds, not with its capacity (issue #11: a manager
//! of 2^20 blocks used to take ~36 MB before its first key). Measured with a counting global
//! allocator; the test binary runs this one test only, so no other thread allocates meanwhile.
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(clippy::unwrap_used, clippy::pedantic)]
// Unsafe: the counting global allocator below (a GlobalAlloc impl is unsafe by definition).
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvoff::manager::{AnyManager, ManagerConfig, OffloadingManager, PolicyKind};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: delegates to the system allocator unchanged; only counts the live bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's obligations for `alloc` are passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size, Ordering::Relaxed);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

#[test]
fn memory_grows_with_use_not_with_capacity() {
    for kind in PolicyKind::ALL {
        let before = LIVE.load(Ordering::Relaxed);
        let mut m = AnyManager::<u64>::try_new(kind, ManagerConfig::new(1 << 24)).unwrap();
        let empty = LIVE.load(Ordering::Relaxed) - before;
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
        let used = LIVE.load(Ordering::Relaxed) - before;
        assert!(used < 8 << 20, "{kind:?}: 10 000 blocks took {used} bytes");
        drop(m);
    }
}
