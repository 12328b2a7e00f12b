"""kvoff's object tier (a real SeaweedFS) as a secondary tier of vLLM 0.33's own tiering.

The same ``kvoff.vllm.tiering`` class as the file and remote tiers, over the same
``kvoff._native.BlockStore``, on the object tier (docs/tier.md "Object tier", "The block store"):
built by vLLM's ``SecondaryTierFactory`` from a tier dict with ``object_url``, and inside vLLM's
``TieringOffloadingSpec.get_manager()`` with its real CPU primary tier. Stores reach the bucket; a
fresh instance (a restarted engine) finds them by listing, or — for a chunk stored after its
listing — answers ``RETRY`` while one HEAD runs, never waiting, and loads them byte-exact; another
namespace or model sees nothing; a value another client corrupted is rejected, counted and deleted,
never served; the tier's budget comes from the dict; the tier-neutral metrics
(``vllm:kvoff_tier_*``) carry the object tier's figures.

Server: the session's SeaweedFS (tests/python/seaweed.py, fixture ``seaweed``); each test writes
under a prefix of its own. Credentials and endpoint from the environment (``AWS_*``, as a
deployment gives them), the endpoint also as ``object_endpoint`` in one test.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import pytest
import seaweed as sw

pytestmark = pytest.mark.vllm

try:
    import torch
    from kvoff.tiers import METRICS
    from kvoff.vllm.tiering import TIER_VLLM_METRICS, KvoffFileTier, KvoffObjectTier
    from vllm.v1.kv_offload.base import LookupResult
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
except ImportError as e:
    pytest.skip(f"vLLM 0.33's tiering is not importable: {e}", allow_module_level=True)

import test_tiering_vllm033 as base

CTX = base.CTX
TYPE = "KvoffObjectTier"
LABEL = f"('{TYPE}',)"
CHUNK = base.CHUNK_ELEMS * 4
#: Short bounds: the server is on loopback.
FAST = {"object_timeout_s": 2.0, "object_connect_timeout_s": 0.5, "object_negative_ttl_s": 0.2}


class S3:
    """The session's server and this test's own ``s3://`` prefix."""

    def __init__(self, srv: sw.SeaweedServer) -> None:
        self.srv = srv
        self.prefix = f"vllm-{uuid.uuid4().hex[:12]}"
        self.url = f"s3://{srv.bucket}/{self.prefix}"

    def keys(self) -> list[str]:
        with self.srv.client() as c:
            return c.list_keys(self.srv.bucket, self.prefix + "/")


