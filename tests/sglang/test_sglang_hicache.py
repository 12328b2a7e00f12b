"""kvoff as SGLang's HiCache L3 backend, through SGLang 0.5.23's real classes on the CPU.

SGLang's real ``HiCacheStorageConfig``, its real host pools (``MHATokenToKVPoolHost``,
``MLATokenToKVPoolHost``, built by their constructors over CPU tensors standing in for the device
KV buffers), and its real ``StorageBackendFactory`` with the ``dynamic`` config load
``kvoff.sglang.KvoffHiCacheStorage``; pages are stored with ``batch_set_v1``, dropped from the host
pool, and loaded back with ``batch_get_v1`` into other host slots, compared byte for byte with
SGLang's own ``get_data_page``. A second process (a second server) sees the first's pages; ranks
and models are isolated; corrupt files are never served. The same backend on the remote tier (a
real ``redis-server``) and the object tier (SeaweedFS, ``tests/python/seaweed.py``, one server for
the session): a second backend finds the pages byte-exact; other namespaces see none; corrupt
values are never served.

Level: the backend under SGLang's factory and host pools. SGLang's ``HiCacheController`` (which
calls these methods from its prefetch and backup threads) is built from the device KV pool and
CUDA streams and does not run on the CPU; an SGLang server needs ``sgl_kernel`` / a GPU.

Runs in the ``sglang`` environment that ``scripts/test.sh`` makes (outside ``tests/python``, so the
main run does not collect it); skipped elsewhere (with
``KVOFF_REQUIRE_SGLANG=1``, as there, a missing SGLang is an error instead).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest

pytestmark = pytest.mark.sglang

try:
    import torch
    from kvoff.sglang import KvoffHiCacheStorage
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MambaStateBufferInfo,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageConfig,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except ImportError as e:
    if os.environ.get("KVOFF_REQUIRE_SGLANG") == "1":
        raise
    pytest.skip(f"SGLang 0.5.23 is not importable: {e}", allow_module_level=True)

PAGE = 4
LAYERS = 3
HEADS, HEAD_DIM = 2, 16
DEVICE_TOKENS = 64


def mha_pool(layout: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    """SGLang's MHA host pool, built by its constructor from CPU stand-ins for the device KV."""
    k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=PAGE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS,
    )


def mla_pool(layout: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    lora, rope = 32, 8
    bufs = tuple(torch.zeros(DEVICE_TOKENS, 1, lora + rope, dtype=dtype) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(LAYERS)),
        device_layer_num=LAYERS,
        page_size=PAGE,
        kv_lora_rank=lora,
        qk_rope_head_dim=rope,
        kv_cache_dim=lora + rope,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS,
        target_layer_num=LAYERS,
    )


def storage_config(
    path: Any,
    *,
    model: str = "org/tiny",
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    page_first: bool = False,
) -> Any:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config={
            "backend_name": "kvoff",
            "module_path": "kvoff.sglang",
            "class_name": "KvoffHiCacheStorage",
            "interface_v1": 1,
            "disk_path": str(path),
            "disk_bytes_to_use": 1 << 30,
            "io_threads": 4,
        },
    )


def backend(cfg: Any, pool: Any) -> Any:
    """SGLang's factory with the ``dynamic`` config, then the host pool registration the cache
    controller does."""
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    assert isinstance(b, KvoffHiCacheStorage)
    b.register_mem_pool_host(pool)
    return b


def fill(pool: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    buf = pool.kv_buffer
    raw = buf.view(torch.uint8) if buf.is_contiguous() else None
    assert raw is not None
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def page_bytes(pool: Any, slot: int) -> torch.Tensor:
    """SGLang's own view of one host page (``get_data_page``), as bytes."""
    return pool.get_data_page(slot * PAGE, flat=True).contiguous().view(torch.uint8).clone()


def indices(slots: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(s * PAGE, (s + 1) * PAGE, dtype=torch.int64) for s in slots])


KEYS = [f"{i:064x}" for i in range(1, 9)]

LAYOUTS = [
    ("mha", "layer_first"),
    ("mha", "page_first"),
    ("mha", "page_first_direct"),
    ("mla", "layer_first"),
    ("mla", "page_first"),
]


@pytest.mark.parametrize(("kind", "layout"), LAYOUTS)
def test_store_drop_load_byte_exact(tmp_path: Any, kind: str, layout: str) -> None:
    pool = (mha_pool if kind == "mha" else mla_pool)(layout)
    cfg = storage_config(tmp_path, mla=kind == "mla", page_first=layout != "layer_first")
    b = backend(cfg, pool)
    try:
        fill(pool, 1)
        src = [1, 2, 3, 4, 5, 6, 7, 8]
        want = [page_bytes(pool, s) for s in src]
        assert b.batch_set_v1(KEYS, indices(src)) == [True] * 8
        assert b.batch_exists(KEYS) == 8
        assert b.batch_exists(KEYS + ["f" * 64]) == 8
        assert b.batch_exists(["f" * 64] + KEYS) == 0
        pool.kv_buffer.zero_()  # the pages leave the host pool
        dst = [12, 11, 10, 9, 16, 15, 14, 13]
        assert b.batch_get_v1(KEYS, indices(dst)) == [True] * 8
        for w, d in zip(want, dst, strict=True):
            assert torch.equal(page_bytes(pool, d), w)
        st = b.kvoff_stats()
        assert st["disk_files_written"] == 8 and st["disk_reads"] == 8
        m = b.get_stats()
        assert sum(m.backup_pgs) == 8 and sum(m.prefetch_pgs) == 8
        # Stored again: already there, no write.
        assert b.batch_set_v1(KEYS[:2], indices(src[:2])) == [True, True]
        assert b.kvoff_stats()["disk_files_written"] == 8
    finally:
        b.close()


