"""``kvoff bench remote`` (python/kvoff/tools/bench_remote.py): the same-run references (redis-benchmark's
best SET/GET, redis-py pipelined SET/GET) against the real session redis-server, and the command
line end to end on a private server. Small sizes: this checks the machinery, not the figures
(BENCHMARKS.md has those)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import redis_servers as rs
from kvoff.tools import bench_remote as br
from kvoff.tools import bench_remote_refs as brr
from kvoff.tools.cli import main


def test_url_parsing() -> None:
    t = br.RedisTarget.from_url("rediss://alice:p%40ss@10.0.0.1:7000/2")
    assert (t.host, t.port, t.username, t.password, t.tls, t.db) == (
        "10.0.0.1",
        7000,
        "alice",
        "p@ss",
        True,
        2,
    )
    assert "p@ss" not in " ".join(t.tool_args())  # the password travels in REDISCLI_AUTH only
    assert t.tool_env()["REDISCLI_AUTH"] == "p@ss"
    assert br.RedisTarget.from_url("redis://h").port == 6379
    c = br.RedisTarget.from_url("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001")
    assert (c.host, c.port, c.password, c.tls) == ("10.0.0.1", 7000, "pw", False)
    assert c.url() == "redis://:pw@10.0.0.1:7000"
    assert br.RedisTarget.from_url(t.url()) == t
    with pytest.raises(ValueError):
        br.RedisTarget.from_url("http://h:1")


def test_benchmark_csv_parsing() -> None:
    out = '"test","rps","avg_latency_ms"\n"SET","1500.50","1.0"\n"GET","2000.00","0.5"\n'
    assert brr._parse_benchmark_csv(out) == {"SET": 1500.5, "GET": 2000.0}


def test_redis_benchmark_best(redis_server: rs.RedisServer) -> None:
    r = br.redis_benchmark_best(
        redis_server.url, 32 << 10, pipelines=(1, 4), clients=(1, 2), run_bytes=8 << 20
    )
    assert len(r["grid"]) == 2 * 2 * 2
    for op in ("set", "get"):
        best = r[op]
        assert best["gb_s"] > 0 and best["pipeline"] in (1, 4) and best["clients"] in (1, 2)
        assert best["gb_s"] == max(g["gb_s"] for g in r["grid"] if g["op"] == op)


def test_redis_benchmark_keyspace(redis_server: rs.RedisServer) -> None:
    # -r over 40 keys, written beforehand; every benchmark key is gone afterwards.
    r = br.redis_benchmark_best(
        redis_server.url, 32 << 10, pipelines=(1,), clients=(2,), run_bytes=4 << 20, keyspace=40
    )
    assert r["set"]["gb_s"] > 0 and r["get"]["gb_s"] > 0
    assert redis_server.cli("KEYS", "key:*") == ""


def test_redis_benchmark_password(redis_factory: object) -> None:
    srv = redis_factory(password="pw")  # type: ignore[operator]
    r = br.redis_benchmark_best(srv.url, 4096, pipelines=(1,), clients=(1,), run_bytes=1 << 20)
    assert r["set"]["gb_s"] > 0


@pytest.mark.skipif(importlib.util.find_spec("redis") is None, reason="redis-py is not installed")
def test_redis_py_reference(redis_server: rs.RedisServer) -> None:
    r = br.redis_py_pipelined(redis_server.url, 32 << 10, 64, pipeline=16, reps=2)
    assert r["verified"] and r["set_gb_s"] > 0 and r["get_gb_s"] > 0 and r["blocks"] == 64
    assert redis_server.cli("KEYS", "kvoff-bench-ref:*") == ""  # cleaned up


@pytest.mark.skipif(importlib.util.find_spec("redis") is None, reason="redis-py is not installed")
def test_redis_py_reference_cluster(redis_cluster: rs.RedisCluster) -> None:
    r = br.redis_py_pipelined(redis_cluster.url, 32 << 10, 48, pipeline=16, reps=1, cluster=True)
    assert r["verified"]


def test_kvoff_rows_contract(redis_server: rs.RedisServer) -> None:
    # None exactly where this build has no remote tier; otherwise the documented keys.
    k = br.kvoff_rows(redis_server.url, 32 << 10, 16, reps=1)
    if k is None:
        import kvoff._native as native

        assert not hasattr(native, "bench_remote")
        return
    for key in ("set_gb_s", "get_gb_s", "promote_p50_us", "promote_p99_us", "lookup_p99_us_up", "verified"):
        assert key in k, key
    assert k["verified"] is True and k["set_gb_s"] > 0 and k["get_gb_s"] > 0
    # The server's CPU is read only where the benchmark started the server (its process).
    for phase in ("server_store", "server_load"):
        assert k[phase]["busy"] is None and k[phase]["cpu_s_per_gb"] is None, k[phase]
        # This process's CPU is read in every run; the I/O threads' by their names (Linux).
        assert k[phase]["client_cpu_s_per_gb"] > 0, k[phase]
        if sys.platform == "linux":
            io = k[phase]["io_threads_cpu_s_per_gb"]
            assert 0 <= io <= k[phase]["client_cpu_s_per_gb"] * 1.05, k[phase]
    # Each scheduler-thread figure comes with its reference from the same loop.
    for case in ("up", "up_paced", "down"):
        assert k[f"lookup_ref_p99_us_{case}"] > 0 and k[f"lookup_p99_us_{case}"] > 0


def test_cli_private_server(capsys: pytest.CaptureFixture[str]) -> None:
    if rs.missing_reason():
        pytest.skip(rs.missing_reason() or "")
    argv = ["bench", "remote", "--sizes", "32KiB", "--blocks", "32", "--reps", "1"]
    argv += [
        "--pipelines",
        "1",
        "--clients",
        "1",
        "--io-threads",
        "3",
        "--native-threads",
        "2",
        "--json",
        "--quiet",
    ]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["private_server"] and res["server"].startswith(("redis ", "valkey "))
    assert res["io_threads"] == 3
    [row] = res["sizes"]
    assert row["value_bytes"] == 32 << 10 and row["redis_benchmark"]["set"]["gb_s"] > 0
    assert (row["kvoff"] is None) == ("kvoff_note" in row)
    if row["kvoff"] is not None:
        # The best shapes ran again before kvoff's one repetition: a reference beside it.
        alt = row["redis_benchmark_alternated"]
        assert alt["runs"] == 1
        for variant in ("one_key", "keys"):
            assert alt[variant]["set_gb_s"] > 0 and alt[variant]["get_gb_s"] > 0
        assert row["ratios"]["store_vs_redis_benchmark_keys_alternated"] > 0
        # The native client's best thread counts ran again beside kvoff too, every byte compared.
        nat = row["native_alternated"]
        assert nat["runs"] == 1 and nat["verified"] and nat["set_gb_s"] > 0 and nat["get_gb_s"] > 0
        assert row["ratios"]["load_vs_native_alternated"] > 0 and row["ratios"]["store_vs_native"] > 0
        # The private server's event loop, read around kvoff's store and load and each run again.
        if sys.platform == "linux":
            for phase in ("server_store", "server_load"):
                srv = row["kvoff"][phase]
                assert srv["cpu_s_per_gb"] > 0 and 0 < srv["busy"] <= 1.05, (phase, srv)
            for variant in ("one_key", "keys"):
                assert alt[variant]["set_server_cpu_s_per_gb"] > 0
                assert alt[variant]["get_server_cpu_s_per_gb"] > 0
            # The client's CPU beside the server's, for kvoff and for the native client.
            assert nat["set_client_cpu_s_per_gb"] > 0 and nat["get_client_cpu_s_per_gb"] > 0
            assert "server CPU s per GB of values" in br.format_remote(res)
            assert "client CPU s per GB: kvoff store / load" in br.format_remote(res)
    text = br.format_remote(res)
    assert "redis-benchmark best" in text and "32 KiB" in text and "3 I/O threads" in text
    assert (row["kvoff"] is None) or "redis-benchmark again" in text
    assert (row["kvoff"] is None) or ("native client again" in text and "vs the native client" in text)


def test_native_reference(redis_server: rs.RedisServer) -> None:
    # The native client's grid: a SET and a GET pass per thread count, every loaded byte
    # compared, the best count per operation named; its keys stay for the runs again beside
    # kvoff until close(), and none is left after.
    r, ref = br.native_best(redis_server.url, 32 << 10, 48, threads=(1, 3))
    try:
        assert [p["threads"] for p in r["grid"]] == [1, 3]
        assert r["verified"] and all(p["set_gb_s"] > 0 and p["get_gb_s"] > 0 for p in r["grid"])
        for op in ("set", "get"):
            assert r[op]["gb_s"] == max(p[f"{op}_gb_s"] for p in r["grid"])
        assert len(redis_server.cli("KEYS", "kvoff-bench-native:*").split()) == 48
        gbs, ok = ref.get(2)
        assert gbs > 0 and ok
    finally:
        ref.close()
    ref.close()  # a second close does nothing
    assert redis_server.cli("KEYS", "kvoff-bench-native:*") == ""
    import kvoff

    with pytest.raises(kvoff.InvalidStateError):
        ref.set(1)
    # A TLS or Cluster URL, and a get before any set, are refused with clean errors.
    for url in ("rediss://127.0.0.1:1", "redis+cluster://127.0.0.1:1"):
        with pytest.raises(kvoff.ConfigError):
            br.native_best(url, 4096, 4, threads=(1,))
    fresh = kvoff._native.NativeRemoteRef(redis_server.url, 4096, 2)
    try:
        with pytest.raises(kvoff.InvalidStateError):
            fresh.get(1)
    finally:
        fresh.close()
