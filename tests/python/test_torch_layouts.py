"""canonicalize_kv_caches on the KV-cache layouts engines use (docs/spec.md §6), for bf16/fp16/fp8/int8:
canonical shapes and page sizes, byte-exact store → load round trips through CpuGpuOffloadingHandlers
(every destination byte right; every other byte, padding included, unchanged), several KV-cache groups
with different layers (and tensors shared across groups), keep-alive of the engine's memory, and the
rejections. CPU tensors + host engine; the CUDA cases are marked ``gpu``."""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass

import kvoff
import numpy as np
import pytest
from kvoff import (
    CanonicalKVCaches,
    CpuGpuOffloadingHandlers,
    CPULoadStoreSpec,
    CudaUnavailableError,
    GPULoadStoreSpec,
    canonicalize_kv_caches,
)

torch = pytest.importorskip("torch")
from worker_model import Job, _pairs, expected_store, random_job

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
NB, BS, H, D = 12, 4, 2, 8  # GPU blocks, block size (tokens), heads, head dim
HAS_CUDA = torch.cuda.is_available()


def elems_per_block() -> int:
    return BS * H * D


# --- byte-level model of the engine's memory ------------------------------------------------------


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a flat uint8 tensor (padding included)."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (s.nbytes(),), (1,))


def fill_storage(t: torch.Tensor, rng: random.Random) -> None:
    flat = storage_bytes(t)
    g = torch.Generator().manual_seed(rng.getrandbits(32))
    flat.copy_(torch.randint(0, 256, tuple(flat.shape), dtype=torch.uint8, generator=g))


class GpuMemory:
    """Every byte of the storages behind a set of KV-cache tensors, and where each canonical tensor's
    blocks lie in them."""

    def __init__(self, bases: list[torch.Tensor], caches: CanonicalKVCaches) -> None:
        seen: dict[int, torch.Tensor] = {}
        for b in bases:
            seen.setdefault(b.untyped_storage().data_ptr(), b)
        self.bases = list(seen.values())
        self.loc = []  # canonical tensor → (storage index, byte offset, row stride)
        for ct in caches.tensors:
            p = ct.tensor.data_ptr()
            for k, b in enumerate(self.bases):
                s = b.untyped_storage()
                if s.data_ptr() <= p < s.data_ptr() + s.nbytes():
                    self.loc.append((k, p - s.data_ptr(), ct.tensor.stride(0)))
                    break
            else:  # pragma: no cover - a canonical view outside the engine's storages
                raise AssertionError("canonical tensor outside the given storages")

    def fill(self, rng: random.Random) -> None:
        for b in self.bases:
            fill_storage(b, rng)

    def snapshot(self) -> list[np.ndarray]:
        return [storage_bytes(b).cpu().numpy().copy() for b in self.bases]

    def expected_load(self, caches, flat, cpu, job, f) -> list[np.ndarray]:
        out = [x.copy() for x in flat]
        for gid, (cid, col), p, t in _pairs(caches, job, f):
            k, off, stride = self.loc[t]
            start = off + gid * stride
            out[k][start : start + p] = cpu[t][cid, col : col + p]
        return out


def cpu_snapshot(h) -> list[np.ndarray]:
    return [t.numpy().copy() for t in h.cpu_tensors]


def assert_bytes_equal(actual, expected, what):
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if not np.array_equal(a, e):
            bad = np.argwhere(a != e)
            raise AssertionError(f"{what} {i}: {len(bad)} bytes differ, first at {bad[0].tolist()}")


def logical_blocks(t: torch.Tensor, b: int) -> list[torch.Tensor]:
    """Block ``b`` of an engine tensor: ``t[0, b], t[1, b]`` for a K/V split, else ``t[b]``."""
    if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == NB:
        return [t[0, b], t[1, b]]
    return [t[b]]


