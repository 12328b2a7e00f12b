"""Stateful property test: random operation sequences on the Python API, checked step by step against
the reference model of docs/spec.md §2 in ``model.py``.

Every result is compared exactly (keys_to_store, block ids, evicted keys and their order, lookups,
lookup_prefix, stats, events, ARC lists and p) and invariants are checked after every step.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from helpers import K, ids_of
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kvoff import InvalidStateError, create_manager
from model import ModelInvalidState, ModelManager

UNIVERSE = 8
KEYS = [K(i) for i in range(UNIVERSE)]

key_idx = st.integers(0, UNIVERSE - 1)
key_lists = st.lists(key_idx, max_size=6)
containers = st.sampled_from(["list", "tuple", "gen"])
BAD_ITEMS = ["k", 3, None, 2.5, bytearray(b"0\x00\x00\x00\x00")]


def wrap(keys: list[bytes], kind: str) -> Iterable[bytes]:
    if kind == "tuple":
        return tuple(keys)
    if kind == "gen":
        return (k for k in keys)
    return list(keys)


class ManagerMachine(RuleBasedStateMachine):
    policy = "lru"

    def start(self, cap: int, threshold: int, tracker: int, events: bool, block_size: int) -> None:
        kw = {
            "block_size": block_size,
            "enable_events": events,
            "store_threshold": threshold,
            "max_tracker_size": tracker,
        }
        self.cap = cap
        self.m = create_manager(self.policy, cap, **kw)
        self.model = ModelManager(self.policy, cap, **kw)
        # Observed from the real outputs only: key -> block id of every present key, pending keys.
        self.obs_ids: dict[bytes, int] = {}
        self.obs_pending: set[bytes] = set()
        # Replay of drained events (meaningful only with events enabled).
        self.replayed: set[bytes] = set()
        self.reset_marks: list[int] = []  # number of queued events at each reset since the last drain

    # ------------------------------------------------------------------ helpers
    def observe(self) -> tuple:
        """All state observable without side effects (get_stats resets stores_skipped: not here)."""
        return (
            self.m.debug_lists(),
            self.m.arc_target,
            len(self.m),
            [self.m.lookup(k) for k in KEYS],
        )

    def check_unchanged(self, before: tuple) -> None:
        assert self.observe() == before

    # ------------------------------------------------------------------ rules
    @rule(idx=key_lists, kind=containers)
    def lookup_prefix(self, idx: list[int], kind: str) -> None:
        keys = [KEYS[i] for i in idx]
        before = self.observe()
        assert self.m.lookup_prefix(wrap(keys, kind)) == self.model.lookup_prefix(keys)
        self.check_unchanged(before)

    @rule(idx=key_lists, valid=st.booleans(), kind=containers)
    def prepare_load(self, idx: list[int], valid: bool, kind: str) -> None:
        keys = [KEYS[i] for i in idx]
        if valid:
            keys = [k for k in keys if self.model.lookup(k) is True]
        before = self.observe()
        try:
            expected = self.model.prepare_load(keys)
        except ModelInvalidState:
            with pytest.raises(InvalidStateError):
                self.m.prepare_load(wrap(keys, kind))
            self.check_unchanged(before)
            return
        spec = self.m.prepare_load(wrap(keys, kind))
        assert ids_of(spec) == expected
        # Loads change no recency.
        self.check_unchanged(before)

    @rule(idx=key_lists, valid=st.booleans(), kind=containers)
    def complete_load(self, idx: list[int], valid: bool, kind: str) -> None:
        keys = [KEYS[i] for i in idx]
        if valid:
            # Every loading key once, except those drawn (so that loads do not pile up).
            keys = [
                k for k in KEYS if self.model.blocks.get(k) and self.model.blocks[k].loads and k not in keys
            ]
        before = self.observe()
        try:
            self.model.complete_load(keys)
        except ModelInvalidState:
            with pytest.raises(InvalidStateError):
                self.m.complete_load(wrap(keys, kind))
            self.check_unchanged(before)
            return
        self.m.complete_load(wrap(keys, kind))
        self.check_unchanged(before)

    @rule(idx=key_lists, kind=containers)
    def touch(self, idx: list[int], kind: str) -> None:
        keys = [KEYS[i] for i in idx]
        self.model.touch(keys)
        self.m.touch(wrap(keys, kind))

    @rule(idx=key_lists, kind=containers)
    def prepare_store(self, idx: list[int], kind: str) -> None:
        keys = [KEYS[i] for i in idx]
        # Pre-state, to check what may be evicted.
        protected = {k for k, e in self.model.blocks.items() if not e.evictable} | set(keys)
        before = self.observe()
        expected = self.model.prepare_store(keys)
        out = self.m.prepare_store(wrap(keys, kind))
        if expected is None:
            event("prepare_store: None")
            assert out is None
            self.check_unchanged(before)
            return
        assert out is not None
        stored, ids, evicted = list(out.keys_to_store), ids_of(out.store_spec), list(out.evicted_keys)
        assert stored == expected.keys_to_store
        assert ids == expected.block_ids
        assert evicted == expected.evicted_keys
        if evicted:
            event(f"{self.policy} evicted")
        if self.policy == "arc" and self.model.p > 0:
            event("arc p > 0")
        if self.policy == "arc" and self.model.b2:
            event("arc B2 non-empty")
        # Pending, loading and offered keys are never evicted.
        assert not set(evicted) & protected
        # Observed id map: evicted ids are freed first, then the new ids must be free and in range.
        for k in evicted:
            assert k in self.obs_ids and k not in self.obs_pending
            del self.obs_ids[k]
        for k, b in zip(stored, ids, strict=True):
            assert k not in self.obs_ids
            assert 0 <= b < self.cap
            assert b not in self.obs_ids.values()
            self.obs_ids[k] = b
            self.obs_pending.add(k)

    @rule(idx=key_lists, kind=containers)
    def store_and_complete(self, idx: list[int], kind: str) -> None:
        """The common engine pattern: a store, then every pending store completes successfully."""
        self.prepare_store(idx, kind)
        self.complete_store([], True, True, "list")

    @rule(idx=st.lists(key_idx, min_size=1, max_size=8))
    def churn(self, idx: list[int]) -> None:
        """Single-key store + complete, one key after the other: many evictions and ghost hits."""
        for i in idx:
            self.store_and_complete([i], "list")

    @rule(idx=key_lists, kind=containers)
    def touch_present(self, idx: list[int], kind: str) -> None:
        """touch restricted to resident keys and ghosts, to move keys to T2 and adapt p."""
        lists = self.model.debug_lists()
        known = {k for lst in lists for k in lst}
        self.touch([i for i in idx if KEYS[i] in known], kind)

    @rule(idx=key_lists, success=st.booleans(), valid=st.booleans(), kind=containers)
    def complete_store(self, idx: list[int], success: bool, valid: bool, kind: str) -> None:
        keys = [KEYS[i] for i in idx]
        if valid:
            # Every pending key except those drawn (so that pending stores do not pile up).
            keys = [k for k in KEYS if self.model.lookup(k) is None and k not in keys]
        self.model.complete_store(keys, success)
        self.m.complete_store(wrap(keys, kind), success)
        for k in keys:
            if k in self.obs_pending:
                self.obs_pending.discard(k)
                if not success:
                    del self.obs_ids[k]

    @rule()
    def take_events(self) -> None:
        expected = self.model.take_events()
        got = self.m.take_events()
        assert [(list(e.keys), e.removed) for e in got] == expected
        for e in got:
            assert e.medium == "CPU"
            assert e.block_size == self.model.block_size
        if not self.model.enable_events:
            assert got == []
            self.reset_marks = []
            return
        # Replay: stored events add keys, removed events drop them; a reset forgets everything.
        marks = self.reset_marks
        for n, e in enumerate(got):
            while marks and marks[0] == n:
                marks.pop(0)
                self.replayed.clear()
            if e.removed:
                assert set(e.keys) <= self.replayed
                self.replayed -= set(e.keys)
            else:
                assert not set(e.keys) & self.replayed
                self.replayed |= set(e.keys)
        if marks:
            self.replayed.clear()
        self.reset_marks = []
        assert self.replayed == self.model.ready_keys()
        assert self.replayed == {k for k in KEYS if self.m.lookup(k) is True}

    @rule()
    def get_stats(self) -> None:
        assert self.m.get_stats() == self.model.get_stats()

    @rule(roll=st.integers(0, 7))
    def reset(self, roll: int) -> None:
        if roll:  # keep resets rare so that state can build up
            return
        self.reset_marks.append(len(self.model.events))
        self.model.reset()
        self.m.reset()
        self.obs_ids.clear()
        self.obs_pending.clear()

    @rule(
        method=st.sampled_from(
            ["lookup_prefix", "prepare_load", "touch", "complete_load", "prepare_store", "complete_store"]
        ),
        idx=key_lists,
        bad=st.sampled_from(BAD_ITEMS),
        kind=containers,
    )
    def bad_key_type(self, method: str, idx: list[int], bad: object, kind: str) -> None:
        # The bad item comes last: everything before it would have been valid to process.
        keys: list = [KEYS[i] for i in idx] + [bad]
        before = self.observe()
        with pytest.raises(TypeError):
            getattr(self.m, method)(wrap(keys, kind))
        self.check_unchanged(before)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "m"):
            return
        n = len(self.m)
        assert n == len(self.model) <= self.cap
        assert self.m.num_blocks == self.cap
        assert self.m.debug_lists() == self.model.debug_lists()
        if self.policy == "arc":
            assert self.m.arc_target == self.model.p
            assert 0.0 <= self.model.p <= self.cap
            assert len(self.model.b1) <= self.cap and len(self.model.b2) <= self.cap
        else:
            assert self.m.arc_target is None
        assert [self.m.lookup(k) for k in KEYS] == [self.model.lookup(k) for k in KEYS]

    @invariant()
    def ids_consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        ids = list(self.obs_ids.values())
        assert len(set(ids)) == len(ids)
        assert all(0 <= b < self.cap for b in ids)
        assert set(self.obs_ids) == {k for k in KEYS if self.m.lookup(k) is not False}
        assert self.obs_pending == {k for k in KEYS if self.m.lookup(k) is None}
        assert {k: e.block_id for k, e in self.model.blocks.items()} == self.obs_ids


SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


CONFIG = {
    "threshold": st.sampled_from([0, 2]),
    "tracker": st.sampled_from([0, 1, 2, 3, 64000]),
    "events": st.booleans(),
    "block_size": st.sampled_from([0, 16]),
}


class LRUMachine(ManagerMachine):
    policy = "lru"

    @initialize(cap=st.sampled_from([0, 1, 2, 2, 3, 3, 4, 5, 6]), **CONFIG)
    def init(self, cap: int, threshold: int, tracker: int, events: bool, block_size: int) -> None:
        self.start(cap, threshold, tracker, events, block_size)


class ARCMachine(ManagerMachine):
    policy = "arc"

    # Smaller capacities: more evictions, ghost hits and T2 evictions within the step budget.
    @initialize(cap=st.sampled_from([0, 1, 2, 2, 3, 3, 4, 6]), **CONFIG)
    def init(self, cap: int, threshold: int, tracker: int, events: bool, block_size: int) -> None:
        self.start(cap, threshold, tracker, events, block_size)


LRUMachine.TestCase.settings = SETTINGS
ARCMachine.TestCase.settings = SETTINGS
TestLRUManagerAgainstModel = LRUMachine.TestCase
TestARCManagerAgainstModel = ARCMachine.TestCase
