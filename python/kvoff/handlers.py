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
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvoff import _native
from kvoff._native import HostRegion, cuda_available
from kvoff.errors import CudaUnavailableError, InvalidStateError, KvoffError
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
    """One KV-cache tensor viewed as bytes ``(num_blocks, page_size_bytes)``: a ``torch.uint8`` view
    whose rows are the blocks (the row stride is the tensor's ``stride(0)``, which may exceed the page
    when blocks are padded). The view shares, and so keeps alive, the engine tensor's storage.
    ``source`` describes where it came from (for messages; ``""`` when built by hand)."""

    tensor: Any
    page_size_bytes: int
    source: str = field(default="", compare=False)


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


#: A block that is not one contiguous run of bytes is split into at most this many canonical tensors.
MAX_PARTS_PER_BLOCK = 64


def _describe(t: Any) -> str:
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{dtype} shape {tuple(t.shape)} strides {tuple(t.stride())} on {t.device}"


def _block_runs(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, list[int]] | None:
    """How one block (dims ``shape``/``stride`` after ``num_blocks``) lies in memory: ``(run, offsets)``
    — equal contiguous runs of ``run`` elements at element ``offsets`` — or ``None`` when its
    innermost elements are not contiguous or it repeats memory (a zero stride)."""
    merged: list[tuple[int, int]] = []  # (size, stride), inner → outer, adjacent contiguous dims merged
    for size, st in zip(reversed(shape), reversed(stride)):
        if size == 1:
            continue
        if merged and st == merged[-1][0] * merged[-1][1]:
            merged[-1] = (merged[-1][0] * size, merged[-1][1])
        else:
            merged.append((size, st))
    if not merged:
        return 1, [0]
    run, inner_stride = merged[0]
    if inner_stride != 1 or any(st == 0 for _, st in merged[1:]):
        return None
    offsets = [0]
    for size, st in merged[1:]:
        offsets = [o + i * st for i in range(size) for o in offsets]
    return run, sorted(offsets)


def _byte_rows(t: Any, what: str) -> Any:
    """A zero-copy ``torch.uint8`` view ``(num_blocks, page_bytes)`` of a tensor ``(num_blocks, …)``
    whose blocks are each contiguous."""
    views = _block_views(t, what, max_parts=1)
    return views[0][1]


def _block_views(t: Any, what: str, max_parts: int = MAX_PARTS_PER_BLOCK) -> list[tuple[str, Any]]:
    """Zero-copy ``torch.uint8`` views ``(num_blocks, run_bytes)`` of a tensor ``(num_blocks, …)``:
    one per contiguous run of a block (one when each block is contiguous; padding between runs,
    e.g. a view ``base[:, :, :k]``, is left out), rows ``stride(0)`` apart."""
    torch = _torch()
    shape, stride = tuple(t.shape), tuple(t.stride())
    if len(shape) < 1:
        raise ValueError(f"{what}: a KV-cache tensor needs a num_blocks dimension, got shape {shape}")
    es = t.element_size()
    nb = shape[0]
    if math.prod(shape[1:]) == 0:
        raise ValueError(f"{what}: shape {shape} has empty blocks")
    runs = _block_runs(shape[1:], stride[1:])
    if runs is None or len(runs[1]) > max_parts:
        raise ValueError(
            f"{what}: {_describe(t)} cannot be viewed as (num_blocks, page) bytes: the bytes of a "
            f"block must be contiguous"
            + ("" if max_parts == 1 else f" or at most {max_parts} equal contiguous runs")
        )
    run, offsets = runs
    extent = (offsets[-1] + run) * es
    row_stride = stride[0] * es if nb > 1 else extent
    if nb > 1 and row_stride < extent:
        raise ValueError(
            f"{what}: blocks of {_describe(t)} overlap (a block spans {extent} bytes, blocks are "
            f"{row_stride} bytes apart); the first dimension must be num_blocks"
        )
    out = []
    for k, off in enumerate(offsets):
        v = torch.empty(0, dtype=torch.uint8, device=t.device)
        v.set_(t.untyped_storage(), (t.storage_offset() + off) * es, (nb, run * es), (row_stride, 1))
        out.append((what if len(offsets) == 1 else f"{what} run {k}", v))
    return out


