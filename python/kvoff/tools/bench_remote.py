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
  (:func:`redis_py_pipelined`).

kvoff's own rows come from :func:`kvoff_rows` (the remote tier's store and load GB/s, lookup-to-
promoted latency and the scheduler thread's lookup time with the server up, slow and down); where
this build of kvoff has no remote tier, the benchmark reports the references alone and says so.

With its private server the benchmark also reads the CPU time of the server's event loop (its main
thread, where a Redis or Valkey without I/O threads parses, executes and answers every command;
:meth:`ServerControl.cpu_s`) around kvoff's store and load and around each run of the best shapes
again: the server's CPU seconds per GB of values for each, and the share of kvoff's time the server
was busy. A client at the server's ceiling keeps it busy nearly all the time; one that costs the
server less per GB than redis-benchmark does moves more bytes for the same CPU.

Without ``url`` the benchmark starts a private ``redis-server`` on loopback (a random port, no
persistence) and stops it at the end; it needs Debian's ``redis-server`` and ``redis-tools``
(``redis-benchmark``) or their Valkey equivalents on ``PATH``. Blocks are written under keys
``kvoff-bench-ref:*`` (redis-py) and redis-benchmark's ``key:__rand_int__``, and deleted at the end.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import io
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit

__all__ = [
    "DEFAULT_SIZES",
    "RedisTarget",
    "ServerControl",
    "bench_remote",
    "default_blocks",
    "format_remote",
    "kvoff_rows",
    "local_redis",
    "redis_benchmark_best",
    "redis_py_pipelined",
]

MiB = 1 << 20
KiB = 1 << 10
#: Value sizes measured by default: a 2 MiB block (Llama-3-8B, 16 tokens, bf16) and a 32 KiB one.
DEFAULT_SIZES = (2 * MiB, 32 * KiB)
#: Bytes each redis-benchmark run moves per operation (runs are at least 2 × clients × pipeline ops).
DEFAULT_RUN_BYTES = 1 << 30


@dataclass(frozen=True)
class RedisTarget:
    """Where a ``redis://`` / ``rediss://`` URL points (``user:password@host:port/db``)."""

    host: str
    port: int
    username: str | None
    password: str | None
    tls: bool
    db: int

    @classmethod
    def from_url(cls, url: str) -> RedisTarget:
        """``redis://``, ``rediss://`` or a Cluster's ``redis+cluster://host:port[,host:port]``
        (``rediss+cluster://``; the first seed node)."""
        u = urlsplit(url)
        if u.scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
            raise ValueError(f"not a redis://, rediss:// or redis+cluster:// URL: scheme {u.scheme!r}")
        if "," in u.netloc:
            u = u._replace(netloc=u.netloc.split(",")[0])
        path = u.path.lstrip("/")
        return cls(
            host=u.hostname or "127.0.0.1",
            port=u.port or 6379,
            username=unquote(u.username) if u.username else None,
            password=unquote(u.password) if u.password else None,
            tls=u.scheme.startswith("rediss"),
            db=int(path) if path else 0,
        )

    def tool_args(self, benchmark: bool = False) -> list[str]:
        """Options of ``redis-cli`` (or, with ``benchmark``, ``redis-benchmark``) that reach this
        server. For redis-cli the password travels in ``REDISCLI_AUTH`` (:meth:`tool_env`);
        redis-benchmark reads no environment variable, so it gets ``-a`` (its command line is
        never printed or put into an error)."""
        a = ["-h", self.host, "-p", str(self.port)]
        if benchmark and self.password:
            a += ["-a", self.password]
        if self.username:
            a += ["--user", self.username]
        if self.tls:
            a += ["--tls", "--insecure"]
        if self.db:
            a += ["--dbnum", str(self.db)] if benchmark else ["-n", str(self.db)]
        return a

    def url(self) -> str:
        """A plain ``redis://`` / ``rediss://`` URL of this node (for redis-py)."""
        auth = ""
        if self.password:
            auth = f"{quote(self.username or '', safe='')}:{quote(self.password, safe='')}@"
        db = f"/{self.db}" if self.db else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}{self.host}:{self.port}{db}"

    def tool_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.password:
            env["REDISCLI_AUTH"] = self.password
        return env


