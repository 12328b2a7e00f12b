"""``kvoff bench``: the manager benchmark's rows, its cross-checks against the Python reference,
the target lines, the command line, and the host transfer benchmark on a small job.

vLLM's own managers as a same-run baseline are tested in ``test_vllm_bench.py`` (vLLM env)."""

from __future__ import annotations

import json

import kvoff
import pytest
from kvoff.tools import bench, cli


def _small(**kw: object) -> list[dict[str, object]]:
    return bench.bench_managers(num_requests=80, capacity=600, reps=1, ref_reps=1, show_progress=False, **kw)  # type: ignore[arg-type]


def test_manager_rows_agree_with_the_reference() -> None:
    rows = _small(vllm=False)
    assert [(r["policy"], r["impl"]) for r in rows] == [
        ("lru", "python-ref"),
        ("lru", "kvoff"),
        ("arc", "python-ref"),
        ("arc", "kvoff"),
    ]
    for policy in ("lru", "arc"):
        ref, kv = (r for r in rows if r["policy"] == policy)
        # Same protocol on the same workload: the same hits and the same keys passed.
        assert kv["hit_rate"] == ref["hit_rate"]
        assert kv["key_ops"] == ref["key_ops"]
        assert 0.0 < kv["hit_rate"] < 1.0
        assert kv["key_ops_per_s"] > 0 and ref["ratio"] == 1.0
        assert kv["ratio"] == pytest.approx(kv["key_ops_per_s"] / ref["key_ops_per_s"])
        # Without vLLM the target has no baseline: not measured (None), never "met".
        assert kv["vs_vllm"] is None and kv["target_met"] is None


def test_format_manager_rows_states_each_target() -> None:
    text = bench.format_manager_rows(_small(vllm=False))
    assert "target lru: >= 10x vLLM's LRU manager in the same run: not measured" in text
    assert "target arc: >= 5x vLLM's ARC manager in the same run: not measured" in text
    assert " met" not in text
    assert text.count("python-ref") == 2 and text.count("kvoff ") >= 2


def test_vllm_required_but_missing_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "vllm_manager_factory", lambda: None)
    with pytest.raises(RuntimeError, match="vLLM"):
        _small(vllm=True)
    assert cli.main(["bench", "managers", "--requests", "10", "--reps", "1", "--quiet", "--vllm", "on"]) == 2


def test_cli_bench_managers_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(
        [
            "bench",
            "managers",
            "--requests",
            "40",
            "--capacity",
            "300",
            "--reps",
            "1",
            "--quiet",
            "--json",
            "--vllm",
            "off",
        ]
    )
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["impl"] for r in rows} == {"python-ref", "kvoff"}
    assert all(r["key_ops"] > 0 for r in rows)


def test_bench_transfers_small_job() -> None:
    """The transfer benchmark end to end on a small job: ``auto`` picks the host engine without a
    GPU and a CUDA method with one; every row is verified byte for byte inside the benchmark."""
    torch = pytest.importorskip("torch")
    cuda = torch.cuda.is_available() and kvoff.cuda_available()
    rows = bench.bench_transfers(job_mib=2, reps=1, methods=["auto"], show_progress=False)
    assert len(rows) == 2 * len(bench.TRANSFER_SCENARIOS)
    for r in rows:
        assert r["engine"].startswith("cuda:") if cuda else r["engine"] == "host"
        assert r["gb_s"] > 0 and r["contiguous_gb_s"] > 0
        assert r["blocks"] >= bench.MIN_BLOCKS
        assert r["job_bytes"] == r["blocks"] * r["page_bytes"] * r["tensors"]
    text = bench.format_transfer_rows(rows).splitlines()
    assert "contig GB/s" in text[1] and all(r["verified_bytes"] == r["job_bytes"] for r in rows)
    assert text[-1].startswith(
        f"verified: the last job of each of the {len(rows)} rows compared byte for byte"
    )
    if not cuda:  # no GPU: the directions are store/load, the reference on the engine's threads
        assert {r["direction"] for r in rows} == set(bench.HOST_DIRS)
        assert all(r["contiguous_threads"] >= 1 for r in rows)
        assert bench.HOST_DIRS_NOTE in text and "GPU->CPU" not in "\n".join(text)