def _shape_candidates(t: Any) -> set[int]:
    s = tuple(t.shape)
    c = {s[0]} if s else set()
    if len(s) >= 3 and s[0] == 2:
        c.add(s[1])
    return c


def _group_lists(groups: Any, keys: list[Any], is_dict: bool) -> list[list[Any]]:
    """``groups`` (None, a list of lists of layer keys, or a dict group → list of layer keys) as a
    list of lists of layer keys that covers every layer exactly once."""
    if groups is None:
        return [list(keys)]
    if isinstance(groups, Mapping):
        lists = list(groups.values())
    elif isinstance(groups, (list, tuple)):
        lists = list(groups)
    else:
        raise TypeError(f"groups must be a list of lists of layer names or a dict group -> layer names, "
                        f"got {type(groups).__name__}")
    known = set(keys)
    seen: dict[Any, int] = {}
    out: list[list[Any]] = []
    for g, layers in enumerate(lists):
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
            raise TypeError(f"groups[{g}] must be a list of layer names, got {type(layers).__name__}")
        layers = list(layers)
        for layer in layers:
            if layer not in known:
                valid = "dict keys of kv_caches" if is_dict else f"indices 0..{len(keys) - 1} of kv_caches"
                raise ValueError(f"groups[{g}] names unknown layer {layer!r}; layers are the {valid}")
            if layer in seen:
                raise ValueError(f"layer {layer!r} is in KV-cache groups {seen[layer]} and {g}; a layer "
                                 f"belongs to one group")
            seen[layer] = g
        out.append(layers)
    missing = [k for k in keys if k not in seen]
    if missing:
        raise ValueError(f"layers {missing!r} are in no KV-cache group; every layer of kv_caches must be "
                         f"in one of groups")
    return out


class _Entry:
    """A canonical tensor being built: its widest view and the layer parts that use it."""

    __slots__ = ("owners", "ptr", "row_stride", "view")

    def __init__(self, view: Any, ptr: int, row_stride: int) -> None:
        self.view = view
        self.ptr = ptr
        self.row_stride = row_stride
        self.owners: list[tuple[int, str]] = []  # (group, description)

    @property
    def width(self) -> int:
        return int(self.view.shape[1])

    def span(self) -> tuple[int, int]:
        nb = int(self.view.shape[0])
        return self.ptr, self.ptr + (nb - 1) * self.row_stride + self.width if nb else self.ptr

    def disjoint_from(self, o: _Entry) -> bool:
        (a0, a1), (b0, b1) = self.span(), o.span()
        if a1 <= b0 or b1 <= a0:
            return True
        s = self.row_stride
        if s != o.row_stride or s <= 0 or self.width > s or o.width > s:
            return False
        d = (o.ptr - self.ptr) % s  # o's column start after self's, on a circle of circumference s
        return d >= self.width and s - d >= o.width


