"""Transfer metrics (docs/spec.md §8): exact Prometheus text for a known sequence, histogram bucket edges,
the manager gauges; the prometheus_client collector in a fresh registry after host-engine transfers
and manager operations, several labelled sources, a shut-down manager, registering/unregistering;
the standalone server (prometheus_client's start_http_server); kvoff without prometheus_client (a
subprocess that blocks its import); the handlers observing their results automatically; a tiered
manager's file tier (``kvoff_disk_*``) and object tier (``kvoff_object_*``, against SeaweedFS)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import kvoff
import pytest
from helpers import ks
from kvoff import TransferMetrics, TransferMetricsCollector, TransferResult, serve_metrics
from kvoff.metrics import SIZE_BUCKETS_BYTES, _go_float

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

G2C = ("GPU", "CPU")
C2G = ("CPU", "GPU")


def res(size: int, secs: float, tt=G2C, ok: bool = True, job: int = 0) -> TransferResult:
    return TransferResult(job, ok, size, secs, tt, None if ok else "boom")


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of a text exposition, parsed by prometheus_client."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def families(text: str) -> dict[str, str]:
    """``{family name: type}`` of a text exposition, parsed by prometheus_client."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}


EXPECTED_KNOWN = """\
# HELP kvoff_offload_total_bytes_total Bytes moved by KV offloading transfers.
# TYPE kvoff_offload_total_bytes_total counter
kvoff_offload_total_bytes_total{transfer_type="CPU_to_GPU"} 3e+06
kvoff_offload_total_bytes_total{transfer_type="GPU_to_CPU"} 3.5e+08
# HELP kvoff_offload_total_time_total Seconds spent in KV offloading transfers (device-timed on a GPU).
# TYPE kvoff_offload_total_time_total counter
kvoff_offload_total_time_total{transfer_type="CPU_to_GPU"} 0.25
kvoff_offload_total_time_total{transfer_type="GPU_to_CPU"} 1.5
# HELP kvoff_offload_transfers_total Successful KV offloading transfers.
# TYPE kvoff_offload_transfers_total counter
kvoff_offload_transfers_total{transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_transfers_total{transfer_type="GPU_to_CPU"} 2.0
# HELP kvoff_offload_failed_transfers_total Failed KV offloading transfers.
# TYPE kvoff_offload_failed_transfers_total counter
kvoff_offload_failed_transfers_total{transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_failed_transfers_total{transfer_type="GPU_to_CPU"} 0.0
# HELP kvoff_offload_size Bytes per KV offloading transfer.
# TYPE kvoff_offload_size histogram
kvoff_offload_size_bucket{le="1e+06",transfer_type="CPU_to_GPU"} 0.0
kvoff_offload_size_bucket{le="5e+06",transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_size_bucket{le="1e+07",transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_size_bucket{le="2e+07",transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_size_bucket{le="4e+07",transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_size_bucket{le="6e+07",transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_size_bucket{le="8e+07",transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_size_bucket{le="1e+08",transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_size_bucket{le="1.5e+08",transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_size_bucket{le="2e+08",transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_size_bucket{le="+Inf",transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_size_sum{transfer_type="CPU_to_GPU"} 3e+06
kvoff_offload_size_count{transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_size_bucket{le="1e+06",transfer_type="GPU_to_CPU"} 0.0
kvoff_offload_size_bucket{le="5e+06",transfer_type="GPU_to_CPU"} 0.0
kvoff_offload_size_bucket{le="1e+07",transfer_type="GPU_to_CPU"} 0.0
kvoff_offload_size_bucket{le="2e+07",transfer_type="GPU_to_CPU"} 0.0
kvoff_offload_size_bucket{le="4e+07",transfer_type="GPU_to_CPU"} 0.0
kvoff_offload_size_bucket{le="6e+07",transfer_type="GPU_to_CPU"} 0.0
kvoff_offload_size_bucket{le="8e+07",transfer_type="GPU_to_CPU"} 0.0
kvoff_offload_size_bucket{le="1e+08",transfer_type="GPU_to_CPU"} 1.0
kvoff_offload_size_bucket{le="1.5e+08",transfer_type="GPU_to_CPU"} 1.0
kvoff_offload_size_bucket{le="2e+08",transfer_type="GPU_to_CPU"} 1.0
kvoff_offload_size_bucket{le="+Inf",transfer_type="GPU_to_CPU"} 2.0
kvoff_offload_size_sum{transfer_type="GPU_to_CPU"} 3.5e+08
kvoff_offload_size_count{transfer_type="GPU_to_CPU"} 2.0
"""


