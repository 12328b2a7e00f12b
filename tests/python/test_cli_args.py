"""The ``kvoff`` command line never shows a traceback for a bad value: every numeric option of every
subcommand, fed a negative, zero, huge and non-numeric value in a child process (as a user runs
it), exits 2 with one line naming the option and its allowed range (kvoff.tools._cli_args)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from kvoff.tools import cli

# (command, option, values that are valid, so that zero is accepted where the range starts at 0)
NUMERIC = [
    (["bench"], "--requests"),
    (["bench"], "--capacity"),
    (["bench"], "--reps"),
    (["bench"], "--job-mib"),
    (["bench"], "--plot-repeats"),
    (["bench", "managers"], "--requests"),
    (["bench", "managers"], "--capacity"),
    (["bench", "managers"], "--reps"),
    (["bench", "transfers"], "--job-mib"),
    (["bench", "transfers"], "--reps"),
    (["bench", "transfers"], "--plot-repeats"),
    (["bench", "disk"], "--blocks"),
    (["bench", "disk"], "--reps"),
    (["bench", "disk"], "--io-threads"),
    (["bench", "remote"], "--sizes"),
    (["bench", "remote"], "--blocks"),
    (["bench", "remote"], "--reps"),
    (["bench", "remote"], "--pipelines"),
    (["bench", "remote"], "--clients"),
    (["bench", "remote"], "--io-threads"),
    (["bench", "remote"], "--native-threads"),
    (["bench", "object"], "--sizes-kib"),
    (["bench", "object"], "--mib"),
    (["bench", "object"], "--reps"),
    (["bench", "object"], "--ref-threads"),
    (["bench", "object"], "--batch"),
    (["bench", "object"], "--io-threads"),
    (["bench", "object"], "--max-requests"),
    (["bench", "object"], "--lookups"),
    (["bench", "object"], "--prefix"),
    (["bench", "interference"], "--seconds"),
    (["bench", "interference"], "--rounds"),
    (["bench", "interference"], "--plot-job-mib"),
    (["bench", "interference"], "--plot-repeats"),
    (["bench", "interference"], "--pages-kib"),
    (["bench", "interference"], "--jobs-mib"),
    (["demo"], "--requests"),
    (["demo"], "--blocks-per-request"),
    (["demo"], "--gpu-blocks"),
    (["demo"], "--cpu-blocks"),
    (["demo"], "--prefill-tokens-per-s"),
    (["demo"], "--sweep-mib"),
]
#: Options whose range starts at 0 (zero is valid there).
ZERO_OK = {("demo", "--seed"), ("demo", "--metrics-port")}
NUMERIC += [(["demo"], "--seed"), (["demo"], "--metrics-port")]
BAD = {"negative": "-3", "zero": "0", "huge": "1" + "0" * 30, "non-numeric": "abc"}


def _numeric_options(parser: object, path: list[str]) -> set[tuple[str, str]]:
    """Every option of the real parser whose ``type`` is a range check (kvoff.tools._cli_args), so that
    an option added later without a case here fails this test."""
    import argparse

    out: set[tuple[str, str]] = set()
    assert isinstance(parser, argparse.ArgumentParser)
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, p in a.choices.items():
                out |= _numeric_options(p, [*path, name])
        elif a.option_strings and getattr(a.type, "__name__", "") in ("integer", "number", "list"):
            out.add((" ".join(path), a.option_strings[0]))
    return out


def test_every_numeric_option_is_covered() -> None:
    real = _numeric_options(cli._build_parser(), [])
    assert real == {(" ".join(cmd), opt) for cmd, opt in NUMERIC}


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("KVOFF_TRACEBACK", None)
    return subprocess.run(
        [sys.executable, "-c", "import sys; from kvoff.tools.cli import main; sys.exit(main())", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def _cases() -> list[tuple[list[str], str, str, str]]:
    out = []
    for cmd, opt in NUMERIC:
        for kind, value in BAD.items():
            if kind == "zero" and (cmd[0], opt) in ZERO_OK:
                continue
            out.append((cmd, opt, kind, value))
    return out


def test_bad_numeric_values_are_one_line_usage_errors() -> None:
    """Each bad value, in its own child process (`--opt=value`, so that a negative number reaches
    the option): exit status 2, one line on stderr naming the option and the allowed range,
    nothing on stdout, no traceback, no benchmark run."""
    cases = _cases()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: _run([*c[0], f"{c[1]}={c[3]}"]), cases))
    failures = []
    for (cmd, opt, kind, value), p in zip(cases, results, strict=True):
        err = p.stderr.strip()
        prog = " ".join(["kvoff", *cmd])
        ok = (
            p.returncode == 2
            and p.stdout == ""
            and "Traceback" not in p.stderr
            and len(err.splitlines()) == 1
            and err.startswith(f"{prog}: error: argument {opt}")
            and "allowed:" in err
        )
        if not ok:
            failures.append(
                f"{prog} {opt}={value} ({kind}): rc={p.returncode} err={err!r} out={p.stdout[:200]!r}"
            )
    assert not failures, "\n".join(failures)


def test_negative_value_after_a_space_names_the_option() -> None:
    """`kvoff bench --reps -3` (the issue's case): the option's error, not "invalid choice"."""
    for argv in (["bench", "--reps", "-3"], ["bench", "managers", "--reps", "-3"], ["demo", "--seed", "-1"]):
        p = _run(argv)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert "argument --reps" in p.stderr or "argument --seed" in p.stderr, p.stderr
        assert "invalid choice" not in p.stderr


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["bench", "--methods", "warp"], "argument --methods"),
        (["bench", "transfers", "--methods", "host,dma"], "argument --methods"),
        (["bench", "interference", "--dirs", "up"], "argument --dirs"),
        (["bench", "interference", "--methods", "x:warp"], "argument --methods"),
        (["bench", "interference", "--methods", "x:dma:-1"], "argument --methods"),
        (["bench", "transfers", "--job-mib", "16384"], "argument --job-mib"),
        (["bench", "disk", "--dir", "/nonexistent/kvoff"], "argument --dir"),
        (["demo", "--gpu-blocks", "4", "--blocks-per-request", "8"], "argument --gpu-blocks"),
        (["bench", "nonsense"], "invalid choice"),
        (["bench", "managers", "--reps"], "argument --reps: expected one argument"),
    ],
)
def test_other_bad_values_are_usage_errors(argv: list[str], needle: str) -> None:
    """Lists, names, combinations and the machine's memory: also one line, exit 2. (16 GiB jobs
    need ~64 GiB of memory, more than the test machines have.)"""
    if "host,dma" in argv:
        from kvoff import _native

        if _native.cuda_available():
            pytest.skip("a GPU is here: dma runs")
    p = _run(argv)
    err = p.stderr.strip()
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    if "16384" in argv and "argument --job-mib" not in err:
        pytest.skip("this machine has the memory for a 16 GiB job")
    assert len(err.splitlines()) == 1 and needle in err, err


def test_quiet_is_accepted_before_and_after_the_subcommand() -> None:
    args = cli._build_parser().parse_args(["bench", "--plot", "x.png", "--quiet"])
    assert args.quiet and args.plot == "x.png" and args.plot_repeats == 3
    args = cli._build_parser().parse_args(["bench", "--quiet", "transfers", "--reps", "2"])
    assert args.quiet and args.transfer_reps == 2
    args = cli._build_parser().parse_args(["bench", "--reps", "2"])
    assert args.reps == 2 and args.transfer_reps == 2
    args = cli._build_parser().parse_args(["bench", "managers"])
    assert args.reps == 5 and args.requests == 2000 and not args.quiet


def test_demo_without_torch_prints_only_its_message() -> None:
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['torch'] = None\nfrom kvoff.tools.cli import main\nsys.exit(main(['demo']))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip() == (
        "kvoff demo needs torch: pip install torch (or, in a kvoff checkout: pip install '.[torch]')"
    )


def test_an_unexpected_error_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A failure inside a benchmark: one line with the error, exit 1 (KVOFF_TRACEBACK=1 re-raises)."""
    from kvoff.tools import bench

    def boom(*_: object, **__: object) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(bench, "bench_managers", boom)
    monkeypatch.delenv("KVOFF_TRACEBACK", raising=False)
    assert cli.main(["bench", "managers", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        "kvoff bench managers: error: RuntimeError: disk on fire (KVOFF_TRACEBACK=1 shows where)"
    )
    monkeypatch.setenv("KVOFF_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="disk on fire"):
        cli.main(["bench", "managers", "--quiet"])


def test_no_progress_frames_or_dicts_on_a_redirected_stderr(tmp_path: object) -> None:
    """stderr not a terminal: no `\\r` progress frames (KVOFF_PROGRESS unset), and the --plot
    sweep's log lines are text, not Python dicts, with no blank lines."""
    pytest.importorskip("matplotlib")
    import pathlib

    png = pathlib.Path(str(tmp_path)) / "s.png"
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from kvoff.tools import bench\n"
        "from kvoff.tools.cli import main\n"
        "t, s = bench.bench_transfers, bench.sweep_host_for_plot\n"
        "bench.bench_transfers = lambda job_mib, reps, methods, show_progress: t(4, 1, methods, show_progress)\n"
        "bench.sweep_host_for_plot = lambda job_mib, reps, log: s(pages_kib=[4, 2048], job_mib=4, reps=1, log=log)\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = dict(os.environ)
    env.pop("KVOFF_PROGRESS", None)
    p = subprocess.run(
        [sys.executable, "-c", code, "bench", "transfers", "--plot", str(png), "--plot-repeats", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "\r" not in p.stderr and "{" not in p.stderr, p.stderr
    assert all(line.strip() for line in p.stderr.splitlines()), p.stderr
    assert "page-size sweep 2 of 2" in p.stderr
    assert "spread: 2 sweeps: median line, min-max band" in p.stdout
    assert "min-max" in p.stdout and png.stat().st_size > 10_000