def test_missing_pages_read_false(tmp_path: Any) -> None:
    pool = mha_pool("page_first")
    b = backend(storage_config(tmp_path, page_first=True), pool)
    try:
        fill(pool, 2)
        assert b.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
        assert b.batch_get_v1([KEYS[0], "e" * 64, KEYS[1]], indices([5, 6, 7])) == [True, False, True]
    finally:
        b.close()


CHILD = r"""
import json, sys, torch
sys.path[:0] = json.loads(sys.argv[2])
import test_sglang_hicache as t
args = json.loads(sys.argv[1])
pool = t.mha_pool(args["layout"])
b = t.backend(t.storage_config(args["path"], page_first=args["layout"] != "layer_first"), pool)
n = b.batch_exists(args["keys"])
ok = b.batch_get_v1(args["keys"], t.indices(args["dst"]))
pages = [t.page_bytes(pool, d).tolist() for d in args["dst"]]
b.close()
print(json.dumps({"exists": n, "ok": ok, "pages": pages}))
"""


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_second_process_sees_the_pages(tmp_path: Any, layout: str) -> None:
    pool = mha_pool(layout)
    b = backend(storage_config(tmp_path, page_first=layout != "layer_first"), pool)
    try:
        fill(pool, 3)
        src = [1, 2, 3, 4]
        want = [page_bytes(pool, s).tolist() for s in src]
        assert b.batch_set_v1(KEYS[:4], indices(src)) == [True] * 4
    finally:
        b.close()
    here = os.path.dirname(os.path.abspath(__file__))
    args = {"path": str(tmp_path), "layout": layout, "keys": KEYS[:4], "dst": [9, 10, 11, 12]}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args), json.dumps([here, *sys.path])],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["exists"] == 4 and got["ok"] == [True] * 4
    assert got["pages"] == want


def test_ranks_and_models_are_isolated(tmp_path: Any) -> None:
    pool0, pool1, pool_other = mha_pool("page_first"), mha_pool("page_first"), mha_pool("page_first")
    r0 = backend(storage_config(tmp_path, tp_rank=0, tp_size=2, page_first=True), pool0)
    r1 = backend(storage_config(tmp_path, tp_rank=1, tp_size=2, page_first=True), pool1)
    other = backend(
        storage_config(tmp_path, model="org/other", tp_rank=0, tp_size=2, page_first=True), pool_other
    )
    single = backend(storage_config(tmp_path, tp_rank=0, tp_size=1, page_first=True), mha_pool("page_first"))
    try:
        fill(pool0, 4)
        assert r0.batch_set_v1(KEYS[:3], indices([1, 2, 3])) == [True] * 3
        for b in (r1, other, single):
            b.store.rescan()
            assert b.batch_exists(KEYS[:3]) == 0
            assert b.batch_get_v1(KEYS[:1], indices([5])) == [False]
        assert r0.batch_exists(KEYS[:3]) == 3
        # Ranks of one model share the namespace directory; the rank is in each file's name and
        # header (docs/tier.md), so a rank never reads another's heads.
        k0 = KEYS[0].encode()
        assert r0.store.path_of(k0) != r1.store.path_of(k0)
        assert other.store.dir != r0.store.dir
    finally:
        for b in (r0, r1, other, single):
            b.close()


def test_page_sizes_do_not_mix(tmp_path: Any) -> None:
    global PAGE
    a = backend(storage_config(tmp_path, page_first=True), mha_pool("page_first"))
    try:
        fill(a.mem_pool_host, 5)
        assert a.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
    finally:
        a.close()
    old = PAGE
    PAGE = 8
    try:
        b = backend(storage_config(tmp_path, page_first=True), mha_pool("page_first"))
        try:
            assert b.batch_exists(KEYS[:2]) == 0
        finally:
            b.close()
    finally:
        PAGE = old


