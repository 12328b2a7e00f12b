"""The remote tier (docs/tier.md) against a real Redis Cluster, through the Python API
(``kvoff.tier.TieredOffloadingManager(..., remote_url=..., remote_cluster=True)``), and the
Cluster faults of issue 26 §4: slot routing between two engines (their own host memory, no disk),
one master SIGKILLed (with a replica to take over, and without), and a network partition of every
node (a stalling proxy in front of each, the nodes announcing the proxies).

In every case: the scheduler thread's calls return at once (no call waits on the network), every
lookup ends (``True`` or ``False``, never pending for ever), nothing served differs from what was
stored, the tier recovers when the Cluster does, and threads and file descriptors do not grow.

Skipped, saying why, while this build of kvoff has no remote tier or where redis-server is not
installed (scripts/test.sh installs Debian's).
"""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import Callable
from typing import Any

import kvoff
import numpy as np
import pytest
import redis_servers as rs
from kvoff.tier import TieredOffloadingManager

if "remote_url" not in inspect.signature(TieredOffloadingManager).parameters:
    pytest.skip(
        "this build of kvoff has no remote tier (TieredOffloadingManager takes no remote_url); "
        "the remote tier of issue 26 brings it",
        allow_module_level=True,
    )

BLOCK = 64 * 1024
#: The slowest a scheduler-thread call may be while the Cluster is slow, failing or cut off: well
#: below the network timeouts (a call that waited on the network would take 1 s or more here), far
#: above a call's normal cost even on a busy 2-core machine that may preempt the test for a while.
CALL_LIMIT_S = 0.25
TIMEOUT_S = 1.0


def K(i: int) -> bytes:
    return kvoff.make_offload_key(f"cluster-block-{i}".encode(), 0)


def content(i: int) -> np.ndarray:
    return np.random.default_rng(i + 7).integers(0, 256, BLOCK, dtype=np.uint8)


#: I/O threads of each engine where a test counts connections (the default depends on the CPUs).
IO_THREADS = 2


class Engine:
    """One engine's scheduler side: its own host memory and manager, the remote tier behind it."""

    def __init__(self, url: str, namespace: str, blocks: int = 128, **kw: Any) -> None:
        self.region = kvoff.HostRegion.private(blocks, BLOCK)
        kw.setdefault("remote_timeout_s", TIMEOUT_S)
        kw.setdefault("remote_connect_timeout_s", TIMEOUT_S)
        kw.setdefault("remote_negative_ttl_s", 0.2)
        self.m = TieredOffloadingManager(
            "lru", blocks, self.region, namespace=namespace, remote_url=url, remote_cluster=True, **kw
        )
        self.view = self.region.view_numpy(0, 0, BLOCK)
        self.slowest_call_s = 0.0
        self.closed = False

    def _timed(self, f: Callable[..., Any], *a: Any) -> Any:
        t = time.perf_counter()
        r = f(*a)
        self.slowest_call_s = max(self.slowest_call_s, time.perf_counter() - t)
        return r

    def store(self, ids: list[int]) -> None:
        out = self._timed(self.m.prepare_store, [K(i) for i in ids])
        assert out is not None
        by_key = {K(i): i for i in ids}
        for k, b in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            self.view[int(b)] = content(by_key[k])
        self._timed(self.m.complete_store, out.keys_to_store)

    def resolve(self, i: int, limit_s: float = 20.0) -> bool:
        """Asks as a scheduler does (again at each step while pending) until the answer is final;
        fails if it stays pending past ``limit_s``."""
        deadline = time.monotonic() + limit_s
        while True:
            r = self._timed(self.m.lookup, K(i))
            if r is not None:
                return bool(r)
            assert time.monotonic() < deadline, f"lookup of block {i} still pending after {limit_s}s"
            time.sleep(0.002)

    def load_ok(self, i: int) -> bool:
        """Loads a ready block; whether its bytes are those stored (a wrong one fails the test)."""
        spec = self._timed(self.m.prepare_load, [K(i)])
        data = self.view[int(spec.block_ids[0])].copy()
        self._timed(self.m.complete_load, [K(i)])
        assert np.array_equal(data, content(i)), f"block {i} served with wrong bytes"
        return True

    def stats(self) -> dict[str, Any]:
        return dict(self._timed(self.m.get_stats))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.m.shutdown()
            self.region.close()


