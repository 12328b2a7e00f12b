"""Transfer handlers on the host engine (docs/spec.md §4, §6): canonicalization, byte-exact randomized round
trips GPU side → CPU → GPU side, bad input rejected at submission with nothing written, ordering,
shutdown with jobs in flight, engine selection."""

from __future__ import annotations

import random
import threading
import time
import uuid
from types import SimpleNamespace

import kvoff
import numpy as np
import pytest
from kvoff import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CpuGpuOffloadingHandlers,
    CPULoadStoreSpec,
    CudaUnavailableError,
    GPULoadStoreSpec,
    HostRegion,
    InvalidStateError,
    TransferResult,
    canonicalize_kv_caches,
)

torch = pytest.importorskip("torch")
from worker_model import Job, expected_load, expected_store, fill_random, random_job, random_layout


def snapshot(ts):
    return [t.cpu().numpy().copy() for t in ts]


def assert_same(actual, expected, what):
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if not np.array_equal(a, e):
            bad = np.argwhere(a != e)
            raise AssertionError(f"{what} tensor {i}: {len(bad)} bytes differ, first at {bad[0].tolist()}")


def job_bytes(caches, job):
    return sum(
        int(job.group_sizes[g]) * sum(r.page_size_bytes for r in refs)
        for g, refs in enumerate(caches.group_data_refs)
    )


# --- canonicalization (docs/spec.md §6) --------------------------------------------------------------------


def test_canonicalize_layouts_and_dtypes_zero_copy():
    flash = torch.zeros(2, 10, 16, 4, 8, dtype=torch.bfloat16)  # (2, num_blocks, …)
    infer = torch.zeros(10, 2, 16, 4, 8, dtype=torch.float8_e4m3fn)  # (num_blocks, 2, …)
    cross = torch.zeros(10, 3, 5, dtype=torch.int8)  # cross-layer (num_blocks, num_layers, …)
    c = canonicalize_kv_caches({"a": flash, "b": infer, "c": cross})
    assert [t.page_size_bytes for t in c.tensors] == [16 * 32 * 2, 16 * 32 * 2, 2 * 16 * 32, 15]
    assert len(c.group_data_refs) == 1
    assert [(r.tensor_idx, r.page_size_bytes) for r in c.group_data_refs[0]] == [
        (i, t.page_size_bytes) for i, t in enumerate(c.tensors)
    ]
    for t in c.tensors:
        assert t.tensor.dtype == torch.uint8 and t.tensor.shape == (10, t.page_size_bytes)
    # zero-copy: writes through the views land in the originals
    c.tensors[1].tensor[3].fill_(0xFF)
    assert flash[1, 3].view(torch.uint8).min() == 0xFF and flash[0].view(torch.uint8).max() == 0
    c.tensors[3].tensor[9, -1] = 7
    assert cross[9, 2, 4] == 7


def test_canonicalize_list_single_kv_tensor_is_split():
    t = torch.zeros(2, 5, 8)
    c = canonicalize_kv_caches([t])
    assert len(c.tensors) == 2 and c.tensors[0].tensor.shape == (5, 32)
    c2 = canonicalize_kv_caches([t], num_blocks=2)  # explicit: (2, 2?) no — rows of 5×8 floats
    assert len(c2.tensors) == 1 and c2.tensors[0].tensor.shape == (2, 160)


@pytest.mark.parametrize(
    "caches",
    [
        [torch.zeros(())],
        [torch.zeros(4, 3), torch.zeros(5, 3)],  # no common num_blocks
        [torch.zeros(4, 3, 8).transpose(1, 2)],  # block bytes not contiguous
        [torch.zeros(3, 0)],  # empty blocks
    ],
)
def test_canonicalize_rejects_bad_shapes(caches):
    with pytest.raises(ValueError, match=r"\("):
        canonicalize_kv_caches(caches)


def test_canonicalize_rejects_non_tensors():
    with pytest.raises(TypeError):
        canonicalize_kv_caches([np.zeros((3, 4))])
    with pytest.raises(TypeError):
        canonicalize_kv_caches(torch.zeros(3, 4))
    with pytest.raises(ValueError):
        canonicalize_kv_caches([])


# --- randomized round trips ------------------------------------------------------------------------


