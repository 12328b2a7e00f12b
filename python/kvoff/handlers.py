"""Worker-side transfer handlers (SPEC §3–§6): KV-cache canonicalization, the host allocation and
the two single-direction handlers that move KV blocks between the GPU-side KV caches and host memory.

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

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvoff import _native
from kvoff._native import HostRegion, cuda_available
from kvoff.errors import CudaUnavailableError, KvoffError
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

ENGINES = ("auto", "host", "cuda", "dma", "kernel", "staged", "loop")
_CUDA_ENGINES = frozenset(ENGINES) - {"auto", "host"}


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is installed in the test environments
        raise ImportError("kvoff's transfer handlers need torch: pip install 'kvoff[torch]'") from e
    return torch


# ---------------------------------------------------------------------------------------------
# Sizing (SPEC §3)
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
    """The GPU side of a transfer: GPU block ids ordered group by group (SPEC §4).

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
# Canonical KV caches (SPEC §6)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CanonicalKVCacheTensor:
    """One KV-cache tensor viewed as bytes ``(num_blocks, page_size_bytes)``."""

    tensor: Any
    page_size_bytes: int


@dataclass(frozen=True)
class CanonicalKVCacheRef:
    """One layer of a KV-cache group: copy the first ``page_size_bytes`` (un-padded) bytes of each
    block of tensor ``tensor_idx``."""

    tensor_idx: int
    page_size_bytes: int


@dataclass(frozen=True)
class CanonicalKVCaches:
    """Canonical tensors and, per KV-cache group, the refs of its layers."""

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]] = field(default_factory=list)


def _rest_is_contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def _byte_rows(t: Any, what: str) -> Any:
    """A zero-copy ``torch.uint8`` view ``(num_blocks, page_bytes)`` of a tensor ``(num_blocks, …)``
    whose blocks are each contiguous."""
    torch = _torch()
    shape, stride = tuple(t.shape), tuple(t.stride())
    if len(shape) < 1:
        raise ValueError(f"{what}: a KV-cache tensor needs a num_blocks dimension, got shape {shape}")
    es = t.element_size()
    nb = shape[0]
    page = math.prod(shape[1:]) * es
    if page == 0:
        raise ValueError(f"{what}: shape {tuple(shape)} has empty blocks")
    if not _rest_is_contiguous(shape[1:], stride[1:]):
        raise ValueError(
            f"{what}: the bytes of each block must be contiguous; shape {shape} with strides {stride} "
            f"is not (num_blocks, …) with contiguous blocks"
        )
    row_stride = stride[0] * es if nb > 1 else page
    if nb > 1 and row_stride < page:
        raise ValueError(
            f"{what}: blocks of shape {shape} (strides {stride}) overlap; the first dimension must be "
            f"num_blocks"
        )
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset() * es, (nb, page), (row_stride, 1))
    return out


def _shape_candidates(t: Any) -> set[int]:
    s = tuple(t.shape)
    c = {s[0]} if s else set()
    if len(s) >= 3 and s[0] == 2:
        c.add(s[1])
    return c


def canonicalize_kv_caches(kv_caches: Any, num_blocks: int | None = None) -> CanonicalKVCaches:
    """Canonical byte views of KV-cache tensors (a ``{layer_name: tensor}`` dict or a list).

    Accepted layouts, any dtype (bf16, fp8, int8, … are viewed as bytes), zero-copy:

    - ``(num_blocks, …)``: one canonical tensor, page = bytes of one block (this covers the
      cross-layer layout ``(num_blocks, num_layers, …)`` and FlashInfer's ``(num_blocks, 2, …)``);
    - ``(2, num_blocks, …)`` (FlashAttention's K/V split): K and V become two canonical tensors.

    ``num_blocks`` (the GPU block count shared by all tensors) disambiguates the two; without it,
    it is inferred from the shapes. A shape ``(2, num_blocks, …)`` is always read as the K/V split
    (so with ``num_blocks == 2`` a ``(2, 2, …)`` tensor is K/V). All tensors form one KV-cache group (one ref per canonical tensor).

    Raises:
        ValueError: a shape fits neither layout (the message names it), tensors disagree on
            ``num_blocks``, or a block's bytes are not contiguous.
    """
    torch = _torch()
    if isinstance(kv_caches, dict):
        items = list(kv_caches.items())
    elif isinstance(kv_caches, (list, tuple)):
        items = [(f"kv_caches[{i}]", t) for i, t in enumerate(kv_caches)]
    else:
        raise TypeError(f"kv_caches must be a dict or list of torch tensors, got {type(kv_caches).__name__}")
    if not items:
        raise ValueError("kv_caches is empty: there must be at least one KV-cache tensor")
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError(f"{name}: shape {tuple(t.shape)} has no num_blocks dimension")
    if num_blocks is None:
        common = set.intersection(*(_shape_candidates(t) for _, t in items))
        if not common:
            shapes = ", ".join(f"{n}: {tuple(t.shape)}" for n, t in items)
            raise ValueError(
                f"KV-cache tensors do not share a num_blocks dimension ({shapes}); expected "
                f"(num_blocks, …) or (2, num_blocks, …)"
            )
        # Several candidates only when every tensor is (2, n, …): read that as the K/V split.
        num_blocks = next(iter(common - {2}), 2) if len(common) > 1 else next(iter(common))
    elif isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
    tensors: list[CanonicalKVCacheTensor] = []
    for name, t in items:
        s = tuple(t.shape)
        if len(s) >= 3 and s[0] == 2 and s[1] == num_blocks:
            parts = [(f"{name}[0] (K)", t[0]), (f"{name}[1] (V)", t[1])]
        elif s[0] == num_blocks:
            parts = [(name, t)]
        else:
            raise ValueError(
                f"{name}: shape {s} is neither (num_blocks, …) nor (2, num_blocks, …) with "
                f"num_blocks = {num_blocks}"
            )
        for what, p in parts:
            v = _byte_rows(p, what)
            tensors.append(CanonicalKVCacheTensor(v, int(v.shape[1])))
    refs = [CanonicalKVCacheRef(i, t.page_size_bytes) for i, t in enumerate(tensors)]
    return CanonicalKVCaches(tensors, [refs])


