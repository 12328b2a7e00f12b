//! Pitched (2D) DMA: a job's copies that form a regular grid — equal sizes, source and
//! destination each advancing by a constant stride — move as one `cuMemcpy2DAsync` per run
//! instead of one batch entry per copy.
//!
//! Why: the driver spends about a microsecond of CPU per entry of a batched copy, so 4 KiB pages
//! move at 4–9 GB/s by batched DMA however the batch is cut, and 32 KiB pages at ~33 GB/s per
//! thread. A pitched copy of 64 rows costs 2–4 µs of CPU and the copy engines run it at 31–40
//! GB/s for 4 KiB rows and 47–52 GB/s from 16 KiB rows (93% of the contiguous copy), measured on
//! an H100 (docs/performance.md) — with no SMs and a single pass over device memory, which is
//! what a model computing beside the transfer can afford.
//!
//! kvoff's planner emits copies block by block, each block's pages tensor after tensor: when the
//! GPU tensors lie at a constant distance from each other (one allocation, or equal-sized
//! allocations placed one after another) and the host block is contiguous, a block is one run.
//! Failing that, the copies sorted by source address put each tensor's consecutive blocks next
//! to each other, which is a run when the other side's blocks are consecutive too.
#![forbid(unsafe_code)]

/// Fewest rows worth a pitched copy (a 2D call costs about as much CPU as three batch entries).
pub(crate) const MIN_ROWS: usize = 4;

/// Largest row pitch used (the driver's limit for pitched copies is `CU_DEVICE_ATTRIBUTE_MAX_PITCH`,
/// 2^31 − 1 on current GPUs); farther rows go by batched DMA.
pub(crate) const MAX_PITCH: u64 = (1 << 31) - 1;

/// `rows` copies of `width` bytes: row `i` from `src + i·spitch` to `dst + i·dpitch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pitched {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) width: u64,
    pub(crate) spitch: u64,
    pub(crate) dpitch: u64,
    pub(crate) rows: u64,
}

impl Pitched {
    /// The copies the run stands for, `(src, dst, bytes)`.
    pub(crate) fn rows(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        (0..self.rows).map(move |i| {
            (
                self.src + i * self.spitch,
                self.dst + i * self.dpitch,
                self.width,
            )
        })
    }
}

/// The stride from `a` to `b` when it can be a row pitch for rows of `width` bytes.
fn pitch(a: u64, b: u64, width: u64) -> Option<u64> {
    let d = b.checked_sub(a)?;
    (d >= width && d <= MAX_PITCH).then_some(d)
}

/// Where a run starting at `(src, dst)` must end: `(src_end, dst_end)`, the first addresses past
/// the allocations holding `src` and `dst` (`u64::MAX`: no bound known). The driver refuses a
/// pitched copy whose rows span two allocations (`CUDA_ERROR_INVALID_VALUE`, measured on an H100
/// with adjacent 2 MiB allocations), so a run stops at its first row's allocation's end.
pub(crate) type Limit<'a> = &'a mut dyn FnMut(u64, u64) -> (u64, u64);

/// No bound: every address lies in one allocation (tests, and memory kvoff allocated in one piece).
#[cfg(test)]
pub(crate) fn unbounded(_: u64, _: u64) -> (u64, u64) {
    (u64::MAX, u64::MAX)
}