def run_round_trip(seed: int, h_kwargs=None, layout_kwargs=None, expect_engine="host", region=None):
    """Store random blocks, check every CPU byte; load them into other random blocks, check every
    GPU-side byte (sources unchanged, non-destinations unchanged)."""
    rng = random.Random(seed)
    f = rng.choice([1, 3, 4, 16])
    lay = random_layout(rng, **(layout_kwargs or {}))
    slot = sum(t.page_size_bytes for t in lay.caches.tensors) * f
    num_cpu = rng.randint(2, max(2, min(30, (48 << 20) // slot)))
    if region is not None:
        region = region(num_cpu, slot)
    h = CpuGpuOffloadingHandlers(lay.caches, f, num_cpu, region=region, **(h_kwargs or {"engine": "host"}))
    try:
        assert h.engine.startswith(expect_engine), h.engine
        for t in h.gpu_tensors + h.cpu_tensors:
            fill_random(t, rng)
        ng = len(lay.caches.group_data_refs)
        job = random_job(rng, ng, lay.num_gpu_blocks, num_cpu, f)
        gpu0, cpu0 = snapshot(h.gpu_tensors), snapshot(h.cpu_tensors)
        exp_cpu = expected_store(lay.caches, gpu0, cpu0, job, f)
        st, ld = h.gpu_to_cpu_handler, h.cpu_to_gpu_handler
        spec = GPULoadStoreSpec(job.gpu_ids, job.group_sizes, job.block_indices)
        assert st.transfer_async(10, (spec, CPULoadStoreSpec(job.cpu_ids))) is True
        st.wait({10})
        (r,) = st.get_finished()
        assert r == TransferResult(10, True, job_bytes(lay.caches, job), r.transfer_time, ("GPU", "CPU"))
        assert r.transfer_time >= 0
        assert_same(snapshot(h.cpu_tensors), exp_cpu, "CPU after store")
        assert_same(snapshot(h.gpu_tensors), gpu0, "GPU (source) after store")

        # Load back into other, random GPU blocks over fresh random GPU bytes.
        for t in h.gpu_tensors:
            fill_random(t, rng)
        ids2 = np.array(rng.sample(range(lay.num_gpu_blocks), len(job.gpu_ids)), dtype=np.int64)
        job2 = Job(ids2, job.group_sizes, job.block_indices, job.cpu_ids)
        gpu1, cpu1 = snapshot(h.gpu_tensors), snapshot(h.cpu_tensors)
        exp_gpu = expected_load(lay.caches, gpu1, cpu1, job2, f)
        assert ld.transfer_async(
            11, (CPULoadStoreSpec(job2.cpu_ids), GPULoadStoreSpec(ids2, job.group_sizes, job.block_indices))
        )
        ld.wait([11])
        (r,) = ld.get_finished()
        assert r.success and r.transfer_type == ("CPU", "GPU") and r.job_id == 11
        assert_same(snapshot(h.gpu_tensors), exp_gpu, "GPU after load")
        assert_same(snapshot(h.cpu_tensors), cpu1, "CPU (source) after load")
        # Round trip: loaded blocks hold what was stored from the original blocks.
        for g_old, g_new in zip(job.gpu_ids, ids2, strict=True):
            for refs in lay.caches.group_data_refs:
                for ref in refs:
                    if g_old in _group_ids(lay.caches, job, ref):
                        p = ref.page_size_bytes
                        assert np.array_equal(
                            exp_gpu[ref.tensor_idx][g_new, :p], gpu0[ref.tensor_idx][g_old, :p]
                        )
    finally:
        h.shutdown()


def _group_ids(caches, job, ref):
    off = 0
    for g, refs in enumerate(caches.group_data_refs):
        n = int(job.group_sizes[g])
        if ref in refs:
            return set(job.gpu_ids[off : off + n].tolist())
        off += n
    return set()


@pytest.mark.parametrize("seed", range(40))
def test_random_round_trip(seed):
    run_round_trip(seed)


@pytest.mark.parametrize("seed", range(3))
def test_round_trip_2mib_pages(seed):
    run_round_trip(1000 + seed, layout_kwargs={"pages": (2 << 20,), "max_tensors": 2})


@pytest.mark.parametrize("seed", range(3))
def test_round_trip_many_tiny_tensors(seed):
    run_round_trip(2000 + seed, layout_kwargs={"pages": (8,), "max_tensors": 64})


def test_round_trip_in_shared_region_slot():
    kv = torch.arange(2 * 12 * 64, dtype=torch.int32).reshape(2, 12, 64)  # 256 B pages, K and V
    name = f"kvoff-test-{uuid.uuid4().hex[:12]}"
    regions = [HostRegion.shared(name, 8, 2 * 256 * 2, 2, r, timeout=5.0) for r in (0, 1)]
    try:
        hs = [
            CpuGpuOffloadingHandlers([kv.clone() + r], 2, 8, region=regions[r], engine="host") for r in (0, 1)
        ]
        for r, h in enumerate(hs):
            h.gpu_to_cpu_handler.transfer_async(1, (GPULoadStoreSpec([4, 5, 6]), CPULoadStoreSpec([7, 0])))
            h.gpu_to_cpu_handler.wait([1])
            assert h.gpu_to_cpu_handler.get_finished()[0].success
            assert h.cpu_tensors[0].data_ptr() == regions[r].ptr + r * regions[r].slot_bytes
        # rank 1's bytes are visible to rank 0 and differ by the +1 of its KV cache
        rows0 = regions[0].view_numpy(0, 0, 1024)[[7, 0]]
        rows1 = regions[0].view_numpy(1, 0, 1024)[[7, 0]]
        assert not np.array_equal(rows0, rows1)
        for h in hs:
            h.gpu_to_cpu_handler.shutdown()
            h.cpu_to_gpu_handler.shutdown()
    finally:
        for r in regions:
            r.close()


# --- bad input: a clear exception at submission, nothing written --------------------------------


@pytest.fixture
def small():
    rng = random.Random(7)
    kv = {
        "l0": torch.zeros(2, 16, 32, dtype=torch.bfloat16),
        "l1": torch.zeros(16, 4, 4, dtype=torch.float32),
    }
    h = CpuGpuOffloadingHandlers(kv, 4, 6, engine="host")
    for t in h.gpu_tensors + h.cpu_tensors:
        fill_random(t, rng)
    yield h
    h.shutdown()


def test_last_submit_stats_describe_the_submit(small):
    """The handlers say what the last submit did: nothing before the first; the host engine moves
    bytes with the CPU (no SMs, no driver calls) and times the submit."""
    st = small.gpu_to_cpu_handler
    assert st.last_submit_stats == {
        "method": None,
        "sms": 0,
        "policy": None,
        "submit_ns": 0,
        "longest_call_ns": 0,
        "longest_call_cpu_ns": 0,
        "driver_calls": 0,
        "longest_call": None,
        "paced_ns": 0,
        "fed": False,
        "reason": None,
        "staged_cap_mb_s": 0,
        "polite": False,
        "driver_contention": (0, 0, 0),
        "driver_blocked": (0, [0] * 8),
    }
    assert st.transfer_async(1, (G([0, 1, 2, 3]), C([2])))
    st.wait(1)
    assert [r.success for r in st.get_finished()] == [True]
    s = st.last_submit_stats
    assert s["method"] == "host" and s["sms"] == 0 and s["driver_calls"] == 0
    assert s["longest_call"] is None and s["paced_ns"] == 0
    assert s["submit_ns"] > 0 and s["longest_call_ns"] == 0
    assert s["policy"] is None, "only the CUDA engine's auto chooses by policy"
    assert s["reason"] is None, "the host engine has one method"
    assert s["staged_cap_mb_s"] == 0, "only the CUDA engine's staged pipeline is paced"
    assert s["polite"] is False and s["driver_contention"] == (0, 0, 0), (
        "the host engine makes no driver calls"
    )
    assert s["driver_blocked"] == (0, [0] * 8)


def test_compute_streams_are_checked():
    """``compute_streams`` holds torch CUDA streams (refused otherwise, before anything is built);
    the host engine has no policy to feed and ignores them."""
    kv = {"l0": torch.zeros(4, 2, 16, dtype=torch.float16)}
    with pytest.raises(TypeError, match="compute_streams must hold torch CUDA streams"):
        CpuGpuOffloadingHandlers(kv, 1, 4, engine="host", compute_streams=[object()])
    CpuGpuOffloadingHandlers(kv, 1, 4, engine="host", compute_streams=None).shutdown()
    h = CpuGpuOffloadingHandlers(kv, 1, 4, engine="host", compute_streams=[])
    h.gpu_to_cpu_handler._native.set_compute_streams([])
    h.gpu_to_cpu_handler._native.set_compute_streams([0, 12345])  # ignored by the host engine
    with pytest.raises((TypeError, ValueError, OverflowError)):
        h.gpu_to_cpu_handler._native.set_compute_streams([-1])
    h.shutdown()


def _submit_and_check_nothing_written(h, direction, job_id, spec, exc, match=None):
    handler = h.gpu_to_cpu_handler if direction == "store" else h.cpu_to_gpu_handler
    before = snapshot(h.gpu_tensors), snapshot(h.cpu_tensors)
    with pytest.raises(exc, match=match):
        handler.transfer_async(job_id, spec)
    time.sleep(0.01)
    assert handler.get_finished() == []
    assert_same(snapshot(h.gpu_tensors), before[0], "GPU")
    assert_same(snapshot(h.cpu_tensors), before[1], "CPU")


G, C = GPULoadStoreSpec, CPULoadStoreSpec
BAD = [
    ("store", (G([1, 2, 99]), C([0])), ValueError, "out of range"),
    ("store", (G([1, 2, -1]), C([0])), ValueError, None),
    ("load", (C([6]), G([1, 2])), ValueError, "out of range"),
    ("store", (G([1, 2, 3, 4, 5]), C([0])), ValueError, "CPU block ids"),  # too few CPU ids
    ("store", (G([1, 2]), C([0, 1])), ValueError, "consume"),  # CPU ids left over
    ("store", (G([1, 2], group_sizes=[3]), C([0])), ValueError, None),  # sizes ≠ ids
    ("store", (G([1, 2], group_sizes=[1, 1]), C([0, 1])), ValueError, None),  # 2 groups, 1 exists
    ("store", (G([1, 2], block_indices=[1, 2]), C([0])), ValueError, "block_indices"),
    ("store", (G([1, 2, 3, 4, 5, 6]), C([0, 0])), ValueError, "same destination"),
    ("load", (C([0]), G([3, 3])), ValueError, "same destination"),
    ("store", (SimpleNamespace(block_ids=np.array([1.5])), C([0])), TypeError, "integers"),
    ("store", (SimpleNamespace(block_ids=np.array([[1]])), C([0])), ValueError, "1-D"),
    ("store", (C([0]), C([0])), TypeError, "GPU"),  # swapped kinds
    ("load", (G([0]), C([0])), TypeError, None),
    ("store", (G([1]),), TypeError, "pair"),
    ("store", (G([1]), object()), TypeError, None),
]


@pytest.mark.parametrize(("direction", "spec", "exc", "match"), BAD)
def test_bad_specs_raise_and_write_nothing(small, direction, spec, exc, match):
    _submit_and_check_nothing_written(small, direction, 5, spec, exc, match)


def test_gpu_spec_validates_ids_early():
    with pytest.raises(ValueError):
        GPULoadStoreSpec(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(TypeError):
        GPULoadStoreSpec("123")
    assert GPULoadStoreSpec([]).block_ids.dtype == np.int64
    a = np.arange(3, dtype=np.int64)
    assert GPULoadStoreSpec(a).block_ids is a  # no copy


def test_job_id_busy_until_reported(small):
    st = small.gpu_to_cpu_handler
    assert st.transfer_async(1, (G([0, 1, 2, 3]), C([0])))
    before = snapshot(small.cpu_tensors)
    with pytest.raises(ValueError, match="1"):
        st.transfer_async(1, (G([4, 5, 6, 7]), C([1])))
    st.wait([1])
    assert [r.job_id for r in st.get_finished()] == [1]
    after = snapshot(small.cpu_tensors)
    assert np.array_equal(after[0][1], before[0][1])  # the rejected job wrote nothing
    assert st.transfer_async(1, (G([4, 5, 6, 7]), C([1])))  # free again once reported
    st.wait(1)
    assert st.get_finished()[0].success


def test_results_in_submission_order_and_wait_ignores_unknown(small):
    st = small.gpu_to_cpu_handler
    ids = [9, 3, 7, 1, 5]
    for k, j in enumerate(ids):
        st.transfer_async(j, (G([k]), C([k])))
    st.wait([*ids, 12345])
    assert [r.job_id for r in st.get_finished()] == ids
    assert st.get_finished() == []


def test_wrong_tensors_are_rejected():
    with pytest.raises(ValueError):
        CpuGpuOffloadingHandlers([torch.zeros(4, 8, device="meta")], 1, 2, engine="host")
    t = torch.zeros(4, 16, dtype=torch.uint8)
    same = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, 16), CanonicalKVCacheTensor(t, 16)],
        [[CanonicalKVCacheRef(0, 16)], [CanonicalKVCacheRef(1, 16)]],
    )
    with pytest.raises(ValueError, match="overlap"):
        CpuGpuOffloadingHandlers(same, 1, 2, engine="host")
    bad_ref = CanonicalKVCaches([CanonicalKVCacheTensor(t, 16)], [[CanonicalKVCacheRef(3, 16)]])
    with pytest.raises(ValueError):
        CpuGpuOffloadingHandlers(bad_ref, 1, 2, engine="host")
    with pytest.raises(ValueError):
        CpuGpuOffloadingHandlers([t], 0, 2, engine="host")
    with pytest.raises(ValueError, match="engine"):
        CpuGpuOffloadingHandlers([t], 1, 2, engine="warp")
    with pytest.raises(TypeError):
        CpuGpuOffloadingHandlers([t], 1, "2", engine="host")


def test_native_handler_rejects_non_byte_views():
    from kvoff import _native

    t = torch.zeros(4, 4, dtype=torch.float32)
    c = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="uint8"):
        _native.TransferHandler("gpu_to_cpu", [t], [c], [[(0, 16)]], 1, "host")
    with pytest.raises(TypeError):
        _native.TransferHandler("gpu_to_cpu", [object()], [c], [[(0, 16)]], 1, "host")
    with pytest.raises(ValueError, match="direction"):
        _native.TransferHandler("sideways", [c], [c.clone()], [[(0, 16)]], 1, "host")
    with pytest.raises(ValueError, match="contiguous"):
        _native.TransferHandler(
            "gpu_to_cpu", [torch.zeros(16, 4, dtype=torch.uint8).t()], [c], [[(0, 4)]], 1, "host"
        )


