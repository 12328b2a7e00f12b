//! Fuzzing the worker side's plan inputs (issue #11): arbitrary and hostile arguments to the
//! expansion functions ([`kvoff::expand`]) and to [`CopyPlanner`] (construction from random tensor
//! and group descriptors, then `plan` with random GPU specs and CPU ids), checked against a
//! reference model written from the modules' docs.
//!
//! Properties, for every input:
//! - **no panic**: every call under test runs inside `catch_unwind`; a panic fails the test with
//!   the input in the message;
//! - **no absurd allocation**: a counting global allocator watches the calls under test. One
//!   request above [`ALLOC_LIMIT_BYTES`] fails the test (the inputs are small: only a cap of the
//!   crate could justify that much); one above [`ALLOC_REFUSE_BYTES`] is refused after the input
//!   is printed to stderr (the process then aborts: that is the failure). Inputs beyond the crate's
//!   caps (`expand::MAX_SUB_BLOCKS`, `plan::MAX_BLOCK_COPIES`) must be errors, not attempts;
//! - **exactness**: Ok or error as the model says wherever the docs decide it; an Ok expansion
//!   holds exactly the model's values; an Ok plan's copies are exactly the model's per-block copies
//!   (merged where both sides are contiguous, and only there), lie inside the described tensors,
//!   write no byte twice (for layouts whose tensors are disjoint by construction), and its
//!   `total_bytes` / `num_block_copies` add up.
//!
//! The planner cases are drawn from a seed (a layout: small regular, huge (up to 2^60 rows, factors
//! up to 2^33), pages near 2^62 on tensors sharing memory, one thing corrupted, or every field
//! hostile; then [`JOBS_PER_LAYOUT`] jobs: consistent, consistent with one thing broken, or
//! anything): a failure prints the whole layout and job, and the seed reproduces it.
//! `generators_cover_ok_and_err` checks that both outcomes stay frequent (about 3 in 4 layouts
//! build and 6 in 10 jobs give a plan).
//!
//! Cases per property: `PROPTEST_CASES` (default [`DEFAULT_CASES`]: the file runs in about 2 s in a
//! debug build on 2 cores; 100 000 cases took 2 minutes).
// Sets its own global allocator: not built with the Python extension's (feature `mimalloc`).
#![cfg(not(feature = "mimalloc"))]
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]
// Unsafe: the counting global allocator (forwards to `System`).
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};

use kvoff::expand::{
    compute_sub_block_ptrs, compute_sub_block_ptrs_into, expand_block_ids, expand_block_ids_into,
    MAX_SUB_BLOCKS,
};
use kvoff::plan::{CopyPlan, CopyPlanner, Direction, GpuSpec, PlanRef, TensorDesc};
use kvoff::KvoffError;
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestCaseError};

const DEFAULT_CASES: u32 = 2048;
const JOBS_PER_LAYOUT: usize = 24;
/// Most bytes one allocation of a call under test may ask for (the crate's largest fixed buffer,
/// the planner's duplicate-destination bitmap, is capped at 32 MiB; everything else here is
/// proportional to inputs of at most a few hundred elements).
const ALLOC_LIMIT_BYTES: usize = 64 << 20;
/// Requests above this are refused (and the input printed) instead of tried.
const ALLOC_REFUSE_BYTES: usize = 1 << 30;

// ---------------------------------------------------------------------------------------------
// The counting allocator and the guard around every call under test
// ---------------------------------------------------------------------------------------------

struct Watch;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
    static INPUT: RefCell<[u8; 4096]> = const { RefCell::new([0; 4096]) };
    static INPUT_LEN: Cell<usize> = const { Cell::new(0) };
}

/// Writes `bytes` to stderr without allocating.
fn raw_stderr(bytes: &[u8]) {
    // SAFETY: `bytes` is a valid buffer for the duration of the call.
    let _ = unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
}

/// Records a request of `size` bytes; `false` when it must be refused.
fn watch(size: usize) -> bool {
    if !ARMED.try_with(Cell::get).unwrap_or(false) {
        return true;
    }
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
    if size <= ALLOC_REFUSE_BYTES {
        return true;
    }
    // No allocation from here on: digits on the stack, the input from its pre-rendered buffer.
    let mut digits = [0u8; 20];
    let (mut n, mut i) = (size, digits.len());
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    raw_stderr(b"\nfuzz_plan: refused an allocation of ");
    raw_stderr(&digits[i..]);
    raw_stderr(b" bytes; input: ");
    let len = INPUT_LEN.try_with(Cell::get).unwrap_or(0);
    let _ = INPUT.try_with(|b| {
        if let Ok(b) = b.try_borrow() {
            raw_stderr(&b[..len.min(b.len())]);
        }
    });
    raw_stderr(b"\n");
    false
}

