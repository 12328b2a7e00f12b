"""Worker-side functions and host regions through Python (docs/spec.md §3, §4, §5)."""

from __future__ import annotations

import gc
import os
import uuid

import kvoff
import numpy as np
import pytest
from kvoff import (
    ConfigError,
    HostRegion,
    InvalidStateError,
    RegionError,
    compute_sub_block_ptrs,
    expand_block_ids,
)

torch = pytest.importorskip("torch")
PAGE = os.sysconf("SC_PAGE_SIZE")


# --- §3 sizing ---------------------------------------------------------------------------------


def test_sizing_rounds_row_to_page_and_divides_budget():
    s = kvoff.cpu_sizing([1000, 1000], 3, world_size=2, cpu_bytes_to_use=10**6)
    assert s.slot_bytes == 6000
    assert s.row_stride_bytes == -(-12000 // PAGE) * PAGE
    assert s.num_cpu_blocks == 10**6 // s.row_stride_bytes
    assert kvoff.cpu_sizing([PAGE], 1, cpu_bytes_to_use=PAGE * 7 + 1) == (PAGE, PAGE, 7)
    assert kvoff.cpu_sizing([PAGE], 1, cpu_bytes_to_use=64e3 * PAGE).num_cpu_blocks == 64000


@pytest.mark.parametrize("budget", [None, 0, -5, "lots"])
def test_sizing_budget_errors_name_the_key(budget):
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        kvoff.cpu_sizing([4096], 1, cpu_bytes_to_use=budget)
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    ("pages", "f", "w"), [([], 1, 1), ([0], 1, 1), ([16], 0, 1), ([16], 1, 0), ([-1], 1, 1)]
)
def test_sizing_bad_geometry(pages, f, w):
    with pytest.raises(ValueError):
        kvoff.cpu_sizing(pages, f, w, 10**9)


# --- §4 expansion --------------------------------------------------------------------------------


def test_expand_spec_example():
    out = expand_block_ids(np.array([0, 1, 3], dtype=np.int64), 4)
    assert out.dtype == np.int64
    assert out.tolist() == [*range(8), 12, 13, 14, 15]
    assert expand_block_ids([0, 1, 3], 4, skip_count=2, count=3).tolist() == [2, 3, 4]
    assert expand_block_ids([], 4).tolist() == []
    assert expand_block_ids(np.array([5], dtype=np.int32), 2).tolist() == [10, 11]


def test_expand_takes_readonly_and_strided_arrays():
    a = np.arange(10, dtype=np.int64)
    a.flags.writeable = False
    assert expand_block_ids(a, 1).tolist() == list(range(10))
    assert expand_block_ids(np.arange(10, dtype=np.int64)[::3], 2).tolist() == [0, 1, 6, 7, 12, 13, 18, 19]


def test_sub_block_ptrs_spec_example():
    base, r, s = 1 << 20, 4096, 100
    out = compute_sub_block_ptrs(np.array([7, 2]), 3, base, r, 3 * s, skip_count=2, count=4)
    assert out.dtype == np.int64
    assert out.tolist() == [base + 7 * r + 2 * s, base + 2 * r, base + 2 * r + s, base + 2 * r + 2 * s]


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        (([1, 2], 0), ValueError),
        (([1, 2], 2, 2), ValueError),  # skip >= f
        (([1, 2], 2, 1, 4), ValueError),  # count > available
        (([-1], 2), ValueError),
        (([1.5], 2), TypeError),
        ((np.array([1.0]), 2), TypeError),
        ((np.zeros((2, 2), dtype=np.int64), 2), ValueError),
        (("12", 2), TypeError),
        (([1], -1), ValueError),
    ],
)
def test_expand_bad_input(args, exc):
    with pytest.raises(exc):
        expand_block_ids(*args)


def test_sub_block_ptrs_row_not_divisible():
    with pytest.raises(ValueError, match="multiple"):
        compute_sub_block_ptrs([1], 3, 4096, 1000, 1000)


# --- §5 regions ----------------------------------------------------------------------------------


def test_private_region_views_are_zero_copy_strided():
    r = HostRegion.private(5, 3000, world_size=2)
    assert r.rank is None and r.world_size == 2 and r.num_cpu_blocks == 5
    assert r.row_stride_bytes % PAGE == 0 and r.row_stride_bytes >= 6000
    v = r.view(1, 100, 200)
    assert v.dtype == torch.uint8 and tuple(v.shape) == (5, 200)
    assert v.stride() == (r.row_stride_bytes, 1)
    assert v.data_ptr() == r.ptr + 3000 + 100
    v.fill_(9)
    n = r.view_numpy(1, 0, 3000)
    assert n[:, 100:300].min() == 9 and n[:, :100].max() == 0 and n[:, 300:].max() == 0
    assert not r.is_pinned


def test_view_outside_slot_is_value_error():
    r = HostRegion.private(2, 1000)
    with pytest.raises(ValueError, match="slot"):
        r.view(0, 900, 200)
    with pytest.raises(ValueError, match="rank"):
        r.view(1, 0, 10)


def test_close_keeps_views_alive_and_is_idempotent():
    r = HostRegion.private(3, 4096)
    v = r.view(0, 0, 4096)
    v.fill_(3)
    r.close()
    r.close()
    assert r.closed
    assert int(v.sum()) == 3 * 3 * 4096  # the mapping lives until the last view is gone
    with pytest.raises(InvalidStateError):
        r.view(0, 0, 1)
    del v
    gc.collect()
    with HostRegion.private(1, 10) as r2:
        assert not r2.closed
    assert r2.closed


def test_shared_region_two_ranks_see_each_other():
    name = f"kvoff-test-{uuid.uuid4().hex[:12]}"
    a = HostRegion.shared(name, 4, 512, 2, 0, timeout=5.0, unlink_when_all_joined=False)
    b = HostRegion.shared(name, 4, 512, 2, 1, timeout=5.0, unlink_when_all_joined=False)
    try:
        assert a.path == b.path and a.path is not None and a.rank == 0 and b.rank == 1
        a.view(0, 0, 512).fill_(1)
        b.view(1, 0, 512).fill_(2)
        assert int(b.view(0, 0, 512).sum()) == 4 * 512
        assert int(a.view(1, 0, 512).sum()) == 2 * 4 * 512
        assert a.unlink() is True
    finally:
        a.close()
        b.close()


def test_shared_region_join_timeout_names_path_and_size(tmp_path):
    # A stale lock held by nobody and no file: the joiner reports the failed creator or times out.
    name = f"kvoff-test-{uuid.uuid4().hex[:12]}"
    with pytest.raises(RegionError) as ei:
        HostRegion.shared(name, 4, 512, 2, 1, timeout=0.0, directory=str(tmp_path / "missing"))
    assert "missing" in str(ei.value)


def test_region_bad_arguments():
    with pytest.raises(ValueError):
        HostRegion.private(1, 0)
    with pytest.raises(ValueError):
        HostRegion.shared("x/y", 1, 1, 1, 0)
    with pytest.raises(ValueError):
        HostRegion.shared("kvoff-x", 1, 1, 1, 3)
    with pytest.raises(TypeError):
        HostRegion.private("3", 10)


def test_cuda_available_is_bool():
    assert isinstance(kvoff.cuda_available(), bool)
