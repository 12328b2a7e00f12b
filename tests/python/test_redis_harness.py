"""The real-server harness of the remote tier's tests (tests/python/redis_servers.py, conftest.py):
Debian's redis-server comes up standalone and as a Cluster, and every fault the tier's tests inject
(SIGKILL, restart empty or with data, SIGSTOP, maxmemory + allkeys-lru, a failover, a stalling /
delaying / dropping proxy) does what it says. Skipped, saying why, only where redis-server is not
installed (scripts/test.sh installs it)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable

import pytest
import redis_servers as rs


def _ping(port: int, timeout_s: float = 2.0) -> bytes:
    """An inline ``PING`` over a fresh connection: ``b"+PONG\\r\\n"``."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): look at its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_versions_are_known() -> None:
    if rs.missing_reason():
        pytest.skip(rs.missing_reason() or "")
    v = rs.server_version()
    print(v)
    assert "v=" in v
    assert rs.benchmark_binary() is not None, "redis-benchmark (Debian package redis-tools) is missing"


def test_standalone_session_server(redis_server: rs.RedisServer) -> None:
    s = redis_server
    assert s.url.startswith("redis://127.0.0.1:")
    assert _ping(s.port) == b"+PONG\r\n"
    assert s.cli("SET", "harness:k", "v") == "OK" and s.cli("GET", "harness:k") == "v"
    # loopback only, no persistence
    assert s.config_get("bind") == "127.0.0.1"
    assert s.config_get("save") == "" and s.config_get("appendonly") == "no"
    s.cli("DEL", "harness:k")


def test_session_server_is_the_product_asked_for(redis_server: rs.RedisServer) -> None:
    """scripts/test.sh runs the remote tier's tests twice: on Debian's Redis 7 and on Valkey 8
    (``KVOFF_REDIS_SERVER`` and ``KVOFF_EXPECT_SERVER=valkey``); the second pass must really talk to
    Valkey, not fall back to whatever ``redis-server`` is on ``PATH``."""
    info = redis_server.info("server")
    product = "valkey" if "valkey_version" in info else "redis"
    print(product, info.get("valkey_version") or info.get("redis_version"))
    expect = os.environ.get("KVOFF_EXPECT_SERVER")
    if expect:
        assert product == expect, f"{expect} asked for, {product} answered: {info}"
    major = int((info.get("valkey_version") or info["redis_version"]).split(".")[0])
    assert major >= 7, info  # Redis ≥ 7; Valkey began at 7.2


def test_cluster_session_is_ok(redis_cluster: rs.RedisCluster) -> None:
    c = redis_cluster
    assert len(c.nodes) == 3 and len(c.masters()) == 3
    for nd in c.nodes:
        ci = c.cluster_info(nd)
        assert ci["cluster_state"] == "ok" and ci["cluster_slots_assigned"] == "16384", ci
        assert ci["cluster_known_nodes"] == "3"
    # keys spread over the masters, each served by the node that owns its slot
    owners = set()
    for i in range(12):
        k = f"harness:{i}"
        assert c.nodes[0].cli("-c", "SET", k, str(i)) == "OK"
        m = c.master_for_key(k)
        owners.add(m.port)
        assert m.cli("GET", k) == str(i)
        m.cli("DEL", k)
    assert len(owners) == 3


def test_kill_and_restart_empty(redis_factory: Callable[..., rs.RedisServer]) -> None:
    s = redis_factory()
    s.cli("SET", "k", "v")
    pid = s.pid
    assert pid is not None
    s.kill()
    assert not s.running() and not _alive(pid)
    with pytest.raises(OSError):
        _ping(s.port, 0.5)
    s.restart()
    assert s.pid != pid and s.dbsize() == 0  # no persistence: back empty, same port
    assert _ping(s.port) == b"+PONG\r\n"


def test_restart_with_data_aof_survives_sigkill(redis_factory: Callable[..., rs.RedisServer]) -> None:
    s = redis_factory(persistence="aof")
    for i in range(50):
        s.cli("SET", f"k{i}", str(i))
    s.kill()  # SIGKILL: appendfsync always kept every acknowledged write
    s.restart()
    assert s.dbsize() == 50 and s.cli("GET", "k49") == "49"
    s.restart(keep_data=False)
    assert s.dbsize() == 0