// SAFETY: every method forwards to `System` with the caller's arguments (only refusing some
// requests with null, which `GlobalAlloc` allows); `watch` does not allocate.
unsafe impl GlobalAlloc for Watch {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        if !watch(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout (its obligations are the caller's).
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: AllocLayout) -> *mut u8 {
        if !watch(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: `ptr` came from `System` with this layout (every allocation here does).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        if !watch(new_size) {
            return std::ptr::null_mut();
        }
        // SAFETY: as in `dealloc`; `new_size` is the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Watch = Watch;

/// Runs `f` watched: a panic or an allocation above [`ALLOC_LIMIT_BYTES`] is a test failure that
/// names `input`.
fn guarded<T>(what: &str, input: &dyn Debug, f: impl FnOnce() -> T) -> Result<T, TestCaseError> {
    let text = format!("{what} on {input:?}");
    INPUT.with(|b| {
        let mut b = b.borrow_mut();
        let n = text.len().min(b.len());
        b[..n].copy_from_slice(&text.as_bytes()[..n]);
        INPUT_LEN.with(|l| l.set(n));
    });
    LARGEST.with(|l| l.set(0));
    ARMED.with(|a| a.set(true));
    let r = catch_unwind(AssertUnwindSafe(f));
    ARMED.with(|a| a.set(false));
    let largest = LARGEST.with(Cell::get);
    let v = match r {
        Ok(v) => v,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_default();
            return Err(TestCaseError::fail(format!("panicked ({msg}): {text}")));
        }
    };
    if largest > ALLOC_LIMIT_BYTES {
        return Err(TestCaseError::fail(format!(
            "allocated {largest} bytes at once: {text}"
        )));
    }
    Ok(v)
}

fn config() -> PropConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES);
    PropConfig {
        cases,
        failure_persistence: None,
        ..PropConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Expansion
// ---------------------------------------------------------------------------------------------

fn id() -> impl Strategy<Value = i64> {
    prop_oneof![
        6 => 0i64..50,
        1 => -5i64..0,
        1 => prop_oneof![
            Just(i64::MIN),
            Just(i64::MAX),
            Just(i64::MAX / 2),
            Just(i64::MAX / 3 + 1),
            Just(i64::MAX / 8),
        ],
        1 => (i64::MAX - 8)..=i64::MAX,
        1 => (0u32..63).prop_map(|s| 1i64 << s),
        1 => any::<i64>(),
    ]
}

fn factor() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 1usize..=8,
        1 => Just(0usize),
        1 => prop_oneof![
            Just(MAX_SUB_BLOCKS - 1),
            Just(MAX_SUB_BLOCKS),
            Just(MAX_SUB_BLOCKS + 1),
            Just(usize::MAX),
            Just(usize::MAX / 2),
            Just(1usize << 32),
            Just((1usize << 31) + 7),
            Just(1usize << 62),
        ],
        1 => any::<usize>(),
    ]
}

fn count() -> impl Strategy<Value = Option<usize>> {
    prop_oneof![
        3 => Just(None),
        3 => (0usize..24).prop_map(Some),
        1 => any::<usize>().prop_map(Some),
        1 => prop_oneof![Just(MAX_SUB_BLOCKS), Just(MAX_SUB_BLOCKS + 1), Just(usize::MAX)].prop_map(Some),
    ]
}

fn u64_hostile() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0u64..5000,
        1 => prop_oneof![Just(0u64), Just(u64::MAX), Just(u64::MAX - 1), Just(1 << 63), Just(i64::MAX as u64)],
        1 => (0u32..64).prop_map(|s| 1u64 << s),
        1 => (u64::MAX - 100_000)..=u64::MAX,
        1 => any::<u64>(),
    ]
}

#[derive(Debug, Clone)]
struct ExpandCase {
    ids: Vec<i64>,
    f: usize,
    skip: usize,
    count: Option<usize>,
    base: u64,
    stride: u64,
    row: u64,
}

fn expand_case() -> impl Strategy<Value = ExpandCase> {
    (
        proptest::collection::vec(id(), 0..12),
        factor(),
        (0u8..6, 0usize..6, any::<usize>()),
        count(),
        u64_hostile(),
        u64_hostile(),
        (any::<bool>(), 1u64..64, u64_hostile()),
    )
        .prop_map(
            |(ids, f, (sk, small, big), count, base, stride, (multiple, sub, row))| {
                let skip = match sk {
                    0 | 1 => small,
                    2 => f.saturating_sub(1),
                    3 => f,
                    4 => f.saturating_add(small),
                    _ => big,
                };
                // Mostly a valid row (a multiple of f), sometimes anything.
                let row = if multiple {
                    sub.checked_mul(f as u64).unwrap_or(row)
                } else {
                    row
                };
                let mut c = ExpandCase {
                    ids,
                    f,
                    skip,
                    count,
                    base,
                    stride,
                    row,
                };
                // A valid expansion of up to 2^28 sub-blocks would allocate up to 2 GiB, as
                // documented: keep those cheap by taking only a few of them.
                if let Some(n) = requested(c.ids.len(), c.f, c.skip, c.count) {
                    if n > 1 << 16 && n <= MAX_SUB_BLOCKS {
                        c.count = Some(n % 4096);
                    }
                }
                c
            },
        )
}

/// Sub-blocks an expansion of `len` ids would produce if its arguments are consistent.
fn requested(len: usize, f: usize, skip: usize, count: Option<usize>) -> Option<usize> {
    if f == 0 || skip >= f {
        return None;
    }
    let total = len.checked_mul(f)?;
    let avail = total.checked_sub(skip)?;
    let c = count.unwrap_or(avail);
    (c <= avail).then_some(c)
}

/// The expansion the docs describe: `(block id, sub-block j)` of every emitted entry, or `None`
/// when the arguments must be rejected (ids not yet checked).
fn model_positions(c: &ExpandCase) -> Option<Vec<(i128, i128)>> {
    let n = requested(c.ids.len(), c.f, c.skip, c.count)?;
    if n > MAX_SUB_BLOCKS || c.ids.iter().any(|&b| b < 0) {
        return None;
    }
    Some(
        (c.skip..c.skip + n)
            .map(|p| (i128::from(c.ids[p / c.f]), (p % c.f) as i128))
            .collect(),
    )
}

fn model_ids(c: &ExpandCase) -> Option<Vec<i64>> {
    let pos = model_positions(c)?;
    let f = c.f as i128;
    let max_id = i128::from(c.ids.iter().copied().max().unwrap_or(0));
    if max_id * f + f - 1 > i128::from(i64::MAX) {
        return None;
    }
    Some(pos.iter().map(|&(b, j)| (b * f + j) as i64).collect())
}

fn model_ptrs(c: &ExpandCase) -> Option<Vec<u64>> {
    let pos = model_positions(c)?;
    let f = c.f as u128;
    if u128::from(c.row) % f != 0 {
        return None;
    }
    let sub = u128::from(c.row) / f;
    let max_id = c.ids.iter().copied().max().unwrap_or(0) as u128;
    let max_ptr = u128::from(c.base) + max_id * u128::from(c.stride) + (f - 1) * sub;
    if max_ptr > u128::from(u64::MAX) {
        return None;
    }
    Some(
        pos.iter()
            .map(|&(b, j)| {
                (u128::from(c.base) + b as u128 * u128::from(c.stride) + j as u128 * sub) as u64
            })
            .collect(),
    )
}