def test_interference_method_specs_parse():
    from kvoff.tools.bench_interference import parse_method

    assert parse_method("auto") == ("auto", "auto", 0.02, "")
    assert parse_method("dma") == ("dma", "dma", None, "pitched=0"), "plain batched DMA"
    assert parse_method("dma2d") == ("dma2d", "dma", None, "")
    assert parse_method("auto-serve") == ("auto-serve", "auto", 0.02, "idleafter=0")
    assert parse_method("auto-idle") == ("auto-idle", "auto", None, "")
    assert parse_method("a:auto:none") == ("a", "auto", None, "")
    assert parse_method("k:auto:0.01:ctas=2,launch=65536") == ("k", "auto", 0.01, "ctas=2,launch=65536")


def _interference_row(**extra: object) -> dict[str, object]:
    """A row of ``kvoff bench interference`` (4 KiB x 8 MiB, both directions, auto) plus ``extra``."""
    return {
        "page_kib": 4,
        "job_mib": 8,
        "copies": 2048,
        "dirs": "both",
        "method": "auto",
        "idle_gb_s": 40.0,
        "launch_p99_us": 120.0,
        "launch_max_us": 300.0,
        "failed": 0,
        **extra,
    }


def test_interference_slowdown_from_alternating_rounds():
    """The slowdown is median(beside) / median(alone) - 1 over the rounds, so one outlier round on
    either side does not move it, and a drift shared by both sides cancels."""
    from kvoff.tools.bench_interference import format_row, slowdown_row

    r = slowdown_row("gemm", [1.50, 1.52, 9.0], [1.53, 1.56, 1.55], [10.0, 30.0, 20.0])
    assert r["gemm_slowdown"] == pytest.approx(1.55 / 1.52 - 1)
    assert r["gemm_gb_s"] == 20.0 and r["gemm_alone_ms"] == 1.52
    row = _interference_row(sms=16, longest_call_us=87.0, **r, **slowdown_row("mem", [0.7], [0.72], [15.0]))
    line = format_row(row)
    assert "+2.0%" in line and "+2.9%" in line and " 16 " in line and " 87 " in line and line.endswith("ok")


def test_interference_method_mix_names_methods_and_reasons_per_direction():
    """The bench logs which method each direction's jobs took beside compute, and why (the CUDA
    engine's ``last_submit_stats["reason"]``), as shares, largest first."""
    from kvoff.tools.bench_interference import method_mix

    mix = method_mix(
        {
            "st dma [serving: pitched runs, feedback]": 1,
            "st staged [serving: pitched runs, feedback]": 3,
            "ld staged [serving: small copies]": 5,
        }
    )
    assert mix == (
        "st staged [serving: pitched runs, feedback] 75% dma [serving: pitched runs, feedback] 25%; "
        "ld staged [serving: small copies] 100%"
    )
    assert method_mix({}) == "-"


def test_interference_bracketed_rounds_cancel_drift():
    """With alone rounds around each beside round (A B A B A B A), a proxy that drifts steadily
    over the cell reads no slowdown when the transfers cost it nothing — where comparing medians of
    A B A B A B reads the drift as a slowdown — and a real slowdown reads through the drift."""
    from kvoff.tools.bench_interference import format_row, slowdown_row

    alone = [1.0, 1.2, 1.4, 1.6]  # +10% per phase, steady
    r = slowdown_row("gemm", alone, [1.1, 1.3, 1.5], [20.0, 21.0, 22.0])
    assert r["gemm_slowdown"] == pytest.approx(0.0)
    assert r["gemm_drift"] == pytest.approx(0.6)
    assert slowdown_row("gemm", alone[:3], [1.1, 1.3, 1.5], [1.0])["gemm_slowdown"] == pytest.approx(
        1.3 / 1.2 - 1
    )
    r3 = slowdown_row("gemm", alone, [1.1 * 1.03, 1.3 * 1.03, 1.5 * 1.03], [1.0, 1.0, 1.0])
    assert r3["gemm_slowdown"] == pytest.approx(0.03)
    # One outlier round (a clock step) does not move the median.
    r4 = slowdown_row("mem", [0.70, 0.70, 0.70, 0.70], [0.72, 0.90, 0.72], [1.0] * 3)
    assert r4["mem_slowdown"] == pytest.approx(0.72 / 0.70 - 1)
    row = _interference_row(**r3, **r4)
    assert "+60.0/+0.0" in format_row(row)
    with pytest.raises(ValueError, match="rounds"):
        from kvoff.tools.bench_interference import bench_interference

        bench_interference(rounds=0)