def test_region_too_small_or_short():
    kv = [torch.zeros(8, 1024, dtype=torch.uint8)]
    with pytest.raises(ValueError, match="slot"):
        CpuGpuOffloadingHandlers(kv, 2, 4, region=HostRegion.private(4, 1024), engine="host")
    with pytest.raises(ValueError, match="CPU blocks"):
        CpuGpuOffloadingHandlers(kv, 1, 5, region=HostRegion.private(4, 1024), engine="host")
    h = CpuGpuOffloadingHandlers(kv, 1, 3, region=HostRegion.private(4, 4096), engine="host")
    assert h.cpu_tensors[0].shape == (3, 1024)
    with pytest.raises(ValueError, match="out of range"):
        h.gpu_to_cpu_handler.transfer_async(1, (G([0]), C([3])))
    h.shutdown()


# --- shutdown, engines ---------------------------------------------------------------------------


def test_shutdown_with_jobs_in_flight_drains():
    kv = [torch.randint(0, 255, (64, 1 << 20), dtype=torch.uint8)]
    h = CpuGpuOffloadingHandlers(kv, 1, 64, engine="host")
    st = h.gpu_to_cpu_handler
    for j in range(8):
        st.transfer_async(j, (G(list(range(8 * j, 8 * j + 8))), C(list(range(8 * j, 8 * j + 8)))))
    st.shutdown()  # drains
    res = st.get_finished()
    assert [r.job_id for r in res] == list(range(8)) and all(r.success for r in res)
    assert torch.equal(h.cpu_tensors[0], kv[0])
    st.shutdown()  # idempotent
    with pytest.raises(InvalidStateError):
        st.transfer_async(99, (G([0]), C([0])))
    h.shutdown()
    h.shutdown()