def same_view(t: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``t``'s shape and strides over another copy of its storage (an integer dtype of its size)."""
    it = {1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    storage = flat.view(it).untyped_storage()
    return torch.empty(0, dtype=it).set_(storage, t.storage_offset(), t.shape, t.stride())


def expected_after_load(kv, mem, before, stored, src_ids, dst_ids, positions):
    """Independently of canonicalization: the engine's storages after loading into ``dst_ids`` what
    was stored from ``src_ids`` — each layer's logical blocks replaced, every other byte (padding and
    the blocks of other groups included) as ``before``."""
    idx = {b.untyped_storage().data_ptr(): k for k, b in enumerate(mem.bases)}
    exp = [torch.from_numpy(x.copy()) for x in before]
    src = [torch.from_numpy(x.copy()) for x in stored]
    for name, t in kv.items():
        k = idx[t.untyped_storage().data_ptr()]
        d, s = same_view(t, exp[k]), same_view(t, src[k])
        for i in positions[name]:
            for dv, sv in zip(
                logical_blocks(d, int(dst_ids[i])), logical_blocks(s, int(src_ids[i])), strict=True
            ):
                dv.copy_(sv)
    return [e.numpy() for e in exp]


def round_trip(kv, bases, seed, f=1, groups=None, engine="host", num_cpu=None):
    """Store random distinct GPU blocks into random distinct CPU blocks, then load them into other
    random GPU blocks; check every byte of the CPU tensors and of the engine's storages each time,
    against the plan model and, for the load, against a model that knows only the engine tensors."""
    rng = random.Random(seed)
    caches = canonicalize_kv_caches(kv, groups=groups)
    ng = len(caches.group_data_refs)
    group_lists = [list(kv)]
    if groups is not None:
        group_lists = list(groups.values() if isinstance(groups, dict) else groups)
    num_cpu = num_cpu or rng.randint(4, 10)
    h = CpuGpuOffloadingHandlers(caches, f, num_cpu, engine=engine)
    try:
        assert h.engine.startswith(engine if engine == "host" else "cuda")
        mem = GpuMemory(bases, caches)
        mem.fill(rng)
        for t in h.cpu_tensors:
            t.copy_(torch.randint(0, 256, tuple(t.shape), dtype=torch.uint8))
        job = random_job(rng, ng, NB, num_cpu, f, empty_group=False)
        while len(job.gpu_ids) == 0:
            job = random_job(rng, ng, NB, num_cpu, f, empty_group=False)
        starts = np.concatenate([[0], np.cumsum(job.group_sizes)])
        positions = {
            layer: range(int(starts[g]), int(starts[g + 1]))
            for g, layers in enumerate(group_lists)
            for layer in layers
        }
        gpu0, cpu0 = mem.snapshot(), cpu_snapshot(h)
        gpu_cur = [c.tensor.cpu().numpy() for c in caches.tensors]
        exp_cpu = expected_store(caches, gpu_cur, cpu0, job, f)
        st, ld = h.gpu_to_cpu_handler, h.cpu_to_gpu_handler
        st.transfer_async(
            1,
            (
                GPULoadStoreSpec(job.gpu_ids, job.group_sizes, job.block_indices),
                CPULoadStoreSpec(job.cpu_ids),
            ),
        )
        st.wait([1])
        (r,) = st.get_finished()
        assert r.success, r.error
        nbytes = sum(
            int(job.group_sizes[g]) * sum(x.page_size_bytes for x in refs)
            for g, refs in enumerate(caches.group_data_refs)
        )
        assert r.transfer_size == nbytes
        assert_bytes_equal(cpu_snapshot(h), exp_cpu, "CPU tensor after store")
        assert_bytes_equal(mem.snapshot(), gpu0, "GPU storage (source) after store")

        # Load into other random GPU blocks over fresh random GPU bytes (padding included).
        mem.fill(rng)
        ids2 = np.array(rng.sample(range(NB), len(job.gpu_ids)), dtype=np.int64)
        job2 = Job(ids2, job.group_sizes, job.block_indices, job.cpu_ids)
        gpu1, cpu1 = mem.snapshot(), cpu_snapshot(h)
        exp_gpu = mem.expected_load(caches, gpu1, cpu1, job2, f)
        ld.transfer_async(
            2, (CPULoadStoreSpec(job.cpu_ids), GPULoadStoreSpec(ids2, job.group_sizes, job.block_indices))
        )
        ld.wait([2])
        (r,) = ld.get_finished()
        assert r.success and r.transfer_size == nbytes, r.error
        after = mem.snapshot()
        assert_bytes_equal(after, exp_gpu, "GPU storage after load")
        assert_bytes_equal(cpu_snapshot(h), cpu1, "CPU tensor (source) after load")
        indep = expected_after_load(kv, mem, gpu1, gpu0, job.gpu_ids, ids2, positions)
        assert_bytes_equal(after, indep, "GPU storage after load (engine-tensor model)")
        return caches, h
    finally:
        h.shutdown()


# --- layouts ---------------------------------------------------------------------------------------


@dataclass
class Case:
    kv: dict  # what the engine passes
    bases: list  # the allocations behind it (padding included)
    pages: list[int]  # expected canonical page sizes
    strides: list[int]  # expected canonical row strides (bytes)


def make_case(layout: str, dtype, device="cpu") -> Case:
    es = torch.empty(0, dtype=dtype).element_size()
    e = elems_per_block()
    z = lambda *s: torch.empty(s, dtype=dtype, device=device)
    if layout == "kv_split":  # FlashAttention (2, num_blocks, block_size, heads, head_dim)
        kv = {f"l{i}": z(2, NB, BS, H, D) for i in range(2)}
        return Case(kv, list(kv.values()), [e * es] * 4, [e * es] * 4)
    if layout == "kv_interleaved":  # (2, num_blocks, …) logical, block-major physical (K, V per block)
        bases = [z(NB, 2, BS, H, D) for _ in range(2)]
        kv = {f"l{i}": b.transpose(0, 1) for i, b in enumerate(bases)}
        return Case(kv, bases, [e * es] * 4, [2 * e * es] * 4)
    if layout == "flashinfer":  # (num_blocks, 2, block_size, heads, head_dim): page = K and V
        kv = {f"l{i}": z(NB, 2, BS, H, D) for i in range(3)}
        return Case(kv, list(kv.values()), [2 * e * es] * 3, [2 * e * es] * 3)
    if layout == "mla":  # (num_blocks, block_size, kv_lora_rank + rope_dim)
        kv = {f"l{i}": z(NB, BS, 72) for i in range(2)}
        return Case(kv, list(kv.values()), [BS * 72 * es] * 2, [BS * 72 * es] * 2)
    if layout == "cross_layer":  # one tensor (num_blocks, num_layers, 2, block_size, heads, head_dim)
        kv = {"all": z(NB, 3, 2, BS, H, D)}
        return Case(kv, list(kv.values()), [6 * e * es], [6 * e * es])
    if layout == "cross_layer_views":  # per-layer views base[:, i] of a cross-layer tensor
        base = z(NB, 3, 2, BS, H, D)
        kv = {f"l{i}": base[:, i] for i in range(3)}
        return Case(kv, [base], [2 * e * es] * 3, [6 * e * es] * 3)
    if layout == "padded_stride":  # pages padded to a common size: stride(0) > page (base[:, :k])
        padded = 2 * e + 40
        bases = [z(NB, padded) for _ in range(2)]
        kv = {f"l{i}": b[:, : 2 * e].view(NB, 2, BS, H, D) for i, b in enumerate(bases)}
        return Case(kv, bases, [2 * e * es] * 2, [padded * es] * 2)
    if layout == "padded_runs":  # base[:, :, :k]: K and V runs each padded inside the block
        bases = [z(NB, 2, e + 24) for _ in range(2)]
        kv = {f"l{i}": b[:, :, :e] for i, b in enumerate(bases)}
        return Case(kv, bases, [e * es] * 4, [2 * (e + 24) * es] * 4)
    raise AssertionError(layout)


LAYOUTS = [
    "kv_split",
    "kv_interleaved",
    "flashinfer",
    "mla",
    "cross_layer",
    "cross_layer_views",
    "padded_stride",
    "padded_runs",
]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_canonical_shapes_and_pages(layout, dtype):
    c = make_case(layout, dtype)
    caches = canonicalize_kv_caches(c.kv)
    assert [t.page_size_bytes for t in caches.tensors] == c.pages
    for t in caches.tensors:
        assert t.tensor.dtype == torch.uint8 and tuple(t.tensor.shape) == (NB, t.page_size_bytes)
        assert t.tensor.stride(1) == 1
    assert [t.tensor.stride(0) for t in caches.tensors] == c.strides
    assert len(caches.group_data_refs) == 1
    assert [(r.tensor_idx, r.page_size_bytes) for r in caches.group_data_refs[0]] == [
        (i, p) for i, p in enumerate(c.pages)
    ]
    # zero-copy: the views alias the engine tensors' storages
    ptrs = {b.untyped_storage().data_ptr() for b in c.bases}
    assert all(t.tensor.untyped_storage().data_ptr() in ptrs for t in caches.tensors)
    assert all(t.source for t in caches.tensors)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_byte_exact(layout, dtype):
    c = make_case(layout, dtype)
    seed = LAYOUTS.index(layout) * 10 + list(DTYPES.values()).index(dtype)
    round_trip(c.kv, c.bases, seed, f=1)
    round_trip(c.kv, c.bases, seed + 1000, f=3)


# --- several KV-cache groups -------------------------------------------------------------------------


def hybrid(dtype=torch.bfloat16, device="cpu"):
    """Full-attention layers l0, l2 (K/V split) and a sliding-window layer l1 (FlashInfer layout)."""
    z = lambda *s: torch.empty(s, dtype=dtype, device=device)
    return {"l0": z(2, NB, BS, H, D), "l1": z(NB, 2, BS, H, D), "l2": z(2, NB, BS, H, D)}


@pytest.mark.parametrize(
    "groups", [[["l0", "l2"], ["l1"]], {"full": ["l0", "l2"], "swa": ["l1"]}], ids=["list", "dict"]
)
def test_groups_refs(groups):
    kv = hybrid()
    c = canonicalize_kv_caches(kv, groups=groups)
    e = elems_per_block() * 2
    # canonical tensors in input order: l0 K, l0 V, l1, l2 K, l2 V
    assert [t.page_size_bytes for t in c.tensors] == [e, e, 2 * e, e, e]
    assert [[(r.tensor_idx, r.page_size_bytes) for r in g] for g in c.group_data_refs] == [
        [(0, e), (1, e), (3, e), (4, e)],
        [(2, 2 * e)],
    ]
    # a list of tensors: groups name indices
    c2 = canonicalize_kv_caches(list(kv.values()), groups=[[1], [0, 2]])
    assert [[r.tensor_idx for r in g] for g in c2.group_data_refs] == [[2], [0, 1, 3, 4]]
    # an empty group is allowed
    c3 = canonicalize_kv_caches(kv, groups=[["l0", "l1", "l2"], []])
    assert len(c3.group_data_refs) == 2 and c3.group_data_refs[1] == []


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("seed", range(3))
def test_groups_round_trip(dtype, seed):
    kv = hybrid(dtype)
    for f in (1, 2, 3):
        round_trip(kv, list(kv.values()), 100 * seed + f, f=f, groups=[["l0", "l2"], ["l1"]])
        groups = {"swa": ["l1", "l2"], "full": ["l0"]}
        round_trip(kv, list(kv.values()), 100 * seed + f + 50, f=f, groups=groups)


def test_groups_sharing_a_tensor():
    """vLLM's hybrid allocator: one tensor shared_by a layer of each group (different block tables);
    the attention layer's page is padded, the other layer uses the whole padded page."""
    e = elems_per_block()
    base = torch.zeros(NB, 2 * e + 32, dtype=torch.bfloat16)
    kv = {
        "attn0": base[:, : 2 * e].view(NB, 2, BS, H, D),
        "mamba0": base,
        "attn1": torch.zeros(NB, 2, BS, H, D, dtype=torch.bfloat16),
    }
    groups = [["attn0", "attn1"], ["mamba0"]]
    c = canonicalize_kv_caches(kv, groups=groups)
    padded = (2 * e + 32) * 2
    assert [t.page_size_bytes for t in c.tensors] == [padded, 4 * e]  # shared tensor = the widest view
    assert [[(r.tensor_idx, r.page_size_bytes) for r in g] for g in c.group_data_refs] == [
        [(0, 4 * e), (1, 4 * e)],
        [(0, padded)],
    ]
    for seed in range(4):
        round_trip(kv, [base, kv["attn1"]], 300 + seed, f=1 + seed % 2, groups=groups)
    # The same identical tensor in two groups is shared too; within one group it is an error.
    t = torch.zeros(NB, 64, dtype=torch.int8)
    c = canonicalize_kv_caches({"a": t, "b": t}, groups=[["a"], ["b"]])
    assert len(c.tensors) == 1 and [[r.tensor_idx for r in g] for g in c.group_data_refs] == [[0], [0]]
    with pytest.raises(ValueError, match="same memory"):
        canonicalize_kv_caches({"a": t, "b": t})


@pytest.mark.parametrize(
    ("groups", "exc", "match"),
    [
        ([["l0", "l2"], ["l1", "lx"]], ValueError, "unknown layer 'lx'"),
        ([["l0", "l2"], ["l1", "l0"]], ValueError, "'l0' is in KV-cache groups 0 and 1"),
        ([["l0", "l2"]], ValueError, r"\['l1'\] are in no KV-cache group"),
        ("l0", TypeError, "groups"),
        ([["l0", "l1", "l2"], "l1"], TypeError, r"groups\[1\]"),
    ],
)
def test_groups_rejected(groups, exc, match):
    with pytest.raises(exc, match=match):
        canonicalize_kv_caches(hybrid(), groups=groups)


# --- the engine's memory stays alive ------------------------------------------------------------------


def test_handlers_keep_the_tensors_alive():
    def build():
        kv = {f"l{i}": torch.arange(2 * NB * 64, dtype=torch.int16).reshape(2, NB, 64) + i for i in range(2)}
        return CpuGpuOffloadingHandlers(canonicalize_kv_caches(kv), 1, 8, engine="host")

    h = build()  # the caller keeps no reference to its tensors nor to the canonical caches
    gc.collect()
    junk = [torch.full((NB, 2, 64), 7, dtype=torch.int16) for _ in range(32)]  # reuse freed memory, if any
    st, ld = h.gpu_to_cpu_handler, h.cpu_to_gpu_handler
    st.transfer_async(1, (GPULoadStoreSpec([3, 5]), CPULoadStoreSpec([0, 1])))
    st.wait(1)
    assert st.get_finished()[0].success
    for i, cpu in enumerate(h.cpu_tensors):
        layer, kv = divmod(i, 2)
        want = (torch.arange(2 * NB * 64, dtype=torch.int16).reshape(2, NB, 64) + layer)[kv, [3, 5]]
        assert torch.equal(cpu[:2], want.view(torch.uint8)), i
    ld.transfer_async(2, (CPULoadStoreSpec([1, 0]), GPULoadStoreSpec([0, 1])))
    ld.wait(2)
    assert ld.get_finished()[0].success
    assert torch.equal(h.gpu_tensors[0][0], h.cpu_tensors[0][1])
    assert torch.equal(h.gpu_tensors[0][1], h.cpu_tensors[0][0])
    del junk
    h.shutdown()


def test_canonical_caches_keep_the_tensors_alive():
    t = torch.arange(NB * 32, dtype=torch.int8).reshape(NB, 32)
    want = t.clone()
    c = canonicalize_kv_caches({"l": t})
    del t
    gc.collect()
    assert torch.equal(c.tensors[0].tensor, want.view(torch.uint8))


# --- rejections -----------------------------------------------------------------------------------------


BAD_LAYOUTS = [
    ({"l": torch.zeros(NB, dtype=torch.bfloat16)}, r"l: shape \(12,\) is not a KV-cache layout"),
    ({"l": torch.zeros((), dtype=torch.int8)}, r"shape \(\)"),
    ({"a": torch.zeros(NB, 8), "b": torch.zeros(NB + 1, 8)}, r"a: \(12, 8\), b: \(13, 8\)"),
    ({"a": torch.zeros(2, NB, 8, 4), "b": torch.zeros(NB + 1, 2, 8)}, r"num_blocks"),
    (
        {"l": torch.zeros(NB, 8, 4, dtype=torch.float16).transpose(1, 2)},
        r"float16 shape \(12, 4, 8\).*cannot be viewed",
    ),
    ({"l": torch.zeros(NB, 100, 8, dtype=torch.int8)[:, :, :4]}, r"int8 shape \(12, 100, 4\).*at most 64"),
    (
        {"l": torch.zeros(NB, 1, 16, dtype=torch.int8).expand(NB, 2, 16)},
        r"shape \(12, 2, 16\).*cannot be viewed",
    ),
    ({"l": torch.zeros(2, 16, dtype=torch.int8).expand(NB, 2, 16)}, r"shape \(12, 2, 16\).*overlap"),
    (
        {"l": torch.zeros(NB * 8 + 8, dtype=torch.int8).as_strided((NB, 16), (8, 1))},
        r"shape \(12, 16\).*overlap",
    ),
    ({"l": torch.zeros(NB, 0, dtype=torch.int8)}, r"\(12, 0\) has empty blocks"),
    ({"l": torch.zeros(NB, 8, device="meta")}, r"on meta"),
]


@pytest.mark.parametrize(("kv", "match"), BAD_LAYOUTS)
def test_unknown_or_bad_layouts_rejected(kv, match):
    with pytest.raises(ValueError, match=match):
        canonicalize_kv_caches(kv)


def test_overlapping_views_rejected():
    base = torch.zeros(NB, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"b \(bfloat16 shape \(12, 40\).*overlap"):
        canonicalize_kv_caches({"a": base[:, :40], "b": base[:, 24:]})
    with pytest.raises(ValueError, match="same memory"):  # two names, one view
        canonicalize_kv_caches({"a": base, "b": base.view(NB, 2, 32)})
    with pytest.raises(ValueError, match="overlap"):  # even across groups when not identical views
        canonicalize_kv_caches({"a": base[:, :40], "b": base[:, 24:]}, groups=[["a"], ["b"]])
    kv = torch.zeros(2, NB, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="overlap"):  # a K/V tensor and a view of its V half
        canonicalize_kv_caches({"kv": kv, "v": kv[1, :, 8:]})
    # disjoint interleaved views (column ranges of the same rows) are fine
    c = canonicalize_kv_caches({"a": base[:, :24], "b": base[:, 24:]})
    assert [t.page_size_bytes for t in c.tensors] == [48, 80]


def test_non_tensors_rejected():
    with pytest.raises(TypeError, match="torch.Tensor"):
        canonicalize_kv_caches({"l": np.zeros((NB, 4))})
    with pytest.raises(TypeError, match="dict or list"):
        canonicalize_kv_caches(torch.zeros(NB, 4))
    with pytest.raises(ValueError, match="empty"):
        canonicalize_kv_caches({})


@pytest.mark.parametrize("engine", ["cuda", "dma", "kernel", "staged"])
def test_cpu_tensors_with_a_cuda_engine_rejected(engine):
    """Documented choice: CudaUnavailableError when there is no CUDA at all, else ValueError; both name
    the tensor (layer, dtype, shape) and its device."""
    kv = {"layer0": torch.zeros(2, NB, 16, dtype=torch.bfloat16)}
    exc = ValueError if kvoff.cuda_available() else CudaUnavailableError
    with pytest.raises(exc, match=r"layer0\[0\] \(K\) \(bfloat16 shape \(2, 12, 16\).* is on cpu"):
        CpuGpuOffloadingHandlers(kv, 1, 4, engine=engine)


# --- on a GPU -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["cuda", "dma", "kernel", "staged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_round_trip_byte_exact(layout, dtype, engine):
    c = make_case(layout, dtype, device="cuda")
    round_trip(c.kv, c.bases, LAYOUTS.index(layout), f=2, engine=engine)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_groups_round_trip_and_device_checks():
    kv = hybrid(torch.float8_e4m3fn, device="cuda")
    for f in (1, 3):
        round_trip(kv, list(kv.values()), f, f=f, groups=[["l0", "l2"], ["l1"]], engine="cuda")
    with pytest.raises(ValueError, match=r"different devices \(a on cuda:0, b on cpu\)"):
        canonicalize_kv_caches({"a": torch.zeros(NB, 8, device="cuda"), "b": torch.zeros(NB, 8)})
