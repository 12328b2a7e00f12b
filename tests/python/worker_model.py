"""A reference model of docs/spec.md §4 transfer plans for the handler tests: random KV-cache layouts, random
jobs, and the expected bytes of every destination (numpy, byte-exact)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from kvoff import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, canonicalize_kv_caches

DTYPES = [torch.uint8, torch.int8, torch.bfloat16, torch.float16, torch.float32]


def fill_random(t: torch.Tensor, rng: random.Random) -> None:
    """Random bytes into a uint8 byte view (any device)."""
    g = torch.Generator().manual_seed(rng.getrandbits(32))
    src = torch.randint(0, 256, tuple(t.shape), dtype=torch.uint8, generator=g)
    t.copy_(src)


@dataclass
class Layout:
    caches: CanonicalKVCaches
    originals: list[torch.Tensor]  # the user-level tensors (kept alive)
    num_gpu_blocks: int


def random_layout(
    rng: random.Random,
    device: str = "cpu",
    max_tensors: int = 64,
    pages: tuple[int, ...] = (8, 24, 64, 520, 4096, 2 << 20),
    dtypes: list[torch.dtype] | None = None,
    num_groups: int | None = None,
) -> Layout:
    """1..max_tensors canonical tensors of one page size, in random layouts and dtypes, split into
    random groups (one possibly empty of refs), with some un-padded refs."""
    page = rng.choice(pages)
    n = rng.randint(1, max(1, min(max_tensors, (8 << 20) // (page * 8))))
    nb = rng.randint(8, 40) if page < (1 << 20) else rng.randint(6, 10)
    originals: list[torch.Tensor] = []
    dtypes = dtypes or DTYPES
    i = 0
    while i < n:
        dt = rng.choice([d for d in dtypes if page % torch.empty(0, dtype=d).element_size() == 0])
        es = torch.empty(0, dtype=dt).element_size()
        per_block = page // es
        kind = rng.choice(["rows", "kv", "cross"]) if n - i >= 2 else rng.choice(["rows", "cross"])
        if kind == "kv":
            shape = (2, nb, per_block)
            i += 2
        elif kind == "cross" and per_block % 2 == 0:
            shape = (nb, 2, per_block // 2)
            i += 1
        else:
            shape = (nb, per_block)
            i += 1
        originals.append(torch.empty(shape, dtype=dt, device=device))
    canon = canonicalize_kv_caches(originals, num_blocks=nb)
    tensors = canon.tensors
    # Groups: a random partition of the tensors; refs may copy fewer bytes than the page.
    g = num_groups or rng.randint(1, 4)
    idx = list(range(len(tensors)))
    rng.shuffle(idx)
    groups: list[list[CanonicalKVCacheRef]] = [[] for _ in range(g)]
    for k, t in enumerate(idx):
        p = tensors[t].page_size_bytes
        if rng.random() < 0.3 and p > 1:
            p = rng.randint(1, p)
        groups[k % g].append(CanonicalKVCacheRef(t, p))
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(t.tensor, t.page_size_bytes) for t in tensors], groups)
    return Layout(caches, originals, nb)


@dataclass
class Job:
    gpu_ids: np.ndarray
    group_sizes: np.ndarray
    block_indices: np.ndarray
    cpu_ids: np.ndarray


def random_job(
    rng: random.Random,
    num_groups: int,
    num_gpu_blocks: int,
    num_cpu_blocks: int,
    f: int,
    empty_group: bool = True,
) -> Job:
    """Distinct GPU ids and distinct CPU ids across all groups, random sizes (one group may be
    empty) and block indices (unaligned starts/ends)."""
    sizes, indices, cpu_counts = [], [], []
    gpu_left, cpu_left = num_gpu_blocks, num_cpu_blocks
    empty = rng.randrange(num_groups) if empty_group and num_groups > 1 else -1
    for g in range(num_groups):
        idx = rng.randint(0, 3 * f)
        skip = idx % f
        hi = max(0, min(gpu_left, cpu_left * f - skip, 3 * f + 2))
        size = 0 if g == empty else rng.randint(0, hi)
        need = -(-(size + skip) // f) if size else 0
        sizes.append(size)
        indices.append(idx)
        cpu_counts.append(need)
        gpu_left -= size
        cpu_left -= need
    gpu_ids = rng.sample(range(num_gpu_blocks), sum(sizes))
    cpu_ids = rng.sample(range(num_cpu_blocks), sum(cpu_counts))
    a = lambda x: np.array(x, dtype=np.int64)
    return Job(a(gpu_ids), a(sizes), a(indices), a(cpu_ids))


def expected_store(
    caches: CanonicalKVCaches, gpu: list[np.ndarray], cpu: list[np.ndarray], job: Job, f: int
) -> list[np.ndarray]:
    """CPU tensors after storing ``job`` (copies of ``cpu``)."""
    out = [c.copy() for c in cpu]
    for src, dst, p, t in _pairs(caches, job, f):
        gi, (ci, col) = src, dst
        out[t][ci, col : col + p] = gpu[t][gi, :p]
    return out


def expected_load(
    caches: CanonicalKVCaches, gpu: list[np.ndarray], cpu: list[np.ndarray], job: Job, f: int
) -> list[np.ndarray]:
    """GPU tensors after loading ``job`` (copies of ``gpu``)."""
    out = [x.copy() for x in gpu]
    for gi, (ci, col), p, t in _pairs(caches, job, f):
        out[t][gi, :p] = cpu[t][ci, col : col + p]
    return out


def _pairs(caches: CanonicalKVCaches, job: Job, f: int):
    goff = coff = 0
    for g, refs in enumerate(caches.group_data_refs):
        size = int(job.group_sizes[g])
        skip = int(job.block_indices[g]) % f
        if size == 0:
            continue
        gids = job.gpu_ids[goff : goff + size]
        cids = job.cpu_ids[coff:]
        for r in refs:
            page_t = caches.tensors[r.tensor_idx].page_size_bytes
            for i, gid in enumerate(gids):
                s = skip + i
                yield int(gid), (int(cids[s // f]), (s % f) * page_t), r.page_size_bytes, r.tensor_idx
        goff += size
        coff += -(-(size + skip) // f)
