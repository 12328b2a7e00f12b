"""Exception classes of kvoff (docs/spec.md §7).

``KvoffError`` is the base of everything kvoff raises on its own; invalid arguments raise the
built-in ``ValueError``/``TypeError`` (``ConfigError`` is both a ``KvoffError`` and a ``ValueError``).
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "CudaError",
    "CudaUnavailableError",
    "InvalidStateError",
    "KvoffError",
    "RegionError",
]


class KvoffError(Exception):
    """Base class of kvoff's own errors."""


class InvalidStateError(KvoffError):
    """A call is not valid in the object's current state (key not ready, object shut down, ...)."""


class ConfigError(KvoffError, ValueError):
    """A configuration value is missing or invalid; the message names the key to set."""


class RegionError(KvoffError):
    """A host memory region could not be created, joined, sized or mapped."""


class CudaUnavailableError(KvoffError):
    """CUDA was requested but there is no usable driver or device."""


class CudaError(KvoffError):
    """A CUDA call failed."""
