"""``kvoff bench object`` (python/kvoff/tools/bench_object.py) runs end to end on a small scale
against a real SeaweedFS it starts itself: kvoff's object tier and, where boto3 is installed, the
boto3 reference store and load byte-verified values; the table and the JSON carry every figure,
and the lookups are timed with the server up, stopped and gone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import seaweed as sw


@pytest.mark.usefixtures("require_seaweed")
def test_bench_object_quick_runs_and_reports(tmp_path: object) -> None:
    if sw.weed_binary() is None:  # pragma: no cover - require_seaweed skipped or failed already
        pytest.skip("no weed")
    args = ["--quick", "--sizes-kib", "256", "--ref-threads", "1,4", "--json"]
    p = subprocess.run(
        [sys.executable, "-m", "kvoff.tools.cli", "bench", "object", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    (row,) = res["rows"]
    assert row["size_kib"] == 256 and row["values"] >= 8
    assert all(v > 0 for v in row["kvoff"])
    if res["boto3"]:
        assert row["boto3_best_threads"][0] in (1, 4) and row["store_vs_best"] > 0 and row["load_vs_1"] > 0
    assert set(res["lookups"]) == {"up", "stopped", "gone"}
    for p50, p99 in res["lookups"].values():
        assert 0 < p50 <= p99 < 5000  # µs: a lookup never waits on the network
