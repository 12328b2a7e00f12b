"""kvoff's file tier as a secondary tier under vLLM 0.33's own ``TieringOffloadingSpec``.

Two levels, both through vLLM's real code on the CPU:

1. The tier alone, as vLLM's ``tests/v1/kv_offload/tiering/test_fs_tier.py`` drives its ``fs``
   tier: built by vLLM's ``SecondaryTierFactory`` from a ``module_path`` config, a page-aligned CPU
   tensor standing in for the CPU tier, ``TransferJob``s in, ``JobResult``s out.
2. vLLM's ``TieringOffloadingSpec.get_manager()``: the real ``TieringOffloadingManager`` with its
   real CPU primary tier (``CPUPrimaryTierOffloadingManager`` over the ``SharedOffloadRegion`` in
   ``/dev/shm``) and kvoff's tier behind it. Stores to the primary cascade into kvoff's files; a
   fresh spec (a restarted engine) finds them, promotes them into its primary tier, byte-exact.
   vLLM's CPU-tier *worker* (GPU <-> CPU copies) refuses to start without CUDA ("CPU Offloading
   is currently only supported on CUDA-alike and XPU GPUs", ``CPUOffloadingSpec.get_worker``), so
   the bytes a worker would copy into the primary tier are written into its memoryview here.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.vllm

try:
    import torch
    from kvoff.vllm.tiering import KvoffFileTier
    from vllm.v1.kv_offload.base import (
        LookupResult,
        OffloadingKVEventsConfig,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
except ImportError as e:
    pytest.skip(f"vLLM 0.33's tiering is not importable: {e}", allow_module_level=True)

CTX = ReqContext(req_id="test")
NUM_CHUNKS = 8
CHUNK_ELEMS = 16 * mmap.PAGESIZE // 4  # 64 KiB chunks of float32


def _config(
    model: str = "test-model",
    rank: int = 0,
    world: int = 1,
    extra: dict[str, Any] | None = None,
    worker_bytes: int = 8192,
    engine_id: str | None = None,
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer",), 0),),
        worker_kv_bytes_per_block=worker_bytes,
        enable_kv_cache_events=False,
        extra_config=dict(extra or {}),
        engine_id=engine_id or f"kvoff-test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name=model, dtype="float32", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world,
            tp_size=world,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


class _Spec:
    """What a secondary tier reads of its ``OffloadingSpec`` (vLLM's fs-tier test uses a mock)."""

    def __init__(self, config: OffloadingConfig) -> None:
        self.config = config
        self.blocks_per_chunk = 1
        self.kv_events_config = OffloadingKVEventsConfig(
            enable_kv_cache_events=False, self_describing_kv_events=False
        )


def _aligned(num: int, elems: int) -> torch.Tensor:
    raw = torch.zeros(num * elems * 4 + mmap.PAGESIZE, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % mmap.PAGESIZE
    return raw[shift : shift + num * elems * 4].view(torch.float32).view(num, elems)


def key(n: int) -> bytes:
    return make_offload_key(n.to_bytes(8, "big"), 0)


def job(job_id: int, keys: list[bytes], chunks: list[int], promotion: bool = False) -> TransferJob:
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(chunks, dtype=np.int64),
        is_promotion=promotion,
        req_context=CTX,
    )


def _tier(path: Any, tensor: torch.Tensor, model: str = "test-model", **kw: Any) -> KvoffFileTier:
    cfg = {"type": "KvoffFileTier", "module_path": "kvoff.vllm.tiering", "disk_path": str(path)}
    cfg.update(kw)
    tier = SecondaryTierFactory.create_secondary_tier(cfg, memoryview(tensor.numpy()), _Spec(_config(model)))
    assert isinstance(tier, KvoffFileTier)
    return tier


def drain(tier: KvoffFileTier) -> list[Any]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


@pytest.fixture
def kv_tier(tmp_path: Any) -> Any:
    t = _aligned(NUM_CHUNKS, CHUNK_ELEMS)
    tier = _tier(tmp_path, t)
    yield tier, t
    tier.shutdown()


# --- level 1: the tier, as vLLM's test_fs_tier.py drives the fs tier ----------------------------


def test_lookup_empty_tier(kv_tier: Any) -> None:
    tier, _ = kv_tier
    assert [tier.lookup(key(i), CTX) for i in (1, 2)] == [LookupResult.MISS] * 2


def test_store_creates_file_and_lookup_succeeds(kv_tier: Any) -> None:
    tier, t = kv_tier
    t[0] = torch.rand(CHUNK_ELEMS)
    tier.submit_store(job(1, [key(1)], [0]))
    res = drain(tier)
    assert [(r.job_id, r.success) for r in res] == [(1, True)]
    assert res[0].transfer_bytes == CHUNK_ELEMS * 4
    assert tier.lookup(key(1), CTX) is LookupResult.HIT
    assert os.path.exists(tier.store.path_of(key(1)))


def test_store_then_load_is_byte_exact(kv_tier: Any) -> None:
    tier, t = kv_tier
    t[:4] = torch.rand(4, CHUNK_ELEMS)
    want = t[:4].clone()
    tier.submit_store(job(1, [key(i) for i in range(4)], [0, 1, 2, 3]))
    assert all(r.success for r in drain(tier))
    t.zero_()
    tier.submit_load(job(2, [key(3), key(0)], [5, 6], promotion=True))
    res = drain(tier)
    assert [(r.job_id, r.success) for r in res] == [(2, True)]
    assert torch.equal(t[5], want[3]) and torch.equal(t[6], want[0])


def test_store_of_present_key_is_a_success_without_a_write(kv_tier: Any) -> None:
    tier, _t = kv_tier
    tier.submit_store(job(1, [key(1)], [0]))
    drain(tier)
    tier.submit_store(job(2, [key(1)], [1]))
    assert [(r.job_id, r.success) for r in drain(tier)] == [(2, True)]
    assert tier.stats()["disk_files_written"] == 1


def test_load_of_missing_key_fails_and_keeps_the_others(kv_tier: Any) -> None:
    tier, t = kv_tier
    t[0] = 1.5
    tier.submit_store(job(1, [key(1)], [0]))
    drain(tier)
    tier.submit_load(job(2, [key(1), key(99)], [3, 4], promotion=True))
    (r,) = drain(tier)
    assert not r.success and list(r.successful_keys or ()) == [key(1)]
    assert torch.all(t[3] == 1.5)


def test_fresh_instance_loads_the_files(tmp_path: Any) -> None:
    t = _aligned(NUM_CHUNKS, CHUNK_ELEMS)
    t[:3] = torch.rand(3, CHUNK_ELEMS)
    want = t[:3].clone()
    a = _tier(tmp_path, t)
    a.submit_store(job(1, [key(i) for i in range(3)], [0, 1, 2]))
    assert all(r.success for r in drain(a))
    a.shutdown()
    t2 = _aligned(NUM_CHUNKS, CHUNK_ELEMS)
    b = _tier(tmp_path, t2)
    try:
        assert [b.lookup(key(i), CTX) for i in range(3)] == [LookupResult.HIT] * 3
        b.submit_load(job(7, [key(i) for i in range(3)], [7, 6, 5], promotion=True))
        assert [r.success for r in drain(b)] == [True]
        assert torch.equal(t2[7], want[0]) and torch.equal(t2[6], want[1]) and torch.equal(t2[5], want[2])
    finally:
        b.shutdown()


def test_other_model_does_not_see_the_files(tmp_path: Any) -> None:
    t = _aligned(NUM_CHUNKS, CHUNK_ELEMS)
    a = _tier(tmp_path, t, model="model-a")
    a.submit_store(job(1, [key(1)], [0]))
    drain(a)
    b = _tier(tmp_path, t, model="model-b")
    try:
        assert b.lookup(key(1), CTX) is LookupResult.MISS
        assert a.lookup(key(1), CTX) is LookupResult.HIT
    finally:
        a.shutdown()
        b.shutdown()


def test_corrupt_file_is_never_served(tmp_path: Any) -> None:
    t = _aligned(NUM_CHUNKS, CHUNK_ELEMS)
    t[0] = 2.0
    a = _tier(tmp_path, t)
    a.submit_store(job(1, [key(1)], [0]))
    drain(a)
    path = a.store.path_of(key(1))
    a.shutdown()
    with open(path, "r+b") as f:  # flip one payload byte
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    t2 = _aligned(NUM_CHUNKS, CHUNK_ELEMS)
    c = _tier(tmp_path, t2)
    try:
        c.submit_load(job(2, [key(1)], [3], promotion=True))
        (r,) = drain(c)
        # The job fails, so vLLM never serves the row (with O_DIRECT into aligned rows the file is
        # read straight into the row before its checksum is known: the row's bytes are undefined
        # after a failed load, as after a failed read of vLLM's own fs tier).
        assert not r.success and not r.successful_keys
        assert c.stats()["disk_corrupt_files"] == 1
        assert c.lookup(key(1), CTX) is LookupResult.MISS
        assert not os.path.exists(path)
    finally:
        c.shutdown()


def test_events_for_stored_chunks(tmp_path: Any) -> None:
    t = _aligned(NUM_CHUNKS, CHUNK_ELEMS)
    spec = _Spec(_config())
    spec.kv_events_config = OffloadingKVEventsConfig(
        enable_kv_cache_events=True, self_describing_kv_events=False
    )
    cfg = {
        "type": "kvoff",
        "module_path": "kvoff.vllm.tiering",
        "disk_path": str(tmp_path),
        "enable_kv_events": True,
        "locality": "LOCAL",
    }
    tier = SecondaryTierFactory.create_secondary_tier(cfg, memoryview(t.numpy()), spec)
    try:
        tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
        drain(tier)
        (ev,) = list(tier.take_events())
        assert list(ev.keys) == [key(1), key(2)] and not ev.removed
    finally:
        tier.shutdown()


# --- level 2: vLLM's TieringOffloadingSpec + TieringOffloadingManager ----------------------------


def _step(manager: Any) -> None:
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
    list(manager.take_events())


def _tiering_spec(path: Any, engine_id: str) -> Any:
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 64 * 8192,
        "secondary_tiers": [
            {"type": "KvoffFileTier", "module_path": "kvoff.vllm.tiering", "disk_path": str(path)}
        ],
    }
    return TieringOffloadingSpec(_config(extra=extra, engine_id=engine_id))


