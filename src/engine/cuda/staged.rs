//! The CPU side of the `Staged` method: the chunk schedule of a job (chunks ramp up from 2 MiB to
//! the slot size) and the packer that cuts a job's copies into per-chunk kernel descriptors
//! (gather/scatter between the caller's memory and a device staging slot) and host-contiguous DMA
//! runs (between the slot and pinned host memory).

use super::handles::{DevMem, Event, Stream};
use super::kernel::KERNEL_CHUNK_BYTES;
use crate::plan::CopyOp;

/// First chunk of a staged job. Chunks double from here up to the slot size (2, 4, 8, 16, 32 MiB,
/// then slot-sized), so that the device starts after little CPU work and the two-stage pipeline
/// fills quickly, while long jobs still move in few, large chunks.
const STAGED_FIRST_CHUNK: u64 = 2 << 20;

/// Smallest job for which `Auto` considers the staged method.
pub(crate) const STAGED_MIN_JOB_BYTES: u64 = 32 << 20;

/// Bytes of chunk `k` of a staged job whose slots hold `cap` bytes.
pub(crate) fn staged_chunk_len(k: usize, cap: u64) -> u64 {
    let first = STAGED_FIRST_CHUNK.min(cap);
    if k >= 40 {
        cap
    } else {
        (first << k).min(cap)
    }
}

/// Number of chunks of a staged job of `total` bytes (see [`staged_chunk_len`]).
pub(crate) fn staged_chunk_count(total: u64, cap: u64) -> usize {
    if cap == 0 {
        return 0;
    }
    let mut left = total;
    let mut k = 0usize;
    while left > 0 {
        let c = staged_chunk_len(k, cap);
        if c >= cap {
            return k.saturating_add(usize::try_from(left.div_ceil(cap)).unwrap_or(usize::MAX));
        }
        left = left.saturating_sub(c);
        k += 1;
    }
    k
}

/// Most kernel descriptors a staged job can need: chunk boundaries cut the copies into at most
/// `copies + chunks` segments, and a segment of `s` bytes gives at most `s / KERNEL_CHUNK_BYTES + 1`
/// pieces.
pub(crate) fn staged_desc_bound(n_copies: usize, total: u64, n_chunks: usize) -> usize {
    usize::try_from(total / KERNEL_CHUNK_BYTES)
        .unwrap_or(usize::MAX)
        .saturating_add(n_copies)
        .saturating_add(n_chunks)
}

/// Packs a staged job chunk by chunk, in emission order (see [`CopyMethod::Staged`]).
#[derive(Debug, Default)]
pub(crate) struct StagedPacker {
    /// Next copy to pack, and the bytes of it already packed.
    copy: usize,
    off: u64,
}

impl StagedPacker {
    /// Packs up to `len` more bytes of `copies` into the staging slot at device address `base`:
    /// kernel descriptor triples (GPU side ↔ staging, pieces of at most [`KERNEL_CHUNK_BYTES`])
    /// are written to `descs` from triple `*nd` on (advancing `*nd`), and the DMA runs
    /// `(src, dst, bytes)` (staging ↔ host, merged while host-contiguous) replace `runs`.
    /// Returns the bytes packed (fewer than `len` only at the end of the job), or `None` if
    /// `descs` is too small (callers size it with [`staged_desc_bound`]).
    #[allow(clippy::too_many_arguments)] // plain data in, two reused buffers out
    pub(crate) fn pack_chunk(
        &mut self,
        copies: &[CopyOp],
        d2h: bool,
        len: u64,
        base: u64,
        descs: &mut [u64],
        nd: &mut usize,
        runs: &mut Vec<(u64, u64, u64)>,
    ) -> Option<u64> {
        if d2h {
            self.pack::<true>(copies, len, base, descs, nd, runs)
        } else {
            self.pack::<false>(copies, len, base, descs, nd, runs)
        }
    }