fn check_expand(c: &ExpandCase) -> Result<(), TestCaseError> {
    let want = model_ids(c);
    let got = guarded("expand_block_ids", c, || {
        expand_block_ids(&c.ids, c.f, c.skip, c.count)
    })?;
    match (&got, &want) {
        (Ok(v), Some(w)) => prop_assert_eq!(v, w, "expand_block_ids on {:?}", c),
        (Err(KvoffError::InvalidArgument(_)), None) => {}
        _ => prop_assert!(
            false,
            "expand_block_ids on {:?}: got {:?}, model {:?}",
            c,
            got,
            want
        ),
    }
    let mut out = vec![-7i64];
    let r = guarded("expand_block_ids_into", c, || {
        expand_block_ids_into(&c.ids, c.f, c.skip, c.count, &mut out)
    })?;
    let mut w_into = vec![-7i64];
    if let Some(w) = &want {
        w_into.extend_from_slice(w);
    }
    prop_assert_eq!(r.is_ok(), want.is_some(), "{:?}", c);
    prop_assert_eq!(&out, &w_into, "expand_block_ids_into on {:?}", c);

    let want = model_ptrs(c);
    let got = guarded("compute_sub_block_ptrs", c, || {
        compute_sub_block_ptrs(&c.ids, c.f, c.base, c.stride, c.row, c.skip, c.count)
    })?;
    match (&got, &want) {
        (Ok(v), Some(w)) => prop_assert_eq!(v, w, "compute_sub_block_ptrs on {:?}", c),
        (Err(KvoffError::InvalidArgument(_)), None) => {}
        _ => prop_assert!(
            false,
            "compute_sub_block_ptrs on {:?}: got {:?}, model {:?}",
            c,
            got,
            want
        ),
    }
    let mut out = vec![7u64];
    let r = guarded("compute_sub_block_ptrs_into", c, || {
        compute_sub_block_ptrs_into(
            &c.ids, c.f, c.base, c.stride, c.row, c.skip, c.count, &mut out,
        )
    })?;
    let mut w_into = vec![7u64];
    if let Some(w) = &want {
        w_into.extend_from_slice(w);
    }
    prop_assert_eq!(r.is_ok(), want.is_some(), "{:?}", c);
    prop_assert_eq!(&out, &w_into, "compute_sub_block_ptrs_into on {:?}", c);
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    /// Expansion: never panics, never allocates beyond its cap, exactly the documented values.
    #[test]
    fn expansion_matches_model(c in expand_case()) {
        check_expand(&c)?;
    }

    /// Planner construction and plans: see the file docs.
    #[test]
    fn planner_matches_model(seed in any::<u64>()) {
        check_layout(seed)?;
    }
}

/// Regression: the largest sub-block id `i64::MAX` is valid and must not overflow while it is
/// produced (the id after it does not exist).
#[test]
fn expansion_up_to_i64_max() {
    let c = ExpandCase {
        ids: vec![i64::MAX],
        f: 1,
        skip: 0,
        count: None,
        base: 0,
        stride: 1,
        row: 1,
    };
    check_expand(&c).unwrap();
    let c = ExpandCase {
        ids: vec![i64::MAX / 4],
        f: 4,
        skip: 1,
        count: None,
        base: 0,
        stride: 1,
        row: 4,
    };
    assert_eq!(
        expand_block_ids(&c.ids, c.f, c.skip, c.count)
            .unwrap()
            .last(),
        Some(&i64::MAX)
    );
    check_expand(&c).unwrap();
    // Pointers up to u64::MAX - 1 (the end of the last byte's range) likewise.
    assert_eq!(
        compute_sub_block_ptrs(&[1], 2, u64::MAX - 3, 1, 4, 0, None).unwrap(),
        vec![u64::MAX - 2, u64::MAX]
    );
}