def known_sequence() -> TransferMetrics:
    m = TransferMetrics()
    m.observe(res(100_000_000, 1.0))  # exactly on the 1e+08 edge: counted there (le is inclusive)
    m.observe(res(250_000_000, 0.5))  # above every finite bucket: only +Inf
    m.observe(res(3_000_000, 0.25, C2G))
    m.observe(res(7_000_000, 9.0, C2G, ok=False))  # failed: only the failure counter moves
    return m


def test_exact_text_of_a_known_sequence():
    """prometheus_client's exposition of the collector gives this text byte for byte."""
    m = known_sequence()
    assert m.prometheus_text() == EXPECTED_KNOWN
    assert generate_latest(TransferMetricsCollector(m)).decode() == EXPECTED_KNOWN


def test_labels_are_escaped():
    mgr = kvoff.create_manager("arc", 8, store_threshold=2)
    m = known_sequence()
    m.attach_manager(mgr)
    col = TransferMetricsCollector(m, labels={"engine": 'a "b"\\c\nd', "rank": "0"})
    text = generate_latest(col).decode()
    assert 'engine="a \\"b\\"\\\\c\\nd"' in text


def test_snapshot_and_reset():
    m = known_sequence()
    s = m.snapshot()
    g = s["GPU_to_CPU"]
    assert (g["bytes"], g["seconds"], g["transfers"], g["failed_transfers"]) == (350_000_000, 1.5, 2, 0)
    assert g["gb_per_s"] == pytest.approx(350e6 / 1.5 / 1e9)
    assert (
        g["size_buckets"][100e6] == 1 and g["size_buckets"][200e6] == 1 and g["size_buckets"][math.inf] == 2
    )
    c = s["CPU_to_GPU"]
    assert (c["bytes"], c["transfers"], c["failed_transfers"]) == (3_000_000, 1, 1)
    assert "cache" not in s
    m.reset()
    z = m.snapshot()
    assert z["GPU_to_CPU"]["bytes"] == 0 and z["CPU_to_GPU"]["failed_transfers"] == 0
    assert z["GPU_to_CPU"]["gb_per_s"] == 0.0
    assert all(v == 0 for v in z["GPU_to_CPU"]["size_buckets"].values())


@pytest.mark.parametrize("edge", SIZE_BUCKETS_BYTES)
def test_bucket_edges_are_inclusive(edge):
    """A transfer of exactly ``le`` bytes is in bucket ``le``; one byte more is in the next one."""
    m = TransferMetrics()
    m.observe(res(int(edge), 1.0))
    m.observe(res(int(edge) + 1, 1.0, C2G))
    on, above = m.snapshot()["GPU_to_CPU"]["size_buckets"], m.snapshot()["CPU_to_GPU"]["size_buckets"]
    for le in (*SIZE_BUCKETS_BYTES, math.inf):
        assert on[le] == (1 if le >= edge else 0), le
        assert above[le] == (1 if le > edge else 0), le


def test_go_float_spelling():
    from prometheus_client.utils import floatToGoString

    assert [_go_float(b) for b in SIZE_BUCKETS_BYTES] == [
        "1e+06",
        "5e+06",
        "1e+07",
        "2e+07",
        "4e+07",
        "6e+07",
        "8e+07",
        "1e+08",
        "1.5e+08",
        "2e+08",
    ]
    assert _go_float(math.inf) == "+Inf" and _go_float(0) == "0.0" and _go_float(0.25) == "0.25"
    assert _go_float(123456.0) == "123456.0" and _go_float(1234567.0) == "1.234567e+06"
    # Ten digits and more before the point (e.g. 10 GB moved): two-digit exponents, as Go writes them.
    assert _go_float(1e10) == "1e+10" and _go_float(1.5e12) == "1.5e+12"
    for x in (
        0.0,
        1.0,
        0.1,
        3.5,
        1e6,
        1e9,
        1e10,
        2.5e15,
        1e20,
        123456789.5,
        -1.0,
        -1e10,
        math.inf,
        -math.inf,
    ):
        assert _go_float(x) == floatToGoString(x), x


