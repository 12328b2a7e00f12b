"""vLLM's ``OffloadingWorker`` (0.32 and 0.33) on top of kvoff's transfer handlers.

vLLM hands the worker its KV caches already canonicalized (``CanonicalKVCaches``: per tensor a
``(num_blocks, page)`` view and per KV-cache group the refs of its layers); they map one-to-one
onto kvoff's canonical types, so multi-group models keep their group layout. Three kvoff
handlers do the work, as in vLLM's own CPU worker: stores (GPU→CPU), loads (CPU→GPU) and
*expedited* loads (CPU→GPU on their own queue, so a load the step waits on does not queue behind
regular loads). All three view the same host memory: a private :class:`kvoff.HostRegion`, or this
rank's slot of one region shared by the engine's ranks (like vLLM's ``shared_offload_region.py``).

Results carry ``transfer_size`` (bytes) and ``transfer_time`` (seconds), which is what vLLM's
offloading connector needs to fill ``vllm:kv_offload_total_bytes``, ``vllm:kv_offload_total_time``
and ``vllm:kv_offload_size`` (label ``transfer_type`` = ``GPU_to_CPU`` for stores,
``CPU_to_GPU`` for loads; the connector tells the two apart by job id).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

import kvoff
from kvoff._names import EngineName
from kvoff.errors import ConfigError

__all__ = ["KvoffOffloadingWorker", "to_kvoff_kv_caches"]

#: A child of vLLM's ``vllm`` logger, so kvoff's lines go through vLLM's handler, format and
#: level (``VLLM_LOGGING_LEVEL``) in every vLLM process; a logger outside that tree has no
#: handler there and its INFO lines would be lost.
logger = init_logger("vllm.kvoff")

from kvoff.metrics import TransferMetrics as _TransferMetrics


def to_kvoff_kv_caches(
    kv_caches: CanonicalKVCaches, canonical_layout: bool = False
) -> kvoff.CanonicalKVCaches:
    """vLLM's canonical KV caches as kvoff's (zero-copy; the group layout is kept).

    vLLM's connector attaches a canonical page mapping (``ref.mapping``: how this rank's page
    maps onto a parallelism-agnostic page) to every layer whenever it can derive one, whether or
    not ``canonical_layout`` was asked for. Like vLLM's own CPU worker, the mapping only matters
    in canonical-layout mode; otherwise pages are copied as they are on the device, and the
    mapping is ignored.

    Raises:
        ConfigError: ``canonical_layout`` is on (kvoff stores this rank's pages as they are and
            does not implement vLLM's parallelism-agnostic page format).
    """
    if canonical_layout:
        raise ConfigError(
            "kvoff does not support vLLM's canonical_layout (parallelism-agnostic CPU pages); remove "
            "'canonical_layout' from kv_connector_extra_config"
        )
    tensors = [kvoff.CanonicalKVCacheTensor(t.tensor, int(t.page_size_bytes)) for t in kv_caches.tensors]
    groups = [
        [kvoff.CanonicalKVCacheRef(int(r.tensor_idx), int(r.page_size_bytes)) for r in g]
        for g in kv_caches.group_data_refs
    ]
    return kvoff.CanonicalKVCaches(tensors, groups)


def _gpu_spec(spec: Any) -> kvoff.GPULoadStoreSpec:
    group_sizes = getattr(spec, "group_sizes", None)
    block_indices = getattr(spec, "block_indices", None)
    return kvoff.GPULoadStoreSpec(
        np.asarray(spec.block_ids, dtype=np.int64),
        None if group_sizes is None else [int(x) for x in group_sizes],
        None if block_indices is None else [int(x) for x in block_indices],
    )


def _cpu_spec(spec: Any) -> kvoff.CPULoadStoreSpec:
    if not hasattr(spec, "block_ids"):
        raise TypeError(f"kvoff's worker expects a CPU block-ids spec, got {type(spec).__name__}")
    return kvoff.CPULoadStoreSpec(np.asarray(spec.block_ids, dtype=np.int64))


class KvoffOffloadingWorker(OffloadingWorker):
    """Moves KV blocks between vLLM's KV caches and kvoff host memory.

    Args:
        kv_caches: vLLM's canonical KV caches.
        blocks_per_chunk: GPU blocks per CPU block (the block size factor).
        num_cpu_chunks: CPU blocks to hold.
        region: the host region to place the CPU blocks in (owned by the worker from here on:
            closed on shutdown); ``None`` allocates a private one.
        engine: kvoff engine name (``"auto"``: CUDA when the KV caches are on a GPU, else host).
        canonical_layout: vLLM's ``canonical_layout`` setting (not supported: ``ConfigError``).
        compute_budget: model slowdown the transfers may cost beside compute (see
            ``CpuGpuOffloadingHandlers``).
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        region: kvoff.HostRegion | None = None,
        engine: EngineName = "auto",
        canonical_layout: bool = False,
        compute_budget: float | None = kvoff._native.DEFAULT_COMPUTE_BUDGET,
    ) -> None:
        try:
            caches = to_kvoff_kv_caches(kv_caches, canonical_layout)
        except BaseException:
            if region is not None:
                region.close()
            raise
        if region is None:
            slot = sum(t.page_size_bytes for t in caches.tensors) * blocks_per_chunk
            region = kvoff.HostRegion.private(num_cpu_chunks, slot)
        self.region = region

        def handlers() -> kvoff.CpuGpuOffloadingHandlers:
            return kvoff.CpuGpuOffloadingHandlers(
                caches,
                blocks_per_chunk,
                num_cpu_chunks,
                region=region,
                engine=engine,
                compute_budget=compute_budget,
            )

        try:
            self._main = handlers()
            self._expedited = handlers()
        except BaseException:
            region.close()
            raise
        self._expedited.gpu_to_cpu_handler.shutdown()  # only its load direction is used
        self._store = self._main.gpu_to_cpu_handler
        self._load = self._main.cpu_to_gpu_handler
        self._expedited_load = self._expedited.cpu_to_gpu_handler
        self.metrics = _TransferMetrics()
        self._closed = False
        logger.info(
            "kvoff worker: %d tensors, %d CPU blocks x %d GPU blocks, engine %s",
            len(caches.tensors),
            num_cpu_chunks,
            blocks_per_chunk,
            self.engine,
        )

    @property
    def engine(self) -> str:
        return self._main.engine

    @property
    def cpu_tensors(self) -> list[Any]:
        """The host-side ``(num_cpu_chunks, page × factor)`` byte views, one per canonical tensor."""
        return self._main.cpu_tensors

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._store.transfer_async(job_id, (_gpu_spec(src_spec), _cpu_spec(dst_spec)))

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        handler = self._expedited_load if expedited else self._load
        return handler.transfer_async(job_id, (_cpu_spec(src_spec), _gpu_spec(dst_spec)))

    def get_finished(self) -> list[TransferResult]:
        out: list[TransferResult] = []
        for h in (self._store, self._load, self._expedited_load):
            for r in h.get_finished():
                if not r.success:
                    logger.error("kvoff transfer job %d %s failed: %s", r.job_id, r.transfer_type, r.error)
                if self.metrics is not None:
                    self.metrics.observe(r)
                out.append(
                    TransferResult(
                        job_id=r.job_id,
                        success=r.success,
                        # vLLM counts these as bytes moved: nothing moved for a failed job
                        # (kvoff's own results carry the job's size either way).
                        transfer_size=int(r.transfer_size) if r.success else 0,
                        transfer_time=float(r.transfer_time),
                    )
                )
        return out

    def wait(self, job_ids: set[int]) -> None:
        ids = list(job_ids)
        for h in (self._store, self._load, self._expedited_load):
            h.wait(ids)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for hs in (self._main, self._expedited):
            try:
                hs.gpu_to_cpu_handler.shutdown()
                hs.cpu_to_gpu_handler.shutdown()
            except Exception:
                logger.exception("kvoff: shutting down a transfer handler failed")
        self.region.close()