@pytest.fixture
def s3(seaweed: sw.SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> S3:
    for k, v in seaweed.env().items():  # credentials, region and AWS_ENDPOINT_URL
        monkeypatch.setenv(k, v)
    return S3(seaweed)


def _tier(url: str, tensor: torch.Tensor, model: str = "test-model", **kw: Any) -> KvoffFileTier:
    cfg: dict[str, Any] = {"type": TYPE, "module_path": "kvoff.vllm.tiering", "object_url": url, **FAST}
    cfg.update(kw)
    tier = SecondaryTierFactory.create_secondary_tier(
        cfg, memoryview(tensor.numpy()), base._Spec(base._config(model))
    )
    assert isinstance(tier, KvoffObjectTier)
    assert tier.store.kind == "object"
    return tier


def _lookup(tier: KvoffFileTier, k: bytes) -> LookupResult:
    """vLLM's way with ``RETRY``: ask again (next step) until the tier knows; no call waits."""
    deadline = time.monotonic() + 20
    while True:
        t0 = time.perf_counter()
        r = tier.lookup(k, CTX)
        assert time.perf_counter() - t0 < 0.05, "a lookup waited"
        if r is not LookupResult.RETRY:
            return r
        assert time.monotonic() < deadline, "the object tier never learned the key"
        time.sleep(0.002)


def _listed(tier: KvoffFileTier) -> None:
    """Waits until the tier's first listing of its namespace finished."""
    deadline = time.monotonic() + 20
    while tier.stats()["object_listings"] < 1:
        assert time.monotonic() < deadline, "the first listing never finished"
        time.sleep(0.005)


def _store(tier: KvoffFileTier, job_id: int, keys: list[bytes], rows: list[int]) -> None:
    tier.submit_store(base.job(job_id, keys, rows))
    assert [(r.job_id, r.success) for r in base.drain(tier)] == [(job_id, True)]


def test_store_fresh_instance_retry_then_load_byte_exact(s3: S3) -> None:
    t = base._aligned(base.NUM_CHUNKS, base.CHUNK_ELEMS)
    t[:5] = torch.rand(5, base.CHUNK_ELEMS)
    want = t[:5].clone()
    keys = [base.key(i) for i in range(5)]
    a = _tier(s3.url, t)
    b = None
    try:
        _store(a, 1, keys[:4], [0, 1, 2, 3])
        assert a.stats()["object_writes"] == 4
        stored = s3.keys()
        assert len(stored) == 4 and all(k.endswith(".r0") for k in stored), stored
        # A fresh instance (a restarted engine): its first listing finds the four values.
        t2 = base._aligned(base.NUM_CHUNKS, base.CHUNK_ELEMS)
        b = _tier(s3.url, t2)
        _listed(b)
        assert [_lookup(b, k) for k in keys[:4]] == [LookupResult.HIT] * 4
        # A chunk stored after that listing: the index does not know it, so the lookup answers
        # RETRY at once (one HEAD started), and HIT once the store answered.
        _store(a, 2, keys[4:], [4])
        assert b.lookup(keys[4], CTX) is LookupResult.RETRY
        assert _lookup(b, keys[4]) is LookupResult.HIT
        assert _lookup(b, base.key(99)) is LookupResult.MISS
        b.submit_load(base.job(3, [keys[2], keys[0], keys[4]], [5, 6, 7], promotion=True))
        assert [(r.job_id, r.success) for r in base.drain(b)] == [(3, True)]
        assert torch.equal(t2[5], want[2]) and torch.equal(t2[6], want[0]) and torch.equal(t2[7], want[4])
        # The tier-neutral figures: every one the object tier has (kvoff.tiers.METRICS["object"]
        # generics), the counters' increments since the tier started equal to its own totals.
        red = b.get_stats().reduce()  # type: ignore[union-attr]
        st = b.stats()
        assert st["object_reads"] == 3 and st["object_rejected_values"] == 0
        generic = {m.generic for m in METRICS["object"] if m.generic}
        for name, (kind, _, tier_keys) in TIER_VLLM_METRICS.items():
            if tier_keys is None:
                continue
            assert name.removeprefix("vllm:kvoff_tier_") in generic, name
            got = red.get(f"{name}:{LABEL}", 0)
            assert got == pytest.approx(float(st[tier_keys["object"]])), (name, kind)
        assert red[f"vllm:kvoff_tier_reads:{LABEL}"] == 3
        assert red[f"vllm:kvoff_tier_bytes_read:{LABEL}"] == 3 * CHUNK
        assert red[f"vllm:kvoff_tier_lookup_hits:{LABEL}"] == 5
        assert red[f"vllm:kvoff_tier_lookup_misses:{LABEL}"] == 1
        assert red[f"vllm:kvoff_tier_up:{LABEL}"] == 1
        assert red[f"vllm:kvoff_tier_stored_bytes:{LABEL}"] >= 5 * CHUNK
        ra = a.get_stats().reduce()  # type: ignore[union-attr]
        assert ra[f"vllm:kvoff_tier_writes:{LABEL}"] == 5
        assert ra[f"vllm:kvoff_tier_bytes_written:{LABEL}"] == 5 * CHUNK
    finally:
        a.shutdown()
        if b is not None:
            b.shutdown()


def test_other_namespaces_and_models_see_nothing(s3: S3) -> None:
    t = base._aligned(base.NUM_CHUNKS, base.CHUNK_ELEMS)
    t[0] = 1.25
    a = _tier(s3.url, t)  # the namespace: the model's name
    try:
        _store(a, 1, [base.key(1)], [0])
    finally:
        a.shutdown()
    for kw, seen in (
        ({"model": "other-model"}, LookupResult.MISS),
        ({"namespace": "ns-b"}, LookupResult.MISS),
        # object_namespace stands for namespace on this tier (the layout is still added).
        ({"namespace": "ns-b", "object_namespace": "test-model"}, LookupResult.HIT),
    ):
        t2 = base._aligned(base.NUM_CHUNKS, base.CHUNK_ELEMS)
        b = _tier(s3.url, t2, **kw)
        try:
            assert _lookup(b, base.key(1)) is seen, kw
            if seen is LookupResult.MISS:
                b.submit_load(base.job(2, [base.key(1)], [3], promotion=True))
                (r,) = base.drain(b)
                assert not r.success and not torch.any(t2[3] == 1.25), kw
        finally:
            b.shutdown()


def test_corrupt_value_is_never_served(s3: S3) -> None:
    t = base._aligned(base.NUM_CHUNKS, base.CHUNK_ELEMS)
    t[0] = 3.25
    a = _tier(s3.url, t)
    try:
        _store(a, 1, [base.key(1)], [0])
    finally:
        a.shutdown()
    (obj,) = s3.keys()
    # Another client overwrites the value with one payload byte flipped (same length).
    c = s3.srv.client()
    try:
        data = bytearray(c.get_object(s3.srv.bucket, obj) or b"")
        assert len(data) > CHUNK
        data[-CHUNK // 2] ^= 0x01
        c.put_object(s3.srv.bucket, obj, bytes(data))
    finally:
        c.close()
    t2 = base._aligned(base.NUM_CHUNKS, base.CHUNK_ELEMS)
    b = _tier(s3.url, t2)
    try:
        assert _lookup(b, base.key(1)) is LookupResult.HIT  # the right length: listed as held
        b.submit_load(base.job(2, [base.key(1)], [4], promotion=True))
        (res,) = base.drain(b)
        assert not res.success and not res.successful_keys
        # Checked before a byte is copied: the row is untouched.
        assert not torch.any(t2[4] != 0), "bytes of a corrupt value reached the CPU tier"
        assert b.stats()["object_rejected_values"] == 1
        red = b.get_stats().reduce()  # type: ignore[union-attr]
        assert red[f"vllm:kvoff_tier_rejected:{LABEL}"] == 1
        assert red.get(f"vllm:kvoff_tier_reads:{LABEL}", 0) == 0
        # Deleted from the bucket, and a miss from then on.
        assert s3.keys() == []
        assert _lookup(b, base.key(1)) is LookupResult.MISS
    finally:
        b.shutdown()


def test_budget_from_the_tier_dict(s3: S3) -> None:
    """``object_bytes_to_use`` in the tier's dict bounds the bytes in the bucket; the values
    deleted for it are counted and reach the tier-neutral ``evicted``."""
    t = base._aligned(base.NUM_CHUNKS, base.CHUNK_ELEMS)
    t[:] = torch.rand(base.NUM_CHUNKS, base.CHUNK_ELEMS)
    budget = 3 * CHUNK + 3 * 2048  # three values and their headers
    a = _tier(s3.url, t, object_bytes_to_use=budget)
    try:
        for i in range(6):
            _store(a, i, [base.key(i)], [i])
        st = a.stats()
        assert st["object_writes"] == 6 and st["object_evictions"] >= 3
        assert st["object_known_bytes"] <= budget
        assert len(s3.keys()) <= 3
        red = a.get_stats().reduce()  # type: ignore[union-attr]
        assert red[f"vllm:kvoff_tier_evicted:{LABEL}"] == st["object_evictions"]
    finally:
        a.shutdown()


def test_tiering_spec_cascades_to_s3_and_a_fresh_engine_promotes(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's ``TieringOffloadingSpec`` with the object tier's dict in ``secondary_tiers`` (the
    endpoint given there, not in the environment): the cascade reaches the bucket, a fresh engine
    promotes from it."""
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
        monkeypatch.delenv(k)

    def spec(engine_id: str) -> Any:
        tier = {
            "type": TYPE,
            "module_path": "kvoff.vllm.tiering",
            "object_url": s3.url,
            "object_endpoint": s3.srv.endpoint,
            **FAST,
        }
        extra = {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 64 * 8192,
            "secondary_tiers": [tier],
        }
        return TieringOffloadingSpec(base._config(extra=extra, engine_id=engine_id))

    manager = spec(f"kvoff-oa-{uuid.uuid4().hex[:8]}").get_manager()
    keys = [base.key(500 + i) for i in range(5)]
    want = {}
    try:
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, KvoffObjectTier)
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
        base._wait(manager, tier, lambda: tier.stats()["object_writes"] == 5, "the cascade to S3")
        chunk = int(view.shape[1])
        red = manager.get_stats().reduce()
        assert red[f"vllm:kvoff_tier_writes:{LABEL}"] == 5
        assert red[f"vllm:kvoff_tier_bytes_written:{LABEL}"] == 5 * chunk
        assert red[f"vllm:kvoff_tier_up:{LABEL}"] == 1
        assert len(s3.keys()) == 5
    finally:
        manager.shutdown()

    m2 = spec(f"kvoff-ob-{uuid.uuid4().hex[:8]}").get_manager()
    try:
        (tier2,) = m2.secondary_tiers
        view2 = np.asarray(m2.primary_tier.get_kv_memoryview())
        ctx2 = base.ReqContext(req_id="again")
        m2.on_new_request(ctx2)

        def promoted() -> bool:
            return all(m2.lookup(k, ctx2) is LookupResult.HIT for k in keys)

        base._wait(m2, tier2, promoted, "the promotion from S3")
        spec_load = m2.prepare_load(keys, ctx2)
        for k, row in zip(keys, list(spec_load.block_ids), strict=True):
            assert np.array_equal(view2[int(row)].view(np.uint8), want[bytes(k)]), "promoted bytes differ"
        m2.complete_load(keys, ctx2)
        assert tier2.stats()["object_reads"] == 5
        red = m2.get_stats().reduce()
        assert red[f"vllm:kvoff_tier_reads:{LABEL}"] == 5
        assert red.get(f"vllm:kvoff_tier_rejected:{LABEL}", 0) == 0
    finally:
        m2.shutdown()


def test_bad_settings_raise(tmp_path: Any, s3: S3) -> None:
    from kvoff.errors import ConfigError

    t = base._aligned(base.NUM_CHUNKS, base.CHUNK_ELEMS)
    with pytest.raises(ConfigError, match="not both"):
        _tier(s3.url, t, disk_path=str(tmp_path))
    with pytest.raises(ConfigError, match="not both"):
        _tier(s3.url, t, remote_url="redis://127.0.0.1:1")
    with pytest.raises(ValueError, match="object_timeout_s"):
        _tier(s3.url, t, object_timeout_s=0)
    with pytest.raises(TypeError, match="object_max_retries"):
        _tier(s3.url, t, object_max_retries=True)
    with pytest.raises(ConfigError, match="object_url"):
        _tier("s3://B/x", t)
    a = _tier(s3.url, t)
    try:
        with pytest.raises(Exception, match="file-tier operation"):
            a.store.path_of(base.key(1))
        assert a.store.remove(base.key(1)) is False
        assert s3.url in a.store.dir
    finally:
        a.shutdown()