def test_transfer_type_spellings():
    m = TransferMetrics()
    m.observe(res(1, 1.0, "GPU_to_CPU"))
    m.observe(res(1, 1.0, "cpu_to_gpu"))
    assert m.snapshot()["GPU_to_CPU"]["transfers"] == 1 and m.snapshot()["CPU_to_GPU"]["transfers"] == 1
    with pytest.raises(ValueError, match="transfer_type"):
        m.observe(res(1, 1.0, ("GPU", "GPU")))


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_manager_gauges(policy):
    """docs/spec.md §2.6 #27 gauges, and stores_skipped accumulated across reads (the manager resets its own)."""
    mgr = kvoff.create_manager(policy, 4, store_threshold=2)
    m = TransferMetrics(mgr)
    mgr.prepare_store(ks(1, 2))  # first offer: both skipped by admission
    mgr.prepare_store(ks(1, 2))  # second offer: admitted, pending
    text = m.prometheus_text()
    assert "kvoff_cache_write_usage 0.5\n" in text
    assert "kvoff_cache_usage 0.5\n" in text
    assert "kvoff_cache_read_usage 0.0\n" in text
    assert "kvoff_cache_blocks 4.0\n" in text
    assert "kvoff_cache_blocks_present 2.0\n" in text
    assert "kvoff_cache_blocks_free 2.0\n" in text
    assert "# TYPE kvoff_cache_stores_skipped_total counter" in text
    assert "kvoff_cache_stores_skipped_total 2.0\n" in text
    mgr.prepare_store(ks(3))  # skipped once more
    assert m.snapshot()["cache"]["stores_skipped"] == 3  # accumulated, not reset per read
    assert "kvoff_cache_stores_skipped_total 3.0\n" in m.prometheus_text()
    m.attach_manager(None)
    assert "kvoff_cache" not in m.prometheus_text()


def test_prefix():
    text = known_sequence().prometheus_text(prefix="myengine")
    assert 'myengine_offload_total_bytes_total{transfer_type="GPU_to_CPU"} 3.5e+08' in text
    assert "kvoff" not in text
    with pytest.raises(ValueError, match="prefix"):
        known_sequence().prometheus_text(prefix="my-engine")
    with pytest.raises(ValueError, match="prefix"):
        TransferMetricsCollector(prefix="9x")


def test_family_names_and_types_parse_back():
    """The family names and types prometheus_client's parser reads: the same as before the
    collector (counter samples carry ``_total``, as the parser already read them)."""
    m = known_sequence()
    m.attach_manager(kvoff.create_manager("lru", 8))
    fams = families(m.prometheus_text())
    assert fams == {
        "kvoff_offload_total_bytes": "counter",
        "kvoff_offload_total_time": "counter",
        "kvoff_offload_transfers": "counter",
        "kvoff_offload_failed_transfers": "counter",
        "kvoff_offload_size": "histogram",
        "kvoff_cache_usage": "gauge",
        "kvoff_cache_write_usage": "gauge",
        "kvoff_cache_read_usage": "gauge",
        "kvoff_cache_blocks": "gauge",
        "kvoff_cache_blocks_present": "gauge",
        "kvoff_cache_blocks_free": "gauge",
        "kvoff_cache_blocks_evictable": "gauge",
        "kvoff_cache_stores_skipped": "counter",
    }


# -- the collector ----------------------------------------------------------------------------------


def _host_handlers(torch, m: TransferMetrics):
    kv = [torch.arange(8 * 64, dtype=torch.int32).view(8, 64) for _ in range(2)]  # 256 B pages
    return kv, kvoff.CpuGpuOffloadingHandlers(kv, 1, 8, engine="host", metrics=m)


def _run(handler, job: int, spec) -> None:
    assert handler.transfer_async(job, spec)
    handler.wait([job])
    assert all(r.success for r in handler.get_finished())  # observed by the handlers' metrics