def _wait(manager: Any, tier: Any, cond: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        tier.drain_jobs()
        _step(manager)


def test_tiering_spec_cascades_to_kvoff_and_a_fresh_engine_promotes(tmp_path: Any) -> None:
    spec = _tiering_spec(tmp_path, f"kvoff-a-{uuid.uuid4().hex[:8]}")
    manager = spec.get_manager()
    try:
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, KvoffFileTier)
        view = np.asarray(manager.primary_tier.get_kv_memoryview())
        keys = [key(100 + i) for i in range(5)]
        manager.on_new_request(CTX)
        out = manager.prepare_store(keys, CTX)
        assert out is not None and len(list(out.keys_to_store)) == 5
        rng = np.random.default_rng(0)
        want = {}
        # The worker's part (GPU -> CPU copy) on the CPU: fill the rows vLLM gave the chunks.
        ids = list(out.store_spec.block_ids)
        for k, row in zip(out.keys_to_store, ids, strict=True):
            data = rng.integers(0, 255, size=view.shape[1], dtype=np.uint8)
            view[int(row)].view(np.uint8)[:] = data
            want[bytes(k)] = data.copy()
        manager.complete_store(keys, CTX, success=True)
        manager.on_request_finished(CTX)
        _wait(manager, tier, lambda: all(tier.store.contains(k) for k in keys), "the cascade to kvoff")
        assert tier.stats()["disk_files_written"] == 5
    finally:
        manager.shutdown()

    # A restarted engine: empty CPU tier, kvoff's files on disk.
    spec2 = _tiering_spec(tmp_path, f"kvoff-b-{uuid.uuid4().hex[:8]}")
    m2 = spec2.get_manager()
    try:
        (tier2,) = m2.secondary_tiers
        view2 = np.asarray(m2.primary_tier.get_kv_memoryview())
        ctx2 = ReqContext(req_id="again")
        m2.on_new_request(ctx2)
        first = [m2.lookup(k, ctx2) for k in keys]
        assert all(r in (LookupResult.HIT_PENDING, LookupResult.RETRY) for r in first), first

        def promoted() -> bool:
            return all(m2.lookup(k, ctx2) is LookupResult.HIT for k in keys)

        _wait(m2, tier2, promoted, "the promotion from kvoff")
        spec_load = m2.prepare_load(keys, ctx2)
        rows = list(spec_load.block_ids)
        for k, row in zip(keys, rows, strict=True):
            assert np.array_equal(view2[int(row)].view(np.uint8), want[bytes(k)]), "promoted bytes differ"
        m2.complete_load(keys, ctx2)
        assert tier2.stats()["disk_reads"] == 5
    finally:
        m2.shutdown()


