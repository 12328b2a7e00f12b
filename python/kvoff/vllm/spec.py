"""``KvoffOffloadingSpec``: the offloading spec vLLM's ``OffloadingConnector`` loads by name."""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

import kvoff
from kvoff.vllm._compat import CPUOffloadingInfo
from kvoff.vllm.config import KvoffOffloadConfig
from kvoff.vllm.manager import KvoffOffloadingManager
from kvoff.vllm.worker import KvoffOffloadingWorker

__all__ = ["KvoffOffloadingSpec", "region_name"]

logger = logging.getLogger("kvoff.vllm")


def region_name(engine_id: str) -> str:
    """The /dev/shm name of an engine's shared host region (one per engine, i.e. per DP rank)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:80]
    digest = hashlib.sha1(engine_id.encode()).hexdigest()[:12]
    return f"kvoff-vllm-{safe}-{digest}"


class KvoffOffloadingSpec(OffloadingSpec):
    """CPU offloading with kvoff's managers (scheduler) and transfer handlers (workers).

    Sizing (kvoff SPEC §3): one CPU block holds ``blocks_per_chunk`` GPU blocks of every rank;
    ``row = worker_kv_bytes_per_block × blocks_per_chunk × world_size`` rounded up to the OS page
    size, and ``num_chunks = cpu_bytes_to_use // row`` (``cpu_bytes_to_use`` is for all ranks).
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        defs: dict[str, OffloadingMetricMetadata] = {
            CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Fraction of kvoff's CPU KV cache pinned by in-flight stores and loads."
            ),
            CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Fraction of kvoff's CPU KV cache pinned by in-flight stores."
            ),
            CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Fraction of kvoff's CPU KV cache pinned by in-flight loads."
            ),
            CPUOffloadingMetrics.CPU_ALLOCATION_SIZE: OffloadingHistogramMetadata(
                documentation="CPU blocks allocated by each kvoff prepare_store call.",
                buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144),
            ),
        }
        try:
            threshold = int(extra_config.get("store_threshold", 0))
        except (TypeError, ValueError):
            threshold = 0
        if threshold >= 2:
            defs[CPUOffloadingMetrics.STORES_SKIPPED] = OffloadingCounterMetadata(
                documentation="KV offload stores skipped because the reuse threshold was not reached."
            )
        return defs

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return () if CPUOffloadingInfo is None else CPUOffloadingInfo.config_info_keys()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.kvoff_config = KvoffOffloadConfig.from_extra_config(self.extra_config)
        self.world_size = max(int(config.parallel.world_size), 1)
        self.rank = int(config.parallel.rank)
        self.num_chunks = 0
        self.slot_bytes = 0
        self.kv_bytes_per_chunk = 0
        if config.worker_kv_bytes_per_block > 0:
            sizing = kvoff.cpu_sizing(
                [int(config.worker_kv_bytes_per_block)],
                int(self.blocks_per_chunk),
                self.world_size,
                self.kvoff_config.cpu_bytes_to_use,
            )
            self.slot_bytes = sizing.slot_bytes
            self.kv_bytes_per_chunk = sizing.row_stride_bytes
            self.num_chunks = sizing.num_cpu_blocks
        self.cpu_info = (
            None
            if CPUOffloadingInfo is None
            else CPUOffloadingInfo.from_config(config, self.num_chunks, self.kv_bytes_per_chunk)
        )
        self._manager: KvoffOffloadingManager | None = None
        self._worker: KvoffOffloadingWorker | None = None

    @property
    def uses_shared_region(self) -> bool:
        shared = self.kvoff_config.shared_region
        return self.world_size > 1 if shared is None else shared

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            c = self.kvoff_config
            self._manager = KvoffOffloadingManager(
                self.num_chunks,
                eviction_policy=c.eviction_policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=c.store_threshold,
                max_tracker_size=c.max_tracker_size,
                info=self.cpu_info,
            )
        return self._manager

    def _make_region(self, slot_bytes: int) -> kvoff.HostRegion:
        if self.uses_shared_region and self.num_chunks > 0:
            return kvoff.HostRegion.shared(
                region_name(self.config.engine_id),
                self.num_chunks,
                slot_bytes,
                self.world_size,
                self.rank,
                timeout=self.kvoff_config.region_timeout_s,
            )
        return kvoff.HostRegion.private(self.num_chunks, slot_bytes)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            f = int(self.blocks_per_chunk)
            slot = sum(int(t.page_size_bytes) for t in kv_caches.tensors) * f
            if self.slot_bytes and slot > self.slot_bytes:
                logger.warning(
                    "kvoff: the KV caches need %d bytes per CPU block per rank, more than the %d "
                    "vLLM's worker_kv_bytes_per_block implies; the host region uses %d",
                    slot,
                    self.slot_bytes,
                    slot,
                )
            region = self._make_region(max(slot, self.slot_bytes))
            self._worker = KvoffOffloadingWorker(
                kv_caches,
                f,
                self.num_chunks,
                region=region,
                engine=self.kvoff_config.engine,
                compute_budget=self.kvoff_config.compute_budget,
                canonical_layout=bool(getattr(self.config, "canonical_layout", False)),
            )
        return self._worker