def test_dropping_handlers_with_jobs_in_flight_is_safe():
    import gc
    import weakref

    kv = [torch.randint(0, 255, (32, 1 << 20), dtype=torch.uint8)]
    before = kv[0].clone()
    h = CpuGpuOffloadingHandlers(kv, 1, 32, engine="host")
    gone = weakref.ref(h)
    h.gpu_to_cpu_handler.transfer_async(1, (G(list(range(32))), C(list(range(32)))))
    del h  # the native handler drains before releasing the tensors it points into
    gc.collect()
    assert gone() is None, "the handlers were not released"
    assert torch.equal(kv[0], before), "a store wrote into its source"
    # The process and the tensors are intact: new handlers over the same KV caches round-trip.
    h2 = CpuGpuOffloadingHandlers(kv, 1, 32, engine="host")
    st = h2.gpu_to_cpu_handler
    st.transfer_async(2, (G(list(range(32))), C(list(range(32)))))
    st.wait([2])
    assert [r.success for r in st.get_finished()] == [True]
    assert torch.equal(h2.cpu_tensors[0], before)
    h2.shutdown()


def test_wait_releases_the_gil():
    # A thread that ticks while the main thread is blocked in `wait`: with the GIL held there,
    # it could not tick during the waits (only ticks counted inside them pass the test).
    kv = [torch.randint(0, 255, (64, 1 << 20), dtype=torch.uint8)]
    h = CpuGpuOffloadingHandlers(kv, 1, 64, engine="host")
    st = h.gpu_to_cpu_handler
    ticks = []
    stop = threading.Event()
    started = threading.Event()

    def spin():
        started.set()
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.0005)

    th = threading.Thread(target=spin)
    th.start()
    started.wait()
    during = 0
    waited = 0.0
    try:
        for j in range(6):
            st.transfer_async(j, (G(list(range(64))), C(list(range(64)))))
            n0, t0 = len(ticks), time.perf_counter()
            st.wait([j])
            waited += time.perf_counter() - t0
            during += len(ticks) - n0
            st.get_finished()
    finally:
        stop.set()
        th.join()
        h.shutdown()
    if waited < 0.005:
        pytest.skip(f"the waits took {waited * 1e3:.2f} ms in all: too short to tell")
    assert during > 0, f"no tick in {waited * 1e3:.1f} ms of waits: wait held the GIL"


