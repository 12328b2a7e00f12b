"""S3 over plain HTTP for the object tier's tests, without boto3: SigV4 signing by hand
(:func:`sigv4_headers`, kvoff.tools.seaweed's, re-exported), a minimal path-style client
(:class:`S3Client`), and :class:`ThrottleProxy`, an HTTP/1.1 proxy that answers requests with S3's
``503 SlowDown`` (or another S3 XML error) for throttling and retry tests. tests/python/seaweed.py's
:class:`~seaweed.SeaweedServer` hands out the client (``client()``); tests use it to check what is
stored. For stalls, delays and resets between client and server, use
:class:`redis_servers.FaultProxy` (TCP, protocol-agnostic) instead.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import random
import secrets
import socket
import threading
import urllib.parse
import xml.etree.ElementTree as ET
from typing import IO, NamedTuple

from kvoff.tools.seaweed import REGION, sigv4_headers
from typing_extensions import Self

__all__ = ["REGION", "S3Client", "S3Response", "ThrottleProxy", "sigv4_headers"]
_LIVE_PROXIES: set[ThrottleProxy] = set()
_LOCK = threading.Lock()


# -- S3 requests signed by hand (SigV4: kvoff.tools.seaweed.sigv4_headers) ------------------


class S3Response(NamedTuple):
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def error_code(self) -> str | None:
        """The ``<Code>`` of an S3 XML error body, else ``None``."""
        text = self.body.decode("utf-8", "replace")
        a, b = text.find("<Code>"), text.find("</Code>")
        return text[a + 6 : b] if 0 <= a < b else None


class S3Client:
    """A minimal path-style S3 client (one keep-alive connection, reopened after an error) for
    the harness and for tests that must check what is stored without boto3."""

    def __init__(self, endpoint: str, access_key: str, secret_key: str, region: str = REGION) -> None:
        u = urllib.parse.urlsplit(endpoint)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.access_key, self.secret_key, self.region = access_key, secret_key, region
        self._conn: http.client.HTTPConnection | None = None

    def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        query: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float = 10.0,
        sign: bool = True,
    ) -> S3Response:
        """One request (``path`` like ``/bucket/key``); raises ``OSError`` when the connection
        fails (the next request opens a new one)."""
        q = dict(query or {})
        hdrs = (
            sigv4_headers(
                method, f"{self.host}:{self.port}", path, q, body, self.access_key, self.secret_key,
                self.region, headers,
            )
            if sign
            else dict(headers or {})
        )  # fmt: skip
        target = urllib.parse.quote(path, safe="/-_.~") + ("?" + urllib.parse.urlencode(q) if q else "")
        for attempt in range(2):
            reused = self._conn is not None
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
            self._conn.timeout = timeout_s
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout_s)
            try:
                self._conn.request(method, target, body=body, headers=hdrs)
                r = self._conn.getresponse()
                return S3Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
            except (OSError, http.client.HTTPException) as e:
                self.close()
                # A kept-alive connection the server closed meanwhile (a restart): once more, anew.
                stale = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
                if not (reused and attempt == 0 and isinstance(e, stale)):
                    raise OSError(f"S3 {method} {path}: {e!r}") from e
        raise AssertionError("unreachable")

    def create_bucket(self, bucket: str) -> None:
        r = self.request("PUT", f"/{bucket}")
        if r.status != 200 and r.error_code() not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise RuntimeError(f"CreateBucket {bucket}: {r.status} {r.body[:300]!r}")

    def put_object(self, bucket: str, key: str, data: bytes) -> None:
        r = self.request("PUT", f"/{bucket}/{key}", body=data)
        if r.status != 200:
            raise RuntimeError(f"PutObject {bucket}/{key}: {r.status} {r.body[:300]!r}")

    def get_object(self, bucket: str, key: str) -> bytes | None:
        """The object's bytes, or ``None`` when it does not exist (404)."""
        r = self.request("GET", f"/{bucket}/{key}")
        if r.status == 404:
            return None
        if r.status != 200:
            raise RuntimeError(f"GetObject {bucket}/{key}: {r.status} {r.body[:300]!r}")
        return r.body

    def list_keys(self, bucket: str, prefix: str = "", page: int = 1000) -> list[str]:
        """Every key under ``prefix`` (ListObjectsV2, ``page`` keys a request), in S3's order."""
        keys: list[str] = []
        token: str | None = None
        while True:
            q = {"list-type": "2", "prefix": prefix, "max-keys": str(page)}
            if token:
                q["continuation-token"] = token
            r = self.request("GET", f"/{bucket}", query=q)
            if r.status != 200:
                raise RuntimeError(f"ListObjectsV2 {bucket}/{prefix}: {r.status} {r.body[:300]!r}")
            root = ET.fromstring(r.body)
            ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
            keys += [k.text or "" for k in root.iter(f"{ns}Key")]
            token = root.findtext(f"{ns}NextContinuationToken")
            if root.findtext(f"{ns}IsTruncated") != "true" or not token:
                return keys

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten client: its socket closes without a ResourceWarning
        with contextlib.suppress(Exception):
            self.close()