def test_mla_one_writer_all_readers(tmp_path: Any) -> None:
    p0, p1 = mla_pool("page_first"), mla_pool("page_first")
    r0 = backend(storage_config(tmp_path, tp_rank=0, tp_size=2, mla=True, page_first=True), p0)
    r1 = backend(storage_config(tmp_path, tp_rank=1, tp_size=2, mla=True, page_first=True), p1)
    try:
        assert r0.storage_config.is_storage_writer and not r1.storage_config.is_storage_writer
        fill(p0, 6)
        fill(p1, 7)
        want = [page_bytes(p0, s) for s in (1, 2)]
        # The non-writer's backup is a no-op (SGLang's controller skips it too): nothing written.
        assert r1.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
        assert r1.kvoff_stats()["disk_files_written"] == 0
        assert r0.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
        r1.store.rescan()
        assert r1.batch_exists(KEYS[:2]) == 2
        assert r1.batch_get_v1(KEYS[:2], indices([8, 9])) == [True, True]
        assert torch.equal(page_bytes(p1, 8), want[0]) and torch.equal(page_bytes(p1, 9), want[1])
    finally:
        r0.close()
        r1.close()


def test_corrupt_files_are_never_served(tmp_path: Any) -> None:
    pool = mha_pool("layer_first")
    b = backend(storage_config(tmp_path), pool)
    try:
        fill(pool, 8)
        assert b.batch_set_v1(KEYS[:3], indices([1, 2, 3])) == [True] * 3
        paths = [b.store.path_of(k.encode()) for k in KEYS[:3]]
    finally:
        b.close()
    with open(paths[1], "r+b") as f:  # flip a payload byte of the middle page
        f.seek(4096 + 7)
        x = f.read(1)
        f.seek(4096 + 7)
        f.write(bytes([x[0] ^ 0x01]))
    with open(paths[2], "r+b") as f:  # truncate the last one
        f.truncate(4096 + 10)
    pool2 = mha_pool("layer_first")
    b2 = backend(storage_config(tmp_path), pool2)
    try:
        sentinel = page_bytes(pool2, 6)
        assert b2.batch_get_v1(KEYS[:3], indices([5, 6, 7])) == [True, False, False]
        assert torch.equal(page_bytes(pool2, 6), sentinel), "bytes of a corrupt file reached the host pool"
        st = b2.kvoff_stats()
        assert st["disk_corrupt_files"] == 2
        assert b2.batch_exists(KEYS[:3]) == 1
        assert not os.path.exists(paths[1]) and not os.path.exists(paths[2])
    finally:
        b2.close()


def test_bad_config_and_bad_calls_raise(tmp_path: Any) -> None:
    cfg = storage_config(tmp_path)
    cfg.extra_config = {k: v for k, v in cfg.extra_config.items() if k != "disk_path"}
    with pytest.raises(Exception, match="disk_path"):
        StorageBackendFactory.create_backend("dynamic", cfg, None)
    pool = mha_pool("page_first")
    b = backend(storage_config(tmp_path, page_first=True), pool)
    try:
        with pytest.raises(ValueError):
            b.batch_set_v1(KEYS[:2], indices([1]))  # one page of indices for two keys
    finally:
        b.close()


# --- v2: hybrid models (several host pools), SGLang's batch_*_v2 with PoolTransfers -------------

MAMBA_SLOTS = 8


def mamba_pool(side_state: bool = False) -> Any:
    """SGLang's Mamba host pool (page-first, one state slot per page), built by its constructor from
    CPU stand-ins for the device state; ``side_state`` adds a per-slot side buffer (then SGLang has no
    zero-copy page description and kvoff goes through its flat data pages)."""
    extra = (torch.zeros(MAMBA_SLOTS, 5, dtype=torch.int32),) if side_state else ()
    info = MambaStateBufferInfo(
        temporal=torch.zeros(LAYERS, MAMBA_SLOTS, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(LAYERS, MAMBA_SLOTS, 3, 16, dtype=torch.bfloat16),),
        extra_checkpoint_buffers=extra,
    )
    return MambaPoolHost(
        info, 2.0, 0, device_capacity=MAMBA_SLOTS, pin_memory=False, device="cpu", layout="page_first"
    )


