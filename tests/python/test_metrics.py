"""Transfer metrics (docs/spec.md §8): exact Prometheus text for a known sequence, histogram bucket edges,
the manager gauges, parsing back with prometheus_client (when installed), the HTTP endpoint, and the
handlers observing their results automatically."""

from __future__ import annotations

import math
import threading
import urllib.error
import urllib.request

import kvoff
import pytest
from helpers import ks
from kvoff import TransferMetrics, TransferResult, serve_metrics
from kvoff.metrics import SIZE_BUCKETS_BYTES, _go_float

G2C = ("GPU", "CPU")
C2G = ("CPU", "GPU")


def res(size: int, secs: float, tt=G2C, ok: bool = True, job: int = 0) -> TransferResult:
    return TransferResult(job, ok, size, secs, tt, None if ok else "boom")


EXPECTED_KNOWN = """\
# HELP kvoff_offload_total_bytes Bytes moved by KV offloading transfers.
# TYPE kvoff_offload_total_bytes counter
kvoff_offload_total_bytes{transfer_type="CPU_to_GPU"} 3e+06
kvoff_offload_total_bytes{transfer_type="GPU_to_CPU"} 3.5e+08
# HELP kvoff_offload_total_time Seconds spent in KV offloading transfers (device-timed on a GPU).
# TYPE kvoff_offload_total_time counter
kvoff_offload_total_time{transfer_type="CPU_to_GPU"} 0.25
kvoff_offload_total_time{transfer_type="GPU_to_CPU"} 1.5
# HELP kvoff_offload_transfers Successful KV offloading transfers.
# TYPE kvoff_offload_transfers counter
kvoff_offload_transfers{transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_transfers{transfer_type="GPU_to_CPU"} 2.0
# HELP kvoff_offload_failed_transfers Failed KV offloading transfers.
# TYPE kvoff_offload_failed_transfers counter
kvoff_offload_failed_transfers{transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_failed_transfers{transfer_type="GPU_to_CPU"} 0.0
# HELP kvoff_offload_size Bytes per KV offloading transfer.
# TYPE kvoff_offload_size histogram
kvoff_offload_size_bucket{transfer_type="CPU_to_GPU",le="1e+06"} 0.0
kvoff_offload_size_bucket{transfer_type="CPU_to_GPU",le="5e+06"} 1.0
kvoff_offload_size_bucket{transfer_type="CPU_to_GPU",le="1e+07"} 1.0
kvoff_offload_size_bucket{transfer_type="CPU_to_GPU",le="2e+07"} 1.0
kvoff_offload_size_bucket{transfer_type="CPU_to_GPU",le="4e+07"} 1.0
kvoff_offload_size_bucket{transfer_type="CPU_to_GPU",le="6e+07"} 1.0
kvoff_offload_size_bucket{transfer_type="CPU_to_GPU",le="8e+07"} 1.0
kvoff_offload_size_bucket{transfer_type="CPU_to_GPU",le="1e+08"} 1.0
kvoff_offload_size_bucket{transfer_type="CPU_to_GPU",le="1.5e+08"} 1.0
kvoff_offload_size_bucket{transfer_type="CPU_to_GPU",le="2e+08"} 1.0
kvoff_offload_size_bucket{transfer_type="CPU_to_GPU",le="+Inf"} 1.0
kvoff_offload_size_sum{transfer_type="CPU_to_GPU"} 3e+06
kvoff_offload_size_count{transfer_type="CPU_to_GPU"} 1.0
kvoff_offload_size_bucket{transfer_type="GPU_to_CPU",le="1e+06"} 0.0
kvoff_offload_size_bucket{transfer_type="GPU_to_CPU",le="5e+06"} 0.0
kvoff_offload_size_bucket{transfer_type="GPU_to_CPU",le="1e+07"} 0.0
kvoff_offload_size_bucket{transfer_type="GPU_to_CPU",le="2e+07"} 0.0
kvoff_offload_size_bucket{transfer_type="GPU_to_CPU",le="4e+07"} 0.0
kvoff_offload_size_bucket{transfer_type="GPU_to_CPU",le="6e+07"} 0.0
kvoff_offload_size_bucket{transfer_type="GPU_to_CPU",le="8e+07"} 0.0
kvoff_offload_size_bucket{transfer_type="GPU_to_CPU",le="1e+08"} 1.0
kvoff_offload_size_bucket{transfer_type="GPU_to_CPU",le="1.5e+08"} 1.0
kvoff_offload_size_bucket{transfer_type="GPU_to_CPU",le="2e+08"} 1.0
kvoff_offload_size_bucket{transfer_type="GPU_to_CPU",le="+Inf"} 2.0
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
    assert known_sequence().prometheus_text() == EXPECTED_KNOWN


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
    assert "# TYPE kvoff_cache_stores_skipped counter" in text
    assert "kvoff_cache_stores_skipped 2.0\n" in text
    mgr.prepare_store(ks(3))  # skipped once more
    assert m.snapshot()["cache"]["stores_skipped"] == 3  # accumulated, not reset per read
    assert "kvoff_cache_stores_skipped 3.0\n" in m.prometheus_text()
    m.attach_manager(None)
    assert "kvoff_cache" not in m.prometheus_text()


def test_prefix():
    text = known_sequence().prometheus_text(prefix="myengine")
    assert 'myengine_offload_total_bytes{transfer_type="GPU_to_CPU"} 3.5e+08' in text
    assert "kvoff" not in text


def test_parses_back_with_prometheus_client():
    parser = pytest.importorskip("prometheus_client.parser")
    mgr = kvoff.create_manager("lru", 8)
    m = known_sequence()
    m.attach_manager(mgr)
    fams = {f.name: f for f in parser.text_string_to_metric_families(m.prometheus_text())}
    # Our counters carry no _total suffix; the parser adds it to counter samples (OpenMetrics style).
    assert fams["kvoff_offload_total_bytes"].type == "counter"
    vals = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert vals[("kvoff_offload_total_bytes_total", (("transfer_type", "GPU_to_CPU"),))] == 350e6
    assert vals[("kvoff_offload_failed_transfers_total", (("transfer_type", "CPU_to_GPU"),))] == 1
    assert vals[("kvoff_offload_size_bucket", (("le", "1e+08"), ("transfer_type", "GPU_to_CPU")))] == 1
    assert vals[("kvoff_offload_size_bucket", (("le", "+Inf"), ("transfer_type", "GPU_to_CPU")))] == 2
    assert vals[("kvoff_offload_size_count", (("transfer_type", "CPU_to_GPU"),))] == 1
    assert fams["kvoff_offload_size"].type == "histogram"
    assert fams["kvoff_cache_usage"].type == "gauge"
    assert vals[("kvoff_cache_blocks", ())] == 8


def test_http_endpoint_on_an_ephemeral_port():
    m = known_sequence()
    server = serve_metrics(m, 0)
    try:
        assert server.port > 0
        with urllib.request.urlopen(server.url, timeout=10) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert r.read().decode() == EXPECTED_KNOWN
        m.observe(res(1, 1.0, C2G))  # served live, not a copy
        with urllib.request.urlopen(server.url, timeout=10) as r:
            assert 'kvoff_offload_transfers{transfer_type="CPU_to_GPU"} 2.0' in r.read().decode()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=10)
        assert e.value.code == 404
    finally:
        server.close()
        server.close()  # idempotent


def test_serve_metrics_rejects_other_objects():
    with pytest.raises(TypeError):
        serve_metrics(object(), 0)  # type: ignore[arg-type]


def test_observe_is_thread_safe():
    m = TransferMetrics()

    def work(tt):
        for _ in range(2000):
            m.observe(res(1000, 0.001, tt))

    ts = [threading.Thread(target=work, args=(tt,)) for tt in (G2C, C2G, G2C, C2G)]
    for t in ts:
        t.start()
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
