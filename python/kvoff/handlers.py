"""Worker-side transfer handlers (docs/spec.md §3–§6): the host allocation and the two single-direction
handlers that move KV blocks between the GPU-side KV caches and host memory.

Layout decision. The CPU side of every canonical tensor ``t`` is a view
``(num_cpu_blocks, page_t × factor)`` of **one** host allocation whose rows are block-major::

    row b = [ tensor0: page_0 × f | tensor1: page_1 × f | … ] (+ padding to the OS page size)

(a private :class:`HostRegion` by default, or this rank's slot of a shared one), so all bytes of one
CPU block are contiguous on the host; the CUDA engine's "staged" method moves such rows with large
DMAs. With a CUDA engine the allocation is pinned (``HostRegion.pin``); unpinned memory still works
with the ``"dma"`` method.

torch is imported lazily: ``import kvoff`` works without it; these classes need it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from kvoff import _native
from kvoff._names import EngineName
from kvoff._native import HostRegion
from kvoff.canonical import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    _byte_rows,
    canonicalize_kv_caches,
)
from kvoff.errors import InvalidStateError, KvoffError
from kvoff.metrics import TransferMetrics

__all__ = [
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "CpuGpuOffloadingHandlers",
    "CpuSizing",
    "GPULoadStoreSpec",
    "SingleDirectionOffloadingHandler",
    "TransferResult",
    "canonicalize_kv_caches",
    "cpu_sizing",
]

#: The ``engine=`` choices, from the Rust enum that decides them (``EngineKind``).
ENGINES: tuple[str, ...] = _native.ENGINES


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is installed in the test environments
        raise ImportError(
            "kvoff's transfer handlers need torch: pip install torch "
            "(or, in a kvoff checkout: pip install '.[torch]')"
        ) from e
    return torch


# ---------------------------------------------------------------------------------------------
# Sizing (docs/spec.md §3)
# ---------------------------------------------------------------------------------------------


class CpuSizing(NamedTuple):
    """Geometry of a host region: one rank's slot, the row stride, and how many rows fit."""

    slot_bytes: int
    row_stride_bytes: int
    num_cpu_blocks: int


def cpu_sizing(
    page_size_bytes: Sequence[int],
    block_size_factor: int,
    world_size: int = 1,
    cpu_bytes_to_use: float | None = None,
) -> CpuSizing:
    """``kv_bytes_per_cpu_block`` (the row stride) and ``num_cpu_blocks`` for a host budget.

    Raises:
        ConfigError: ``cpu_bytes_to_use`` is missing or not positive (the message names the key).
        ValueError: bad page sizes, factor or world size.
    """
    return CpuSizing(*_native.cpu_sizing(page_size_bytes, block_size_factor, world_size, cpu_bytes_to_use))


# ---------------------------------------------------------------------------------------------
# Specs and results
# ---------------------------------------------------------------------------------------------


