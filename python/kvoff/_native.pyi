"""Type stubs of the native module ``kvoff._native`` (checked by ``mypy.stubtest``)."""

import os
from collections.abc import Iterable
from typing import Any, Literal, final

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

__all__ = [
    "DEFAULT_COMPUTE_BUDGET",
    "DIRECT_IO",
    "ENGINES",
    "MAX_IDLE_SPIN_S",
    "MAX_REMOTE_IO_THREADS",
    "POLICIES",
    "POLICY_TOUCH_RULES",
    "TIERS",
    "TIER_DEFAULTS",
    "ARCOffloadingManager",
    "BlockStore",
    "CPULoadStoreSpec",
    "ChainManagerCore",
    "HostRegion",
    "LRUOffloadingManager",
    "NativeRemoteRef",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "RegionBuffer",
    "TransferHandler",
    "__version__",
    "bench_disk",
    "check_tier_settings",
    "compute_sub_block_ptrs",
    "cpu_sizing",
    "cuda_available",
    "expand_block_ids",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
    "resolve_engine",
    "set_thread_cpus",
    "thread_cpus",
    "thread_placement_error",
]

__version__: str

from kvoff._names import Direction as _Direction
from kvoff._names import DirectIoName as _DirectIoName
from kvoff._names import EngineName as _EngineName
from kvoff._names import PolicyName as _PolicyName

#: The eviction policies, from the Rust enum ``PolicyKind``.
POLICIES: tuple[_PolicyName, ...]
#: Per policy, which keys the serving adapter touches when a request finishes: ``"all"`` or
#: ``"reused"`` (the Rust ``Policy::TOUCH``).
POLICY_TOUCH_RULES: dict[str, Literal["all", "reused"]]
#: The ``engine=`` choices of the transfer handlers, from the Rust enum ``EngineKind``.
ENGINES: tuple[_EngineName, ...]
#: The file tier's ``direct_io`` modes (the Rust ``DirectIo``).
DIRECT_IO: tuple[_DirectIoName, ...]
#: The handlers' default ``compute_budget`` (Rust ``engine::DEFAULT_COMPUTE_BUDGET_BP``).
DEFAULT_COMPUTE_BUDGET: float
#: Every tier setting's default as ``ChainManagerCore`` and ``BlockStore`` apply it, from the crate's
#: configs (``None``: none, or chosen by the machine or the surface); see :mod:`kvoff.tiers`.
TIER_DEFAULTS: dict[str, Any]
#: Every registered tier (Rust ``tier::registry::TIERS``, chain order): kind → the names of its own
#: stats (``<kind>_<name>`` in ``get_stats()``).
TIERS: dict[str, tuple[str, ...]]
#: Most ``remote_io_threads``.
MAX_REMOTE_IO_THREADS: int
#: Longest ``remote_idle_spin_s`` / ``remote_idle_nap_s``.
MAX_IDLE_SPIN_S: float

def check_tier_settings(kind: Literal["manager", "store"], **settings: Any) -> None:
    """Checks tier settings as ``ChainManagerCore`` (``"manager"``) or ``BlockStore``
    (``"store"``) read them, opening nothing: ``TypeError`` (wrong type, unknown setting),
    ``ValueError`` (out of range), naming the setting."""

def make_offload_key(block_hash: bytes, group_idx: int) -> bytes:
    """The offload key of a block: `block_hash` followed by `group_idx` as 4 big-endian bytes."""

def get_offload_block_hash(key: bytes) -> bytes:
    """The block hash part of an offload key (all but its last 4 bytes)."""

def get_offload_group_idx(key: bytes) -> int:
    """The KV-cache group index of an offload key (its last 4 bytes, big-endian)."""

@final
class CPULoadStoreSpec:
    """CPU block ids of a load or store (`block_ids`: int64 numpy array)."""
    def __new__(cls, block_ids: Iterable[int] | npt.ArrayLike) -> CPULoadStoreSpec: ...
    @property
    def block_ids(self) -> npt.NDArray[np.int64]:
        """The block ids (int64, one dimension)."""
    @staticmethod
    def medium() -> Literal["CPU"]:
        """The medium name, `"CPU"`."""
    def __len__(self) -> int:
        """Return len(self)."""