/// Length of the run of `(src, dst, bytes)` triples starting at `i` (1 when none); `get(j)` is
/// the `j`-th triple, `None` past the end; rows stay within `limit`.
fn run_len(get: &impl Fn(usize) -> Option<(u64, u64, u64)>, i: usize, limit: Limit<'_>) -> usize {
    let (Some((s0, d0, w)), Some((s1, d1, w1))) = (get(i), get(i + 1)) else {
        return 1;
    };
    let (Some(sp), Some(dp)) = (pitch(s0, s1, w), pitch(d0, d1, w)) else {
        return 1;
    };
    if w1 != w || w == 0 {
        return 1;
    }
    // Every caller counts a run shorter than MIN_ROWS as none: check that the pitch goes on that
    // far before asking for the allocation bound (a per-copy lookup that made this scan cost
    // ~30 ns a copy on jobs without runs, docs/performance.md "The cost of a submit").
    for k in 2..MIN_ROWS {
        let at = |base: u64, p: u64| p.checked_mul(k as u64).and_then(|o| base.checked_add(o));
        let Some((s, d, ww)) = get(i + k) else {
            return 1;
        };
        if ww != w || Some(s) != at(s0, sp) || Some(d) != at(d0, dp) {
            return 1;
        }
    }
    let (s_end, d_end) = limit(s0, d0);
    let inside = |s: u64, d: u64| {
        s.checked_add(w).is_some_and(|e| e <= s_end) && d.checked_add(w).is_some_and(|e| e <= d_end)
    };
    if !inside(s1, d1) {
        return 1;
    }
    let (mut j, mut prev) = (i + 1, (s1, d1));
    while let Some((s, d, ww)) = get(j + 1) {
        if ww != w
            || s.checked_sub(prev.0) != Some(sp)
            || d.checked_sub(prev.1) != Some(dp)
            || !inside(s, d)
        {
            break;
        }
        prev = (s, d);
        j += 1;
    }
    j - i + 1
}

/// Device allocations seen by an engine, `[start, end)`, sorted and disjoint: the bound of a
/// pitched run's device side ([`Limit`]) without a driver call per run. Entries are never
/// checked again: an allocation freed and replaced by others of different bounds leaves a stale
/// entry, which costs only speed (the driver refuses a run that spans two allocations, and its
/// rows then go as batch entries). Cleared when it grows past [`AllocRanges::MAX`] entries.
#[derive(Debug, Default)]
pub(crate) struct AllocRanges {
    ranges: Vec<(u64, u64)>,
}

impl AllocRanges {
    /// Most entries kept.
    pub(crate) const MAX: usize = 4096;

    /// The end of the allocation holding `ptr`, asking `query` (`(base, bytes)` or `None`) when
    /// no known allocation holds it; `u64::MAX` when `query` does not know either.
    pub(crate) fn end_of(
        &mut self,
        ptr: u64,
        query: impl FnOnce(u64) -> Option<(u64, u64)>,
    ) -> u64 {
        let i = self.ranges.partition_point(|&(start, _)| start <= ptr);
        if let Some(&(_, end)) = i.checked_sub(1).and_then(|k| self.ranges.get(k)) {
            if ptr < end {
                return end;
            }
        }
        let Some((base, bytes)) = query(ptr) else {
            return u64::MAX;
        };
        let end = base.saturating_add(bytes);
        if !(base <= ptr && ptr < end) {
            return u64::MAX;
        }
        if self.ranges.len() >= Self::MAX {
            self.ranges.clear();
        }
        // Drop stale entries that overlap the new one, then insert it in order.
        self.ranges.retain(|&(s, e)| e <= base || s >= end);
        let at = self.ranges.partition_point(|&(s, _)| s < base);
        self.ranges.insert(at, (base, end));
        end
    }
}

/// Fewest bytes a pitched run must move for `auto` to count on it when it chooses DMA for the
/// sake of pitched copies (the grouping itself still uses runs from [`MIN_ROWS`] rows: a short run
/// costs no more CPU than its rows as batch entries). A 2D call costs 2–4 µs of CPU, so short runs
/// leave DMA bound by the driver: on an H100, per-layer tensors from torch's caching allocator
/// (512 KiB each, four to a 2 MiB segment) gave 4-row runs of 16 KiB at 4 KiB pages, and DMA
/// moved 3.0 GB/s beside a GEMM (4 KiB × 8 MiB, both directions) where the staged pipeline moved
/// 9.6 within the budget; a block's pages across 64 evenly spaced tensors (256 KiB runs) move at
/// 27–29 GB/s (docs/performance.md, "How `auto` chooses a copy method").
pub(crate) const CHOICE_MIN_RUN_BYTES: u64 = 64 << 10;

/// Fewest rows a pitched run must have for `auto` to count on it beside a model, whatever its
/// bytes. Measured on an H100 beside a memory-bound kernel at the HBM's peak, 32 KiB pages of
/// torch's small-pool tensors (four 512 KiB tensors to a 2 MiB segment: 4-row runs) moved
/// 9.0–10.4 GB/s as pitched copies and 19.8–26.5 as batch entries (8 MiB stores), while a
/// block's pages across 64 evenly spaced tensors (64-row runs) moved 38.7 pitched against 31.9
/// (docs/performance.md, "How `auto` chooses a copy method").
pub(crate) const CHOICE_MIN_ROWS: u64 = 16;

