"""Pure-Python reference managers, used only as the baseline of ``kvoff bench managers``.

They follow the structure of vLLM's Python offloading managers (a dict of block states plus
``OrderedDict`` recency lists, ARC with T1/T2/B1/B2 and target ``p``) and implement the same protocol
on the same workload, so that the benchmark can report kvoff's speed as a ratio measured in the same
run. They are not part of the public API.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class _Block:
    __slots__ = ("block_id", "ready", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.ready = False


class PyLRU:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.events: list[tuple[list[bytes], bool]] = []

    def lookup_prefix(self, keys: Iterable[bytes]) -> int | None:
        n = 0
        for k in keys:
            b = self.blocks.get(k)
            if b is None:
                return n
            if not b.ready:
                return None
            n += 1
        return n

    def prepare_load(self, keys: list[bytes]) -> list[int]:
        out = []
        for k in keys:
            b = self.blocks[k]
            assert b.ready
            b.ref_cnt += 1
            out.append(b.block_id)
        return out

    def complete_load(self, keys: list[bytes]) -> None:
        for k in keys:
            self.blocks[k].ref_cnt -= 1

    def touch(self, keys: list[bytes]) -> None:
        for k in reversed(keys):
            if k in self.blocks:
                self.blocks.move_to_end(k)

    def _victims(self, need: int, protect: set[bytes]) -> list[bytes] | None:
        out: list[bytes] = []
        for k, b in self.blocks.items():
            if len(out) == need:
                break
            if b.ready and b.ref_cnt == 0 and k not in protect:
                out.append(k)
        return out if len(out) == need else None

    def prepare_store(self, keys: list[bytes]) -> tuple[list[bytes], list[int], list[bytes]] | None:
        protect = set(keys)
        cands = list(dict.fromkeys(k for k in keys if k not in self.blocks))
        need = len(cands) - len(self.free)
        evicted: list[bytes] = []
        if need > 0:
            v = self._victims(need, protect)
            if v is None:
                return None
            for k in v:
                self.free.append(self.blocks.pop(k).block_id)
            evicted = v
            self.events.append((v, True))
        ids = []
        for k in cands:
            b = _Block(self.free.pop())
            self.blocks[k] = b
            ids.append(b.block_id)
        return cands, ids, evicted

    def complete_store(self, keys: list[bytes], success: bool = True) -> None:
        stored = []
        for k in keys:
            b = self.blocks.get(k)
            if b is not None and not b.ready:
                if success:
                    b.ready = True
                    stored.append(k)
                else:
                    self.free.append(self.blocks.pop(k).block_id)
        if stored:
            self.events.append((stored, False))

    def take_events(self) -> list[tuple[list[bytes], bool]]:
        ev, self.events = self.events, []
        return ev


class PyARC(PyLRU):
    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.t1: OrderedDict[bytes, _Block] = OrderedDict()
        self.t2: OrderedDict[bytes, _Block] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()
        self.p = 0.0

    def _get(self, k: bytes) -> _Block | None:
        return self.t1.get(k) or self.t2.get(k)

    def lookup_prefix(self, keys: Iterable[bytes]) -> int | None:
        n = 0
        for k in keys:
            b = self._get(k)
            if b is None:
                return n
            if not b.ready:
                return None
            n += 1
        return n

    def prepare_load(self, keys: list[bytes]) -> list[int]:
        out = []
        for k in keys:
            b = self._get(k)
            assert b is not None and b.ready
            b.ref_cnt += 1
            out.append(b.block_id)
        return out

    def complete_load(self, keys: list[bytes]) -> None:
        for k in keys:
            b = self._get(k)
            assert b is not None
            b.ref_cnt -= 1

    def touch(self, keys: list[bytes]) -> None:
        for k in reversed(keys):
            if k in self.t1:
                b = self.t1[k]
                if b.ready:
                    del self.t1[k]
                    self.t2[k] = b
                else:
                    self.t1.move_to_end(k)
            elif k in self.t2:
                self.t2.move_to_end(k)
            elif k in self.b1:
                self.p = min(self.p + max(1.0, len(self.b2) / len(self.b1)), self.num_blocks)
                self.b1.move_to_end(k)
            elif k in self.b2:
                self.p = max(self.p - max(1.0, len(self.b1) / len(self.b2)), 0.0)
                self.b2.move_to_end(k)

    def prepare_store(self, keys: list[bytes]) -> tuple[list[bytes], list[int], list[bytes]] | None:
        protect = set(keys)
        cands = list(dict.fromkeys(k for k in keys if k not in self.t1 and k not in self.t2))
        need = len(cands) - len(self.free)
        evicted: list[bytes] = []
        if need > 0:
            it1 = (k for k, b in self.t1.items() if b.ready and b.ref_cnt == 0 and k not in protect)
            it2 = (k for k, b in self.t2.items() if b.ready and b.ref_cnt == 0 and k not in protect)
            n1 = len(self.t1)
            chosen: list[tuple[bytes, int]] = []
            t1_taken = 0
            for _ in range(need):
                k = None
                first, second = (it1, it2) if n1 - t1_taken >= int(self.p) else (it2, it1)
                k = next(first, None)
                src = first
                if k is None:
                    k = next(second, None)
                    src = second
                if k is None:
                    return None
                which = 1 if src is it1 else 2
                t1_taken += which == 1
                chosen.append((k, which))
            for k, which in chosen:
                if which == 1:
                    self.free.append(self.t1.pop(k).block_id)
                    self.b1[k] = None
                else:
                    self.free.append(self.t2.pop(k).block_id)
                    self.b2[k] = None
                evicted.append(k)
            for ghost in (self.b1, self.b2):
                while len(ghost) > self.num_blocks:
                    ghost.popitem(last=False)
            self.events.append((evicted, True))
        ids = []
        for k in cands:
            if k in self.b1:
                self.p = min(self.p + max(1.0, len(self.b2) / len(self.b1)), self.num_blocks)
                del self.b1[k]
            elif k in self.b2:
                self.p = max(self.p - max(1.0, len(self.b1) / len(self.b2)), 0.0)
                del self.b2[k]
            b = _Block(self.free.pop())
            self.t1[k] = b
            ids.append(b.block_id)
        return cands, ids, evicted

    def complete_store(self, keys: list[bytes], success: bool = True) -> None:
        stored = []
        for k in keys:
            b = self._get(k)
            if b is not None and not b.ready:
                if success:
                    b.ready = True
                    stored.append(k)
                else:
                    self.t1.pop(k, None)
                    self.free.append(b.block_id)
        if stored:
            self.events.append((stored, False))
