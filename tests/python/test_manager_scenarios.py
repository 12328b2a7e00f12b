"""docs/spec.md §2.6 reference scenarios through the Python API, plus the surface of §2 (factory, req_context,
len/num_blocks, events, CPULoadStoreSpec). Capacity 4 unless noted; keys K(i) as in the spec (docs/spec.md)."""

from __future__ import annotations

import kvoff
import numpy as np
import pytest
from helpers import POLICIES, K, ids_of, ks, store, store_complete
from kvoff import (
    ARCOffloadingManager,
    CPULoadStoreSpec,
    LRUOffloadingManager,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    create_manager,
)


def mk(policy: str, num_blocks: int = 4, **kw) -> OffloadingManager:
    kw.setdefault("enable_events", True)
    return create_manager(policy, num_blocks, **kw)


def events(m: OffloadingManager) -> list[tuple[list[bytes], bool]]:
    """Drained events as (keys, removed) pairs."""
    return [(list(e.keys), e.removed) for e in m.take_events()]


# --------------------------------------------------------------------------- scenarios 1–8


@pytest.mark.parametrize("policy", POLICIES)
def test_s01_to_s08_sequence(policy: str) -> None:
    m = mk(policy)
    # 1: store [1,2] → keys [1,2], ids [0,1] (never-used ids ascending); both pending.
    assert store(m, 1, 2) == (ks(1, 2), [0, 1], [])
    assert m.lookup(K(1)) is None
    assert m.lookup(K(2)) is None
    # Pending stores emit nothing yet.
    assert m.take_events() == []
    # 2: complete_store [1,2] → one stored event listing {1,2}; 1,2 ready, 3 absent.
    m.complete_store(ks(1, 2))
    assert events(m) == [(ks(1, 2), False)]
    assert m.lookup(K(1)) is True
    assert m.lookup(K(2)) is True
    assert m.lookup(K(3)) is False
    # 3: store [2,3,4,5]: 2 is present, candidates 3,4,5; 2 free → evict one (1, the LRU, since the
    #    offered 2 is protected); ids: fresh 2,3 then the freed 0.
    assert store(m, 2, 3, 4, 5) == (ks(3, 4, 5), [2, 3, 0], ks(1))
    #    One removed event for {1}.
    assert events(m) == [(ks(1), True)]
    assert m.lookup(K(1)) is False
    # 4: store [1,6] with 3,4,5 pending: need 2 but only 2 is evictable → None, nothing changes.
    before = (m.debug_lists(), m.arc_target, len(m))
    assert m.prepare_store(ks(1, 6)) is None
    assert (m.debug_lists(), m.arc_target, len(m)) == before
    assert m.lookup(K(1)) is False
    assert m.lookup(K(6)) is False
    # 5: complete [2,3,4,5] (2 already ready: ignored); prepare_load [2,3] → ids [1,2].
    m.complete_store(ks(2, 3, 4, 5))
    assert events(m) == [(ks(3, 4, 5), False)]
    assert ids_of(m.prepare_load(ks(2, 3))) == [1, 2]
    #    store [6,7,8]: need 3 but 2,3 are loading → only 4,5 evictable → None.
    assert m.prepare_store(ks(6, 7, 8)) is None
    # 6: complete_load [2,3]; store [6,7,8] → evicted [2,3,4] (LRU order; for ARC all in T1 with
    #    p = 0), their ids 1,2,3 freed in that order and reused last-freed-first → [3,2,1].
    m.complete_load(ks(2, 3))
    assert store(m, 6, 7, 8) == (ks(6, 7, 8), [3, 2, 1], ks(2, 3, 4))
    assert events(m) == [(ks(2, 3, 4), True)]
    # 7: complete [6,7,8]; touch [5,6,7] (5 ends MRU); store [9] → evicts 8 (now the LRU), id 1.
    m.complete_store(ks(6, 7, 8))
    m.touch(ks(5, 6, 7))
    assert store(m, 9) == (ks(9), [1], ks(8))
    assert events(m) == [(ks(6, 7, 8), False), (ks(8), True)]
    # 8: complete_store [7,9] failed: 7 is ready (kept), 9 pending (removed, block freed).
    m.complete_store(ks(7, 9), success=False)
    assert m.lookup(K(7)) is True
    assert m.lookup(K(9)) is False
    #    No stored (or any public) event for 9.
    assert m.take_events() == []
    #    5,6,7 remain.
    assert len(m) == 3
    #    The freed id 1 is reused by the next store.
    assert store(m, 10) == (ks(10), [1], [])


