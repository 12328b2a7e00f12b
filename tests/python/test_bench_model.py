"""``kvoff bench model``'s harness on the CPU (issue 45): a tiny Llama built from a config with
random weights (the torch implementation and transformers'), its decode and prefill timed alone and
beside kvoff's host engine in both call patterns, every job checked, a byte-exact round trip, the
table and the plot. The GPU run (``scripts/gpu_check.sh model``) uses the same code with CUDA."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from kvoff.tools import bench_model as bm
from kvoff.tools import model_llama as ml


def test_shapes_parse_and_refuse_nonsense():
    s = ml.shape_by_name("llama3-8b")
    assert (s.layers, s.kv_heads, s.head_dim, s.kv_page_bytes) == (32, 8, 128, 32 << 10)
    assert ml.shape_by_name("tiny:layers=3,batch=4").layers == 3
    with pytest.raises(ValueError, match="unknown model shape"):
        ml.shape_by_name("gpt5")
    with pytest.raises(ValueError, match="field"):
        ml.shape_by_name("tiny:wings=2")


@pytest.mark.parametrize("impl", ["torch", "transformers"])
def test_workloads_run_on_the_cpu(impl):
    if impl == "transformers" and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed here")
    model, used = ml.build(torch, ml.TINY, impl, "cpu")
    assert used == impl
    for kind in ("decode", "prefill"):
        wl = ml.Workload(torch, model, kind, used, ml.TINY, "cpu")
        out = wl._once()
        assert torch.isfinite(out.float()).all()
        wl.step()
        wl.step()


def test_patterns_select_the_grid():
    both = bm.default_cells(["decode", "prefill"], [8], ["auto", "dma"], ("both",))
    only_vllm = bm.default_cells(["decode", "prefill"], [8], ["auto", "dma"], ("both",), ("vllm",))
    only_thread = bm.default_cells(["decode", "prefill"], [8], ["auto", "dma"], ("both",), ("thread",))
    assert {c.pattern for c in only_vllm} == {"vllm"} and len(only_vllm) == 6  # 8/128/512 MiB x 2
    assert {c.pattern for c in only_thread} == {"thread"} and len(only_thread) == 8
    assert len(both) == len(only_vllm) + len(only_thread)
    with pytest.raises(ValueError, match="unknown patterns"):
        bm.default_cells(["decode"], [8], ["auto"], ("both",), ("vllm", "sglang"))


def test_engines_name_their_tuning():
    assert bm._engine_args("auto") == ("auto", "")
    assert bm._engine_args("dma") == ("dma", "pitched=0")
    assert bm._engine_args("slow:auto:slowshare=40+duty=25") == ("auto", "slowshare=40,duty=25")


def test_the_harness_measures_beside_the_host_engine(tmp_path):
    cells = [
        bm.Cell("decode", "auto", 1, "both", "thread", True),
        bm.Cell("prefill", "dma", 1, "load", "thread", False),
        bm.Cell("decode", "auto", 1, "both", "vllm", True),
        bm.Cell("decode", "auto", 1, "store", "thread", True, "pool"),
    ]
    res = bm.bench_model(ml.TINY, cells, impl="torch", rounds=1, device="cpu", round_s=0.05)
    assert res["roundtrip_ok"]
    assert res["impl"] == {"decode": "torch", "prefill": "torch"}
    assert len(res["rows"]) == len(cells)
    for r in res["rows"]:
        assert r.failed == 0
        assert r.gb_s > 0, r
        assert math.isfinite(r.slowdown) and r.alone_ms > 0
        assert all(k.split()[1] == "host" for k in r.methods), r.methods
    vllm = res["rows"][2]
    assert vllm.submit_us > 0 and vllm.submit_p99_us >= vllm.submit_us
    assert {k.split()[0] for k in vllm.methods} == {"st", "ld"}
    assert {k.split()[0] for k in res["rows"][3].methods} == {"st"}
    text = bm.format_model(res)
    assert "slowdown" in text and "round trip byte-exact: True" in text
    if importlib.util.find_spec("matplotlib") is not None:
        bm.plot_model(res, str(tmp_path / "model.png"))
        assert (tmp_path / "model.png").stat().st_size > 1000


def test_the_command_needs_a_gpu_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the command would run")
    r = subprocess.run(
        [sys.executable, "-m", "kvoff.tools.cli", "bench", "model", "--workloads", "decode"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode != 0
    assert "CUDA GPU" in r.stderr, r.stderr
    h = subprocess.run(
        [sys.executable, "-m", "kvoff.tools.cli", "bench", "model", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert h.returncode == 0 and "--workloads" in h.stdout