def test_restart_with_data_rdb(redis_factory: Callable[..., rs.RedisServer]) -> None:
    s = redis_factory(persistence="rdb")
    s.cli("SET", "saved", "1")
    s.save()
    s.cli("SET", "unsaved", "1")
    s.kill()
    s.restart()
    assert s.cli("GET", "saved") == "1" and s.cli("GET", "unsaved") == ""


def test_pause_resume(redis_factory: Callable[..., rs.RedisServer]) -> None:
    s = redis_factory()
    s.pause()
    with pytest.raises(TimeoutError):
        _ping(s.port, 0.5)  # the kernel accepts; the stopped server answers nothing
    s.resume()
    assert _ping(s.port) == b"+PONG\r\n"


def test_maxmemory_allkeys_lru_evicts(redis_factory: Callable[..., rs.RedisServer]) -> None:
    s = redis_factory()
    s.set_maxmemory(4 << 20, "allkeys-lru")
    value = os.urandom(32 << 10).hex()  # 64 KiB of ASCII
    # 200 x 64 KiB = 12.5 MiB into a 4 MiB server, one redis-cli reading the commands from stdin
    s.cli(stdin="".join(f"SET big{i} {value}\n" for i in range(200)).encode(), timeout_s=60)
    info = s.info("stats")
    assert int(info["evicted_keys"]) > 0
    assert s.dbsize() < 200
    assert int(s.info("memory")["used_memory"]) <= 5 << 20


def test_password_acl_and_tls(redis_factory: Callable[..., rs.RedisServer]) -> None:
    s = redis_factory(password="s3cret", acl_users={"kv": "kvpw"}, tls=True)
    assert s.url.startswith("rediss://:s3cret@127.0.0.1:")
    assert s.cli("PING") == "PONG"
    assert s.cli("--user", "kv", "--pass", "kvpw", "ACL", "WHOAMI") == "kv"
    refused = s.cli("--user", "kv", "--pass", "nope", "PING", check=False)
    assert refused.startswith(("WRONGPASS", "NOAUTH")), refused
    # a plain-TCP client gets no answer it could take for Redis
    with socket.create_connection(("127.0.0.1", s.port), timeout=2) as c:
        c.sendall(b"PING\r\n")
        try:
            assert not c.recv(64).startswith(b"+PONG")
        except (TimeoutError, ConnectionResetError):
            pass


@pytest.mark.server_neutral
def test_processes_end_with_close(redis_factory: Callable[..., rs.RedisServer]) -> None:
    s = rs.RedisServer().start()
    pid = s.pid
    assert pid is not None and _alive(pid)
    s.pause()  # even a stopped server is ended
    s.close()
    assert not _alive(pid) and not s.dir.exists()


@pytest.mark.server_neutral
def test_proxy_pass_delay_stall_drop(
    redis_server: rs.RedisServer, fault_proxy: Callable[[int], rs.FaultProxy]
) -> None:
    p = fault_proxy(redis_server.port)
    assert _ping(p.port) == b"+PONG\r\n"
    p.delay(0.2)
    t = time.monotonic()
    assert _ping(p.port) == b"+PONG\r\n"
    assert time.monotonic() - t >= 0.35  # both directions wait
    p.resume()
    with socket.create_connection(("127.0.0.1", p.port), timeout=0.5) as held:
        held.sendall(b"PING\r\n")
        assert held.recv(64) == b"+PONG\r\n"
        p.stall()
        held.sendall(b"PING\r\n")
        with pytest.raises(TimeoutError):
            held.recv(64)  # partition: the open connection hangs
        with pytest.raises(TimeoutError):
            _ping(p.port, 0.5)  # and so does a new one
        p.resume()
        assert held.recv(64) == b"+PONG\r\n"  # what waited goes through after the partition
        p.drop()
        with pytest.raises(OSError):
            held.sendall(b"PING\r\n")
            if not held.recv(64):
                raise ConnectionResetError("closed")
    with pytest.raises(OSError):
        _ping(p.port, 0.5)  # refused (reset) until resume
    p.resume()
    assert _ping(p.port) == b"+PONG\r\n"
    assert p.connections >= 4 and p.bytes_up > 0 and p.bytes_down > 0


