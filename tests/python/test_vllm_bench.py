"""``kvoff bench managers`` with vLLM's own offloading managers as the same-run baseline (docs/performance.md:
kvoff ≥ 10× vLLM's LRU and ≥ 5× its ARC on the manager workload, same machine, same run).

Skipped (with the reason) where vLLM's managers are not importable; run in the vLLM environment
with ``pytest -m vllm`` (scripts/test.sh does)."""

from __future__ import annotations

import pytest
from kvoff.tools import bench

pytestmark = pytest.mark.vllm

if bench.vllm_manager_factory() is None:  # pragma: no cover - depends on the environment
    pytest.skip("vLLM's offloading managers (vllm.v1.kv_offload) are not importable", allow_module_level=True)


def test_vllm_rows_follow_the_same_protocol() -> None:
    rows = bench.bench_managers(
        num_requests=80, capacity=600, reps=1, ref_reps=1, show_progress=False, vllm=True
    )
    assert [(r["policy"], r["impl"]) for r in rows] == [
        ("lru", "python-ref"),
        ("lru", "vllm"),
        ("lru", "kvoff"),
        ("arc", "python-ref"),
        ("arc", "vllm"),
        ("arc", "kvoff"),
    ]
    for policy in ("lru", "arc"):
        ref, vl, kv = (r for r in rows if r["policy"] == policy)
        # vLLM's managers, the reference and kvoff make the same decisions on this workload.
        assert vl["hit_rate"] == kv["hit_rate"] == ref["hit_rate"]
        assert vl["key_ops"] == kv["key_ops"] == ref["key_ops"]
        assert vl["version"]
        assert kv["vs_vllm"] == pytest.approx(kv["key_ops_per_s"] / vl["key_ops_per_s"])
        assert kv["target_met"] == (kv["vs_vllm"] >= bench.VLLM_RATIO_TARGETS[policy])
    text = bench.format_manager_rows(rows)
    assert "in the same run" in text and text.count("vllm ") >= 2
