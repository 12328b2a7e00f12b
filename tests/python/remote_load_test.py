"""Load test of the remote tier (issue 26 §7, docs/tier.md "Scaling out"): N engine processes, each
with its own host memory and no shared disk, against one Redis Cluster (by default 3 masters
started here on loopback by tests/python/redis_servers.py).

Every engine process runs a kvoff ``TieredOffloadingManager`` with the remote tier behind a small
host memory and serves a stream of requests over a shared pool of prefixes (a Zipf-like
popularity, so that engines reuse what others computed):

- for each request it looks its blocks up (``True`` ready, ``None`` pending while kvoff fetches
  them from the server: it asks again, as a scheduler does at its next step, ``False`` absent);
- the leading ready blocks are "loaded": read from the host rows and compared byte for byte with
  what the prefix's block must contain (content derived from the block's identity only, the same
  in every engine): **a block that differs was served wrong** and is counted;
- the rest is "computed" (the expected content written into host blocks) and stored, which
  writes it out to the server for the other engines.

It reports, over all engines: blocks asked for, host hits, remote promotions, blocks computed, the
hit rate (blocks served without recompute / blocks asked for), remote bytes read and written and
their aggregate GB/s over the wall-clock time, the scheduler thread's ``lookup`` p50/p99 and
the number of blocks served wrong (must be 0: the exit status is 1 otherwise).

    python tests/python/remote_load_test.py                     # 8 engines vs a 3-master Cluster
    python tests/python/remote_load_test.py --url redis://h:7000 --cluster --engines 8
    python tests/python/remote_load_test.py --backend disk      # the file tier on a shared
                                                                # directory (checks this script)

Exit status 77 (skipped) where this build of kvoff has no remote tier.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SKIP = 77


# -- one engine process ------------------------------------------------------------------------


def has_remote_tier() -> bool:
    """Whether this build's ``TieredOffloadingManager`` takes ``remote_url``."""
    from kvoff.tier import TieredOffloadingManager

    return "remote_url" in inspect.signature(TieredOffloadingManager).parameters


def make_manager(args: argparse.Namespace, region: Any, engine: int) -> Any:
    """The manager under test: host memory (``region``) with the remote tier behind it (or, with
    ``--backend disk``, the file tier on a directory shared by the engines)."""
    from kvoff.tier import TieredOffloadingManager

    common: dict[str, Any] = {"namespace": args.namespace, "block_size": 16}
    if args.backend == "disk":
        return TieredOffloadingManager(
            "lru",
            args.host_blocks,
            region,
            args.disk,
            1 << 40,
            rescan_interval_s=0.02,  # several rescans even in a short run (each engine sees the others)
            owner=f"engine{engine}",
            **common,
        )
    kw: dict[str, Any] = dict(common, remote_url=args.url)
    params = inspect.signature(TieredOffloadingManager).parameters
    if args.cluster and "remote_cluster" in params:
        kw["remote_cluster"] = True
    if "disk_path" in params and params["disk_path"].default is inspect.Parameter.empty:
        return TieredOffloadingManager("lru", args.host_blocks, region, None, 0, **kw)
    return TieredOffloadingManager("lru", args.host_blocks, region, **kw)


def _key(p: int, j: int) -> bytes:
    import kvoff

    return kvoff.make_offload_key(f"load-p{p}-b{j}".encode(), 0)


def _content(p: int, j: int, block: int) -> Any:
    """What block j of prefix p holds, in every engine: from its identity only. A cheap,
    position-dependent pattern (a random 4 KiB tile xor the block's number)."""
    import numpy as np

    tile = np.random.default_rng(p * 100_003 + j).integers(0, 256, 4096, dtype=np.uint8)
    out = np.resize(tile, block)
    out[:8] = np.frombuffer(((p << 20) | j).to_bytes(8, "little"), dtype=np.uint8)
    return out


