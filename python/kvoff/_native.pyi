"""Type stubs of the native module ``kvoff._native`` (checked by ``mypy.stubtest``)."""

import os
from collections.abc import Iterable
from typing import Any, Literal, TypeAlias, final

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

__all__ = [
    "ENGINES",
    "POLICIES",
    "ARCOffloadingManager",
    "CPULoadStoreSpec",
    "HostRegion",
    "LRUOffloadingManager",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "RegionBuffer",
    "TieredManagerCore",
    "TransferHandler",
    "__version__",
    "bench_disk",
    "compute_sub_block_ptrs",
    "cpu_sizing",
    "cuda_available",
    "expand_block_ids",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
    "resolve_engine",
]

__version__: str

_PolicyName: TypeAlias = Literal["lru", "arc"]
_EngineName: TypeAlias = Literal["auto", "host", "cuda", "dma", "kernel", "staged", "loop"]

#: The eviction policies, from the Rust enum ``PolicyKind``.
POLICIES: tuple[_PolicyName, ...]
#: The ``engine=`` choices of the transfer handlers, from the Rust enum ``EngineKind``.
ENGINES: tuple[_EngineName, ...]

def make_offload_key(block_hash: bytes, group_idx: int) -> bytes: ...
def get_offload_block_hash(key: bytes) -> bytes: ...
def get_offload_group_idx(key: bytes) -> int: ...

@final
class CPULoadStoreSpec:
    def __new__(cls, block_ids: Iterable[int] | npt.ArrayLike) -> CPULoadStoreSpec: ...
    @property
    def block_ids(self) -> npt.NDArray[np.int64]: ...
    @staticmethod
    def medium() -> str: ...
    def __len__(self) -> int: ...

@final
class PrepareStoreOutput:
    def __new__(
        cls, keys_to_store: Iterable[bytes], store_spec: CPULoadStoreSpec, evicted_keys: Iterable[bytes]
    ) -> PrepareStoreOutput: ...
    @property
    def keys_to_store(self) -> list[bytes]: ...
    @property
    def store_spec(self) -> CPULoadStoreSpec: ...
    @property
    def evicted_keys(self) -> list[bytes]: ...

@final
class OffloadingEvent:
    def __new__(
        cls, keys: Iterable[bytes], block_size: int, medium: str, removed: bool
    ) -> OffloadingEvent: ...
    @property
    def keys(self) -> list[bytes]: ...
    @property
    def block_size(self) -> int: ...
    @property
    def medium(self) -> str: ...
    @property
    def removed(self) -> bool: ...

@disjoint_base
class OffloadingManager:
    @property
    def policy(self) -> str: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def arc_target(self) -> float | None: ...
    def __len__(self) -> int: ...
    def lookup(self, key: bytes, req_context: Any = None) -> bool | None: ...
    def lookup_prefix(self, keys: Iterable[bytes], req_context: Any = None) -> int | None: ...
    def prepare_load(self, keys: Iterable[bytes], req_context: Any = None) -> CPULoadStoreSpec: ...
    def touch(self, keys: Iterable[bytes], req_context: Any = None) -> None: ...
    def complete_load(self, keys: Iterable[bytes], req_context: Any = None) -> None: ...
    def prepare_store(self, keys: Iterable[bytes], req_context: Any = None) -> PrepareStoreOutput | None: ...
    def complete_store(
        self, keys: Iterable[bytes], success: bool = True, req_context: Any = None
    ) -> None: ...
    def take_events(self, req_context: Any = None) -> list[OffloadingEvent]: ...
    def get_stats(self, req_context: Any = None) -> dict[str, Any]: ...
    def reset(self, req_context: Any = None) -> None: ...
    def shutdown(self, req_context: Any = None) -> None: ...
    def debug_lists(self) -> list[list[bytes]]: ...

@final
class LRUOffloadingManager(OffloadingManager):
    def __new__(
        cls,
        num_blocks: int,
        *,
        block_size: int | None = None,
        enable_events: bool = False,
        store_threshold: int | None = None,
        max_tracker_size: int | None = None,
    ) -> LRUOffloadingManager: ...

@final
class ARCOffloadingManager(OffloadingManager):
    def __new__(
        cls,
        num_blocks: int,
        *,
        block_size: int | None = None,
        enable_events: bool = False,
        store_threshold: int | None = None,
        max_tracker_size: int | None = None,
    ) -> ARCOffloadingManager: ...

# ---- worker side -------------------------------------------------------------------------------

def cpu_sizing(
    page_size_bytes: Iterable[int],
    block_size_factor: int,
    world_size: int | None = None,
    cpu_bytes_to_use: float | None = None,
) -> tuple[int, int, int]: ...
def expand_block_ids(
    block_ids: npt.ArrayLike, block_size_factor: int, skip_count: int | None = None, count: int | None = None
) -> npt.NDArray[np.int64]: ...
def compute_sub_block_ptrs(
    block_ids: npt.ArrayLike,
    block_size_factor: int,
    base_ptr: int,
    row_stride: int,
    row_bytes: int,
    skip_count: int | None = None,
    count: int | None = None,
) -> npt.NDArray[np.int64]: ...
def cuda_available() -> bool: ...
def resolve_engine(
    engine: str, placements: list[int | None], names: list[str] | None = None
) -> Literal["host", "cuda"]:
    """The engine ``TransferHandler(..., engine)`` will use for GPU-side tensors placed as
    ``placements`` (per tensor: its CUDA device index, ``None`` for host memory), raising what it
    would raise; ``names[i]`` describes tensor ``i`` in messages."""