def test_engine_selection_without_gpu():
    kv = [torch.zeros(4, 64, dtype=torch.uint8)]
    h = CpuGpuOffloadingHandlers(kv, 1, 2)  # auto with CPU tensors → host
    assert h.engine == "host" and h.gpu_to_cpu_handler.engine == "host"
    h.shutdown()
    if kvoff.cuda_available():
        pytest.skip("CUDA is available here; the CudaUnavailableError path cannot be exercised")
    for e in ("cuda", "dma", "kernel", "staged"):
        with pytest.raises(CudaUnavailableError):
            CpuGpuOffloadingHandlers(kv, 1, 2, engine=e)
        from kvoff import _native

        with pytest.raises(CudaUnavailableError):
            _native.TransferHandler(
                "gpu_to_cpu", [kv[0]], [torch.zeros(2, 64, dtype=torch.uint8)], [[(0, 64)]], 1, e
            )


def test_compute_budget_is_validated_and_passed_through():
    kv = [torch.zeros(4, 64, dtype=torch.uint8)]
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="compute_budget"):
            kvoff.CpuGpuOffloadingHandlers(kv, 1, 4, engine="host", compute_budget=bad)
    for ok in (None, 0.0, 0.02, 1.0):
        h = kvoff.CpuGpuOffloadingHandlers(kv, 1, 4, engine="host", compute_budget=ok)
        h.shutdown()