/// The bytes a pitched run of copies averaging `avg_copy` bytes must move to count for `auto`:
/// [`CHOICE_MIN_RUN_BYTES`] and [`CHOICE_MIN_ROWS`] rows.
#[must_use]
pub(crate) fn choice_min_run_bytes(avg_copy: u64) -> u64 {
    CHOICE_MIN_RUN_BYTES.max(avg_copy.saturating_mul(CHOICE_MIN_ROWS))
}

/// How many of `n` copies (the `j`-th is `get(j)`) fall in runs of at least [`MIN_ROWS`] rows
/// and `min_run_bytes` bytes when grouped in order, as [`group`] first tries (no allocation).
#[cfg(test)]
pub(crate) fn pitched_copies(
    n: usize,
    min_run_bytes: u64,
    get: impl Fn(usize) -> Option<(u64, u64, u64)>,
    limit: Limit<'_>,
) -> usize {
    pitched_scan(n, min_run_bytes, None, get, limit)
}

/// As [`pitched_copies`], but stops as soon as it is known whether at least `need` copies fall
/// in runs: the count returned is then at least `need`, or below it. `auto` asks only whether
/// half of a job's copies do, so a job without runs is scanned half-way.
pub(crate) fn pitched_copies_until(
    n: usize,
    min_run_bytes: u64,
    need: usize,
    get: impl Fn(usize) -> Option<(u64, u64, u64)>,
    limit: Limit<'_>,
) -> usize {
    pitched_scan(n, min_run_bytes, Some(need), get, limit)
}

fn pitched_scan(
    n: usize,
    min_run_bytes: u64,
    need: Option<usize>,
    get: impl Fn(usize) -> Option<(u64, u64, u64)>,
    limit: Limit<'_>,
) -> usize {
    let (mut covered, mut i) = (0, 0);
    while i < n {
        if let Some(need) = need {
            if covered >= need || covered.saturating_add(n - i) < need {
                break;
            }
        }
        let r = run_len(&get, i, limit);
        if r >= MIN_ROWS {
            let width = get(i).map_or(0, |c| c.2);
            if (r as u64).saturating_mul(width) >= min_run_bytes {
                covered += r;
            }
            i += r;
        } else {
            i += 1;
        }
    }
    covered
}

/// Runs of `c` in its order, greedy: `out` gets the runs of at least [`MIN_ROWS`] rows, the
/// returned vector the copies left over (in order).
fn group_in_order(
    c: &[(u64, u64, u64)],
    out: &mut Vec<Pitched>,
    limit: Limit<'_>,
) -> Vec<(u64, u64, u64)> {
    let mut rest = Vec::new();
    let mut i = 0;
    let get = |j: usize| c.get(j).copied();
    while i < c.len() {
        let n = run_len(&get, i, limit);
        if n >= MIN_ROWS {
            let (s0, d0, w) = c[i];
            let (s1, d1, _) = c[i + 1];
            out.push(Pitched {
                src: s0,
                dst: d0,
                width: w,
                spitch: s1 - s0,
                dpitch: d1 - d0,
                rows: n as u64,
            });
            i += n;
        } else {
            rest.push(c[i]);
            i += 1;
        }
    }
    rest
}

/// Splits `copies` into pitched runs (appended to `out`) and the copies left over (left in
/// `copies`): first in the given order; when under half of the copies form runs that way, also
/// sorted by source address (each tensor's consecutive blocks next to each other), keeping
/// whichever needs fewer operations. Every copy ends up in exactly one place.
pub(crate) fn group(copies: &mut Vec<(u64, u64, u64)>, out: &mut Vec<Pitched>, limit: Limit<'_>) {
    if copies.len() < MIN_ROWS {
        return;
    }
    let mut a = Vec::new();
    let rest_a = group_in_order(copies, &mut a, limit);
    if 2 * (copies.len() - rest_a.len()) >= copies.len() {
        out.extend(a);
        *copies = rest_a;
        return;
    }
    let mut sorted = copies.clone();
    sorted.sort_unstable();
    let mut b = Vec::new();
    let rest_b = group_in_order(&sorted, &mut b, limit);
    if b.len() + rest_b.len() < a.len() + rest_a.len() {
        out.extend(b);
        *copies = rest_b;
    } else {
        out.extend(a);
        *copies = rest_a;
    }
}

