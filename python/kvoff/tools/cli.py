"""The ``kvoff`` command line: ``kvoff bench [managers|transfers|disk|remote|object|interference|model|serve]`` (no subcommand:
managers and transfers; ``--plot FILE``: also a page-size sweep plot) and ``kvoff demo`` (a
simulated serving loop offloading a model-shaped KV cache).

Subcommands of ``kvoff bench`` are rows of :func:`_bench_commands` (name, help, a function adding its
options, a function running it). Numeric options take their ``type=`` from :mod:`kvoff.tools._cli_args`,
which states the allowed range; errors are one line, exit status 2, and no input shows a traceback
(``KVOFF_TRACEBACK=1`` shows one for an unexpected error)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvoff import _native
from kvoff.tools._cli_args import (
    BENCH_PIPELINES,
    CAPACITY,
    DISK_BLOCKS,
    IO_THREADS,
    JOB_MIB,
    JOBS_MIB,
    NATIVE_THREADS_ARG,
    PAGES_KIB,
    PLOT_REPEATS,
    REMOTE_BLOCKS,
    REMOTE_IO_THREADS,
    REPS,
    REQUESTS,
    ROUNDS,
    SECONDS,
    Parser,
    UsageError,
    check_memory,
    has_torch,
    usage_exit,
)
from kvoff.tools._cli_demo import add_demo_args, demo_main
from kvoff.tools.bench_serve import SERVE_HELP, add_serve_options, serve_main

# The closed name sets come from the native module (the Rust enums `EngineKind`, `PolicyKind` and
# the file tier's `DirectIo`; docs/design.md "Closed name sets live in one Rust enum").
#: Engines ``kvoff bench transfers --methods`` takes (``auto-idle``: auto with the idle policy).
TRANSFER_METHODS: tuple[str, ...] = (*_native.ENGINES, "auto-idle")
#: Engines of ``kvoff bench interference --methods`` variants.
INTERFERENCE_ENGINES: tuple[str, ...] = _native.ENGINES

# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _log(args: argparse.Namespace) -> Callable[[str], None] | None:
    """A per-row log on stderr unless ``--quiet``."""
    if getattr(args, "quiet", False):
        return None
    return lambda s: print(s, file=sys.stderr, flush=True)


def _check_job_memory(job_mib: int | None) -> None:
    """A transfer job of ``job_mib`` MiB holds about 6x its bytes at once (the KV side and the
    host region, each twice the job, and the reference's two buffers; scenarios move at least 256
    pages of 2 MiB)."""
    if job_mib is not None:
        check_memory("--job-mib", job_mib, 6 * max(job_mib, 512) << 20)


def _plot_needs_matplotlib(cmd: str) -> bool:
    """False (after saying why on stderr) where ``--plot`` cannot draw: matplotlib is missing."""
    from kvoff.tools._toolbase import require_matplotlib

    try:
        require_matplotlib()
    except ImportError:
        print(
            f"{cmd}: --plot needs matplotlib: pip install matplotlib (the benchmarks themselves do not)",
            file=sys.stderr,
        )
        return False
    return True


def _gpu_for_plot() -> bool:
    """Whether the GPU benchmarks (``--plot``'s GPU sweep, CUDA methods) can run here: torch with
    CUDA and kvoff's CUDA engine."""
    try:
        import torch
    except ImportError:
        return False
    import kvoff

    return bool(torch.cuda.is_available() and kvoff.cuda_available())


# ---------------------------------------------------------------------------------------------
# kvoff bench ...
# ---------------------------------------------------------------------------------------------


def _bench_managers(args: argparse.Namespace) -> int:
    from kvoff.tools.bench import bench_managers, format_manager_rows, vllm_manager_factory

    sys.stdout.flush()
    vllm = {"auto": None, "on": True, "off": False}[getattr(args, "vllm", "auto")]
    if vllm and vllm_manager_factory() is None:
        print(
            "kvoff bench managers: --vllm on, but vLLM's offloading managers (vllm.v1.kv_offload) "
            "cannot be imported here",
            file=sys.stderr,
        )
        return 2
    rows = bench_managers(args.requests, args.capacity, args.reps, show_progress=not args.quiet, vllm=vllm)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        sys.stderr.flush()
        print(format_manager_rows(rows))
    return 0


def _page_size_sweep(args: argparse.Namespace) -> tuple[list[dict[str, object]], str]:
    """``kvoff bench [transfers] --plot FILE``: the page-size sweep, run ``--plot-repeats`` times
    and drawn into ``args.plot`` with its min-max spread. On a GPU with torch,
    ``kvoff bench interference --plot``'s (kvoff, batched DMA and a contiguous copy, idle and beside
    compute); otherwise the host engine's (kvoff, a contiguous copy on the engine's threads, one
    copy per page, idle only). Returns the rows and their table."""
    from kvoff.tools.bench import (
        HOST_PLOT_NOTE,
        format_spread,
        plot_host_sweep_rows,
        repeat_sweeps,
        sweep_host_for_plot,
    )
    from kvoff.tools.bench_interference import format_sweep_rows, plot_sweep_rows, sweep_for_plot

    log = _log(args)
    repeats = args.plot_repeats
    if _gpu_for_plot():
        job_mib = args.job_mib or 64
        rows, spread = repeat_sweeps(lambda: sweep_for_plot(job_mib=job_mib, log=log), repeats, log)
        plot_sweep_rows(rows, args.plot, note=spread.note)
        table = format_sweep_rows(rows)
    else:
        job_mib = args.job_mib
        reps = args.transfer_reps
        rows, spread = repeat_sweeps(
            lambda: sweep_host_for_plot(job_mib=job_mib, reps=reps, log=log), repeats, log
        )
        plot_host_sweep_rows(rows, args.plot, spread_note=spread.note)
        table = f"page-size sweep on the host engine ({HOST_PLOT_NOTE})\n{format_sweep_rows(rows)}"
    return rows, f"{table}\n{format_spread(spread)}\nplot written to {args.plot}"


def _check_transfer_args(args: argparse.Namespace) -> list[str] | None:
    _check_job_memory(args.job_mib)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    if methods is not None:
        bad = [m for m in methods if m not in TRANSFER_METHODS]
        if bad or not methods:
            raise UsageError(
                f"argument --methods: {args.methods!r}: expected a comma-separated list of "
                f"{', '.join(TRANSFER_METHODS)}"
            )
        if methods != ["host"] and not has_torch():
            raise UsageError(
                f"argument --methods: {args.methods!r} needs torch and a CUDA GPU; without torch "
                "only 'host' runs"
            )
        cuda_only = [m for m in methods if m not in ("host", "auto")]
        if cuda_only and not _gpu_for_plot():
            raise UsageError(
                f"argument --methods: {', '.join(cuda_only)} need a CUDA GPU (torch with CUDA and kvoff's "
                "CUDA engine); here only host and auto (= host) run"
            )
    return methods


def _bench_transfers(args: argparse.Namespace) -> int:
    from kvoff.tools.bench import bench_transfers, format_transfer_rows

    plot = getattr(args, "plot", None)
    methods = _check_transfer_args(args)
    if plot and not _plot_needs_matplotlib(f"kvoff bench {args.what or ''}".strip()):
        return 2
    sys.stdout.flush()
    rows = bench_transfers(args.job_mib, args.transfer_reps, methods, show_progress=not args.quiet)
    sweep, table = _page_size_sweep(args) if plot else (None, "")
    sys.stderr.flush()
    if args.json:
        print(json.dumps(rows if sweep is None else {"transfers": rows, "sweep": sweep}, indent=2))
    else:
        print(format_transfer_rows(rows))
        if sweep is not None:
            print()
            print(table)
    return 0


def _bench_disk(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from kvoff.tier import bench_disk_rows, format_disk_rows

    d = args.dir or tempfile.gettempdir()
    if not os.path.isdir(d):
        raise UsageError(f"argument --dir: {d!r} is not a directory")
    # The host region and the blocks' source bytes (2 MiB each), and the tier's files beside a
    # sequential file of the same bytes.
    nbytes = args.blocks << 21
    check_memory("--blocks", args.blocks, 3 * nbytes, " blocks of 2 MiB")
    free = shutil.disk_usage(d).free
    if 2 * nbytes > free:
        raise UsageError(
            f"argument --blocks: {args.blocks} blocks of 2 MiB need about {2 * nbytes / 2**30:.1f} GiB "
            f"on {d}, {free / 2**30:.1f} GiB is free"
        )
    if not args.quiet:
        print(
            f"disk tier on {d}: {args.blocks} blocks of 2 MiB per repetition, {args.reps} repetitions, "
            f"{args.io_threads} I/O threads",
            file=sys.stderr,
        )
    rows = bench_disk_rows(d, args.blocks, args.reps, args.io_threads, args.direct_io)
    print(json.dumps(rows, indent=2) if args.json else format_disk_rows(rows))
    return 0


def _interference_methods(spec: str | None) -> list[str] | None:
    """``--methods`` of ``kvoff bench interference``, each variant checked (:class:`UsageError`)."""
    from kvoff.tools.bench_interference import parse_method

    if not spec:
        return None
    variants = [v for v in spec.split(";") if v.strip()]
    for v in variants:
        try:
            _, engine, budget, _ = parse_method(v)
        except ValueError:
            engine, budget = "", -1.0
        if engine not in INTERFERENCE_ENGINES or (budget is not None and not 0.0 < budget <= 1.0):
            raise UsageError(
                f"argument --methods: {v!r}: expected label:engine[:budget[:tune]] with engine one of "
                f"{', '.join(INTERFERENCE_ENGINES)} and budget a number above 0 to 1 or 'none'"
            )
    return variants


def _value_sizes(s: str) -> list[int]:
    """``--sizes`` of ``kvoff bench remote``: comma-separated value sizes (``2MiB``, ``32KiB`` or
    bytes), each from 1 KiB to the remote tier's 64 MiB value cap."""
    allowed = "1 to 8 comma-separated sizes such as 2MiB or 32KiB, each from 1KiB to 64MiB"
    items = [x.strip().lower() for x in s.split(",") if x.strip()]
    if not items or len(items) > 8:
        raise argparse.ArgumentTypeError(f"{s!r}: expected {allowed}")
    out = []
    for x in items:
        mult = 1 << 20 if x.endswith("mib") else 1 << 10 if x.endswith("kib") else 1
        num = x.removesuffix("mib").removesuffix("kib")
        if not num.isdigit():
            raise argparse.ArgumentTypeError(f"{x!r} is not a size (allowed: {allowed})")
        v = int(num) * mult
        if not 1 << 10 <= v <= 64 << 20:
            shown = x if len(x) <= 24 else x[:21] + "..."
            raise argparse.ArgumentTypeError(f"{shown} is out of range (allowed: {allowed})")
        out.append(v)
    return out


_value_sizes.__name__ = "list"


def _remote_cmd(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=None,
        help="redis:// or rediss:// URL of the server (default: start a private redis-server on "
        "loopback; needs redis-server and redis-benchmark on PATH)",
    )
    p.add_argument("--cluster", action="store_true", help="the URL is a Redis Cluster node")
    p.add_argument(
        "--sizes",
        type=_value_sizes,
        default=[2 << 20, 32 << 10],
        help="value (block) sizes (default 2MiB,32KiB)",
    )
    p.add_argument(
        "--blocks",
        type=REMOTE_BLOCKS,
        default=None,
        metavar="N",
        help="blocks per repetition (default ~256 MiB)",
    )
    p.add_argument(
        "--reps",
        dest="remote_reps",
        type=REPS,
        default=3,
        metavar="N",
        help="repetitions, median (1-100, default 3)",
    )
    p.add_argument(
        "--pipelines",
        type=BENCH_PIPELINES,
        default=[1, 4, 16],
        help="redis-benchmark -P values tried (1-1024)",
    )
    p.add_argument(
        "--clients", type=BENCH_PIPELINES, default=[1, 4, 16], help="redis-benchmark -c values tried (1-1024)"
    )
    p.add_argument(
        "--native-threads",
        dest="native_threads",
        type=NATIVE_THREADS_ARG,
        default=[1, 4, 8, 16],
        help="thread counts of the native-client reference (one GET per key; 1-256, default 1,4,8,16)",
    )
    p.add_argument(
        "--io-threads",
        type=REMOTE_IO_THREADS,
        default=None,
        metavar="N",
        help="kvoff's remote_io_threads (1-64, default: the tier's default, 4)",
    )
    _output_args(p)


def _bench_remote(args: argparse.Namespace) -> int:
    from kvoff.tools.bench_remote import bench_remote, format_remote

    try:
        res = bench_remote(
            args.url,
            args.sizes,
            blocks=args.blocks,
            reps=args.remote_reps,
            pipelines=args.pipelines,
            clients=args.clients,
            native_threads=args.native_threads,
            cluster=args.cluster,
            io_threads=args.io_threads,
            log=None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True)),
        )
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        raise UsageError(f"remote: {e}") from None
    print(json.dumps(res, indent=1) if args.json else format_remote(res))
    return 0


