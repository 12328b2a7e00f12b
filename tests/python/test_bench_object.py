"""``kvoff bench object`` (python/kvoff/tools/bench_object.py) end to end on a small scale against a
private SeaweedFS it starts itself (kvoff.tools.seaweed): kvoff's object tier and, where boto3 is
installed, the boto3 reference at two thread counts store and load values that are compared byte
for byte; the JSON and the table carry every figure and ratio, and the scheduler's lookups are
timed with the server up (also paced), stopped and gone. This checks the machinery, not the figures
(BENCHMARKS.md has those)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from kvoff.tools import bench_object as bo

ARGS = ["--sizes-kib", "256", "--mib", "4", "--reps", "1", "--ref-threads", "1,2", "--lookups", "300"]


def _run(*extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvoff.tools.cli", "bench", "object", *ARGS, *extra],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.usefixtures("require_seaweed")
def test_bench_object_runs_verifies_and_reports() -> None:
    p = _run("--json")
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    have_boto3 = importlib.util.find_spec("boto3") is not None
    assert res["boto3"] is have_boto3 and res["reps"] == 1 and res["mib"] == 4
    assert "SeaweedFS" in res["server"] and "127.0.0.1" in res["server"]
    (row,) = res["rows"]
    assert row["size_kib"] == 256 and row["values"] == 16
    assert len(row["kvoff"]) == 2 and all(v > 0 for v in row["kvoff"])
    value_bytes = 16 * 256 * 1024
    # Every value each client loaded was compared with what it stored (a mismatch fails the run).
    assert row["verified_bytes"] == {"kvoff": value_bytes, "boto3": 2 * value_bytes if have_boto3 else 0}
    if have_boto3:
        assert set(row["boto3"]) == {"1", "2"} and row["boto3_1"] == row["boto3"]["1"]
        assert all(t in (1, 2) for t in row["boto3_best_threads"])
        for key, ref in (("store_vs_best", row["boto3_best"][0]), ("load_vs_best", row["boto3_best"][1])):
            assert row[key] == pytest.approx(row["kvoff"][key.startswith("load")] / ref)
        assert row["load_vs_1"] == pytest.approx(row["kvoff"][1] / row["boto3_1"][1])
        assert set(res["targets"]) == {"store_vs_best", "load_vs_best", "load_vs_1", "lookup_p99"}
        assert all(isinstance(v, bool) for v in res["targets"].values())
    else:
        assert "boto3_best" not in row and res["targets"]["load_vs_1"] is None
    assert list(res["lookups"]) == ["up", "up, paced", "stopped", "gone"]
    for state in res["lookups"].values():
        assert [k for k, _ in bo.LOOKUP_KINDS] == list(state)
        for v in state.values():
            assert 0 < v["p50_us"] <= v["p99_us"] < 1e6  # a lookup never waits for the network


def test_table_and_plot_from_the_results(tmp_path: object) -> None:
    """The table and the plot of a result without boto3 (no reference columns, targets not
    measured) and of one with it."""
    look = {k: {"p50_us": 1.0, "p99_us": 2.0} for k, _ in bo.LOOKUP_KINDS}
    res = {
        "server": "test",
        "mib": 4,
        "reps": 1,
        "batch": 64,
        "object_io_threads": 2,
        "object_max_requests": 16,
        "boto3_version": None,
        "lookup_calls": 300,
        "prefix": 16,
        "rows": [{"size_kib": 2048, "values": 2, "kvoff": [0.1, 0.5]}],
        "lookups": {"up": look, "gone": look},
    }
    res["targets"] = bo._targets(res)
    assert res["targets"] == {
        "store_vs_best": None,
        "load_vs_best": None,
        "load_vs_1": None,
        "lookup_p99": True,
    }
    table = bo.format_object(res)
    assert "| 2 MiB | 0.100 / 0.500 | (boto3 not installed) |" in table
    assert "| lookup, unknown key | 1.0 / 2.0 | 1.0 / 2.0 |" in table and "not measured" in table
    res["rows"][0].update(
        boto3={"1": [0.05, 0.1], "4": [0.1, 0.4]},
        boto3_best=[0.1, 0.4],
        boto3_best_threads=[4, 4],
        boto3_1=[0.05, 0.1],
        store_vs_best=1.0,
        load_vs_best=1.25,
        load_vs_1=5.0,
    )
    res["targets"] = bo._targets(res)
    assert res["targets"]["store_vs_best"] and res["targets"]["load_vs_1"]
    table = bo.format_object(res)
    assert (
        "| 2 MiB | 0.100 / 0.500 | 0.100 / 0.400 (4 / 4) | 0.050 / 0.100 | 1.00x | 1.25x | 5.00x |" in table
    )
    if importlib.util.find_spec("matplotlib") is not None:
        import pathlib

        png = pathlib.Path(str(tmp_path)) / "object.png"
        bo.plot_object(res, str(png))
        assert png.stat().st_size > 10_000