@final
class PrepareStoreOutput:
    """Result of `prepare_store`."""
    def __new__(
        cls, keys_to_store: Iterable[bytes], store_spec: CPULoadStoreSpec, evicted_keys: Iterable[bytes]
    ) -> PrepareStoreOutput: ...
    @property
    def keys_to_store(self) -> list[bytes]:
        """Keys to store now, in input order (absent keys that were admitted)."""
    @property
    def store_spec(self) -> CPULoadStoreSpec:
        """CPU block ids for `keys_to_store`, co-indexed: where the worker writes them."""
    @property
    def evicted_keys(self) -> list[bytes]:
        """Keys evicted to make room, in eviction order."""

@final
class OffloadingEvent:
    """A change of the set of ready blocks."""
    def __new__(
        cls, keys: Iterable[bytes], block_size: int, medium: str, removed: bool
    ) -> OffloadingEvent: ...
    @property
    def keys(self) -> list[bytes]:
        """The keys that became ready (stored) or were removed (evicted)."""
    @property
    def block_size(self) -> int:
        """The manager's `block_size` setting (tokens per block), as configured."""
    @property
    def medium(self) -> str:
        """Where the blocks live: `"CPU"`."""
    @property
    def removed(self) -> bool:
        """`True` for removals, `False` for stores."""

@disjoint_base
class OffloadingManager:
    """Base class of the offloading managers."""
    @property
    def policy(self) -> _PolicyName:
        """Policy name, `"lru"` or `"arc"`."""
    @property
    def num_blocks(self) -> int:
        """Capacity in CPU blocks."""
    @property
    def arc_target(self) -> float | None:
        """ARC's target size of T1 (`None` for LRU). Introspection for tests and tuning."""
    def __len__(self) -> int:
        """Return len(self)."""
    def lookup(self, key: bytes, req_context: Any = None) -> bool | None:
        """`True` ready/loading, `None` pending, `False` absent."""
    def lookup_prefix(self, keys: Iterable[bytes], req_context: Any = None) -> int | None:
        """Number of leading ready keys; `None` if the first non-ready key is pending."""
    def prepare_load(self, keys: Iterable[bytes], req_context: Any = None) -> CPULoadStoreSpec:
        """Pins ready keys for loading; returns their CPU spec."""
    def touch(self, keys: Iterable[bytes], req_context: Any = None) -> None:
        """Recency update (the first key ends most recently used)."""
    def complete_load(self, keys: Iterable[bytes], req_context: Any = None) -> None:
        """Unpins keys whose load finished."""
    def prepare_store(self, keys: Iterable[bytes], req_context: Any = None) -> PrepareStoreOutput | None:
        """docs/spec.md §2.3. `None` when there is not enough evictable room (nothing changed)."""
    def complete_store(self, keys: Iterable[bytes], success: bool = True, req_context: Any = None) -> None:
        """Pending keys become ready (`success`) or are removed (failure)."""
    def take_events(self, req_context: Any = None) -> list[OffloadingEvent]:
        """Drains events in order."""
    def get_stats(self, req_context: Any = None) -> dict[str, Any]:
        """Gauges and counters; resets `stores_skipped`."""
    def reset(self, req_context: Any = None) -> None:
        """Forgets every key, ghost and counter; pending events stay."""
    def shutdown(self, req_context: Any = None) -> None:
        """Idempotent; later calls of other methods raise `InvalidStateError`."""
    def debug_lists(self) -> list[list[bytes]]:
        """Keys of each list from LRU to MRU: `(T1, T2, B1, B2)` for ARC, `(order, [], [], [])` for LRU."""

@final
class LRUOffloadingManager(OffloadingManager):
    """LRU offloading manager (docs/spec.md §2.4)."""
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
    """ARC offloading manager (docs/spec.md §2.5)."""
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
) -> tuple[int, int, int]:
    """`cpu_sizing(page_size_bytes, block_size_factor, world_size=1, cpu_bytes_to_use=None)` →
    `(slot_bytes, row_stride_bytes, num_cpu_blocks)`.
    """