def test_proxied_cluster_announces_the_proxies(cluster_factory: Callable[..., rs.RedisCluster]) -> None:
    c = cluster_factory(proxied=True)
    proxy_ports = {p.port for p in c.proxies}
    slots = c.nodes[0].cli("CLUSTER", "SLOTS").splitlines()
    announced = {int(slots[i + 1]) for i, x in enumerate(slots) if x == "127.0.0.1"}  # ip, then port
    assert announced == proxy_ports, (announced, proxy_ports)
    assert [int(u.rsplit(":", 1)[1]) for u in c.urls] == [p.port for p in c.proxies]
    # through a proxy, redirects included (-c follows MOVED to the announced = proxy ports)
    before = sum(p.connections for p in c.proxies)
    for i in range(10):
        out = rs.subprocess.run(
            [rs.cli_binary() or "redis-cli", "-c", "-p", str(c.proxies[0].port), "SET", f"px{i}", "1"],
            capture_output=True,
            timeout=10,
        )
        assert out.stdout.strip() == b"OK"
    assert sum(p.connections for p in c.proxies) > before
    for p in c.proxies:
        p.stall()
    with pytest.raises(TimeoutError):
        _ping(c.proxies[1].port, 0.5)
    for p in c.proxies:
        p.resume()
    assert _ping(c.proxies[1].port) == b"+PONG\r\n"


def test_cluster_failover_after_master_killed(cluster_factory: Callable[..., rs.RedisCluster]) -> None:
    # 3 masters + 3 replicas: the "one master killed" fault needs a replica to take over.
    c = cluster_factory(3, 1, node_timeout_ms=1000)
    assert len(c.nodes) == 6 and len(c.masters()) == 3
    k = "failover-key"
    c.nodes[0].cli("-c", "SET", k, "1")
    victim = c.master_for_key(k)
    c.wait_replicated()
    t = time.monotonic()
    killed = c.kill_master(c.masters().index(victim))
    new = c.wait_failover(killed, timeout_s=30)
    print(f"failover in {time.monotonic() - t:.1f}s: {killed.port} -> {new.port}")
    assert new is not killed and c.master_for_key(k) is new
    assert new.cli("GET", k) == "1"  # replicated before the kill
    killed.restart()
    c.wait_ok()
    assert killed.info("replication")["role"] == "slave"


def test_cluster_master_killed_without_replica(cluster_factory: Callable[..., rs.RedisCluster]) -> None:
    # No replica: the killed master's slots stay down; the others keep serving
    # (cluster-require-full-coverage no), and a restart on the same port brings them back.
    c = cluster_factory(3, 0, node_timeout_ms=1000)
    victim = c.masters()[0]
    victim.kill(signal.SIGKILL)
    deadline = time.monotonic() + 20
    other = c.masters()[0]
    while time.monotonic() < deadline:
        if int(c.cluster_info(other)["cluster_slots_fail"]) > 0:
            break
        time.sleep(0.1)
    assert int(c.cluster_info(other)["cluster_slots_fail"]) > 0
    assert c.cluster_info(other)["cluster_state"] == "ok"
    victim.restart()
    c.wait_ok(30)


@pytest.mark.server_neutral
def test_servers_die_with_a_sigkilled_test_process(tmp_path: rs.Path) -> None:
    # No atexit or finalizer runs in a SIGKILLed process: setpriv --pdeathsig ends its servers.
    if rs.missing_reason():
        pytest.skip(rs.missing_reason() or "")
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); import redis_servers as rs\n"
        "s = rs.RedisServer().start(); print(s.pid, flush=True); time.sleep(60)\n"
    )
    p = rs.subprocess.Popen(
        [sys.executable, "-c", code, os.path.dirname(rs.__file__)], stdout=rs.subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None
        pid = int(p.stdout.readline())
        assert _alive(pid)
    finally:
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"redis-server {pid} outlived its SIGKILLed parent"


def test_resource_probes(redis_server: rs.RedisServer) -> None:
    assert rs.open_fds() > 2 and rs.thread_count() >= 1 and rs.rss_bytes() > 1 << 20
    before = rs.client_connections(redis_server)
    with socket.create_connection(("127.0.0.1", redis_server.port)) as c:
        c.sendall(b"PING\r\n")
        c.recv(64)
        assert rs.client_connections(redis_server) == before + 1