# ---------------------------------------------------------------------------------------------
# Handlers
# ---------------------------------------------------------------------------------------------


class SingleDirectionOffloadingHandler:
    """Transfers of one direction (GPU→CPU stores or CPU→GPU loads); see SPEC §6.

    Jobs run and complete in submission order. On a CUDA engine every transfer is ordered after
    the work already queued on the caller's current CUDA stream. With ``metrics`` (a
    :class:`kvoff.TransferMetrics`), every result returned by :meth:`get_finished` is observed there.
    """

    def __init__(self, native: Any, device: Any = None, metrics: TransferMetrics | None = None) -> None:
        self._native = native
        self.metrics = metrics
        self._store = native.direction == "gpu_to_cpu"
        self._transfer_type: tuple[str, str] = tuple(native.transfer_type)  # type: ignore[assignment]
        self._cuda = native.engine.startswith("cuda")
        self._device = device

    @property
    def transfer_type(self) -> tuple[str, str]:
        """``("GPU", "CPU")`` or ``("CPU", "GPU")``."""
        return self._transfer_type

    @property
    def engine(self) -> str:
        """``"host"`` or ``"cuda:<method>"``."""
        return str(self._native.engine)

    def transfer_async(self, job_id: int, spec: tuple[Any, Any]) -> bool:
        """Validates and enqueues one transfer ``(src_spec, dst_spec)``; returns ``True`` at once.

        Raises:
            ValueError: the specs do not fit the KV caches (ids out of range, ids not consumed
                exactly, duplicate destinations, a busy job id); nothing was enqueued.
            TypeError: the specs are of the wrong kind for this direction.
            InvalidStateError: the handler was shut down.
        """
        try:
            src, dst = spec
        except (TypeError, ValueError):
            raise TypeError("spec must be a (src_spec, dst_spec) pair") from None
        gpu, cpu = (src, dst) if self._store else (dst, src)
        _check_medium(gpu, "GPU", "source" if self._store else "destination")
        _check_medium(cpu, "CPU", "destination" if self._store else "source")
        stream = None
        if self._cuda:
            stream = int(_torch().cuda.current_stream(self._device).cuda_stream)
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
        tt = self._transfer_type
        out = [TransferResult(j, ok, n, t, tt, err) for (j, ok, n, t, err) in self._native.get_finished()]
        if self.metrics is not None and out:
            self.metrics.observe_all(out)
        return out

    def wait(self, job_ids: Iterable[int] | int) -> None:
        """Blocks until the jobs ``job_ids`` finished (unknown ids are ignored); releases the GIL."""
        ids = [job_ids] if isinstance(job_ids, int) else list(job_ids)
        self._native.wait(ids)

    def shutdown(self) -> None:
        """Drains in-flight transfers and stops the engine. Idempotent."""
        self._native.shutdown()

    def __repr__(self) -> str:
        return f"SingleDirectionOffloadingHandler({self._transfer_type}, engine={self.engine!r})"