# --------------------------------------------------------------------------- scenarios 9–15


@pytest.mark.parametrize("policy", POLICIES)
def test_s09_touch_protects_first_key(policy: str) -> None:
    m = mk(policy)
    # Store and complete 1..4 (ids 0..3); the cache is full.
    store_complete(m, 1, 2, 3, 4)
    # touch [1]: 1 becomes most recently used (ARC: moves to T2).
    m.touch(ks(1))
    # store [5] evicts 2 (the LRU one / T1's LRU one with p = 0) and reuses its id 1.
    assert store(m, 5) == (ks(5), [1], ks(2))


@pytest.mark.parametrize("policy", POLICIES)
def test_s10_offered_keys_are_protected(policy: str) -> None:
    m = mk(policy)
    # Store and complete 1,2 (ids 0,1).
    store_complete(m, 1, 2)
    # touch [1]: 2 is now the LRU key.
    m.touch(ks(1))
    # store [2,3,4,5]: 2 is offered → protected although LRU; 1 is evicted instead (id 0 reused).
    assert store(m, 2, 3, 4, 5) == (ks(3, 4, 5), [2, 3, 0], ks(1))
    # 2 stays ready.
    assert m.lookup(K(2)) is True


def test_s11_lru_touch_order() -> None:
    m = mk("lru")
    # Store and complete 1..4: LRU order 1,2,3,4.
    store_complete(m, 1, 2, 3, 4)
    # touch [1,2] is processed in reverse: 2 then 1 → order 3,4,2,1.
    m.touch(ks(1, 2))
    assert m.debug_lists() == [ks(3, 4, 2, 1), [], [], []]
    # Four single stores evict in that order.
    evicted = []
    for new in range(10, 14):
        out = store(m, new)
        assert out is not None
        evicted += out[2]
        m.complete_store(ks(new))
    assert evicted == ks(3, 4, 2, 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_s13_all_loading_gives_none(policy: str) -> None:
    # Capacity 2: store and complete 1,2; load both.
    m = mk(policy, 2)
    store_complete(m, 1, 2)
    m.prepare_load(ks(1, 2))
    # store [3]: nothing evictable → None.
    assert m.prepare_store(ks(3)) is None
    assert m.lookup(K(3)) is False
    assert len(m) == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_s14_offered_and_loading_keys_are_protected(policy: str) -> None:
    # Capacity 2: store and complete 1,2; load 2.
    m = mk(policy, 2)
    store_complete(m, 1, 2)
    m.prepare_load(ks(2))
    # store [1,3]: 3 needs a block; 1 is offered (protected), 2 loading → None.
    assert m.prepare_store(ks(1, 3)) is None
    assert m.lookup(K(1)) is True
    assert m.lookup(K(3)) is False


@pytest.mark.parametrize("policy", POLICIES)
def test_s15_eviction_is_all_or_nothing(policy: str) -> None:
    # Capacity 3: store and complete 1,2,3; load 1; drain events.
    m = mk(policy, 3)
    store_complete(m, 1, 2, 3)
    m.prepare_load(ks(1))
    m.take_events()
    lists = m.debug_lists()
    # store [4,5,6] needs 3 victims but only 2,3 are evictable → None and nothing evicted.
    assert m.prepare_store(ks(4, 5, 6)) is None
    for i in (1, 2, 3):
        assert m.lookup(K(i)) is True
    # No removed event, lists untouched.
    assert m.take_events() == []
    assert m.debug_lists() == lists


# --------------------------------------------------------------------------- ARC 17–22


def test_s17_s18_arc_ghost_hit() -> None:
    # 17: ARC cap 2: store+complete [1,2]; store+complete [3] → evicts 1 (id 0).
    m = mk("arc", 2)
    store_complete(m, 1, 2)
    assert store(m, 3) == (ks(3), [0], ks(1))
    m.complete_store(ks(3))
    #     1 is a ghost in B1; T1 = [2,3]; p still 0.
    assert m.debug_lists() == [ks(2, 3), [], ks(1), []]
    assert m.arc_target == 0.0
    # 18: touch [1] (a B1 ghost) → p = 0 + max(1, |B2|/|B1|) = 1.0.
    m.touch(ks(1))
    assert m.arc_target == 1.0
    #     The ghost is not resident, and stays in B1.
    assert m.lookup(K(1)) is False
    assert m.debug_lists()[2] == ks(1)


def test_s19_s21_arc_promotion() -> None:
    # 19: ARC: store+complete [1..4] (all in T1); touch [3,4] (reverse: 4 then 3 to T2's MRU).
    m = mk("arc")
    store_complete(m, 1, 2, 3, 4)
    m.touch(ks(3, 4))
    t1, t2, b1, b2 = m.debug_lists()
    assert (t1, t2) == (ks(1, 2), ks(4, 3))
    assert (b1, b2) == ([], [])
    # 21: touch [1,3,4]: reverse → 4, 3 to T2's MRU; 1 from T1 to T2's MRU → T2 = [4,3,1].
    m.touch(ks(1, 3, 4))
    assert m.debug_lists()[:2] == [ks(2), ks(4, 3, 1)]
    #     store [5]: p = 0 so T1's LRU (2) is the victim; its id 1 is reused.
    assert store(m, 5) == (ks(5), [1], ks(2))
    #     2 became a B1 ghost; 5 is at T1's MRU.
    assert m.debug_lists() == [ks(5), ks(4, 3, 1), ks(2), []]


def test_s22_arc_ghost_list_trimmed() -> None:
    # ARC cap 2: store+complete [1,2], then 17 single store+completes of keys 3..19.
    m = mk("arc", 2)
    store_complete(m, 1, 2)
    for i in range(3, 20):
        store_complete(m, i)
    # T1 holds the last two; B1 is trimmed to num_blocks = 2 entries (16, 17).
    t1, t2, b1, b2 = m.debug_lists()
    assert (t1, b1) == (ks(18, 19), ks(16, 17))
    assert (t2, b2) == ([], [])
    assert m.arc_target == 0.0


def test_arc_pending_touch_stays_in_t1_and_b2_hit_lowers_p() -> None:
    m = mk("arc", 2)
    # A pending key touched stays in T1 (moved to its MRU end).
    assert store(m, 1) is not None
    m.touch(ks(1))
    assert m.debug_lists() == [ks(1), [], [], []]
    # Once ready, touch moves it to T2.
    m.complete_store(ks(1))
    m.touch(ks(1))
    assert m.debug_lists() == [[], ks(1), [], []]
    # Store 2 (T1); then 3,4: with p = 0, T1's 2 goes first (→ B1), then T2's 1 (→ B2).
    store_complete(m, 2)
    store_complete(m, 3, 4)
    assert m.debug_lists() == [ks(3, 4), [], ks(2), ks(1)]
    # B1 hit on touch: p = 0 + max(1, 1/1) = 1.
    m.touch(ks(2))
    assert m.arc_target == 1.0
    # Re-inserting 1 (a B2 ghost): p = max(1 − max(1, |B1|/|B2|), 0) = 0; 1 goes to T1 (victim: T1's
    # LRU 3, since |T1| = 2 ≥ ⌊p⌋ = 1).
    assert store(m, 1) == (ks(1), [0], ks(3))
    m.complete_store(ks(1))
    assert m.arc_target == 0.0
    assert m.debug_lists() == [ks(4, 1), [], ks(2, 3), []]
    # A failed store leaves no ghost behind.
    assert store(m, 7) is not None
    m.complete_store(ks(7), success=False)
    assert all(K(7) not in lst for lst in m.debug_lists())


def test_arc_b1_insert_raises_p_and_prefers_t2() -> None:
    m = mk("arc", 2)
    # 1,2 in T1; touch 2 → T2 = [2]; store 3 evicts T1's 1 (p = 0) → B1 = [1].
    store_complete(m, 1, 2)
    m.touch(ks(2))
    assert store(m, 3) == (ks(3), [0], ks(1))
    m.complete_store(ks(3))
    assert m.debug_lists() == [ks(3), ks(2), ks(1), []]
    # Re-storing 1 (B1 ghost): victim chosen first with p = 0 → T1's 3 (→ B1 = [1,3]); then the insert
    # of 1 adapts p = min(0 + max(1, 0/2), 2) = 1 and deletes 1 from B1.
    assert store(m, 1) == (ks(1), [0], ks(3))
    assert m.arc_target == 1.0
    assert m.debug_lists() == [ks(1), ks(2), ks(3), []]
    m.complete_store(ks(1))
    # Now |T1| = 1 ≥ ⌊p⌋ = 1 → T1's 1 is the victim of the next store.
    assert store(m, 4) == (ks(4), [0], ks(1))


# --------------------------------------------------------------------------- admission 25–26


@pytest.mark.parametrize("policy", POLICIES)
def test_s25_s26_admission(policy: str) -> None:
    m = mk(policy, store_threshold=2, max_tracker_size=3)
    # 25: first offer of 1,2,3: all below the threshold → empty output (not None).
    out = m.prepare_store(ks(1, 2, 3))
    assert out is not None
    assert list(out.keys_to_store) == []
    assert ids_of(out.store_spec) == []
    assert list(out.evicted_keys) == []
    #     stores_skipped 3, reset by the call.
    assert m.get_stats()["stores_skipped"] == 3
    assert m.get_stats()["stores_skipped"] == 0
    # 26: second offer of 1,2 → admitted.
    assert store(m, 1, 2) == (ks(1, 2), [0, 1], [])
    # Tracker bounded to 3: offering 4,5,6 drops 3 (least recently offered), so 3 needs two more.
    assert store(m, 4, 5, 6) == ([], [], [])
    assert store(m, 3) == ([], [], [])
    assert store(m, 3) == (ks(3), [2], [])
    assert m.get_stats()["stores_skipped"] == 4


@pytest.mark.parametrize("policy", POLICIES)
def test_admission_duplicates_count_once(policy: str) -> None:
    m = mk(policy, store_threshold=2)
    # The same key twice in one call is one offer.
    assert store(m, 1, 1) == ([], [], [])
    assert m.get_stats()["stores_skipped"] == 1
    # Second call: admitted.
    assert store(m, 1) == (ks(1), [0], [])


# --------------------------------------------------------------------------- gauges 27, capacity 0


@pytest.mark.parametrize("policy", POLICIES)
def test_s27_gauges(policy: str) -> None:
    m = mk(policy)

    def g() -> tuple[float, float, float]:
        s = m.get_stats()
        return s["write_usage"], s["read_usage"], s["usage"]

    # store [1,2]: 2 pending of 4.
    store(m, 1, 2)
    assert g() == (0.5, 0.0, 0.5)
    # complete: nothing pinned.
    m.complete_store(ks(1, 2))
    assert g() == (0.0, 0.0, 0.0)
    # load [1]: one block pinned by a load.
    m.prepare_load(ks(1))
    assert g() == (0.0, 0.25, 0.25)
    # complete_load [1], store [3,4], load [2]: 2 pending + 1 loading.
    m.complete_load(ks(1))
    store(m, 3, 4)
    m.prepare_load(ks(2))
    assert g() == (0.5, 0.25, 0.75)
    s = m.get_stats()
    assert (s["num_blocks"], s["num_present"], s["num_free"], s["num_evictable"]) == (4, 4, 0, 1)
    assert set(s) == {
        "usage",
        "write_usage",
        "read_usage",
        "num_blocks",
        "num_present",
        "num_free",
        "num_evictable",
        "stores_skipped",
    }
    # A key loaded twice is one pinned block.
    m.prepare_load(ks(1, 1))
    assert g() == (0.5, 0.5, 1.0)


@pytest.mark.parametrize("policy", POLICIES)
def test_s30_capacity_zero(policy: str) -> None:
    m = mk(policy, 0)
    # store [1] can never fit → None.
    assert m.prepare_store(ks(1)) is None
    # usage is 0.0 (no division by zero).
    s = m.get_stats()
    assert (s["usage"], s["write_usage"], s["read_usage"]) == (0.0, 0.0, 0.0)
    assert (s["num_blocks"], s["num_free"]) == (0, 0)
    # An empty store is an empty output, not None.
    assert store(m) == ([], [], [])
    assert len(m) == 0


# --------------------------------------------------------------------------- misc behaviour


@pytest.mark.parametrize("policy", POLICIES)
def test_duplicates_lookup_prefix_and_stored_events(policy: str) -> None:
    m = mk(policy)
    # Duplicates in prepare_store count once.
    assert store(m, 1, 1, 2) == (ks(1, 2), [0, 1], [])
    # lookup_prefix: pending first non-ready → None.
    assert m.lookup_prefix(ks(1, 2)) is None
    m.complete_store(ks(1))
    assert m.lookup_prefix(ks(1, 2)) is None
    # Absent first non-ready → count of ready leading keys.
    assert m.lookup_prefix(ks(1, 5, 2)) == 1
    assert m.lookup_prefix([]) == 0
    # complete_store ignores duplicates and absent keys; the event lists 2 once.
    m.complete_store(ks(2, 2, 9))
    assert m.lookup_prefix(ks(1, 2)) == 2
    assert events(m) == [(ks(1), False), (ks(2), False)]
    # complete_store of already-ready keys is idempotent: no event.
    m.complete_store(ks(1, 2))
    assert m.take_events() == []


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_load_ids_and_duplicates(policy: str) -> None:
    m = mk(policy)
    store_complete(m, 1, 2, 3)
    # ids co-indexed with the keys, duplicates repeated.
    assert ids_of(m.prepare_load(ks(3, 1, 3))) == [2, 0, 2]
    # 3 loaded twice: one complete_load leaves it pinned.
    m.complete_load(ks(3, 1))
    assert m.get_stats()["num_evictable"] == 2
    m.complete_load(ks(3))
    assert m.get_stats()["num_evictable"] == 3
    # Empty load.
    assert ids_of(m.prepare_load([])) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_loads_do_not_change_recency(policy: str) -> None:
    m = mk(policy)
    store_complete(m, 1, 2, 3, 4)
    lists = m.debug_lists()
    # Loading and completing loads of 1 keeps it the LRU key.
    m.prepare_load(ks(1))
    m.complete_load(ks(1))
    assert m.debug_lists() == lists
    assert store(m, 5) == (ks(5), [0], ks(1))


@pytest.mark.parametrize("policy", POLICIES)
def test_touch_absent_is_ignored(policy: str) -> None:
    m = mk(policy)
    store_complete(m, 1, 2)
    lists = m.debug_lists()
    m.touch(ks(7, 8))
    assert m.debug_lists() == lists
    assert m.arc_target == (0.0 if policy == "arc" else None)


@pytest.mark.parametrize("policy", POLICIES)
def test_reset(policy: str) -> None:
    m = mk(policy, store_threshold=2)
    # Admit 1 (two offers), store 3 once (skipped), complete 1.
    store(m, 1)
    store(m, 1)
    store(m, 3)
    m.complete_store(ks(1))
    # reset forgets keys, counters, tracker and the free list; pending events stay.
    m.reset()
    assert len(m) == 0
    assert m.lookup(K(1)) is False
    assert m.debug_lists() == [[], [], [], []]
    s = m.get_stats()
    assert (s["num_present"], s["num_free"], s["stores_skipped"], s["usage"]) == (0, 4, 0, 0.0)
    assert events(m) == [(ks(1), False)]
    # The tracker was forgotten: 1 needs two offers again; ids start from 0 again.
    assert store(m, 1) == ([], [], [])
    assert store(m, 1) == (ks(1), [0], [])


def test_reset_clears_arc_ghosts_and_p() -> None:
    m = mk("arc", 1)
    store_complete(m, 1)
    store_complete(m, 2)  # 1 → B1
    m.touch(ks(1))  # p = 1
    assert m.arc_target == 1.0
    m.reset()
    assert m.arc_target == 0.0
    assert m.debug_lists() == [[], [], [], []]


# --------------------------------------------------------------------------- factory and surface


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("lru", LRUOffloadingManager),
        ("arc", ARCOffloadingManager),
    ],
)
def test_create_manager(name: str, cls: type) -> None:
    m = create_manager(name, 7, block_size=16, enable_events=True, store_threshold=0, max_tracker_size=10)
    assert isinstance(m, cls)
    assert isinstance(m, OffloadingManager)
    assert m.num_blocks == 7
    assert len(m) == 0
    assert m.policy == cls(1).policy