def test_collector_in_a_fresh_registry_after_host_transfers_and_manager_ops():
    torch = pytest.importorskip("torch")
    mgr = kvoff.create_manager("lru", 8, store_threshold=2)
    m = TransferMetrics(mgr)
    registry = CollectorRegistry()
    collector = TransferMetricsCollector(m)
    registry.register(collector)
    kv, h = _host_handlers(torch, m)
    try:
        assert mgr.prepare_store(ks(1, 2, 3)).keys_to_store == []  # first offer: 3 skipped
        out = mgr.prepare_store(ks(1, 2, 3))  # second offer: admitted
        cpu_ids = out.store_spec.block_ids.tolist()
        _run(
            h.gpu_to_cpu_handler,
            1,
            (kvoff.GPULoadStoreSpec([0, 1, 2]), kvoff.CPULoadStoreSpec(cpu_ids)),
        )
        mgr.complete_store(ks(1, 2, 3))
        load = mgr.prepare_load(ks(2))  # pinned until complete_load: read usage 1/8
        _run(h.cpu_to_gpu_handler, 2, (load, kvoff.GPULoadStoreSpec([7])))
        assert torch.equal(kv[0][7], kv[0][1]) and torch.equal(kv[1][7], kv[1][1])
        mgr.prepare_store(ks(4))  # skipped once more

        text = generate_latest(registry).decode()
        v = samples(text)
        g2c, c2g = (("transfer_type", "GPU_to_CPU"),), (("transfer_type", "CPU_to_GPU"),)
        assert v[("kvoff_offload_total_bytes_total", g2c)] == 3 * 2 * 256
        assert v[("kvoff_offload_total_bytes_total", c2g)] == 2 * 256
        assert v[("kvoff_offload_transfers_total", g2c)] == 1 == v[("kvoff_offload_transfers_total", c2g)]
        assert v[("kvoff_offload_failed_transfers_total", g2c)] == 0
        assert v[("kvoff_offload_total_time_total", g2c)] > 0
        assert v[("kvoff_offload_size_bucket", (("le", "1e+06"), *g2c))] == 1
        assert v[("kvoff_offload_size_bucket", (("le", "+Inf"), *c2g))] == 1
        assert v[("kvoff_offload_size_sum", g2c)] == 1536 and v[("kvoff_offload_size_count", c2g)] == 1
        assert v[("kvoff_cache_blocks", ())] == 8
        assert v[("kvoff_cache_blocks_present", ())] == 3
        assert v[("kvoff_cache_blocks_free", ())] == 5
        assert v[("kvoff_cache_blocks_evictable", ())] == 2  # the loading block is pinned
        assert v[("kvoff_cache_read_usage", ())] == 1 / 8 == v[("kvoff_cache_usage", ())]
        assert v[("kvoff_cache_write_usage", ())] == 0
        assert v[("kvoff_cache_stores_skipped_total", ())] == 4
        assert families(text)["kvoff_offload_size"] == "histogram"
        assert text == m.prometheus_text()  # one spelling everywhere

        mgr.complete_load(ks(2))
        v = samples(generate_latest(registry).decode())
        assert v[("kvoff_cache_read_usage", ())] == 0 and v[("kvoff_cache_stores_skipped_total", ())] == 4
    finally:
        h.shutdown()
    registry.unregister(collector)
    assert generate_latest(registry) == b""


def test_two_sources_coexist_with_labels():
    torch = pytest.importorskip("torch")
    m1, m2 = TransferMetrics(kvoff.create_manager("lru", 8)), TransferMetrics(kvoff.create_manager("arc", 16))
    collector = TransferMetricsCollector(m1, labels={"engine": "a"})
    collector.add(m2, labels={"engine": "b"})
    registry = CollectorRegistry(auto_describe=True)  # as prometheus_client.REGISTRY
    registry.register(collector)
    _, h1 = _host_handlers(torch, m1)
    _, h2 = _host_handlers(torch, m2)
    try:
        _run(h1.gpu_to_cpu_handler, 1, (kvoff.GPULoadStoreSpec([0]), kvoff.CPULoadStoreSpec([0])))
        _run(h2.gpu_to_cpu_handler, 1, (kvoff.GPULoadStoreSpec([0, 1]), kvoff.CPULoadStoreSpec([0, 1])))
        text = generate_latest(registry).decode()
        v = samples(text)
        a = (("engine", "a"), ("transfer_type", "GPU_to_CPU"))
        b = (("engine", "b"), ("transfer_type", "GPU_to_CPU"))
        assert v[("kvoff_offload_total_bytes_total", a)] == 512
        assert v[("kvoff_offload_total_bytes_total", b)] == 1024
        assert v[("kvoff_offload_size_bucket", (("engine", "b"), ("le", "+Inf"), b[1]))] == 1
        assert v[("kvoff_cache_blocks", (("engine", "a"),))] == 8
        assert v[("kvoff_cache_blocks", (("engine", "b"),))] == 16
        # One HELP/TYPE per family, both sources' series under it.
        assert text.count("# TYPE kvoff_offload_total_bytes_total counter") == 1
        assert text.count("# TYPE kvoff_cache_blocks gauge") == 1

        collector.remove(m1)
        v = samples(generate_latest(registry).decode())
        assert ("kvoff_cache_blocks", (("engine", "a"),)) not in v
        assert v[("kvoff_cache_blocks", (("engine", "b"),))] == 16
        with pytest.raises(ValueError, match="not a source"):
            collector.remove(m1)
        assert [lab for _, lab in collector.sources] == [{"engine": "b"}]
    finally:
        h1.shutdown()
        h2.shutdown()