def _tool(*names: str) -> str:
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    raise FileNotFoundError(
        f"{names[0]} not found on PATH (Debian: apt-get install redis-tools; Valkey: valkey-tools)"
    )


def _parse_benchmark_csv(text: str) -> dict[str, float]:
    """``redis-benchmark --csv`` output: ``{"SET": rps, "GET": rps}``."""
    out = {}
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 2 and row[0] != "test":
            with contextlib.suppress(ValueError):
                out[row[0].upper()] = float(row[1])
    return out


def _requests(value_bytes: int, pipeline: int, clients: int, run_bytes: int) -> int:
    """Requests of one redis-benchmark run (``-n``): ``run_bytes`` of values, at least two
    pipelines per client."""
    return max(2 * clients * pipeline, run_bytes // value_bytes, 16)


def redis_benchmark_best(
    url: str,
    value_bytes: int,
    *,
    pipelines: Sequence[int] = (1, 4, 16),
    clients: Sequence[int] = (1, 4, 16),
    run_bytes: int = DEFAULT_RUN_BYTES,
    cluster: bool = False,
    keyspace: int = 0,
    timeout_s: float = 300.0,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``redis-benchmark -t set,get -d value_bytes`` over ``pipelines × clients``; the best GB/s
    (payload bytes: requests/s × ``value_bytes`` / 1e9) per operation and where it was reached.
    ``keyspace`` > 0: random keys among that many (``-r``), written once beforehand (4 × keyspace
    SETs) so that GETs find values.

    Returns ``{"set": {"gb_s", "pipeline", "clients", "rps"}, "get": {...}, "grid": [rows]}``.

    Raises:
        FileNotFoundError: no ``redis-benchmark`` (or ``valkey-benchmark``) on ``PATH``.
        RuntimeError: a run failed (its output is in the message).
    """
    exe = _tool("redis-benchmark", "valkey-benchmark")
    t = RedisTarget.from_url(url)
    grid: list[dict[str, Any]] = []
    best: dict[str, dict[str, Any]] = {}
    keys = ["-r", str(keyspace)] if keyspace > 0 else []
    if keyspace > 0:
        fill = [exe, *t.tool_args(benchmark=True), "-t", "set", "-d", str(value_bytes)]
        fill += ["-n", str(4 * keyspace), *keys, "-P", "16", "-c", "4", "-q"]
        if cluster:
            fill.append("--cluster")
        subprocess.run(fill, capture_output=True, timeout=timeout_s, env=t.tool_env(), check=False)
    for p in pipelines:
        for c in clients:
            n = _requests(value_bytes, p, c, run_bytes)
            cmd = [exe, *t.tool_args(benchmark=True), "-t", "set,get", "-d", str(value_bytes), "-n", str(n)]
            cmd += ["-P", str(p), "-c", str(c), *keys, "--csv"]
            if cluster:
                cmd.append("--cluster")
            r = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout_s, env=t.tool_env(), check=False
            )
            rps = _parse_benchmark_csv(r.stdout)
            if r.returncode != 0 or "SET" not in rps or "GET" not in rps:
                raise RuntimeError(
                    f"redis-benchmark failed (rc {r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}"
                )
            for op in ("SET", "GET"):
                row = {
                    "op": op.lower(),
                    "pipeline": p,
                    "clients": c,
                    "ops": n,
                    "rps": rps[op],
                    "gb_s": rps[op] * value_bytes / 1e9,
                }
                grid.append(row)
                if row["gb_s"] > best.get(op.lower(), {}).get("gb_s", -1.0):
                    best[op.lower()] = {k: row[k] for k in ("gb_s", "pipeline", "clients", "rps")}
            if log is not None:
                log(
                    f"  redis-benchmark {value_bytes} B -P {p} -c {c}{' -r ' + str(keyspace) if keyspace else ''}: SET {rps['SET'] * value_bytes / 1e9:.2f} "
                    f"GET {rps['GET'] * value_bytes / 1e9:.2f} GB/s"
                )
    _delete_benchmark_keys(t, keyspace, cluster=cluster, timeout_s=timeout_s)
    return {"set": best["set"], "get": best["get"], "grid": grid}


def redis_benchmark_shape(
    url: str,
    value_bytes: int,
    op: str,
    pipeline: int,
    clients: int,
    *,
    run_bytes: int = DEFAULT_RUN_BYTES,
    cluster: bool = False,
    keyspace: int = 0,
    requests: int | None = None,
    timeout_s: float = 300.0,
) -> float:
    """GB/s of one ``redis-benchmark -t op`` run (``op``: ``"set"`` or ``"get"``) at one shape,
    counted as :func:`redis_benchmark_best` counts them, of ``requests`` requests (default
    :func:`_requests`). A GET over ``keyspace`` keys needs them written first: a SET run of the
    same keyspace of at least 4 × ``keyspace`` requests writes 98% of them (a key missed is
    answered with nil, not a value)."""
    exe = _tool("redis-benchmark", "valkey-benchmark")
    t = RedisTarget.from_url(url)
    n = requests or _requests(value_bytes, pipeline, clients, run_bytes)
    cmd = [exe, *t.tool_args(benchmark=True), "-t", op, "-d", str(value_bytes), "-n", str(n)]
    cmd += [
        "-P",
        str(pipeline),
        "-c",
        str(clients),
        *(["-r", str(keyspace)] if keyspace > 0 else []),
        "--csv",
    ]
    if cluster:
        cmd.append("--cluster")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=t.tool_env(), check=False)
    rps = _parse_benchmark_csv(r.stdout).get(op.upper())
    if r.returncode != 0 or rps is None:
        raise RuntimeError(
            f"redis-benchmark failed (rc {r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}"
        )
    return rps * value_bytes / 1e9


class _Alternated:
    """redis-benchmark's best shapes (from the grids) run again before each of kvoff's
    repetitions: the median of these runs is a reference measured beside kvoff's median, where
    the grid's best is the luckiest of nine single runs."""

    def __init__(
        self,
        url: str,
        value_bytes: int,
        row: dict[str, Any],
        *,
        run_bytes: int,
        cluster: bool,
        server_cpu: Callable[[], float | None] | None = None,
    ) -> None:
        self.url, self.value_bytes, self.run_bytes, self.cluster = url, value_bytes, run_bytes, cluster
        self.server_cpu = server_cpu
        self.variants = [
            ("one_key", row["redis_benchmark"], 0),
            ("keys", row["redis_benchmark_keys"], row["blocks"]),
        ]
        self.runs: dict[str, dict[str, list[float]]] = {
            v: {"set": [], "get": []} for v, _, _ in self.variants
        }
        # The server's CPU seconds per GB of values in each run (with its private server).
        self.cpu: dict[str, dict[str, list[float]]] = {v: {"set": [], "get": []} for v, _, _ in self.variants}

    def __call__(self) -> None:
        for variant, best, keyspace in self.variants:
            for op in ("set", "get"):  # the SET run writes the keys the GET run reads
                shape = best[op]
                n = _requests(self.value_bytes, shape["pipeline"], shape["clients"], self.run_bytes)
                n = max(n, 4 * keyspace)  # the SET run writes (nearly) every key the GET run reads
                c0 = self.server_cpu() if self.server_cpu is not None else None
                self.runs[variant][op].append(
                    redis_benchmark_shape(
                        self.url,
                        self.value_bytes,
                        op,
                        shape["pipeline"],
                        shape["clients"],
                        run_bytes=self.run_bytes,
                        cluster=self.cluster,
                        keyspace=keyspace,
                        requests=n,
                    )
                )
                c1 = self.server_cpu() if self.server_cpu is not None else None
                if c0 is not None and c1 is not None:
                    self.cpu[variant][op].append((c1 - c0) / (n * self.value_bytes / 1e9))

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"runs": len(self.runs["one_key"]["set"])}
        for variant, ops in self.runs.items():
            out[variant] = {f"{op}_gb_s": statistics.median(xs) for op, xs in ops.items() if xs}
            for op, xs in self.cpu[variant].items():
                if xs:
                    out[variant][f"{op}_server_cpu_s_per_gb"] = statistics.median(xs)
        return out


def _delete_benchmark_keys(t: RedisTarget, keyspace: int, *, cluster: bool, timeout_s: float) -> None:
    """Deletes redis-benchmark's keys: ``key:__rand_int__``, and with ``keyspace`` its ``-r`` keys
    (``key:`` and the number in 12 digits), one ``DEL`` per key through ``redis-cli`` (``-c``
    follows a Cluster's redirects)."""
    names = ["key:__rand_int__", *(f"key:{i:012d}" for i in range(keyspace))]
    cmd = [_tool("redis-cli", "valkey-cli"), *t.tool_args(), *(["-c"] if cluster else [])]
    subprocess.run(
        cmd,
        input="".join(f"DEL {k}\n" for k in names),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=t.tool_env(),
        check=False,
    )


def default_blocks(value_bytes: int) -> int:
    """Blocks per repetition: about 256 MiB of values, 64 to 8192 of them."""
    return max(64, min(8192, (256 * MiB) // value_bytes))


def _make_blocks(value_bytes: int, n_blocks: int, seed: int = 0) -> list[bytes]:
    """``n_blocks`` distinct values: one random buffer, each block with its index in front."""
    base = (bytes(os.urandom(min(value_bytes, 1 << 16))) * (value_bytes // min(value_bytes, 1 << 16) + 1))[
        :value_bytes
    ]
    return [(i + seed).to_bytes(8, "little") + base[8:] for i in range(n_blocks)]


def redis_py_pipelined(
    url: str,
    value_bytes: int,
    n_blocks: int,
    *,
    pipeline: int = 16,
    reps: int = 3,
    cluster: bool = False,
    blocks: Sequence[bytes] | None = None,
) -> dict[str, Any]:
    """redis-py: SET ``n_blocks`` values of ``value_bytes`` in pipelines of ``pipeline`` commands
    (no MULTI), then GET them back the same way, ``reps`` times; the median GB/s per direction.
    Every value read back is compared with what was written.

    Returns ``{"set_gb_s", "get_gb_s", "pipeline", "blocks", "verified", "redis_py", "hiredis"}``
    (``hiredis``: whether redis-py parsed replies with the hiredis C extension).

    Raises:
        ImportError: redis-py is not installed (``pip install redis``).
    """
    redis = importlib.import_module("redis")
    url = RedisTarget.from_url(url).url()  # redis-py knows no redis+cluster:// scheme
    data = list(blocks) if blocks is not None else _make_blocks(value_bytes, n_blocks)
    keys = [f"kvoff-bench-ref:{value_bytes}:{i}" for i in range(len(data))]
    if cluster:
        client = redis.RedisCluster.from_url(url, ssl_cert_reqs=None) if url.startswith("rediss") else None
        client = client or redis.RedisCluster.from_url(url)
    else:
        kw = {"ssl_cert_reqs": None} if url.startswith("rediss") else {}
        client = redis.Redis.from_url(url, **kw)
    set_s: list[float] = []
    get_s: list[float] = []
    verified = True
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            for i in range(0, len(data), pipeline):
                pipe = client.pipeline(transaction=False)
                for k, v in zip(keys[i : i + pipeline], data[i : i + pipeline], strict=True):
                    pipe.set(k, v)
                pipe.execute()
            set_s.append(time.perf_counter() - t0)
            got: list[bytes | None] = []
            t0 = time.perf_counter()
            for i in range(0, len(data), pipeline):
                pipe = client.pipeline(transaction=False)
                for k in keys[i : i + pipeline]:
                    pipe.get(k)
                got.extend(pipe.execute())
            get_s.append(time.perf_counter() - t0)
            verified = verified and got == data
            del got
    finally:
        for i in range(0, len(keys), 256):
            with contextlib.suppress(Exception):
                if cluster:
                    for k in keys[i : i + 256]:
                        client.delete(k)
                else:
                    client.delete(*keys[i : i + 256])
        client.close()
    total = len(data) * value_bytes
    return {
        "set_gb_s": total / statistics.median(set_s) / 1e9,
        "get_gb_s": total / statistics.median(get_s) / 1e9,
        "pipeline": pipeline,
        "blocks": len(data),
        "verified": verified,
        "redis_py": str(getattr(redis, "__version__", "?")),
        "hiredis": bool(getattr(importlib.import_module("redis.utils"), "HIREDIS_AVAILABLE", False)),
    }


class ServerControl:
    """What :func:`kvoff_rows` may do to the server it measures, where the benchmark started it
    itself (``None`` otherwise): ``pause()``/``resume()`` (SIGSTOP/SIGCONT: a server that keeps
    its connections but answers nothing, for the scheduler-thread lookup time while the server is
    down or slow) and the private server's ``url``."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self._proc = proc
        self.url = url

    def cpu_s(self) -> float | None:
        """CPU seconds the server's main thread (its event loop: every command is parsed,
        executed and answered there by a server without I/O threads) has run, from
        ``/proc/<pid>/schedstat`` (nanoseconds); ``None`` where that cannot be read (not Linux,
        or the server gone)."""
        try:
            with open(f"/proc/{self._proc.pid}/schedstat") as f:
                return int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            return None

    def pause(self) -> None:
        self._proc.send_signal(19)  # SIGSTOP

    def resume(self) -> None:
        self._proc.send_signal(18)  # SIGCONT


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


def _store_remote(
    a: Any,
    ra: Any,
    keys: list[bytes],
    block: int,
    base: Any,
    server_cpu: Callable[[], float | None] | None = None,
    spent: list[tuple[float, float]] | None = None,
) -> float:
    """Stores ``keys`` (``base`` with the block's index in its first 8 bytes) through manager ``a``
    (host memory ``ra``) until the server acknowledged all of them; returns GB/s of block bytes.
    With ``server_cpu`` (:meth:`ServerControl.cpu_s`), appends to ``spent`` the server's CPU
    seconds over the timed store and its duration."""
    import numpy as np

    n = len(keys)
    out = a.prepare_store(keys)
    assert out is not None
    view = ra.view_numpy(0, 0, block)
    for i, blk in enumerate(out.store_spec.block_ids):
        view[int(blk)] = base
        view[int(blk), :8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    c0 = server_cpu() if server_cpu is not None else None
    t0 = time.perf_counter()
    a.complete_store(out.keys_to_store)
    a.flush()  # waits until the server acknowledged every queued write
    dt = time.perf_counter() - t0
    c1 = server_cpu() if server_cpu is not None else None
    if spent is not None and c0 is not None and c1 is not None:
        spent.append((c1 - c0, dt))
    st = a.get_stats()
    if st["remote_writes"] != n:
        raise RuntimeError(f"only {st['remote_writes']} of {n} values written: {st['remote_last_error']}")
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
    spent: list[tuple[float, float]] | None = None,
) -> tuple[float, bool]:
    """Promotes ``keys`` into manager ``b`` (host memory ``rb``) the way a scheduler does: the keys
    are requests of ``REQUEST_BLOCKS`` blocks, and every step (``STEP_S`` apart) calls
    ``lookup_prefix`` for each request not yet fully in host memory (each call's time appended to
    ``lookups``); then compares every block. Returns (GB/s, all verified). ``server_cpu`` and
    ``spent`` as :func:`_store_remote`'s."""
    import numpy as np

    n = len(keys)
    waiting = [keys[i : i + REQUEST_BLOCKS] for i in range(0, n, REQUEST_BLOCKS)]
    c0 = server_cpu() if server_cpu is not None else None
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
    c1 = server_cpu() if server_cpu is not None else None
    if spent is not None and c0 is not None and c1 is not None:
        spent.append((c1 - c0, dt))
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
    bytes. Store: ``complete_store`` of
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
        "remote_max_queued_writes": n,
        "remote_max_inflight_bytes": n * value_bytes,
        "remote_timeout_s": 2.0,
    }
    if io_threads is not None:
        kw["remote_io_threads"] = io_threads

    def engine(ns: str, url_: str = url, **more: Any) -> tuple[TieredOffloadingManager, kvoff.HostRegion]:
        region = kvoff.HostRegion.private(n, block)
        return TieredOffloadingManager(
            "lru", n, region, remote_url=url_, namespace=ns, **{**kw, **more}
        ), region

    def key(ns: str, i: int) -> bytes:
        return kvoff.make_offload_key(f"{ns}-{i}".encode(), 0)

    set_gbs: list[float] = []
    get_gbs: list[float] = []
    lookups_load: list[float] = []
    # The server's CPU seconds and the duration of each store and load (with its private server).
    server_cpu = control.cpu_s if control is not None else None
    spent_store: list[tuple[float, float]] = []
    spent_load: list[tuple[float, float]] = []
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

    def server(spent: list[tuple[float, float]]) -> dict[str, float | None]:
        # Medians over the repetitions: the share of the time the server's event loop ran, and
        # its CPU seconds per GB of values (header included, as the references count them).
        if not spent:
            return {"busy": None, "cpu_s_per_gb": None}
        return {
            "busy": statistics.median(c / dt for c, dt in spent),
            "cpu_s_per_gb": statistics.median(c / gb_values for c, _ in spent),
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def local_redis(timeout_s: float = 20.0) -> Iterator[ServerControl]:
    """A private ``redis-server`` (or ``valkey-server``) on 127.0.0.1 at a free port, no
    persistence, stopped (SIGKILL) at the end; yields its :class:`ServerControl`."""
    exe = _tool("redis-server", "valkey-server")
    cli = _tool("redis-cli", "valkey-cli")
    d = tempfile.mkdtemp(prefix="kvoff-bench-redis-")
    port = _free_port()
    pre = [sp, "--pdeathsig", "KILL"] if (sp := shutil.which("setpriv")) else []
    cmd = [*pre, exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    cmd += ["--dir", d, "--logfile", os.path.join(d, "server.log"), "--protected-mode", "no"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            r = subprocess.run(
                [cli, "-p", str(port), "PING"], capture_output=True, text=True, timeout=5, check=False
            )
            if r.stdout.strip() == "PONG":
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {port} (rc {proc.poll()})")
            time.sleep(0.05)
        yield ServerControl(proc, f"redis://127.0.0.1:{port}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(18)
            proc.kill()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def server_version(url: str) -> str:
    """``redis_version`` (or Valkey's ``valkey_version``) from ``INFO server``."""
    t = RedisTarget.from_url(url)
    r = subprocess.run(
        [_tool("redis-cli", "valkey-cli"), *t.tool_args(), "INFO", "server"],
        capture_output=True,
        text=True,
        timeout=10,
        env=t.tool_env(),
        check=False,
    )
    info = dict(ln.split(":", 1) for ln in r.stdout.splitlines() if ":" in ln)
    name = "valkey" if "valkey_version" in info else "redis"
    return f"{name} {info.get(f'{name}_version', info.get('redis_version', '?')).strip()}"


def bench_remote(
    url: str | None = None,
    sizes: Sequence[int] = DEFAULT_SIZES,
    *,
    blocks: int | None = None,
    reps: int = 3,
    pipelines: Sequence[int] = (1, 4, 16),
    clients: Sequence[int] = (1, 4, 16),
    py_pipeline: int = 16,
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
            try:
                k = kvoff_rows(
                    url,
                    size,
                    n,
                    reps=reps,
                    cluster=cluster,
                    control=control,
                    io_threads=io_threads,
                    before_rep=alt,
                )
            finally:
                t = RedisTarget.from_url(url)
                _delete_benchmark_keys(t, n, cluster=cluster, timeout_s=300.0)
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
    if ra is not None and "set_server_cpu_s_per_gb" in ra["one_key"]:
        o, n = ra["one_key"], ra["keys"]
        text += (
            f"; redis-benchmark again SET / GET, one key {o['set_server_cpu_s_per_gb']:.2f} /"
            f" {o['get_server_cpu_s_per_gb']:.2f}, {blocks} keys {n['set_server_cpu_s_per_gb']:.2f} /"
            f" {n['get_server_cpu_s_per_gb']:.2f}"
        )
    return text


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
        k = row["kvoff"]
        if k is None:
            lines.append(f"{v:>8} {'kvoff':<34} {row['kvoff_note']}")
            continue
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
