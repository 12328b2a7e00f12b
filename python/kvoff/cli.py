"""The ``kvoff`` command line: ``kvoff bench [managers|transfers|disk|remote|interference]`` (no subcommand:
managers and transfers; ``--plot FILE``: also a page-size sweep plot) and ``kvoff demo`` (a
simulated serving loop offloading a model-shaped KV cache)."""

from __future__ import annotations

import argparse
import json
import sys


def _bench_managers(args: argparse.Namespace) -> int:
    from kvoff.bench import bench_managers, format_manager_rows, vllm_manager_factory

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


def _plot_needs_matplotlib(cmd: str) -> bool:
    """False (after saying why on stderr) where ``--plot`` cannot draw: matplotlib is missing."""
    from kvoff.demo import require_matplotlib

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
    """Whether ``--plot`` can run the GPU sweep here: torch with CUDA and kvoff's CUDA engine."""
    try:
        import torch
    except ImportError:
        return False
    import kvoff

    return bool(torch.cuda.is_available() and kvoff.cuda_available())


def _page_size_sweep(args: argparse.Namespace) -> tuple[list[dict[str, object]], str]:
    """``kvoff bench [transfers] --plot FILE``: the page-size sweep drawn into ``args.plot``. On a
    GPU with torch, ``kvoff bench interference --plot``'s (kvoff, batched DMA and a contiguous copy,
    idle and beside compute); otherwise the host engine's (kvoff, one memcpy, one copy per page,
    idle only). Returns the rows and their table."""
    from kvoff.bench import HOST_PLOT_NOTE, plot_host_sweep_rows, sweep_host_for_plot
    from kvoff.bench_interference import format_sweep_rows, plot_sweep_rows, sweep_for_plot

    log = None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    if _gpu_for_plot():
        rows = sweep_for_plot(job_mib=args.job_mib or 64, log=log)
        plot_sweep_rows(rows, args.plot)
        table = format_sweep_rows(rows)
    else:
        rows = sweep_host_for_plot(job_mib=args.job_mib, reps=args.transfer_reps, log=log)
        plot_host_sweep_rows(rows, args.plot)
        table = f"page-size sweep on the host engine ({HOST_PLOT_NOTE})\n{format_sweep_rows(rows)}"
    return rows, f"{table}\nplot written to {args.plot}"


def _bench_transfers(args: argparse.Namespace) -> int:
    from kvoff.bench import bench_transfers, format_transfer_rows

    plot = getattr(args, "plot", None)
    if plot and not _plot_needs_matplotlib(f"kvoff bench {args.what or ''}".strip()):
        return 2
    sys.stdout.flush()
    methods = args.methods.split(",") if args.methods else None
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
    import tempfile

    from kvoff.tier import bench_disk_rows, format_disk_rows

    d = args.dir or tempfile.gettempdir()
    print(
        f"disk tier on {d}: {args.blocks} blocks of 2 MiB per repetition, {args.reps} repetitions, "
        f"{args.io_threads} I/O threads",
        file=sys.stderr,
    )
    rows = bench_disk_rows(d, args.blocks, args.reps, args.io_threads, args.direct_io)
    print(json.dumps(rows, indent=2) if args.json else format_disk_rows(rows))
    return 0


def _bench_remote(args: argparse.Namespace) -> int:
    from kvoff.bench_remote import bench_remote, format_remote

    def sizes(v: str) -> list[int]:
        out = []
        for x in v.split(","):
            x = x.strip().lower()
            mult = 1 << 20 if x.endswith("mib") else 1 << 10 if x.endswith("kib") else 1
            out.append(int(x.removesuffix("mib").removesuffix("kib")) * mult)
        return out

    def ints(v: str) -> list[int]:
        return [int(x) for x in v.split(",")]

    try:
        res = bench_remote(
            args.url,
            sizes(args.sizes),
            blocks=args.blocks,
            reps=args.reps,
            pipelines=ints(args.pipelines),
            clients=ints(args.clients),
            cluster=args.cluster,
            log=None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True)),
        )
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"kvoff bench remote: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1) if args.json else format_remote(res))
    return 0