def fill_mamba(pool: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in [pool.temporal_buffer, *pool.conv_buffer, *pool.slot_state_buffers]:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def zero_mamba(pool: Any) -> None:
    for t in [pool.temporal_buffer, *pool.conv_buffer, *pool.slot_state_buffers]:
        t.zero_()


def mamba_page(pool: Any, slot: int) -> torch.Tensor:
    return pool.get_data_page(slot, flat=True).contiguous().view(torch.uint8).clone()


def hybrid(tmp_path: Any, **kw: Any) -> tuple[Any, Any, Any]:
    """A hybrid model's registration as SGLang's hybrid cache controller does it: the KV anchor,
    then every host pool of the group through ``register_mem_host_pool_v2``."""
    kv, mamba = mha_pool("page_first"), mamba_pool(kw.pop("side_state", False))
    b = backend(storage_config(tmp_path, page_first=True, **kw), kv)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    b.on_host_pools_registered()
    return b, kv, mamba


@pytest.mark.parametrize("side_state", [False, True])
def test_v2_kv_and_mamba_byte_exact(tmp_path: Any, side_state: bool) -> None:
    b, kv, mamba = hybrid(tmp_path, side_state=side_state)
    try:
        fill(kv, 11)
        fill_mamba(mamba, 12)
        src_kv, src_m = [1, 2, 3, 4], [1, 2, 3, 4]
        want_kv = [page_bytes(kv, s) for s in src_kv]
        want_m = [mamba_page(mamba, s) for s in src_m]
        res = b.batch_set_v2(
            [
                PoolTransfer(name=PoolName.KV, host_indices=indices(src_kv), keys=KEYS[:4]),
                PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor(src_m), keys=KEYS[:4]),
            ]
        )
        assert res == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True] * 4}
        kv.kv_buffer.zero_()
        zero_mamba(mamba)
        dst_kv, dst_m = [12, 11, 10, 9], [7, 6, 5, 0]
        res = b.batch_get_v2(
            [
                PoolTransfer(name=PoolName.KV, host_indices=indices(dst_kv), keys=KEYS[:4]),
                PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor(dst_m), keys=KEYS[:4]),
            ]
        )
        assert res == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True] * 4}
        for w, d in zip(want_kv, dst_kv, strict=True):
            assert torch.equal(page_bytes(kv, d), w)
        for w, d in zip(want_m, dst_m, strict=True):
            assert torch.equal(mamba_page(mamba, d), w)
        assert b.kvoff_stats()["disk_files_written"] == 4
        assert b.kvoff_stats("mamba")["disk_files_written"] == 4
        assert b.kvoff_stats("mamba")["disk_reads"] == 4
        assert b.pools["mamba"].flat == side_state
        # The Mamba pool's files are a namespace of their own: same keys, separate pages.
        assert b.pools["mamba"].store.dir != b.store.dir
    finally:
        b.close()


def test_v2_exists_hit_policies(tmp_path: Any) -> None:
    b, kv, mamba = hybrid(tmp_path)
    try:
        fill(kv, 13)
        fill_mamba(mamba, 14)
        # KV for 6 pages; Mamba state only at pages 3 and 6 (SGLang keeps the state at node ends).
        assert (
            b.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=indices(range(6)), keys=KEYS[:6])])[
                PoolName.KV
            ]
            == [True] * 6
        )
        m = b.batch_set_v2(
            [PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([2, 5]), keys=[KEYS[2], KEYS[5]])]
        )
        assert m[PoolName.MAMBA] == [True, True]
        trailing = PoolTransfer(name=PoolName.MAMBA, keys=[KEYS[0]], hit_policy=PoolHitPolicy.TRAILING_PAGES)
        r = b.batch_exists_v2(KEYS, [trailing])
        assert r.kv_hit_pages == 6 and r.restorable_prefix_pages == [3, 6]
        assert r.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.MAMBA: 6}
        every = PoolTransfer(name=PoolName.MAMBA, keys=KEYS[:6], hit_policy=PoolHitPolicy.ALL_PAGES)
        r = b.batch_exists_v2(KEYS, [every])
        assert r.kv_hit_pages == 0 and r.restorable_prefix_pages == []
        r = b.batch_exists_v2(KEYS[:3], [trailing])
        assert r.kv_hit_pages == 3 and r.restorable_prefix_pages == [3]
        r = b.batch_exists_v2(["f" * 64, *KEYS], [trailing])
        assert r.kv_hit_pages == 0
        # SGLang's own result type, and its policy check for an unknown policy.
        blocks = PoolTransfer(name=PoolName.MAMBA, keys=KEYS[:1], hit_policy=PoolHitPolicy.BLOCK_GROUPS)
        with pytest.raises(ValueError, match="hit policy"):
            b.batch_exists_v2(KEYS, [blocks])
    finally:
        b.close()


def test_v2_swa_pool_and_errors(tmp_path: Any) -> None:
    """An SWA side pool (an MHA host pool of its own, layer-first) next to the KV anchor."""
    kv, swa = mha_pool("page_first"), mha_pool("layer_first")
    b = backend(storage_config(tmp_path, page_first=True), kv)
    try:
        b.register_mem_host_pool_v2(kv, PoolName.KV)
        b.register_mem_host_pool_v2(swa, PoolName.SWA)
        fill(swa, 15)
        want = [page_bytes(swa, s) for s in (1, 2)]
        t = PoolTransfer(name=PoolName.SWA, host_indices=indices([1, 2]), keys=KEYS[:2])
        assert b.batch_set_v2([t]) == {PoolName.SWA: [True, True]}
        assert b.batch_exists(KEYS[:2]) == 0  # SWA pages are not KV pages
        swa.kv_buffer.zero_()
        got = b.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=indices([5, 6]), keys=KEYS[:2])])
        assert got == {PoolName.SWA: [True, True]}
        assert torch.equal(page_bytes(swa, 5), want[0]) and torch.equal(page_bytes(swa, 6), want[1])
        missing = b.batch_get_v2(
            [PoolTransfer(name=PoolName.SWA, host_indices=indices([7]), keys=["e" * 64])]
        )
        assert missing == {PoolName.SWA: [False]}
        with pytest.raises(ValueError, match="not registered"):
            b.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=indices([1]), keys=KEYS[:1])])
        with pytest.raises(ValueError, match="host indices"):
            b.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=indices([1]), keys=KEYS[:2])])
    finally:
        b.close()