#[cfg(test)]
mod tests {
    use super::{
        choice_min_run_bytes, group, pitched_copies, pitched_copies_until, unbounded, AllocRanges,
        Pitched, CHOICE_MIN_RUN_BYTES, MAX_PITCH, MIN_ROWS,
    };

    fn cov(c: &[(u64, u64, u64)]) -> usize {
        let full = pitched_copies(c.len(), 0, |j| c.get(j).copied(), &mut unbounded);
        // The early-stopping scan gives the same answer to "at least half?".
        let need = c.len().div_ceil(2);
        let early = pitched_copies_until(c.len(), 0, need, |j| c.get(j).copied(), &mut unbounded);
        assert_eq!(early >= need, full >= need, "{early} {full} of {}", c.len());
        full
    }

    /// Expands runs and leftovers back into copies, sorted.
    fn expand(runs: &[Pitched], rest: &[(u64, u64, u64)]) -> Vec<(u64, u64, u64)> {
        let mut v: Vec<_> = runs.iter().flat_map(Pitched::rows).collect();
        v.extend_from_slice(rest);
        v.sort_unstable();
        v
    }

    fn check(copies: Vec<(u64, u64, u64)>) -> (Vec<Pitched>, Vec<(u64, u64, u64)>) {
        let mut want = copies.clone();
        want.sort_unstable();
        let (mut rest, mut runs) = (copies, Vec::new());
        group(&mut rest, &mut runs, &mut unbounded);
        assert_eq!(expand(&runs, &rest), want, "every copy exactly once");
        for r in &runs {
            assert!(r.rows >= MIN_ROWS as u64);
            assert!(
                r.spitch >= r.width && r.dpitch >= r.width,
                "rows never overlap"
            );
            assert!(r.spitch <= MAX_PITCH && r.dpitch <= MAX_PITCH);
        }
        (runs, rest)
    }

    /// kvoff's layout: tensor t's block g at `gpu + (t·ngpu + g)·page`, host block c contiguous.
    fn kv(page: u64, tensors: u64, ngpu: u64, blocks: &[(u64, u64)]) -> Vec<(u64, u64, u64)> {
        let (gpu, host) = (1 << 40, 1 << 44);
        blocks
            .iter()
            .flat_map(|&(g, c)| {
                (0..tensors).map(move |t| {
                    (
                        gpu + (t * ngpu + g) * page,
                        host + (c * tensors + t) * page,
                        page,
                    )
                })
            })
            .collect()
    }

    #[test]
    fn a_block_of_evenly_spaced_tensors_is_one_run() {
        let c = kv(4096, 64, 100, &[(7, 3), (2, 9), (50, 0)]);
        assert_eq!(cov(&c), 192);
        let (runs, rest) = check(c);
        assert_eq!(runs.len(), 3);
        assert!(rest.is_empty());
        assert_eq!(runs[0].spitch, 100 * 4096);
        assert_eq!(runs[0].dpitch, 4096);
        assert_eq!(runs[0].rows, 64);
    }