def _object_cmd(p: argparse.ArgumentParser) -> None:
    from kvoff.tools.bench_object import add_arguments

    add_arguments(p)


def _bench_object(args: argparse.Namespace) -> int:
    from kvoff.tools.bench_object import run

    return run(args)


def _model_cmd(p: argparse.ArgumentParser) -> None:
    from kvoff.tools.bench_model import add_arguments

    add_arguments(p)


def _bench_model(args: argparse.Namespace) -> int:
    from kvoff.tools.bench_model import run

    return run(args)


def _bench_interference(args: argparse.Namespace) -> int:
    from kvoff.tools.bench_interference import (
        bench_interference,
        format_interference,
        format_sweep_rows,
        plot_sweep_rows,
        sweep_for_plot,
    )

    variants = _interference_methods(args.variants)
    dirs = [x.strip() for x in args.dirs.split(",") if x.strip()] if args.dirs else None
    if dirs is not None and (not dirs or any(x not in ("store", "load", "both") for x in dirs)):
        raise UsageError(
            f"argument --dirs: {args.dirs!r}: expected a comma-separated list of store, load, both"
        )
    if args.plot and not _plot_needs_matplotlib("kvoff bench interference"):
        return 2
    if not _gpu_for_plot():
        print(
            "kvoff bench interference: needs a CUDA GPU and torch with CUDA (it measures transfers "
            "beside GPU compute); on this machine run kvoff bench transfers",
            file=sys.stderr,
        )
        return 1
    if args.plot:
        from kvoff.tools.bench import format_spread, repeat_sweeps

        job_mib, seconds, log = args.plot_job_mib, args.seconds, _log(args)
        rows, spread = repeat_sweeps(
            lambda: sweep_for_plot(job_mib=job_mib, seconds=seconds, log=log), args.plot_repeats, log
        )
        plot_sweep_rows(rows, args.plot, note=spread.note)
        print(json.dumps(rows, indent=1) if args.json else format_sweep_rows(rows))
        print(format_spread(spread))
        print(f"plot written to {args.plot}")
        return 0

    if args.full:
        pages, jobs, dirs_ = [4, 32, 256, 2048], [1, 8, 32, 128, 512], ["store", "load", "both"]
    else:
        pages, jobs, dirs_ = [4, 32], [8, 128], ["store", "both"]
    res = bench_interference(
        args.pages_kib or pages,
        args.jobs_mib or jobs,
        dirs or dirs_,
        variants,
        args.seconds,
        log=_log(args),
        rounds=args.rounds,
    )
    print(json.dumps(res, indent=1) if args.json else format_interference(res))
    return 0