def test_collector_refuses_colliding_sources_and_bad_labels():
    m1, m2 = TransferMetrics(), TransferMetrics()
    c = TransferMetricsCollector(m1)
    with pytest.raises(ValueError, match="already a source"):
        c.add(m1, labels={"x": "1"})
    with pytest.raises(ValueError, match="labels"):
        c.add(m2)  # the same (empty) label set as m1: the series would collide
    for bad in ("transfer_type", "le", "__x", "0x", "a-b"):
        with pytest.raises(ValueError, match="label name"):
            c.add(m2, labels={bad: "1"})
    with pytest.raises(TypeError):
        c.add(m2, labels={"x": 1})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="TransferMetrics"):
        c.add(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="labels"):
        TransferMetricsCollector(labels={"x": "1"})
    c.add(m2, labels={"x": "1"})
    assert len(c.sources) == 2


def test_register_unregister_and_duplicates_in_one_registry():
    m1, m2 = TransferMetrics(), TransferMetrics()
    registry = CollectorRegistry()
    c1 = TransferMetricsCollector(m1)
    registry.register(c1)
    # describe() names every family, so the registry refuses a second kvoff collector with the same
    # prefix at register (not at scrape time)...
    with pytest.raises(ValueError, match="Duplicated"):
        registry.register(TransferMetricsCollector(m2))
    # ...while another prefix is fine.
    c3 = TransferMetricsCollector(m2, prefix="kvoff_b")
    registry.register(c3)
    text = generate_latest(registry).decode()
    assert "kvoff_offload_total_bytes_total" in text and "kvoff_b_offload_total_bytes_total" in text
    registry.unregister(c1)
    registry.register(TransferMetricsCollector(m2))  # after unregistering, the names are free again
    assert {m.name for m in c1.describe()} >= {"kvoff_offload_size", "kvoff_cache_stores_skipped"}
    # Restricted scrapes (?name[]=...) reach the collector through describe().
    only = registry.restricted_registry(["kvoff_cache_blocks", "kvoff_offload_size_count"])
    assert [f.name for f in only.collect()] == ["kvoff_offload_size"]


def test_collect_survives_a_shut_down_manager_and_a_failing_source():
    mgr = kvoff.create_manager("lru", 8)
    alive = TransferMetrics(kvoff.create_manager("arc", 4))
    m = TransferMetrics(mgr)
    m.observe(res(10, 0.5))

    class Broken:
        def get_stats(self):
            raise RuntimeError("kaputt")

    broken = TransferMetrics(Broken())
    c = TransferMetricsCollector(m, labels={"src": "shut"})
    c.add(alive, labels={"src": "alive"})
    c.add(broken, labels={"src": "broken"})
    registry = CollectorRegistry()
    registry.register(c)
    mgr.shutdown()
    with pytest.raises(kvoff.InvalidStateError):
        m.snapshot()  # an explicit read still says why
    v = samples(generate_latest(registry).decode())  # the registry never sees an exception
    assert v[("kvoff_offload_total_bytes_total", (("src", "shut"), ("transfer_type", "GPU_to_CPU")))] == 10
    assert ("kvoff_cache_blocks", (("src", "shut"),)) not in v  # skipped, not made up
    assert ("kvoff_cache_blocks", (("src", "broken"),)) not in v
    assert v[("kvoff_cache_blocks", (("src", "alive"),))] == 4
    assert "kvoff_cache_blocks" not in m.prometheus_text()


def test_collect_skips_a_source_that_fails_entirely(monkeypatch, caplog):
    good, bad = TransferMetrics(), TransferMetrics()
    good.observe(res(5, 1.0))

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(bad, "_families", boom)
    c = TransferMetricsCollector(good, labels={"s": "good"})
    c.add(bad, labels={"s": "bad"})
    with caplog.at_level("ERROR", logger="kvoff.metrics"):
        v = samples(generate_latest(c).decode())
    assert v[("kvoff_offload_total_bytes_total", (("s", "good"), ("transfer_type", "GPU_to_CPU")))] == 5
    assert not any(lab[0] == ("s", "bad") for _, lab in v)
    assert "boom" in caplog.text