    #[test]
    fn runs_stop_at_allocation_ends() {
        // 64 tensors of 512 KiB (128 blocks of 4 KiB) in adjacent 2 MiB allocations, four to
        // each: evenly spaced, but the driver refuses a pitched copy spanning two allocations.
        let c = kv(4096, 64, 128, &[(5, 1), (90, 7)]);
        let (gpu, seg) = (1u64 << 40, 2u64 << 20);
        let mut allocs = AllocRanges::default();
        let mut queries = 0;
        let mut limit = |s: u64, _d: u64| {
            let end = allocs.end_of(s, |p| {
                queries += 1;
                Some((gpu + (p - gpu) / seg * seg, seg))
            });
            (end, u64::MAX)
        };
        let (mut rest, mut runs) = (c.clone(), Vec::new());
        group(&mut rest, &mut runs, &mut limit);
        assert!(rest.is_empty());
        assert_eq!(runs.len(), 32, "one 4-row run per allocation and block");
        for r in &runs {
            assert_eq!(r.rows, 4);
            let last = r.src + (r.rows - 1) * r.spitch + r.width;
            assert_eq!(
                (r.src - gpu) / seg,
                (last - 1 - gpu) / seg,
                "within one allocation"
            );
        }
        let get = |j: usize| c.get(j).copied();
        assert_eq!(pitched_copies(c.len(), 0, get, &mut limit), 128);
        assert_eq!(
            pitched_copies(c.len(), CHOICE_MIN_RUN_BYTES, get, &mut limit),
            0,
            "16 KiB runs do not make the job a pitched one"
        );
        assert_eq!(queries, 16, "one driver query per allocation");
        assert_eq!(
            pitched_copies(c.len(), CHOICE_MIN_RUN_BYTES, get, &mut unbounded),
            128
        );
    }

    #[test]
    fn large_copies_count_only_in_long_runs() {
        // 4 KiB pages: the 64 KiB floor (16 rows) as before.
        assert_eq!(choice_min_run_bytes(4096), CHOICE_MIN_RUN_BYTES);
        // 32 KiB pages: 16 rows (512 KiB). Four 512 KiB tensors to a 2 MiB allocation give 4-row
        // runs of 128 KiB, which no longer make the job a pitched one; 64 evenly spaced tensors
        // in one allocation (64-row runs) still do.
        let page = 32u64 << 10;
        assert_eq!(choice_min_run_bytes(page), 512 << 10);
        let small_pool = kv(page, 64, 16, &[(5, 1), (9, 7)]);
        let (gpu, seg) = (1u64 << 40, 2u64 << 20);
        let mut allocs = AllocRanges::default();
        let mut limit = |s: u64, _d: u64| {
            (
                allocs.end_of(s, |p| Some((gpu + (p - gpu) / seg * seg, seg))),
                u64::MAX,
            )
        };
        let get = |j: usize| small_pool.get(j).copied();
        assert_eq!(
            pitched_copies(small_pool.len(), CHOICE_MIN_RUN_BYTES, get, &mut limit),
            128,
            "4-row runs of 128 KiB pass the bytes floor alone"
        );
        assert_eq!(
            pitched_copies(
                small_pool.len(),
                choice_min_run_bytes(page),
                get,
                &mut limit
            ),
            0
        );
        let one_alloc = kv(page, 64, 100, &[(5, 1), (9, 7)]);
        let get = |j: usize| one_alloc.get(j).copied();
        assert_eq!(
            pitched_copies(
                one_alloc.len(),
                choice_min_run_bytes(page),
                get,
                &mut unbounded
            ),
            128
        );
        // Huge copies never overflow.
        assert_eq!(choice_min_run_bytes(u64::MAX), u64::MAX);
    }

    #[test]
    fn alloc_ranges_cache_replace_and_refuse() {
        let mut a = AllocRanges::default();
        let mut q = 0;
        assert_eq!(
            a.end_of(100, |_| {
                q += 1;
                Some((50, 100))
            }),
            150
        );
        assert_eq!(
            a.end_of(149, |_| {
                q += 1;
                None
            }),
            150,
            "cached"
        );
        assert_eq!(q, 1);
        assert_eq!(a.end_of(150, |_| None), u64::MAX, "unknown: no bound");
        assert_eq!(
            a.end_of(7, |_| Some((50, 10))),
            u64::MAX,
            "an answer not holding ptr"
        );
        // A new allocation overlapping a stale entry replaces it.
        assert_eq!(a.end_of(10, |_| Some((0, 60))), 60);
        assert_eq!(
            a.end_of(100, |_| Some((60, 1000))),
            1060,
            "the stale [50, 150) is gone"
        );
        for i in 0..AllocRanges::MAX as u64 + 5 {
            let base = 1 << 20 | i << 8;
            assert_eq!(a.end_of(base, |_| Some((base, 256))), base + 256);
        }
        assert!(a.ranges.len() <= AllocRanges::MAX);
        assert!(
            a.ranges.windows(2).all(|w| w[0].1 <= w[1].0),
            "sorted, disjoint"
        );
    }