def _prom(extra: dict[str, Any], tmp: Any) -> Any:
    """vLLM's own Prometheus path for the offloading connector (``KVConnectorProm`` →
    ``OffloadingConnector.build_prom_metrics`` → ``OffloadPromMetrics``, which asks the spec class —
    here ``TieringOffloadingSpec``, which asks each secondary tier — for its metric definitions)."""
    import transformers
    from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    d = tmp / "tiny-llama"
    transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(d)
    cfg = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=ModelConfig(model=str(d), dtype="float16", seed=0, skip_tokenizer_init=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        ),
    )
    return KVConnectorProm(cfg, ["model_name", "engine"], {0: ["tiny", "0"]})


def _sample(name: str, labels: dict[str, str]) -> float:
    import prometheus_client

    v = prometheus_client.REGISTRY.get_sample_value(name, labels)
    return 0.0 if v is None else float(v)


def test_tier_counters_reach_vllms_metrics(tmp_path: Any) -> None:
    """kvoff's tier counters (lookup hits and misses, reads, writes, bytes, errors, rejected values)
    leave through vLLM's metrics path: the tier's ``get_stats`` increments, merged by vLLM's
    ``TieringOffloadingManager.get_stats``, observed by vLLM's ``OffloadPromMetrics`` into
    Prometheus series labelled with the tier's type."""
    import prometheus_client
    from kvoff.vllm.tiering import TIER_VLLM_METRICS

    before = set(prometheus_client.REGISTRY._names_to_collectors)
    spec = _tiering_spec(tmp_path, f"kvoff-m-{uuid.uuid4().hex[:8]}")
    prom = _prom(dict(spec.config.extra_config), tmp_path)
    labels = {"model_name": "tiny", "engine": "0", "kvoff_tier": "KvoffFileTier"}
    manager = spec.get_manager()
    try:
        (tier,) = manager.secondary_tiers
        view = np.asarray(manager.primary_tier.get_kv_memoryview())
        keys = [key(300 + i) for i in range(4)]
        manager.on_new_request(CTX)
        out = manager.prepare_store(keys, CTX)
        assert out is not None
        for row in out.store_spec.block_ids:
            view[int(row)].view(np.uint8)[:] = 7
        manager.complete_store(keys, CTX, success=True)
        manager.on_request_finished(CTX)
        _wait(manager, tier, lambda: all(tier.store.contains(k) for k in keys), "the cascade to kvoff")
        # The tier's own lookups (vLLM asks each secondary tier on a primary miss).
        assert [tier.lookup(k, CTX) for k in keys] == [LookupResult.HIT] * 4
        assert tier.lookup(key(999), CTX) is LookupResult.MISS
        stats = manager.get_stats()
        assert stats is not None
        prom.observe(stats.data, 0)
        chunk = int(view.shape[1])
        assert _sample("vllm:kvoff_tier_writes_total", labels) == 4
        assert _sample("vllm:kvoff_tier_bytes_written_total", labels) == 4 * chunk
        assert _sample("vllm:kvoff_tier_lookup_hits_total", labels) >= 4
        assert _sample("vllm:kvoff_tier_lookup_misses_total", labels) >= 1
        assert _sample("vllm:kvoff_tier_entries", labels) == 4
        assert _sample("vllm:kvoff_tier_stored_bytes", labels) >= 4 * chunk
        assert _sample("vllm:kvoff_tier_write_errors_total", labels) == 0
        # Increments, not totals: a second report without new I/O adds nothing.
        again = manager.get_stats()
        if again is not None:
            prom.observe(again.data, 0)
        assert _sample("vllm:kvoff_tier_writes_total", labels) == 4
        # A corrupt file: read, rejected, counted, and the counter reaches vLLM.
        path = tier.store.path_of(keys[0])
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b[0] ^ 0xFF]))
        tier.submit_load(job(77, [keys[0], keys[1]], [0, 1]))
        tier.drain_jobs()
        (res,) = [r for r in tier.get_finished_jobs() if r.job_id == 77]
        assert not res.success and list(res.successful_keys or []) == [keys[1]]
        stats = manager.get_stats()
        assert stats is not None
        prom.observe(stats.data, 0)
        assert _sample("vllm:kvoff_tier_rejected_total", labels) == 1
        assert _sample("vllm:kvoff_tier_reads_total", labels) == 1
        assert _sample("vllm:kvoff_tier_bytes_read_total", labels) == chunk
        # Every declared metric is one vLLM registered.
        for name in TIER_VLLM_METRICS:
            assert name in prometheus_client.REGISTRY._names_to_collectors, name
    finally:
        manager.shutdown()
        reg = prometheus_client.REGISTRY
        for c in {reg._names_to_collectors[n] for n in set(reg._names_to_collectors) - before}:
            reg.unregister(c)


