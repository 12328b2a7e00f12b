"""Transfer handlers on a CUDA GPU (docs/spec.md §6). Marked ``gpu``; skipped without CUDA.

Byte-exact randomized round trips per engine method with bf16/fp8 KV caches, a shared 2-rank
region, ordering against the caller's current stream (loads land after queued work, stores read
after queued writes), concurrent store and load handlers, shutdown with jobs in flight.
"""

from __future__ import annotations

import random
import time
import uuid

import pytest

torch = pytest.importorskip("torch")
import kvoff
from kvoff import CpuGpuOffloadingHandlers, CPULoadStoreSpec, GPULoadStoreSpec, HostRegion
from test_worker_handlers import run_round_trip

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is false)"
    ),
]
G, C = GPULoadStoreSpec, CPULoadStoreSpec
METHODS = ["auto", "dma", "kernel", "staged"]
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time queued before the transfer


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("seed", range(4))
def test_gpu_round_trip(method, dtype, seed):
    assert kvoff.cuda_available()
    run_round_trip(
        seed,
        h_kwargs={"engine": method},
        layout_kwargs={"device": "cuda", "dtypes": [dtype], "pages": (16, 4096, 32768, 128 << 10, 2 << 20)},
        expect_engine="cuda",
    )


@pytest.mark.parametrize("method", METHODS)
def test_gpu_round_trip_shared_region(method):
    name = f"kvoff-test-{uuid.uuid4().hex[:12]}"
    kv = [
        torch.randint(-100, 100, (2, 64, 16, 8, 64), dtype=torch.int8, device="cuda").to(torch.bfloat16)
        for _ in range(2)
    ]
    slot = 2 * 16 * 8 * 64 * 2 * 4  # K and V pages × factor 4
    regions = [HostRegion.shared(name, 16, slot, 2, r, timeout=10.0) for r in (0, 1)]
    try:
        hs = [CpuGpuOffloadingHandlers([kv[r]], 4, 16, region=regions[r], engine=method) for r in (0, 1)]
        for r, h in enumerate(hs):
            assert regions[r].is_pinned, regions[r].pin_error
            ids = list(range(8 * r, 8 * r + 8))
            h.gpu_to_cpu_handler.transfer_async(1, (G(ids), C([3, 9])))
            h.gpu_to_cpu_handler.wait([1])
            assert h.gpu_to_cpu_handler.get_finished()[0].success
        for r, h in enumerate(hs):
            dst = list(range(40, 48))
            h.cpu_to_gpu_handler.transfer_async(2, (C([3, 9]), G(dst)))
            h.cpu_to_gpu_handler.wait([2])
            assert h.cpu_to_gpu_handler.get_finished()[0].success
            src = list(range(8 * r, 8 * r + 8))
            assert torch.equal(kv[r][:, dst], kv[r][:, src])
        for h in hs:
            h.shutdown()
    finally:
        for reg in regions:
            reg.close()


def _handlers(method, blocks=256, page_elems=16 * 1024, ncpu=256):
    kv = torch.randint(-100, 100, (2, blocks, page_elems), dtype=torch.int16, device="cuda").to(
        torch.bfloat16
    )
    return kv, CpuGpuOffloadingHandlers([kv], 1, ncpu, engine=method)


@pytest.mark.parametrize("method", METHODS)
def test_load_lands_after_queued_work_on_current_stream(method):
    kv, h = _handlers(method)
    src = list(range(64))
    dst = list(range(100, 164))
    h.gpu_to_cpu_handler.transfer_async(1, (G(src), C(list(range(64)))))
    h.gpu_to_cpu_handler.wait([1])
    assert h.gpu_to_cpu_handler.get_finished()[0].success
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the caller's current stream is a non-default stream
        torch.cuda._sleep(SLEEP_CYCLES)
        kv[:, dst] = 0  # queued after the sleep: must not overwrite the loaded bytes
        h.cpu_to_gpu_handler.transfer_async(2, (C(list(range(64))), G(dst)))
    h.cpu_to_gpu_handler.wait([2])
    assert h.cpu_to_gpu_handler.get_finished()[0].success
    torch.cuda.synchronize()
    assert torch.equal(kv[:, dst], kv[:, src])
    h.shutdown()