    fn pack<const D2H: bool>(
        &mut self,
        copies: &[CopyOp],
        len: u64,
        base: u64,
        descs: &mut [u64],
        nd: &mut usize,
        runs: &mut Vec<(u64, u64, u64)>,
    ) -> Option<u64> {
        runs.clear();
        let (mut ci, mut off, mut n) = (self.copy, self.off, *nd);
        let mut fill = 0u64;
        // The open run: (host start, staging start, bytes).
        let mut run: Option<(u64, u64, u64)> = None;
        while fill < len {
            let Some(c) = copies.get(ci) else {
                break;
            };
            let take = (c.bytes - off).min(len - fill);
            let stage = base + fill;
            let (gpu, host) = if D2H {
                (c.src_ptr + off, c.dst_ptr + off)
            } else {
                (c.dst_ptr + off, c.src_ptr + off)
            };
            let mut k = 0;
            while k < take {
                let l = (take - k).min(KERNEL_CHUNK_BYTES);
                let d = descs.get_mut(n * 3..n * 3 + 3)?;
                if D2H {
                    d[0] = gpu + k;
                    d[1] = stage + k;
                } else {
                    d[0] = stage + k;
                    d[1] = gpu + k;
                }
                d[2] = l;
                n += 1;
                k += l;
            }
            // Staging is filled contiguously, so a run continues while the host side does.
            if take > 0 {
                run = match run {
                    Some((h, st, b)) if h + b == host => Some((h, st, b + take)),
                    Some((h, st, b)) => {
                        runs.push(if D2H { (st, h, b) } else { (h, st, b) });
                        Some((host, stage, take))
                    }
                    None => Some((host, stage, take)),
                };
            }
            fill += take;
            off += take;
            if off >= c.bytes {
                ci += 1;
                off = 0;
            }
        }
        if let Some((h, st, b)) = run {
            runs.push(if D2H { (st, h, b) } else { (h, st, b) });
        }
        self.copy = ci;
        self.off = off;
        *nd = n;
        Some(fill)
    }
}

/// One chunk packed by [`StagedChunks`]: its slot, and its descriptors (`first_desc..` of the
/// job's descriptor buffer, `n_descs` of them); its DMA runs are in the caller's `runs`.
pub(crate) struct PackedChunk {
    pub(crate) slot: usize,
    pub(crate) first_desc: usize,
    pub(crate) n_descs: usize,
}

/// The chunks of one staged job, packed one at a time in order (chunk `k` into slot
/// `(first_slot + k) % slots.len()`). The engine's thread enqueues them for the explicit method;
/// the feeder packs and enqueues `auto`'s, so the submitting thread spends no time on them
/// (docs/performance.md, "The cost of a submit").
pub(crate) struct StagedChunks<'a> {
    copies: &'a [CopyOp],
    d2h: bool,
    cap: u64,
    slots: &'a [u64],
    first_slot: usize,
    n_chunks: usize,
    k: usize,
    packer: StagedPacker,
    nd: usize,
}

impl<'a> StagedChunks<'a> {
    pub(crate) fn new(
        copies: &'a [CopyOp],
        d2h: bool,
        cap: u64,
        slots: &'a [u64],
        first_slot: usize,
        n_chunks: usize,
    ) -> Self {
        Self {
            copies,
            d2h,
            cap,
            slots,
            first_slot,
            n_chunks,
            k: 0,
            packer: StagedPacker::default(),
            nd: 0,
        }
    }

    /// Packs the next chunk: its kernel descriptor triples into `descs` (after the previous
    /// chunks'), its DMA runs into `runs`; `Ok(None)` after the last chunk.
    ///
    /// # Errors
    /// `descs` is too small (sized with [`staged_desc_bound`], it is not: a kvoff bug), or there
    /// are no slots.
    pub(crate) fn next_chunk(
        &mut self,
        descs: &mut [u64],
        runs: &mut Vec<(u64, u64, u64)>,
    ) -> crate::error::Result<Option<PackedChunk>> {
        if self.k >= self.n_chunks {
            return Ok(None);
        }
        if self.slots.is_empty() {
            return Err(crate::error::KvoffError::state("no staging slots"));
        }
        let slot = (self.first_slot + self.k) % self.slots.len();
        let first_desc = self.nd;
        let got = self
            .packer
            .pack_chunk(
                self.copies,
                self.d2h,
                staged_chunk_len(self.k, self.cap),
                self.slots[slot],
                descs,
                &mut self.nd,
                runs,
            )
            .ok_or_else(|| {
                crate::error::KvoffError::state("staged descriptor buffer too small (a kvoff bug)")
            })?;
        self.k += 1;
        if got == 0 {
            self.k = self.n_chunks;
            return Ok(None);
        }
        Ok(Some(PackedChunk {
            slot,
            first_desc,
            n_descs: self.nd - first_desc,
        }))
    }
}