def expand_block_ids(
    block_ids: npt.ArrayLike, block_size_factor: int, skip_count: int | None = None, count: int | None = None
) -> npt.NDArray[np.int64]:
    """`expand_block_ids(block_ids, block_size_factor, skip_count=0, count=None) -> int64 array`."""

def compute_sub_block_ptrs(
    block_ids: npt.ArrayLike,
    block_size_factor: int,
    base_ptr: int,
    row_stride: int,
    row_bytes: int,
    skip_count: int | None = None,
    count: int | None = None,
) -> npt.NDArray[np.int64]:
    """`compute_sub_block_ptrs(block_ids, block_size_factor, base_ptr, row_stride, row_bytes,
    skip_count=0, count=None) -> int64 array`.
    """

def cuda_available() -> bool:
    """Whether kvoff can use CUDA here (a driver with at least one device)."""

def set_thread_cpus(cpus: Iterable[int] | str | None) -> None:
    """The CPUs of the threads kvoff starts from now on (copy, I/O and feeder threads),
    process-wide: CPU numbers, a Linux CPU list such as ``"1,3,8-11"``, or ``None`` /
    ``"inherit"`` to keep the creator's (the default; ``KVOFF_THREAD_CPUS`` sets it at start)."""

def thread_cpus() -> list[int] | None:
    """The CPUs set for kvoff's threads, or ``None`` when they inherit their creator's."""

def thread_placement_error() -> str | None:
    """Why the CPU setting could not be applied to one of kvoff's threads (the last time)."""

def resolve_engine(
    engine: str, placements: list[int | None], names: list[str] | None = None
) -> Literal["host", "cuda"]:
    """The engine ``TransferHandler(..., engine)`` will use for GPU-side tensors placed as
    ``placements`` (per tensor: its CUDA device index, ``None`` for host memory), raising what it
    would raise; ``names[i]`` describes tensor ``i`` in messages."""