// ---------------------------------------------------------------------------------------------
// Planner: random layouts and jobs from a seed
// ---------------------------------------------------------------------------------------------

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n > 0`; 0 for `n == 0`).
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
        }
    }
    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }
    fn hostile_u64(&mut self) -> u64 {
        match self.below(9) {
            0 => 0,
            1 => 1,
            2 => u64::MAX,
            3 => u64::MAX - self.below(8),
            4 => 1 << self.below(64),
            5 => (1 << self.below(64)) - 1,
            6 => self.next(),
            _ => self.below(100),
        }
    }
    fn hostile_i64(&mut self) -> i64 {
        match self.below(8) {
            0 => -1 - self.below(3) as i64,
            1 => i64::MIN,
            2 => i64::MAX,
            3 => (self.next() >> 1) as i64,
            4 => self.next() as i64,
            _ => self.below(20) as i64,
        }
    }
}

#[derive(Debug, Clone)]
struct PlanLayout {
    kind: &'static str,
    gpu: Vec<TensorDesc>,
    cpu: Vec<TensorDesc>,
    groups: Vec<Vec<PlanRef>>,
    f: u64,
    /// The tensors of each side are byte-disjoint by construction (no byte may be written twice).
    disjoint: bool,
}

#[derive(Debug, Clone)]
struct Job {
    direction: Direction,
    ids: Vec<i64>,
    sizes: Option<Vec<i64>>,
    indices: Option<Vec<i64>>,
    cpu: Vec<i64>,
}

/// Random groups over `n` tensors of pages `pages[t]` (largest valid page of each tensor).
fn random_groups(r: &mut Rng, pages: &[u64]) -> Vec<Vec<PlanRef>> {
    let n = pages.len();
    let ng = if r.chance(1, 12) { 0 } else { 1 + r.below(3) };
    (0..ng)
        .map(|_| {
            let mut ts: Vec<usize> = (0..n).collect();
            for i in (1..ts.len()).rev() {
                ts.swap(i, r.below(i as u64 + 1) as usize);
            }
            let k = if r.chance(1, 10) {
                0
            } else {
                1 + r.below(n as u64) as usize
            };
            ts[..k.min(n)]
                .iter()
                .map(|&t| {
                    let p = if r.chance(3, 4) {
                        pages[t]
                    } else {
                        1 + r.below(pages[t])
                    };
                    PlanRef::new(t, p)
                })
                .collect()
        })
        .collect()
}

/// Small, well-formed layouts: separate or interleaved (cross-layer / block-major host rows)
/// tensors on each side, byte-disjoint.
fn layout_regular(r: &mut Rng) -> PlanLayout {
    let n = 1 + r.below(5) as usize;
    let f = r.pick(&[1u64, 1, 2, 3, 4, 7]);
    let pages: Vec<u64> = (0..n).map(|_| 1 + r.below(64)).collect();
    let mut gpu = Vec::new();
    if r.chance(1, 3) {
        let nb = 1 + r.below(30);
        let rows: Vec<u64> = pages.iter().map(|p| p + r.below(3)).collect();
        let stride = rows.iter().sum::<u64>() + r.below(16);
        let mut off = 0x1_0000;
        for &row in &rows {
            gpu.push(TensorDesc::new(off, nb, stride, row));
            off += row;
        }
    } else {
        let mut cursor = 0x1_0000u64;
        for &p in &pages {
            let nb = if r.chance(1, 30) { 0 } else { 1 + r.below(30) };
            let row = p + r.below(4);
            let stride = row + if r.chance(1, 2) { 0 } else { r.below(16) };
            let d = TensorDesc::new(cursor, nb, stride, row);
            cursor += d.extent_bytes().unwrap() + 64 * r.below(3);
            gpu.push(d);
        }
    }
    let mut cpu = Vec::new();
    let subs: Vec<u64> = pages.iter().map(|p| p + r.below(3)).collect();
    if r.chance(1, 2) {
        // Block-major host rows (a region): every tensor's sub-blocks of a CPU block side by side.
        let nb = 1 + r.below(12);
        let stride = subs.iter().map(|s| s * f).sum::<u64>() + r.below(64);
        let mut off = 0x8000_0000_0000u64;
        for &s in &subs {
            cpu.push(TensorDesc::new(off, nb, stride, s * f));
            off += s * f;
        }
    } else {
        let mut cursor = 0x8000_0000_0000u64;
        for &s in &subs {
            let nb = 1 + r.below(12);
            let d = TensorDesc::new(cursor, nb, s * f + r.below(2) * 8, s * f);
            cursor += d.extent_bytes().unwrap() + 64 * r.below(2);
            cpu.push(d);
        }
    }
    let groups = random_groups(r, &pages);
    PlanLayout {
        kind: "regular",
        gpu,
        cpu,
        groups,
        f,
        disjoint: true,
    }
}

/// Huge tensors (up to 2^60 rows) and factors, still well-formed and disjoint: ids near the
/// limits, duplicate checks over huge id spaces.
fn layout_huge(r: &mut Rng) -> PlanLayout {
    let n = 1 + r.below(3) as usize;
    let f = r.pick(&[1u64, 2, 3, 1 << 20, 1 << 33]);
    let span = (1u64 << 61) / n as u64; // bytes of address space per tensor and side
    let pages: Vec<u64> = (0..n).map(|_| 1 + r.below(64)).collect();
    let mut gpu = Vec::new();
    let mut cpu = Vec::new();
    for (t, &p) in pages.iter().enumerate() {
        let stride = p + r.below(2);
        let max_nb = (span - stride) / stride;
        let nb = if r.chance(1, 2) {
            max_nb - r.below(4)
        } else {
            1 << r.below(max_nb.ilog2() as u64 + 1)
        };
        gpu.push(TensorDesc::new((1 << 20) + t as u64 * span, nb, stride, p));
        let row = p * f;
        let max_cnb = (span / row).max(1);
        let cnb = if r.chance(1, 2) {
            max_cnb
        } else {
            1 + r.below(max_cnb)
        };
        cpu.push(TensorDesc::contiguous(
            (1 << 62) + t as u64 * span,
            cnb,
            row,
        ));
    }
    let groups = random_groups(r, &pages);
    PlanLayout {
        kind: "huge",
        gpu,
        cpu,
        groups,
        f,
        disjoint: true,
    }
}

/// Pages near 2^62 on tensors that share their memory (same-side overlap is allowed: the planner
/// checks GPU against CPU only): byte totals near and beyond `u64::MAX`.
fn layout_big_pages(r: &mut Rng) -> PlanLayout {
    let n = 1 + r.below(4) as usize;
    let f = r.pick(&[1u64, 2, 4]);
    let mut gpu = Vec::new();
    let mut cpu = Vec::new();
    let mut pages = Vec::new();
    for _ in 0..n {
        let row = 1u64 << (57 + r.below(5)); // 2^57 ..= 2^61
        let nb = 1 + r.below(2);
        gpu.push(TensorDesc::contiguous(1 << 20, nb, row));
        let crow = row * f;
        let cnb = ((1u64 << 63) / crow).clamp(1, 2);
        cpu.push(TensorDesc::contiguous(1 << 63, cnb, crow));
        pages.push(row);
    }
    let groups = random_groups(r, &pages);
    PlanLayout {
        kind: "big_pages",
        gpu,
        cpu,
        groups,
        f,
        disjoint: false,
    }
}

/// Every field hostile.
fn layout_hostile(r: &mut Rng) -> PlanLayout {
    let n = r.below(4) as usize;
    let desc = |r: &mut Rng| {
        TensorDesc::new(
            r.hostile_u64(),
            r.hostile_u64(),
            r.hostile_u64(),
            r.hostile_u64(),
        )
    };
    let gpu: Vec<TensorDesc> = (0..n).map(|_| desc(r)).collect();
    let cpu: Vec<TensorDesc> = (0..n).map(|_| desc(r)).collect();
    let ng = r.below(4);
    let groups = (0..ng)
        .map(|_| {
            (0..r.below(4))
                .map(|_| {
                    let t = r.below(n as u64 + 2) as usize;
                    let p = if r.chance(1, 2) {
                        r.below(64)
                    } else {
                        r.hostile_u64()
                    };
                    PlanRef::new(t, p)
                })
                .collect()
        })
        .collect();
    let f = if r.chance(1, 2) {
        r.below(5)
    } else {
        r.hostile_u64()
    };
    PlanLayout {
        kind: "hostile",
        gpu,
        cpu,
        groups,
        f,
        disjoint: false,
    }
}

/// A regular layout with one thing broken.
fn layout_corrupted(r: &mut Rng) -> PlanLayout {
    let mut l = layout_regular(r);
    l.kind = "corrupted";
    let n = l.gpu.len();
    let t = r.below(n as u64) as usize;
    match r.below(11) {
        0 => l.f = 0,
        1 => {
            l.cpu.pop();
        }
        2 => l.gpu[t].row_bytes = 0,
        3 => {
            l.gpu[t].num_blocks = l.gpu[t].num_blocks.max(2);
            l.gpu[t].row_stride_bytes = l.gpu[t].row_bytes - 1;
        }
        4 => l.cpu[t].base_ptr = 0,
        5 => l.cpu[t].base_ptr = l.gpu[t].base_ptr + r.below(8), // overlaps its GPU side
        6 => l.cpu[t].row_bytes += 1,                            // not a multiple of f (mostly)
        7 => l.cpu[t].num_blocks = u64::MAX - r.below(3),        // extent overflows
        _ => {
            if let Some(g) = l.groups.first_mut() {
                match r.below(4) {
                    0 => g.push(PlanRef::new(n + r.below(3) as usize, 1)),
                    1 => g.push(g.first().copied().unwrap_or(PlanRef::new(0, 1))),
                    2 => g.push(PlanRef::new(t, 0)),
                    _ => g.push(PlanRef::new(t, l.gpu[t].row_bytes + 1)),
                }
            }
        }
    }
    l
}

fn make_layout(r: &mut Rng) -> PlanLayout {
    match r.below(16) {
        0..=6 => layout_regular(r),
        7..=9 => layout_huge(r),
        10..=11 => layout_big_pages(r),
        12..=13 => layout_corrupted(r),
        _ => layout_hostile(r),
    }
}

fn range_of(d: &TensorDesc) -> Option<(u128, u128)> {
    let e = d.extent_bytes()?;
    let end = d.base_ptr.checked_add(e)?;
    Some((u128::from(d.base_ptr), u128::from(end)))
}

/// Whether `CopyPlanner::new` must accept the layout (its `# Errors` list, negated).
fn model_new(l: &PlanLayout) -> bool {
    let f = l.f;
    if f == 0 || l.gpu.len() != l.cpu.len() {
        return false;
    }
    let desc_ok = |d: &TensorDesc| {
        d.row_bytes > 0
            && !(d.num_blocks > 1 && d.row_stride_bytes < d.row_bytes)
            && !(d.num_blocks > 0 && d.base_ptr == 0)
            && range_of(d).is_some()
    };
    if !l.gpu.iter().chain(&l.cpu).all(desc_ok) || l.cpu.iter().any(|d| d.row_bytes % f != 0) {
        return false;
    }
    for g in &l.gpu {
        for c in &l.cpu {
            let (gs, ge) = range_of(g).unwrap();
            let (cs, ce) = range_of(c).unwrap();
            if gs < ce && cs < ge {
                return false;
            }
        }
    }
    let n = l.gpu.len();
    for group in &l.groups {
        let mut seen = HashSet::new();
        let mut bytes: u128 = 0;
        for r in group {
            let t = r.tensor_idx;
            if t >= n || !seen.insert(t) {
                return false;
            }
            let p = r.page_size_bytes;
            if p == 0 || p > l.gpu[t].row_bytes || p > l.cpu[t].row_bytes / f {
                return false;
            }
            if u128::from(l.cpu[t].num_blocks) * u128::from(f) > u128::from(u64::MAX) {
                return false;
            }
            bytes += u128::from(p);
        }
        if bytes > u128::from(u64::MAX) {
            return false;
        }
    }
    true
}