def test_collect_does_not_hold_the_metrics_lock_while_the_manager_answers():
    """A slow get_stats() (the manager's lock is busy) does not stall the transfer path's observe()."""
    entered, release = threading.Event(), threading.Event()

    class Slow:
        def get_stats(self):
            entered.set()
            release.wait(10)
            return {"num_blocks": 1, "stores_skipped": 1}

    m = TransferMetrics(Slow())
    c = TransferMetricsCollector(m)
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(generate_latest(c).decode()))
    t.start()
    try:
        assert entered.wait(10)
        t0 = time.monotonic()
        m.observe(res(7, 1.0))  # while collect() waits for the manager
        m.reset()
        m.observe(res(7, 1.0))
        assert time.monotonic() - t0 < 5
        assert t.is_alive()  # collect() was still waiting all along
    finally:
        release.set()
        t.join(10)
    assert "kvoff_cache_blocks 1.0" in got[0] and "kvoff_cache_stores_skipped_total 1.0" in got[0]


# -- the standalone server --------------------------------------------------------------------------


def _get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.headers["Content-Type"], r.read().decode()


def test_standalone_server_on_an_ephemeral_port():
    m = known_sequence()
    m.attach_manager(kvoff.create_manager("lru", 8))
    server = serve_metrics(m, 0)
    try:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        assert server.metrics is m and server.prefix == "kvoff"
        status, ctype, body = _get(server.url)
        assert status == 200 and ctype.startswith("text/plain")
        assert body == m.prometheus_text() == generate_latest(server.registry).decode()
        assert body.startswith(EXPECTED_KNOWN)
        m.observe(res(1, 1.0, C2G))  # served live, not a copy
        assert 'kvoff_offload_transfers_total{transfer_type="CPU_to_GPU"} 2.0' in _get(server.url)[2]
        # prometheus_client's negotiation: a scraper asking for OpenMetrics gets it.
        req = urllib.request.Request(
            server.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            om = r.read().decode()
        assert om.endswith("# EOF\n") and "# TYPE kvoff_offload_total_bytes counter" in om
    finally:
        server.close()
        server.close()  # idempotent
    with pytest.raises(OSError):
        _get(server.url)


def test_standalone_server_of_a_collector_with_two_sources():
    m1, m2 = known_sequence(), TransferMetrics()
    c = TransferMetricsCollector(m1, labels={"engine": "a"}, prefix="eng")
    c.add(m2, labels={"engine": "b"})
    with serve_metrics(c, 0) as server:
        assert server.collector is c and server.prefix == "eng" and server.metrics is None
        v = samples(_get(server.url)[2])
    assert v[("eng_offload_total_bytes_total", (("engine", "a"), ("transfer_type", "GPU_to_CPU")))] == 350e6
    assert v[("eng_offload_total_bytes_total", (("engine", "b"), ("transfer_type", "GPU_to_CPU")))] == 0


def test_serve_metrics_rejects_other_objects():
    with pytest.raises(TypeError):
        serve_metrics(object(), 0)  # type: ignore[arg-type]


# -- without prometheus_client ----------------------------------------------------------------------

_WITHOUT = textwrap.dedent(
    """
    import json, sys
    sys.modules["prometheus_client"] = None  # import prometheus_client -> ImportError
    import kvoff
    from kvoff import TransferMetrics, TransferResult
    from kvoff.metrics import TransferMetricsCollector

    m = TransferMetrics(kvoff.create_manager("lru", 8))
    for job, ok, size, secs, tt in json.loads(sys.argv[1]):
        m.observe(TransferResult(job, ok, size, secs, tuple(tt), None if ok else "boom"))
    out = {"snapshot_bytes": m.snapshot()["GPU_to_CPU"]["bytes"]}
    for name, call in (
        ("text", m.prometheus_text),
        ("collector", lambda: TransferMetricsCollector(m)),
        ("kvoff.collector", lambda: kvoff.TransferMetricsCollector(m)),
        ("server", lambda: kvoff.serve_metrics(m, 0)),
    ):
        try:
            call()
            out[name] = None
        except ImportError as e:
            out[name] = str(e)
    print(json.dumps(out))
    """
)

_KNOWN_RESULTS = [
    (0, True, 100_000_000, 1.0, G2C),
    (0, True, 250_000_000, 0.5, G2C),
    (0, True, 3_000_000, 0.25, C2G),
    (0, False, 7_000_000, 9.0, C2G),
]


def test_without_prometheus_client():
    """kvoff imports and its metrics work; the collector, the server and prometheus_text() raise
    an ImportError that names the extra."""
    p = subprocess.run(
        [sys.executable, "-c", _WITHOUT, json.dumps(_KNOWN_RESULTS)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["snapshot_bytes"] == 350_000_000
    for key in ("text", "collector", "kvoff.collector", "server"):
        assert out[key] is not None and "pip install prometheus_client" in out[key], out
        assert "pip install '.[prometheus]'" in out[key] and "kvoff[" not in out[key]
        assert "prometheus_client" in out[key]


def test_import_kvoff_does_not_import_prometheus_client():
    code = "import sys, kvoff, kvoff.metrics; print('prometheus_client' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0 and p.stdout.strip() == "False", (p.stdout, p.stderr)


# -- threads, handlers ------------------------------------------------------------------------------


def test_observe_is_thread_safe():
    m = TransferMetrics()

    def work(tt):
        for _ in range(2000):
            m.observe(res(1000, 0.001, tt))

    ts = [threading.Thread(target=work, args=(tt,)) for tt in (G2C, C2G, G2C, C2G)]
    for t in ts:
        t.start()
    c = TransferMetricsCollector(m)
    while any(t.is_alive() for t in ts):
        generate_latest(c)  # collecting beside the writers
    for t in ts:
        t.join()
    s = m.snapshot()
    assert s["GPU_to_CPU"]["transfers"] == 4000 and s["CPU_to_GPU"]["bytes"] == 4000 * 1000


def test_handlers_observe_their_results():
    torch = pytest.importorskip("torch")
    kv = [torch.arange(8 * 64, dtype=torch.int32).view(8, 64) for _ in range(2)]  # 256 B pages
    m = TransferMetrics()
    h = kvoff.CpuGpuOffloadingHandlers(kv, 1, 8, engine="host", metrics=m)
    try:
        assert h.metrics is m
        h.gpu_to_cpu_handler.transfer_async(
            1, (kvoff.GPULoadStoreSpec([0, 1, 2]), kvoff.CPULoadStoreSpec([5, 6, 7]))
        )
        h.gpu_to_cpu_handler.wait([1])
        h.cpu_to_gpu_handler.transfer_async(2, (kvoff.CPULoadStoreSpec([5]), kvoff.GPULoadStoreSpec([7])))
        h.cpu_to_gpu_handler.wait([2])
        assert len(h.gpu_to_cpu_handler.get_finished()) == 1
        assert len(h.cpu_to_gpu_handler.get_finished()) == 1
        s = m.snapshot()
        assert (s["GPU_to_CPU"]["transfers"], s["GPU_to_CPU"]["bytes"]) == (1, 3 * 2 * 256)
        assert (s["CPU_to_GPU"]["transfers"], s["CPU_to_GPU"]["bytes"]) == (1, 2 * 256)
        assert torch.equal(kv[0][7], kv[0][0])
    finally:
        h.shutdown()
    # Without metrics= the handlers make their own.
    h2 = kvoff.CpuGpuOffloadingHandlers(kv, 1, 8, engine="host")
    try:
        assert isinstance(h2.metrics, TransferMetrics) and h2.metrics is not m
    finally:
        h2.shutdown()
    with pytest.raises(TypeError, match="metrics"):
        kvoff.CpuGpuOffloadingHandlers(kv, 1, 8, engine="host", metrics=object())  # type: ignore[arg-type]


def test_tiered_manager_exports_the_file_tier(tmp_path):
    # A TieredOffloadingManager attached: the collector adds kvoff_disk_* (bytes and seconds per
    # direction, hits, promotions, corrupt files) from its get_stats().
    pc = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    region = kvoff.HostRegion.private(4, 4096)
    mgr = kvoff.TieredOffloadingManager("lru", 4, region, str(tmp_path / "kv"), 10**7)
    try:
        out = mgr.prepare_store([b"k" * 16])
        region.view_numpy(0, 0, 4096)[out.store_spec.block_ids[0]] = 7
        mgr.complete_store([b"k" * 16])
        mgr.flush()
        m = kvoff.TransferMetrics(manager=mgr)
        reg = pc.CollectorRegistry()
        reg.register(kvoff.TransferMetricsCollector(m))
        samples = {
            s.name: s.value
            for fam in text_string_to_metric_families(pc.generate_latest(reg).decode())
            for s in fam.samples
        }
        assert samples["kvoff_disk_written_bytes_total"] == 4096
        assert samples["kvoff_disk_files_written_total"] == 1
        assert samples["kvoff_disk_write_seconds_total"] > 0
        assert samples["kvoff_disk_corrupt_files_total"] == 0 and samples["kvoff_disk_files"] == 1
    finally:
        mgr.shutdown()
        region.close()


def _settle(mgr, keys, timeout=10.0):
    """``lookup_prefix`` polled until it answers (a fetch or a promotion in flight answers None)."""
    t0 = time.monotonic()
    while (n := mgr.lookup_prefix(keys)) is None:
        assert time.monotonic() - t0 < timeout, "lookup stayed pending"
        time.sleep(0.005)
    return n


def test_tiered_manager_exports_the_object_tier(seaweed, monkeypatch):
    # The object tier (S3, here SeaweedFS) behind a TieredOffloadingManager: the collector adds
    # kvoff_object_* under kvoff.tiers.METRICS["object"]'s names, kinds and help, each sample the
    # manager's own figure. Engine A writes two blocks; engine B serves one and rejects the other,
    # which another client corrupted.
    pc = pytest.importorskip("prometheus_client")
    from kvoff.tiers import METRICS
    from prometheus_client.parser import text_string_to_metric_families

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    block, ns, prefix = 4096, f"metrics-{time.monotonic_ns()}", "metrics"
    keys = [b"o" * 15 + bytes([i]) for i in range(2)]

    def manager(region):
        return kvoff.TieredOffloadingManager(
            "lru", 4, region, object_url=f"s3://{seaweed.bucket}/{prefix}", object_endpoint=seaweed.endpoint,
            object_bytes_to_use=1 << 24, namespace=ns, object_negative_ttl_s=0.2,
        )  # fmt: skip

    def scrape(mgr):
        reg = pc.CollectorRegistry()
        reg.register(kvoff.TransferMetricsCollector(kvoff.TransferMetrics(manager=mgr)))
        text = pc.generate_latest(reg).decode()
        return text, {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    client = seaweed.client()
    ra, rb = kvoff.HostRegion.private(4, block), kvoff.HostRegion.private(4, block)
    a = b = None
    try:
        a = manager(ra)
        objects = []
        for i, k in enumerate(keys):  # one at a time: which object holds which block
            out = a.prepare_store([k])
            ra.view_numpy(0, 0, block)[out.store_spec.block_ids[0]] = 7 + i
            a.complete_store([k])
            a.flush()
            listed = client.list_keys(seaweed.bucket, f"{prefix}/{ns}/")
            objects += [o for o in listed if o not in objects]
            assert len(objects) == i + 1, listed
        _, sa = scrape(a)
        assert sa["kvoff_object_writes_total"] == 2 and sa["kvoff_object_written_bytes_total"] == 2 * block
        assert sa["kvoff_object_up"] == 1 and sa["kvoff_object_write_errors_total"] == 0
        # Another client flips the last payload bytes of the second block's value.
        value = bytearray(client.get_object(seaweed.bucket, objects[1]))
        value[-8:] = bytes(x ^ 0xFF for x in value[-8:])
        client.put_object(seaweed.bucket, objects[1], bytes(value))

        b = manager(rb)
        assert _settle(b, keys[:1]) == 1  # fetched, promoted, ready
        spec = b.prepare_load(keys[:1])
        assert (rb.view_numpy(0, 0, block)[spec.block_ids[0]] == 7).all()
        b.complete_load(keys[:1])
        assert _settle(b, keys[1:]) == 0  # rejected: a miss
        text, sb = scrape(b)
        stats = b.get_stats()
        for m in METRICS["object"]:
            if "manager" not in m.surfaces:
                assert m.prometheus not in sb, m
                continue
            assert f"# HELP {m.prometheus} {m.help}\n# TYPE {m.prometheus} {m.kind}" in text, m
            if m.kind == "counter":
                assert sb[m.prometheus] == stats[m.key], m
        assert sb["kvoff_object_promotions_total"] == 1 and sb["kvoff_object_read_bytes_total"] == block
        assert sb["kvoff_object_hits_total"] >= 1 and sb["kvoff_object_rejected_values_total"] == 1
        assert sb["kvoff_object_up"] == 1
        # The rejected value is deleted (its task's last step).
        t0 = time.monotonic()
        while client.get_object(seaweed.bucket, objects[1]) is not None:
            assert time.monotonic() - t0 < 5, "the rejected value is still stored"
            time.sleep(0.05)
    finally:
        for m in (a, b):
            if m is not None:
                m.shutdown()
        ra.close()
        rb.close()
        client.close()