def test_interference_plot_draws_both_directions(tmp_path):
    """`kvoff bench interference --plot`'s drawing, from synthetic sweep rows: kvoff, the batched-DMA
    baseline and the contiguous limit, idle, beside the GEMM and beside the memory-bound kernel, one
    panel per direction."""
    pytest.importorskip("matplotlib")
    from kvoff.tools.bench_interference import format_sweep_rows, plot_sweep_rows

    methods = ("kvoff auto", "batched DMA", "contiguous copy")
    rows = [
        {
            "page_kib": p,
            "dir": d,
            "method": m,
            "idle_gb_s": 10.0 + i,
            "gemm_gb_s": 5.0 + i,
            "mem_gb_s": 3.0 + i,
        }
        for i, (p, d, m) in enumerate(
            (p, d, m) for p in (4, 32, 2048) for d in ("store", "load") for m in methods
        )
    ]
    out = tmp_path / "sweep.png"
    labels = plot_sweep_rows(rows, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert labels == [
        f"{m}, {what}" for m in methods for what in ("idle", "beside a GEMM", "beside a memory-bound kernel")
    ]
    text = format_sweep_rows(rows).splitlines()
    assert len(text) == 1 + len(rows) and "2 MiB" in text[-1]
    assert "beside GEMM" in text[0] and "beside mem" in text[0]
    assert text[-1].split()[-3:] == ["27.0", "22.0", "20.0"]


def test_interference_plot_line_styles(tmp_path, monkeypatch):
    """Each method keeps one colour; idle is solid, beside the GEMM dashed, beside the memory-bound
    kernel dotted; a proxy missing from the rows draws no line."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from kvoff.tools import bench_interference as bi

    rows = [
        {"page_kib": p, "dir": "store", "method": m, "idle_gb_s": 1.0, "gemm_gb_s": 2.0, "mem_gb_s": 3.0}
        for p in (4, 32)
        for m in ("kvoff auto", "batched DMA")
    ]
    seen: list[tuple[str, str, str]] = []
    real_savefig = plt.Figure.savefig

    def grab(fig, *a, **k):
        for ax in fig.axes:
            seen.extend((ln.get_label(), ln.get_linestyle(), ln.get_color()) for ln in ax.get_lines())
        return real_savefig(fig, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", grab)
    bi.plot_sweep_rows(rows, str(tmp_path / "s.png"))
    monkeypatch.undo()
    assert [(lbl.split(", ")[1], ls) for lbl, ls, _ in seen] == [
        ("idle", "-"),
        ("beside a GEMM", "--"),
        ("beside a memory-bound kernel", ":"),
    ] * 2
    assert len({c for _, _, c in seen[:3]}) == 1 and seen[0][2] != seen[3][2]
    # Idle only (the host sweep's rows): one line per method.
    labels = bi.plot_sweep_rows(
        [{k: v for k, v in r.items() if k not in ("gemm_gb_s", "mem_gb_s")} for r in rows],
        str(tmp_path / "idle.png"),
        note="idle only",
    )
    assert labels == ["kvoff auto, idle", "batched DMA, idle"]


def test_host_plot_sweep_end_to_end(tmp_path):
    """`kvoff bench --plot` without a GPU: the host engine's page-size sweep (numpy buffers and a
    HostRegion, no torch) beside one memcpy of the same bytes and one numpy copy per page, drawn
    idle only; kvoff's bytes are verified inside the sweep."""
    pytest.importorskip("matplotlib")
    rows = bench.sweep_host_for_plot(pages_kib=[4, 2048], job_mib=4, reps=1)
    methods = (bench.HOST_KVOFF, bench.HOST_PER_COPY, bench.HOST_CONTIGUOUS)
    assert {(r["page_kib"], r["dir"], r["method"]) for r in rows} == {
        (p, d, m) for p in (4, 2048) for d in ("store", "load") for m in methods
    }
    assert all(r["idle_gb_s"] > 0 and "gemm_gb_s" not in r for r in rows)
    assert all(r["job_bytes"] == r["blocks"] * r["tensors"] * (r["page_kib"] << 10) for r in rows)
    out = tmp_path / "host.png"
    labels = bench.plot_host_sweep_rows(rows, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert labels == [f"{m}, idle" for m in methods]
    assert any("kvoff" in lbl for lbl in labels) and any("contiguous" in lbl for lbl in labels)
    assert any("per-copy baseline" in lbl for lbl in labels)
    assert "beside-compute curves need a GPU" in bench.HOST_PLOT_NOTE


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "interference", "--plot", "x.png", "--quiet"],
        ["bench", "--plot", "x.png"],
        ["bench", "transfers", "--plot", "x.png", "--quiet"],
    ],
)
def test_plot_without_matplotlib_exits_2(monkeypatch, capsys, argv):
    """Without matplotlib every `--plot` exits 2 with a clear message before any benchmark runs."""
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib here")
        return real(name, *a, **k)

    def ran(*_: object, **__: object) -> None:
        raise AssertionError("a benchmark ran")

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    monkeypatch.setattr(bench, "bench_managers", ran)
    monkeypatch.setattr(bench, "bench_transfers", ran)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib: pip install matplotlib" in err and err.startswith("kvoff bench")