# Names are exact (docs/spec.md §2): "LRU" is not a policy name.
@pytest.mark.parametrize("name", ["fifo", "", "lru2", "random", "LRU", "Arc"])
def test_create_manager_unknown_policy(name: str) -> None:
    with pytest.raises(ValueError, match="lru") as ei:
        create_manager(name, 4)
    assert "arc" in str(ei.value)


@pytest.mark.parametrize("cls", [LRUOffloadingManager, ARCOffloadingManager])
def test_constructors_keyword_only(cls: type) -> None:
    m = cls(3, block_size=8, enable_events=True, store_threshold=2, max_tracker_size=5)
    assert m.num_blocks == 3
    with pytest.raises(TypeError):
        cls(3, 8)  # block_size is keyword-only


@pytest.mark.parametrize("policy", POLICIES)
def test_len_and_num_blocks(policy: str) -> None:
    m = mk(policy, 5)
    assert (len(m), m.num_blocks) == (0, 5)
    store(m, 1, 2)
    assert len(m) == 2  # pending keys are present
    m.complete_store(ks(1, 2))
    m.prepare_load(ks(1))
    assert len(m) == 2
    m.complete_store(ks(3), success=False)
    store(m, 3)
    m.complete_store(ks(3), success=False)
    assert len(m) == 2
    assert m.num_blocks == 5