def test_v2_mla_mamba_is_sharded(tmp_path: Any) -> None:
    """MLA KV is replicated (rank 0 writes, every rank reads); Mamba state is TP-sharded (each rank
    writes its own), as in SGLang's ``file`` backend."""
    out: list[tuple[int, int]] = []
    for rank in (0, 1):
        kv, mamba = mla_pool("page_first"), mamba_pool()
        b = backend(storage_config(tmp_path, mla=True, tp_rank=rank, tp_size=2, page_first=True), kv)
        b.register_mem_host_pool_v2(kv, PoolName.KV)
        b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        try:
            fill(kv, 20 + rank)
            fill_mamba(mamba, 30 + rank)
            every = PoolTransfer(name=PoolName.MAMBA, keys=KEYS[:1], hit_policy=PoolHitPolicy.ALL_PAGES)
            seen = b.batch_exists_v2(KEYS[:1], [every])
            # Rank 1 sees rank 0's MLA KV page (shared) but not its Mamba state (rank 0's shard).
            assert seen.extra_pool_hit_pages == ({} if rank == 0 else {PoolName.KV: 1})
            assert seen.kv_hit_pages == 0
            res = b.batch_set_v2(
                [
                    PoolTransfer(name=PoolName.KV, host_indices=indices([1]), keys=KEYS[:1]),
                    PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1]), keys=KEYS[:1]),
                ]
            )
            assert res == {PoolName.KV: [True], PoolName.MAMBA: [True]}
            out.append((b.kvoff_stats()["disk_files_written"], b.kvoff_stats("mamba")["disk_files_written"]))
        finally:
            b.close()
    assert out == [(1, 1), (0, 1)]  # rank 1 wrote no KV file, and its own Mamba file


# --- the remote tier (a real redis-server) under the same backend --------------------------------