def _bench_all(args: argparse.Namespace) -> int:
    """``kvoff bench`` with no subcommand: every benchmark that this machine can run (and with
    ``--plot FILE``, the page-size sweep drawn into FILE)."""
    _check_transfer_args(args)
    if args.plot and not _plot_needs_matplotlib("kvoff bench"):
        return 2
    rc = _bench_managers(args)
    print()
    # Without torch (or a GPU) the transfers run on the host engine over plain host buffers.
    return rc or _bench_transfers(args)


# ---------------------------------------------------------------------------------------------
# The option table of ``kvoff bench``
# ---------------------------------------------------------------------------------------------

#: Defaults of options that ``kvoff bench`` itself takes (for ``kvoff bench`` with no subcommand,
#: which runs managers and transfers) and that its subcommands take too. A subcommand's option of
#: one of these dests defaults to "not given" (argparse.SUPPRESS, set by :func:`_build_parser`), so
#: that one given before the subcommand (``kvoff bench --quiet transfers``) is kept.
BENCH_DEFAULTS: dict[str, Any] = {
    "requests": 2000,
    "capacity": 20_000,
    "reps": 5,
    "transfer_reps": 5,
    "job_mib": None,
    "methods": None,
    "vllm": "auto",
    "json": False,
    "quiet": False,
    "plot": None,
    "plot_repeats": 3,
}