@pytest.mark.parametrize("policy", POLICIES)
def test_req_context_accepted_by_key_methods(policy: str) -> None:
    m = mk(policy)
    ctx = object()
    out = m.prepare_store(ks(1, 2), req_context=ctx)
    assert out is not None
    assert m.lookup(K(1), req_context=ctx) is None
    assert m.lookup_prefix(ks(1), req_context=ctx) is None
    m.complete_store(ks(1, 2), True, req_context=ctx)
    m.complete_store(ks(1), req_context=None)
    assert m.lookup(K(1), ctx) is True  # positional trailing argument
    assert ids_of(m.prepare_load(ks(1), req_context=ctx)) == [0]
    m.touch(ks(2), req_context=ctx)
    m.complete_load(ks(1), req_context=ctx)
    assert m.lookup_prefix(ks(1, 2), req_context={"req": 1}) == 2


@pytest.mark.parametrize("method", ["take_events", "get_stats", "reset", "shutdown"])
@pytest.mark.parametrize("policy", POLICIES)
def test_req_context_accepted_by_other_methods(policy: str, method: str) -> None:
    m = mk(policy)
    getattr(m, method)(req_context=None)


@pytest.mark.parametrize("policy", POLICIES)
def test_event_fields(policy: str) -> None:
    m = mk(policy, 1, block_size=16)
    store_complete(m, 1)
    store_complete(m, 2)  # evicts 1
    evs = m.take_events()
    assert len(evs) == 3
    assert all(isinstance(e, OffloadingEvent) for e in evs)
    assert [(list(e.keys), e.removed) for e in evs] == [(ks(1), False), (ks(1), True), (ks(2), False)]
    for e in evs:
        assert e.block_size == 16
        assert e.medium == "CPU"
        assert all(isinstance(k, bytes) for k in e.keys)
    # Events are drained.
    assert m.take_events() == []
    # Events compare by value.
    assert evs[0] == OffloadingEvent(ks(1), 16, "CPU", False)
    assert evs[0] != OffloadingEvent(ks(1), 16, "CPU", True)


