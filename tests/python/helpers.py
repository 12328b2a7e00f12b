"""Shared helpers of the Python test suite (keys, store shortcuts, state snapshots)."""

from __future__ import annotations

import kvoff
import numpy as np
from kvoff import make_offload_key

POLICIES = ["lru", "arc"]


def K(i: int) -> bytes:
    """The docs/spec.md §2.6 key ``K(i) = make_offload_key(str(i).encode(), 0)``."""
    return make_offload_key(str(i).encode(), 0)


def ks(*ids: int) -> list[bytes]:
    return [K(i) for i in ids]


def ids_of(spec: kvoff.CPULoadStoreSpec) -> list[int]:
    """The block ids of a spec as a list, after checking they are a 1-D int64 numpy array."""
    arr = spec.block_ids
    assert isinstance(arr, np.ndarray)
    assert arr.dtype == np.int64
    assert arr.ndim == 1
    return arr.tolist()


def store(m: kvoff.OffloadingManager, *ids: int):
    """prepare_store of K(ids); returns None or (keys_to_store, block ids, evicted_keys)."""
    out = m.prepare_store(ks(*ids))
    if out is None:
        return None
    return list(out.keys_to_store), ids_of(out.store_spec), list(out.evicted_keys)


def store_complete(m: kvoff.OffloadingManager, *ids: int) -> None:
    assert store(m, *ids) is not None, "the store must fit"
    m.complete_store(ks(*ids))


def snapshot(m: kvoff.OffloadingManager, universe: range = range(20)) -> dict:
    """Everything observable without side effects, plus get_stats (which resets stores_skipped)."""
    return {
        "lists": m.debug_lists(),
        "p": m.arc_target,
        "len": len(m),
        "lookups": [m.lookup(K(i)) for i in universe],
        "stats": m.get_stats(),
    }