@pytest.mark.parametrize("method", METHODS)
def test_store_reads_after_queued_writes(method):
    kv, h = _handlers(method)
    ids = list(range(10, 74))
    torch.cuda._sleep(SLEEP_CYCLES)
    kv[:, ids] = 3.0  # queued on the current (default) stream after the sleep
    h.gpu_to_cpu_handler.transfer_async(1, (G(ids), C(list(range(64)))))
    h.gpu_to_cpu_handler.wait([1])
    assert h.gpu_to_cpu_handler.get_finished()[0].success
    expect = torch.full((64, 16 * 1024), 3.0, dtype=torch.bfloat16).view(torch.uint8)
    for t in h.cpu_tensors:  # K and V
        assert torch.equal(t[:64], expect)
    h.shutdown()


@pytest.mark.parametrize("method", METHODS)
def test_concurrent_store_and_load_many_jobs(method):
    kv, h = _handlers(method, blocks=512, page_elems=8 * 1024, ncpu=512)
    rng = random.Random(3)
    snap = kv.clone()
    st, ld = h.gpu_to_cpu_handler, h.cpu_to_gpu_handler
    # Pre-store blocks 0..127 into CPU 0..127, then load them to 256..383 while storing 128..255.
    st.transfer_async(0, (G(list(range(128))), C(list(range(128)))))
    st.wait([0])
    st.get_finished()
    order = list(range(128))
    rng.shuffle(order)
    for j in range(64):
        a, b = order[2 * j], order[2 * j + 1]
        st.transfer_async(100 + j, (G([128 + a, 128 + b]), C([128 + a, 128 + b])))
        ld.transfer_async(200 + j, (C([a, b]), G([256 + a, 256 + b])))
    st.wait(range(100, 164))
    ld.wait(range(200, 264))
    rs, rl = st.get_finished(), ld.get_finished()
    assert [r.job_id for r in rs] == list(range(100, 164)) and all(r.success for r in rs)
    assert [r.job_id for r in rl] == list(range(200, 264)) and all(r.success for r in rl)
    torch.cuda.synchronize()
    assert torch.equal(kv[:, 256:384], snap[:, 0:128])
    assert torch.equal(kv[:, :256], snap[:, :256])
    cpu = torch.stack([t[128:256].view(torch.bfloat16) for t in h.cpu_tensors])
    assert torch.equal(cpu.cuda(), snap[:, 128:256])
    h.shutdown()


@pytest.mark.parametrize("method", METHODS)
def test_gpu_shutdown_with_jobs_in_flight(method):
    kv, h = _handlers(method)
    st = h.gpu_to_cpu_handler
    torch.cuda._sleep(SLEEP_CYCLES)
    for j in range(16):
        st.transfer_async(j, (G(list(range(16 * j, 16 * j + 16))), C(list(range(16 * j, 16 * j + 16)))))
    h.shutdown()
    res = st.get_finished()
    assert [r.job_id for r in res] == list(range(16)) and all(r.success for r in res)
    cpu = torch.stack([t.view(torch.bfloat16) for t in h.cpu_tensors])
    assert torch.equal(cpu.cuda(), kv)
    h.shutdown()


def test_engine_auto_picks_cuda_and_pins():
    kv = torch.zeros(8, 4096, dtype=torch.uint8, device="cuda")
    h = CpuGpuOffloadingHandlers([kv], 1, 4)
    assert h.engine.startswith("cuda") and h.region.is_pinned
    h.shutdown()