def _as_ids(x: Any, name: str) -> np.ndarray:
    """A 1-D int64 numpy array from ids (int64 arrays are passed through without a copy)."""
    if isinstance(x, np.ndarray):
        arr = x
    elif hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        arr = x.detach().cpu().numpy()
    elif isinstance(x, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints, got {type(x).__name__}")
    else:
        arr = np.asarray(list(x) if not isinstance(x, Sequence) else x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.int64:
        return arr
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds ids beyond int64")
    return arr.astype(np.int64)


class GPULoadStoreSpec:
    """The GPU side of a transfer: GPU block ids ordered group by group (docs/spec.md §4).

    ``group_sizes[g]`` ids belong to group ``g`` (``None``: one group); ``block_indices[g]`` is the
    index within the request of group ``g``'s first block (``None``: 0 for every group).
    """

    __slots__ = ("block_ids", "block_indices", "group_sizes")

    def __init__(self, block_ids: Any, group_sizes: Any = None, block_indices: Any = None) -> None:
        self.block_ids = _as_ids(block_ids, "block_ids")
        self.group_sizes = None if group_sizes is None else _as_ids(group_sizes, "group_sizes")
        self.block_indices = None if block_indices is None else _as_ids(block_indices, "block_indices")

    @staticmethod
    def medium() -> str:
        return "GPU"

    def __len__(self) -> int:
        return len(self.block_ids)

    def __repr__(self) -> str:
        return (
            f"GPULoadStoreSpec({self.block_ids.tolist()}, group_sizes="
            f"{None if self.group_sizes is None else self.group_sizes.tolist()}, block_indices="
            f"{None if self.block_indices is None else self.block_indices.tolist()})"
        )


class TransferResult(NamedTuple):
    """The outcome of one transfer job. ``transfer_time`` is in seconds (device-timed on a GPU);
    ``error`` is the engine's message when ``success`` is false."""

    job_id: int
    success: bool
    transfer_size: int
    transfer_time: float
    transfer_type: tuple[str, str]
    error: str | None = None


# ---------------------------------------------------------------------------------------------
# Handlers
# ---------------------------------------------------------------------------------------------


class SingleDirectionOffloadingHandler:
    """Transfers of one direction (GPU→CPU stores or CPU→GPU loads); see docs/spec.md §6.

    Jobs run and complete in submission order. On a CUDA engine every transfer is ordered after
    the work already queued on the caller's current CUDA stream. With ``metrics`` (a
    :class:`kvoff.TransferMetrics`), every result returned by :meth:`get_finished` is observed there.
    """

    def __init__(
        self,
        native: Any,
        device: Any = None,
        metrics: TransferMetrics | None = None,
        storages: Sequence[tuple[Any, int, int]] = (),
    ) -> None:
        self._native = native
        self.metrics = metrics
        # The process that owns the engine (its threads, streams, events): a fork()ed child has
        # none of them, so there every call fails clearly instead of waiting forever.
        self._pid = os.getpid()
        # (storage, data_ptr, bytes needed) of every engine tensor: the engine holds raw pointers,
        # so a storage resized or reallocated since (``untyped_storage().resize_(0)``) is refused
        # at submission instead of being written after it was freed.
        self._storages = tuple(storages)
        self._store = native.direction == "gpu_to_cpu"
        self._transfer_type: tuple[str, str] = native.transfer_type
        self._cuda = native.engine.startswith("cuda")
        self._device = device
        # The caller's current stream, read at every submit (docs/performance.md, "The cost of a
        # submit": torch.cuda.current_stream() cost ~12 µs of the model's thread per call).
        self._current_stream = _current_stream_reader(device) if self._cuda else None
        # Streams the engine watches for the model (set by CpuGpuOffloadingHandlers), kept alive
        # here because the engine holds their raw handles.
        self._compute_streams: tuple[Any, ...] = ()

    @property
    def transfer_type(self) -> tuple[str, str]:
        """``("GPU", "CPU")`` or ``("CPU", "GPU")``."""
        return self._transfer_type

    @property
    def engine(self) -> str:
        """``"host"`` or ``"cuda:<method>"``."""
        return str(self._native.engine)

    @property
    def last_submit_stats(self) -> dict[str, Any]:
        """What the most recent submit did: ``method``, ``sms`` (SMs its copy kernels can occupy at
        once; 0 = copy engines only), ``policy`` (``"serving"`` or ``"idle"``: which policy of the
        CUDA engine's ``auto`` chose; ``None`` otherwise), ``submit_ns``, ``longest_call_ns`` /
        ``longest_call_cpu_ns`` (its longest single CUDA driver call, wall-clock / thread CPU
        time), ``driver_calls``, ``longest_call`` (the driver entry point of the most CPU-hungry
        call, or ``None``), ``paced_ns`` (time the submit waited outside the driver for the device
        to drain the stream's queue: the pacing of long DMA jobs), ``fed`` (a long DMA job handed to
        the engine's feeder thread, which enqueues it paced while the submit returns), and the
        device's driver contention (``polite``, ``driver_contention``, ``driver_blocked``: see
        ``kvoff._native.TransferHandler.last_submit_stats``)."""
        self._check_process()
        return dict(self._native.last_submit_stats)

    def transfer_async(self, job_id: int, spec: tuple[Any, Any]) -> bool:
        """Validates and enqueues one transfer ``(src_spec, dst_spec)``; returns ``True`` at once.

        Raises:
            ValueError: the specs do not fit the KV caches (ids out of range, ids not consumed
                exactly, duplicate destinations, a busy job id); nothing was enqueued.
            TypeError: the specs are of the wrong kind for this direction.
            InvalidStateError: the handler was shut down.
        """
        self._check_process()
        self._check_storages()
        try:
            src, dst = spec
        except (TypeError, ValueError):
            raise TypeError("spec must be a (src_spec, dst_spec) pair") from None
        gpu, cpu = (src, dst) if self._store else (dst, src)
        _check_medium(gpu, "GPU", "source" if self._store else "destination")
        _check_medium(cpu, "CPU", "destination" if self._store else "source")
        stream = None if self._current_stream is None else self._current_stream()
        self._native.submit(
            job_id,
            gpu.block_ids,
            getattr(gpu, "group_sizes", None),
            getattr(gpu, "block_indices", None),
            cpu.block_ids,
            stream,
        )
        return True

    def get_finished(self) -> list[TransferResult]:
        """Results of finished transfers not returned before, in submission order. Never blocks."""
        self._check_process()
        tt = self._transfer_type
        out = [TransferResult(j, ok, n, t, tt, err) for (j, ok, n, t, err) in self._native.get_finished()]
        if self.metrics is not None and out:
            self.metrics.observe_all(out)
        return out

    def wait(self, job_ids: Iterable[int] | int) -> None:
        """Blocks until the jobs ``job_ids`` finished (unknown ids are ignored); releases the GIL."""
        self._check_process()
        ids = [job_ids] if isinstance(job_ids, int) else list(job_ids)
        self._native.wait(ids)

    def shutdown(self) -> None:
        """Drains in-flight transfers and stops the engine. Idempotent. In a fork()ed child it
        does nothing: the engine belongs to the parent."""
        if os.getpid() != self._pid:
            return
        self._native.shutdown()

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise InvalidStateError(
                f"these kvoff transfer handlers belong to process {self._pid} and cannot be used in "
                f"a fork()ed child (process {os.getpid()}); create new handlers in the child"
            )

    def _check_storages(self) -> None:
        for i, (st, ptr, need) in enumerate(self._storages):
            if st.data_ptr() != ptr or st.nbytes() < need:
                raise ValueError(
                    f"the storage of KV-cache tensor {i} was resized or reallocated since the handlers "
                    f"were created ({st.nbytes()} bytes at {st.data_ptr():#x}, needed {need} at "
                    f"{ptr:#x}); create new handlers for the new tensors"
                )

    def __repr__(self) -> str:
        return f"SingleDirectionOffloadingHandler({self._transfer_type}, engine={self.engine!r})"


def _current_stream_reader(device: Any) -> Callable[[], int]:
    """A function that returns the raw handle of ``device``'s current CUDA stream, as
    ``torch.cuda.current_stream(device).cuda_stream`` does: through torch's direct accessor
    (``torch._C._cuda_getCurrentRawStream``, which Triton and torch's own generated code use)
    where this torch has it, else through the public call."""
    torch = _torch()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    index = getattr(device, "index", None)
    if raw is None or index is None:
        return lambda: int(torch.cuda.current_stream(device).cuda_stream)
    return lambda: int(raw(index))


def _storage_extents(views: Sequence[Any]) -> list[tuple[Any, int, int]]:
    """For each distinct storage under ``views`` (2-D byte views): the storage, its data pointer
    and the bytes the views reach into it."""
    need: dict[int, tuple[Any, int, int]] = {}
    for v in views:
        st = v.untyped_storage()
        ptr = int(st.data_ptr())
        end = v.storage_offset() * v.element_size()
        if v.numel() > 0:
            end += ((v.shape[0] - 1) * v.stride(0) + (v.shape[1] - 1) * v.stride(1) + 1) * v.element_size()
        prev = need.get(ptr)
        need[ptr] = (st, ptr, max(end, prev[2] if prev else 0))
    return list(need.values())


def _check_medium(spec: Any, medium: str, role: str) -> None:
    if not hasattr(spec, "block_ids"):
        raise TypeError(f"the {role} spec must be a {medium} load/store spec, got {type(spec).__name__}")
    m = getattr(spec, "medium", None)
    if callable(m):
        got = m()
        if str(got).upper() != medium:
            raise TypeError(
                f"the {role} spec must be a {medium} spec, got a {got} spec ({type(spec).__name__})"
            )


def _stream_handles(compute_streams: tuple[Any, ...]) -> list[int]:
    """The raw CUDA stream handles of ``compute_streams`` (TypeError for anything else)."""
    stream_handles = []
    for st in compute_streams:
        if not hasattr(st, "cuda_stream"):
            raise TypeError(f"compute_streams must hold torch CUDA streams, got {type(st).__name__}")
        stream_handles.append(int(st.cuda_stream))
    return stream_handles


def _check_sizes(engine: Any, block_size_factor: Any, num_cpu_blocks: Any) -> None:
    """Type and range checks of :class:`CpuGpuOffloadingHandlers`' scalar arguments."""
    if not isinstance(engine, str):
        raise TypeError(f"engine must be a str, one of {list(ENGINES)}; got {type(engine).__name__}")
    for name, v in (("block_size_factor", block_size_factor), ("num_cpu_blocks", num_cpu_blocks)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if block_size_factor < 1:
        raise ValueError(f"block_size_factor must be >= 1, got {block_size_factor}")
    if num_cpu_blocks < 0:
        raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")


def _gpu_views(caches: CanonicalKVCaches) -> list[Any]:
    """Each canonical tensor as ``uint8`` rows cut to its page (ValueError for a bad page size or
    no tensor at all)."""
    torch = _torch()
    gpu_views = []
    for i, ct in enumerate(caches.tensors):
        v = ct.tensor
        if not (isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 2):
            v = _byte_rows(v, f"canonical tensor {i}")
        if not 0 < ct.page_size_bytes <= v.shape[1]:
            raise ValueError(
                f"canonical tensor {i}: page_size_bytes {ct.page_size_bytes} must be in 1..{v.shape[1]}"
            )
        gpu_views.append(v[:, : ct.page_size_bytes])
    if not gpu_views:
        raise ValueError("there must be at least one KV-cache tensor")
    return gpu_views


def _host_region(
    region: HostRegion | None, num_cpu_blocks: int, slot_bytes: int, block_size_factor: int
) -> tuple[HostRegion, int]:
    """The host region (a private one for ``None``) and this rank in it, checked to hold
    ``num_cpu_blocks`` slots of ``slot_bytes``."""
    if region is None:
        return HostRegion.private(num_cpu_blocks, slot_bytes), 0
    if not isinstance(region, HostRegion):
        raise TypeError(f"region must be a kvoff.HostRegion, got {type(region).__name__}")
    rank = region.rank or 0
    if region.num_cpu_blocks < num_cpu_blocks:
        raise ValueError(
            f"the region holds {region.num_cpu_blocks} CPU blocks but num_cpu_blocks = {num_cpu_blocks}"
        )
    if region.slot_bytes < slot_bytes:
        raise ValueError(
            f"the region's slot ({region.slot_bytes} bytes per rank per block) is smaller than "
            f"one CPU block of these KV caches ({slot_bytes} bytes = Σ page × factor "
            f"{block_size_factor}); size it with kvoff.cpu_sizing"
        )
    return region, rank


def _pin_or_warn(region: HostRegion, device: Any) -> None:
    """Pins ``region`` for ``device``; a failure is a RuntimeWarning (transfers then use unpinned
    memory)."""
    ordinal = device.index if device is not None and device.index is not None else 0
    try:
        region.pin(ordinal)
    except KvoffError as e:
        warnings.warn(
            f"kvoff: could not pin the host region ({e}); transfers use unpinned memory "
            f"(slower; the 'kernel' method is unavailable)",
            RuntimeWarning,
            stacklevel=3,
        )


class CpuGpuOffloadingHandlers:
    """Store and load handlers between GPU-side KV caches and a host allocation (docs/spec.md §6).

    Args:
        kv_caches: a dict/list of KV-cache tensors (see :func:`canonicalize_kv_caches`) or a
            :class:`CanonicalKVCaches`.
        block_size_factor: GPU blocks per CPU block (≥ 1).
        num_cpu_blocks: CPU blocks to hold.
        region: a :class:`HostRegion` to place the CPU tensors in (this rank's slot of a shared
            region); ``None`` allocates a private one.
        engine: ``"auto"`` (CUDA when the KV caches are on a GPU and CUDA is usable, else host
            memcpy), ``"host"``, ``"cuda"`` (= CUDA, method chosen per job), ``"dma"``,
            ``"kernel"``, ``"staged"`` or ``"loop"``.
        metrics: a :class:`kvoff.TransferMetrics` that observes every result of both handlers'
            ``get_finished()``; ``None`` creates one (``self.metrics``).
        compute_budget: the model slowdown that transfers running beside it may cost, as a
            fraction of a compute-bound kernel's time (default 0.02 = 2%; a memory-bound kernel
            sees about 2.5× that), used by the CUDA engine's ``"auto"``/``"cuda"`` choice. While
            the model is seen computing, ``auto`` keeps within it (the serving policy: batched DMA
            for copies ≥ 32 KiB, else the staged pipeline, at the lowest stream priority); when no
            model work was seen for 100 ms (the GPU is idle), it takes the fastest method. The
            model is "seen" when the stream a job is ordered after (the caller's current stream,
            in vLLM the model's) or one of ``compute_streams`` has unfinished work at a submit.
            ``None``: the idle-GPU policy always (fastest method; beside a model on an H100 it cost
            a GEMM up to 14% and a memory-bound kernel up to 30%; docs/performance.md).
        compute_streams: torch CUDA streams of the KV caches' device on which the model computes,
            watched besides each job's ordering stream (needed when transfers are submitted from a
            thread whose current stream is not the model's); the handlers keep the stream objects
            alive (a ``torch.cuda.ExternalStream`` does not own its stream: keep that stream alive
            while the handlers live). A stream being captured into a CUDA graph is not queried.

    Raises:
        CudaUnavailableError: a CUDA engine was asked for where there is no CUDA driver or device
            (also when the KV caches are CPU tensors; the message names their device).
        ValueError: bad shapes, devices, sizes; the region is too small; a CUDA engine
            (``"cuda"``, ``"dma"``, ``"kernel"``, ``"staged"``, ``"loop"``) with KV caches that
            are not CUDA tensors where CUDA is available (the message names the tensor and device).
    """

    def __init__(
        self,
        kv_caches: Any,
        block_size_factor: int,
        num_cpu_blocks: int,
        region: HostRegion | None = None,
        engine: EngineName = "auto",
        metrics: TransferMetrics | None = None,
        compute_budget: float | None = _native.DEFAULT_COMPUTE_BUDGET,
        compute_streams: Sequence[Any] | None = (),
    ) -> None:
        _torch()  # first: without torch, the ImportError that says so
        if metrics is not None and not isinstance(metrics, TransferMetrics):
            raise TypeError(f"metrics must be a kvoff.TransferMetrics or None, got {type(metrics).__name__}")
        self.metrics: TransferMetrics = TransferMetrics() if metrics is None else metrics
        compute_streams = tuple(compute_streams or ())
        stream_handles = _stream_handles(compute_streams)
        _check_sizes(engine, block_size_factor, num_cpu_blocks)
        caches = kv_caches if isinstance(kv_caches, CanonicalKVCaches) else canonicalize_kv_caches(kv_caches)
        gpu_views = _gpu_views(caches)
        cpu_pages = [int(v.shape[1]) * block_size_factor for v in gpu_views]
        slot_bytes = sum(cpu_pages)

        self._own_region = region is None
        region, rank = _host_region(region, num_cpu_blocks, slot_bytes, block_size_factor)
        self.region: HostRegion = region
        self.block_size_factor = block_size_factor
        self.num_cpu_blocks = num_cpu_blocks

        # Which engine serves, with its errors, is decided in Rust (EngineKind::resolve), the same
        # decision the native handlers make below: CudaUnavailableError where CUDA is needed and
        # there is none, else ValueError for tensors that do not fit the choice; the messages name
        # the tensor (its layer) and device. Asked here first because a CUDA engine wants the
        # host region pinned before the handlers are built.
        names = []
        for i, ct in enumerate(caches.tensors):
            names.append(f"canonical tensor {i}{f' ({ct.source})' if ct.source else ''}")
        placements = [v.get_device() if v.is_cuda else None for v in gpu_views]
        use_cuda = _native.resolve_engine(engine, placements, names) == "cuda"
        device = None
        if use_cuda:
            device = gpu_views[0].device
            if region.len_bytes > 0 and not region.is_pinned:
                _pin_or_warn(region, device)

        cpu_tensors = []
        offset = 0
        for nbytes in cpu_pages:
            cpu_tensors.append(region.view(rank, offset, nbytes)[:num_cpu_blocks])
            offset += nbytes
        group_refs = [[(r.tensor_idx, r.page_size_bytes) for r in g] for g in caches.group_data_refs]
        self.gpu_tensors: list[Any] = gpu_views
        self.cpu_tensors: list[Any] = cpu_tensors
        self.kv_caches = caches
        storages = _storage_extents(gpu_views)
        self.gpu_to_cpu_handler = SingleDirectionOffloadingHandler(
            _native.TransferHandler(
                "gpu_to_cpu", gpu_views, cpu_tensors, group_refs, block_size_factor, engine, compute_budget
            ),
            device,
            self.metrics,
            storages,
        )
        self.cpu_to_gpu_handler = SingleDirectionOffloadingHandler(
            _native.TransferHandler(
                "cpu_to_gpu", gpu_views, cpu_tensors, group_refs, block_size_factor, engine, compute_budget
            ),
            device,
            self.metrics,
            storages,
        )

        # Validated by the native handlers above (a fraction in [0, 1] or None).
        self._compute_budget: float | None = None if compute_budget is None else float(compute_budget)

        if use_cuda and stream_handles:
            self._watch_compute_streams(compute_streams, stream_handles, device)

    def _watch_compute_streams(
        self, compute_streams: tuple[Any, ...], stream_handles: list[int], device: Any
    ) -> None:
        """Has both handlers watch ``compute_streams`` (all on ``device``, else ValueError after
        shutting the handlers down)."""
        for st in compute_streams:
            if st.device != device:
                self.shutdown()
                raise ValueError(
                    f"compute_streams: a stream of {st.device}, but the KV caches are on {device}"
                )
        for hd in (self.gpu_to_cpu_handler, self.cpu_to_gpu_handler):
            # Each handler keeps the stream objects alive as long as its engine watches them.
            hd._compute_streams = compute_streams
            hd._native.set_compute_streams(stream_handles)

    @property
    def engine(self) -> str:
        return self.gpu_to_cpu_handler.engine

    @property
    def compute_budget(self) -> float | None:
        """The ``compute_budget`` both handlers were made with (read-only): the model slowdown
        their transfers may cost beside compute, as a fraction (e.g. ``0.02``), or ``None`` for the
        idle-GPU policy. The host engine accepts it and has no use for it."""
        return self._compute_budget

    def shutdown(self) -> None:
        """Drains and stops both handlers, then releases a private region. Idempotent."""
        self.gpu_to_cpu_handler.shutdown()
        self.cpu_to_gpu_handler.shutdown()
        if self._own_region:
            self.region.close()

    def __repr__(self) -> str:
        return (
            f"CpuGpuOffloadingHandlers(tensors={len(self.gpu_tensors)}, block_size_factor="
            f"{self.block_size_factor}, num_cpu_blocks={self.num_cpu_blocks}, engine={self.engine!r})"
        )