/// One device staging slot of the `Staged` method. A slot is always used by the same stream
/// (even slots: the engine's stream; odd slots: the auxiliary stream), so stream order alone keeps
/// a chunk from overwriting a slot before its previous chunk was consumed.
pub(super) struct Slot {
    pub(super) dev: DevMem,
}

/// Second stream and staging ring of the `Staged` method (created on first use).
pub(super) struct Staging {
    pub(super) aux: Stream,
    pub(super) fork: Event,
    pub(super) join: Event,
    pub(super) slots: Vec<Slot>,
    pub(super) next: usize,
}

#[cfg(test)]
mod pack_tests {
    use super::{
        staged_chunk_count, staged_chunk_len, staged_desc_bound, CopyOp, StagedChunks,
        KERNEL_CHUNK_BYTES,
    };

    /// A packed chunk: its slot and its ranges of the flat descriptor and run lists.
    struct Chunk {
        slot: usize,
        desc_start: usize,
        desc_count: usize,
        run_start: usize,
        run_count: usize,
    }

    /// Descriptor words, DMA runs and chunks of a whole packed job.
    type Packed = (Vec<u64>, Vec<(u64, u64, u64)>, Vec<Chunk>);

    /// Packs a whole job the way `enqueue_staged` does, collecting every chunk.
    fn pack_all(
        copies: &[CopyOp],
        d2h: bool,
        cap: u64,
        bases: &[u64],
        first_slot: usize,
    ) -> Packed {
        let total: u64 = copies.iter().map(|c| c.bytes).sum();
        let n_chunks = staged_chunk_count(total, cap);
        let mut descs = vec![0u64; 3 * staged_desc_bound(copies.len(), total, n_chunks)];
        let (mut runs, mut chunks) = (Vec::new(), Vec::new());
        let mut packed = 0u64;
        let mut chunk_runs = Vec::new();
        let mut it = StagedChunks::new(copies, d2h, cap, bases, first_slot, n_chunks);
        while let Some(c) = it
            .next_chunk(&mut descs, &mut chunk_runs)
            .expect("the bound holds")
        {
            let k = chunks.len();
            assert_eq!(c.slot, (first_slot + k) % bases.len());
            let got: u64 = descs[c.first_desc * 3..(c.first_desc + c.n_descs) * 3]
                .chunks(3)
                .map(|d| d[2])
                .sum();
            let len = staged_chunk_len(k, cap);
            assert!(
                got == len || packed + got == total,
                "short chunk before the end"
            );
            packed += got;
            chunks.push(Chunk {
                slot: c.slot,
                desc_start: c.first_desc,
                desc_count: c.n_descs,
                run_start: runs.len(),
                run_count: chunk_runs.len(),
            });
            runs.extend_from_slice(&chunk_runs);
        }
        let nd = chunks.last().map_or(0, |c| c.desc_start + c.desc_count);
        assert_eq!(packed, total, "chunk count covers the job");
        descs.truncate(nd * 3);
        (descs, runs, chunks)
    }

    #[test]
    fn chunk_schedule_ramps_to_the_slot_size() {
        let mib = 1u64 << 20;
        let lens: Vec<u64> = (0..6)
            .map(|k| staged_chunk_len(k, 16 * mib) / mib)
            .collect();
        assert_eq!(lens, [2, 4, 8, 16, 16, 16]);
        assert_eq!(staged_chunk_len(0, mib), mib);
        assert_eq!(staged_chunk_len(100, 16 * mib), 16 * mib);
        assert_eq!(staged_chunk_count(0, 16 * mib), 0);
        assert_eq!(staged_chunk_count(1, 16 * mib), 1);
        assert_eq!(staged_chunk_count(2 * mib, 16 * mib), 1);
        assert_eq!(staged_chunk_count(2 * mib + 1, 16 * mib), 2);
        assert_eq!(staged_chunk_count(30 * mib, 16 * mib), 4);
        assert_eq!(staged_chunk_count(512 * mib, 16 * mib), 3 + 32); // 2 + 4 + 8, then 498 MiB
        assert_eq!(staged_chunk_count(5 * mib, mib), 5);
    }