def _lookup(m: Any, k: bytes, timeout_s: float, lookup_ns: list[int]) -> tuple[bool | None, bool]:
    """``m.lookup(k)`` repeated while pending (up to ``timeout_s``), each call's time appended to
    ``lookup_ns``; returns (the last answer, whether it waited)."""
    deadline = time.monotonic() + timeout_s
    waited = False
    while True:
        t = time.perf_counter_ns()
        r = m.lookup(k)
        lookup_ns.append(time.perf_counter_ns() - t)
        if r is not None or time.monotonic() > deadline:
            return r, waited
        waited = True
        time.sleep(0.001)  # the scheduler's next step


def _ready_prefix(
    m: Any,
    args: argparse.Namespace,
    p: int,
    keys: list[bytes],
    counts: dict[str, int],
    mine: set[tuple[int, int]],
    lookup_ns: list[int],
) -> int:
    """How many leading blocks of prefix ``p`` the tier serves (waiting for pending ones)."""
    ready = 0
    for k in keys:
        r, waited = _lookup(m, k, args.pending_timeout_s, lookup_ns)
        if r is None:
            counts["pending_timeouts"] += 1
        if r is not True:
            break
        if waited and (p, ready) not in mine:
            counts["fetched_from_others"] += 1
        ready += 1
        counts["after_pending" if waited else "ready_at_once"] += 1
    return ready


def _serve(
    m: Any, view: Any, args: argparse.Namespace, p: int, keys: list[bytes], ready: int, counts: dict[str, int]
) -> None:
    """Loads (and checks) the ``ready`` leading blocks, computes and stores the rest."""
    import numpy as np

    block = args.block_kib * 1024
    if ready:
        spec = m.prepare_load(keys[:ready])
        for j, b in enumerate(spec.block_ids):
            if not np.array_equal(view[int(b)], _content(p, j, block)):
                counts["wrong"] += 1
        m.complete_load(keys[:ready])
    rest = keys[ready:]
    if not rest:
        return
    out = m.prepare_store(rest)
    if out is None:
        counts["store_skipped"] += len(rest)
    else:
        idx = {k: i for i, k in enumerate(keys)}
        for k, b in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            view[int(b)] = _content(p, idx[k], block)
            if args.engine == args.wrong_engine:  # the script's self-check (see --wrong-engine)
                view[int(b)][100] ^= 0xFF
        m.complete_store(out.keys_to_store)
    counts["computed"] += len(rest)