/// The ids limits of group `g`: (GPU, CPU) ids must be below these.
fn limits(l: &PlanLayout, g: usize) -> (u64, u64) {
    l.groups[g].iter().fold((u64::MAX, u64::MAX), |(a, b), r| {
        (
            a.min(l.gpu[r.tensor_idx].num_blocks),
            b.min(l.cpu[r.tensor_idx].num_blocks),
        )
    })
}

/// An id below `limit`: often from a small range (duplicates), sometimes anywhere, near the top.
fn id_below(r: &mut Rng, limit: u64) -> i64 {
    let limit = limit.min(i64::MAX as u64 + 1);
    let v = match r.below(4) {
        0 => r.below(limit),
        1 => limit - 1 - r.below(limit.min(3)),
        _ => r.below(limit.min(24)),
    };
    v as i64
}

fn make_job(r: &mut Rng, l: &PlanLayout) -> Job {
    let direction = if r.chance(1, 2) {
        Direction::GpuToCpu
    } else {
        Direction::CpuToGpu
    };
    let ng = l.groups.len();
    let f = l.f.max(1);
    let mode = r.below(10);
    if mode >= 8 {
        // Anything.
        let v = |r: &mut Rng, len: u64| (0..len).map(|_| r.hostile_i64()).collect::<Vec<i64>>();
        let len = r.below(8);
        let ids = v(r, len);
        let len = r.below(8);
        let cpu = v(r, len);
        let sizes = r.chance(1, 2).then(|| {
            let k = (ng as u64 + r.below(3)).saturating_sub(1);
            v(r, k)
        });
        let indices = r.chance(1, 2).then(|| {
            let k = (ng as u64 + r.below(3)).saturating_sub(1);
            v(r, k)
        });
        return Job {
            direction,
            ids,
            sizes,
            indices,
            cpu,
        };
    }
    // Consistent: every group's ids in range, the CPU ids consumed exactly; destinations mostly
    // distinct (a small id range makes collisions likely anyway).
    let mut job = Job {
        direction,
        ids: Vec::new(),
        sizes: Some(Vec::new()),
        indices: Some(Vec::new()),
        cpu: Vec::new(),
    };
    let mut used_gpu = HashSet::new();
    let mut used_cpu = HashSet::new();
    for g in 0..ng {
        let (gl, cl) = limits(l, g);
        let mut size = if r.chance(1, 6) { 0 } else { 1 + r.below(6) };
        let bi = match r.below(6) {
            0 => r.below(1 << 40),
            1 => 0,
            _ => r.below(3 * f.min(1 << 20) + 2),
        };
        let skip = bi % f;
        if gl == 0 || (cl == 0 && size > 0) {
            size = 0;
        }
        for _ in 0..size {
            let mut id = id_below(r, gl);
            for _ in 0..4 {
                if direction == Direction::GpuToCpu || used_gpu.insert(id) {
                    break;
                }
                id = id_below(r, gl);
            }
            job.ids.push(id);
        }
        if size > 0 {
            let need = (size + skip).div_ceil(f);
            for _ in 0..need {
                let mut id = id_below(r, cl);
                for _ in 0..4 {
                    if direction == Direction::CpuToGpu || used_cpu.insert(id) {
                        break;
                    }
                    id = id_below(r, cl);
                }
                job.cpu.push(id);
            }
        }
        job.sizes.as_mut().unwrap().push(size as i64);
        job.indices.as_mut().unwrap().push(bi as i64);
    }
    if ng == 1 && r.chance(1, 3) {
        job.sizes = None;
    }
    if job.indices.as_ref().unwrap().iter().all(|&b| b == 0) && r.chance(1, 2) {
        job.indices = None;
    }
    if mode == 7 {
        // Break one thing.
        let pick_mut = |r: &mut Rng, v: &mut Vec<i64>, val: i64| {
            if !v.is_empty() {
                let i = r.below(v.len() as u64) as usize;
                v[i] = val;
            }
        };
        match r.below(10) {
            0 => {
                let x = r.hostile_i64();
                pick_mut(r, &mut job.ids, x);
            }
            1 => {
                let x = r.hostile_i64();
                pick_mut(r, &mut job.cpu, x);
            }
            2 => job.cpu.push(r.below(4) as i64),
            3 => {
                job.cpu.pop();
            }
            4 => {
                let x = r.hostile_i64();
                if let Some(s) = job.sizes.as_mut() {
                    pick_mut(r, s, x);
                }
            }
            5 => {
                let x = r.pick(&[-1, i64::MIN, i64::MAX, 1 << 40]);
                if let Some(s) = job.indices.as_mut() {
                    pick_mut(r, s, x);
                }
            }
            6 => job.sizes = None,
            7 => job.indices = Some(vec![0; ng + 1]),
            8 => {
                if job.ids.len() >= 2 {
                    job.ids[1] = job.ids[0];
                }
            }
            _ => {
                if job.cpu.len() >= 2 {
                    job.cpu[1] = job.cpu[0];
                }
            }
        }
    }
    job
}