def _recovers(a: Engine, make: Callable[..., Engine], url: str, ns: str, first: int) -> int:
    """After a fault: engine ``a`` stores 16 new blocks and a fresh engine must be served all of
    them; a few attempts (new blocks each time: a write that failed while the client's view of
    the Cluster was stale is dropped, not retried). Returns the attempt that succeeded."""
    for attempt in range(6):
        ids = list(range(first + 16 * attempt, first + 16 * (attempt + 1)))
        a.store(ids)
        a.m.flush()
        d = make(url, ns)
        got = sum(d.load_ok(i) for i in ids if d.resolve(i))
        assert d.slowest_call_s < CALL_LIMIT_S, d.slowest_call_s
        d.close()
        if got == len(ids):
            return attempt
        time.sleep(1.0)
    raise AssertionError("the remote tier did not recover: new blocks are still not served")


@pytest.fixture
def engines() -> Any:
    made: list[Engine] = []

    def make(url: str, namespace: str, **kw: Any) -> Engine:
        e = Engine(url, namespace, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_two_engines_share_through_the_cluster(redis_cluster: rs.RedisCluster, engines: Any) -> None:
    ns = f"cl-{uuid.uuid4().hex[:8]}"
    a = engines(redis_cluster.url, ns)
    ids = list(range(96))
    for i in range(0, len(ids), 8):
        a.store(ids[i : i + 8])
    a.m.flush()
    assert a.stats()["remote_writes"] >= len(ids)
    b = engines(redis_cluster.url, ns)
    served = sum(b.load_ok(i) for i in ids if b.resolve(i))
    s = b.stats()
    assert served == len(ids), (served, s)
    assert s["remote_hits"] >= len(ids) and s["remote_rejected_values"] == 0, s
    assert b.slowest_call_s < CALL_LIMIT_S, b.slowest_call_s
    # slot routing: the values spread over the three masters
    per_master = [m.dbsize() for m in redis_cluster.masters()]
    assert all(n > 0 for n in per_master), per_master


@pytest.mark.parametrize("seeds", ["all", "one"])
def test_master_killed_replica_takes_over(
    cluster_factory: Callable[..., rs.RedisCluster], engines: Any, seeds: str
) -> None:
    # The killed master is the first node. With seeds="one" it is also the only node engine A's
    # remote_url names: A, running since before the kill, must carry on through the nodes it
    # learned from the Cluster. (Engines started after the kill get every node as a seed: from
    # a dead single seed nothing can be learned.)
    c = cluster_factory(3, 1, node_timeout_ms=1000)
    url = c.cluster_url
    ns = f"fo-{uuid.uuid4().hex[:8]}"
    a = engines(url if seeds == "all" else c.url, ns)
    ids = list(range(64))
    for i in range(0, len(ids), 8):
        a.store(ids[i : i + 8])
    a.m.flush()
    c.wait_replicated()  # the replicas have every value before the kill
    assert c.masters()[0] is c.nodes[0]
    killed = c.kill_master(0)
    # While the Cluster notices and fails over: every lookup ends, nothing wrong is served, no
    # call waits on the network.
    b = engines(url, ns)
    during = sum(b.load_ok(i) for i in ids if b.resolve(i))
    new = c.wait_failover(killed, timeout_s=30)
    assert new.running()
    # After the failover: everything comes back (the replica had it), new stores go through.
    time.sleep(0.5)  # past the negative cache of b's misses
    fds, threads = rs.open_fds(), rs.thread_count()
    c2 = engines(url, ns)
    after = sum(c2.load_ok(i) for i in ids if c2.resolve(i))
    attempt = _recovers(a, engines, url, ns, 100)
    print(
        f"served during failover {during}/{len(ids)}, after {after}/{len(ids)}; new stores at attempt {attempt}"
    )
    assert after == len(ids)
    for e in (a, b, c2):
        assert e.slowest_call_s < CALL_LIMIT_S, e.slowest_call_s
        assert e.stats()["remote_rejected_values"] == 0
    c2.close()
    assert rs.thread_count() <= threads + 2 and rs.open_fds() <= fds + 8, "threads or fds grew"


def test_master_killed_without_replica_then_restarted(
    cluster_factory: Callable[..., rs.RedisCluster], engines: Any
) -> None:
    # No replica: the killed master's slots are gone until it returns (empty: no persistence).
    # Its keys become misses (or failed fetches), the others keep being served — all of them, to
    # an engine started after the kill (every node as seed) and to engine A, running since before
    # and whose only seed is the killed master; after the restart the tier reconnects and serves
    # again what is stored anew.
    c = cluster_factory(3, 0, node_timeout_ms=1000)
    ns = f"nr-{uuid.uuid4().hex[:8]}"
    a = engines(c.url, ns)
    ids = list(range(48))
    for i in range(0, len(ids), 8):
        a.store(ids[i : i + 8])
    a.m.flush()
    assert c.masters()[0] is c.nodes[0]
    on_victim = c.nodes[0].dbsize()
    assert 0 < on_victim < len(ids), on_victim
    victim = c.kill_master(0)
    b = engines(c.cluster_url, ns)
    t = time.monotonic()
    served = sum(b.load_ok(i) for i in ids if b.resolve(i))
    assert served == len(ids) - on_victim, (served, on_victim)  # the other two masters' share, all of it
    a.m.reset()  # A forgets its host copies: it must fetch through the nodes it learned
    served_a = sum(a.load_ok(i) for i in ids if a.resolve(i))
    assert served_a == len(ids) - on_victim, (served_a, on_victim)
    print(f"live shards' {served} of {len(ids)} served to each engine in {time.monotonic() - t:.2f}s")
    victim.restart()
    c.wait_ok(30)
    _recovers(a, engines, c.cluster_url, ns, 200)
    for e in (a, b):
        assert e.slowest_call_s < CALL_LIMIT_S, e.slowest_call_s
        assert e.stats()["remote_rejected_values"] == 0


def test_partition_of_every_node(cluster_factory: Callable[..., rs.RedisCluster], engines: Any) -> None:
    c = cluster_factory(proxied=True)
    ns = f"pt-{uuid.uuid4().hex[:8]}"
    a = engines(c.url, ns, remote_io_threads=IO_THREADS)
    ids = list(range(32))
    a.store(ids)
    a.m.flush()
    b = engines(c.url, ns, remote_io_threads=IO_THREADS)
    assert all(b.resolve(i) for i in ids)  # b is connected (its threads and connections exist)
    b.m.reset()
    # Counted from here: this process's threads and fds include the proxies' (two threads and two
    # sockets per proxied connection), so b's first connections (one per I/O thread and master, each
    # with its proxy's threads and sockets) must be open before the first count.
    threads0, fds0 = rs.thread_count(), rs.open_fds()
    per_round: list[tuple[int, int]] = []
    proxied0 = sum(p.open_connections() for p in c.proxies)
    proxied: list[int] = []
    for round_ in range(4):
        for p in c.proxies:
            p.stall()
        # cut off: every lookup ends as a miss within the timeouts, no call waits
        t = time.monotonic()
        found = [b.resolve(i, limit_s=10) for i in ids]
        assert time.monotonic() - t < 15
        for i, ok in zip(ids, found, strict=True):
            if ok:
                b.load_ok(i)  # only a block promoted before the cut (round > 0)
        for p in c.proxies:
            p.resume()
        time.sleep(0.3)  # the negative cache (remote_negative_ttl_s) forgets the misses
        deadline = time.monotonic() + 20
        while True:  # reconnects with backoff; then serves
            got = sum(b.load_ok(i) for i in ids if b.resolve(i))
            if got == len(ids) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert got == len(ids), f"round {round_}: {got}/{len(ids)} after the partition ended"
        b.m.reset()  # forget the host copies: the next round must fetch again
        per_round.append((rs.thread_count(), rs.open_fds()))
        proxied.append(sum(p.open_connections() for p in c.proxies))
    s = b.stats()
    assert s["remote_rejected_values"] == 0, s
    assert b.slowest_call_s < CALL_LIMIT_S, b.slowest_call_s
    print(
        f"threads, fds: {threads0}, {fds0} before; after each round {per_round}; "
        f"connections through the proxies (two proxy threads each): {proxied0}, then {proxied}"
    )
    # Connections and threads come back after a partition; they may settle at a higher level
    # once (a pool refilled), but must not grow with every partition. The level of the first two
    # rounds is their larger count: which I/O threads reconnect in a round depends on which took
    # a job, so a round may open fewer connections than the one before (seen: 35, 31, 35, 35
    # threads).
    settled = (max(r[0] for r in per_round[:2]), max(r[1] for r in per_round[:2]))
    assert all(t <= settled[0] and f <= settled[1] for t, f in per_round[2:]), (
        f"threads/fds grow with every partition: {per_round}"
    )
    # Each engine's I/O threads hold at most one connection per master (2 engines x IO_THREADS x 3
    # masters); which threads have connected by the first count depends on which took a job, so
    # the count may settle higher once, then must stay there.
    assert max(proxied) <= 2 * IO_THREADS * 3, f"more connections than threads x masters: {proxied}"
    assert proxied[-1] <= max(proxied0, proxied[0]) + 1, f"connections left open: {proxied0}, then {proxied}"
    # Against the first round (connections of threads that had no job before the first count
    # open once, two proxy threads and three fds each, bounded by the check above).
    t1, f1 = per_round[0]
    assert rs.thread_count() <= t1 + 2 and rs.open_fds() <= f1 + 8, (threads0, fds0, per_round)
