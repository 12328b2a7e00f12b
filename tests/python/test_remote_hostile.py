"""The remote tier against misbehaving servers and misuse (docs/tier.md "Faults"), from Python.

Only a misbehaving server can show these cases, so each test runs a small one on loopback
(:class:`Rogue`, threads): it answers ``PING``/``AUTH``/``SELECT`` at once and every other command
as told — a reply trickled one byte every 50 ms (each read within the timeout, the whole reply
never), ``-MOVED`` to another host, or ``AUTH`` refused by echoing the command. Every call is run
on a thread with a bound, so a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import kvoff
import numpy as np
import pytest
from kvoff import ConfigError
from kvoff._native import BlockStore
from kvoff.tier import TieredOffloadingManager

T = TypeVar("T")
BLOCK = 8192


class Rogue:
    """A misbehaving "server" on loopback; ``how`` is ``"trickle"``, ``"moved:<port>"`` or
    ``"ok"``; ``auth`` the raw reply to ``AUTH`` (default ``+OK``). ``hits`` counts connections."""

    def __init__(self, how: str, auth: bytes | None = None) -> None:
        self.how = how
        self.auth = auth
        self.hits = 0
        self.stop = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self.hits += 1
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()
        self.sock.close()

    def _serve(self, c: socket.socket) -> None:
        c.settimeout(10)
        f = c.makefile("rb")
        try:
            while not self.stop.is_set():
                head = f.readline()
                if not head:
                    return
                args = []
                for _ in range(int(head[1:])):
                    n = int(f.readline()[1:])
                    args.append(f.read(n + 2)[:n])
                name = args[0].upper()
                if name == b"PING":
                    c.sendall(b"+PONG\r\n")
                elif name in (b"SELECT", b"HELLO"):
                    c.sendall(b"+OK\r\n")
                elif name == b"AUTH":
                    c.sendall(self.auth or b"+OK\r\n")
                elif self.how == "trickle":
                    c.sendall(b"$100000000\r\n")
                    while not self.stop.is_set():
                        c.sendall(b"x")
                        time.sleep(0.05)
                    return
                elif self.how.startswith("moved:"):
                    c.sendall(f"-MOVED 1 127.0.0.1:{self.how[6:]}\r\n".encode())
                else:
                    c.sendall(b"+OK\r\n")
        except (OSError, ValueError):
            return
        finally:
            c.close()

    def close(self) -> None:
        self.stop.set()


@pytest.fixture
def rogues() -> Iterator[Callable[..., Rogue]]:
    made: list[Rogue] = []

    def make(how: str, auth: bytes | None = None) -> Rogue:
        r = Rogue(how, auth)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def within(limit: float, what: str, f: Callable[[], T]) -> tuple[T, float]:
    """``f()`` on a thread; fails when it takes longer than ``limit`` seconds. Result, seconds."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("ok", f()))
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            out.append(("err", e))

    t0 = time.monotonic()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    took = time.monotonic() - t0
    assert out, f"{what} took longer than {limit} s"
    kind, v = out[0]
    if kind == "err":
        raise v
    return v, took


QUICK = {"remote_timeout_s": 0.5, "remote_connect_timeout_s": 0.3, "remote_negative_ttl_s": 0.2}


def test_trickling_server_bounds_manager_calls(rogues: Callable[..., Rogue]) -> None:
    """flush() and shutdown() of the tiered manager end within their bounds (a node's replies
    within one I/O timeout) against a server that sends every reply one byte at a time."""
    srv = rogues("trickle")
    region = kvoff.HostRegion.private(8, BLOCK)
    m = TieredOffloadingManager("lru", 8, region, remote_url=srv.url, namespace="tr", **QUICK)
    keys = [b"k%d" % i for i in range(4)]
    out = m.prepare_store(keys)
    assert out is not None
    m.complete_store(out.keys_to_store)
    _, took = within(5, "flush()", m.flush)
    assert took < 2.5, took
    st = m.get_stats()
    assert st["remote_writes"] == 0 and st["remote_write_errors"] >= 1, st
    assert "timed out" in st["remote_last_error"], st
    _, took = within(5, "shutdown()", m.shutdown)
    assert took < 2.5, took
    region.close()


