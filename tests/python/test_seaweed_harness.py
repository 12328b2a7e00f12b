"""The object tier's real-server harness (tests/python/seaweed.py, s3_http.py, conftest.py):
SeaweedFS's ``weed mini`` comes up on loopback with S3 auth on, serves signed requests (by hand
and, where installed, boto3's), keeps its data across SIGKILL + restart, loses it with
``restart_empty``, hangs under SIGSTOP, and leaves nothing behind; the throttling proxy answers
``503 SlowDown`` as told and passes everything else over kept-alive connections. Skipped, saying
why, only where ``weed`` is not installed (scripts/test.sh installs it and then requires it)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis_servers as rs
import s3_http
import seaweed as sw

Factory = Callable[..., sw.SeaweedServer]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on (/proc/PID/fd, /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    addr, port = cols[1].split(":")
                    ip = (
                        ".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0))
                        if len(addr) == 8
                        else addr
                    )
                    out.add((ip, int(port, 16)))
    return out


@pytest.mark.usefixtures("require_seaweed")
def test_weed_version_is_known() -> None:
    v = sw.weed_version()
    print(sw.weed_binary(), v)
    assert "version" in v


def test_session_server_serves_signed_requests(seaweed: sw.SeaweedServer) -> None:
    s = seaweed
    assert s.endpoint == f"http://127.0.0.1:{s.port}" and s.region == "us-east-1"
    env = s.env()
    assert env["AWS_ACCESS_KEY_ID"] == s.access_key and env["AWS_SECRET_ACCESS_KEY"] == s.secret_key
    assert env["AWS_ENDPOINT"] == s.endpoint and env["AWS_ALLOW_HTTP"] == "true"
    c = s.client()
    key = "harness/signed/a b+c"  # spaces and '+' must be encoded the same way when signing
    c.put_object(s.bucket, key, b"hello")
    assert c.get_object(s.bucket, key) == b"hello"
    assert s.filer_get(s.bucket, key) == b"hello"  # stored, as the filer sees it
    listed = c.request("GET", f"/{s.bucket}", query={"list-type": "2", "prefix": "harness/signed/"})
    assert listed.status == 200 and b"<Key>harness/signed/a b+c</Key>" in listed.body
    s.filer_put(s.bucket, "harness/signed/via-filer", b"x")
    assert c.get_object(s.bucket, "harness/signed/via-filer") == b"x"
    listed_keys = ["harness/signed/a b+c", "harness/signed/via-filer"]
    assert (
        c.list_keys(s.bucket, "harness/signed/")
        == c.list_keys(s.bucket, "harness/signed/", page=1)
        == listed_keys
    )
    assert c.get_object(s.bucket, "harness/signed/missing") is None
    s.create_bucket("kvoff-second")
    c.put_object("kvoff-second", "k", b"2")
    # No bucket is made on upload: a missing bucket is an error, as on AWS.
    r = c.request("PUT", "/kvoff-no-such-bucket/k", body=b"1")
    assert r.status == 404 and r.error_code() == "NoSuchBucket"
    c.close()


def test_auth_is_enforced(seaweed: sw.SeaweedServer) -> None:
    s = seaweed
    r = s.client().request("GET", f"/{s.bucket}", sign=False)
    assert r.status == 403 and r.error_code() == "AccessDenied", r
    wrong = sw.S3Client(s.endpoint, s.access_key, s.secret_key + "x")
    r = wrong.request("GET", "/")
    assert r.status == 403 and r.error_code() == "SignatureDoesNotMatch", r
    unknown = sw.S3Client(s.endpoint, "KVOFFNOSUCHKEY000000", s.secret_key)
    r = unknown.request("GET", "/")
    assert r.status == 403 and r.error_code() == "InvalidAccessKeyId", r


def test_boto3_with_the_env(seaweed: sw.SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    boto3 = pytest.importorskip("boto3")
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    s3 = boto3.client("s3")  # endpoint, credentials and region from the environment only
    s3.put_object(Bucket=seaweed.bucket, Key="harness/boto3", Body=b"b" * 100)
    assert s3.get_object(Bucket=seaweed.bucket, Key="harness/boto3")["Body"].read() == b"b" * 100
    assert seaweed.client().get_object(seaweed.bucket, "harness/boto3") == b"b" * 100


def test_every_port_is_drawn_and_on_loopback(seaweed: sw.SeaweedServer) -> None:
    assert seaweed.pid is not None
    listening = _listening(seaweed.pid)
    assert listening, "weed listens on nothing?"
    assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening
    assert {p for _, p in listening} <= set(seaweed.ports.values()), (listening, seaweed.ports)
    assert {seaweed.port, seaweed.ports["filer"], seaweed.ports["master"]} <= {p for _, p in listening}


def test_kill_and_restart_keep_the_data(seaweed_factory: Factory) -> None:
    s = seaweed_factory()
    c = s.client()
    c.put_object(s.bucket, "k", b"kept")
    port, pid = s.port, s.pid
    s.kill()
    assert pid is not None and not _alive(pid)
    with pytest.raises(OSError):
        c.request("GET", "/", timeout_s=2)
    t = time.monotonic()
    s.restart()
    print(f"restart: {time.monotonic() - t:.2f}s")
    assert s.port == port and s.pid != pid
    assert c.get_object(s.bucket, "k") == b"kept"


def test_restart_empty_loses_the_objects(seaweed_factory: Factory) -> None:
    s = seaweed_factory(buckets=("kvoff", "kvoff-other"))
    c = s.client()
    c.put_object(s.bucket, "k", b"gone")
    s.restart_empty()
    assert c.get_object(s.bucket, "k") is None  # the buckets are made again, empty
    c.put_object("kvoff-other", "k", b"1")
    s.restart_empty(keep_buckets=False)
    r = c.request("GET", f"/{s.bucket}/k")
    assert r.status == 404 and r.error_code() == "NoSuchBucket"
    assert s.buckets == ["kvoff", "kvoff-other"]  # kept for the next start


def test_stop_holds_requests_until_cont(seaweed_factory: Factory) -> None:
    s = seaweed_factory()
    c = s.client()
    c.put_object(s.bucket, "k", b"v")
    s.stop()
    try:
        with pytest.raises(OSError, match="timed out"):
            c.request("GET", f"/{s.bucket}/k", timeout_s=1.0)
        with socket.create_connection(("127.0.0.1", s.port), timeout=1):
            pass  # the kernel still accepts: the port is held, nothing answers
    finally:
        s.cont()
    assert c.get_object(s.bucket, "k") == b"v"


def test_throttle_proxy_answers_slowdown(
    seaweed: sw.SeaweedServer, s3_throttle_proxy: Callable[[int], s3_http.ThrottleProxy]
) -> None:
    p = s3_throttle_proxy(seaweed.port)
    c = seaweed.client(p.endpoint)  # signed for the proxy's address, which it passes on unchanged
    c.put_object(seaweed.bucket, "harness/throttle", b"t" * 70000)
    p.throttle()
    r = c.request("GET", f"/{seaweed.bucket}/harness/throttle")
    assert r.status == 503 and r.error_code() == "SlowDown", r
    assert r.headers["content-type"] == "application/xml" and b"<Error>" in r.body
    assert c.request("HEAD", f"/{seaweed.bucket}/harness/throttle").status == 503
    r = c.request("PUT", f"/{seaweed.bucket}/harness/throttle", body=b"dropped")
    assert r.status == 503  # its body was read and dropped: the connection goes on
    p.resume()
    assert c.get_object(seaweed.bucket, "harness/throttle") == b"t" * 70000
    p.throttle_next(2, status=500, code="InternalError")
    codes = [c.request("GET", f"/{seaweed.bucket}/harness/throttle").status for _ in range(3)]
    assert codes == [500, 500, 200]
    assert p.connections == 1  # all of it over one kept-alive connection
    p.throttle(0.5)
    n = sum(c.request("HEAD", f"/{seaweed.bucket}/harness/throttle").status == 503 for _ in range(40))
    assert 8 <= n <= 32, n
    p.resume()
    assert p.requests >= 47 and p.throttled == 3 + 2 + n


def test_throttle_proxy_and_expect_continue(
    seaweed: sw.SeaweedServer, s3_throttle_proxy: Callable[[int], s3_http.ThrottleProxy]
) -> None:
    p = s3_throttle_proxy(seaweed.port)
    path, body = f"/{seaweed.bucket}/harness/expect", b"e" * 5000

    def send_head(sock: socket.socket) -> None:
        h = sw.sigv4_headers(
            "PUT", f"127.0.0.1:{p.port}", path, {}, body, seaweed.access_key, seaweed.secret_key,
            extra={"expect": "100-continue"},
        )  # fmt: skip
        h["content-length"] = str(len(body))
        sock.sendall(
            (f"PUT {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n").encode()
        )

    with socket.create_connection(("127.0.0.1", p.port), timeout=10) as s:
        send_head(s)
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(body)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    p.throttle()
    with socket.create_connection(("127.0.0.1", p.port), timeout=10) as s:
        send_head(s)  # answered at once, without the body, and closed
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 503 Slow Down") and b"<Code>SlowDown</Code>" in reply
    assert seaweed.client().get_object(seaweed.bucket, "harness/expect") == body


def test_fault_proxy_stalls_s3(
    seaweed: sw.SeaweedServer, fault_proxy: Callable[[int], rs.FaultProxy]
) -> None:
    p = fault_proxy(seaweed.port)
    c = seaweed.client(f"http://127.0.0.1:{p.port}")
    c.put_object(seaweed.bucket, "harness/stall", b"s")
    p.stall()
    with pytest.raises(OSError, match="timed out"):
        c.request("GET", f"/{seaweed.bucket}/harness/stall", timeout_s=1.0)
    p.resume()
    assert c.get_object(seaweed.bucket, "harness/stall") == b"s"


@pytest.mark.usefixtures("require_seaweed")
def test_close_leaves_nothing() -> None:
    s = sw.SeaweedServer().start()
    pid, d = s.pid, s.dir
    assert pid is not None and _alive(pid) and d.exists()
    sockets = s.grpc_sockets()
    assert sockets[0].is_socket() and sockets[2].is_socket()  # the master's and the filer's
    s.stop()  # even a stopped server is ended
    s.close()
    assert not _alive(pid) and not d.exists() and not any(x.exists() for x in sockets)


@pytest.mark.usefixtures("require_seaweed")
def test_server_dies_with_a_sigkilled_test_process() -> None:
    # No atexit or finalizer runs in a SIGKILLed process: setpriv --pdeathsig ends its server.
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); import seaweed as sw\n"
        "s = sw.SeaweedServer().start(); print(s.pid, s.dir, *s.grpc_sockets(), flush=True)\n"
        "time.sleep(120)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, os.path.dirname(sw.__file__)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None
        pid_s, d, *sockets = p.stdout.readline().split()
        pid = int(pid_s)
        assert _alive(pid)
    finally:
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"weed {pid} outlived its SIGKILLed parent"
    shutil.rmtree(d, ignore_errors=True)  # what only close() removes
    for x in sockets:
        Path(x).unlink(missing_ok=True)