def engine_main(args: argparse.Namespace) -> int:
    import kvoff
    import numpy as np

    if args.backend == "remote" and not has_remote_tier():
        print("kvoff has no remote tier in this build", file=sys.stderr)
        return SKIP
    block = args.block_kib * 1024
    region = kvoff.HostRegion.private(args.host_blocks, block)
    m = make_manager(args, region, args.engine)
    view = region.view_numpy(0, 0, block)
    rng = np.random.default_rng(1000 + args.engine)
    # Zipf-like popularity over the prefixes, the same for every engine.
    weights = 1.0 / np.arange(1, args.prefixes + 1) ** args.zipf
    weights /= weights.sum()

    counts = {"asked": 0, "ready_at_once": 0, "after_pending": 0, "computed": 0, "wrong": 0}
    counts.update({"store_skipped": 0, "pending_timeouts": 0, "fetched_from_others": 0})
    mine: set[tuple[int, int]] = set()  # blocks this engine computed itself
    lookup_ns: list[int] = []
    # Start together (the parent passes a wall-clock start time).
    delay = args.start_at - time.time()
    if delay > 0:
        time.sleep(delay)
    t0 = time.perf_counter()
    for _ in range(args.requests):
        p = int(rng.choice(args.prefixes, p=weights))
        n = args.blocks_per_prefix
        keys = [_key(p, j) for j in range(n)]
        ready = _ready_prefix(m, args, p, keys, counts, mine, lookup_ns)
        counts["asked"] += n
        _serve(m, view, args, p, keys, ready, counts)
        if keys[ready:]:
            mine.update((p, j) for j in range(ready, n))
    wall = time.perf_counter() - t0
    if hasattr(m, "flush"):
        m.flush()
    stats = {k: v for k, v in m.get_stats().items() if isinstance(v, (int, float))}
    m.shutdown()
    region.close()
    lk = sorted(lookup_ns) or [0]
    res = {
        "engine": args.engine,
        "wall_s": wall,
        "counts": counts,
        "lookup_p50_us": lk[len(lk) // 2] / 1e3,
        "lookup_p99_us": lk[min(len(lk) - 1, int(len(lk) * 0.99))] / 1e3,
        "stats": stats,
    }
    print("KVOFF_LOAD_RESULT " + json.dumps(res), flush=True)
    return 0


# -- the parent: servers, engines, totals ------------------------------------------------------


def _tier_bytes(stats: dict[str, float], direction: str, backend: str) -> float:
    pre = "disk" if backend == "disk" else "remote"
    names = [f"{pre}_bytes_{direction}"]
    return float(sum(stats.get(n, 0) for n in names))


def _remote_tier_missing(args: argparse.Namespace) -> bool:
    """For the remote backend: whether kvoff or its remote tier is missing (says so on stderr)."""
    if args.backend != "remote":
        return False
    try:
        import kvoff  # noqa: F401
    except ImportError:
        print("kvoff is not installed", file=sys.stderr)
        return True
    if not has_remote_tier():
        print("skipped: this build of kvoff has no remote tier (no remote_url)", file=sys.stderr)
        return True
    return False


def _engine_cmd(args: argparse.Namespace, e: int, start_at: float) -> list[str]:
    """The command line of engine process ``e``."""
    cmd = [sys.executable, __file__, "--engine-worker", str(e), "--start-at", repr(start_at)]
    cmd += ["--backend", args.backend, "--namespace", args.namespace]
    cmd += ["--requests", str(args.requests), "--prefixes", str(args.prefixes)]
    cmd += ["--blocks-per-prefix", str(args.blocks_per_prefix), "--block-kib", str(args.block_kib)]
    cmd += ["--host-blocks", str(args.host_blocks), "--zipf", str(args.zipf)]
    cmd += [
        "--pending-timeout-s",
        str(args.pending_timeout_s),
        "--wrong-engine",
        str(args.wrong_engine),
    ]
    if args.backend == "disk":
        cmd += ["--disk", args.disk]
    else:
        cmd += ["--url", args.url] + (["--cluster"] if args.cluster else [])
    return cmd


def _collect(procs: list[Any], timeout_s: float) -> tuple[list[dict[str, Any]], list[str]] | None:
    """The engines' results and failures; ``None`` when one was skipped (says why on stderr)."""
    results, failures = [], []
    for e, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            failures.append(f"engine {e} timed out; stderr: {err[-2000:]}")
            continue
        line = next((ln for ln in out.splitlines() if ln.startswith("KVOFF_LOAD_RESULT ")), None)
        if p.returncode == SKIP:
            print(f"skipped: {err.strip()}", file=sys.stderr)
            return None
        if p.returncode != 0 or line is None:
            failures.append(f"engine {e} failed (rc {p.returncode}): {err[-3000:]}")
            continue
        results.append(json.loads(line.split(" ", 1)[1]))
    return results, failures


def _summary(
    args: argparse.Namespace, results: list[dict[str, Any]], failures: list[str], cluster: Any, wall: float
) -> dict[str, Any]:
    """The totals over all engines."""
    tot: dict[str, float] = {}
    for r in results:
        for k, v in r["counts"].items():
            tot[k] = tot.get(k, 0) + v
    stats_sum: dict[str, float] = {}
    for r in results:
        for k, v in r["stats"].items():
            if k.startswith(("remote_", "disk_")):
                stats_sum[k] = stats_sum.get(k, 0) + v
    read = sum(_tier_bytes(r["stats"], "read", args.backend) for r in results)
    written = sum(_tier_bytes(r["stats"], "written", args.backend) for r in results)
    served = tot.get("ready_at_once", 0) + tot.get("after_pending", 0)
    return {
        "engines": args.engines,
        "engines_ok": len(results),
        "backend": args.backend,
        "cluster_masters": args.masters if cluster is not None else None,
        "block_bytes": args.block_kib * 1024,
        "wall_s": round(wall, 2),
        "blocks_asked": tot.get("asked", 0),
        "hit_rate": served / tot["asked"] if tot.get("asked") else 0.0,
        "served_after_fetch": tot.get("after_pending", 0),
        "fetched_from_others": tot.get("fetched_from_others", 0),
        "computed": tot.get("computed", 0),
        "wrong": tot.get("wrong", 0),
        "pending_timeouts": tot.get("pending_timeouts", 0),
        "tier_read_gb_s": read / wall / 1e9 if wall else 0.0,
        "tier_written_gb_s": written / wall / 1e9 if wall else 0.0,
        "tier_read_bytes": read,
        "tier_written_bytes": written,
        "lookup_p99_us_max": max((r["lookup_p99_us"] for r in results), default=0.0),
        "lookup_p50_us_median": sorted(r["lookup_p50_us"] for r in results)[len(results) // 2]
        if results
        else 0.0,
        "tier_stats": stats_sum,
        "failures": failures,
    }


def run(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(HERE))
    import redis_servers as rs

    if _remote_tier_missing(args):
        return SKIP
    cluster = None
    tmp = None
    try:
        if args.backend == "disk":
            tmp = tempfile.TemporaryDirectory(prefix="kvoff-load-disk-")
            args.disk = tmp.name
        elif args.url is None:
            reason = rs.missing_reason()
            if reason:
                print(f"skipped: {reason}", file=sys.stderr)
                return SKIP
            cluster = rs.RedisCluster(masters=args.masters, replicas=0).start()
            args.url, args.cluster = cluster.url, True
            print(
                f"3-master Cluster on {[n.port for n in cluster.nodes]} ({rs.server_version()})",
                file=sys.stderr,
            )
        start_at = time.time() + 2.0 + 0.3 * args.engines
        procs = []
        for e in range(args.engines):
            cmd = _engine_cmd(args, e, start_at)
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        t0 = time.time()
        collected = _collect(procs, args.timeout_s)
        if collected is None:
            return SKIP
        results, failures = collected
        wall = max((r["wall_s"] for r in results), default=time.time() - t0)
        summary = _summary(args, results, failures, cluster, wall)
        if cluster is not None:
            summary["keys_per_master"] = [m.dbsize() for m in cluster.masters()]
        print(json.dumps(summary, indent=1))
        return 0 if not failures and summary["wrong"] == 0 and results else 1
    finally:
        if cluster is not None:
            cluster.close()
        if tmp is not None:
            tmp.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--url", default=None, help="a server / Cluster node (default: start a Cluster here)")
    ap.add_argument("--cluster", action="store_true", help="--url is a Cluster node")
    ap.add_argument("--masters", type=int, default=3, help="masters of the Cluster started here")
    ap.add_argument("--backend", choices=["remote", "disk"], default="remote")
    ap.add_argument("--namespace", default=f"load-{os.getpid()}")
    ap.add_argument("--requests", type=int, default=200, help="requests per engine")
    ap.add_argument("--prefixes", type=int, default=64, help="shared prefixes in the pool")
    ap.add_argument("--blocks-per-prefix", dest="blocks_per_prefix", type=int, default=8)
    ap.add_argument("--block-kib", dest="block_kib", type=int, default=256, help="block (value) size in KiB")
    ap.add_argument("--host-blocks", dest="host_blocks", type=int, default=64, help="host blocks per engine")
    ap.add_argument("--zipf", type=float, default=1.0, help="popularity exponent of the prefixes")
    ap.add_argument("--pending-timeout-s", dest="pending_timeout_s", type=float, default=5.0)
    ap.add_argument("--timeout-s", dest="timeout_s", type=float, default=600.0)
    ap.add_argument(
        "--wrong-engine",
        dest="wrong_engine",
        type=int,
        default=-1,
        help="self-check of this script: that engine stores blocks with a wrong byte, which the "
        "others must detect when served them (the run then fails)",
    )
    ap.add_argument("--engine-worker", dest="engine", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--start-at", dest="start_at", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--disk", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine is not None:
        return engine_main(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