/// What the planner must do with a job: its per-block copies `(src, dst, bytes)` when valid.
#[derive(Debug, Default)]
struct Expect {
    must_err: bool,
    must_ok: bool,
    pieces: Vec<(u64, u64, u64)>,
    total: u128,
    block_copies: u128,
}

fn model_plan(l: &PlanLayout, j: &Job) -> Expect {
    let invalid = Expect {
        must_err: true,
        ..Expect::default()
    };
    let ng = l.groups.len();
    let f = u128::from(l.f);
    let sizes: Vec<i64> = match &j.sizes {
        None if ng == 1 => vec![j.ids.len() as i64],
        None => return invalid,
        Some(s) if s.len() != ng => return invalid,
        Some(s) => s.clone(),
    };
    let indices: Vec<i64> = match &j.indices {
        None => vec![0; ng],
        Some(b) if b.len() != ng => return invalid,
        Some(b) => b.clone(),
    };
    if sizes.iter().chain(&indices).any(|&v| v < 0) {
        return invalid;
    }
    // Spans and id checks.
    let (mut goff, mut coff) = (0u128, 0u128);
    let mut spans = Vec::new();
    for g in 0..ng {
        let size = sizes[g] as u128;
        let skip = indices[g] as u128 % f;
        let ccount = if size == 0 {
            0
        } else {
            (size + skip).div_ceil(f)
        };
        if goff + size > j.ids.len() as u128 || coff + ccount > j.cpu.len() as u128 {
            return invalid;
        }
        let (gl, cl) = limits(l, g);
        let (go, co) = (goff as usize, coff as usize);
        let gids = &j.ids[go..go + size as usize];
        let cids = &j.cpu[co..co + ccount as usize];
        if gids.iter().any(|&b| b < 0 || b as u64 >= gl)
            || cids.iter().any(|&b| b < 0 || b as u64 >= cl)
        {
            return invalid;
        }
        spans.push((go, co, size as usize, skip));
        goff += size;
        coff += ccount;
    }
    if goff != j.ids.len() as u128 || coff != j.cpu.len() as u128 {
        return invalid;
    }
    // Components of groups sharing tensors (the planner's conservative duplicate scope).
    let mut comp: Vec<usize> = (0..ng).collect();
    loop {
        let mut changed = false;
        for a in 0..ng {
            for b in 0..ng {
                let share = l.groups[a]
                    .iter()
                    .any(|x| l.groups[b].iter().any(|y| y.tensor_idx == x.tensor_idx));
                if share && comp[a] != comp[b] {
                    let m = comp[a].min(comp[b]);
                    comp[a] = m;
                    comp[b] = m;
                    changed = true;
                }
            }
        }
        if !changed {
            break;
        }
    }
    let mut e = Expect::default();
    let mut real: HashSet<(usize, u128)> = HashSet::new();
    let mut scoped: HashSet<(usize, u128)> = HashSet::new();
    let (mut real_dup, mut scoped_dup) = (false, false);
    for (g, &(go, co, size, skip)) in spans.iter().enumerate() {
        let refs = &l.groups[g];
        let bpb: u128 = refs.iter().map(|r| u128::from(r.page_size_bytes)).sum();
        e.total += size as u128 * bpb;
        e.block_copies += (size * refs.len()) as u128;
        for k in 0..size {
            let gid = u128::from(j.ids[go + k] as u64);
            let s = skip + k as u128;
            let cb = u128::from(j.cpu[co + (s / f) as usize] as u64);
            let jj = s % f;
            let unit = match j.direction {
                Direction::CpuToGpu => gid,
                Direction::GpuToCpu => cb * f + jj,
            };
            if !refs.is_empty() && !scoped.insert((comp[g], unit)) {
                scoped_dup = true;
            }
            for r in refs {
                let t = r.tensor_idx;
                if !real.insert((t, unit)) {
                    real_dup = true;
                }
                let (gd, cd) = (&l.gpu[t], &l.cpu[t]);
                let gptr = u128::from(gd.base_ptr) + gid * u128::from(gd.row_stride_bytes);
                let cptr = u128::from(cd.base_ptr)
                    + cb * u128::from(cd.row_stride_bytes)
                    + jj * (u128::from(cd.row_bytes) / f);
                // Inside a validated tensor: fits.
                let (gptr, cptr) = (gptr as u64, cptr as u64);
                e.pieces.push(match j.direction {
                    Direction::GpuToCpu => (gptr, cptr, r.page_size_bytes),
                    Direction::CpuToGpu => (cptr, gptr, r.page_size_bytes),
                });
            }
        }
    }
    let too_big = e.total > u128::from(u64::MAX)
        || e.block_copies > u128::from(kvoff::plan::MAX_BLOCK_COPIES);
    e.must_err = real_dup || too_big;
    e.must_ok = !scoped_dup && !too_big;
    e
}

