"""vLLM's ``OffloadingManager`` (0.32 and 0.33) on top of a kvoff manager (LRU or ARC).

Mapping of the interface (vLLM → kvoff):

- keys: vLLM's ``OffloadKey`` is already ``block hash ‖ group idx (4 bytes, big-endian)``, kvoff's
  key format, so keys pass through unchanged;
- ``lookup`` → ``True``/``None``/``False`` become ``HIT``/``HIT_PENDING``/``MISS``;
- ``prepare_load``/``prepare_store`` return vLLM's ``CPULoadStoreSpec``/``PrepareStoreOutput``
  (block ids co-indexed with the keys);
- ``complete_*``, ``touch``, ``reset_cache``, ``shutdown`` delegate;
- events become vLLM ``OffloadingEvent``s on ``Medium.CPU`` (a failed store emits none: kvoff
  never announced its keys);
- ``get_stats`` reports the gauges and counters vLLM's CPU spec reports (usage, write/read usage,
  allocation sizes, stores skipped);
- recency: vLLM 0.33's scheduler no longer calls ``touch``; it tells the manager which keys a
  request used and, in ``on_request_finished``, commits that access. The adapter records the
  keys each request loads or offers and touches them head-to-tail when the request finishes
  (so the head of the prompt ends most recently used). For ARC only the keys the request
  *reused* (loaded, or offered while already stored) are touched: a store alone is not a
  second access and must not promote a block to T2.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics

import kvoff
from kvoff._names import PolicyName
from kvoff.tier import TieredOffloadingManager
from kvoff.tiers import METRICS, TIER_DEFAULTS
from kvoff.vllm._compat import ConfigInfoMapping

__all__ = [
    "DISK_VLLM_METRICS",
    "OBJECT_VLLM_METRICS",
    "REMOTE_VLLM_METRICS",
    "VLLM_METRICS",
    "KvoffOffloadingManager",
]

#: Each tier's figures as vLLM metrics: tier → {name → (kind, meaning)}, from
#: :data:`kvoff.tiers.METRICS` (their ``vllm`` names). Counters are cumulative in kvoff and reported
#: to vLLM as increments; GB/s per direction is ``rate(..._bytes) / rate(..._seconds)``.
VLLM_METRICS: dict[str, dict[str, tuple[str, str]]] = {
    tier: {m.vllm: (m.kind, m.help) for m in rows if m.vllm} for tier, rows in METRICS.items()
}

#: The file tier's figures as vLLM metrics (``vllm:kvoff_disk_*``): ``VLLM_METRICS["disk"]``.
DISK_VLLM_METRICS: dict[str, tuple[str, str]] = VLLM_METRICS["disk"]

#: The remote tier's figures as vLLM metrics (docs/tier.md "Remote tier"): ``VLLM_METRICS["remote"]``.
REMOTE_VLLM_METRICS: dict[str, tuple[str, str]] = VLLM_METRICS["remote"]

#: The object tier's figures as vLLM metrics (``vllm:kvoff_object_*``, docs/tier.md "Object tier"):
#: ``VLLM_METRICS["object"]``.
OBJECT_VLLM_METRICS: dict[str, tuple[str, str]] = VLLM_METRICS["object"]


@dataclass
class _RequestAccess:
    """Keys one request used, in the order first seen, and which of them it reused."""

    owner: object
    generation: int
    keys: dict[bytes, None] = field(default_factory=dict)
    reused: set[bytes] = field(default_factory=set)
    finished: bool = False


@dataclass
class _Scan:
    """The last key one request looked up and its end-token position (vLLM's connector looks a
    request's keys up one at a time, in prefix order, every step)."""

    owner: object
    key: bytes | None = None
    pos: int | None = None
    #: The smallest position looked up: the first chunk's end token, i.e. one chunk's tokens.
    first: int | None = None


class KvoffOffloadingManager(OffloadingManager):
    """A vLLM ``OffloadingManager`` backed by ``kvoff.create_manager(policy, num_chunks)``."""

    def __init__(
        self,
        num_chunks: int,
        eviction_policy: PolicyName = "lru",
        enable_events: bool = False,
        store_threshold: int = 0,
        max_tracker_size: int = TIER_DEFAULTS["max_tracker_size"],
        info: Any = None,
        host_manager: TieredOffloadingManager | None = None,
    ) -> None:
        self.medium = Medium.CPU
        self.policy = eviction_policy.lower()
        self.store_threshold = store_threshold
        # With the file tier, a TieredOffloadingManager (same protocol; lookups may answer
        # "pending" while a file is promoted); otherwise a plain LRU/ARC manager.
        self.kvoff_manager: Any = (
            host_manager  # not `or`: an empty manager is falsy (it has a length)
            if host_manager is not None
            else kvoff.create_manager(
                cast(PolicyName, self.policy),
                num_chunks,
                enable_events=enable_events,
                store_threshold=store_threshold,
                max_tracker_size=max_tracker_size,
            )
        )
        self._tiered = host_manager
        self._disk_seen: dict[str, float] = {}
        self._config_info: ConfigInfoMapping = info.as_config_info() if info is not None else {}
        self._allocation_sizes: list[int] = []
        self._generation = 0

    @property
    def num_chunks(self) -> int:
        return int(self.kvoff_manager.num_blocks)

    # --- per-request access tracking ---------------------------------------------------------

    def _access(self, req_context: ReqContext) -> _RequestAccess:
        state: _RequestAccess | None = req_context.get_state(_RequestAccess)
        if state is None or state.owner is not self or state.generation != self._generation:
            state = _RequestAccess(owner=self, generation=self._generation)
            req_context.set_state(state)
        return state

    def _record(self, keys: Iterable[bytes], req_context: ReqContext, reused: Iterable[bytes] = ()) -> None:
        state = self._access(req_context)
        if state.finished:
            return
        for k in keys:
            state.keys.setdefault(k, None)
        state.reused.update(reused)

    # --- OffloadingManager -------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._access(req_context)
        return RequestOffloadingContext()

    def _prev_key(self, key: bytes, req_context: ReqContext) -> bytes | None:
        """The key before ``key`` in its request's prefix when it was the last one looked up
        (a forward scan); ``None`` otherwise (a scan's first key, a backward scan, another
        group's keys, or positions vLLM did not record)."""
        get_pos = getattr(req_context, "get_offload_key_position", None)
        pos = get_pos(key) if get_pos is not None else None
        scan: _Scan | None = req_context.get_state(_Scan)
        if scan is None or scan.owner is not self:
            scan = _Scan(owner=self)
            req_context.set_state(scan)
        prev = None
        if (
            isinstance(pos, int)
            and scan.pos is not None
            and scan.first is not None
            and pos - scan.pos == scan.first
        ):
            prev = scan.key
        if isinstance(pos, int) and pos > 0:
            scan.first = pos if scan.first is None else min(scan.first, pos)
        scan.key, scan.pos = key, pos if isinstance(pos, int) else None
        return prev

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._tiered is not None:
            # Keys one at a time, in prefix order: the tiers are asked once per prefix, and the
            # rest of a prefix a tier holds is read straight into host blocks (docs/tier.md).
            r = self._tiered.lookup(key, after=self._prev_key(key, req_context))
        else:
            r = self.kvoff_manager.lookup(key)
        if r is None:
            return LookupResult.HIT_PENDING
        return LookupResult.HIT if r else LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        keys = list(keys)
        spec = self.kvoff_manager.prepare_load(keys)
        self._record(keys, req_context, reused=keys)
        return CPULoadStoreSpec(spec.block_ids.tolist())

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.kvoff_manager.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.kvoff_manager.complete_load(list(keys))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = list(keys)
        ready = [k for k in keys if self.kvoff_manager.lookup(k)]
        out = self.kvoff_manager.prepare_store(keys)
        self._record(keys, req_context, reused=ready)
        if out is None:
            return None
        to_store = list(out.keys_to_store)
        if to_store:
            self._allocation_sizes.append(len(to_store))
        return PrepareStoreOutput(
            keys_to_store=to_store,
            store_spec=CPULoadStoreSpec(out.store_spec.block_ids.tolist()),
            evicted_keys=list(out.evicted_keys),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.kvoff_manager.complete_store(list(keys), success)

    def on_request_finished(self, req_context: ReqContext) -> None:
        state = req_context.get_state(_RequestAccess)
        if state is None or state.owner is not self or state.generation != self._generation or state.finished:
            return
        state.finished = True
        keys = list(state.keys)
        positions = {k: req_context.get_offload_key_position(k) for k in keys}
        if keys and all(p is not None for p in positions.values()):
            keys.sort(key=lambda k: positions[k])  # type: ignore[arg-type, return-value]
        # The policy's own rule (Rust `Policy::TOUCH`): ARC touches only the keys the request reused.
        if kvoff._native.POLICY_TOUCH_RULES[self.policy] == "reused":
            keys = [k for k in keys if k in state.reused]
        if keys:
            # kvoff's touch processes keys in reverse: the request's head ends most recently used.
            self.kvoff_manager.touch(keys)

    def take_events(self) -> Iterable[OffloadingEvent]:
        for ev in self.kvoff_manager.take_events():
            yield OffloadingEvent(keys=list(ev.keys), medium=self.medium, removed=bool(ev.removed))

    def reset_cache(self) -> None:
        self.kvoff_manager.reset()
        self._generation += 1
        self._allocation_sizes.clear()

    def get_stats(self) -> OffloadingConnectorStats | None:
        s = self.kvoff_manager.get_stats()
        stats = OffloadingConnectorStats()
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, float(s["usage"]))
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, float(s["write_usage"]))
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, float(s["read_usage"]))
        for n in self._allocation_sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, n)
        self._allocation_sizes.clear()
        if self.store_threshold >= 2:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, int(s["stores_skipped"]))
        if self._tiered is not None:
            for rows in METRICS.values():
                if not any(m.key in s for m in rows):
                    continue  # no such tier behind this manager
                for m in rows:
                    if m.vllm is None:
                        continue
                    value = float(s.get(m.key, 0))
                    if m.kind == "gauge":
                        stats.set_gauge(m.vllm, value)
                    else:
                        stats.increase_counter(m.vllm, value - self._disk_seen.get(m.key, 0.0))
                        self._disk_seen[m.key] = value
        return stats

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]

    def shutdown(self) -> None:
        self.kvoff_manager.shutdown()
        if self._tiered is not None:
            # The tier's I/O threads have stopped: the scheduler's view of the region can go.
            self._tiered.region.close()

    def __len__(self) -> int:
        return len(self.kvoff_manager)

    def __repr__(self) -> str:
        return f"KvoffOffloadingManager(policy={self.policy!r}, num_chunks={self.num_chunks})"

    def __getstate__(self) -> Any:  # pragma: no cover - managers live in one process
        raise TypeError("KvoffOffloadingManager cannot be pickled")
