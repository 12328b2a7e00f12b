"""The ``kvoff`` command line: ``kvoff bench [managers|transfers]`` (no subcommand: all of them)."""

from __future__ import annotations

import argparse
import json
import sys


def _bench_managers(args: argparse.Namespace) -> int:
    from kvoff.bench import bench_managers, format_manager_rows

    sys.stdout.flush()
    rows = bench_managers(args.requests, args.capacity, args.reps, show_progress=not args.quiet)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        sys.stderr.flush()
        print(format_manager_rows(rows))
    return 0


def _bench_transfers(args: argparse.Namespace) -> int:
    from kvoff.bench import bench_transfers, format_transfer_rows

    sys.stdout.flush()
    methods = args.methods.split(",") if args.methods else None
    rows = bench_transfers(args.job_mib, args.transfer_reps, methods, show_progress=not args.quiet)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        sys.stderr.flush()
        print(format_transfer_rows(rows))
    return 0


def _bench_all(args: argparse.Namespace) -> int:
    """``kvoff bench`` with no subcommand: every benchmark that this machine can run."""
    rc = _bench_managers(args)
    print()
    try:
        import torch  # noqa: F401
    except ImportError:
        print("transfers: skipped (needs torch)")
        return rc
    return rc or _bench_transfers(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvoff", description="kvoff: KV-cache offloading tools")
    sub = parser.add_subparsers(dest="cmd", required=True)
    bench = sub.add_parser("bench", help="run benchmarks")
    bsub = bench.add_subparsers(dest="what")
    bench.set_defaults(func=_bench_all, requests=2000, capacity=20_000, reps=5, json=False, quiet=False,
                       job_mib=None, transfer_reps=5, methods=None)
    m = bsub.add_parser("managers", help="manager workload of PERF.md, both policies, vs a Python reference")
    m.add_argument("--requests", type=int, default=2000)
    m.add_argument("--capacity", type=int, default=20_000)
    m.add_argument("--reps", type=int, default=5, help="repetitions (median reported)")
    m.add_argument("--json", action="store_true", help="print rows as JSON")
    m.add_argument("--quiet", action="store_true", help="no progress bar")
    m.set_defaults(func=_bench_managers)
    t = bsub.add_parser("transfers", help="scattered KV-block transfers (PERF.md scenarios) vs a contiguous copy")
    t.add_argument("--job-mib", dest="job_mib", type=int, default=None,
                   help="bytes per job in MiB (default: 512 on a GPU, scaled to memory on the host)")
    t.add_argument("--reps", dest="transfer_reps", type=int, default=5, help="repetitions (median reported)")
    t.add_argument("--methods", default=None, help="comma-separated engines (default: auto,dma,kernel,staged "
                   "on a GPU, host otherwise)")
    t.add_argument("--json", action="store_true", help="print rows as JSON")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=_bench_transfers)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