def test_tier_counters_through_vllms_scheduler(tmp_path: Any) -> None:
    """The deepest level that runs without a GPU: vLLM's real ``Scheduler`` with its scheduler-role
    ``OffloadingConnector`` over ``TieringOffloadingSpec`` and kvoff's tier. The tier holds a
    request's chunks (a previous engine's cascade); the scheduler's lookup finds them in kvoff's
    index, vLLM's tiering promotes them into its CPU tier (kvoff reads the files, byte-exact), and
    kvoff's counters leave in ``SchedulerStats.kv_connector_stats`` from ``update_from_output`` —
    vLLM's own path — into vLLM's Prometheus metrics. (The worker's CPU→GPU load needs CUDA.)"""
    import prometheus_client
    import test_vllm_scheduler as ts
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 64 << 20,
        "secondary_tiers": [
            {"type": "KvoffFileTier", "module_path": "kvoff.vllm.tiering", "disk_path": str(tmp_path / "kv")}
        ],
    }
    vc = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=ModelConfig(
            model=ts._model_dir(tmp_path), dtype="float16", seed=0, skip_tokenizer_init=True
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=256,
            max_model_len=1024,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=ts.BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            engine_id=f"kvoff-s-{uuid.uuid4().hex[:8]}",
        ),
    )
    spec = FullAttentionSpec(
        block_size=ts.BLOCK, num_kv_heads=ts.HEADS, head_size=ts.HEAD_DIM, dtype=torch.float16
    )
    n, page = 32, spec.page_size_bytes
    kcc = KVCacheConfig(
        num_blocks=n,
        kv_cache_tensors=[KVCacheTensor(size=page * n, shared_by=[name]) for name in ts.LAYERS]
        if "shared_by" in KVCacheTensor.__dataclass_fields__
        else [
            KVCacheTensor(
                size=page * n * len(ts.LAYERS),
                layers=list(ts.LAYERS),
                layer_stride=page * n,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(ts.LAYERS), spec)],
    )
    vc.cache_config.num_gpu_blocks = n
    bs, hbs = resolve_kv_cache_block_sizes(kcc, vc)
    before = set(prometheus_client.REGISTRY._names_to_collectors)
    with set_current_vllm_config(vc):
        sched = Scheduler(
            vllm_config=vc,
            kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=bs,
            hash_block_size=hbs,
            log_stats=True,
        )
        prom = KVConnectorProm(vc, ["model_name", "engine"], {0: ["tiny", "0"]})
    manager = sched.connector.connector_scheduler.manager
    try:
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, KvoffFileTier)
        view = np.asarray(manager.primary_tier.get_kv_memoryview())
        init_none_hash(sha256)
        sp = SamplingParams(max_tokens=2, ignore_eos=True)
        sp.update_from_generation_config({}, ts.EOS)
        req = Request(
            request_id="r0",
            prompt_token_ids=list(range(10, 10 + 4 * ts.BLOCK + 3)),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=get_request_block_hasher(ts.BLOCK, sha256),
        )
        keys = [make_offload_key(h, 0) for h in req.block_hashes]
        assert len(keys) == 4
        # A previous engine's cascade: the chunks' bytes in kvoff's files (stored from unallocated
        # CPU-tier rows, then cleared).
        for i in range(4):
            view[i].view(np.uint8)[:] = i + 1
        tier.submit_store(job(10**6, keys, [0, 1, 2, 3]))
        assert all(r.success for r in drain(tier))
        view[:4] = 0
        sched.add_request(req)
        got: dict[str, float] = {}
        reads = "vllm:kvoff_tier_reads:('KvoffFileTier',)"
        for _ in range(500):
            so = sched.schedule()
            running = [r for r in sched.running if r.request_id in so.num_scheduled_tokens]
            mro = ModelRunnerOutput(
                req_ids=[r.request_id for r in running],
                req_id_to_index={r.request_id: i for i, r in enumerate(running)},
                sampled_token_ids=[[] for _ in running],
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=None,
            )
            for out in sched.update_from_output(so, mro).values():
                kcs = out.scheduler_stats.kv_connector_stats if out.scheduler_stats else None
                if not kcs:
                    continue
                data = kcs if isinstance(kcs, dict) else kcs.data
                prom.observe(data, 0)
                for name, value in OffloadingConnectorStats(data=data).reduce().items():
                    if name.startswith("vllm:kvoff_tier_") and isinstance(value, (int, float)):
                        got[name] = got.get(name, 0.0) + value if "entries" not in name else value
            if got.get(reads, 0) >= 4:
                break
            time.sleep(0.002)
        assert got.get(reads) == 4, got
        assert got["vllm:kvoff_tier_bytes_read:('KvoffFileTier',)"] == 4 * view.shape[1]
        assert got["vllm:kvoff_tier_lookup_hits:('KvoffFileTier',)"] >= 4
        # The promoted rows hold the stored bytes.
        firsts = sorted(int(view[r].view(np.uint8)[0]) for r in range(view.shape[0]) if view[r].any())
        assert firsts == [1, 2, 3, 4]
        for r in range(view.shape[0]):
            row = view[r].view(np.uint8)
            if row.any():
                assert np.all(row == row[0])
        labels = {"model_name": "tiny", "engine": "0", "kvoff_tier": "KvoffFileTier"}
        assert _sample("vllm:kvoff_tier_reads_total", labels) == 4
        assert _sample("vllm:kvoff_tier_lookup_hits_total", labels) >= 4
        assert _sample("vllm:kvoff_tier_entries", labels) == 4
    finally:
        manager.shutdown()
        reg = prometheus_client.REGISTRY
        for c in {reg._names_to_collectors[n] for n in set(reg._names_to_collectors) - before}:
            reg.unregister(c)