def canonicalize_kv_caches(
    kv_caches: Any, num_blocks: int | None = None, *, groups: Any = None
) -> CanonicalKVCaches:
    """Canonical byte views of an engine's KV-cache tensors (a ``{layer_name: tensor}`` dict or a list).

    Every tensor becomes one or more zero-copy ``torch.uint8`` views ``(num_blocks, page)`` whose
    rows are ``stride(0)`` apart; any element type (bf16, fp16, fp8 ``float8_e4m3fn``, int8, …) is
    just bytes. Accepted layouts per tensor (``num_blocks`` is shared by all tensors):

    - ``(num_blocks, …)``, at least 2-D: one canonical tensor, page = the bytes of one block. This
      covers FlashInfer's ``(num_blocks, 2, block_size, heads, head_dim)`` (page = K and V), MLA's
      ``(num_blocks, block_size, dim)`` and the cross-layer ``(num_blocks, num_layers, 2, …)``;
    - ``(2, num_blocks, …)``, at least 3-D (FlashAttention's K/V split): K and V become two
      canonical tensors (also when they interleave block by block in memory);
    - **padded pages**: ``stride(0)`` larger than a block (e.g. ``base[:, :k]``, or pages padded to a
      common size): the page is the un-padded bytes, the padding is never copied. A block made of
      several equal contiguous runs (e.g. ``base[:, :, :k]``) is split into one canonical tensor per
      run (at most ``MAX_PARTS_PER_BLOCK``), so the padding between runs is not copied either.

    ``num_blocks`` disambiguates ``(2, n, …)``; without it, it is inferred from the shapes (a
    ``(2, n, …)`` tensor is read as the K/V split when every tensor allows both readings).

    ``groups`` says which layers form each KV-cache group (layers of different groups have different
    block tables, e.g. full-attention and sliding-window layers): a list of lists of layer names
    (dict keys; list indices for a list), or a dict ``group -> layer names`` (in its order). Every
    layer must be in exactly one group; ``None`` = one group of all layers. ``group_data_refs[g]``
    then lists, for each layer of group ``g`` in the given order, one ref per canonical tensor of the
    layer (K before V). Layers of *different* groups may share memory (vLLM's hybrid allocator: one
    tensor ``shared_by`` a layer of each group): identical views (same address and row stride)
    become one canonical tensor with page = the widest, and each ref copies its own layer's page.

    The views share the engine tensors' storages, so the memory stays valid as long as the result
    (or a handler built on it) is alive, even after the caller drops its own references.

    Raises:
        TypeError: ``kv_caches`` is not a dict/list of tensors; ``groups`` is malformed.
        ValueError: an unknown layout (a 0-/1-D tensor, a shape fitting neither layout, tensors that
            disagree on ``num_blocks``), block bytes that cannot be viewed as ``(num_blocks, page)``
            (e.g. transposed), tensors on different devices or not on ``cpu``/``cuda``, two layers
            whose views overlap (or share memory within one group), an unknown or missing layer in
            ``groups``. Messages name the layer, dtype, shape, strides and device.
    """
    torch = _torch()
    is_dict = isinstance(kv_caches, Mapping)
    if is_dict:
        items = [(k, str(k), t) for k, t in kv_caches.items()]
    elif isinstance(kv_caches, (list, tuple)):
        items = [(i, f"kv_caches[{i}]", t) for i, t in enumerate(kv_caches)]
    else:
        raise TypeError(f"kv_caches must be a dict or list of torch tensors, got {type(kv_caches).__name__}")
    if not items:
        raise ValueError("kv_caches is empty: there must be at least one KV-cache tensor")
    for _, name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(
                f"{name}: shape {tuple(t.shape)} is not a KV-cache layout; expected (num_blocks, …) or "
                f"(2, num_blocks, …) with at least 2 dimensions"
            )
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name}: {_describe(t)}: KV caches must be on a cuda (or cpu) device")
    first = items[0]
    for _, name, t in items[1:]:
        if t.device != first[2].device:
            raise ValueError(
                f"KV caches are on different devices ({first[1]} on {first[2].device}, {name} on "
                f"{t.device}); one set of handlers serves one device"
            )
    if num_blocks is None:
        common = set.intersection(*(_shape_candidates(t) for _, _, t in items))
        if not common:
            shapes = ", ".join(f"{n}: {tuple(t.shape)}" for _, n, t in items)
            raise ValueError(
                f"KV-cache tensors do not share a num_blocks dimension ({shapes}); expected "
                f"(num_blocks, …) or (2, num_blocks, …)"
            )
        # Several candidates only when every tensor is (2, n, …): read that as the K/V split.
        num_blocks = next(iter(common - {2}), 2) if len(common) > 1 else next(iter(common))
    elif isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
    group_lists = _group_lists(groups, [k for k, _, _ in items], is_dict)
    group_of = {k: g for g, layers in enumerate(group_lists) for k in layers}

    entries: list[_Entry] = []
    by_key: dict[tuple[int, int, int], int] = {}
    layer_parts: dict[Any, list[tuple[int, int]]] = {}  # layer → [(entry index, page bytes)]
    for key, name, t in items:
        s = tuple(t.shape)
        if len(s) >= 3 and s[0] == 2 and s[1] == num_blocks:
            halves = [(f"{name}[0] (K)", t[0]), (f"{name}[1] (V)", t[1])]
        elif s[0] == num_blocks:
            halves = [(name, t)]
        else:
            raise ValueError(
                f"{name}: {_describe(t)} is neither (num_blocks, …) nor (2, num_blocks, …) with "
                f"num_blocks = {num_blocks}"
            )
        g = group_of[key]
        parts = []
        for what, half in halves:
            for desc, v in _block_views(half, what):
                ptr = int(v.data_ptr())
                row_stride = int(v.stride(0)) if num_blocks > 1 else int(v.shape[1])
                desc = f"{desc} ({_describe(t)})"
                k = (ptr, row_stride, int(v.shape[0]))
                idx = by_key.get(k)
                if idx is None:
                    idx = by_key[k] = len(entries)
                    entries.append(_Entry(v, ptr, row_stride))
                e = entries[idx]
                same = [d for og, d in e.owners if og == g]
                if same:
                    raise ValueError(
                        f"{desc} and {same[0]} view the same memory; the layers of one KV-cache group "
                        f"need their own bytes (layers of different groups may share a tensor: pass "
                        f"groups=...)"
                    )
                if v.shape[1] > e.width:
                    e.view = v
                e.owners.append((g, desc))
                parts.append((idx, int(v.shape[1])))
        layer_parts[key] = parts
    order = sorted(range(len(entries)), key=lambda i: entries[i].span())
    for n, i in enumerate(order):
        a = entries[i]
        for j in order[n + 1 :]:
            b = entries[j]
            if b.span()[0] >= a.span()[1]:
                break
            if not a.disjoint_from(b):
                raise ValueError(
                    f"{a.owners[0][1]} and {b.owners[0][1]} overlap in memory; every layer's KV cache "
                    f"must have its own bytes (or be the identical view of a layer of another group)"
                )
    tensors = [
        CanonicalKVCacheTensor(e.view, e.width, "; ".join(d for _, d in e.owners)) for e in entries
    ]
    refs = [
        [CanonicalKVCacheRef(idx, page) for layer in layers for idx, page in layer_parts[layer]]
        for layers in group_lists
    ]
    return CanonicalKVCaches(tensors, refs)


