"""kvoff: KV-cache offloading for LLM inference engines.

The scheduler side (managers: which blocks live on the host, what to evict) and the worker side
(host regions, transfer handlers that move KV blocks between GPU and host) of vLLM-style KV
offloading, implemented in Rust. See the README for usage.
"""

from __future__ import annotations

from typing import Any

from kvoff import _native
from kvoff._names import Direction, DirectIoName, EngineName, PolicyName
from kvoff._native import (
    ARCOffloadingManager,
    CPULoadStoreSpec,
    HostRegion,
    LRUOffloadingManager,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    __version__,
    compute_sub_block_ptrs,
    cuda_available,
    expand_block_ids,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
    set_thread_cpus,
    thread_cpus,
    thread_placement_error,
)
from kvoff.errors import (
    ConfigError,
    CudaError,
    CudaUnavailableError,
    InvalidStateError,
    KvoffError,
    RegionError,
)
from kvoff.handlers import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CpuGpuOffloadingHandlers,
    CpuSizing,
    GPULoadStoreSpec,
    SingleDirectionOffloadingHandler,
    TransferResult,
    canonicalize_kv_caches,
    cpu_sizing,
)
from kvoff.metrics import TransferMetrics, TransferMetricsCollector, serve_metrics
from kvoff.tier import TieredOffloadingManager

OffloadKey = bytes
"""An offload key: block hash bytes followed by the group index as 4-byte big-endian."""

_POLICIES = {"lru": LRUOffloadingManager, "arc": ARCOffloadingManager}
# The names come from the Rust enum PolicyKind (_native.POLICIES); tests check this map covers them.


def create_manager(policy: PolicyName, num_blocks: int, **kwargs: Any) -> OffloadingManager:
    """Create a manager by policy name (``"lru"`` or ``"arc"``).

    Keyword arguments are those of :class:`LRUOffloadingManager`.

    Raises:
        ValueError: ``policy`` is not one of the valid names.
    """
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a str, got {type(policy).__name__}")
    cls = _POLICIES.get(policy)  # exact: "LRU" is not a policy name (docs/spec.md §2)
    if cls is None:
        raise ValueError(f"unknown eviction policy {policy!r}; valid choices: {list(_native.POLICIES)}")
    return cls(num_blocks, **kwargs)


__all__ = [
    "ARCOffloadingManager",
    "CPULoadStoreSpec",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "ConfigError",
    "CpuGpuOffloadingHandlers",
    "CpuSizing",
    "CudaError",
    "CudaUnavailableError",
    "DirectIoName",
    "Direction",
    "EngineName",
    "GPULoadStoreSpec",
    "HostRegion",
    "InvalidStateError",
    "KvoffError",
    "LRUOffloadingManager",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "PolicyName",
    "PrepareStoreOutput",
    "RegionError",
    "SingleDirectionOffloadingHandler",
    "TieredOffloadingManager",
    "TransferMetrics",
    "TransferMetricsCollector",
    "TransferResult",
    "__version__",
    "canonicalize_kv_caches",
    "compute_sub_block_ptrs",
    "cpu_sizing",
    "create_manager",
    "cuda_available",
    "expand_block_ids",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
    "serve_metrics",
    "set_thread_cpus",
    "thread_cpus",
    "thread_placement_error",
]