# -- an HTTP proxy that throttles --------------------------------------------------------------


class ThrottleProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 (``self.port``, ``self.endpoint``) in front of an S3 port,
    that answers requests with an S3 XML error instead of forwarding them: all (``throttle()``),
    a fraction at random (``throttle(0.3)``, seeded), or the next ``n`` (``throttle_next(n)``);
    default ``503 SlowDown``. Otherwise requests and responses pass unchanged (the ``Host`` header
    too, so SigV4 signatures made for the proxy's address stay valid). Keep-alive works; a request
    with ``Expect: 100-continue`` gets its ``100 Continue`` from the proxy. Bodies are framed by
    ``Content-Length`` or chunked transfer encoding. ``connections`` (accepted), ``requests`` and
    ``throttled`` count what came through."""

    def __init__(self, target_port: int, *, seed: int = 0) -> None:
        self.target = ("127.0.0.1", target_port)
        self._ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._ls.bind(("127.0.0.1", 0))
        self._ls.listen(128)
        self._ls.settimeout(0.2)
        self.port: int = self._ls.getsockname()[1]
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._fraction, self._next = 0.0, 0
        self._status, self._code = 503, "SlowDown"
        self.requests = self.throttled = self.connections = 0
        self._closed = False
        self._socks: set[socket.socket] = set()
        self._threads = [threading.Thread(target=self._accept_loop, daemon=True)]
        self._threads[0].start()
        with _LOCK:
            _LIVE_PROXIES.add(self)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def throttle(self, fraction: float = 1.0, status: int = 503, code: str = "SlowDown") -> None:
        """Answer each request with ``status``/``code`` with this probability (1.0: all)."""
        with self._lock:
            self._fraction, self._status, self._code = fraction, status, code

    def throttle_next(self, n: int, status: int = 503, code: str = "SlowDown") -> None:
        """Answer the next ``n`` requests with the error, then pass (the fraction still applies)."""
        with self._lock:
            self._next, self._status, self._code = n, status, code

    def resume(self) -> None:
        with self._lock:
            self._fraction, self._next = 0.0, 0

    def close(self) -> None:
        self._closed = True
        with self._lock:
            socks = list(self._socks)
        for s in [self._ls, *socks]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2)
        with _LOCK:
            _LIVE_PROXIES.discard(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                c, _ = self._ls.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            c.settimeout(None)
            with self._lock:
                self.connections += 1
            t = threading.Thread(target=self._serve, args=(c,), daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _decide(self) -> tuple[int, str] | None:
        with self._lock:
            self.requests += 1
            hit = self._next > 0 or (self._fraction > 0 and self._rng.random() < self._fraction)
            self._next = max(0, self._next - 1)
            if hit:
                self.throttled += 1
                return self._status, self._code
            return None

    def _serve(self, c: socket.socket) -> None:
        up: list[tuple[socket.socket, IO[bytes]]] = []  # the upstream connection, once opened
        with self._lock:
            self._socks.add(c)
        cf = c.makefile("rb")
        try:
            while not self._closed:
                head = _read_head(cf)
                if head is None:
                    return
                method, target = head[0].split(" ")[:2]
                h = _header_map(head)
                expect = h.get("expect", "").lower() == "100-continue"
                err = self._decide()
                if err is not None:
                    if not expect:
                        _read_body(cf, h)
                    c.sendall(_error_response(method, target, *err, close=expect))
                    if expect:
                        return  # the client may or may not send the body now: start afresh
                    continue
                if expect:  # the header stays (it may be signed): the server's 100 is dropped
                    c.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + _read_body(cf, h)
                response = self._forward(up, method, request)
                if response is None:
                    return  # the server closed or reset: so does the proxy, to the client
                c.sendall(response[0])
                if response[1] or "close" in h.get("connection", "").lower():
                    return
        except (OSError, ValueError, IndexError):
            return
        finally:
            for s in [c, *(u[0] for u in up)]:
                with contextlib.suppress(OSError):
                    s.close()
                with self._lock:
                    self._socks.discard(s)

    def _forward(
        self, up: list[tuple[socket.socket, IO[bytes]]], method: str, request: bytes
    ) -> tuple[bytes, bool] | None:
        """Send one request upstream (a kept-alive connection that the server closed meanwhile is
        replaced once); the response as received and whether the connection closes after it."""
        for attempt in range(2):
            fresh = not up
            if fresh:
                s = socket.create_connection(self.target, timeout=60)
                with self._lock:
                    self._socks.add(s)
                up.append((s, s.makefile("rb")))
            s, f = up[0]
            try:
                s.sendall(request)
                rhead = _read_head(f)
                while rhead is not None and rhead[0].split(" ")[1].startswith("1"):
                    rhead = _read_head(f)  # the server's own 100 Continue: the client had ours
            except OSError:
                rhead = None
            if rhead is None:
                with contextlib.suppress(OSError):
                    s.close()
                with self._lock:
                    self._socks.discard(s)
                up.clear()
                if fresh or attempt:
                    return None
                continue
            rh = _header_map(rhead)
            status = int(rhead[0].split(" ")[1])
            no_body = method == "HEAD" or status in (204, 304) or status < 200
            body = b"" if no_body else _read_body(f, rh, to_eof=True)
            framed = "content-length" in rh or "chunked" in rh.get("transfer-encoding", "").lower()
            closing = "close" in rh.get("connection", "").lower() or not (no_body or framed)
            return ("\r\n".join(rhead) + "\r\n\r\n").encode("latin-1") + body, closing
        return None


def _read_head(f: IO[bytes]) -> list[str] | None:
    """The request or status line and header lines of one message; ``None`` at end of stream."""
    lines: list[str] = []
    while True:
        ln = f.readline(65537)
        if not ln:
            return None
        s = ln.decode("latin-1").rstrip("\r\n")
        if not s:
            if lines:
                return lines
            continue  # stray CRLF between messages
        lines.append(s)


def _header_map(head: list[str]) -> dict[str, str]:
    return {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in head[1:])}


def _read_body(f: IO[bytes], h: dict[str, str], to_eof: bool = False) -> bytes:
    """A message's body as sent (chunked framing kept): by Content-Length, chunked, else none
    (a request) or up to the end of the stream (a response)."""
    if "chunked" in h.get("transfer-encoding", "").lower():
        out = bytearray()
        while True:
            size_line = f.readline(65537)
            out += size_line
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, up to the empty line
                    t = f.readline(65537)
                    out += t
                    if t in (b"\r\n", b"\n", b""):
                        return bytes(out)
            out += f.read(size + 2)
    if "content-length" in h:
        n = int(h["content-length"])
        data = f.read(n)
        if len(data) != n:
            raise OSError("connection closed mid-body")
        return data
    return f.read() if to_eof else b""


def _error_response(method: str, target: str, status: int, code: str, close: bool) -> bytes:
    reason = {503: "Slow Down", 500: "Internal Server Error"}.get(status, "Error")
    rid = secrets.token_hex(8).upper()
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>Please reduce your request rate.</Message>"
        f"<Resource>{urllib.parse.urlsplit(target).path}</Resource><RequestId>{rid}</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
        f"x-amz-request-id: {rid}\r\nConnection: {'close' if close else 'keep-alive'}\r\n\r\n"
    ).encode()
    return head if method == "HEAD" else head + body


def close_all() -> None:
    """Close every proxy of this process still open (atexit)."""
    with _LOCK:
        proxies = list(_LIVE_PROXIES)
    for p in proxies:
        with contextlib.suppress(Exception):
            p.close()


atexit.register(close_all)