@final
class HostRegion:
    """A host memory region (docs/spec.md §5): private (anonymous) or shared by name in `/dev/shm`."""
    @staticmethod
    def private(num_cpu_blocks: int, slot_bytes: int, world_size: int | None = None) -> HostRegion:
        """A private region of `num_cpu_blocks` rows of `world_size` slots of `slot_bytes`, prefaulted."""
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
    ) -> HostRegion:
        """Creates or joins the shared region `name` (a file in `directory`, default `/dev/shm`) as
        `rank`, waiting up to `timeout` seconds for its creator. Releases the GIL while waiting.
        """
    @staticmethod
    def attach(
        name: str, timeout: float = 60.0, directory: str | os.PathLike[str] | None = None
    ) -> HostRegion:
        """Attaches to the shared region `name` that an engine's ranks created, as an observer (no
        rank; the geometry is read from the region), waiting up to `timeout` seconds for it: how the
        scheduler's process reaches the host rows to move blocks to and from a tier behind them.
        The ranks must create it with `unlink_when_all_joined=False`; `unlink()` it once attached.
        """
    @property
    def num_cpu_blocks(self) -> int:
        """Number of rows (CPU blocks)."""
    @property
    def slot_bytes(self) -> int:
        """Bytes of one rank's slot in a row."""
    @property
    def world_size(self) -> int:
        """Number of ranks (slots per row)."""
    @property
    def rank(self) -> int | None:
        """This process's rank (shared regions); `None` for a private region."""
    @property
    def row_stride_bytes(self) -> int:
        """Bytes from one row to the next (a multiple of the OS page size)."""
    @property
    def len_bytes(self) -> int:
        """Bytes of all rows."""
    @property
    def path(self) -> str | None:
        """Path of the region file (shared regions), whether or not it is still linked."""
    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
    @property
    def ptr(self) -> int:
        """Address of row 0."""
    @property
    def is_pinned(self) -> bool:
        """Whether the region is registered (page-locked) with CUDA."""
    @property
    def pin_error(self) -> str | None:
        """Why the last `pin` failed, if it did."""
    def view(self, rank: int, offset: int, nbytes: int) -> Any:
        """A zero-copy 2-D `torch.uint8` tensor `(num_cpu_blocks, nbytes)` with the region's row stride:
        bytes `offset..offset+nbytes` of `rank`'s slot in every row. The tensor keeps the mapping
        alive. Needs torch.
        """
    def view_numpy(self, rank: int, offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """As `view`, as a numpy `uint8` array."""
    def pin(self, device: int = 0) -> None:
        """Page-locks the region for CUDA device `device` (row-aligned pieces, all or nothing). On
        failure the region stays usable and unpinned and `pin_error` says why.
        """
    def unpin(self) -> None:
        """Unregisters what `pin` registered (no-op when not pinned)."""
    def unlink(self) -> bool:
        """Removes the region's file name (shared regions); the mapping stays. Returns whether a name
        was removed.
        """
    def close(self) -> None:
        """Releases this object's hold on the mapping: unpins and unmaps now when no view is alive,
        otherwise when the last view is garbage-collected. Idempotent.
        """
    def __enter__(self) -> HostRegion: ...
    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool: ...

@final
class RegionBuffer:
    """Exporter of one region view to numpy (`__array_interface__`); holds the region alive."""
    @property
    def __array_interface__(self) -> dict[str, Any]:
        """numpy's array interface (version 3): a writable `uint8` 2-D strided array."""
    @property
    def ptr(self) -> int:
        """Address of row 0 of the view."""

@final
class TransferHandler:
    """One direction's transfers over a fixed set of tensors: a [`CopyPlanner`] and an engine."""
    def __new__(
        cls,
        direction: _Direction,
        gpu_tensors: list[Any] | tuple[Any, ...],
        cpu_tensors: list[Any] | tuple[Any, ...],
        group_refs: list[list[tuple[int, int]]] | tuple[Any, ...],
        block_size_factor: int,
        engine: _EngineName = "auto",
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
    ) -> None:
        """Checks and queues one job for the handler's submit thread (which plans it and hands it to
        the engine); returns at once. Nothing is queued when it raises; a failure after queuing is
        the job's failed result. Raises `InvalidStateError` in a fork()ed child."""
    def get_finished(self) -> list[tuple[int, bool, int, float, str | None]]:
        """Finished jobs not returned before, in submission order, as
        `(job_id, success, bytes, seconds, error)`. Never blocks: while another thread is in `wait`,
        returns what is available later.
        """
    def wait(self, job_ids: Iterable[int] | int) -> None:
        """Blocks until the jobs `job_ids` finished (unknown ids are ignored), releasing the GIL;
        queued jobs are handed to the engine first."""
    def set_compute_streams(self, streams: list[int]) -> None:
        """`set_compute_streams(streams)`: raw CUDA stream handles (ints; 0 = the legacy default
        stream) on which the model computes, watched by the CUDA engine's serving policy at each
        submit besides the job's own ordering stream (ignored by the host engine). The caller keeps
        the streams alive while the handler lives (`kvoff.handlers` holds the torch streams); as
        with `submit`'s stream, a handle that is not a live stream of the device is undefined
        behaviour.
        """
    def shutdown(self) -> None:
        """Hands queued jobs over, drains in-flight work and stops the engine; idempotent. Results
        stay available. Does nothing in a fork()ed child."""
    @property
    def direction(self) -> _Direction:
        """`"gpu_to_cpu"` or `"cpu_to_gpu"`."""
    @property
    def transfer_type(self) -> tuple[Literal["GPU", "CPU"], Literal["GPU", "CPU"]]:
        """`("GPU", "CPU")` or `("CPU", "GPU")`."""
    @property
    def engine(self) -> str:
        """The engine in use: `"host"` or `"cuda:<method>"`."""
    @property
    def last_submit_stats(self) -> dict[str, Any]:
        """What the most recent `submit` did (once queued jobs were handed to the engine): `method`
        (the copy method, or None before the first),
        `sms` (SMs its copy kernels can occupy at once; 0 = copy engines only), `policy`
        (`"serving"` or `"idle"`: which policy of the CUDA engine's `auto` chose; None otherwise),
        `submit_ns` (CPU time of the submit), `longest_call_ns` / `longest_call_cpu_ns` (its longest
        single driver call, wall-clock / thread CPU time), `driver_calls`, `longest_call` (the
        driver entry point of the most CPU-hungry call, or None), `paced_ns` (time waited outside
        the driver for the device to drain the stream's queue), `fed` (a long DMA job handed to the
        engine's feeder thread, which enqueues it paced while the submit returns), `reason` (which
        rule of the CUDA engine chose the method, e.g. "serving: pitched runs"; None for the host
        engine), `staged_cap_mb_s` (the rate cap the job's staged pipeline was paced at, shared by
        the device's engines while the model computes; 0 when not paced), `polite` (the device's
        copy calls were short and spaced because the model was seen launching beside them),
        `driver_contention` (shares of 1024 of the device's recent copy calls that waited for
        another thread's driver call: by wall time, by time off the CPU; and the share of those
        calls' time spent off the CPU), `driver_blocked` (the device's sampled copy calls since it
        was opened, and a list of the blocked ones by time off the CPU: 3–6, 6–12, …, 192–384 µs
        and longer).
        """
    @property
    def num_tensors(self) -> int:
        """Number of tensors kept alive by the handler (GPU side + CPU side)."""

# --- tiered manager (src/python/tier.rs); the public wrapper is kvoff.tier.TieredOffloadingManager ---

@final
class ChainManagerCore:
    """A tiered manager for Python: see the module docs."""
    def __new__(
        cls,
        policy: _PolicyName,
        num_blocks: int,
        disk_path: str | os.PathLike[str] | None,
        disk_bytes_to_use: int | None,
        memory_ptr: int,
        memory_rows: int,
        row_stride_bytes: int,
        block_bytes: int,
        memory_owner: HostRegion,
        *,
        namespace: str = ...,
        page_sizes: list[int] = ...,
        block_size_factor: int = ...,
        dtype: str = ...,
        world_size: int = ...,
        rank: int = ...,
        block_size: int = ...,
        enable_events: bool = ...,
        store_threshold: int = ...,
        max_tracker_size: int = ...,
        disk_store_threshold: int = ...,
        io_threads: int = ...,
        write_threads: int = ...,
        max_queued_writes: int = ...,
        fsync: bool = ...,
        direct_io: _DirectIoName = ...,
        rescan_interval_s: float | None = ...,
        owner: str | None = None,
        max_promotions: int = ...,
        trusted_uids: list[int] = ...,
        trusted_gid: int | None = None,
        allow_writable_dir: bool = ...,
        remote_url: str | None = None,
        remote_cluster: bool = ...,
        remote_namespace: str | None = None,
        remote_store_threshold: int = ...,
        remote_ttl_s: float | None = None,
        remote_connect_timeout_s: float = ...,
        remote_timeout_s: float = ...,
        remote_io_threads: int | None = None,
        remote_max_queued_writes: int = ...,
        remote_max_inflight_bytes: int = ...,
        remote_negative_ttl_s: float = ...,
        remote_max_fetch_keys: int = ...,
        remote_password_env: str = ...,
        remote_tls_ca_file: str | os.PathLike[str] | None = None,
        remote_idle_spin_s: float | None = None,
        remote_idle_nap_s: float | None = None,
        object_url: str | None = None,
        object_endpoint: str | None = None,
        object_region: str | None = None,
        object_namespace: str | None = None,
        object_bytes_to_use: int | None = None,
        object_ttl_s: float | None = None,
        object_connect_timeout_s: float = ...,
        object_timeout_s: float = ...,
        object_max_retries: int = ...,
        object_io_threads: int = ...,
        object_max_requests: int = ...,
        object_max_queued_writes: int = ...,
        object_max_inflight_bytes: int = ...,
        object_negative_ttl_s: float = ...,
        object_list_interval_s: float | None = ...,
        object_multipart_bytes: int = ...,
        object_profile: str | None = None,
        object_store_threshold: int = ...,
    ) -> ChainManagerCore: ...
    def lookup(self, key: bytes, req_context: Any = None, after: bytes | None = None) -> bool | None:
        """`True` ready, `None` pending (store, promotion or fetch in flight), `False` absent.
        `after`: the key before `key` in its prefix, looked up just before (a caller that looks
        a prefix up one key at a time, in order; docs/tier.md "Tier chain"). `req_context` is
        vLLM's, unused: the signature is the manager's, so that `TieredOffloadingManager` hands the
        scheduler's calls to this method with no Python frame in between.
        """
    def lookup_prefix(self, keys: Iterable[bytes], req_context: Any = None) -> int | None:
        """Leading ready keys, or `None` when the first non-ready one is pending, being promoted or
        being fetched. `req_context`: as `lookup`'s.
        """
    def prepare_load(self, keys: Iterable[bytes]) -> list[int]:
        """Pins the keys for a load; returns their block ids."""
    def touch(self, keys: Iterable[bytes]) -> None:
        """Recency update."""
    def complete_load(self, keys: Iterable[bytes]) -> None:
        """Unpins loaded keys."""
    def prepare_store(self, keys: Iterable[bytes]) -> tuple[list[bytes], list[int], list[bytes]] | None:
        """`(keys_to_store, block_ids, evicted_keys)` or `None`."""
    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        """Finishes stores (and writes the stored blocks through to the tiers)."""
    def take_events(self) -> list[tuple[list[bytes], bool]]:
        """Events as `(keys, removed)` pairs, in order."""
    def get_stats(self) -> dict[str, Any]:
        """Host gauges (docs/spec.md §2.2) plus `disk_*` and `remote_*` counters and gauges."""
    def poll(self) -> None:
        """Applies finished I/O (never blocks)."""
    def flush(self) -> None:
        """Waits (GIL released; for the file tier without the manager's lock) until the queued I/O
        has run — bounded by the remote timeouts — then applies it. For tests and tools, not a
        scheduler.
        """
    def num_promoting(self) -> int:
        """Number of promotions in flight."""
    @property
    def disk_dir(self) -> str | None:
        """The directory of this layout's files, or `None` without a file tier."""
    @property
    def remote_url(self) -> str | None:
        """The remote URL with its password hidden, or `None` without a remote tier."""
    def disk_path_of(self, key: bytes) -> str:
        """Path of a key's file (whether or not it exists)."""
    def disk_rescan(self) -> None:
        """Lists the file tier's directory again now (GIL released)."""
    def tier_index(self, kind: str, key: bytes) -> bool | None:
        """What tier `kind`'s index knows about a key (no I/O): `True` present, `False` absent,
        `None` unknown (a fetch would ask the server); `False` when there is no such tier.
        """
    def reset(self) -> None:
        """Waits for I/O, then forgets every host key (the tiers keep their values)."""
    def shutdown(self) -> None:
        """Waits for I/O (bounded by the remote timeouts), stops the I/O threads; idempotent. Later
        calls raise `InvalidStateError`.
        """
    def __len__(self) -> int:
        """Return len(self)."""
    @property
    def num_blocks(self) -> int:
        """Host capacity in blocks."""

def bench_disk(
    dir: str | os.PathLike[str],
    label: str,
    page_sizes: list[int],
    num_blocks: int = ...,
    reps: int = ...,
    io_threads: int = ...,
    direct_io: _DirectIoName = "auto",
) -> dict[str, Any]:
    """Runs the disk benchmark for one layout (GIL released) and returns its row as a dict."""

@final
class NativeRemoteRef:
    """The native-client reference of `kvoff bench remote`: `n_blocks` values of `value_bytes` for
    the standalone `redis://` server at `url`, stored (`set`) and loaded (`get`) in timed passes
    from N connections, each call with the GIL released; `close` deletes its keys."""

    def __new__(cls, url: str, value_bytes: int, n_blocks: int) -> NativeRemoteRef: ...
    def set(self, threads: int) -> float:
        """Stores every value from `threads` connections (timed; an untimed first write before the
        first call); GB/s of values."""
    def get(self, threads: int) -> tuple[float, bool]:
        """Loads every value from `threads` connections into host memory (timed); (GB/s of values,
        every byte equal to the stored one)."""
    def close(self) -> None:
        """Deletes the reference's keys from the server and frees its memory (later calls raise
        `InvalidStateError`); a second call does nothing."""

# --- block store (src/python/blockstore.rs); used by kvoff.sglang and kvoff.vllm.tiering ---

@final
class BlockStore:
    """One of kvoff's secondary tiers — the file tier (``path``) or the remote tier on
    Redis/Valkey (``path=None, remote_url=...``) or an S3-compatible store (``path=None,
    object_url=...``; budget ``object_bytes_to_use``, else ``capacity_bytes``) — as a block store for engines that own their host
    memory (docs/tier.md, "The block store"): rows mode (``rows=(ptr, num_rows, row_stride_bytes)``,
    queued jobs, ``poll``) or segments mode (``write_segments``/``read_segments`` over lists of
    pieces)."""
    def __new__(
        cls,
        path: str | os.PathLike[str] | None,
        capacity_bytes: int,
        block_bytes: int,
        *,
        rows: tuple[int, int, int] | None = None,
        memory_owner: object | None = None,
        slots: int = ...,
        namespace: str = ...,
        page_sizes: list[int] = ...,
        block_size_factor: int = ...,
        dtype: str = ...,
        world_size: int = ...,
        rank: int = ...,
        io_threads: int = ...,
        write_threads: int = ...,
        max_queued_writes: int = ...,
        fsync: bool = ...,
        direct_io: _DirectIoName = ...,
        rescan_interval_s: float | None = ...,
        owner: str | None = None,
        trusted_uids: list[int] = ...,
        trusted_gid: int | None = None,
        allow_writable_dir: bool = ...,
        remote_url: str | None = None,
        remote_cluster: bool = ...,
        remote_namespace: str | None = None,
        remote_io_threads: int | None = None,
        remote_max_queued_writes: int | None = None,
        remote_idle_spin_s: float | None = None,
        remote_idle_nap_s: float | None = None,
        remote_ttl_s: float | None = None,
        remote_connect_timeout_s: float = ...,
        remote_timeout_s: float = ...,
        remote_max_inflight_bytes: int = ...,
        remote_negative_ttl_s: float = ...,
        remote_max_fetch_keys: int = ...,
        remote_password_env: str = ...,
        remote_tls_ca_file: str | os.PathLike[str] | None = None,
        object_url: str | None = None,
        object_endpoint: str | None = None,
        object_region: str | None = None,
        object_namespace: str | None = None,
        object_bytes_to_use: int | None = None,
        object_ttl_s: float | None = None,
        object_connect_timeout_s: float = ...,
        object_timeout_s: float = ...,
        object_max_retries: int = ...,
        object_io_threads: int = ...,
        object_max_requests: int = ...,
        object_max_queued_writes: int = ...,
        object_max_inflight_bytes: int = ...,
        object_negative_ttl_s: float = ...,
        object_list_interval_s: float | None = ...,
        object_multipart_bytes: int = ...,
        object_profile: str | None = None,
    ) -> BlockStore: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def kind(self) -> Literal["disk", "remote", "object"]: ...
    def submit_write(self, keys: Iterable[bytes], blocks: list[int]) -> list[bool]: ...
    def submit_read(self, keys: Iterable[bytes], blocks: list[int]) -> list[bool]: ...
    def poll(self) -> tuple[list[tuple[bytes, int, bool]], list[tuple[bytes, int, bool]]]: ...
    def write_segments(self, keys: Iterable[bytes], ptrs: list[int], sizes: list[int]) -> list[bool]: ...
    def read_segments(self, keys: Iterable[bytes], ptrs: list[int], sizes: list[int]) -> list[bool]: ...
    def contains(self, key: bytes) -> bool: ...
    def lookup(self, keys: Iterable[bytes]) -> list[bool | None]: ...
    def contains_many(self, keys: Iterable[bytes], wait_s: float = 0.0) -> list[bool]: ...
    def leading_run(self, keys: Iterable[bytes], wait_s: float = 0.0) -> int: ...
    def remove(self, key: bytes) -> bool: ...
    @property
    def dir(self) -> str: ...
    def path_of(self, key: bytes) -> str: ...
    def stats(self) -> dict[str, Any]: ...
    def num_pending(self) -> int: ...
    def flush(self) -> None: ...
    def rescan(self) -> None: ...
    def shutdown(self) -> None: ...
