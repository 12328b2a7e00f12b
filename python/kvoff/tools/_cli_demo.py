"""``kvoff demo``'s options and handler (:mod:`kvoff.tools.cli` registers them; the demo itself is
:mod:`kvoff.tools.demo`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvoff import _native
from kvoff.tools._cli_args import (
    BLOCKS_PER_REQUEST,
    DEMO_REQUESTS,
    JOB_MIB,
    POOL_BLOCKS,
    PORT,
    PREFILL_RATE,
    SEED,
    UsageError,
    check_memory,
    has_torch,
)

# ---------------------------------------------------------------------------------------------
# kvoff demo
# ---------------------------------------------------------------------------------------------

TORCH_HINT = "pip install torch (or, in a kvoff checkout: pip install '.[torch]')"
PROMETHEUS_HINT = "pip install prometheus_client (or, in a kvoff checkout: pip install '.[prometheus]')"


def add_demo_args(d: argparse.ArgumentParser) -> None:
    d.add_argument(
        "--requests", type=DEMO_REQUESTS, default=160, metavar="N", help="requests (1-100000, default 160)"
    )
    d.add_argument(
        "--blocks-per-request",
        dest="blocks_per_request",
        type=BLOCKS_PER_REQUEST,
        default=24,
        metavar="N",
        help="16-token blocks of 2 MiB per request (1-1024, default 24 = 384 tokens)",
    )
    d.add_argument(
        "--gpu-blocks",
        dest="gpu_blocks",
        type=POOL_BLOCKS,
        default=None,
        metavar="N",
        help="GPU KV pool in blocks of 2 MiB (at least --blocks-per-request, and what memory allows; "
        "default 64, less when memory is short)",
    )
    d.add_argument(
        "--cpu-blocks",
        dest="cpu_blocks",
        type=POOL_BLOCKS,
        default=None,
        metavar="N",
        help="host offload capacity in blocks of 2 MiB (1 and what memory allows; default 192, less "
        "when memory is short)",
    )
    d.add_argument("--policy", choices=_native.POLICIES, default="arc")
    d.add_argument(
        "--engine",
        default="auto",
        choices=_native.ENGINES,
        help="handler engine (default auto)",
    )
    d.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the KV cache lives (auto: the GPU when there is one)",
    )
    d.add_argument(
        "--prefill-tokens-per-s",
        dest="prefill_tokens_per_s",
        type=PREFILL_RATE,
        default=20_000.0,
        metavar="RATE",
        help="assumed prefill rate of an 8B model, for the time-saved estimate (above 0 to 1e9; "
        "default 20000, an H100-class GPU)",
    )
    d.add_argument("--seed", type=SEED, default=0, help="random seed (0 to 2^63-1, default 0)")
    d.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="also sweep page sizes and plot GB/s per page size and direction (needs matplotlib)",
    )
    d.add_argument(
        "--sweep-mib",
        dest="sweep_mib",
        type=JOB_MIB,
        default=None,
        metavar="MIB",
        help="MiB per job in the page-size sweep (1-16384 and what memory allows; default 16 on the "
        "host, 256 on a GPU)",
    )
    d.add_argument(
        "--metrics-port",
        dest="metrics_port",
        type=PORT,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics while the demo runs (0-65535, "
        f"0: a free port; needs prometheus_client: {PROMETHEUS_HINT})",
    )
    d.add_argument("--prometheus", action="store_true", help="print the Prometheus metrics at the end")
    d.add_argument("--json", action="store_true", help="print the results as JSON")
    d.add_argument("--quiet", action="store_true", help="no progress bar")


def _check_demo_args(args: argparse.Namespace) -> None:
    from kvoff.tools.demo import BLOCK_BYTES

    bpr = args.blocks_per_request
    if args.gpu_blocks is not None and args.gpu_blocks < bpr:
        raise UsageError(
            f"argument --gpu-blocks: {args.gpu_blocks} is below --blocks-per-request ({bpr}): the "
            "pool must hold one request"
        )
    # The "GPU" pool and the host copy (in host memory without a GPU), the expected patterns of a
    # request's blocks, and the sweep's two buffers of a job each.
    blocks = (args.gpu_blocks or 0) + (args.cpu_blocks or 0) + 3 * bpr
    for opt, v in (("--gpu-blocks", args.gpu_blocks), ("--cpu-blocks", args.cpu_blocks)):
        if v is not None:
            check_memory(opt, v, blocks * BLOCK_BYTES, " blocks of 2 MiB")
    if args.gpu_blocks is None and args.cpu_blocks is None:
        check_memory("--blocks-per-request", bpr, 3 * bpr * BLOCK_BYTES, " blocks of 2 MiB")
    if args.sweep_mib is not None:
        check_memory("--sweep-mib", args.sweep_mib, 4 * args.sweep_mib << 20, " MiB")


def demo_main(args: argparse.Namespace) -> int:
    _check_demo_args(args)
    if not has_torch():
        print(f"kvoff demo needs torch: {TORCH_HINT}", file=sys.stderr)
        return 2
    from kvoff.metrics import TransferMetrics, serve_metrics
    from kvoff.tools.demo import DemoConfig, plot_sweep, run_demo, sweep_page_sizes

    if not _demo_extras_present(args):
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
        except ImportError:  # prometheus_client missing: say what to install
            print(f"kvoff demo: --metrics-port needs prometheus_client: {PROMETHEUS_HINT}", file=sys.stderr)
            return 2
        except OSError as e:
            raise UsageError(f"argument --metrics-port: cannot serve on port {args.metrics_port}: {e}") from e
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
    _print_demo(args, result, sweep, prom)
    return 0 if result.verified else 1


def _demo_extras_present(args: argparse.Namespace) -> bool:
    """Whether the optional packages that ``--plot`` and ``--prometheus`` need are installed (if
    not, says which on stderr)."""
    from kvoff.tools._toolbase import require_matplotlib

    if args.plot:
        try:
            require_matplotlib()
        except ImportError as e:
            print(f"kvoff demo: {e}", file=sys.stderr)
            return False
    if args.prometheus:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            print(f"kvoff demo: --prometheus needs prometheus_client: {PROMETHEUS_HINT}", file=sys.stderr)
            return False
    return True


def _print_demo(args: argparse.Namespace, result: Any, sweep: Any, prom: str | None) -> None:
    """Prints the demo's result (JSON with ``--json``), the sweep and the Prometheus text."""
    from kvoff.tools.demo import format_result, format_sweep

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