def _bench_interference(args: argparse.Namespace) -> int:
    from kvoff.bench_interference import (
        bench_interference,
        format_interference,
        format_sweep_rows,
        plot_sweep_rows,
        sweep_for_plot,
    )

    if args.plot:
        if not _plot_needs_matplotlib("kvoff bench interference"):
            return 2
        rows = sweep_for_plot(
            job_mib=args.plot_job_mib,
            seconds=args.seconds,
            log=None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True)),
        )
        plot_sweep_rows(rows, args.plot)
        print(json.dumps(rows, indent=1) if args.json else format_sweep_rows(rows))
        print(f"plot written to {args.plot}")
        return 0

    def ints(v: str) -> list[int]:
        return [int(x) for x in v.split(",")]

    if args.full:
        pages, jobs, dirs = [4, 32, 256, 2048], [1, 8, 32, 128, 512], ["store", "load", "both"]
    else:
        pages, jobs, dirs = [4, 32], [8, 128], ["store", "both"]
    res = bench_interference(
        ints(args.pages_kib) if args.pages_kib else pages,
        ints(args.jobs_mib) if args.jobs_mib else jobs,
        args.dirs.split(",") if args.dirs else dirs,
        args.methods.split(";") if args.methods else None,
        args.seconds,
        log=None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True)),
        rounds=args.rounds,
    )
    print(json.dumps(res, indent=1) if args.json else format_interference(res))
    return 0


def _bench_all(args: argparse.Namespace) -> int:
    """``kvoff bench`` with no subcommand: every benchmark that this machine can run (and with
    ``--plot FILE``, the page-size sweep drawn into FILE)."""
    if args.plot and not _plot_needs_matplotlib("kvoff bench"):
        return 2
    rc = _bench_managers(args)
    print()
    # Without torch (or a GPU) the transfers run on the host engine over plain host buffers.
    return rc or _bench_transfers(args)