def _check_medium(spec: Any, medium: str, role: str) -> None:
    if not hasattr(spec, "block_ids"):
        raise TypeError(f"the {role} spec must be a {medium} load/store spec, got {type(spec).__name__}")
    m = getattr(spec, "medium", None)
    if callable(m):
        got = m()
        if str(got).upper() != medium:
            raise TypeError(f"the {role} spec must be a {medium} spec, got a {got} spec ({type(spec).__name__})")


class CpuGpuOffloadingHandlers:
    """Store and load handlers between GPU-side KV caches and a host allocation (SPEC §6).

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

    Raises:
        CudaUnavailableError: a CUDA engine was asked for without CUDA.
        ValueError: bad shapes, devices, sizes; the region is too small.
    """

    def __init__(
        self,
        kv_caches: Any,
        block_size_factor: int,
        num_cpu_blocks: int,
        region: HostRegion | None = None,
        engine: str = "auto",
        metrics: TransferMetrics | None = None,
    ) -> None:
        torch = _torch()
        if metrics is not None and not isinstance(metrics, TransferMetrics):
            raise TypeError(f"metrics must be a kvoff.TransferMetrics or None, got {type(metrics).__name__}")
        self.metrics: TransferMetrics = TransferMetrics() if metrics is None else metrics
        if not isinstance(engine, str) or engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; valid choices: {list(ENGINES)}")
        for name, v in (("block_size_factor", block_size_factor), ("num_cpu_blocks", num_cpu_blocks)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if block_size_factor < 1:
            raise ValueError(f"block_size_factor must be >= 1, got {block_size_factor}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        caches = kv_caches if isinstance(kv_caches, CanonicalKVCaches) else canonicalize_kv_caches(kv_caches)
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
        cpu_pages = [int(v.shape[1]) * block_size_factor for v in gpu_views]
        slot_bytes = sum(cpu_pages)

        self._own_region = region is None
        if region is None:
            region = HostRegion.private(num_cpu_blocks, slot_bytes)
            rank = 0
        else:
            if not isinstance(region, HostRegion):
                raise TypeError(f"region must be a kvoff.HostRegion, got {type(region).__name__}")
            rank = region.rank or 0
            if region.num_cpu_blocks < num_cpu_blocks:
                raise ValueError(
                    f"the region holds {region.num_cpu_blocks} CPU blocks but num_cpu_blocks = "
                    f"{num_cpu_blocks}"
                )
            if region.slot_bytes < slot_bytes:
                raise ValueError(
                    f"the region's slot ({region.slot_bytes} bytes per rank per block) is smaller than "
                    f"one CPU block of these KV caches ({slot_bytes} bytes = Σ page × factor "
                    f"{block_size_factor}); size it with kvoff.cpu_sizing"
                )
        self.region: HostRegion = region
        self.block_size_factor = block_size_factor
        self.num_cpu_blocks = num_cpu_blocks

        gpu_is_cuda = any(v.is_cuda for v in gpu_views)
        use_cuda = engine in _CUDA_ENGINES or (engine == "auto" and gpu_is_cuda)
        device = None
        if use_cuda:
            if not cuda_available():
                raise CudaUnavailableError(
                    f"engine {engine!r} needs CUDA, but kvoff found no CUDA driver or device; "
                    f"use engine='auto' or 'host'"
                )
            device = gpu_views[0].device if gpu_is_cuda else None
            if region.len_bytes > 0 and not region.is_pinned:
                ordinal = device.index if device is not None and device.index is not None else 0
                try:
                    region.pin(ordinal)
                except KvoffError as e:
                    warnings.warn(
                        f"kvoff: could not pin the host region ({e}); transfers use unpinned memory "
                        f"(slower; the 'kernel' method is unavailable)",
                        RuntimeWarning,
                        stacklevel=2,
                    )

        cpu_tensors = []
        offset = 0
        for nbytes in cpu_pages:
            cpu_tensors.append(region.view(rank, offset, nbytes)[:num_cpu_blocks])
            offset += nbytes
        group_refs = [[(r.tensor_idx, r.page_size_bytes) for r in g] for g in caches.group_data_refs]
        self.gpu_tensors: list[Any] = gpu_views
        self.cpu_tensors: list[Any] = cpu_tensors
        self.kv_caches = caches
        self.gpu_to_cpu_handler = SingleDirectionOffloadingHandler(
            _native.TransferHandler("gpu_to_cpu", gpu_views, cpu_tensors, group_refs, block_size_factor, engine),
            device,
            self.metrics,
        )
        self.cpu_to_gpu_handler = SingleDirectionOffloadingHandler(
            _native.TransferHandler("cpu_to_gpu", gpu_views, cpu_tensors, group_refs, block_size_factor, engine),
            device,
            self.metrics,
        )

    @property
    def engine(self) -> str:
        return self.gpu_to_cpu_handler.engine

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