def test_trickling_server_bounds_block_store(rogues: Callable[..., Rogue]) -> None:
    """The same through BlockStore (SGLang's and vLLM tiering's surface): write_segments, flush
    and shutdown return within their bounds; the writes are reported failed."""
    srv = rogues("trickle")
    store = BlockStore(
        None,
        1 << 20,
        BLOCK,
        namespace="tr",
        page_sizes=[BLOCK],
        remote_url=srv.url,
        remote_timeout_s=0.5,
        remote_connect_timeout_s=0.3,
    )
    buf = np.zeros((4, BLOCK), dtype=np.uint8)
    ptrs = [int(buf[i].ctypes.data) for i in range(4)]
    ok, took = within(
        5, "write_segments", lambda: store.write_segments([b"a", b"b", b"c", b"d"], ptrs, [BLOCK] * 4)
    )
    assert took < 2.5 and not any(ok), (took, ok)
    _, took = within(5, "flush()", store.flush)
    assert took < 2.5, took
    assert store.stats()["remote_write_errors"] >= 1
    _, took = within(5, "shutdown()", store.shutdown)
    assert took < 2.5, took


def test_standalone_moved_is_never_followed(rogues: Callable[..., Rogue]) -> None:
    """A standalone server answering MOVED: the write fails (counted, the reason kept) and no
    connection — no AUTH with the password, no data — goes to the named host."""
    target = rogues("ok")
    liar = rogues(f"moved:{target.port}")
    region = kvoff.HostRegion.private(4, BLOCK)
    url = f"redis://:hunter2@127.0.0.1:{liar.port}"
    m = TieredOffloadingManager("lru", 4, region, remote_url=url, namespace="mv", **QUICK)
    try:
        out = m.prepare_store([b"k"])
        assert out is not None
        m.complete_store(out.keys_to_store)
        m.flush()
        st = m.get_stats()
        assert st["remote_writes"] == 0 and st["remote_write_errors"] == 1, st
        assert "MOVED" in st["remote_last_error"] and "hunter2" not in st["remote_last_error"]
        assert target.hits == 0, "the redirect was followed"
    finally:
        m.shutdown()
        region.close()


def test_password_never_shown(rogues: Callable[..., Rogue]) -> None:
    """No password in a ConfigError, repr or stats: with a comma in it (URL forms of both kinds),
    and when a server refuses AUTH by echoing the command."""
    region = kvoff.HostRegion.private(4, BLOCK)
    for url in ("redis://:hunter2,xyz@", "redis+cluster://:hunter2,xyz@127.0.0.1:1,"):
        with pytest.raises(ConfigError) as e:
            TieredOffloadingManager("lru", 4, region, remote_url=url, **QUICK)
        assert "hunter2" not in str(e.value) and "xyz" not in str(e.value), str(e.value)
    pw = "hunter2,s3cr@t"
    echo = rogues("ok", auth=f"-ERR invalid password 'AUTH {pw}'\r\n".encode())
    url = f"redis://:hunter2%2Cs3cr%40t@127.0.0.1:{echo.port}"
    m = TieredOffloadingManager("lru", 4, region, remote_url=url, namespace="pw", **QUICK)
    try:
        out = m.prepare_store([b"k"])
        assert out is not None
        m.complete_store(out.keys_to_store)
        m.flush()
        st = m.get_stats()
        assert st["remote_write_errors"] == 1 and "AUTH" in st["remote_last_error"], st
        shown = f"{st} {m!r} {m.remote_url}"
        assert "hunter2" not in shown and "s3cr" not in shown, shown
    finally:
        m.shutdown()
        region.close()


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory"])
def test_tls_ca_file_that_is_no_regular_file(tmp_path: Path, kind: str) -> None:
    """A FIFO, /dev/zero or a directory as remote_tls_ca_file: a clean ConfigError at once, and
    the interpreter's other threads run meanwhile (the file is read without the GIL)."""
    if kind == "fifo":
        path = tmp_path / "ca.fifo"
        os.mkfifo(path)
    elif kind == "dev_zero":
        path = Path("/dev/zero")
    else:
        path = tmp_path
    region = kvoff.HostRegion.private(4, BLOCK)
    ticks = 0
    done = threading.Event()

    def tick() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()

    def build() -> None:
        TieredOffloadingManager(
            "lru", 4, region, remote_url="rediss://127.0.0.1:1", remote_tls_ca_file=str(path), **QUICK
        )

    try:
        with pytest.raises(ConfigError, match="TLS CA file"):
            within(5, "construction", build)
    finally:
        done.set()
        ticker.join()
        region.close()