def _demo(args: argparse.Namespace) -> int:
    from kvoff.demo import (
        DemoConfig,
        format_result,
        format_sweep,
        plot_sweep,
        require_matplotlib,
        run_demo,
        sweep_page_sizes,
    )
    from kvoff.metrics import TransferMetrics, serve_metrics

    if args.plot:
        try:
            require_matplotlib()
        except ImportError as e:
            print(f"kvoff demo: {e}", file=sys.stderr)
            return 2
    if args.prometheus:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            print(
                "kvoff demo: --prometheus needs prometheus_client: pip install 'kvoff[prometheus]'",
                file=sys.stderr,
            )
            return 2
    cfg = DemoConfig(
        requests=args.requests,
        blocks_per_request=args.blocks_per_request,
        gpu_blocks=args.gpu_blocks,
        cpu_blocks=args.cpu_blocks,
        policy=args.policy,
        engine=args.engine,
        device=args.device,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        seed=args.seed,
        show_progress=False if args.quiet else None,
    )
    metrics = TransferMetrics()
    server = None
    if args.metrics_port is not None:
        try:
            server = serve_metrics(metrics, args.metrics_port)
        except ImportError as e:  # prometheus_client missing: say which extra to install
            print(f"kvoff demo: {e}", file=sys.stderr)
            return 2
        print(f"serving metrics at {server.url}", file=sys.stderr)
    try:
        sys.stdout.flush()
        result = run_demo(cfg, metrics)
        prom = metrics.prometheus_text() if args.prometheus else None
    finally:
        if server is not None:
            server.close()
    sweep = None
    if args.plot:
        sweep = sweep_page_sizes(
            job_mib=args.sweep_mib,
            engine=args.engine,
            device=args.device,
            show_progress=False if args.quiet else None,
        )
        plot_sweep(sweep, args.plot)
    sys.stderr.flush()
    if args.json:
        out = result.as_dict()
        if sweep is not None:
            out["sweep"] = sweep
        print(json.dumps(out, indent=2))
    else:
        print(format_result(result))
        if sweep is not None:
            print(format_sweep(sweep))
            print(f"  plot written to {args.plot}")
        if prom is not None:
            print()
            print(prom, end="")
    return 0 if result.verified else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvoff", description="kvoff: KV-cache offloading tools")
    sub = parser.add_subparsers(dest="cmd", required=True)
    bench = sub.add_parser("bench", help="run benchmarks")
    bsub = bench.add_subparsers(dest="what")
    bench.set_defaults(
        func=_bench_all,
        requests=2000,
        capacity=20_000,
        reps=5,
        json=False,
        quiet=False,
        job_mib=None,
        transfer_reps=5,
        methods=None,
        vllm="auto",
    )
    plot_help = (
        "also sweep page sizes (4 KiB-2 MiB) and plot GB/s into FILE.png (needs matplotlib): on a GPU "
        "with torch, kvoff's default, plain batched DMA and a contiguous copy, idle, beside a GEMM and "
        "beside a memory-bound kernel (as bench interference --plot); otherwise kvoff's host engine, "
        "one memcpy of the same bytes and one copy per page, idle only"
    )
    bench.add_argument("--plot", metavar="FILE.png", default=None, help=plot_help)
    m = bsub.add_parser(
        "managers",
        help="manager workload of docs/performance.md, both policies, vs a Python reference "
        "and vLLM's own managers where vLLM is installed",
    )
    m.add_argument("--requests", type=int, default=2000)
    m.add_argument("--capacity", type=int, default=20_000)
    m.add_argument("--reps", type=int, default=5, help="repetitions (median reported)")
    m.add_argument("--json", action="store_true", help="print rows as JSON")
    m.add_argument("--quiet", action="store_true", help="no progress bar")
    m.add_argument(
        "--vllm",
        choices=["auto", "on", "off"],
        default="auto",
        help="also run vLLM's own managers: auto = where vLLM is installed (default)",
    )
    m.set_defaults(func=_bench_managers)
    t = bsub.add_parser(
        "transfers", help="scattered KV-block transfers (docs/performance.md scenarios) vs a contiguous copy"
    )
    t.add_argument(
        "--job-mib",
        dest="job_mib",
        type=int,
        default=None,
        help="bytes per job in MiB (default: 512 on a GPU, scaled to memory on the host)",
    )
    t.add_argument("--reps", dest="transfer_reps", type=int, default=5, help="repetitions (median reported)")
    t.add_argument(
        "--methods",
        default=None,
        help="comma-separated engines (default: auto,dma,kernel,staged on a GPU, host otherwise)",
    )
    t.add_argument("--json", action="store_true", help="print rows as JSON")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    # SUPPRESS: the subcommand's --plot must not reset one given before it (`kvoff bench --plot F
    # transfers`); `bench` itself defaults it to None.
    t.add_argument("--plot", metavar="FILE.png", default=argparse.SUPPRESS, help=plot_help)
    t.set_defaults(func=_bench_transfers)
    k = bsub.add_parser(
        "disk",
        help="file tier (docs/spec.md §9) write/read GB/s vs a sequential O_DIRECT write/read "
        "of the same bytes on the same filesystem, promotion latency, CPU per block",
    )
    k.add_argument("--dir", default=None, help="a directory on the filesystem to measure (default: $TMPDIR)")
    k.add_argument("--blocks", type=int, default=256, help="2 MiB blocks per repetition (default 256)")
    k.add_argument("--reps", type=int, default=5, help="repetitions (median reported)")
    k.add_argument("--io-threads", dest="io_threads", type=int, default=8)
    k.add_argument("--direct-io", dest="direct_io", choices=["auto", "on", "off"], default="auto")
    k.add_argument("--json", action="store_true", help="print rows as JSON")
    k.set_defaults(func=_bench_disk)
    r = bsub.add_parser(
        "remote",
        help="remote tier (Redis/Valkey, docs/tier.md) store/load GB/s vs redis-benchmark's best "
        "and redis-py pipelined SET/GET of the same value size on the same server",
    )
    r.add_argument(
        "--url",
        default=None,
        help="redis:// or rediss:// URL of the server (default: start a private redis-server on "
        "loopback; needs redis-server and redis-benchmark on PATH)",
    )
    r.add_argument("--cluster", action="store_true", help="the URL is a Redis Cluster node")
    r.add_argument("--sizes", default="2MiB,32KiB", help="value (block) sizes, e.g. 2MiB,32KiB")
    r.add_argument("--blocks", type=int, default=None, help="blocks per repetition (default ~256 MiB)")
    r.add_argument("--reps", type=int, default=3, help="repetitions (median reported)")
    r.add_argument("--pipelines", default="1,4,16", help="redis-benchmark -P values tried")
    r.add_argument("--clients", default="1,4,16", help="redis-benchmark -c values tried")
    r.add_argument("--json", action="store_true", help="print the result as JSON")
    r.add_argument("--quiet", action="store_true", help="no per-run log on stderr")
    r.set_defaults(func=_bench_remote)
    i = bsub.add_parser(
        "interference",
        help="transfers beside compute on a GPU: model slowdown, GB/s, "
        "other-thread launch latency, per page/job/direction/method",
    )
    i.add_argument(
        "--pages-kib", default=None, help="page sizes in KiB (default 4,32; --full: 4,32,256,2048)"
    )
    i.add_argument(
        "--jobs-mib", default=None, help="job sizes in MiB (default 8,128; --full: 1,8,32,128,512)"
    )
    i.add_argument("--dirs", default=None, help="store,load,both (default store,both; --full: all three)")
    i.add_argument(
        "--methods",
        default=None,
        help="';'-separated label:engine[:budget[:tune]] (default: dma, "
        "kernel, staged, auto-idle (budget none), auto-serve (budget 0.02, serving policy on every "
        "job: tune idleafter=0), auto (budget 0.02: serving policy while the model computes))",
    )
    i.add_argument("--seconds", type=float, default=0.3, help="seconds per measurement (default 0.3)")
    i.add_argument(
        "--plot",
        metavar="FILE.png",
        default=argparse.SUPPRESS,
        help="instead of the grid: sweep page sizes (4 KiB-2 MiB) and plot GB/s of kvoff's default, "
        "plain batched DMA and a contiguous copy, idle, beside the GEMM and beside the memory-bound "
        "kernel (needs matplotlib)",
    )
    i.add_argument(
        "--plot-job-mib", dest="plot_job_mib", type=int, default=64, help="MiB per job in the --plot sweep"
    )
    i.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="alternating alone/beside measurements per proxy and cell (median; default 3)",
    )
    i.add_argument("--full", action="store_true", help="the full grid (takes tens of minutes)")
    i.add_argument("--json", action="store_true", help="print the result as JSON")
    i.add_argument("--quiet", action="store_true", help="no per-row log on stderr")
    i.set_defaults(func=_bench_interference)
    d = sub.add_parser(
        "demo",
        help="simulated serving loop: offload a Llama-3-8B-shaped KV cache, verify "
        "every reloaded block, report hit rate, GB/s and prefill time saved",
    )
    d.add_argument("--requests", type=int, default=160)
    d.add_argument(
        "--blocks-per-request",
        dest="blocks_per_request",
        type=int,
        default=24,
        help="16-token blocks per request (default 24 = 384 tokens)",
    )
    d.add_argument(
        "--gpu-blocks",
        dest="gpu_blocks",
        type=int,
        default=None,
        help="GPU KV pool in blocks of 2 MiB (default 64, less when memory is short)",
    )
    d.add_argument(
        "--cpu-blocks",
        dest="cpu_blocks",
        type=int,
        default=None,
        help="host offload capacity in blocks (default 192, less when memory is short)",
    )
    d.add_argument("--policy", choices=["lru", "arc"], default="arc")
    d.add_argument("--engine", default="auto", help="handler engine (auto, host, cuda, dma, kernel, staged)")
    d.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the KV cache lives (auto: the GPU when there is one)",
    )
    d.add_argument(
        "--prefill-tokens-per-s",
        dest="prefill_tokens_per_s",
        type=float,
        default=20_000.0,
        help="assumed prefill rate of an 8B model, for the time-saved estimate (default 20000, "
        "an H100-class GPU)",
    )
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="also sweep page sizes and plot GB/s per page size and direction (needs matplotlib)",
    )
    d.add_argument(
        "--sweep-mib",
        dest="sweep_mib",
        type=int,
        default=None,
        help="MiB per job in the page-size sweep (default 16 on the host, 256 on a GPU)",
    )
    d.add_argument(
        "--metrics-port",
        dest="metrics_port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics while the demo runs "
        "(needs prometheus_client: pip install 'kvoff[prometheus]')",
    )
    d.add_argument("--prometheus", action="store_true", help="print the Prometheus metrics at the end")
    d.add_argument("--json", action="store_true", help="print the results as JSON")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
