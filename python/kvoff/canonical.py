"""Canonical KV caches (docs/spec.md §6): an engine's KV-cache tensors, whatever their layout, as byte
views ``(num_blocks, page_size_bytes)`` whose rows are the blocks, plus the groups' layer refs.

:func:`canonicalize_kv_caches` accepts the layouts engines use (vLLM's flash-attention
``(2, num_blocks, …)``, block-first ``(num_blocks, 2, …)``, MLA, padded blocks, hybrid models with
several KV-cache groups, fp8), splits a block that is not one contiguous run into at most
``MAX_PARTS_PER_BLOCK`` tensors, and checks that no two canonical tensors share a byte. The
transfer handlers (:mod:`kvoff.handlers`) take its result. torch is imported lazily.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_PARTS_PER_BLOCK",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "canonicalize_kv_caches",
]


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is installed in the test environments
        raise ImportError(
            "kvoff's KV-cache canonicalization needs torch: pip install torch "
            "(or, in a kvoff checkout: pip install '.[torch]')"
        ) from e
    return torch


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
    for size, st in zip(reversed(shape), reversed(stride), strict=True):
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
        raise TypeError(
            f"groups must be a list of lists of layer names or a dict group -> layer names, "
            f"got {type(groups).__name__}"
        )
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
                raise ValueError(
                    f"layer {layer!r} is in KV-cache groups {seen[layer]} and {g}; a layer "
                    f"belongs to one group"
                )
            seen[layer] = g
        out.append(layers)
    missing = [k for k in keys if k not in seen]
    if missing:
        raise ValueError(
            f"layers {missing!r} are in no KV-cache group; every layer of kv_caches must be in one of groups"
        )
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
    items, is_dict = _cache_items(kv_caches)
    num_blocks = _common_num_blocks(items, num_blocks)
    group_lists = _group_lists(groups, [k for k, _, _ in items], is_dict)
    group_of = {k: g for g, layers in enumerate(group_lists) for k in layers}

    entries: list[_Entry] = []
    by_key: dict[tuple[int, int, int], int] = {}
    layer_parts: dict[Any, list[tuple[int, int]]] = {}  # layer → [(entry index, page bytes)]
    for key, name, t in items:
        layer_parts[key] = _add_layer_views(entries, by_key, name, t, num_blocks, group_of[key])
    _check_disjoint(entries)
    tensors = [CanonicalKVCacheTensor(e.view, e.width, "; ".join(d for _, d in e.owners)) for e in entries]
    refs = [
        [CanonicalKVCacheRef(idx, page) for layer in layers for idx, page in layer_parts[layer]]
        for layers in group_lists
    ]
    return CanonicalKVCaches(tensors, refs)


def _cache_items(kv_caches: Any) -> tuple[list[tuple[Any, str, Any]], bool]:
    """``(key, name, tensor)`` of each KV-cache tensor and whether ``kv_caches`` is a dict, checked:
    torch tensors of at least 2 dimensions, all on one cpu or cuda device."""
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
    return items, is_dict


def _common_num_blocks(items: list[tuple[Any, str, Any]], num_blocks: Any) -> int:
    """``num_blocks`` checked, or (``None``) the one the tensors' shapes share."""
    if num_blocks is None:
        common = set.intersection(*(_shape_candidates(t) for _, _, t in items))
        if not common:
            shapes = ", ".join(f"{n}: {tuple(t.shape)}" for _, n, t in items)
            raise ValueError(
                f"KV-cache tensors do not share a num_blocks dimension ({shapes}); expected "
                f"(num_blocks, …) or (2, num_blocks, …)"
            )
        # Several candidates only when every tensor is (2, n, …): read that as the K/V split.
        return next(iter(common - {2}), 2) if len(common) > 1 else next(iter(common))
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
    return num_blocks


def _layer_halves(name: str, t: Any, num_blocks: int) -> list[tuple[str, Any]]:
    """The layer's ``(num_blocks, …)`` tensors with their names: K and V of a ``(2, num_blocks, …)``
    tensor, else the tensor itself."""
    s = tuple(t.shape)
    if len(s) >= 3 and s[0] == 2 and s[1] == num_blocks:
        return [(f"{name}[0] (K)", t[0]), (f"{name}[1] (V)", t[1])]
    if s[0] == num_blocks:
        return [(name, t)]
    raise ValueError(
        f"{name}: {_describe(t)} is neither (num_blocks, …) nor (2, num_blocks, …) with "
        f"num_blocks = {num_blocks}"
    )


def _add_layer_views(
    entries: list[_Entry],
    by_key: dict[tuple[int, int, int], int],
    name: str,
    t: Any,
    num_blocks: int,
    g: int,
) -> list[tuple[int, int]]:
    """Adds the block views of layer ``name`` (tensor ``t``, group ``g``) to ``entries`` (an
    identical view of a layer of another group joins its entry) and returns the layer's
    ``(entry index, page bytes)``, K before V."""
    parts = []
    for what, half in _layer_halves(name, t, num_blocks):
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
    return parts


def _check_disjoint(entries: list[_Entry]) -> None:
    """ValueError when two canonical tensors overlap in memory (sweep in address order)."""
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
