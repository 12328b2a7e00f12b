"""The object tier through Python (docs/tier.md "Object tier") against a real SeaweedFS started by the
harness (tests/python/seaweed.py, fixtures in conftest.py): two engines share blocks, the settings'
errors, and the faults the Rust suite (tests/tier_object.rs) cannot stage — throttling answers
(``503 SlowDown``) from a proxy, the bucket deleted under the engine, credentials that stop working,
a ``fork()``ed child — each ending as misses or failed stores, counted, with nothing wrong served,
every scheduler call returning at once, and no thread left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import kvoff
import numpy as np
import pytest
import s3_http
import seaweed as sw
from kvoff.tier import TieredOffloadingManager

BLOCK = 32 * 1024
NUM = 32


def K(i: int) -> bytes:
    return kvoff.make_offload_key(f"oblock-{i}".encode(), 0)


def content(i: int) -> np.ndarray:
    return np.random.default_rng(i + 11).integers(0, 256, BLOCK, dtype=np.uint8)


class Engine:
    """One engine's host memory with the object tier behind it."""

    def __init__(self, srv: sw.SeaweedServer, namespace: str, endpoint: str | None = None, **kw: Any) -> None:
        self.region = kvoff.HostRegion.private(NUM, BLOCK)
        kw.setdefault("object_timeout_s", 1.0)
        kw.setdefault("object_connect_timeout_s", 0.3)
        kw.setdefault("object_negative_ttl_s", 0.2)
        kw.setdefault("object_max_retries", 1)
        self.m = TieredOffloadingManager(
            "lru",
            NUM,
            self.region,
            object_url=f"s3://{srv.bucket}/kv",
            object_endpoint=endpoint or srv.endpoint,
            object_bytes_to_use=1 << 30,
            namespace=namespace,
            **kw,
        )

    def rows(self) -> np.ndarray:
        return self.region.view_numpy(0, 0, BLOCK)

    def store(self, ids: list[int]) -> None:
        out = self.m.prepare_store([K(i) for i in ids])
        assert out is not None
        by_key = {K(i): i for i in ids}
        view = self.rows()
        for k, b in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            view[b] = content(by_key[k])
        self.m.complete_store(out.keys_to_store)

    def settle(self, ids: list[int], timeout: float = 10.0) -> int:
        """Polls lookup_prefix until it answers (each call bounded); the answer."""
        keys = [K(i) for i in ids]
        t0 = time.monotonic()
        while True:
            t = time.perf_counter()
            n = self.m.lookup_prefix(keys)
            assert time.perf_counter() - t < 0.05, "a lookup waited"
            if n is not None:
                return n
            assert time.monotonic() - t0 < timeout, "lookup stayed pending"
            time.sleep(0.002)

    def found(self, ids: list[int], timeout: float = 10.0) -> int:
        """How many of the prefix the tier serves once its lookups and promotions settle."""
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < timeout:
            n = self.settle(ids)
            self.m.flush()
            if n == len(ids) or self.settle(ids) == n:
                return self.settle(ids)
        return n

    def check(self, ids: list[int]) -> None:
        keys = [K(i) for i in ids]
        spec = self.m.prepare_load(keys)
        view = self.rows()
        for i, b in zip(ids, spec.block_ids, strict=True):
            assert np.array_equal(view[int(b)], content(i)), f"block {i} served wrong bytes"
        self.m.complete_load(keys)

    def stats(self) -> dict[str, Any]:
        return self.m.get_stats()

    def close(self) -> None:
        self.m.shutdown()
        self.region.close()


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(srv: sw.SeaweedServer, *a: Any, **kw: Any) -> Engine:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", srv.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", srv.secret_key)
        e = Engine(srv, *a, **kw)
        made.append(e)
        return e

    try:
        yield make
    finally:
        for e in made:
            e.close()


def test_two_engines_share_blocks_and_report_metrics(
    seaweed: sw.SeaweedServer, engines: Callable[..., Engine]
) -> None:
    ns = f"share-{os.getpid()}"
    a = engines(seaweed, ns)
    a.store(list(range(10)))
    a.m.flush()
    s = a.stats()
    assert s["object_writes"] == 10 and s["object_bytes_written"] == 10 * BLOCK, s
    assert s["num_evictable"] == 10  # write pins released
    assert s["object_up"] == 1 and s["object_known_bytes"] > 10 * BLOCK
    b = engines(seaweed, ns)
    assert b.found(list(range(12))) == 10
    b.check(list(range(10)))
    sb = b.stats()
    assert sb["object_promotions"] == 10 and sb["object_rejected_values"] == 0, sb
    assert engines(seaweed, ns + "-other").found(list(range(10))) == 0


def test_throttling_answers_end_as_failed_stores_then_recover(
    seaweed: sw.SeaweedServer,
    engines: Callable[..., Engine],
    s3_throttle_proxy: Callable[[int], s3_http.ThrottleProxy],
) -> None:
    proxy = s3_throttle_proxy(seaweed.port)
    proxy.throttle(1.0)  # every request: 503 SlowDown
    e = engines(seaweed, f"slow-{os.getpid()}", endpoint=proxy.endpoint)
    t = time.perf_counter()
    e.store([1, 2, 3])
    assert time.perf_counter() - t < 0.05
    e.m.flush()
    s = e.stats()
    assert s["object_writes"] == 0 and s["object_write_errors"] >= 1, s
    assert "SlowDown" in (s["object_last_error"] or "") or "503" in (s["object_last_error"] or "")
    assert s["object_up"] == 0
    assert proxy.throttled >= 2  # retried before it gave up
    # Lookups while throttled: misses at once.
    assert e.settle(list(range(100, 110))) == 0
    proxy.resume()
    t0 = time.monotonic()
    i = 200
    while e.stats()["object_writes"] == 0:
        assert time.monotonic() - t0 < 10, e.stats()
        e.store([i])
        e.m.flush()
        i += 1
        time.sleep(0.1)
    s = e.stats()
    assert s["object_reconnects"] >= 1 and s["object_up"] == 1, s


