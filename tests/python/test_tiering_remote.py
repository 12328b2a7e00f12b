"""kvoff's remote tier (a real ``redis-server``) as a secondary tier of vLLM 0.33's own tiering.

The same ``kvoff.vllm.tiering`` class as the file tier, over the same ``kvoff._native.BlockStore``,
now on the ``SecondaryTier`` trait's remote implementation (docs/tier.md "The block store"):
built by vLLM's ``SecondaryTierFactory`` with ``remote_url``, and inside vLLM's
``TieringOffloadingSpec.get_manager()`` with its real CPU primary tier. Stores reach the server, a
fresh instance (a restarted engine) finds them — its first lookup answers ``RETRY`` while one
batched fetch runs, never waiting — and loads them byte-exact; a corrupted value is never served;
the tier's counters leave through vLLM's metrics path.

Servers: ``tests/python/redis_servers.py`` (Debian's ``redis-server`` on loopback, random port).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import pytest

# The vLLM tiering adapter reaches the server only through the remote tier (test_tier_remote.py).
pytestmark = [pytest.mark.vllm, pytest.mark.server_neutral]

try:
    import torch
    from kvoff.tier import REMOTE_HEADER_BYTES
    from kvoff.vllm.tiering import KvoffFileTier, KvoffRemoteTier
    from vllm.v1.kv_offload.base import LookupResult
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
except ImportError as e:
    pytest.skip(f"vLLM 0.33's tiering is not importable: {e}", allow_module_level=True)

import test_tiering_vllm033 as base

CTX = base.CTX


def _tier(url: str, tensor: torch.Tensor, **kw: Any) -> KvoffFileTier:
    cfg = {"type": "KvoffRemoteTier", "module_path": "kvoff.vllm.tiering", "remote_url": url}
    cfg.update(kw)
    tier = SecondaryTierFactory.create_secondary_tier(
        cfg, memoryview(tensor.numpy()), base._Spec(base._config("test-model"))
    )
    assert isinstance(tier, KvoffRemoteTier)
    assert tier.store.kind == "remote"
    return tier


def _lookup(tier: KvoffFileTier, k: bytes) -> LookupResult:
    """vLLM's way with ``RETRY``: ask again (next step) until the tier knows."""
    deadline = time.monotonic() + 20
    while True:
        r = tier.lookup(k, CTX)
        if r is not LookupResult.RETRY:
            return r
        assert time.monotonic() < deadline, "the remote tier never learned the key"
        time.sleep(0.002)


def test_store_fresh_instance_retry_then_load_byte_exact(redis_factory: Any) -> None:
    srv = redis_factory()
    t = base._aligned(base.NUM_CHUNKS, base.CHUNK_ELEMS)
    t[:4] = torch.rand(4, base.CHUNK_ELEMS)
    want = t[:4].clone()
    keys = [base.key(i) for i in range(4)]
    a = _tier(srv.url, t)
    try:
        a.submit_store(base.job(1, keys, [0, 1, 2, 3]))
        assert [(r.job_id, r.success) for r in base.drain(a)] == [(1, True)]
        assert a.stats()["remote_writes"] == 4
    finally:
        a.shutdown()
    t2 = base._aligned(base.NUM_CHUNKS, base.CHUNK_ELEMS)
    b = _tier(srv.url, t2)
    try:
        # The fresh instance's index knows nothing: RETRY (a fetch started), never a wait. The
        # server is paused meanwhile: an I/O thread may otherwise have the answer before the
        # call reads its key's entry (a loopback fetch takes tens of µs; a call preempted that
        # long on a busy 2-CPU machine then answers HIT, which is right but not this case).
        srv.pause()
        try:
            t0 = time.monotonic()
            assert b.lookup(keys[0], CTX) is LookupResult.RETRY
            assert time.monotonic() - t0 < 1.0, "a lookup waited on the stopped server"
        finally:
            srv.resume()
        assert [_lookup(b, k) for k in keys] == [LookupResult.HIT] * 4
        assert _lookup(b, base.key(99)) is LookupResult.MISS
        b.submit_load(base.job(2, [keys[2], keys[0]], [5, 6], promotion=True))
        res = base.drain(b)
        assert [(r.job_id, r.success) for r in res] == [(2, True)]
        assert torch.equal(t2[5], want[2]) and torch.equal(t2[6], want[0])
        st = b.stats()
        assert st["remote_reads"] == 2 and st["remote_rejected_values"] == 0
        # The counters through the tier's vLLM stats (the file tier's gauges are absent here).
        stats = b.get_stats()
        assert stats is not None
        red = stats.reduce()
        assert red["vllm:kvoff_tier_reads:('KvoffRemoteTier',)"] == 2
        assert red["vllm:kvoff_tier_lookup_hits:('KvoffRemoteTier',)"] == 4
        assert red["vllm:kvoff_tier_lookup_misses:('KvoffRemoteTier',)"] == 1
        assert red["vllm:kvoff_tier_up:('KvoffRemoteTier',)"] == 1
        assert not any("stored_bytes" in n for n in red)
    finally:
        b.shutdown()


def test_corrupt_value_is_never_served(redis_factory: Any) -> None:
    srv = redis_factory()
    t = base._aligned(base.NUM_CHUNKS, base.CHUNK_ELEMS)
    t[0] = 3.25
    a = _tier(srv.url, t)
    try:
        a.submit_store(base.job(1, [base.key(1)], [0]))
        assert all(r.success for r in base.drain(a))
    finally:
        a.shutdown()
    (rkey,) = [k for k in srv.cli("--raw", "KEYS", "*").split() if k]
    # Overwrite a payload byte (after the header) on the server.
    srv.cli("SETRANGE", rkey, str(REMOTE_HEADER_BYTES + 64), "\x7f")
    t2 = base._aligned(base.NUM_CHUNKS, base.CHUNK_ELEMS)
    b = _tier(srv.url, t2)
    try:
        r = _lookup(b, base.key(1))
        if r is LookupResult.HIT:
            b.submit_load(base.job(2, [base.key(1)], [4], promotion=True))
            (res,) = base.drain(b)
            assert not res.success
        assert not torch.any(t2[4] == 3.25), "a corrupt value reached the CPU tier"
        assert b.stats()["remote_rejected_values"] >= 1
    finally:
        b.shutdown()