@pytest.fixture
def redis_url() -> Any:
    """A real ``redis-server`` on loopback (tests/python/redis_servers.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import redis_servers as rs

    reason = rs.missing_reason()
    if reason is not None:
        if os.environ.get("KVOFF_REQUIRE_REDIS"):
            pytest.fail(f"KVOFF_REQUIRE_REDIS is set but: {reason}")
        pytest.skip(reason)
    srv = rs.RedisServer(name="sglang-hicache")
    try:
        yield srv.start().url
    finally:
        srv.close()


def remote_config(url: str, **kw: Any) -> Any:
    cfg = storage_config("unused", **kw)
    extra = dict(cfg.extra_config)
    del extra["disk_path"]
    extra["remote_url"] = url
    cfg.extra_config = extra
    return cfg


@pytest.mark.server_neutral  # SGLang's backend over the remote tier (tests/python/conftest.py)
def test_remote_tier_second_server_byte_exact(redis_url: str) -> None:
    """One backend, tiers chosen by its extra config: ``remote_url`` puts SGLang's pages on Redis;
    a second backend instance (a second server) finds them and loads them byte-exact, v1 and v2."""
    pool = mha_pool("page_first")
    mamba = mamba_pool()
    b = backend(remote_config(redis_url, page_first=True), pool)
    b.register_mem_host_pool_v2(pool, PoolName.KV)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    try:
        assert b.store.kind == "remote"
        fill(pool, 41)
        fill_mamba(mamba, 42)
        src = [1, 2, 3, 4]
        want = [page_bytes(pool, s) for s in src]
        want_m = mamba_page(mamba, 3)
        assert b.batch_set_v1(KEYS[:4], indices(src)) == [True] * 4
        m = b.batch_set_v2(
            [PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=[KEYS[3]])]
        )
        assert m == {PoolName.MAMBA: [True]}
        assert b.kvoff_stats()["remote_writes"] == 4
    finally:
        b.close()
    pool2, mamba2 = mha_pool("page_first"), mamba_pool()
    b2 = backend(remote_config(redis_url, page_first=True), pool2)
    b2.register_mem_host_pool_v2(pool2, PoolName.KV)
    b2.register_mem_host_pool_v2(mamba2, PoolName.MAMBA)
    try:
        # A fresh index: batch_exists asks the server (one batched round trip).
        assert b2.batch_exists(KEYS) == 4
        trailing = PoolTransfer(name=PoolName.MAMBA, keys=[KEYS[0]], hit_policy=PoolHitPolicy.TRAILING_PAGES)
        r = b2.batch_exists_v2(KEYS[:4], [trailing])
        assert r.kv_hit_pages == 4 and r.restorable_prefix_pages == [4]
        dst = [9, 10, 11, 12]
        assert b2.batch_get_v1(KEYS[:4], indices(dst)) == [True] * 4
        for w, d in zip(want, dst, strict=True):
            assert torch.equal(page_bytes(pool2, d), w)
        got = b2.batch_get_v2(
            [PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([6]), keys=[KEYS[3]])]
        )
        assert got == {PoolName.MAMBA: [True]}
        assert torch.equal(mamba_page(mamba2, 6), want_m)
        assert b2.batch_get_v1(["d" * 64], indices([13])) == [False]
        st = b2.kvoff_stats()
        assert st["remote_reads"] == 4 and st["remote_rejected_values"] == 0
    finally:
        b2.close()


@pytest.mark.server_neutral
def test_remote_and_disk_together_is_refused(tmp_path: Any, redis_url: str) -> None:
    cfg = storage_config(tmp_path)
    cfg.extra_config = {**cfg.extra_config, "remote_url": redis_url}
    with pytest.raises(Exception, match="not both"):
        StorageBackendFactory.create_backend("dynamic", cfg, mha_pool("page_first"))


def test_remote_settings_are_checked_by_the_block_stores_reader() -> None:
    """Every remote integer and seconds setting in the extra config goes through the block store's
    own reader when the backend is built: out of range (never an ``OverflowError``) or a ``bool`` is
    a ``ConfigError`` (a ``ValueError``) naming the key; the settings table is what it takes."""
    from kvoff import tiers
    from kvoff.errors import ConfigError
    from kvoff.sglang import backend as sglang_backend

    for name in tiers.settings_of("disk", "store") + tiers.settings_of("remote", "store"):
        assert name in sglang_backend.SETTINGS, name
    bad = {
        "remote_io_threads": (-1, 2**64, 0, 65),
        "remote_max_queued_writes": (-1, 2**64),
        "remote_max_inflight_bytes": (-1, 2**64),
        "remote_max_fetch_keys": (-1, 2**64),
        "remote_ttl_s": (-1, 0),
        "remote_connect_timeout_s": (-1, 0),
        "remote_timeout_s": (-1, 0),
        "remote_negative_ttl_s": (-1, 0),
        "remote_idle_spin_s": (-1, 0.5),
        "remote_idle_nap_s": (-1, 0.5),
    }
    for name, values in bad.items():
        for v in (*values, True):
            cfg = remote_config("redis://127.0.0.1:1")
            cfg.extra_config = {**cfg.extra_config, name: v}
            with pytest.raises(ConfigError, match=name) as e:
                KvoffHiCacheStorage(cfg)
            assert not isinstance(e.value, OverflowError)
    cfg = remote_config("redis://127.0.0.1:1")
    cfg.extra_config = {**cfg.extra_config, "remote_io_threads": 2, "remote_timeout_s": 0.5}
    b = KvoffHiCacheStorage(cfg)
    assert b.lookup_wait_s == 0.5
    b.close()


# --- the object tier (a real SeaweedFS) under the same backend -----------------------------------


@pytest.fixture(scope="session")
def seaweed_server() -> Any:
    """One SeaweedFS S3 server for the session (tests/python/seaweed.py, as tests/python's
    ``seaweed`` fixture); each test writes under a prefix of its own."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import seaweed as sw

    reason = sw.missing_reason()
    if reason is not None:
        if os.environ.get("KVOFF_REQUIRE_SEAWEED"):
            pytest.fail(f"KVOFF_REQUIRE_SEAWEED is set but: {reason}")
        pytest.skip(reason)
    srv = sw.SeaweedServer(name="sglang-hicache")
    try:
        yield srv.start()
    finally:
        srv.close()


class S3:
    """The session's server, this test's ``s3://`` prefix, and what the bucket holds under it."""

    def __init__(self, srv: Any) -> None:
        self.srv = srv
        self.prefix = f"sglang-{uuid.uuid4().hex[:12]}"
        self.url = f"s3://{srv.bucket}/{self.prefix}"

    def keys(self) -> set[str]:
        with self.srv.client() as c:
            return set(c.list_keys(self.srv.bucket, self.prefix + "/"))

    def flip(self, key: str, at: int) -> None:
        """Another client overwrites the object with the byte at ``at`` flipped (same length)."""
        with self.srv.client() as c:
            data = bytearray(c.get_object(self.srv.bucket, key) or b"")
            data[at] ^= 0x01
            c.put_object(self.srv.bucket, key, bytes(data))

    def truncate(self, key: str, n: int) -> None:
        with self.srv.client() as c:
            data = c.get_object(self.srv.bucket, key) or b""
            c.put_object(self.srv.bucket, key, data[:n])


@pytest.fixture
def s3(seaweed_server: Any, monkeypatch: pytest.MonkeyPatch) -> S3:
    """Credentials from the environment (the only place the object tier takes them); the endpoint
    only from the extra config (``object_endpoint``), none in the environment."""
    env = seaweed_server.env()
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(k, env[k])
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    return S3(seaweed_server)


def object_config(s3: S3, **kw: Any) -> Any:
    extra_kw = {k: kw.pop(k) for k in list(kw) if k.startswith("object_") or k == "namespace"}
    cfg = storage_config("unused", **kw)
    extra = dict(cfg.extra_config)
    del extra["disk_path"]
    extra.update(
        object_url=s3.url,
        object_endpoint=s3.srv.endpoint,
        object_timeout_s=2.0,
        object_connect_timeout_s=0.5,
        object_negative_ttl_s=0.2,
        **extra_kw,
    )
    cfg.extra_config = extra
    return cfg


