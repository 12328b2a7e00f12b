"""The server side of ``kvoff bench remote`` (:mod:`kvoff.tools.bench_remote`) and its same-run
references: where a URL points (:class:`RedisTarget`), ``redis-benchmark``'s best shapes
(:func:`redis_benchmark_best`, run again beside each of kvoff's repetitions by :class:`_Alternated`),
redis-py's pipelined SET/GET of the same blocks (:func:`redis_py_pipelined`), a native client's one
``SET``/``GET`` per key from N threads (:func:`native_best`, again beside each of kvoff's
repetitions by :class:`_NativeAlternated`), and the private
server the benchmark starts without ``--url`` (:func:`local_redis`, :class:`ServerControl`)."""

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


#: Thread counts of the native-client reference's grid (LMCache's C++ ``resp://`` connector, the
#: client it stands for, runs 8 by default).
NATIVE_THREADS = (1, 4, 8, 16)


def native_best(
    url: str,
    value_bytes: int,
    n_blocks: int,
    *,
    threads: Sequence[int] = NATIVE_THREADS,
    server_cpu: Callable[[], float | None] | None = None,
) -> tuple[dict[str, Any], Any]:
    """The native-client reference (``kvoff._native.NativeRemoteRef``,
    ``src/tier/remote/native_ref.rs``): what a C++ connector does — one ``SET`` or ``GET`` per key,
    one request in flight per connection, from N threads, values straight from and into host
    memory, no header — over ``n_blocks`` values of ``value_bytes``, one SET pass and one GET pass
    per thread count. Returns ``({"grid": [...], "set": {"gb_s", "threads"}, "get": {...},
    "verified"}, the reference)`` (the best thread count per operation; the reference's keys stay
    on the server for :class:`_NativeAlternated` until its ``close()``). With ``server_cpu``
    (:meth:`ServerControl.cpu_s`) each grid entry also holds the server's CPU seconds per GB of
    each pass. Standalone ``redis://`` servers only (raises ``ConfigError`` otherwise)."""
    native = importlib.import_module("kvoff._native")
    ref = native.NativeRemoteRef(url, value_bytes, n_blocks)
    gb = value_bytes * n_blocks / 1e9
    try:
        grid = []
        verified = True
        for t in threads:
            row: dict[str, Any] = {"threads": t}
            for op in ("set", "get"):
                c0 = server_cpu() if server_cpu is not None else None
                r = ref.set(t) if op == "set" else ref.get(t)
                c1 = server_cpu() if server_cpu is not None else None
                if op == "get":
                    r, ok = r
                    verified &= ok
                row[f"{op}_gb_s"] = r
                if c0 is not None and c1 is not None:
                    row[f"{op}_server_cpu_s_per_gb"] = (c1 - c0) / gb
            grid.append(row)
    except BaseException:
        ref.close()
        raise
    out: dict[str, Any] = {"grid": grid, "verified": verified}
    for op in ("set", "get"):
        best = max(grid, key=lambda p: float(p[f"{op}_gb_s"]))
        out[op] = {"gb_s": best[f"{op}_gb_s"], "threads": best["threads"]}
        if f"{op}_server_cpu_s_per_gb" in best:
            out[op]["server_cpu_s_per_gb"] = best[f"{op}_server_cpu_s_per_gb"]
    return out, ref


class _NativeAlternated:
    """The native client's best thread counts (from :func:`native_best`) run again before each of
    kvoff's repetitions, on the same reference (its keys written once): medians measured beside
    kvoff's median, as :class:`_Alternated`'s, with the server's CPU seconds per GB where
    ``server_cpu`` reads them. ``close()`` deletes the reference's keys."""

    def __init__(
        self, ref: Any, best: dict[str, Any], gb: float, server_cpu: Callable[[], float | None] | None
    ) -> None:
        self.ref, self.gb, self.server_cpu = ref, gb, server_cpu
        self.threads = {op: int(best[op]["threads"]) for op in ("set", "get")}
        self.runs: dict[str, list[float]] = {"set": [], "get": []}
        self.cpu: dict[str, list[float]] = {"set": [], "get": []}
        # This process's CPU seconds per GB of each run (the reference's threads; the calling
        # thread waits in the call).
        self.client_cpu: dict[str, list[float]] = {"set": [], "get": []}
        self.verified = True

    def __call__(self) -> None:
        for op, t in self.threads.items():
            c0 = self.server_cpu() if self.server_cpu is not None else None
            p0 = time.process_time()
            if op == "set":
                self.runs[op].append(float(self.ref.set(t)))
            else:
                gbs, ok = self.ref.get(t)
                self.runs[op].append(float(gbs))
                self.verified &= bool(ok)
            self.client_cpu[op].append((time.process_time() - p0) / self.gb)
            c1 = self.server_cpu() if self.server_cpu is not None else None
            if c0 is not None and c1 is not None:
                self.cpu[op].append((c1 - c0) / self.gb)

    def close(self) -> None:
        self.ref.close()

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "runs": len(self.runs["set"]),
            "verified": self.verified,
            **{f"{op}_threads": t for op, t in self.threads.items()},
            **{f"{op}_gb_s": statistics.median(xs) for op, xs in self.runs.items() if xs},
        }
        for op, xs in self.cpu.items():
            if xs:
                out[f"{op}_server_cpu_s_per_gb"] = statistics.median(xs)
        for op, xs in self.client_cpu.items():
            if xs:
                out[f"{op}_client_cpu_s_per_gb"] = statistics.median(xs)
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
