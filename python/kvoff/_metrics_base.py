"""The plumbing of :mod:`kvoff.metrics`: its constants, argument checks, the per-direction counts and
the plain-data families it writes (prometheus_client is imported only when asked for)."""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

__all__ = ["DIRECTIONS", "PROMETHEUS_EXTRA", "SIZE_BUCKETS_BYTES"]

#: Upper bounds (inclusive, ``le``) of the size histogram in bytes: 1, 5, …, 200 MB, then +Inf.
SIZE_BUCKETS_BYTES: tuple[float, ...] = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)

#: Label values of ``transfer_type``, in the order they are written.
DIRECTIONS: tuple[str, str] = ("CPU_to_GPU", "GPU_to_CPU")

#: The install extra that brings ``prometheus_client``: ``pip install '.[prometheus]'`` in a checkout.
PROMETHEUS_EXTRA = "prometheus"

_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_RESERVED_LABELS = frozenset({"transfer_type", "le"})


def _prometheus_client() -> Any:
    """``prometheus_client`` (with the submodules used here), or an ``ImportError`` naming the extra."""
    try:
        import prometheus_client
        import prometheus_client.metrics_core
    except ImportError as e:
        raise ImportError(
            "kvoff's Prometheus collector and metrics server need prometheus_client, which is not "
            f"installed: pip install prometheus_client (or, in a kvoff checkout: pip install '.[{PROMETHEUS_EXTRA}]')"
        ) from e
    return prometheus_client


def _go_float(x: float) -> str:
    """A float as Prometheus' Go client writes it (``1e+06``, ``1.5e+08``, ``1e+10``, ``+Inf``, ``0.25``).

    The same spelling as ``prometheus_client.utils.floatToGoString``.
    """
    x = float(x)
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if math.isnan(x):
        return "NaN"
    s = repr(x)
    dot = s.find(".")
    if x > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _direction(transfer_type: Any) -> str:
    """``("GPU", "CPU")`` / ``"GPU_to_CPU"`` / ``"gpu_to_cpu"`` → ``"GPU_to_CPU"``."""
    if isinstance(transfer_type, str):
        parts = transfer_type.upper().split("_TO_")
    else:
        parts = [str(p).upper() for p in transfer_type]
    if len(parts) != 2 or set(parts) != {"GPU", "CPU"}:
        raise ValueError(
            f"transfer_type must be ('GPU', 'CPU') or ('CPU', 'GPU') (or 'GPU_to_CPU' / 'CPU_to_GPU'), "
            f"got {transfer_type!r}"
        )
    return f"{parts[0]}_to_{parts[1]}"


class _Direction:
    __slots__ = ("bucket_counts", "bytes", "failed", "seconds", "transfers")

    def __init__(self) -> None:
        self.bytes = 0
        self.seconds = 0.0
        self.transfers = 0
        self.failed = 0
        # Non-cumulative counts per bucket; the last one is (200 MB, +Inf).
        self.bucket_counts = [0] * (len(SIZE_BUCKETS_BYTES) + 1)

    def copy(self) -> _Direction:
        c = _Direction()
        c.bytes, c.seconds, c.transfers, c.failed = self.bytes, self.seconds, self.transfers, self.failed
        c.bucket_counts = list(self.bucket_counts)
        return c


class _Family:
    """One metric family as plain data: ``name`` is the family name (counters without ``_total``),
    ``samples`` are ``(sample name, labels, value)``."""

    __slots__ = ("help", "name", "samples", "type")

    def __init__(self, name: str, type_: str, help_: str) -> None:
        self.name = name
        self.type = type_
        self.help = help_
        self.samples: list[tuple[str, dict[str, str], float]] = []


def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not _METRIC_NAME.match(prefix):
        raise ValueError(
            f"prefix must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), got {prefix!r}"
        )
    return prefix


def _checked_size_time(size: Any, secs: Any) -> tuple[int, float]:
    """A transfer's size and time, checked: one bad result must not poison the counters."""
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
        raise TypeError(f"transfer_size must be an int, got {type(size).__name__}")
    n = int(size)
    if not 0 <= n < 1 << 63:
        raise ValueError(f"transfer_size must be in 0..2**63-1 bytes, got {n}")
    if isinstance(secs, bool) or not isinstance(secs, numbers.Real):
        raise TypeError(f"transfer_time must be a number of seconds, got {type(secs).__name__}")
    t = float(secs)
    if not (math.isfinite(t) and t >= 0.0):
        raise ValueError(f"transfer_time must be a finite number of seconds >= 0, got {t}")
    return n, t