def test_tiering_bench_measures_both_tiers_and_the_disk(tmp_path: Any, capsys: Any) -> None:
    """``python -m kvoff.vllm.tiering_bench``: vLLM's ``fs`` tier, kvoff's tier and the disk's own
    speed for the same bytes, each repetition checked byte for byte, the reference file removed."""
    from kvoff.vllm import tiering_bench

    r = tiering_bench.bench(str(tmp_path / "a"), chunks=8, chunk_bytes=64 << 10, per_job=4, reps=2)
    for k in ("fs", "kvoff", "disk"):
        assert len(r["runs"][k]) == 2
        assert all(w > 0 and rd > 0 for w, rd in r["runs"][k])
    for k in ("write_ratio", "read_ratio", "fs_write_of_disk", "kvoff_read_of_disk"):
        assert r[k] > 0
    assert r["disk_threads"] == 16
    assert sorted(os.listdir(tmp_path / "a")) == ["kvoff", "vllm-fs"]
    args = f"--chunks 4 --chunk-bytes {64 << 10} --chunks-per-job 2 --reps 1 --disk-threads 3".split()
    assert tiering_bench.main(["--dir", str(tmp_path / "b"), *args]) == 0
    out = capsys.readouterr().out
    assert "kvoff/fs: write x" in out
    assert "(3 threads, " in out and "of disk : fs write " in out

    def files(d: Any, suffix: str) -> int:
        return sum(f.endswith(suffix) for _, _, fs in os.walk(d) for f in fs)

    # At capacity kvoff keeps one repetition's files; fs keeps them all. A second run over the same
    # directory writes new keys (never hits on the first run's files).
    c = tmp_path / "c"
    for run in (1, 2):
        r = tiering_bench.bench(str(c), chunks=4, chunk_bytes=64 << 10, per_job=2, reps=3, at_capacity=True)
        assert r["at_capacity"]
        assert files(c / "kvoff", ".kvb") == 4
        assert files(c / "vllm-fs", ".bin") == 3 * 4 * run