# ---------------------------------------------------------------------------------------------
# Handlers
# ---------------------------------------------------------------------------------------------


class SingleDirectionOffloadingHandler:
    """Transfers of one direction (GPU→CPU stores or CPU→GPU loads); see SPEC §6.

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
        self._check_process()
        self._check_storages()
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
        compute_budget: the model slowdown that transfers running beside it may cost, as a
            fraction of a compute-bound kernel's time (default 0.02 = 2%; a memory-bound kernel
            sees about 2.5× that), used by the CUDA engine's ``"auto"``/``"cuda"`` choice: batched
            DMA for copies ≥ 32 KiB, else the copy kernel on a few CTAs in short launches, at the
            lowest stream priority. ``None``: the idle-GPU policy (fastest method, may slow the
            model by 10–200%; BENCHMARKS.md).

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
        engine: str = "auto",
        metrics: TransferMetrics | None = None,
        compute_budget: float | None = 0.02,
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
            # A CUDA engine with non-CUDA KV caches: CudaUnavailableError where there is no CUDA at
            # all (the request cannot be served here whatever the tensors), else ValueError (the
            # tensors are wrong); both messages name the tensor and its device.
            off_gpu = next((i for i, v in enumerate(gpu_views) if not v.is_cuda), None)
            where = ""
            if off_gpu is not None:
                src = caches.tensors[off_gpu].source
                where = (
                    f"canonical tensor {off_gpu}{f' ({src})' if src else ''} is on "
                    f"{gpu_views[off_gpu].device}"
                )
            if not cuda_available():
                raise CudaUnavailableError(
                    f"engine {engine!r} needs CUDA, but kvoff found no CUDA driver or device"
                    f"{f' (and {where})' if where else ''}; use engine='auto' or 'host'"
                )
            if where:
                raise ValueError(
                    f"engine {engine!r} copies between CUDA device memory and host memory, but {where}; "
                    f"use engine='host' (or 'auto') for CPU tensors"
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

