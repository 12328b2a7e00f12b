"""``KvoffOffloadingSpec``: the offloading spec vLLM's ``OffloadingConnector`` loads by name."""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

from vllm.logger import init_logger
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
from kvoff.tier import TieredOffloadingManager
from kvoff.vllm._compat import CPUOffloadingInfo
from kvoff.vllm.config import TIER_KEYS, KvoffOffloadConfig
from kvoff.vllm.manager import VLLM_METRICS, KvoffOffloadingManager
from kvoff.vllm.worker import KvoffOffloadingWorker

__all__ = ["KvoffOffloadingSpec", "region_name"]

#: A child of vLLM's ``vllm`` logger, so kvoff's lines go through vLLM's handler, format and
#: level (``VLLM_LOGGING_LEVEL``) in every vLLM process; a logger outside that tree has no
#: handler there and its INFO lines would be lost.
logger = init_logger("vllm.kvoff")


def thread_cpus_beside_model() -> list[int] | None:
    """The CPUs for kvoff's threads in this vLLM process, or ``None`` to leave them where they are.

    vLLM's CPU build binds its OpenMP threads (the engine's main thread among them) to the CPUs of
    ``VLLM_CPU_OMP_THREADS_BIND`` and keeps the others of the process's CPUs for everything else;
    kvoff's threads, started from the bound thread, would inherit the model's CPUs. They go to the
    parent process's CPUs that the model does not use (docs/performance.md, "kvoff's threads and
    the model's CPUs"). Nothing changes on a GPU, when the process is not bound, when no CPU is
    left over, or when ``KVOFF_THREAD_CPUS`` is set (kvoff reads it itself)."""
    if os.environ.get("KVOFF_THREAD_CPUS") is not None or not hasattr(os, "sched_getaffinity"):
        return None
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        mine = os.sched_getaffinity(0)
        around = os.sched_getaffinity(os.getppid())
    except (ImportError, OSError, AttributeError):
        return None
    rest = sorted(around - mine)
    return rest or None


def _place_threads() -> None:
    cpus = thread_cpus_beside_model()
    if cpus is not None and kvoff.thread_cpus() != cpus:
        kvoff.set_thread_cpus(cpus)
        logger.info(
            "kvoff: its copy and I/O threads run on CPUs %s (the model's: %s)",
            cpus,
            sorted(os.sched_getaffinity(0)),
        )