PLOT_HELP = (
    "also sweep page sizes (4 KiB-2 MiB) --plot-repeats times and plot GB/s with its min-max spread "
    "into FILE.png (needs matplotlib: pip install matplotlib): on a GPU with torch, kvoff's default, "
    "plain batched DMA and a contiguous copy, idle, beside a GEMM and beside a memory-bound kernel (as "
    "bench interference --plot); otherwise kvoff's host engine, a contiguous copy of the same bytes on "
    "the engine's threads and one copy per page, idle only"
)


class _AllReps(argparse.Action):
    """``kvoff bench --reps N``: the repetitions of both benchmarks it runs."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        namespace.reps = values
        namespace.transfer_reps = values


def _output_args(p: argparse.ArgumentParser, *, plot: bool = False) -> None:
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-row log on stderr")
    if plot:
        p.add_argument("--plot", metavar="FILE.png", help=PLOT_HELP)
        p.add_argument(
            "--plot-repeats",
            dest="plot_repeats",
            type=PLOT_REPEATS,
            metavar="N",
            help="sweeps drawn by --plot, as their median and min-max band (1-20, default 3)",
        )


def _manager_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--requests", type=REQUESTS, metavar="N", help="requests of 64 keys (1-100000, default 2000)"
    )
    p.add_argument(
        "--capacity",
        type=CAPACITY,
        metavar="BLOCKS",
        help="manager capacity in blocks (64 = one request's keys, to 2^24; default 20000)",
    )
    p.add_argument(
        "--vllm",
        choices=["auto", "on", "off"],
        help="also run vLLM's own managers (the baseline of the targets): auto = where vLLM is "
        "installed (default)",
    )


def _transfer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--job-mib",
        dest="job_mib",
        type=JOB_MIB,
        metavar="MIB",
        help="bytes per job in MiB (1-16384 and what memory allows; default: 512 on a GPU, scaled "
        "to memory on the host)",
    )
    p.add_argument(
        "--methods",
        metavar="LIST",
        help=f"comma-separated engines of {', '.join(TRANSFER_METHODS)} (default: auto,auto-idle,dma,"
        "kernel,staged on a GPU, host otherwise)",
    )


def _managers_cmd(p: argparse.ArgumentParser) -> None:
    _manager_args(p)
    p.add_argument("--reps", type=REPS, metavar="N", help="repetitions, median reported (1-100, default 5)")
    _output_args(p)


def _transfers_cmd(p: argparse.ArgumentParser) -> None:
    _transfer_args(p)
    p.add_argument(
        "--reps",
        dest="transfer_reps",
        type=REPS,
        metavar="N",
        help="repetitions, median reported (1-100, default 5)",
    )
    _output_args(p, plot=True)


def _disk_cmd(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=None, help="a directory on the filesystem to measure (default: $TMPDIR)")
    p.add_argument(
        "--blocks",
        type=DISK_BLOCKS,
        default=256,
        metavar="N",
        help="2 MiB blocks per repetition (1-16384 and what memory and disk allow; default 256)",
    )
    p.add_argument("--reps", type=REPS, metavar="N", help="repetitions, median reported (1-100, default 5)")
    p.add_argument(
        "--io-threads",
        dest="io_threads",
        type=IO_THREADS,
        default=8,
        metavar="N",
        help="the tier's I/O threads (1-256, default 8)",
    )
    p.add_argument("--direct-io", dest="direct_io", choices=_native.DIRECT_IO, default="auto")
    _output_args(p)


def _interference_cmd(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pages-kib",
        dest="pages_kib",
        type=PAGES_KIB,
        default=None,
        metavar="LIST",
        help="page sizes in KiB, each 1-65536 (default 4,32; --full: 4,32,256,2048)",
    )
    p.add_argument(
        "--jobs-mib",
        dest="jobs_mib",
        type=JOBS_MIB,
        default=None,
        metavar="LIST",
        help="job sizes in MiB, each 1-16384 (default 8,128; --full: 1,8,32,128,512)",
    )
    p.add_argument("--dirs", default=None, help="store,load,both (default store,both; --full: all three)")
    p.add_argument(
        "--methods",
        dest="variants",
        default=None,
        help="';'-separated label:engine[:budget[:tune]] (default: dma, "
        "kernel, staged, auto-idle (budget none), auto-serve (budget 0.02, serving policy on every "
        "job: tune idleafter=0), auto (budget 0.02: serving policy while the model computes))",
    )
    p.add_argument(
        "--seconds",
        type=SECONDS,
        default=0.3,
        metavar="S",
        help="seconds per measurement (above 0 to 60, default 0.3)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="instead of the grid: sweep page sizes (4 KiB-2 MiB) --plot-repeats times and plot GB/s "
        "with its min-max spread of kvoff's default, plain batched DMA and a contiguous copy, idle, "
        "beside the GEMM and beside the memory-bound kernel (needs matplotlib)",
    )
    p.add_argument(
        "--plot-repeats",
        dest="plot_repeats",
        type=PLOT_REPEATS,
        metavar="N",
        help="sweeps drawn by --plot (1-20, default 3)",
    )
    p.add_argument(
        "--plot-job-mib",
        dest="plot_job_mib",
        type=JOB_MIB,
        default=64,
        metavar="MIB",
        help="MiB per job in the --plot sweep (1-16384, default 64)",
    )
    p.add_argument(
        "--rounds",
        type=ROUNDS,
        default=3,
        help="alternating alone/beside measurements per proxy and cell (median; 1-100, default 3)",
    )
    p.add_argument("--full", action="store_true", help="the full grid (takes tens of minutes)")
    _output_args(p)


@dataclass(frozen=True)
class Command:
    """A subcommand: its name, ``--help`` line, a function adding its options and its handler
    (returns the exit status; raises :class:`UsageError` for a bad combination of options)."""

    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _bench_commands() -> list[Command]:
    """The subcommands of ``kvoff bench`` (built per parse, so that tests may replace handlers)."""
    return [
        Command(
            "managers",
            "manager workload of docs/performance.md, both policies, vs a Python reference "
            "and vLLM's own managers where vLLM is installed",
            _managers_cmd,
            _bench_managers,
        ),
        Command(
            "transfers",
            "scattered KV-block transfers (docs/performance.md scenarios) vs a contiguous copy",
            _transfers_cmd,
            _bench_transfers,
        ),
        Command(
            "disk",
            "file tier (docs/spec.md §9) write/read GB/s vs a sequential O_DIRECT write/read "
            "of the same bytes on the same filesystem, promotion latency, CPU per block",
            _disk_cmd,
            _bench_disk,
        ),
        Command(
            "remote",
            "remote tier (Redis/Valkey, docs/tier.md) store/load GB/s vs redis-benchmark's best "
            "and redis-py pipelined SET/GET of the same value size on the same server",
            _remote_cmd,
            _bench_remote,
        ),
        Command(
            "object",
            "object tier (S3-compatible, docs/tier.md) store/load GB/s vs boto3 at its best thread "
            "count and single-threaded on the same server, lookup p50/p99 with the server up, "
            "stopped and gone",
            _object_cmd,
            _bench_object,
        ),
        Command(
            "interference",
            "transfers beside compute on a GPU: model slowdown, GB/s, "
            "other-thread launch latency, per page/job/direction/method",
            _interference_cmd,
            _bench_interference,
        ),
        Command(
            "model",
            "transfers beside a Llama-shaped model's forward on a GPU (eager and CUDA-graph decode, "
            "eager prefill): the model's slowdown and kvoff's GB/s against plain DMA",
            _model_cmd,
            _bench_model,
        ),
        # Its options and one-line checks live in kvoff.tools.bench_serve (standard library only at import).
        Command("serve", SERVE_HELP, add_serve_options, serve_main),
    ]


# ---------------------------------------------------------------------------------------------
# The parser and main
# ---------------------------------------------------------------------------------------------


def _build_parser() -> Parser:
    parser = Parser(prog="kvoff", description="kvoff: KV-cache offloading tools")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{bench,demo}")
    bench = sub.add_parser(
        "bench",
        help="run benchmarks (no subcommand: managers, then transfers)",
        description="Benchmarks. Without a subcommand: managers, then transfers, with the options below.",
    )
    bench.set_defaults(func=_bench_all, **BENCH_DEFAULTS)
    _manager_args(bench)
    _transfer_args(bench)
    bench.add_argument(
        "--reps",
        type=REPS,
        action=_AllReps,
        metavar="N",
        help="repetitions of each benchmark, median reported (1-100, default 5)",
    )
    _output_args(bench, plot=True)
    bsub = bench.add_subparsers(dest="what", metavar="{" + ",".join(c.name for c in _bench_commands()) + "}")
    for c in _bench_commands():
        p = bsub.add_parser(c.name, help=c.help, description=c.help)
        c.add_args(p)
        for a in p._actions:
            if a.dest in BENCH_DEFAULTS:
                a.default = argparse.SUPPRESS
        p.set_defaults(func=c.run)
    demo = sub.add_parser(
        "demo",
        help="simulated serving loop: offload a Llama-3-8B-shaped KV cache, verify "
        "every reloaded block, report hit rate, GB/s and prefill time saved (needs torch)",
    )
    add_demo_args(demo)
    demo.set_defaults(func=demo_main)
    return parser


def _prog(args: argparse.Namespace) -> str:
    return " ".join(x for x in ("kvoff", getattr(args, "cmd", None), getattr(args, "what", None)) if x)


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (2: a usage error, 1: the run failed)."""
    args = _build_parser().parse_args(argv)
    prog = _prog(args)
    try:
        return int(args.func(args))
    except UsageError as e:
        return usage_exit(prog, str(e))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the command line shows one line, not a traceback
        if os.environ.get("KVOFF_TRACEBACK") == "1":
            raise
        print(
            f"{prog}: error: {type(e).__name__}: {e} (KVOFF_TRACEBACK=1 shows where)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