/// Merged address ranges `[start, end)` of one side's tensors.
fn side_ranges(descs: &[TensorDesc]) -> Vec<(u128, u128)> {
    let mut v: Vec<(u128, u128)> = descs.iter().filter_map(range_of).collect();
    v.sort_unstable();
    let mut out: Vec<(u128, u128)> = Vec::new();
    for (s, e) in v {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

fn inside(ranges: &[(u128, u128)], ptr: u64, bytes: u64) -> bool {
    let (s, e) = (u128::from(ptr), u128::from(ptr) + u128::from(bytes));
    ranges.iter().any(|&(a, b)| a <= s && e <= b)
}

fn verify_plan(plan: &CopyPlan, e: &Expect, l: &PlanLayout, j: &Job) -> Result<(), TestCaseError> {
    let ctx = || format!("layout {l:?}, job {j:?}, plan {:?}", plan.copies());
    prop_assert_eq!(plan.direction(), j.direction);
    prop_assert_eq!(u128::from(plan.total_bytes()), e.total, "{}", ctx());
    prop_assert_eq!(
        u128::from(plan.num_block_copies()),
        e.block_copies,
        "{}",
        ctx()
    );
    let sum: u128 = plan.copies().iter().map(|c| u128::from(c.bytes)).sum();
    prop_assert_eq!(sum, e.total, "{}", ctx());
    prop_assert_eq!(plan.is_empty(), e.pieces.is_empty());
    // Within the described tensors.
    let (src_side, dst_side) = match j.direction {
        Direction::GpuToCpu => (&l.gpu, &l.cpu),
        Direction::CpuToGpu => (&l.cpu, &l.gpu),
    };
    let (srcs, dsts) = (side_ranges(src_side), side_ranges(dst_side));
    for c in plan.copies() {
        prop_assert!(c.bytes > 0, "{}", ctx());
        prop_assert!(
            inside(&srcs, c.src_ptr, c.bytes),
            "source outside: {:?} {}",
            c,
            ctx()
        );
        prop_assert!(
            inside(&dsts, c.dst_ptr, c.bytes),
            "destination outside: {:?} {}",
            c,
            ctx()
        );
    }
    // Exactly the model's per-block copies, merged.
    let mut want: HashMap<(u64, u64), Vec<u64>> = HashMap::new();
    for &(s, d, b) in &e.pieces {
        want.entry((s, d)).or_default().push(b);
    }
    for c in plan.copies() {
        let mut pos = 0u64;
        while pos < c.bytes {
            let key = (c.src_ptr + pos, c.dst_ptr + pos);
            let left = c.bytes - pos;
            // Tensors that share memory can give one address pair several pieces: take the one
            // that ends the copy, else the largest one after which the copy can go on.
            let continues = |b: u64| {
                want.get(&(key.0 + b, key.1 + b))
                    .is_some_and(|v| !v.is_empty())
            };
            let pick = want.get(&key).and_then(|v| {
                v.iter().position(|&b| b == left).or_else(|| {
                    (0..v.len())
                        .filter(|&i| v[i] < left && continues(v[i]))
                        .max_by_key(|&i| v[i])
                })
            });
            let bytes = pick.map(|i| want.get_mut(&key).unwrap().swap_remove(i));
            let Some(b) = bytes else {
                return Err(TestCaseError::fail(format!(
                    "copy {c:?} at +{pos} is no model copy: {}",
                    ctx()
                )));
            };
            pos += b;
        }
        prop_assert_eq!(pos, c.bytes, "{}", ctx());
    }
    prop_assert!(
        want.values().all(Vec::is_empty),
        "model copies missing from the plan: {}",
        ctx()
    );
    // Merged where possible (invariant 4).
    for w in plan.copies().windows(2) {
        prop_assert!(
            !(w[0].src_ptr + w[0].bytes == w[1].src_ptr
                && w[0].dst_ptr + w[0].bytes == w[1].dst_ptr),
            "adjacent copies not merged: {:?} {}",
            w,
            ctx()
        );
    }
    // No byte written twice.
    if l.disjoint {
        let mut d: Vec<(u64, u64)> = plan.copies().iter().map(|c| (c.dst_ptr, c.bytes)).collect();
        d.sort_unstable();
        for w in d.windows(2) {
            prop_assert!(
                u128::from(w[0].0) + u128::from(w[0].1) <= u128::from(w[1].0),
                "destinations overlap: {:?} {}",
                w,
                ctx()
            );
        }
    }
    Ok(())
}

/// Checks one job; `Ok(true)` when the plan was made, `Ok(false)` when it was (rightly) refused.
fn check_job(p: &CopyPlanner, l: &PlanLayout, j: &Job) -> Result<bool, TestCaseError> {
    let e = model_plan(l, j);
    let spec = GpuSpec {
        block_ids: &j.ids,
        group_sizes: j.sizes.as_deref(),
        block_indices: j.indices.as_deref(),
    };
    let input = (l, j);
    let got = guarded("CopyPlanner::plan", &input, || {
        p.plan(j.direction, &spec, &j.cpu)
    })?;
    match &got {
        Err(err) => {
            prop_assert!(
                !e.must_ok,
                "plan failed ({}) but the model accepts it: layout {:?}, job {:?}",
                err,
                l,
                j
            );
            prop_assert!(matches!(err, KvoffError::InvalidArgument(_)), "{}", err);
        }
        Ok(plan) => {
            prop_assert!(
                !e.must_err,
                "plan succeeded but the model rejects it: layout {:?}, job {:?}, plan {:?}",
                l,
                j,
                plan
            );
            verify_plan(plan, &e, l, j)?;
        }
    }
    // `plan_into` agrees and leaves nothing half-planned on error.
    let mut out = CopyPlan::from_copies(
        Direction::CpuToGpu,
        vec![kvoff::plan::CopyOp {
            src_ptr: 1,
            dst_ptr: 2,
            bytes: 3,
        }],
    )
    .unwrap();
    let r = guarded("CopyPlanner::plan_into", &input, || {
        p.plan_into(j.direction, &spec, &j.cpu, &mut out)
    })?;
    match (&got, r) {
        (Ok(plan), Ok(())) => prop_assert_eq!(plan, &out),
        (Err(_), Err(_)) => prop_assert!(out.is_empty() && out.total_bytes() == 0),
        (a, b) => prop_assert!(false, "plan {:?} but plan_into {:?}", a, b),
    }
    Ok(got.is_ok())
}

/// Outcomes seen by [`check_layout`] on this thread: (layouts, planners built, plans Ok, plans
/// Err, Ok plans of huge or big-page layouts).
#[derive(Debug, Default, Clone, Copy)]
struct Coverage {
    layouts: u64,
    planners: u64,
    plans_ok: u64,
    plans_err: u64,
    plans_ok_extreme: u64,
}

thread_local! {
    static COVERAGE: Cell<Coverage> = Cell::new(Coverage::default());
}

fn tally(f: impl FnOnce(&mut Coverage)) {
    COVERAGE.with(|c| {
        let mut v = c.get();
        f(&mut v);
        c.set(v);
    });
}

fn check_layout(seed: u64) -> Result<(), TestCaseError> {
    let mut r = Rng(seed);
    let l = make_layout(&mut r);
    let want_ok = model_new(&l);
    let got = guarded("CopyPlanner::new", &l, || {
        CopyPlanner::new(l.gpu.clone(), l.cpu.clone(), l.groups.clone(), l.f)
    })?;
    prop_assert_eq!(
        got.is_ok(),
        want_ok,
        "CopyPlanner::new on {:?} ({}): {:?}",
        l,
        l.kind,
        got.as_ref().err()
    );
    tally(|c| c.layouts += 1);
    let Ok(p) = got else {
        return Ok(());
    };
    tally(|c| c.planners += 1);
    prop_assert_eq!(p.num_groups(), l.groups.len());
    for _ in 0..JOBS_PER_LAYOUT {
        let j = make_job(&mut r, &l);
        let ok = check_job(&p, &l, &j)?;
        let extreme = matches!(l.kind, "huge" | "big_pages");
        tally(|c| {
            if ok {
                c.plans_ok += 1;
                c.plans_ok_extreme += u64::from(extreme);
            } else {
                c.plans_err += 1;
            }
        });
    }
    Ok(())
}

/// The generators reach both outcomes often: most layouts build, and jobs give Ok plans (also on
/// huge and big-page layouts) as well as errors.
#[test]
fn generators_cover_ok_and_err() {
    for seed in 0..400u64 {
        check_layout(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)).unwrap();
    }
    let c = COVERAGE.with(Cell::get);
    eprintln!("{c:?}");
    assert!(c.planners * 2 > c.layouts, "{c:?}");
    assert!(c.plans_ok * 3 > c.plans_ok + c.plans_err, "{c:?}");
    assert!(c.plans_err * 5 > c.plans_ok + c.plans_err, "{c:?}");
    assert!(c.plans_ok_extreme * 20 > c.plans_ok, "{c:?}");
}

// ---------------------------------------------------------------------------------------------
// Regressions found by the fuzzer (each failed on the code before its fix)
// ---------------------------------------------------------------------------------------------

/// Per-block byte counts near 2^63 on tensors sharing memory: the plan's total overflowed `u64`
/// (a panic in debug builds, a wrapped total in release). Now an error.
#[test]
fn total_bytes_beyond_u64_is_an_error() {
    let page = 1u64 << 61;
    let gpu = vec![TensorDesc::contiguous(1 << 20, 1, page); 4];
    let cpu = vec![TensorDesc::contiguous(1 << 63, 1, page * 2); 4];
    let refs = vec![(0..4).map(|t| PlanRef::new(t, page)).collect()];
    let p = CopyPlanner::new(gpu, cpu, refs, 2).unwrap();
    // One block: 4 x 2^61 = 2^63 bytes, fine.
    let ok = p
        .plan(Direction::GpuToCpu, &GpuSpec::new(&[0]), &[0])
        .unwrap();
    assert_eq!(ok.total_bytes(), 1 << 63);
    // Two blocks (the same source twice, two sub-blocks of CPU block 0): 2^64 bytes.
    let r = guarded("plan", &"2 x 2^63", || {
        p.plan(Direction::GpuToCpu, &GpuSpec::new(&[0, 0]), &[0])
    })
    .unwrap();
    match r {
        Err(KvoffError::InvalidArgument(m)) => assert!(m.contains("overflow"), "{m}"),
        other => panic!("expected an overflow error, got {other:?}"),
    }
}

/// A tensor of 2^40 blocks (valid: 1-byte rows) made every plan size its duplicate-destination
/// bitmap by the tensor (2^34 words = 128 GiB, an abort). The check now works on the job's own
/// ids for tensors that large.
#[test]
fn huge_tensors_do_not_size_the_duplicate_check() {
    let nb = 1u64 << 40;
    let gpu = vec![TensorDesc::contiguous(1 << 20, nb, 1)];
    let cpu = vec![TensorDesc::contiguous(1 << 62, nb, 2)];
    let p = CopyPlanner::new(gpu, cpu, vec![vec![PlanRef::new(0, 1)]], 2).unwrap();
    let top = (nb - 1) as i64;
    for direction in [Direction::CpuToGpu, Direction::GpuToCpu] {
        let plan = guarded("plan", &direction, || {
            p.plan(direction, &GpuSpec::new(&[top, 5, 6]), &[top, 9])
        })
        .unwrap()
        .unwrap();
        assert_eq!(plan.total_bytes(), 3);
        let dup = guarded("plan", &direction, || match direction {
            Direction::CpuToGpu => p.plan(direction, &GpuSpec::new(&[top, 5, top]), &[1, 2]),
            Direction::GpuToCpu => p.plan(direction, &GpuSpec::new(&[1, 2, 3, 4]), &[top, top]),
        })
        .unwrap();
        match dup {
            Err(KvoffError::InvalidArgument(m)) => {
                assert!(m.contains("same destination"), "{m}");
                assert!(m.contains(&format!("{top}")), "{m}");
            }
            other => panic!("expected a duplicate-destination error, got {other:?}"),
        }
    }
}

/// More per-block copies than `MAX_BLOCK_COPIES` are refused before anything is reserved (the
/// old code reserved 24 bytes per copy up front: 6 GiB here).
#[test]
fn jobs_beyond_the_copy_cap_are_errors() {
    let n = 64usize;
    let gpu: Vec<TensorDesc> = (0..n)
        .map(|t| TensorDesc::contiguous((1 << 20) + (t as u64) * 4096, 1, 64))
        .collect();
    let cpu: Vec<TensorDesc> = (0..n)
        .map(|t| TensorDesc::contiguous((1 << 40) + (t as u64) * (1 << 30), 1 << 23, 64))
        .collect();
    let refs = vec![(0..n).map(|t| PlanRef::new(t, 64)).collect()];
    let p = CopyPlanner::new(gpu, cpu, refs, 1).unwrap();
    let per_block = n as u64;
    let blocks = (kvoff::plan::MAX_BLOCK_COPIES / per_block + 1) as usize;
    let gids = vec![0i64; blocks];
    let cids: Vec<i64> = (0..blocks as i64).collect();
    let r = guarded("plan", &"over the copy cap", || {
        p.plan(Direction::GpuToCpu, &GpuSpec::new(&gids), &cids)
    })
    .unwrap();
    match r {
        Err(KvoffError::InvalidArgument(m)) => assert!(m.contains("copies"), "{m}"),
        other => panic!("expected an error, got {:?}", other.map(|p| p.len())),
    }
}
