"""``kvoff bench remote``: the remote tier (docs/tier.md, Redis / Valkey) against same-run references
on the same server (docs/performance.md: every figure is a ratio against a reference measured in the
same run).

References, per value size (one KV block = one value):

- ``redis-benchmark`` SET and GET of values of that size, over a grid of pipeline depths (``-P``)
  and client counts (``-c``); the best GB/s per operation is the server's own ceiling on this
  machine (:func:`redis_benchmark_best`). Twice: on its one default key (every SET replaces the
  same value, which stays in the CPU's caches), and with ``-r`` over as many keys as kvoff's rows
  store (``keyspace``: each SET and GET touches another value, as kvoff's and redis-py's do; the
  keys are written once before, so that GETs find them). The best shapes of both grids then run
  again, SET and GET, before each of kvoff's repetitions (:class:`_Alternated`): their medians
  are references measured beside kvoff's median, where a grid's best is the luckiest of nine
  single runs;
- redis-py, pipelined SET then GET of the same blocks, what a Python connector does
  (:func:`redis_py_pipelined`);
- a native client, what a C++ connector (LMCache's ``resp://``) does: one ``SET`` or ``GET`` per
  key, one request in flight per connection, from 1, 4, 8 and 16 threads, values straight from and
  into host memory with no header (:func:`native_best`, in Rust); its best thread count per
  operation runs again before each of kvoff's repetitions. Issue 47's target: kvoff's 2 MiB store
  and load at least 1.0x its median, 32 KiB at least 0.95x (kvoff's 1096-byte header is 3% of a
  32 KiB value). Standalone ``redis://`` servers only (a Cluster or TLS: not measured, said so).

kvoff's own rows come from :func:`kvoff_rows` (the remote tier's store and load GB/s, lookup-to-
promoted latency and the scheduler thread's lookup time with the server up, slow and down); where
this build of kvoff has no remote tier, the benchmark reports the references alone and says so.

With its private server the benchmark also reads the CPU time of the server's event loop (its main
thread, where a Redis or Valkey without I/O threads parses, executes and answers every command;
:meth:`ServerControl.cpu_s`) around kvoff's store and load and around each run of the best shapes
again: the server's CPU seconds per GB of values for each, and the share of kvoff's time the server
was busy. A client at the server's ceiling keeps it busy nearly all the time; one that costs the
server less per GB than redis-benchmark does moves more bytes for the same CPU. The client's side is
read in every run: this process's CPU seconds per GB of kvoff's store and load (the scheduler's
calls and the tier's I/O threads; the I/O threads' alone by their names) and of the native
client's runs again. Where the server and the clients share few CPUs, the sum of both decides.

Without ``url`` the benchmark starts a private ``redis-server`` on loopback (a random port, no
persistence) and stops it at the end; it needs Debian's ``redis-server`` and ``redis-tools``
(``redis-benchmark``) or their Valkey equivalents on ``PATH``. Blocks are written under keys
``kvoff-bench-ref:*`` (redis-py) and redis-benchmark's ``key:__rand_int__``, and deleted at the end.

The server and the references live in :mod:`kvoff.tools.bench_remote_refs`; kvoff's own rows,
the whole run and its table here.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvoff.tools.bench_remote_refs import (
    DEFAULT_RUN_BYTES,
    DEFAULT_SIZES,
    NATIVE_THREADS,
    KiB,
    MiB,
    RedisTarget,
    ServerControl,
    _Alternated,
    _delete_benchmark_keys,
    _free_port,
    _NativeAlternated,
    default_blocks,
    local_redis,
    native_best,
    redis_benchmark_best,
    redis_py_pipelined,
    server_version,
)

__all__ = [
    "DEFAULT_SIZES",
    "RedisTarget",
    "ServerControl",
    "bench_remote",
    "default_blocks",
    "format_remote",
    "kvoff_rows",
    "local_redis",
    "native_best",
    "redis_benchmark_best",
    "redis_py_pipelined",
]


def kvoff_rows(
    url: str,
    value_bytes: int,
    n_blocks: int,
    *,
    reps: int = 3,
    cluster: bool = False,
    control: ServerControl | None = None,
    io_threads: int | None = None,
    before_rep: Callable[[], None] | None = None,
) -> dict[str, Any] | None:
    """kvoff's remote tier over ``n_blocks`` blocks of ``value_bytes`` on the server at ``url``:

    ``{"set_gb_s", "get_gb_s"`` (store: host blocks to values; load: values promoted into host
    blocks, median of ``reps``), ``"promote_p50_us", "promote_p99_us"`` (lookup to promoted),
    ``"lookup_p99_us_up", "lookup_p99_us_slow", "lookup_p99_us_down"`` (the scheduler thread's
    ``lookup_prefix`` of 16 keys, as fast as Python calls it, while the server answers, is stopped
    via ``control`` — ``None`` where ``control`` is ``None`` — and is gone),
    ``"lookup_p99_us_up_paced"`` (the same with the server up, each call, the reference's too,
    after a pause of ``STEP_S`` as a scheduler's steps are), ``"lookup_ref_p99_us_*"`` the
    reference of each: a call over 16 keys ready in the host memory of an engine whose tier has no
    work, in the same loop), ``"lookup_p99_us_load"`` (a request's
    ``lookup_prefix`` while the load phase promotes), ``"verified"`` (every promoted block
    byte-equal to what was stored), ``"server_store", "server_load"`` (``{"busy",
    "cpu_s_per_gb"}``: the share of the store's or load's time the server's event loop ran, and
    its CPU seconds per GB of values, medians of the repetitions; ``None`` each without
    ``control``)}.

    ``io_threads``: the tier's ``remote_io_threads`` (``None``: its default). ``before_rep``:
    called before each repetition (the references run beside kvoff's repetitions).

    ``None`` where this build of kvoff has no remote tier (the benchmark then reports the
    references alone).
    """
    native = importlib.import_module("kvoff._native")
    impl = getattr(native, "bench_remote", None)
    if impl is not None:
        return dict(
            impl(
                url, value_bytes, n_blocks, reps=reps, cluster=cluster, control=control, io_threads=io_threads
            )
        )
    if getattr(native, "ChainManagerCore", None) is None:
        return None
    return _tier_rows(
        url,
        value_bytes,
        n_blocks,
        reps=reps,
        cluster=cluster,
        control=control,
        io_threads=io_threads,
        before_rep=before_rep,
    )


def _p(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


#: The remote tier's I/O threads' name prefix (``src/tier/remote/mod.rs``).
IO_THREAD_PREFIX = "kvoff-remote-"


def io_threads_cpu_s(prefix: str = IO_THREAD_PREFIX) -> float | None:
    """CPU seconds of this process's live threads whose name starts with ``prefix``, from
    ``/proc/self/task``: each thread's run time in ns (``schedstat``), else its user and system
    ticks (``stat``, 10 ms steps); ``None`` where there is no such file system."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm", "rb") as f:
                if not f.read().decode(errors="replace").startswith(prefix):
                    continue
            try:
                with open(f"/proc/self/task/{t}/schedstat", "rb") as f:
                    total += int(f.read().split()[0]) / 1e9
                continue
            except (OSError, ValueError, IndexError):
                pass
            with open(f"/proc/self/task/{t}/stat", "rb") as f:
                # "tid (comm) state ...": comm may hold spaces and parentheses.
                fields = f.read().rpartition(b")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except OSError:
            continue  # ended meanwhile
    return total


class _Cpu:
    """CPU seconds around one timed phase: the server's (``server_cpu``), this process's (every
    thread: the scheduler's calls and the tier's I/O threads, or the native reference's threads)
    and the remote tier's I/O threads' alone."""

    def __init__(self, server_cpu: Callable[[], float | None] | None) -> None:
        self.server_cpu = server_cpu
        self.s0 = server_cpu() if server_cpu is not None else None
        self.p0 = time.process_time()
        self.io0 = io_threads_cpu_s()

    def spent(self, dt: float) -> dict[str, float | None]:
        """``{"server", "dt", "process", "io"}`` since construction (``None`` where unknown)."""
        s1 = self.server_cpu() if self.server_cpu is not None else None
        io1 = io_threads_cpu_s()
        return {
            "server": None if s1 is None or self.s0 is None else s1 - self.s0,
            "dt": dt,
            "process": time.process_time() - self.p0,
            "io": None if io1 is None or self.io0 is None else io1 - self.io0,
        }


def _store_remote(
    a: Any,
    ra: Any,
    keys: list[bytes],
    block: int,
    base: Any,
    server_cpu: Callable[[], float | None] | None = None,
    spent: list[dict[str, float | None]] | None = None,
) -> float:
    """Stores ``keys`` (``base`` with the block's index in its first 8 bytes) through manager ``a``
    (host memory ``ra``) until the server acknowledged all of them; returns GB/s of block bytes.
    Appends to ``spent`` the CPU seconds over the timed store (:meth:`_Cpu.spent`: the server's
    where ``server_cpu``, :meth:`ServerControl.cpu_s`, reads it) and its duration."""
    import numpy as np

    n = len(keys)
    out = a.prepare_store(keys)
    assert out is not None
    view = ra.view_numpy(0, 0, block)
    for i, blk in enumerate(out.store_spec.block_ids):
        view[int(blk)] = base
        view[int(blk), :8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    before = a.get_stats()["remote_writes"]
    cpu = _Cpu(server_cpu)
    t0 = time.perf_counter()
    a.complete_store(out.keys_to_store)
    a.flush()  # waits until the server acknowledged every queued write
    dt = time.perf_counter() - t0
    if spent is not None:
        spent.append(cpu.spent(dt))
    st = a.get_stats()
    if st["remote_writes"] - before != n:
        raise RuntimeError(
            f"only {st['remote_writes'] - before} of {n} values written: {st['remote_last_error']}"
        )
    return n * block / dt / 1e9


#: Blocks per request in the load phase (4096 tokens at 16 tokens per block).
REQUEST_BLOCKS = 256
#: Pause between two scheduler steps of the load phase (a GPU decode step takes several ms, so a
#: real scheduler asks less often; a busy loop would take a CPU from the server and the tier).
STEP_S = 0.0002


def _load_remote(
    b: Any,
    rb: Any,
    keys: list[bytes],
    block: int,
    base: Any,
    lookups: list[float],
    server_cpu: Callable[[], float | None] | None = None,
    spent: list[dict[str, float | None]] | None = None,
) -> tuple[float, bool]:
    """Promotes ``keys`` into manager ``b`` (host memory ``rb``) the way a scheduler does: the keys
    are requests of ``REQUEST_BLOCKS`` blocks, and every step (``STEP_S`` apart) calls
    ``lookup_prefix`` for each request not yet fully in host memory (each call's time appended to
    ``lookups``); then compares every block. Returns (GB/s, all verified). ``server_cpu`` and
    ``spent`` as :func:`_store_remote`'s."""
    import numpy as np

    n = len(keys)
    waiting = [keys[i : i + REQUEST_BLOCKS] for i in range(0, n, REQUEST_BLOCKS)]
    cpu = _Cpu(server_cpu)
    t0 = time.perf_counter()
    while waiting:
        still = []
        for req in waiting:
            t = time.perf_counter()
            got = b.lookup_prefix(req)
            lookups.append(time.perf_counter() - t)
            if got != len(req):
                still.append(req)
        waiting = still
        if not waiting:
            break
        if time.perf_counter() - t0 > 120:
            raise RuntimeError(
                f"load stalled ({len(waiting)} requests left): {b.get_stats()['remote_last_error']}"
            )
        time.sleep(STEP_S)
    dt = time.perf_counter() - t0
    if spent is not None:
        spent.append(cpu.spent(dt))
    gbs = n * block / dt / 1e9
    spec = b.prepare_load(keys)
    vb = rb.view_numpy(0, 0, block)
    verified = True
    for i, blk in enumerate(spec.block_ids):
        row = vb[int(blk)]
        verified &= (
            bool(np.array_equal(row[8:], base[8:])) and int.from_bytes(row[:8].tobytes(), "little") == i
        )
    b.complete_load(keys)
    return gbs, verified


#: Blocks each repetition's engines store and promote, untimed, before the timed store and load:
#: their I/O threads' connections are then open, as a serving engine's are.
WARM_BLOCKS = 8


def _warm_up(a: Any, ra: Any, b: Any, keys: list[bytes], block: int, base: Any) -> None:
    """Stores ``keys`` through ``a`` (flushed) and promotes them into ``b``, untimed."""
    _store_remote(a, ra, keys, block, base)
    t0 = time.perf_counter()
    while b.lookup_prefix(keys) != len(keys):
        if time.perf_counter() - t0 > 30:
            raise RuntimeError(f"warm-up stalled: {b.get_stats()['remote_last_error']}")
        time.sleep(STEP_S)
    b.prepare_load(keys)
    b.complete_load(keys)


def _promote_times(c: Any, keys: list[bytes]) -> list[float]:
    """µs from a ``lookup_prefix`` of one key (on the server) to its promotion, for up to 64 keys."""
    n = len(keys)
    promote_us = []
    for i in range(0, n, max(1, n // 64)):
        k = [keys[i]]
        t0 = time.perf_counter()
        while c.lookup_prefix(k) != 1:
            pass
        promote_us.append((time.perf_counter() - t0) * 1e6)
    return promote_us


def _lookup_p99(
    engine: Any,
    host_engine: Any,
    key: Any,
    url_: str,
    control: ServerControl | None,
    *,
    secs: float = 2.0,
    pace_s: float = 0.0,
) -> tuple[float, float]:
    """p99 µs of ``lookup_prefix`` calls over unknown keys at ``url_`` for ``secs``, with the
    server paused (SIGSTOP) meanwhile when ``control`` is given; and, as the reference measured in
    the same loop (each call followed by one), p99 µs of ``lookup_prefix`` of 16 keys ready in the
    host memory of another engine (``host_engine()``: its tier at a port where nothing listens, so
    it has no fetch result to apply, where the first engine's call would apply the results of its
    fetches that arrived meanwhile) — what the machine, busy with the server and the I/O threads,
    does to any call of that shape.
    ``pace_s`` > 0: a pause of that long before each call, the reference's too, as between a
    scheduler's steps (the first call after a pause finds the CPU's caches cold, whatever it does);
    0: the calls as fast as Python makes them."""
    e, r = engine(f"probe-{time.time_ns()}", url_, remote_connect_timeout_s=0.5, remote_timeout_s=0.5)
    h, hr = host_engine()
    times: list[float] = []
    ref: list[float] = []
    try:
        ready = [key("ready", j) for j in range(16)]
        out = h.prepare_store(ready)
        assert out is not None
        h.complete_store(out.keys_to_store)
        if h.lookup_prefix(ready) != len(ready):
            raise RuntimeError("the reference's keys are not ready in host memory")
        if control is not None:
            control.pause()
        t_end = time.perf_counter() + secs
        i = 0
        while time.perf_counter() < t_end:
            ks = [key("unknown", i + j) for j in range(16)]
            i += 16
            if pace_s > 0:
                time.sleep(pace_s)
            t = time.perf_counter()
            e.lookup_prefix(ks)
            times.append(time.perf_counter() - t)
            if pace_s > 0:
                time.sleep(pace_s)
            t = time.perf_counter()
            h.lookup_prefix(ready)
            ref.append(time.perf_counter() - t)
    finally:
        if control is not None:
            control.resume()
        e.shutdown()
        h.shutdown()
        r.close()
        hr.close()
    return _p(times, 0.99) * 1e6, _p(ref, 0.99) * 1e6


def _tier_rows(
    url: str,
    value_bytes: int,
    n_blocks: int,
    *,
    reps: int,
    cluster: bool,
    control: ServerControl | None,
    io_threads: int | None = None,
    before_rep: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """:func:`kvoff_rows` through ``kvoff.tier.TieredOffloadingManager(remote_url=...)``, the way
    the vLLM plug-in uses it: each value is ``value_bytes`` (the header of
    :data:`kvoff.tier.REMOTE_HEADER_BYTES` + a block of the rest); GB/s count the block (payload)
    bytes. Each repetition's two engines first store and promote ``WARM_BLOCKS`` other blocks,
    untimed (their connections open, as a serving engine's are and as the references' are before
    their clocks start). Store: ``complete_store`` of
    ``n_blocks`` fresh blocks until the server acknowledged all of them. Load: a second engine with
    its own host memory looks the keys up as a scheduler does (:func:`_load_remote`: requests of
    ``REQUEST_BLOCKS`` keys, one ``lookup_prefix`` per waiting request per step) until all are
    promoted, every promoted block compared byte for byte. The scheduler-thread lookup times
    (``up``, ``slow``, ``down``) are of single ``lookup_prefix`` calls of 16 keys the tier does
    not know (each call starts a fetch): while the server answers (``up``), while it is stopped
    with SIGSTOP (``slow``: connections open, no answer; only with ``control``) and at a port
    where nothing listens (``down``); ``load`` is a request's call during the load phase."""
    import numpy as np

    import kvoff
    from kvoff.tier import REMOTE_HEADER_BYTES, TieredOffloadingManager

    block = value_bytes - REMOTE_HEADER_BYTES
    if block <= 0:
        raise ValueError(
            f"values of {value_bytes} B cannot hold the {REMOTE_HEADER_BYTES} B header and a block"
        )
    n = n_blocks
    base = np.random.default_rng(1).integers(0, 256, block, dtype=np.uint8)
    kw: dict[str, Any] = {
        "remote_cluster": cluster,
        "remote_max_queued_writes": n + WARM_BLOCKS,
        "remote_max_inflight_bytes": (n + WARM_BLOCKS) * value_bytes,
        "remote_timeout_s": 2.0,
    }
    if io_threads is not None:
        kw["remote_io_threads"] = io_threads

    def engine(ns: str, url_: str = url, **more: Any) -> tuple[TieredOffloadingManager, kvoff.HostRegion]:
        region = kvoff.HostRegion.private(n + WARM_BLOCKS, block)
        return TieredOffloadingManager(
            "lru", n + WARM_BLOCKS, region, remote_url=url_, namespace=ns, **{**kw, **more}
        ), region

    def key(ns: str, i: int) -> bytes:
        return kvoff.make_offload_key(f"{ns}-{i}".encode(), 0)

    set_gbs: list[float] = []
    get_gbs: list[float] = []
    lookups_load: list[float] = []
    # The server's CPU seconds and the duration of each store and load (with its private server).
    server_cpu = control.cpu_s if control is not None else None
    spent_store: list[dict[str, float | None]] = []
    spent_load: list[dict[str, float | None]] = []
    verified = True
    # One namespace for every repetition, its keys written once before them, untimed, as
    # redis-benchmark's keyspace is before its grid: every timed store replaces values the server
    # holds, as every redis-benchmark SET does, so the server's allocator works alike for both (a
    # first write of fresh keys cost the server 2-3 times its CPU per value on the H100 host:
    # BENCHMARKS.md "Remote tier").
    ns = f"bench-{os.getpid()}-{value_bytes}-{time.time_ns()}"
    keys = [key(ns, i) for i in range(n)]
    w, rw = engine(ns)
    try:
        _store_remote(w, rw, keys, block, base)
    finally:
        w.shutdown()
        rw.close()
    for _rep in range(reps):
        if before_rep is not None:
            before_rep()
        a, ra = engine(ns)
        b, rb = engine(ns)
        try:
            # Warm connections, as a serving engine's are (the references open theirs before
            # their clocks start): a few other blocks stored, flushed and promoted, untimed.
            _warm_up(a, ra, b, [key(ns, n + i) for i in range(WARM_BLOCKS)], block, base)
            set_gbs.append(_store_remote(a, ra, keys, block, base, server_cpu, spent_store))
            gbs, ok = _load_remote(b, rb, keys, block, base, lookups_load, server_cpu, spent_load)
            get_gbs.append(gbs)
            verified &= ok
        finally:
            a.shutdown()
            b.shutdown()
            ra.close()
            rb.close()
    # Lookup to promoted, one key at a time (the keys of the last repetition are on the server).
    c, rc = engine(ns)
    try:
        promote_us = _promote_times(c, keys)
    finally:
        c.shutdown()
        rc.close()

    dead = f"redis://127.0.0.1:{_free_port()}"

    def host_engine() -> tuple[TieredOffloadingManager, kvoff.HostRegion]:
        # The reference's engine: its tier at a port where nothing listens, so its calls take the
        # same path with no fetch result ever to apply; its blocks stay in host memory.
        return engine(
            f"probe-ref-{time.time_ns()}",
            dead,
            remote_connect_timeout_s=0.5,
            remote_timeout_s=0.5,
            remote_store_threshold=1 << 30,
        )

    up = _lookup_p99(engine, host_engine, key, url, None)
    paced = _lookup_p99(engine, host_engine, key, url, None, secs=2.0, pace_s=STEP_S)
    slow = _lookup_p99(engine, host_engine, key, url, control) if control is not None else None
    down = _lookup_p99(engine, host_engine, key, dead, None)
    gb_values = n * value_bytes / 1e9

    def server(spent: list[dict[str, float | None]]) -> dict[str, float | None]:
        # Medians over the repetitions: the share of the time the server's event loop ran, and
        # its CPU seconds per GB of values (header included, as the references count them); this
        # process's CPU seconds per GB (the scheduler's calls and the I/O threads) and the I/O
        # threads' alone.
        def per_gb(what: str) -> float | None:
            xs = [float(c) / gb_values for sp in spent if (c := sp[what]) is not None]
            return statistics.median(xs) if xs else None

        busy = [c / dt for sp in spent if (c := sp["server"]) is not None and (dt := sp["dt"])]
        return {
            "busy": statistics.median(busy) if busy else None,
            "cpu_s_per_gb": per_gb("server"),
            "client_cpu_s_per_gb": per_gb("process"),
            "io_threads_cpu_s_per_gb": per_gb("io"),
        }

    return {
        "set_gb_s": statistics.median(set_gbs),
        "get_gb_s": statistics.median(get_gbs),
        "server_store": server(spent_store),
        "server_load": server(spent_load),
        "promote_p50_us": _p(promote_us, 0.5),
        "promote_p99_us": _p(promote_us, 0.99),
        "lookup_p99_us_load": _p(lookups_load, 0.99) * 1e6,
        "lookup_p99_us_up": up[0],
        "lookup_p99_us_up_paced": paced[0],
        "lookup_p99_us_slow": None if slow is None else slow[0],
        "lookup_p99_us_down": down[0],
        "lookup_ref_p99_us_up": up[1],
        "lookup_ref_p99_us_up_paced": paced[1],
        "lookup_ref_p99_us_slow": None if slow is None else slow[1],
        "lookup_ref_p99_us_down": down[1],
        "verified": verified,
        "payload_bytes": block,
    }


def _native_reference(
    url: str,
    size: int,
    n: int,
    row: dict[str, Any],
    *,
    cluster: bool,
    threads: Sequence[int],
    log: Callable[[str], None] | None,
    server_cpu: Callable[[], float | None] | None,
) -> _NativeAlternated | None:
    """The native client's grid into ``row["native"]`` (``None`` and ``row["native_note"]`` where
    it cannot be measured: a Cluster, a TLS URL, a build without it), and its runs again beside
    kvoff's repetitions (the caller closes it)."""
    from kvoff.errors import KvoffError

    row["native"] = None
    if cluster:
        row["native_note"] = "a Cluster: the native reference talks to one server"
        return None
    try:
        nb, ref = native_best(url, size, n, threads=threads, server_cpu=server_cpu)
    except AttributeError:
        row["native_note"] = "this build of kvoff has no native reference"
        return None
    except KvoffError as e:  # a TLS URL, or a server that refuses it: said, not fatal
        row["native_note"] = f"not measured: {e}"
        return None
    row["native"] = nb
    if log is not None:
        log(
            f"  native client: SET {nb['set']['gb_s']:.2f} ({nb['set']['threads']} threads)"
            f" GET {nb['get']['gb_s']:.2f} GB/s ({nb['get']['threads']} threads)"
        )
    return _NativeAlternated(ref, nb, size * n / 1e9, server_cpu)


def bench_remote(
    url: str | None = None,
    sizes: Sequence[int] = DEFAULT_SIZES,
    *,
    blocks: int | None = None,
    reps: int = 3,
    pipelines: Sequence[int] = (1, 4, 16),
    clients: Sequence[int] = (1, 4, 16),
    py_pipeline: int = 16,
    native_threads: Sequence[int] = NATIVE_THREADS,
    run_bytes: int = DEFAULT_RUN_BYTES,
    cluster: bool = False,
    io_threads: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every row of ``kvoff bench remote`` (see the module docs): per value size, redis-benchmark's
    best, redis-py pipelined, and kvoff's rows where this build has a remote tier, with kvoff's
    ratios to the references. ``url=None``: a private server (:func:`local_redis`)."""
    if url is not None and "+cluster" in url.split("://", 1)[0]:
        cluster = True
    with contextlib.ExitStack() as stack:
        control: ServerControl | None = None
        if url is None:
            control = stack.enter_context(local_redis())
            url = control.url
        out: dict[str, Any] = {
            "server": server_version(url),
            "private_server": control is not None,
            "cluster": cluster,
            "io_threads": io_threads,
            "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg()[0],
            "sizes": [],
        }
        for size in sizes:
            n = blocks or default_blocks(size)
            if log is not None:
                log(f"value size {size} B, {n} blocks")
            row: dict[str, Any] = {"value_bytes": size, "blocks": n}
            row["redis_benchmark"] = redis_benchmark_best(
                url, size, pipelines=pipelines, clients=clients, run_bytes=run_bytes, cluster=cluster, log=log
            )
            row["redis_benchmark_keys"] = redis_benchmark_best(
                url,
                size,
                pipelines=pipelines,
                clients=clients,
                run_bytes=run_bytes,
                cluster=cluster,
                keyspace=n,
                log=log,
            )
            try:
                row["redis_py"] = redis_py_pipelined(
                    url, size, n, pipeline=py_pipeline, reps=reps, cluster=cluster
                )
            except ImportError:
                row["redis_py"] = None
                row["redis_py_note"] = "redis-py is not installed (pip install redis)"
            if log is not None and row["redis_py"] is not None:
                rp = row["redis_py"]
                log(f"  redis-py pipelined: SET {rp['set_gb_s']:.2f} GET {rp['get_gb_s']:.2f} GB/s")
            alt = _Alternated(
                url,
                size,
                row,
                run_bytes=run_bytes,
                cluster=cluster,
                server_cpu=control.cpu_s if control is not None else None,
            )
            server_cpu = control.cpu_s if control is not None else None
            nat = _native_reference(
                url, size, n, row, cluster=cluster, threads=native_threads, log=log, server_cpu=server_cpu
            )

            def before_rep(alt: _Alternated = alt, nat: _NativeAlternated | None = nat) -> None:
                alt()
                if nat is not None:
                    nat()

            try:
                k = kvoff_rows(
                    url,
                    size,
                    n,
                    reps=reps,
                    cluster=cluster,
                    control=control,
                    io_threads=io_threads,
                    before_rep=before_rep,
                )
            finally:
                t = RedisTarget.from_url(url)
                _delete_benchmark_keys(t, n, cluster=cluster, timeout_s=300.0)
                if nat is not None:
                    nat.close()
            row["kvoff"] = k
            if k is None:
                row["kvoff_note"] = "this build of kvoff has no remote tier: references only"
            else:
                rb, rk, rp = row["redis_benchmark"], row["redis_benchmark_keys"], row["redis_py"]
                ra = row["redis_benchmark_alternated"] = alt.result()
                row["ratios"] = {
                    "store_vs_redis_benchmark_alternated": k["set_gb_s"] / ra["one_key"]["set_gb_s"],
                    "load_vs_redis_benchmark_alternated": k["get_gb_s"] / ra["one_key"]["get_gb_s"],
                    "store_vs_redis_benchmark_keys_alternated": k["set_gb_s"] / ra["keys"]["set_gb_s"],
                    "load_vs_redis_benchmark_keys_alternated": k["get_gb_s"] / ra["keys"]["get_gb_s"],
                    "store_vs_redis_benchmark": k["set_gb_s"] / rb["set"]["gb_s"],
                    "load_vs_redis_benchmark": k["get_gb_s"] / rb["get"]["gb_s"],
                    "store_vs_redis_benchmark_keys": k["set_gb_s"] / rk["set"]["gb_s"],
                    "load_vs_redis_benchmark_keys": k["get_gb_s"] / rk["get"]["gb_s"],
                    "load_vs_redis_py": (k["get_gb_s"] / rp["get_gb_s"]) if rp else None,
                }
                if nat is not None:
                    na = row["native_alternated"] = nat.result()
                    nb = row["native"]
                    row["ratios"].update(
                        {
                            "store_vs_native_alternated": k["set_gb_s"] / na["set_gb_s"],
                            "load_vs_native_alternated": k["get_gb_s"] / na["get_gb_s"],
                            "store_vs_native": k["set_gb_s"] / nb["set"]["gb_s"],
                            "load_vs_native": k["get_gb_s"] / nb["get"]["gb_s"],
                        }
                    )
            out["sizes"].append(row)
        out["loadavg_end"] = os.getloadavg()[0]
        return out


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n // KiB} KiB" if n % KiB == 0 else f"{n} B"


def _server_line(k: dict[str, Any], ra: dict[str, Any] | None, blocks: int) -> str:
    """The server's CPU per GB of values (and its busy share in kvoff's store and load), where
    the benchmark measured them (its private server); empty otherwise."""
    st, ld = k.get("server_store") or {}, k.get("server_load") or {}
    if st.get("cpu_s_per_gb") is None or ld.get("cpu_s_per_gb") is None:
        return ""
    text = (
        f"server CPU s per GB of values: kvoff store {st['cpu_s_per_gb']:.2f} (busy {st['busy']:.0%}),"
        f" load {ld['cpu_s_per_gb']:.2f} (busy {ld['busy']:.0%})"
    )
    if st.get("client_cpu_s_per_gb") is not None and ld.get("client_cpu_s_per_gb") is not None:
        io = ""
        if st.get("io_threads_cpu_s_per_gb") is not None and ld.get("io_threads_cpu_s_per_gb") is not None:
            io = f" (its I/O threads {st['io_threads_cpu_s_per_gb']:.2f} / {ld['io_threads_cpu_s_per_gb']:.2f})"
        text += (
            f"; client CPU s per GB: kvoff store / load {st['client_cpu_s_per_gb']:.2f} /"
            f" {ld['client_cpu_s_per_gb']:.2f}{io}"
        )
    if ra is not None and "set_server_cpu_s_per_gb" in ra["one_key"]:
        o, n = ra["one_key"], ra["keys"]
        text += (
            f"; redis-benchmark again SET / GET, one key {o['set_server_cpu_s_per_gb']:.2f} /"
            f" {o['get_server_cpu_s_per_gb']:.2f}, {blocks} keys {n['set_server_cpu_s_per_gb']:.2f} /"
            f" {n['get_server_cpu_s_per_gb']:.2f}"
        )
    return text


def _native_lines(row: dict[str, Any], v: str, part: str) -> list[str]:
    """The native client's lines of a value size's rows: its grid's best (``part="best"``), its
    runs beside kvoff's repetitions (``"again"``), kvoff's ratios to it (``"ratios"``)."""
    nb, na, r = row.get("native"), row.get("native_alternated"), row.get("ratios") or {}
    if part == "best" and nb is not None:
        ok = "" if nb["verified"] else "   NOT VERIFIED"
        what = "native client best, 1 GET/key"
        return [
            (
                f"{v:>8} {what:<34} {nb['set']['gb_s']:>10.2f} {nb['get']['gb_s']:>10.2f}"
                f"   (SET {nb['set']['threads']} threads; GET {nb['get']['threads']} threads){ok}"
            )
        ]
    if part == "best" and "native_note" in row:
        return [f"{v:>8} {'native client':<34} {row['native_note']}"]
    if part == "again" and na is not None:
        ok = "" if na["verified"] else "   NOT VERIFIED"
        cpu = ""
        if "set_server_cpu_s_per_gb" in na and "get_server_cpu_s_per_gb" in na:
            cpu = (
                f"; server CPU s per GB {na['set_server_cpu_s_per_gb']:.2f} /"
                f" {na['get_server_cpu_s_per_gb']:.2f}"
            )
        if "set_client_cpu_s_per_gb" in na and "get_client_cpu_s_per_gb" in na:
            cpu += (
                f"; client CPU s per GB {na['set_client_cpu_s_per_gb']:.2f} /"
                f" {na['get_client_cpu_s_per_gb']:.2f}"
            )
        return [
            (
                f"{v:>8} {'native client again':<34} {na['set_gb_s']:>10.2f} {na['get_gb_s']:>10.2f}"
                f"   (best thread counts, before each of kvoff's {na['runs']} repetitions; median{cpu}){ok}"
            )
        ]
    if part == "ratios" and "store_vs_native_alternated" in r:
        want = 1.0 if row["value_bytes"] >= MiB else 0.95
        low = min(r["store_vs_native_alternated"], r["load_vs_native_alternated"])
        return [
            (
                f"{'':>8} {'':<34} vs the native client: store {r['store_vs_native_alternated']:.2f}x, load "
                f"{r['load_vs_native_alternated']:.2f}x (again; best {r['store_vs_native']:.2f}x /"
                f" {r['load_vs_native']:.2f}x); target >= {want:.2f}x: {'met' if low >= want else 'NOT met'}"
            )
        ]
    return []


def format_remote(res: dict[str, Any]) -> str:
    """The table of :func:`bench_remote`'s result."""
    head = (
        f"kvoff bench remote: {res['server']} ({'private server' if res['private_server'] else 'given URL'}"
    )
    load = ""
    if "loadavg_start" in res:  # other work on the machine shares the cores with the server
        load = f", load average {res['loadavg_start']:.1f} -> {res.get('loadavg_end', 0.0):.1f}"
    threads = f", kvoff with {res['io_threads']} I/O threads" if res.get("io_threads") else ""
    lines = [
        head + f"{', cluster' if res['cluster'] else ''}; {res['cpus']} CPUs{load}{threads}), GB/s of values"
    ]
    lines.append(f"{'value':>8} {'what':<34} {'SET/store':>10} {'GET/load':>10}")
    for row in res["sizes"]:
        v = _size(row["value_bytes"])
        rb = row["redis_benchmark"]
        s, g = rb["set"], rb["get"]
        lines.append(
            f"{v:>8} {'redis-benchmark best, one key':<34} {s['gb_s']:>10.2f} {g['gb_s']:>10.2f}"
            f"   (SET -P {s['pipeline']} -c {s['clients']}; GET -P {g['pipeline']} -c {g['clients']})"
        )
        rk = row.get("redis_benchmark_keys")
        if rk is not None:
            s, g = rk["set"], rk["get"]
            what = f"redis-benchmark best, {row['blocks']} keys"
            lines.append(
                f"{v:>8} {what:<34} {s['gb_s']:>10.2f} {g['gb_s']:>10.2f}"
                f"   (SET -P {s['pipeline']} -c {s['clients']}; GET -P {g['pipeline']} -c {g['clients']})"
            )
        rp = row["redis_py"]
        if rp is not None:
            what = f"redis-py {rp['redis_py']} pipelined ({rp['pipeline']}/batch{', hiredis' if rp['hiredis'] else ''})"
            ok = "" if rp["verified"] else "   NOT VERIFIED"
            lines.append(f"{v:>8} {what:<34} {rp['set_gb_s']:>10.2f} {rp['get_gb_s']:>10.2f}{ok}")
        else:
            lines.append(f"{v:>8} {'redis-py':<34} {row.get('redis_py_note', '')}")
        lines += _native_lines(row, v, "best")
        k = row["kvoff"]
        if k is None:
            lines.append(f"{v:>8} {'kvoff':<34} {row['kvoff_note']}")
            continue
        lines += _native_lines(row, v, "again")
        ra = row.get("redis_benchmark_alternated")
        if ra is not None:
            for variant, what in (("one_key", "one key"), ("keys", f"{row['blocks']} keys")):
                label = f"redis-benchmark again, {what}"
                lines.append(
                    f"{v:>8} {label:<34} {ra[variant]['set_gb_s']:>10.2f} {ra[variant]['get_gb_s']:>10.2f}"
                    f"   (best shapes, before each of kvoff's {ra['runs']} repetitions; median)"
                )
        lines.append(f"{v:>8} {'kvoff remote tier':<34} {k['set_gb_s']:>10.2f} {k['get_gb_s']:>10.2f}")
        r = row["ratios"]
        vs_py = "" if r["load_vs_redis_py"] is None else f"; load {r['load_vs_redis_py']:.1f}x redis-py"
        lines.append(
            f"{'':>8} {'':<34} store {r['store_vs_redis_benchmark']:.0%}, load "
            f"{r['load_vs_redis_benchmark']:.0%} of redis-benchmark (one key){vs_py}"
        )
        if "store_vs_redis_benchmark_keys" in r:
            lines.append(
                f"{'':>8} {'':<34} store {r['store_vs_redis_benchmark_keys']:.0%}, load "
                f"{r['load_vs_redis_benchmark_keys']:.0%} of redis-benchmark ({row['blocks']} keys)"
            )
        if "store_vs_redis_benchmark_alternated" in r:
            lines.append(
                f"{'':>8} {'':<34} alternated medians: store "
                f"{r['store_vs_redis_benchmark_alternated']:.0%} / "
                f"{r['store_vs_redis_benchmark_keys_alternated']:.0%}, load "
                f"{r['load_vs_redis_benchmark_alternated']:.0%} / "
                f"{r['load_vs_redis_benchmark_keys_alternated']:.0%} (one key / {row['blocks']} keys)"
            )
        lines += _native_lines(row, v, "ratios")
        line = _server_line(k, ra, row["blocks"])
        if line:
            lines.append(f"{'':>8} {line}")
        for key in (
            "promote_p50_us",
            "promote_p99_us",
            "lookup_p99_us_load",
            "lookup_p99_us_up",
            "lookup_p99_us_up_paced",
            "lookup_p99_us_slow",
            "lookup_p99_us_down",
        ):
            if k.get(key) is not None:
                ref = (
                    k.get(key.replace("lookup_p99", "lookup_ref_p99"))
                    if key.startswith("lookup_p99")
                    else None
                )
                same = "" if ref is None else f"   (same loop, 16 keys in host memory, idle tier: {ref:.1f})"
                lines.append(f"{'':>8} {key:<34} {k[key]:>10.1f}{same}")
    return "\n".join(lines)