def test_auto_follows_the_model():
    """With the default budget, ``auto`` uses its serving policy while the model is seen computing:
    on the caller's current stream (the stream jobs are ordered after, as in vLLM) or on a watched
    ``compute_streams`` stream; with the GPU idle for longer than the window (100 ms) it takes the
    idle-GPU policy. Every stored block is checked byte for byte."""
    kv = [torch.randint(0, 255, (32, 32 << 10), dtype=torch.uint8, device="cuda") for _ in range(4)]
    model = torch.cuda.Stream()
    h = CpuGpuOffloadingHandlers(kv, 1, 32, compute_streams=[model])
    st = h.gpu_to_cpu_handler
    job = iter(range(1, 100))

    def store(ids):
        j = next(job)
        st.transfer_async(j, (G(ids), C(ids)))
        st.wait(j)
        assert all(r.success for r in st.get_finished())
        for g, c in zip(kv, h.cpu_tensors, strict=True):
            assert torch.equal(g[ids].cpu(), c[ids])
        return st.last_submit_stats

    try:
        torch.cuda._sleep(SLEEP_CYCLES)  # the model's forward, queued on the current stream
        s = store([0, 1, 2, 3])
        assert s["policy"] == "serving" and s["method"] == "dma", s
        assert s["reason"] == "serving: large copies", s
        torch.cuda.synchronize()
        time.sleep(0.15)
        s = store([4, 5, 6, 7])
        assert s["policy"] == "idle", s
        assert s["reason"].startswith("idle: "), s
        time.sleep(0.15)
        with torch.cuda.stream(model):
            torch.cuda._sleep(SLEEP_CYCLES)  # the model on a stream the transfers are not ordered after
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            s = store([8, 9, 10, 11])
        assert s["policy"] == "serving", s
        torch.cuda.synchronize()
        none = CpuGpuOffloadingHandlers(kv, 1, 32, compute_budget=None)
        j = next(job)
        none.gpu_to_cpu_handler.transfer_async(j, (G([0]), C([0])))
        none.gpu_to_cpu_handler.wait(j)
        assert none.gpu_to_cpu_handler.last_submit_stats["policy"] == "idle"
        none.shutdown()
    finally:
        h.shutdown()


def test_per_layer_tensors_are_not_taken_for_pitched_runs(monkeypatch):
    """64 per-layer tensors of 512 KiB are separate allocations (torch's small pool puts four in
    one 2 MiB segment, and the segments often lie next to each other): a block's pages look evenly
    spaced, but the driver refuses a pitched copy that spans two allocations. ``auto`` beside a
    model must not choose DMA for such "pitched runs" (it moved 3-5 GB/s there, where staging moved
    10, on an H100); stores and loads arrive byte for byte either way."""
    monkeypatch.setenv("KVOFF_CUDA_TUNE", "idleafter=0")  # the serving policy on every job
    kv = [torch.randint(0, 255, (128, 4096), dtype=torch.uint8, device="cuda") for _ in range(64)]
    ptrs = [t.data_ptr() for t in kv]
    even = sum(ptrs[i + 1] - ptrs[i] == 512 << 10 for i in range(63))
    h = CpuGpuOffloadingHandlers(kv, 1, 16)
    st, ld = h.gpu_to_cpu_handler, h.cpu_to_gpu_handler
    try:
        blocks = [3, 40, 17, 99, 64, 5, 120, 77]
        st.transfer_async(1, (G(blocks), C(list(range(8)))))
        st.wait(1)
        assert [r.success for r in st.get_finished()] == [True]
        s = st.last_submit_stats
        assert s["policy"] == "serving", s
        assert s["reason"] != "serving: pitched runs", (s, f"{even} of 63 tensor gaps are 512 KiB")
        # Only the serving policy's staged jobs are ever paced (and a lone small job arrives far
        # under the device's cap, so not even it).
        assert s["staged_cap_mb_s"] == 0, s
        for g, c in zip(kv, h.cpu_tensors, strict=True):
            assert torch.equal(g[blocks].cpu(), c[:8])
        dst = [100, 101, 30, 31, 0, 9, 126, 60]
        ld.transfer_async(2, (C(list(range(8))), G(dst)))
        ld.wait(2)
        assert [r.success for r in ld.get_finished()] == [True]
        assert ld.last_submit_stats["reason"] != "serving: pitched runs"
        for g in kv:
            assert torch.equal(g[dst], g[blocks])
    finally:
        h.shutdown()


def test_current_stream_reader_follows_the_callers_stream():
    """The submit reads the caller's current stream through torch's direct accessor: the same
    handle as torch.cuda.current_stream(), on the default stream, inside ``torch.cuda.stream``,
    and per device."""
    from kvoff.handlers import _current_stream_reader

    dev = torch.device("cuda", torch.cuda.current_device())
    read = _current_stream_reader(dev)
    assert read() == torch.cuda.current_stream(dev).cuda_stream
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert read() == s.cuda_stream != 0
    assert read() == torch.cuda.current_stream(dev).cuda_stream
    for i in range(torch.cuda.device_count()):
        d = torch.device("cuda", i)
        assert _current_stream_reader(d)() == torch.cuda.current_stream(d).cuda_stream
