"""A pure-Python reference model of the managers (docs/spec.md §2), used by the property tests.

Written for obviousness, not speed: every list is a plain Python list ordered LRU → MRU, every
operation validates first and then mutates, and nothing is shared with the Rust implementation.
The numbers that matter (block ids, ARC's ``p``, the gauges) are computed with the same float
operations the spec (docs/spec.md) names, so they can be compared exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class ModelInvalidState(Exception):
    """The model's counterpart of ``kvoff.InvalidStateError``."""


@dataclass
class Entry:
    block_id: int
    pending: bool = True
    loads: int = 0

    @property
    def evictable(self) -> bool:
        return not self.pending and self.loads == 0


@dataclass
class StoreResult:
    keys_to_store: list[bytes]
    block_ids: list[int]
    evicted_keys: list[bytes]


def _dedup(keys: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    for k in keys:
        if k not in out:
            out.append(k)
    return out


def _move_to_end(lst: list[bytes], key: bytes) -> None:
    lst.remove(key)
    lst.append(key)


class ModelManager:
    """Reference model of ``LRUOffloadingManager`` / ``ARCOffloadingManager``."""

    def __init__(
        self,
        policy: str,
        num_blocks: int,
        *,
        block_size: int = 0,
        enable_events: bool = False,
        store_threshold: int = 0,
        max_tracker_size: int = 64000,
    ) -> None:
        assert policy in ("lru", "arc")
        self.policy = policy
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_events = enable_events
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.events: list[tuple[list[bytes], bool]] = []  # (keys, removed)
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget everything except the undrained events."""
        self.blocks: dict[bytes, Entry] = {}
        # LRU uses t1 only (its single recency list). ARC uses all four lists.
        self.t1: list[bytes] = []
        self.t2: list[bytes] = []
        self.b1: list[bytes] = []
        self.b2: list[bytes] = []
        self.p = 0.0
        self.next_fresh = 0
        self.freed: list[int] = []  # a stack: the last freed id is reused first
        self.tracker: list[bytes] = []  # LRU → MRU
        self.offers: dict[bytes, int] = {}
        self.stores_skipped = 0

    def debug_lists(self) -> list[list[bytes]]:
        if self.policy == "lru":
            return [list(self.t1), [], [], []]
        return [list(self.t1), list(self.t2), list(self.b1), list(self.b2)]

    def ready_keys(self) -> set[bytes]:
        return {k for k, e in self.blocks.items() if not e.pending}

    def __len__(self) -> int:
        return len(self.blocks)

    # ---------------------------------------------------------------- helpers
    def _push_event(self, keys: list[bytes], removed: bool) -> None:
        if self.enable_events and keys:
            self.events.append((list(keys), removed))

    def _alloc_id(self) -> int:
        if self.next_fresh < self.num_blocks:
            self.next_fresh += 1
            return self.next_fresh - 1
        return self.freed.pop()

    def _adapt_b1(self) -> None:
        self.p = min(self.p + max(1.0, len(self.b2) / len(self.b1)), float(self.num_blocks))

    def _adapt_b2(self) -> None:
        self.p = max(self.p - max(1.0, len(self.b1) / len(self.b2)), 0.0)

    def _select_victims(self, need: int, protected: set[bytes]) -> list[bytes] | None:
        def eligible(lst: list[bytes]) -> list[bytes]:
            return [k for k in lst if self.blocks[k].evictable and k not in protected]

        c1, c2 = eligible(self.t1), eligible(self.t2)
        if len(c1) + len(c2) < need:
            return None
        if self.policy == "lru":
            return c1[:need]
        victims: list[bytes] = []
        target = math.floor(self.p)
        t1_chosen = 0
        for _ in range(need):
            prefer_t1 = len(self.t1) - t1_chosen >= target
            if (prefer_t1 and c1) or not c2:
                victims.append(c1.pop(0))
                t1_chosen += 1
            else:
                victims.append(c2.pop(0))
        return victims

    # ---------------------------------------------------------------- methods
    def lookup(self, key: bytes) -> bool | None:
        e = self.blocks.get(key)
        if e is None:
            return False
        return None if e.pending else True

    def lookup_prefix(self, keys: list[bytes]) -> int | None:
        for n, k in enumerate(keys):
            r = self.lookup(k)
            if r is None:
                return None
            if r is False:
                return n
        return len(keys)

    def prepare_load(self, keys: list[bytes]) -> list[int]:
        for k in keys:
            e = self.blocks.get(k)
            if e is None or e.pending:
                raise ModelInvalidState(f"prepare_load of a non-ready key {k!r}")
        for k in keys:
            self.blocks[k].loads += 1
        return [self.blocks[k].block_id for k in keys]

    def complete_load(self, keys: list[bytes]) -> None:
        needed: dict[bytes, int] = {}
        for k in keys:
            needed[k] = needed.get(k, 0) + 1
        for k, n in needed.items():
            e = self.blocks.get(k)
            if e is None or e.loads < n:
                raise ModelInvalidState(f"complete_load of a key with too few loads {k!r}")
        for k in keys:
            self.blocks[k].loads -= 1

    def touch(self, keys: list[bytes]) -> None:
        for k in reversed(keys):
            if self.policy == "lru":
                if k in self.blocks:
                    _move_to_end(self.t1, k)
            elif k in self.t1:
                if self.blocks[k].pending:
                    _move_to_end(self.t1, k)
                else:
                    self.t1.remove(k)
                    self.t2.append(k)
            elif k in self.t2:
                _move_to_end(self.t2, k)
            elif k in self.b1:
                self._adapt_b1()
                _move_to_end(self.b1, k)
            elif k in self.b2:
                self._adapt_b2()
                _move_to_end(self.b2, k)

    def prepare_store(self, keys: list[bytes]) -> StoreResult | None:
        offered = _dedup(keys)
        candidates = [k for k in offered if k not in self.blocks]
        skipped = 0
        if self.store_threshold >= 2:
            admitted = [k for k in candidates if self.offers.get(k, 0) + 1 >= self.store_threshold]
            skipped = len(candidates) - len(admitted)
            candidates = admitted
        need = len(candidates) - (self.num_blocks - len(self.blocks))
        victims: list[bytes] = []
        if need > 0:
            chosen = self._select_victims(need, set(offered))
            if chosen is None:
                return None  # nothing changed: not even the admission tracker
            victims = chosen
        # --- commit
        if self.store_threshold >= 2:
            self._track_offers(offered)
            self.stores_skipped += skipped
        self._evict(victims)
        self._push_event(victims, True)
        ids = self._add_pending(candidates)
        return StoreResult(candidates, ids, victims)

    def _track_offers(self, offered: list[bytes]) -> None:
        """Counts an offer of each key (admission tracker, oldest dropped past its size)."""
        for k in offered:
            self.offers[k] = self.offers.get(k, 0) + 1
            if k in self.tracker:
                self.tracker.remove(k)
            self.tracker.append(k)
        while len(self.tracker) > self.max_tracker_size and self.tracker[0] not in offered:
            del self.offers[self.tracker.pop(0)]

    def _evict(self, victims: list[bytes]) -> None:
        """Frees the victims' blocks (ARC: remembered in the ghost lists, trimmed to capacity)."""
        for v in victims:
            self.freed.append(self.blocks.pop(v).block_id)
            if v in self.t1:
                self.t1.remove(v)
                if self.policy == "arc":
                    self.b1.append(v)
            else:
                self.t2.remove(v)
                self.b2.append(v)
        if self.policy == "arc":
            del self.b1[: max(0, len(self.b1) - self.num_blocks)]
            del self.b2[: max(0, len(self.b2) - self.num_blocks)]

    def _add_pending(self, candidates: list[bytes]) -> list[int]:
        """Allocates a pending block for each candidate (ARC: a ghost hit adapts p); returns the ids."""
        ids = []
        for k in candidates:
            bid = self._alloc_id()
            ids.append(bid)
            self.blocks[k] = Entry(bid)
            if self.policy == "arc":
                if k in self.b1:
                    self._adapt_b1()
                    self.b1.remove(k)
                elif k in self.b2:
                    self._adapt_b2()
                    self.b2.remove(k)
            self.t1.append(k)
        return ids

    def complete_store(self, keys: list[bytes], success: bool = True) -> None:
        stored = []
        for k in keys:
            e = self.blocks.get(k)
            if e is None or not e.pending:
                continue
            if success:
                e.pending = False
                stored.append(k)
            else:
                self.freed.append(self.blocks.pop(k).block_id)
                (self.t1 if k in self.t1 else self.t2).remove(k)
        if success:
            self._push_event(stored, False)

    def take_events(self) -> list[tuple[list[bytes], bool]]:
        evs, self.events = self.events, []
        return evs

    def get_stats(self) -> dict:
        cap = self.num_blocks
        pending = sum(e.pending for e in self.blocks.values())
        loading = sum(e.loads > 0 for e in self.blocks.values())
        if cap == 0:
            write, usage = 0.0, 0.0
        else:
            write, usage = pending / cap, (pending + loading) / cap
        skipped, self.stores_skipped = self.stores_skipped, 0
        return {
            "usage": usage,
            "write_usage": write,
            "read_usage": usage - write,
            "num_blocks": cap,
            "num_present": len(self.blocks),
            "num_free": cap - len(self.blocks),
            "num_evictable": sum(e.evictable for e in self.blocks.values()),
            "stores_skipped": skipped,
        }
