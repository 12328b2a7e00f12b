"""vLLM 0.33's CPU-manager scenarios (tests/v1/kv_offload/cpu/test_manager.py), run through vLLM's
``OffloadingManager`` interface on kvoff's managers (``KvoffOffloadingManager``), both policies.

Written from the interface and those tests' scenarios (docs/spec.md §2.6 lists the same ones).
vLLM 0.33 moved recency from ``touch`` to request completion (``on_request_finished``); the
request-scoped tests at the end check the adapter's mapping of that onto kvoff's ``touch``.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.vllm

try:
    import kvoff.vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"vLLM (0.32 or 0.33) is not importable: {e}", allow_module_level=True)

from kvoff.vllm import KvoffOffloadingManager
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm_helpers import kvoff_extra, make_offloading_config

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
CTX = ReqContext(req_id="")
POLICIES = ["lru", "arc"]


def K(i: int) -> OffloadKey:
    return make_offload_key(str(i).encode(), 0)


def ks(*ints: int) -> list[OffloadKey]:
    return [K(i) for i in ints]


def make(num_blocks: int = 4, policy: str = "lru", events: bool = True, **kw) -> KvoffOffloadingManager:
    return KvoffOffloadingManager(num_blocks, eviction_policy=policy, enable_events=events, **kw)


def check_store(out: PrepareStoreOutput | None, keys: list[int], ids: list[int], evicted: list[int]) -> None:
    assert out is not None
    assert out.keys_to_store == ks(*keys)
    assert out.evicted_keys == ks(*evicted)
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    assert np.array_equal(out.store_spec.block_ids, np.array(ids, dtype=np.int64))


def check_events(events, stores: tuple[set[int], ...] = (), evictions: tuple[set[int], ...] = ()) -> None:
    got_s, got_e = [], []
    for ev in events:
        assert isinstance(ev, OffloadingEvent) and ev.medium is Medium.CPU
        (got_e if ev.removed else got_s).append(set(ev.keys))
    assert tuple(got_e) == tuple(set(ks(*e)) for e in evictions)
    assert tuple(got_s) == tuple(set(ks(*s)) for s in stores)


def store_complete(m: KvoffOffloadingManager, *ints: int, ctx: ReqContext = CTX) -> None:
    assert m.prepare_store(ks(*ints), ctx) is not None
    m.complete_store(ks(*ints), ctx)


def lists(m: KvoffOffloadingManager) -> list[list[OffloadKey]]:
    return m.kvoff_manager.debug_lists()


@pytest.mark.parametrize("policy", POLICIES)
def test_cpu_manager_main_flow(policy: str) -> None:
    m = make(4, policy)
    # prepare store [1, 2] → ids [0, 1]; in flight, so lookups say HIT_PENDING
    check_store(m.prepare_store(ks(1, 2), CTX), [1, 2], [0, 1], [])
    assert m.lookup(K(1), CTX) is PENDING and m.lookup(K(2), CTX) is PENDING
    assert list(m.take_events()) == []
    # complete store [1, 2] → one stored event
    m.complete_store(ks(1, 2), CTX)
    check_events(m.take_events(), stores=({1, 2},))
    assert [m.lookup(K(i), CTX) for i in (1, 2, 3)] == [HIT, HIT, MISS]
    # prepare store [2, 3, 4, 5] → 2 is already stored; evicts 1; ids [2, 3, 0]
    check_store(m.prepare_store(ks(2, 3, 4, 5), CTX), [3, 4, 5], [2, 3, 0], [1])
    check_events(m.take_events(), evictions=({1},))
    # no space: 3, 4, 5 pending, 2 is protected (offered)
    assert m.prepare_store(ks(1, 6), CTX) is None
    m.complete_store(ks(2, 3, 4, 5), CTX)
    assert [m.lookup(K(i), CTX) for i in (0, 1, 2, 3, 4, 5)] == [MISS, MISS, HIT, HIT, HIT, HIT]
    # prepare load [2, 3] → ids [1, 2]; loading blocks are not evictable
    spec = m.prepare_load(ks(2, 3), CTX)
    assert isinstance(spec, CPULoadStoreSpec) and spec.block_ids.tolist() == [1, 2]
    assert m.prepare_store(ks(6, 7, 8), CTX) is None
    m.complete_load(ks(2, 3), CTX)
    # now [6, 7, 8] evicts the three oldest [2, 3, 4]; ids reused last-freed-first
    check_store(m.prepare_store(ks(6, 7, 8), CTX), [6, 7, 8], [3, 2, 1], [2, 3, 4])
    m.complete_store(ks(6, 7, 8), CTX)
    # touch [5, 6, 7] → 8 is the oldest
    m.touch(ks(5, 6, 7), CTX)
    check_store(m.prepare_store(ks(9), CTX), [9], [1], [8])
    # complete [7, 9] with failure: 7 stays (it was ready), 9 is dropped without a stored event
    m.complete_store(ks(7, 9), CTX, success=False)
    assert m.lookup(K(7), CTX) is HIT and m.lookup(K(9), CTX) is MISS
    check_events(m.take_events(), stores=({3, 4, 5}, {6, 7, 8}), evictions=({2, 3, 4}, {8}))
    m.shutdown()


@pytest.mark.parametrize("policy", POLICIES)
def test_already_stored_block_not_evicted_during_prepare_store(policy: str) -> None:
    m = make(4, policy)
    store_complete(m, 1, 2)
    m.touch(ks(1), CTX)  # 2 becomes the eviction candidate
    # 2 is offered again: it must not be the victim
    check_store(m.prepare_store(ks(2, 3, 4, 5), CTX), [3, 4, 5], [2, 3, 0], [1])
    m.complete_store(ks(2, 3, 4, 5), CTX)
    assert m.lookup(K(2), CTX) is HIT


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_load_preserves_key_order(policy: str) -> None:
    m = make(4, policy)
    out = m.prepare_store(ks(0, 1, 2), CTX)
    assert out is not None
    where = dict(zip(out.keys_to_store, out.store_spec.block_ids.tolist(), strict=True))
    m.complete_store(ks(0, 1, 2), CTX)
    for order in ([0, 1, 2], [1, 2, 0], [2, 0, 1]):
        spec = m.prepare_load(ks(*order), CTX)
        assert spec.block_ids.tolist() == [where[K(i)] for i in order]
        m.complete_load(ks(0, 1, 2), CTX)


@pytest.mark.parametrize("policy", POLICIES)
def test_store_threshold_reports_stores_skipped(policy: str) -> None:
    m = make(4, policy, events=False, store_threshold=2)
    check_store(m.prepare_store(ks(1, 2, 3), CTX), [], [], [])
    stats = m.get_stats()
    assert stats is not None and stats.reduce()[CPUOffloadingMetrics.STORES_SKIPPED] == 3
    assert m.get_stats().reduce()[CPUOffloadingMetrics.STORES_SKIPPED] == 0
    # offered a second time: stored
    check_store(m.prepare_store(ks(1, 2), CTX), [1, 2], [0, 1], [])


@pytest.mark.parametrize("policy", POLICIES)
def test_cache_usage_gauges(policy: str) -> None:
    def gauges(m):
        r = m.get_stats().reduce()
        return (
            r[CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC],
            r[CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC],
            r[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC],
        )

    assert gauges(make(0, policy)) == (0.0, 0.0, 0.0)
    m = make(4, policy)
    assert gauges(m) == (0.0, 0.0, 0.0)
    m.prepare_store(ks(1, 2), CTX)
    assert gauges(m) == pytest.approx((0.5, 0.0, 0.5))
    m.complete_store(ks(1, 2), CTX)
    assert gauges(m) == (0.0, 0.0, 0.0)
    m.prepare_load(ks(1), CTX)
    assert gauges(m) == pytest.approx((0.0, 0.25, 0.25))
    m.complete_load(ks(1), CTX)
    m.prepare_store(ks(3, 4), CTX)
    m.prepare_load(ks(2), CTX)
    assert gauges(m) == pytest.approx((0.5, 0.25, 0.75))
    # allocation-size histogram: one observation per non-empty prepare_store since the last call
    m2 = make(4, policy)
    m2.prepare_store(ks(1, 2), CTX)
    m2.prepare_store(ks(3), CTX)
    r = m2.get_stats().reduce()
    assert r[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_count"] == 2
    assert r[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_sum"] == 3


@pytest.mark.parametrize("policy", POLICIES)
def test_protected_blocks(policy: str) -> None:
    # all blocks loading → no room
    m = make(2, policy)
    store_complete(m, 1, 2)
    m.prepare_load(ks(1, 2), CTX)
    assert m.prepare_store(ks(3), CTX) is None
    # 1 is offered (protected), 2 is loading → no room
    m = make(2, policy)
    store_complete(m, 1, 2)
    m.prepare_load(ks(2), CTX)
    assert m.prepare_store(ks(1, 3), CTX) is None
    # eviction is atomic: 3 victims needed, 2 available → nothing evicted
    m = make(3, policy)
    store_complete(m, 1, 2, 3)
    m.prepare_load(ks(1), CTX)
    before = lists(m)
    assert m.prepare_store(ks(4, 5, 6), CTX) is None
    assert lists(m) == before
    assert [m.lookup(K(i), CTX) for i in (1, 2, 3)] == [HIT, HIT, HIT]


@pytest.mark.parametrize("policy", POLICIES)
def test_zero_capacity(policy: str) -> None:
    m = make(0, policy)
    assert m.prepare_store(ks(1), CTX) is None
    assert m.get_stats().reduce()[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC] == 0.0


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_cache(policy: str) -> None:
    m = make(4, policy)
    store_complete(m, 1, 2)
    m.take_events()
    m.reset_cache()
    assert m.lookup(K(1), CTX) is MISS and len(m) == 0
    check_store(m.prepare_store(ks(3), CTX), [3], [0], [])


def test_lru_touch_order() -> None:
    m = make(4, "lru")
    store_complete(m, 1, 2, 3, 4)
    m.touch(ks(1, 2), CTX)  # 1 most recent, then 2
    evicted = []
    for new in range(10, 14):
        out = m.prepare_store(ks(new), CTX)
        assert out is not None
        evicted += out.evicted_keys
        m.complete_store(ks(new), CTX)
    assert evicted == ks(3, 4, 2, 1)


def test_lru_touch_then_single_store() -> None:
    m = make(4, "lru")
    store_complete(m, 1, 2, 3, 4)
    m.touch(ks(1), CTX)
    check_store(m.prepare_store(ks(5), CTX), [5], [1], [2])


class TestARC:
    def test_basic_t1(self) -> None:
        m = make(4, "arc")
        store_complete(m, 1, 2)
        t1, t2, _, _ = lists(m)
        assert t1 == ks(1, 2) and t2 == []

    def test_t1_to_t2_promotion(self) -> None:
        m = make(4, "arc", events=False)
        store_complete(m, 1)
        m.touch(ks(1), CTX)
        t1, t2, _, _ = lists(m)
        assert t1 == [] and t2 == ks(1)

    def test_pending_touch_stays_in_t1(self) -> None:
        m = make(4, "arc")
        m.prepare_store(ks(1), CTX)
        m.touch(ks(1), CTX)
        assert lists(m)[0] == ks(1)

    def test_ghost_list_and_adaptation(self) -> None:
        m = make(2, "arc")
        store_complete(m, 1, 2)
        out = m.prepare_store(ks(3), CTX)
        check_store(out, [3], [0], [1])
        m.complete_store(ks(3), CTX)
        t1, t2, b1, b2 = lists(m)
        assert (t1, t2, b1, b2) == (ks(2, 3), [], ks(1), [])
        assert m.kvoff_manager.arc_target == 0
        m.touch(ks(1), CTX)  # a ghost hit in B1 grows the T1 target
        assert m.kvoff_manager.arc_target == 1.0

    def test_t2_order_and_eviction(self) -> None:
        m = make(4, "arc")
        store_complete(m, 1, 2, 3, 4)
        m.touch(ks(3, 4), CTX)
        t1, t2, _, _ = lists(m)
        assert t1 == ks(1, 2) and t2 == ks(4, 3)
        m.touch(ks(1, 3, 4), CTX)
        assert lists(m)[1] == ks(4, 3, 1)
        check_store(m.prepare_store(ks(5), CTX), [5], [1], [2])

    def test_ghost_lists_bounded(self) -> None:
        m = make(2, "arc")
        store_complete(m, 1, 2)
        for i in range(3, 20):
            store_complete(m, i)
        t1, _, b1, _ = lists(m)
        assert t1 == ks(18, 19) and b1 == ks(16, 17)

    def test_eviction_with_load(self) -> None:
        m = make(4, "arc")
        store_complete(m, 1, 2, 3, 4)
        m.prepare_load(ks(1, 2), CTX)
        # 3, 4 evicted (1, 2 are loading); their ids are reused last-freed-first
        check_store(m.prepare_store(ks(5, 6), CTX), [5, 6], [3, 2], [3, 4])
        m.complete_load(ks(1, 2), CTX)


# --- vLLM 0.33's request-scoped recency (on_request_finished) -----------------------------------


def test_lru_request_finish_makes_prefix_most_recent() -> None:
    m = make(4, "lru")
    store_complete(m, 1, 2, 3, 4)
    req = ReqContext(req_id="a")
    m.on_new_request(req)
    m.prepare_load(ks(1, 2), req)  # the request reuses the prefix [1, 2]
    m.complete_load(ks(1, 2), req)
    assert m.prepare_store(ks(5), CTX).evicted_keys == ks(1)  # nothing committed yet
    m.complete_store(ks(5), CTX)
    m.on_request_finished(req)  # commits: 1 was evicted (ignored); 2 becomes most recent
    out = m.prepare_store(ks(6, 7), CTX)
    assert out is not None and out.evicted_keys == ks(3, 4)
    m.on_request_finished(req)  # twice is harmless


def test_lru_request_finish_orders_by_token_position() -> None:
    m = make(3, "lru")
    req = ReqContext(req_id="a")
    m.on_new_request(req)
    for pos, i in enumerate((1, 2, 3)):
        req.set_offload_key_position(K(i), (pos + 1) * 16)
    # stores arrive tail-first (e.g. a backfill); the head still ends most recently used
    for i in (3, 2, 1):
        store_complete(m, i, ctx=req)
    m.on_request_finished(req)
    out = m.prepare_store(ks(9), CTX)
    assert out is not None and out.evicted_keys == ks(3)


def test_arc_request_finish_promotes_only_reused_blocks() -> None:
    m = make(4, "arc")
    a = ReqContext(req_id="a")
    m.on_new_request(a)
    store_complete(m, 1, 2, ctx=a)
    m.on_request_finished(a)  # a store is not a second access: 1, 2 stay in T1
    t1, t2, _, _ = lists(m)
    assert t1 == ks(1, 2) and t2 == []
    b = ReqContext(req_id="b")
    m.on_new_request(b)
    m.prepare_load(ks(1), b)
    m.complete_load(ks(1), b)
    out = m.prepare_store(ks(1, 3), b)  # offers 1 again (already stored) and stores 3
    assert out is not None and out.keys_to_store == ks(3)
    m.complete_store(ks(3), b)
    m.on_request_finished(b)  # 1 was reused → T2; 3 was only inserted → T1
    t1, t2, _, _ = lists(m)
    assert t2 == ks(1) and set(t1) == set(ks(2, 3))


@pytest.mark.parametrize("policy", POLICIES)
def test_through_spec_events_follow_vllm_flag(policy: str) -> None:
    spec = OffloadingSpecFactory.create_spec(
        make_offloading_config(kvoff_extra(eviction_policy=policy), enable_events=False)
    )
    m = spec.get_manager()
    store_complete(m, 1)
    assert list(m.take_events()) == []
    spec = OffloadingSpecFactory.create_spec(
        make_offloading_config(kvoff_extra(eviction_policy=policy), enable_events=True)
    )
    m = spec.get_manager()
    store_complete(m, 1)
    check_events(m.take_events(), stores=({1},))