def test_interference_cli_parses_and_needs_a_gpu(capsys):
    from kvoff import _native

    if _native.cuda_available():
        pytest.skip("a GPU is here: the benchmark would run")
    rc = cli.main(
        ["bench", "interference", "--pages-kib", "4", "--jobs-mib", "1", "--dirs", "store", "--quiet"]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "needs a CUDA GPU" in err and "Traceback" not in err


def test_bench_transfers_without_torch() -> None:
    # The README's main command on a fresh CPU machine: with torch not importable, `kvoff bench
    # transfers` runs the host engine over numpy arrays and a HostRegion, verifies the bytes and
    # reports every scenario in both directions.
    import json
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from kvoff.tools.cli import main\n"
        "sys.exit(main(['bench', 'transfers', '--job-mib', '8', '--reps', '1', '--quiet', '--json']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    assert {r["engine"] for r in rows} == {"host"}
    # No GPU here: the directions say what moves (store: KV arrays -> host region, load: back).
    assert {r["direction"] for r in rows} == {"store", "load"}
    assert len(rows) == 8 and all(r["gb_s"] > 0 and r["contiguous_gb_s"] > 0 for r in rows)
    assert all(r["verified_bytes"] == r["job_bytes"] for r in rows)


def test_interference_compute_keeps_a_bounded_queue():
    """The compute proxy's thread waits on an event whenever more than ``_DEPTH`` chunks would be
    queued (a serving engine's depth), instead of queueing a whole round at once: with a second of
    GEMMs queued the driver's launch queue fills and other threads' calls on the stream wait."""
    from kvoff.tools import bench_interference as bi

    log: list[tuple[str, int]] = []

    class Event:
        made = 0

        def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
            Event.made += 1
            self.id, self.timing, self.blocking = Event.made, enable_timing, blocking
            self.recorded = False

        def record(self) -> None:
            self.recorded = True
            log.append(("record", self.id))

        def synchronize(self) -> None:
            log.append(("sync", self.id))

        def elapsed_time(self, _other: object) -> float:
            return 30.0

    class Cuda:
        pass

    class FakeTorch:
        cuda = Cuda()

        def mm(self, *_: object) -> None:
            log.append(("op", 0))

        def add(self, *_: object, **__: object) -> None:
            log.append(("op", 0))

    ft = FakeTorch()
    ft.cuda.Event = Event  # type: ignore[attr-defined]
    comp = object.__new__(bi._Compute)
    comp.torch, comp.a, comp.b, comp.x, comp.y = ft, None, None, None, None
    comp.n, comp.secs, comp.chunk, comp.marks = {}, {"gemm": 1.0, "mem": 0.2}, {"gemm": 3}, []
    assert comp.run("gemm", 30) == pytest.approx(1.0)
    marks = {m.id for m in comp.marks}
    assert len(marks) == bi._DEPTH and all(m.blocking and not m.timing for m in comp.marks)
    # Each wait is on the mark recorded _DEPTH chunks earlier, so after it at most _DEPTH chunks
    # (of 3 ops) can still be queued; before the next wait at most one more chunk is issued.
    ops, done, at = 0, 0, {}
    for what, i in log:
        if what == "op":
            ops += 1
            assert ops - done <= (bi._DEPTH + 1) * 3, (ops, done)
        elif what == "record" and i in marks:
            at[i] = ops
        elif what == "sync" and i in at:
            done = max(done, at[i])
            assert ops - done <= bi._DEPTH * 3
    assert sum(1 for w, i in log if w == "record" and i in marks) == 10
    assert done >= 30 - (bi._DEPTH + 1) * 3


# Runs `kvoff` with torch hidden (as on a fresh CPU machine), the managers' and transfers' workloads
# shrunk so the test takes seconds.
_NO_TORCH = """\
import sys; sys.modules['torch'] = None
from kvoff.tools import bench
from kvoff.tools.cli import main
managers, transfers, sweep = bench.bench_managers, bench.bench_transfers, bench.sweep_host_for_plot
bench.bench_managers = lambda *a, **k: managers(80, 600, 1, 1, show_progress=False, vllm=False)
bench.bench_transfers = lambda job_mib, reps, methods, show_progress: transfers(4, 1, methods, False)
bench.sweep_host_for_plot = lambda job_mib, reps, log: sweep(job_mib=4, reps=1, log=log)
sys.exit(main(sys.argv[1:]))
"""


def _kvoff_without_torch(*argv: str) -> str:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_bare_bench_with_plot_without_torch(tmp_path):
    """The README's main command on a fresh CPU machine, `kvoff bench --plot FILE`: managers, host
    transfers over numpy buffers, then the host engine's page-size sweep drawn into FILE."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    text = _kvoff_without_torch("bench", "--plot", str(png))
    assert "manager workload" in text and "scattered block transfers" in text
    assert "host " in text and "target lru" in text
    assert bench.HOST_KVOFF in text and bench.HOST_PER_COPY in text and bench.HOST_CONTIGUOUS in text
    assert "idle only: beside-compute curves need a GPU" in text and "beside GEMM" not in text
    assert f"plot written to {png}" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_transfers_plot_json_without_torch(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    out = json.loads(_kvoff_without_torch("bench", "transfers", "--quiet", "--json", "--plot", str(png)))
    assert {r["engine"] for r in out["transfers"]} == {"host"}
    assert {r["method"] for r in out["sweep"]} == {
        bench.HOST_KVOFF,
        bench.HOST_PER_COPY,
        bench.HOST_CONTIGUOUS,
    }
    assert {r["page_kib"] for r in out["sweep"]} == set(bench.HOST_PLOT_PAGES_KIB)
    assert png.stat().st_size > 10_000


def test_plot_given_before_the_subcommand_is_kept(monkeypatch):
    """``kvoff bench --plot F transfers`` (or ``interference``): the subcommand's own ``--plot``
    must not reset the one given before it; without any, ``plot`` is None."""
    from kvoff.tools import cli

    seen: list[object] = []

    def record(args):
        seen.append(args.plot)
        return 0

    monkeypatch.setattr(cli, "_bench_transfers", record)
    monkeypatch.setattr(cli, "_bench_interference", record)
    assert cli.main(["bench", "--plot", "a.png", "transfers"]) == 0
    assert cli.main(["bench", "transfers", "--plot", "b.png"]) == 0
    assert cli.main(["bench", "--plot", "c.png", "interference"]) == 0
    assert cli.main(["bench", "transfers"]) == 0
    assert cli.main(["bench", "interference"]) == 0
    assert seen == ["a.png", "b.png", "c.png", None, None]


def test_repeat_sweeps_median_band_and_spread(tmp_path):
    """`--plot` repeats the sweep: each point is the median of the sweeps with its min and max,
    and a spread above SPREAD_LIMIT of the median is called too large to read."""
    pytest.importorskip("matplotlib")
    from kvoff.tools import bench_interference as bi

    def sweep(idle: float, gemm: float) -> list[dict[str, object]]:
        return [
            {"page_kib": 4, "dir": "store", "method": "kvoff auto", "idle_gb_s": idle, "gemm_gb_s": gemm},
            {"page_kib": 32, "dir": "store", "method": "kvoff auto", "idle_gb_s": 10.0, "gemm_gb_s": 9.0},
        ]

    runs = iter([sweep(10.0, 8.0), sweep(12.0, 8.2), sweep(11.0, 8.1)])
    logged: list[str] = []
    rows, spread = bench.repeat_sweeps(lambda: next(runs), 3, logged.append)
    assert logged == [f"page-size sweep {k} of 3" for k in (1, 2, 3)]
    r4 = next(r for r in rows if r["page_kib"] == 4)
    assert (r4["idle_gb_s"], r4["idle_gb_s_min"], r4["idle_gb_s_max"]) == (11.0, 10.0, 12.0)
    assert r4["gemm_gb_s_min"] == 8.0 and r4["sweeps"] == 3
    assert spread.worst == pytest.approx(2.0 / 11.0) and not spread.too_large
    assert "3 sweeps: median line, min-max band; largest spread 18%" in spread.note
    assert "kvoff auto, store, 4 KiB, idle" in spread.note
    labels = bi.plot_sweep_rows(rows, str(tmp_path / "band.png"), note=spread.note)
    assert labels == ["kvoff auto, idle", "kvoff auto, beside a GEMM"]
    assert "min-max" in bi.format_sweep_rows(rows).splitlines()[0]

    runs = iter([sweep(10.0, 8.0), sweep(20.0, 8.0)])
    _, spread = bench.repeat_sweeps(lambda: next(runs), 2)
    assert spread.too_large and "SPREAD TOO LARGE TO READ" in spread.note
    _, one = bench.repeat_sweeps(lambda: sweep(1.0, 1.0), 1)
    assert not one.too_large and one.note.startswith("1 sweep: no spread measured")


def test_host_contiguous_reference_uses_the_engines_threads():
    """The host engine's reference copies on as many threads as the engine splits a job over,
    with its thresholds (one thread below 8 MiB, >= 2 MiB per thread), and copies right."""
    import numpy as np

    with bench.ThreadedCopy(4) as tc:
        assert tc.pieces(4 << 20) == 1 and tc.pieces(8 << 20) == 4 and tc.pieces(100 << 20) == 4
        src = np.arange(9 << 20, dtype=np.uint32).view(np.uint8)[: 33 << 20]
        dst = np.zeros_like(src)
        tc.copy(dst, src)
        assert np.array_equal(dst, src)
    with bench.ThreadedCopy(2) as tc:
        assert tc.pieces(9 << 20) == 2
    assert 1 <= bench.host_engine_threads() <= 8
    gbs, threads = bench.time_host_contiguous(16 << 20, 1)
    assert gbs > 0 and threads == min(bench.host_engine_threads(), 8)


def test_gpu_plot_path_repeats_the_sweep(monkeypatch, tmp_path, capsys):
    """`kvoff bench interference --plot` and `kvoff bench transfers --plot` on a GPU, with the GPU
    sweep stood in for by fixed rows (the sweep itself needs a GPU: test_worker_gpu.py and the
    lead's GPU runs): the sweep runs --plot-repeats times and the table shows its spread."""
    pytest.importorskip("matplotlib")
    from kvoff.tools import bench_interference as bi

    calls: list[int] = []

    def fake_sweep(job_mib=64, seconds=0.3, log=None, pages_kib=None):
        calls.append(job_mib)
        v = 10.0 + len(calls)
        return [
            {"page_kib": p, "dir": d, "method": m, "idle_gb_s": v, "gemm_gb_s": v - 1, "mem_gb_s": v - 2}
            for p in (4, 32)
            for d in ("store", "load")
            for m in ("kvoff auto", "batched DMA", "contiguous copy")
        ]

    monkeypatch.setattr(cli, "_gpu_for_plot", lambda: True)
    monkeypatch.setattr(bi, "sweep_for_plot", fake_sweep)
    png = tmp_path / "i.png"
    argv = ["bench", "interference", "--plot", str(png), "--plot-repeats", "2", "--plot-job-mib", "8"]
    assert cli.main([*argv, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert calls == [8, 8] and png.stat().st_size > 10_000
    assert "spread: 2 sweeps: median line, min-max band; largest spread" in out and "11.0-12.0" in out

    monkeypatch.setattr(bench, "bench_transfers", lambda *a, **k: [])
    calls.clear()
    assert cli.main(["bench", "transfers", "--plot", str(png), "--quiet", "--job-mib", "16"]) == 0
    assert calls == [16, 16, 16] and "spread: 3 sweeps" in capsys.readouterr().out
