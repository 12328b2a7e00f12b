"""Type names of kvoff's closed sets of names, for type checkers.

The runtime lists are ``kvoff._native.POLICIES``, ``kvoff._native.ENGINES`` and
``kvoff._native.DIRECT_IO``, taken from the Rust enums ``PolicyKind``, ``EngineKind`` and
``DirectIo``; a type checker cannot read those, so the ``Literal`` types spell them out here, and
``tests/python/test_manager_errors.py`` checks that both agree.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

__all__ = ["DirectIoName", "Direction", "EngineName", "PolicyName"]

#: An eviction policy (``PolicyKind``).
PolicyName: TypeAlias = Literal["lru", "arc"]
#: An ``engine=`` choice of the transfer handlers (``EngineKind``).
EngineName: TypeAlias = Literal["auto", "host", "cuda", "dma", "kernel", "staged", "loop"]
#: A transfer direction.
Direction: TypeAlias = Literal["gpu_to_cpu", "cpu_to_gpu"]
#: The file tier's ``direct_io`` setting (``DirectIo``).
DirectIoName: TypeAlias = Literal["auto", "on", "off"]