def test_tiering_spec_cascades_to_redis_and_a_fresh_engine_promotes(redis_factory: Any) -> None:
    srv = redis_factory()

    def spec(engine_id: str) -> Any:
        extra = {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 64 * 8192,
            "secondary_tiers": [
                {"type": "KvoffRemoteTier", "module_path": "kvoff.vllm.tiering", "remote_url": srv.url}
            ],
        }
        return TieringOffloadingSpec(base._config(extra=extra, engine_id=engine_id))

    manager = spec(f"kvoff-ra-{uuid.uuid4().hex[:8]}").get_manager()
    keys = [base.key(500 + i) for i in range(5)]
    want = {}
    try:
        (tier,) = manager.secondary_tiers
        view = np.asarray(manager.primary_tier.get_kv_memoryview())
        manager.on_new_request(CTX)
        out = manager.prepare_store(keys, CTX)
        assert out is not None
        rng = np.random.default_rng(5)
        for k, row in zip(out.keys_to_store, list(out.store_spec.block_ids), strict=True):
            data = rng.integers(0, 255, size=view.shape[1], dtype=np.uint8)
            view[int(row)].view(np.uint8)[:] = data
            want[bytes(k)] = data.copy()
        manager.complete_store(keys, CTX, success=True)
        manager.on_request_finished(CTX)
        base._wait(manager, tier, lambda: tier.stats()["remote_writes"] == 5, "the cascade to Redis")
    finally:
        manager.shutdown()

    m2 = spec(f"kvoff-rb-{uuid.uuid4().hex[:8]}").get_manager()
    try:
        (tier2,) = m2.secondary_tiers
        view2 = np.asarray(m2.primary_tier.get_kv_memoryview())
        ctx2 = base.ReqContext(req_id="again")
        m2.on_new_request(ctx2)

        def promoted() -> bool:
            return all(m2.lookup(k, ctx2) is LookupResult.HIT for k in keys)

        base._wait(m2, tier2, promoted, "the promotion from Redis")
        spec_load = m2.prepare_load(keys, ctx2)
        for k, row in zip(keys, list(spec_load.block_ids), strict=True):
            assert np.array_equal(view2[int(row)].view(np.uint8), want[bytes(k)]), "promoted bytes differ"
        m2.complete_load(keys, ctx2)
        assert tier2.stats()["remote_reads"] == 5
    finally:
        m2.shutdown()


def test_bad_settings_raise(tmp_path: Any, redis_server: Any) -> None:
    from kvoff.errors import ConfigError

    t = base._aligned(base.NUM_CHUNKS, base.CHUNK_ELEMS)
    with pytest.raises(ConfigError, match="not both"):
        _tier(redis_server.url, t, disk_path=str(tmp_path))
    with pytest.raises(ConfigError, match="remote_timeout_s"):
        _tier(redis_server.url, t, remote_timeout_s=0)
    a = _tier(redis_server.url, t)
    try:
        with pytest.raises(Exception, match="file-tier operation"):
            a.store.path_of(base.key(1))
        assert a.store.remove(base.key(1)) is False
    finally:
        a.shutdown()


def test_files_and_redis_as_two_secondary_tiers(tmp_path: Any, redis_factory: Any) -> None:
    """kvoff's file tier and remote tier as two entries of one ``secondary_tiers`` list: vLLM's
    cascade reaches both, and each one's counters carry its own ``kvoff_tier`` label."""
    srv = redis_factory()
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 64 * 8192,
        "secondary_tiers": [
            {"type": "KvoffFileTier", "module_path": "kvoff.vllm.tiering", "disk_path": str(tmp_path)},
            {"type": "KvoffRemoteTier", "module_path": "kvoff.vllm.tiering", "remote_url": srv.url},
        ],
    }
    manager = TieringOffloadingSpec(
        base._config(extra=extra, engine_id=f"kvoff-2-{uuid.uuid4().hex[:8]}")
    ).get_manager()
    try:
        files, remote = manager.secondary_tiers
        assert files.store.kind == "disk" and remote.store.kind == "remote"
        view = np.asarray(manager.primary_tier.get_kv_memoryview())
        keys = [base.key(700 + i) for i in range(3)]
        manager.on_new_request(CTX)
        out = manager.prepare_store(keys, CTX)
        assert out is not None
        for row in out.store_spec.block_ids:
            view[int(row)].view(np.uint8)[:] = 9
        manager.complete_store(keys, CTX, success=True)
        manager.on_request_finished(CTX)

        def both() -> bool:
            remote.drain_jobs()
            return files.stats()["disk_files_written"] == 3 and remote.stats()["remote_writes"] == 3

        base._wait(manager, files, both, "the cascade to both kvoff tiers")
        stats = manager.get_stats()
        assert stats is not None
        red = stats.reduce()
        assert red["vllm:kvoff_tier_writes:('KvoffFileTier',)"] == 3
        assert red["vllm:kvoff_tier_writes:('KvoffRemoteTier',)"] == 3
        assert red["vllm:kvoff_tier_entries:('KvoffFileTier',)"] == 3
    finally:
        manager.shutdown()
