"""docs/spec.md §1: offload keys = block hash bytes + group index as 4-byte big-endian unsigned."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvoff import get_offload_block_hash, get_offload_group_idx, make_offload_key

U32_MAX = 2**32 - 1


@pytest.mark.parametrize(
    ("block_hash", "group_idx"),
    [(b"", 0), (b"abc", 1), (b"\x00" * 32, 7), (b"h" * 100, U32_MAX), (b"1", 256)],
)
def test_round_trip(block_hash: bytes, group_idx: int) -> None:
    key = make_offload_key(block_hash, group_idx)
    assert isinstance(key, bytes)
    assert len(key) == len(block_hash) + 4
    assert get_offload_block_hash(key) == block_hash
    assert get_offload_group_idx(key) == group_idx
    assert isinstance(get_offload_group_idx(key), int)


def test_layout_is_hash_then_big_endian_group() -> None:
    assert make_offload_key(b"ab", 0x01020304) == b"ab\x01\x02\x03\x04"
    assert make_offload_key(b"1", 0) == b"1\x00\x00\x00\x00"
    assert get_offload_group_idx(b"\xff\xff\xff\xff") == U32_MAX
    assert get_offload_block_hash(b"\x00\x00\x00\x05") == b""


@given(st.binary(max_size=64), st.integers(0, U32_MAX))
def test_round_trip_property(block_hash: bytes, group_idx: int) -> None:
    key = make_offload_key(block_hash, group_idx)
    assert get_offload_block_hash(key) == block_hash
    assert get_offload_group_idx(key) == group_idx
    assert key == block_hash + group_idx.to_bytes(4, "big")


@given(st.binary(min_size=4, max_size=64))
def test_split_then_make_is_identity(key: bytes) -> None:
    assert make_offload_key(get_offload_block_hash(key), get_offload_group_idx(key)) == key


def test_distinct_groups_give_distinct_keys() -> None:
    assert make_offload_key(b"h", 0) != make_offload_key(b"h", 1)


@pytest.mark.parametrize("group_idx", [-1, 2**32, 2**32 + 5, 2**63, -(2**63)])
def test_group_idx_out_of_range_is_value_error(group_idx: int) -> None:
    with pytest.raises(ValueError):
        make_offload_key(b"h", group_idx)


@pytest.mark.parametrize("group_idx", [2**200, -(2**200)])
def test_huge_group_idx_is_value_error(group_idx: int) -> None:
    with pytest.raises(ValueError):
        make_offload_key(b"h", group_idx)


@pytest.mark.parametrize("key", [b"", b"a", b"ab", b"abc"])
def test_short_key_is_value_error(key: bytes) -> None:
    with pytest.raises(ValueError):
        get_offload_group_idx(key)
    with pytest.raises(ValueError):
        get_offload_block_hash(key)


@pytest.mark.parametrize("block_hash", ["abc", 1, None, bytearray(b"abc"), [1, 2], memoryview(b"ab")])
def test_non_bytes_hash_is_type_error(block_hash: object) -> None:
    with pytest.raises(TypeError):
        make_offload_key(block_hash, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("group_idx", [1.0, 0.5, "1", None, b"\x00", [0]])
def test_non_int_group_is_type_error(group_idx: object) -> None:
    with pytest.raises(TypeError):
        make_offload_key(b"h", group_idx)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["abcd", 1234, None, bytearray(b"abcd"), [b"abcd"]])
def test_non_bytes_key_is_type_error(key: object) -> None:
    with pytest.raises(TypeError):
        get_offload_group_idx(key)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        get_offload_block_hash(key)  # type: ignore[arg-type]