@final
class HostRegion:
    @staticmethod
    def private(num_cpu_blocks: int, slot_bytes: int, world_size: int | None = None) -> HostRegion: ...
    @staticmethod
    def shared(
        name: str,
        num_cpu_blocks: int,
        slot_bytes: int,
        world_size: int,
        rank: int,
        timeout: float = 60.0,
        directory: str | os.PathLike[str] | None = None,
        unlink_when_all_joined: bool = True,
        prefault: bool = True,
    ) -> HostRegion: ...
    @property
    def num_cpu_blocks(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def rank(self) -> int | None: ...
    @property
    def row_stride_bytes(self) -> int: ...
    @property
    def len_bytes(self) -> int: ...
    @property
    def path(self) -> str | None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def ptr(self) -> int: ...
    @property
    def is_pinned(self) -> bool: ...
    @property
    def pin_error(self) -> str | None: ...
    def view(self, rank: int, offset: int, nbytes: int) -> Any: ...
    def view_numpy(self, rank: int, offset: int, nbytes: int) -> npt.NDArray[np.uint8]: ...
    def pin(self, device: int = 0) -> None: ...
    def unpin(self) -> None: ...
    def unlink(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> HostRegion: ...
    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool: ...

@final
class RegionBuffer:
    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    @property
    def ptr(self) -> int: ...

@final
class TransferHandler:
    def __new__(
        cls,
        direction: str,
        gpu_tensors: list[Any] | tuple[Any, ...],
        cpu_tensors: list[Any] | tuple[Any, ...],
        group_refs: list[list[tuple[int, int]]] | tuple[Any, ...],
        block_size_factor: int,
        engine: str = "auto",
        compute_budget: float | None = None,
    ) -> TransferHandler: ...
    def submit(
        self,
        job_id: int,
        gpu_block_ids: npt.ArrayLike,
        group_sizes: npt.ArrayLike | None,
        block_indices: npt.ArrayLike | None,
        cpu_block_ids: npt.ArrayLike,
        stream: int | None = None,
    ) -> None: ...
    def get_finished(self) -> list[tuple[int, bool, int, float, str | None]]: ...
    def wait(self, job_ids: Iterable[int] | int) -> None: ...
    def shutdown(self) -> None: ...
    @property
    def direction(self) -> str: ...
    @property
    def transfer_type(self) -> tuple[str, str]: ...
    @property
    def engine(self) -> str: ...
    @property
    def num_tensors(self) -> int: ...

# --- file tier (src/python/tier.rs); the public wrapper is kvoff.tier.TieredOffloadingManager ---

@final
class TieredManagerCore:
    def __new__(
        cls,
        policy: str,
        num_blocks: int,
        disk_path: str | os.PathLike[str],
        disk_bytes_to_use: int,
        memory_ptr: int,
        memory_rows: int,
        row_stride_bytes: int,
        block_bytes: int,
        memory_owner: object,
        *,
        namespace: str = ...,
        page_sizes: list[int] = ...,
        block_size_factor: int = 1,
        dtype: str = ...,
        world_size: int = 1,
        rank: int = 0,
        block_size: int = 0,
        enable_events: bool = False,
        store_threshold: int = 0,
        max_tracker_size: int = 64000,
        disk_store_threshold: int = 0,
        io_threads: int = 8,
        write_threads: int = 4,
        max_queued_writes: int = 256,
        fsync: bool = False,
        direct_io: str = "auto",
        rescan_interval_s: float | None = ...,
        owner: str | None = None,
        max_promotions: int = 256,
    ) -> TieredManagerCore: ...
    def lookup(self, key: bytes) -> bool | None: ...
    def lookup_prefix(self, keys: Iterable[bytes]) -> int | None: ...
    def prepare_load(self, keys: Iterable[bytes]) -> list[int]: ...
    def touch(self, keys: Iterable[bytes]) -> None: ...
    def complete_load(self, keys: Iterable[bytes]) -> None: ...
    def prepare_store(self, keys: Iterable[bytes]) -> tuple[list[bytes], list[int], list[bytes]] | None: ...
    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None: ...
    def take_events(self) -> list[tuple[list[bytes], bool]]: ...
    def get_stats(self) -> dict[str, Any]: ...
    def poll(self) -> None: ...
    def flush(self) -> None: ...
    def num_promoting(self) -> int: ...
    @property
    def disk_dir(self) -> str: ...
    def disk_path_of(self, key: bytes) -> str: ...
    def disk_contains(self, key: bytes) -> bool: ...
    def disk_rescan(self) -> None: ...
    def reset(self) -> None: ...
    def shutdown(self) -> None: ...
    def __len__(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...

def bench_disk(
    dir: str | os.PathLike[str],
    label: str,
    page_sizes: list[int],
    num_blocks: int = 256,
    reps: int = 5,
    io_threads: int = 8,
    direct_io: str = "auto",
) -> dict[str, Any]: ...
