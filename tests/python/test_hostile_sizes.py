"""Absurd sizes and out-of-range integers get a clean ``ValueError`` (docs/spec.md §7), never an abort.

On kvoff 1526e41 ``expand_block_ids([0], 2**36)`` killed the process ("memory allocation of
549755813888 bytes failed", SIGABRT), ``2**62`` gave an internal "capacity overflow" error, ints
≥ 2**63 raised ``OverflowError`` and pointers ≥ 2**63 came back negative. Each call runs in a
child process, so an abort fails the test instead of killing the suite.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    "kvoff.expand_block_ids([0], 2**36)",
    "kvoff.expand_block_ids([0, 1, 2], 2**34)",
    "kvoff.expand_block_ids([0], 2**62)",
    "kvoff.expand_block_ids([0], 2**64 + 5)",
    "kvoff.expand_block_ids([0], 4, skip_count=2**70)",
    "kvoff.expand_block_ids([0], 4, count=2**63)",
    "kvoff.compute_sub_block_ptrs([0], 2**36, 4096, 2**36, 2**36)",
    "kvoff.compute_sub_block_ptrs([0], 2**62, 0, 2**62, 2**62)",
    "kvoff.compute_sub_block_ptrs([1], 1, 2**63, 4096, 4096)",
    "kvoff.compute_sub_block_ptrs([3], 1, 2**62, 2**61, 4096)",
    "kvoff.compute_sub_block_ptrs([0], 1, 2**64 + 1, 4096, 4096)",
    "kvoff.compute_sub_block_ptrs([0], 1, 0, 2**200, 4096)",
    "kvoff.cpu_sizing([2**200], 1, 1, 10**9)",
    "kvoff.cpu_sizing([4096], 2**70, 1, 10**9)",
    "kvoff.cpu_sizing([4096], 1, 2**64, 10**9)",
]


@pytest.mark.parametrize("call", CASES)
def test_absurd_sizes_raise_value_error(call: str) -> None:
    code = f"""
import kvoff
try:
    {call}
except ValueError as e:
    print("ValueError", e)
except Exception as e:
    print("OTHER", type(e).__name__, e)
else:
    print("RETURNED")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, f"process died (rc {p.returncode}): {p.stderr[-2000:]}"
    assert p.stdout.startswith("ValueError"), p.stdout + p.stderr[-2000:]


def test_normal_sizes_still_work() -> None:
    import kvoff

    assert list(kvoff.expand_block_ids([0, 1, 3], 4)) == [*range(8), *range(12, 16)]
    ptrs = kvoff.compute_sub_block_ptrs([7, 2], 3, 1_000_000, 1000, 900, skip_count=2, count=4)
    assert list(ptrs) == [1_000_000 + 7 * 1000 + 600, 1_002_000, 1_002_300, 1_002_600]