def region_name(engine_id: str) -> str:
    """The /dev/shm name of an engine's shared host region (one per engine, i.e. per DP rank)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:80]
    digest = hashlib.sha1(engine_id.encode()).hexdigest()[:12]
    return f"kvoff-vllm-{safe}-{digest}"


#: How the metrics' help names a tier (its kind otherwise).
_TIER_NAMES = {"disk": "file tier"}


class KvoffOffloadingSpec(OffloadingSpec):
    """CPU offloading with kvoff's managers (scheduler) and transfer handlers (workers).

    Sizing (docs/spec.md §3): one CPU block holds ``blocks_per_chunk`` GPU blocks of every rank;
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
        # Each configured tier's figures (kvoff.tiers.METRICS, their vLLM names).
        for tier, key in TIER_KEYS.items():
            if extra_config.get(key) is None:
                continue
            what = _TIER_NAMES.get(tier, f"{tier} tier")
            for name, (kind, doc) in VLLM_METRICS[tier].items():
                meta = OffloadingCounterMetadata if kind == "counter" else OffloadingGaugeMetadata
                defs[name] = meta(documentation=f"kvoff {what}: {doc}.")
        return defs

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return () if CPUOffloadingInfo is None else CPUOffloadingInfo.config_info_keys()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        _place_threads()
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
        if self.kvoff_config.uses_tiers:
            return True  # the scheduler's process attaches to it for the tiers behind host memory
        shared = self.kvoff_config.shared_region
        return self.world_size > 1 if shared is None else shared

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            c = self.kvoff_config
            tiered = self._tiered_manager() if c.uses_tiers and self.num_chunks > 0 else None
            self._manager = KvoffOffloadingManager(
                self.num_chunks,
                eviction_policy=c.eviction_policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=c.store_threshold,
                max_tracker_size=c.max_tracker_size,
                info=self.cpu_info,
                host_manager=tiered,
            )
        return self._manager

    def _tiered_manager(self) -> TieredOffloadingManager:
        """The host manager with the tiers behind it, in the scheduler's process: it attaches
        to the shared region the workers created (vLLM creates the scheduler after the KV caches,
        so the region exists; it waits up to ``region_timeout_s`` otherwise), then removes the
        region's name, which the workers kept for it."""
        c = self.kvoff_config
        region = kvoff.HostRegion.attach(region_name(self.config.engine_id), timeout=c.region_timeout_s)
        try:
            region.unlink()
            if region.num_cpu_blocks < self.num_chunks:
                raise kvoff.ConfigError(
                    f"the workers' host region holds {region.num_cpu_blocks} CPU blocks, fewer than the "
                    f"{self.num_chunks} the scheduler expects"
                )
            model = getattr(self.config, "model", None)
            dtype = str(getattr(model, "dtype", ""))
            default_ns = f"{getattr(model, 'name', '')}|{dtype}"
            namespace = default_ns if c.disk_namespace is None else c.disk_namespace
            remote_ns = default_ns if c.remote_namespace is None else c.remote_namespace
            objects = dict(c.object_settings)
            if objects and objects.get("object_namespace") is None:
                objects["object_namespace"] = default_ns
            manager = TieredOffloadingManager(
                c.eviction_policy,
                self.num_chunks,
                region,
                c.disk_path,
                c.disk_bytes_to_use,
                rank=None,  # one file per block holds every rank's slot
                namespace=namespace,
                page_sizes=[region.slot_bytes],
                block_size_factor=int(self.blocks_per_chunk),
                dtype=dtype,
                world_size=region.world_size,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=c.store_threshold,
                max_tracker_size=c.max_tracker_size,
                disk_store_threshold=c.disk_store_threshold,
                direct_io=c.disk_direct_io,
                rescan_interval_s=c.disk_rescan_interval_s,
                trusted_uids=c.disk_trusted_uids,
                trusted_gid=c.disk_trusted_gid,
                allow_writable_dir=c.disk_allow_writable_dir,
                remote_url=c.remote_url,
                remote_cluster=c.remote_cluster,
                remote_namespace=remote_ns,
                remote_store_threshold=c.remote_store_threshold,
                remote_ttl_s=c.remote_ttl_s,
                remote_timeout_s=c.remote_timeout_s,
                remote_connect_timeout_s=c.remote_connect_timeout_s,
                remote_negative_ttl_s=c.remote_negative_ttl_s,
                remote_tls_ca_file=c.remote_tls_ca_file,
                remote_idle_spin_s=c.remote_idle_spin_s,
                remote_idle_nap_s=c.remote_idle_nap_s,
                remote_io_threads=c.remote_io_threads,
                **objects,
            )
        except BaseException:
            region.close()
            raise
        if c.uses_disk:
            logger.info(
                "kvoff file tier: %s (%d bytes, namespace %r), %d CPU blocks of %d bytes",
                manager.disk_dir,
                c.disk_bytes_to_use,
                namespace,
                self.num_chunks,
                region.world_size * region.slot_bytes,
            )
        if c.uses_remote:
            # remote_url here has its password hidden.
            logger.info(
                "kvoff remote tier: %s (namespace %r), %d CPU blocks of %d bytes",
                manager.remote_url,
                remote_ns,
                self.num_chunks,
                region.world_size * region.slot_bytes,
            )
        if c.uses_object:
            # The URL names a bucket and a prefix, no secret (credentials come from the environment).
            logger.info(
                "kvoff object tier: %s at %s (%d bytes, namespace %r), %d CPU blocks of %d bytes",
                c.object_url,
                objects.get("object_endpoint") or "the AWS_* endpoint",
                objects["object_bytes_to_use"],
                objects["object_namespace"],
                self.num_chunks,
                region.world_size * region.slot_bytes,
            )
        return manager

    def _make_region(self, slot_bytes: int) -> kvoff.HostRegion:
        if self.uses_shared_region and self.num_chunks > 0:
            return kvoff.HostRegion.shared(
                region_name(self.config.engine_id),
                self.num_chunks,
                slot_bytes,
                self.world_size,
                self.rank,
                timeout=self.kvoff_config.region_timeout_s,
                # With the file tier the scheduler's process attaches by name and removes it.
                unlink_when_all_joined=not self.kvoff_config.uses_tiers,
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