    #[test]
    fn short_runs_do_not_count_for_the_choice() {
        // Four tensors to a 2 MiB segment (torch's small pool), segments far apart: 4-row runs.
        let mut c = Vec::new();
        for (b, &g) in [3u64, 40, 17].iter().enumerate() {
            for t in 0..16u64 {
                let seg = (1u64 << 36) + (t / 4) * (1 << 30) + (t % 4) * (512 << 10);
                c.push((
                    seg + g * 4096,
                    (1u64 << 44) + (b as u64 * 16 + t) * 4096,
                    4096,
                ));
            }
        }
        assert_eq!(cov(&c), 48, "every copy is in a 4-row run");
        let long = |c: &[(u64, u64, u64)]| {
            pitched_copies(
                c.len(),
                CHOICE_MIN_RUN_BYTES,
                |j| c.get(j).copied(),
                &mut unbounded,
            )
        };
        assert_eq!(long(&c), 0, "16 KiB runs are too short to choose DMA for");
        let evenly = kv(4096, 64, 100, &[(7, 3), (2, 9)]);
        assert_eq!(long(&evenly), 128, "256 KiB runs count");
        let sixteen = kv(4096, 16, 100, &[(7, 3)]);
        assert_eq!(long(&sixteen), 16, "a 64 KiB run counts");
        check(c);
    }

    #[test]
    fn consecutive_blocks_of_unevenly_spaced_tensors_run_after_sorting() {
        // Tensors at irregular bases; GPU blocks 10..20 and host blocks 5..15, both consecutive.
        let bases = [1u64 << 32, (1 << 32) + 9_000_000, (1 << 33) + 77 * 4096];
        let mut c = Vec::new();
        for b in 0..10u64 {
            for (t, &base) in bases.iter().enumerate() {
                c.push((
                    base + (10 + b) * 4096,
                    (1u64 << 44) + ((5 + b) * 3 + t as u64) * 4096,
                    4096,
                ));
            }
        }
        assert_eq!(cov(&c), 0, "no run in emission order");
        let (runs, rest) = check(c);
        assert_eq!(runs.len(), 3, "one run per tensor: {runs:?}");
        assert!(rest.is_empty());
        assert!(runs
            .iter()
            .all(|r| r.spitch == 4096 && r.dpitch == 3 * 4096));
    }

    #[test]
    fn irregular_jobs_stay_copies() {
        // Random blocks, tensors far apart (beyond the pitch limit), mixed sizes, descending
        // addresses, overlapping strides, zero-byte copies.
        let far = kv(4096, 8, (MAX_PITCH / 4096) + 10, &[(1, 1), (5, 2)]);
        let (runs, rest) = check(far);
        assert!(runs.is_empty() && rest.len() == 16);
        let down: Vec<_> = (0..10u64)
            .rev()
            .map(|i| (i * 8192, i * 8192 + (1 << 40), 4096))
            .collect();
        let (runs, _) = check(down);
        // Descending in emission order, ascending once sorted: one run after sorting.
        assert_eq!(runs.len(), 1);
        let tight: Vec<_> = (0..10u64)
            .map(|i| (i * 100, (1 << 40) + i * 4096, 4096))
            .collect();
        let (runs, rest) = check(tight);
        assert!(
            runs.is_empty() && rest.len() == 10,
            "a pitch under the width is no run"
        );
        let mixed: Vec<_> = (0..12u64)
            .map(|i| {
                (
                    i * 8192,
                    (1 << 40) + i * 8192,
                    if i % 2 == 0 { 4096 } else { 2048 },
                )
            })
            .collect();
        assert!(check(mixed).0.is_empty());
        let zero: Vec<_> = (0..8u64)
            .map(|i| (i * 8192, (1 << 40) + i * 8192, 0))
            .collect();
        assert!(check(zero).0.is_empty());
        assert!(check(vec![(0, 1 << 40, 4096); 3]).0.is_empty(), "too few");
    }