def test_native_handler_accepts_numpy_host_arrays():
    # Without torch the host engine moves blocks between numpy arrays (the benchmark's path):
    # writable 2-D uint8 arrays with contiguous rows; anything else is refused before any copy.
    import numpy as np
    from kvoff import _native

    g = [np.arange(8 * 64, dtype=np.uint8).reshape(8, 64) + i for i in range(2)]
    region = kvoff.HostRegion.private(8, 128)
    c = [region.view_numpy(0, 0, 64), region.view_numpy(0, 64, 64)]
    refs = [[(0, 64), (1, 64)]]
    store = _native.TransferHandler("gpu_to_cpu", g, c, refs, 1, "host")
    load = _native.TransferHandler("cpu_to_gpu", g, c, refs, 1, "host")
    store.submit(1, np.array([1, 2]), None, None, np.array([5, 6]))
    store.wait([1])
    assert [r[1] for r in store.get_finished()] == [True]
    assert np.array_equal(c[0][[5, 6]], g[0][[1, 2]]) and np.array_equal(c[1][[5, 6]], g[1][[1, 2]])
    g[0][3] = 0
    load.submit(2, np.array([3]), None, None, np.array([5]))
    load.wait([2])
    assert [r[1] for r in load.get_finished()] == [True]
    assert np.array_equal(g[0][3], g[0][1])
    bad = [
        (np.zeros((8, 64), dtype=np.int16), "uint8"),
        (np.zeros((8, 128), dtype=np.uint8)[:, ::2], "contiguous"),
        (np.frombuffer(bytes(8 * 64), dtype=np.uint8).reshape(8, 64), "read-only"),
        (np.zeros(64, dtype=np.uint8), "2-D"),
    ]
    for arr, what in bad:
        with pytest.raises(ValueError, match=what):
            _native.TransferHandler("gpu_to_cpu", [arr, g[1]], c, refs, 1, "host")
    store.shutdown()
    load.shutdown()
    region.close()
