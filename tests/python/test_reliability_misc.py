"""Small reliability defects of kvoff 1526e41 (issue #11, item 8), each a clean error now."""

from __future__ import annotations

import kvoff
import pytest


def test_shared_region_timeout_must_be_a_number_not_a_bool() -> None:
    with pytest.raises(TypeError, match="timeout must be a number of seconds"):
        kvoff.HostRegion.shared("kvoff-test-bool-timeout", 1, 4096, 1, 0, timeout=True)
    with pytest.raises(TypeError, match="timeout must be a number of seconds"):
        kvoff.HostRegion.shared("kvoff-test-str-timeout", 1, 4096, 1, 0, timeout="5")


def test_shared_region_empty_directory_is_rejected() -> None:
    with pytest.raises(ValueError, match="directory must name a directory"):
        kvoff.HostRegion.shared("kvoff-test-empty-dir", 1, 4096, 1, 0, directory="")


def test_transfer_metrics_rejects_a_non_manager_at_construction() -> None:
    with pytest.raises(TypeError, match="manager must be a kvoff manager"):
        kvoff.TransferMetrics("x")
    kvoff.TransferMetrics(kvoff.create_manager("lru", 2))  # a manager is fine


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_every_accessor_raises_after_shutdown(policy: str) -> None:
    m = kvoff.create_manager(policy, 4)
    m.shutdown()
    m.shutdown()  # idempotent
    for call in (len, lambda m: m.num_blocks, repr, lambda m: m.debug_lists(), lambda m: m.arc_target):
        with pytest.raises(kvoff.InvalidStateError, match="shut down"):
            call(m)
    assert m.policy == policy  # a constant of the class, not state