    #[test]
    fn runs_split_where_the_stride_changes() {
        // K and V pages of each layer at one distance, layers at another: pairs, no run of 4.
        let mut c = Vec::new();
        for l in 0..8u64 {
            for kv in 0..2u64 {
                c.push((
                    l * (1 << 24) + kv * (1 << 20),
                    (1 << 40) + (l * 2 + kv) * 4096,
                    4096,
                ));
            }
        }
        assert_eq!(cov(&c), 0);
        // Two runs of 6 with different strides back to back.
        let mut d: Vec<_> = (0..6u64)
            .map(|i| (i * 8192, (1 << 40) + i * 4096, 4096))
            .collect();
        d.extend((0..6u64).map(|i| ((1 << 30) + i * 16384, (1 << 41) + i * 4096, 4096)));
        assert_eq!(cov(&d), 12);
        let (runs, rest) = check(d);
        assert_eq!((runs.len(), rest.len()), (2, 0));
    }

    #[test]
    fn coverage_counts_match_the_grouping_in_order() {
        let mut rng = 0x1234_5678_u64;
        for _ in 0..200 {
            let mut c = Vec::new();
            let mut s = 1u64 << 30;
            let mut d = 1u64 << 40;
            for _ in 0..40 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let w = [4096u64, 4096, 4096, 8192][(rng % 4) as usize];
                s += [w, w, 2 * w, 3 * w][((rng >> 8) % 4) as usize];
                d += [w, w, w, 5 * w][((rng >> 16) % 4) as usize];
                c.push((s, d, w));
            }
            let mut runs = Vec::new();
            let rest = super::group_in_order(&c, &mut runs, &mut super::unbounded);
            assert_eq!(cov(&c), c.len() - rest.len(), "{c:?}");
            check(c);
        }
    }
}

#[cfg(test)]
mod cost_probe {
    use super::{choice_min_run_bytes, pitched_copies_until, AllocRanges};

    /// Prints the CPU time of the per-job analyses on a vLLM-layout 16384-copy job.
    #[test]
    #[ignore = "timing probe"]
    fn cpu_cost_of_a_16384_copy_job() {
        let page = 32768u64;
        let ngpu = 4096u64;
        let layer = |l: u64| (1u64 << 40) + l * (3 * ngpu * page); // not evenly spaced K/V pairs
        let host = 1u64 << 44;
        let mut copies = Vec::new();
        for (c, g) in (0..256u64).map(|c| (c, (c * 7919) % ngpu)) {
            for l in 0..32u64 {
                for kv in 0..2u64 {
                    let src = layer(l) + (kv * ngpu + g) * page;
                    let dst = host + (c * 64 + l * 2 + kv) * page;
                    copies.push((src, dst, page));
                }
            }
        }
        let mut ranges = AllocRanges::default();
        for l in 0..32 {
            ranges.end_of(layer(l), |_| Some((layer(l), 2 * ngpu * page)));
        }
        let t = std::time::Instant::now();
        let mut n = 0;
        for _ in 0..100 {
            let mut lim = |s: u64, _d: u64| (ranges.end_of(s, |_| None), u64::MAX);
            n += pitched_copies_until(
                copies.len(),
                choice_min_run_bytes(page),
                copies.len().div_ceil(2),
                |j| copies.get(j).copied(),
                &mut lim,
            );
        }
        eprintln!("pitched_copies: {:?} per job ({n})", t.elapsed() / 100);
        let mut descs = vec![0u64; 3 * 20000];
        let mut runs = Vec::new();
        let ops: Vec<crate::plan::CopyOp> = copies
            .iter()
            .map(|&(s, d, b)| crate::plan::CopyOp {
                src_ptr: s,
                dst_ptr: d,
                bytes: b,
            })
            .collect();
        let t = std::time::Instant::now();
        for _ in 0..100 {
            let mut p = super::super::staged::StagedPacker::default();
            let mut nd = 0;
            for k in 0..40 {
                let len = super::super::staged::staged_chunk_len(k, 16 << 20);
                if p.pack_chunk(&ops, true, len, 1 << 45, &mut descs, &mut nd, &mut runs)
                    .unwrap_or(0)
                    == 0
                {
                    break;
                }
            }
        }
        eprintln!("pack: {:?} per job", t.elapsed() / 100);
    }
}