def test_bucket_deleted_under_the_engine(
    seaweed_factory: Callable[..., sw.SeaweedServer], engines: Callable[..., Engine]
) -> None:
    srv = seaweed_factory(buckets=("gone",))
    e = engines(srv, "ns")
    e.store([1, 2])
    e.m.flush()
    assert e.stats()["object_writes"] == 2
    weed_shell(srv, "s3.bucket.delete -name gone")
    b = engines(srv, "ns")
    assert b.found([1, 2]) == 0  # nothing served
    e.store([3, 4])
    e.m.flush()
    s = e.stats()
    assert s["object_write_errors"] >= 1, s
    assert "NoSuchBucket" in (s["object_last_error"] or ""), s["object_last_error"]
    assert b.stats()["object_promotions"] == 0


def test_credentials_refused_are_counted_never_shown(
    seaweed: sw.SeaweedServer, engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engines(seaweed, f"creds-{os.getpid()}")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "revoked-secret-0123456789")
    region = kvoff.HostRegion.private(NUM, BLOCK)
    bad = TieredOffloadingManager(
        "lru",
        NUM,
        region,
        object_url=f"s3://{seaweed.bucket}/kv",
        object_endpoint=seaweed.endpoint,
        object_bytes_to_use=1 << 30,
        namespace=f"creds-{os.getpid()}",
        object_timeout_s=1.0,
        object_max_retries=0,
    )
    try:
        out = bad.prepare_store([K(1)])
        assert out is not None
        bad.complete_store(out.keys_to_store)
        bad.flush()
        s = bad.get_stats()
        assert s["object_writes"] == 0 and s["object_write_errors"] == 1, s
        err = s["object_last_error"] or ""
        assert "revoked-secret" not in err and seaweed.secret_key not in err
        assert "403" in err or "Access" in err or "Signature" in err, err
    finally:
        bad.shutdown()
        region.close()
    # The other engine, with good credentials, is unaffected.
    e.store([5])
    e.m.flush()
    assert e.stats()["object_writes"] == 1


def test_settings_errors(seaweed: sw.SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    region = kvoff.HostRegion.private(4, BLOCK)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)

    def make(**kw: Any) -> None:
        kw.setdefault("object_url", "s3://bkt/kv")
        kw.setdefault("object_bytes_to_use", 1 << 20)
        kw.setdefault("object_endpoint", seaweed.endpoint)
        TieredOffloadingManager("lru", 4, region, **kw).shutdown()

    make()
    with pytest.raises(kvoff.ConfigError, match="object_bytes_to_use"):
        make(object_bytes_to_use=None)
    for url in ("s3:///kv", "http://bkt/kv", "s3://B/kv", "s3://bkt/a//b"):
        with pytest.raises(kvoff.ConfigError, match="object_url"):
            make(object_url=url)
    with pytest.raises(kvoff.ConfigError, match="object_endpoint"):
        make(object_endpoint="ftp://x")
    with pytest.raises(TypeError, match="object_io_threads"):
        make(object_io_threads=True)
    with pytest.raises(ValueError, match="object_io_threads"):
        make(object_io_threads=0)
    with pytest.raises(ValueError, match="object_multipart_bytes"):
        make(object_multipart_bytes=1)
    with pytest.raises(TypeError, match="object_nonsense"):
        make(object_nonsense=1)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    with pytest.raises(kvoff.ConfigError, match="no credentials"):
        make()
    region.close()


def test_a_forked_child_gets_a_clear_error_and_shuts_down_without_waiting(
    seaweed: sw.SeaweedServer, engines: Callable[..., Engine]
) -> None:
    e = engines(seaweed, f"fork-{os.getpid()}")
    e.store([1])
    e.m.flush()
    pid = os.fork()
    if pid == 0:  # the child: the runtime's threads exist only in the parent
        code = 1
        try:
            try:
                e.m.lookup(K(1))
            except kvoff.InvalidStateError as err:
                code = 0 if "fork" in str(err) else 2
            e.m.shutdown()  # must not wait for the parent's threads
        finally:
            os._exit(code)
    t0 = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > 30:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the forked child hung")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    e.store([2])
    e.m.flush()
    assert e.stats()["object_writes"] == 2  # the parent keeps working


def test_threads_are_bounded_across_many_engines(
    seaweed: sw.SeaweedServer, engines: Callable[..., Engine]
) -> None:
    e0 = engines(seaweed, "many-warm")  # the process's own threads (numpy, the first runtime) started
    e0.store([0])
    e0.m.flush()
    before = len(os.listdir("/proc/self/task"))
    for i in range(8):
        e = Engine(seaweed, f"many-{i}")
        e.store([i])
        e.m.flush()
        e.close()
    t0 = time.monotonic()
    while len(os.listdir("/proc/self/task")) > before and time.monotonic() - t0 < 3:
        time.sleep(0.02)
    assert len(os.listdir("/proc/self/task")) <= before


def weed_shell(srv: sw.SeaweedServer, command: str) -> str:
    out = subprocess.run(
        [srv.binary, "shell", f"-master={srv.master_address}"],
        input=command + "\n",
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return out.stdout + out.stderr