    /// Every byte of every copy is staged exactly once, kernel pieces are at most 64 KiB, runs stay
    /// inside their chunk's slot, and staging ↔ GPU (descriptors) composed with staging ↔ host
    /// (runs) gives back exactly the copies.
    #[test]
    fn pack_covers_every_byte_once() {
        for (cap, d2h) in [
            (1u64 << 20, true),
            (1 << 20, false),
            (8 << 20, true),
            (8 << 20, false),
        ] {
            let bases = [1u64 << 40, (1u64 << 40) + cap, 1 << 41]; // slots 0 and 1 adjacent
            let mut copies = Vec::new();
            let mut host = 1u64 << 30;
            for i in 0..200u64 {
                let bytes = [8, 4096, 100_000, 3 << 20][(i % 4) as usize];
                let gpu = (1u64 << 35) + i * (4 << 20);
                if i % 7 == 0 {
                    host += 4096; // break host contiguity now and then
                }
                copies.push(if d2h {
                    CopyOp {
                        src_ptr: gpu,
                        dst_ptr: host,
                        bytes,
                    }
                } else {
                    CopyOp {
                        src_ptr: host,
                        dst_ptr: gpu,
                        bytes,
                    }
                });
                host += bytes;
            }
            let (descs, runs, chunks) = pack_all(&copies, d2h, cap, &bases, 1);
            let total: u64 = copies.iter().map(|c| c.bytes).sum();
            assert_eq!(descs.chunks(3).map(|d| d[2]).sum::<u64>(), total);
            assert_eq!(runs.iter().map(|r| r.2).sum::<u64>(), total);
            assert!(descs
                .chunks(3)
                .all(|d| d[2] <= KERNEL_CHUNK_BYTES && d[2] > 0));
            for (n, ch) in chunks.iter().enumerate() {
                assert_eq!(ch.slot, (1 + n) % 3);
                let base = bases[ch.slot];
                for r in &runs[ch.run_start..ch.run_start + ch.run_count] {
                    let stage = if d2h { r.0 } else { r.1 };
                    assert!(
                        stage >= base && stage + r.2 <= base + cap,
                        "run leaves its slot"
                    );
                }
                for d in descs[ch.desc_start * 3..(ch.desc_start + ch.desc_count) * 3].chunks(3) {
                    let stage = if d2h { d[1] } else { d[0] };
                    assert!(stage >= base && stage + d[2] <= base + cap);
                }
            }
            // Per chunk (slots are reused), map staging → GPU through the chunk's descriptors and
            // compose with the chunk's runs (staging ↔ host).
            let mut pairs = Vec::new();
            for ch in &chunks {
                let mut stage_to_gpu = std::collections::BTreeMap::new();
                for d in descs[ch.desc_start * 3..(ch.desc_start + ch.desc_count) * 3].chunks(3) {
                    let (stage, gpu) = if d2h { (d[1], d[0]) } else { (d[0], d[1]) };
                    assert!(
                        stage_to_gpu.insert(stage, (gpu, d[2])).is_none(),
                        "staging reused in a chunk"
                    );
                }
                for r in &runs[ch.run_start..ch.run_start + ch.run_count] {
                    let (stage, hostp) = if d2h { (r.0, r.1) } else { (r.1, r.0) };
                    let mut off = 0;
                    while off < r.2 {
                        let (&k, &(gpu, len)) =
                            stage_to_gpu.range(..=stage + off).next_back().unwrap();
                        let within = stage + off - k;
                        assert!(within < len, "run byte without a descriptor");
                        let take = (len - within).min(r.2 - off);
                        pairs.push((gpu + within, hostp + off, take));
                        off += take;
                    }
                }
            }
            let mut expect: Vec<(u64, u64, u64)> = copies
                .iter()
                .map(|c| {
                    if d2h {
                        (c.src_ptr, c.dst_ptr, c.bytes)
                    } else {
                        (c.dst_ptr, c.src_ptr, c.bytes)
                    }
                })
                .collect();
            let merge = |v: &mut Vec<(u64, u64, u64)>| {
                v.sort_unstable();
                let mut out: Vec<(u64, u64, u64)> = Vec::new();
                for p in v.drain(..) {
                    match out.last_mut() {
                        Some(l) if l.0 + l.2 == p.0 && l.1 + l.2 == p.1 => l.2 += p.2,
                        _ => out.push(p),
                    }
                }
                *v = out;
            };
            merge(&mut pairs);
            merge(&mut expect);
            assert_eq!(pairs, expect);
        }
    }
}