def store_pages(b: Any, s3: S3, pool: Any, keys: list[str], slots: list[int]) -> list[str]:
    """``batch_set_v1`` page by page; each page's object name (what the bucket gained)."""
    names = []
    for k, slot in zip(keys, slots, strict=True):
        before = s3.keys()
        assert b.batch_set_v1([k], indices([slot])) == [True]
        (name,) = s3.keys() - before
        names.append(name)
    return names


def test_object_tier_second_backend_byte_exact(s3: S3) -> None:
    """``object_url`` in the extra config puts SGLang's pages in the bucket; a second backend (new
    block stores: an empty index, which learns from the bucket) finds them and loads them
    byte-exact, v1 and v2; kvoff's figures are the object tier's rows of ``kvoff.tiers.METRICS``."""
    from kvoff.tiers import METRICS

    pool, mamba = mha_pool("page_first"), mamba_pool()
    b = backend(object_config(s3, page_first=True), pool)
    b.register_mem_host_pool_v2(pool, PoolName.KV)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    try:
        assert b.kind == "object" and b.store.kind == "object" and b.pools["mamba"].store.kind == "object"
        fill(pool, 51)
        fill_mamba(mamba, 52)
        src = [1, 2, 3, 4]
        want = [page_bytes(pool, s) for s in src]
        want_m = mamba_page(mamba, 3)
        assert b.batch_set_v1(KEYS[:4], indices(src)) == [True] * 4
        m = b.batch_set_v2(
            [PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=[KEYS[3]])]
        )
        assert m == {PoolName.MAMBA: [True]}
        st = b.kvoff_stats()
        assert st["object_writes"] == 4 and st["object_bytes_written"] == 4 * b.page_bytes
        assert b.kvoff_stats("mamba")["object_writes"] == 1
        assert len(s3.keys()) == 5  # four KV pages and one Mamba state, one object each
        assert sum(b.get_stats().backup_pgs) == 4
    finally:
        b.close()
    pool2, mamba2 = mha_pool("page_first"), mamba_pool()
    b2 = backend(object_config(s3, page_first=True), pool2)
    b2.register_mem_host_pool_v2(pool2, PoolName.KV)
    b2.register_mem_host_pool_v2(mamba2, PoolName.MAMBA)
    try:
        # A fresh index: batch_exists learns from the bucket (its listing, or HEAD requests).
        assert b2.batch_exists(KEYS) == 4
        trailing = PoolTransfer(name=PoolName.MAMBA, keys=[KEYS[0]], hit_policy=PoolHitPolicy.TRAILING_PAGES)
        r = b2.batch_exists_v2(KEYS[:4], [trailing])
        assert r.kv_hit_pages == 4 and r.restorable_prefix_pages == [4]
        dst = [9, 10, 11, 12]
        assert b2.batch_get_v1(KEYS[:4], indices(dst)) == [True] * 4
        for w, d in zip(want, dst, strict=True):
            assert torch.equal(page_bytes(pool2, d), w)
        got = b2.batch_get_v2(
            [PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([6]), keys=[KEYS[3]])]
        )
        assert got == {PoolName.MAMBA: [True]}
        assert torch.equal(mamba_page(mamba2, 6), want_m)
        sentinel = page_bytes(pool2, 13)
        assert b2.batch_get_v1(["d" * 64], indices([13])) == [False]
        assert torch.equal(page_bytes(pool2, 13), sentinel)
        st = b2.kvoff_stats()
        assert st["object_reads"] == 4 and st["object_bytes_read"] == 4 * b2.page_bytes
        assert st["object_rejected_values"] == 0 and st["object_writes"] == 0 and st["object_up"] == 1
        assert sum(b2.get_stats().prefetch_pgs) == 4
        # Every figure the object tier's table lists for the block store, and no other tier's.
        for row in METRICS["object"]:
            assert (row.key in st) == ("store" in row.surfaces), row.key
        assert not any(k.startswith(("disk_", "remote_")) for k in st)
    finally:
        b2.close()