@pytest.mark.parametrize("policy", POLICIES)
def test_removed_event_before_stored_event(policy: str) -> None:
    m = mk(policy, 2)
    store_complete(m, 1, 2)
    m.take_events()
    # The removed event of an eviction comes before the stored event of the new key.
    store(m, 3)
    m.complete_store(ks(3))
    assert events(m) == [(ks(1), True), (ks(3), False)]


@pytest.mark.parametrize("policy", POLICIES)
def test_events_disabled(policy: str) -> None:
    m = create_manager(policy, 1)
    store_complete(m, 1)
    store_complete(m, 2)  # evicts 1
    store(m, 3)  # evicts 2
    m.complete_store(ks(3), success=False)
    assert m.take_events() == []


def test_cpu_load_store_spec() -> None:
    s = CPULoadStoreSpec([1, 2])
    assert isinstance(s.block_ids, np.ndarray)
    assert s.block_ids.dtype == np.int64
    assert s.block_ids.tolist() == [1, 2]
    assert len(s) == 2
    assert s.medium() == "CPU"
    e = CPULoadStoreSpec([])
    assert e.block_ids.dtype == np.int64
    assert e.block_ids.shape == (0,)
    assert len(e) == 0
    # Other integer dtypes are converted to int64.
    assert CPULoadStoreSpec(np.array([3, 4], dtype=np.int32)).block_ids.dtype == np.int64
    # An int64 array is accepted as is.
    a = np.array([5], dtype=np.int64)
    assert CPULoadStoreSpec(a).block_ids.tolist() == [5]


@pytest.mark.parametrize(
    ("ids", "exc"), [([-1], ValueError), ([[1, 2]], ValueError), ([1.5], TypeError), (["a"], TypeError)]
)
def test_cpu_load_store_spec_invalid(ids: object, exc: type) -> None:
    with pytest.raises(exc):
        CPULoadStoreSpec(ids)


def test_prepare_store_output_type() -> None:
    m = mk("lru")
    out = m.prepare_store(ks(1))
    assert isinstance(out, PrepareStoreOutput)
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    assert isinstance(out.keys_to_store, list)
    assert isinstance(out.evicted_keys, list)
    # Public constructor as in the spec (docs/spec.md)'s "no candidates" output.
    empty = PrepareStoreOutput([], CPULoadStoreSpec([]), [])
    assert list(empty.keys_to_store) == []
    assert ids_of(empty.store_spec) == []


def test_package_exports() -> None:
    for name in kvoff.__all__:
        assert hasattr(kvoff, name), name
    assert kvoff.OffloadKey is bytes
