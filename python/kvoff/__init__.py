"""kvoff: KV-cache offloading for LLM inference engines.

The scheduler side (managers: which blocks live on the host, what to evict) and the worker side
(host regions, transfer handlers that move KV blocks between GPU and host) of vLLM-style KV
offloading, implemented in Rust. See the README for usage.
"""

from __future__ import annotations

from typing import Any

from kvoff.errors import (
    ConfigError,
    CudaError,
    CudaUnavailableError,
    InvalidStateError,
    KvoffError,
    RegionError,
)
from kvoff._native import (
    ARCOffloadingManager,
    CPULoadStoreSpec,
    LRUOffloadingManager,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    __version__,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)

OffloadKey = bytes
"""An offload key: block hash bytes followed by the group index as 4-byte big-endian."""

_POLICIES = {"lru": LRUOffloadingManager, "arc": ARCOffloadingManager}


def create_manager(policy: str, num_blocks: int, **kwargs: Any) -> OffloadingManager:
    """Create a manager by policy name (``"lru"`` or ``"arc"``).

    Keyword arguments are those of :class:`LRUOffloadingManager`.

    Raises:
        ValueError: ``policy`` is not one of the valid names.
    """
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a str, got {type(policy).__name__}")
    cls = _POLICIES.get(policy.lower())
    if cls is None:
        raise ValueError(f"unknown eviction policy {policy!r}; valid choices: {sorted(_POLICIES)}")
    return cls(num_blocks, **kwargs)


__all__ = [
    "ARCOffloadingManager",
    "CPULoadStoreSpec",
    "ConfigError",
    "CudaError",
    "CudaUnavailableError",
    "InvalidStateError",
    "KvoffError",
    "LRUOffloadingManager",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "RegionError",
    "__version__",
    "create_manager",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]