def test_object_tier_other_namespaces_see_nothing(s3: S3) -> None:
    """Another ``namespace``, model or TP rank finds none of the pages; ``object_namespace`` stands
    for ``namespace`` (the pool's geometry is still added: an SWA pool of the KV pool's geometry
    never shares its pages)."""
    pool = mha_pool("page_first")
    b = backend(object_config(s3, page_first=True), pool)
    try:
        fill(pool, 53)
        want = page_bytes(pool, 1)
        assert b.batch_set_v1(KEYS[:3], indices([1, 2, 3])) == [True] * 3
    finally:
        b.close()
    for kw, seen in (
        ({"namespace": "org/other"}, 0),
        ({"model": "org/other"}, 0),
        ({"tp_rank": 1, "tp_size": 2}, 0),
        ({"namespace": "org/other", "object_namespace": "org/tiny"}, 3),  # the writer's model name
    ):
        pool2 = mha_pool("page_first")
        b2 = backend(object_config(s3, page_first=True, **kw), pool2)
        try:
            assert b2.batch_exists(KEYS[:3]) == seen, kw
            ok = b2.batch_get_v1(KEYS[:1], indices([5]))
            assert ok == [bool(seen)], kw
            assert torch.equal(page_bytes(pool2, 5), want) == bool(seen), kw
        finally:
            b2.close()
    # With object_namespace set, an SWA pool of the KV pool's geometry is still a namespace apart.
    kv, swa = mha_pool("page_first"), mha_pool("page_first")
    b3 = backend(object_config(s3, page_first=True, object_namespace="shared"), kv)
    try:
        b3.register_mem_host_pool_v2(kv, PoolName.KV)
        b3.register_mem_host_pool_v2(swa, PoolName.SWA)
        fill(swa, 54)
        t = PoolTransfer(name=PoolName.SWA, host_indices=indices([1, 2]), keys=KEYS[4:6])
        assert b3.batch_set_v2([t]) == {PoolName.SWA: [True, True]}
        assert b3.batch_exists(KEYS[4:6]) == 0  # SWA pages are not KV pages
        assert b3.pools["swa"].store.dir == b3.store.dir  # one bucket prefix; namespaces inside
    finally:
        b3.close()


def test_object_tier_corrupt_pages_are_never_served(s3: S3) -> None:
    """A page whose object another client overwrote with a byte flipped, and one cut short: read
    as missing, counted as rejected, deleted from the bucket, the host pool untouched."""
    pool = mha_pool("layer_first")
    b = backend(object_config(s3), pool)
    try:
        fill(pool, 55)
        names = store_pages(b, s3, pool, KEYS[:3], [1, 2, 3])
        size = b.page_bytes
    finally:
        b.close()
    s3.flip(names[1], -size // 2)  # a payload byte of the middle page
    s3.truncate(names[2], 100)  # the last one cut inside its header
    pool2 = mha_pool("layer_first")
    b2 = backend(object_config(s3), pool2)
    try:
        # The first listing sees the short value's length and rejects it; the flipped one has the
        # right length and is held until a read checks it. (Read before that listing ends, the
        # short value may be rejected twice, by the listing and by the read's HEAD: counted 3.)
        deadline = time.monotonic() + 20
        while b2.kvoff_stats()["object_listings"] < 1:
            assert time.monotonic() < deadline, "the first listing never finished"
            time.sleep(0.005)
        assert b2.kvoff_stats()["object_rejected_values"] == 1
        assert b2.batch_exists(KEYS[:3]) == 2
        sentinel = [page_bytes(pool2, s) for s in (6, 7)]
        assert b2.batch_get_v1(KEYS[:3], indices([5, 6, 7])) == [True, False, False]
        assert torch.equal(page_bytes(pool2, 6), sentinel[0]), "bytes of a corrupt page reached the pool"
        assert torch.equal(page_bytes(pool2, 7), sentinel[1]), "bytes of a short page reached the pool"
        st = b2.kvoff_stats()
        assert st["object_rejected_values"] == 2 and st["object_reads"] == 1
        assert b2.batch_exists(KEYS[:3]) == 1
        assert s3.keys() == {names[0]}
    finally:
        b2.close()


def test_object_settings_are_checked_by_the_block_stores_reader() -> None:
    """Every object setting of the block store is read from the extra config and checked when the
    backend is built (a ``ConfigError`` naming the key); one tier per backend."""
    from kvoff import tiers
    from kvoff.errors import ConfigError
    from kvoff.sglang import backend as sglang_backend

    for name in tiers.settings_of("object", "store"):
        assert name in sglang_backend.SETTINGS, name
    url = "s3://kvoff-unused/p"

    def cfg(**kw: Any) -> Any:
        c = remote_config("unused")
        extra = {k: v for k, v in c.extra_config.items() if k != "remote_url"}
        c.extra_config = {**extra, "object_url": url, **kw}
        return c

    bad = {
        "object_timeout_s": (-1, 0),
        "object_connect_timeout_s": (-1, 0),
        "object_ttl_s": (-1, 0),
        "object_io_threads": (-1, 0, 65),
        "object_max_retries": (-1, 2**64),
        "object_bytes_to_use": (-1, 2**64),
        "object_namespace": (1,),
    }
    for name, values in bad.items():
        for v in (*values, True):
            with pytest.raises(ConfigError, match=name):
                KvoffHiCacheStorage(cfg(**{name: v}))
    for both in ({"disk_path": "/tmp/x"}, {"remote_url": "redis://127.0.0.1:1"}):
        with pytest.raises(ConfigError, match="not both"):
            KvoffHiCacheStorage(cfg(**both))
    b = KvoffHiCacheStorage(cfg(object_timeout_s=0.75, namespace="ns", object_namespace="ons"))
    assert b.kind == "object" and b.lookup_wait_s == 0.75 and b.namespace_base == "ons"
    b.close()
