"""Transfer metrics (docs/spec.md §8): per-direction bytes, seconds, transfer counts and a size histogram,
exposed as a dict or in the Prometheus text exposition format (version 0.0.4), optionally over HTTP.

::

    m = kvoff.TransferMetrics()
    h = kvoff.CpuGpuOffloadingHandlers(kv_caches, 1, num_cpu_blocks, metrics=m)   # observed for you
    m.attach_manager(manager)           # adds kvoff_cache_* usage gauges from manager.get_stats()
    server = kvoff.serve_metrics(m, port=9400)                  # GET http://127.0.0.1:9400/metrics
    ...
    server.close()

Names (``prefix="kvoff"``), each with the label ``transfer_type="GPU_to_CPU"|"CPU_to_GPU"``:

==================================  =========  ==========================================================
``kvoff_offload_total_bytes``       counter    bytes moved by successful transfers
``kvoff_offload_total_time``        counter    seconds spent in successful transfers (device-timed)
``kvoff_offload_transfers``         counter    successful transfers
``kvoff_offload_failed_transfers``  counter    failed transfers (not in the other series)
``kvoff_offload_size``              histogram  bytes per successful transfer; buckets 1, 5, 10, 20, 40,
                                               60, 80, 100, 150, 200 MB (1 MB = 10^6 bytes, as vLLM)
==================================  =========  ==========================================================

With a manager attached: gauges ``kvoff_cache_usage``, ``kvoff_cache_write_usage``,
``kvoff_cache_read_usage`` (fractions of the capacity, docs/spec.md §2.2), ``kvoff_cache_blocks``,
``kvoff_cache_blocks_present``, ``kvoff_cache_blocks_free``, ``kvoff_cache_blocks_evictable`` and the
counter ``kvoff_cache_stores_skipped``. Reading them calls ``manager.get_stats()``, which resets the
manager's own ``stores_skipped`` counter; this object accumulates it, so read it from here only.

Inside vLLM the same figures are reported under vLLM's own names (``vllm:kv_offload_total_bytes``,
``vllm:kv_offload_total_time``, ``vllm:kv_offload_size``) by vLLM's metrics machinery; this module is
for standalone use. Counters are written without the ``_total`` suffix that OpenMetrics would add, with
the names above. All methods are thread-safe (the HTTP endpoint reads from its own thread).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["DIRECTIONS", "SIZE_BUCKETS_BYTES", "MetricsServer", "TransferMetrics", "serve_metrics"]

#: Upper bounds (inclusive, ``le``) of the size histogram in bytes: 1, 5, …, 200 MB, then +Inf.
SIZE_BUCKETS_BYTES: tuple[float, ...] = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)

#: Label values of ``transfer_type``, in the order they are written.
DIRECTIONS: tuple[str, str] = ("CPU_to_GPU", "GPU_to_CPU")

_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _go_float(x: float) -> str:
    """A float as Prometheus' Go client writes it (``1e+06``, ``1.5e+08``, ``+Inf``, ``0.25``).

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
        return f"{mantissa}e+0{dot - 1}"
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


class TransferMetrics:
    """Accumulates :class:`kvoff.TransferResult`\\ s per direction (see the module docs).

    Args:
        manager: an offloading manager whose ``get_stats()`` feeds the usage gauges (optional; see
            :meth:`attach_manager`).
    """

    def __init__(self, manager: Any = None) -> None:
        if manager is not None and not callable(getattr(manager, "get_stats", None)):
            raise TypeError(
                f"manager must be a kvoff manager (with get_stats()), got {type(manager).__name__}"
            )
        self._lock = threading.Lock()
        self._dirs = {d: _Direction() for d in DIRECTIONS}
        self._manager = manager
        self._stores_skipped = 0

    # -- input ------------------------------------------------------------------------------------

    def attach_manager(self, manager: Any) -> None:
        """Report ``manager.get_stats()`` as ``*_cache_*`` gauges (``None`` detaches)."""
        with self._lock:
            self._manager = manager

    def observe(self, result: Any) -> None:
        """Counts one transfer result (anything with ``success``, ``transfer_size``,
        ``transfer_time`` and ``transfer_type``, e.g. a :class:`kvoff.TransferResult`).

        Raises:
            ValueError: ``transfer_type`` is not one of the two directions.
        """
        d = _direction(result.transfer_type)
        size = int(result.transfer_size)
        secs = float(result.transfer_time)
        with self._lock:
            s = self._dirs[d]
            if not result.success:
                s.failed += 1
                return
            s.bytes += size
            s.seconds += secs
            s.transfers += 1
            i = 0
            while i < len(SIZE_BUCKETS_BYTES) and size > SIZE_BUCKETS_BYTES[i]:
                i += 1
            s.bucket_counts[i] += 1

    def observe_all(self, results: Iterable[Any]) -> None:
        """:meth:`observe` each result."""
        for r in results:
            self.observe(r)

    def reset(self) -> None:
        """Zeroes every counter (the attached manager stays attached)."""
        with self._lock:
            self._dirs = {d: _Direction() for d in DIRECTIONS}
            self._stores_skipped = 0

    # -- output -----------------------------------------------------------------------------------

    def _cache_stats(self) -> dict[str, Any] | None:
        """The attached manager's stats (``stores_skipped`` accumulated here); caller holds the lock."""
        if self._manager is None:
            return None
        stats = dict(self._manager.get_stats())
        self._stores_skipped += int(stats.get("stores_skipped", 0))
        stats["stores_skipped"] = self._stores_skipped
        return stats

    def snapshot(self) -> dict[str, Any]:
        """The current values::

            {"GPU_to_CPU": {"bytes", "seconds", "transfers", "failed_transfers", "gb_per_s",
                            "size_buckets": {le_bytes: cumulative count, ..., inf: count},
                            "size_sum", "size_count"},
             "CPU_to_GPU": {...},
             "cache": manager.get_stats() with stores_skipped accumulated (only with a manager)}

        ``gb_per_s`` = bytes / seconds / 1e9 (0.0 before any transfer).
        """
        with self._lock:
            out: dict[str, Any] = {}
            for d in ("GPU_to_CPU", "CPU_to_GPU"):
                s = self._dirs[d]
                cum, buckets = 0, {}
                for le, n in zip((*SIZE_BUCKETS_BYTES, math.inf), s.bucket_counts):
                    cum += n
                    buckets[le] = cum
                out[d] = {
                    "bytes": s.bytes,
                    "seconds": s.seconds,
                    "transfers": s.transfers,
                    "failed_transfers": s.failed,
                    "gb_per_s": s.bytes / s.seconds / 1e9 if s.seconds > 0 else 0.0,
                    "size_buckets": buckets,
                    "size_sum": s.bytes,
                    "size_count": s.transfers,
                }
            cache = self._cache_stats()
            if cache is not None:
                out["cache"] = cache
            return out

    def prometheus_text(self, prefix: str = "kvoff") -> str:
        """The metrics in the Prometheus text exposition format (0.0.4), names ``{prefix}_offload_*``
        and ``{prefix}_cache_*``; ends with a newline."""
        with self._lock:
            dirs = {d: self._dirs[d] for d in DIRECTIONS}
            lines: list[str] = []

            def family(name: str, kind: str, help_: str) -> str:
                full = f"{prefix}_{name}"
                lines.append(f"# HELP {full} {help_}")
                lines.append(f"# TYPE {full} {kind}")
                return full

            def per_dir(name: str, kind: str, help_: str, value: Any) -> None:
                full = family(name, kind, help_)
                for d, s in dirs.items():
                    lines.append(f'{full}{{transfer_type="{d}"}} {_go_float(value(s))}')

            per_dir(
                "offload_total_bytes", "counter", "Bytes moved by KV offloading transfers.", lambda s: s.bytes
            )
            per_dir(
                "offload_total_time",
                "counter",
                "Seconds spent in KV offloading transfers (device-timed on a GPU).",
                lambda s: s.seconds,
            )
            per_dir(
                "offload_transfers", "counter", "Successful KV offloading transfers.", lambda s: s.transfers
            )
            per_dir(
                "offload_failed_transfers", "counter", "Failed KV offloading transfers.", lambda s: s.failed
            )
            full = family("offload_size", "histogram", "Bytes per KV offloading transfer.")
            for d, s in dirs.items():
                cum = 0
                for le, n in zip((*SIZE_BUCKETS_BYTES, math.inf), s.bucket_counts):
                    cum += n
                    lines.append(
                        f'{full}_bucket{{transfer_type="{d}",le="{_go_float(le)}"}} {_go_float(cum)}'
                    )
                lines.append(f'{full}_sum{{transfer_type="{d}"}} {_go_float(s.bytes)}')
                lines.append(f'{full}_count{{transfer_type="{d}"}} {_go_float(s.transfers)}')

            cache = self._cache_stats()
            if cache is not None:
                gauges = (
                    ("cache_usage", "usage", "Fraction of CPU blocks pinned by pending stores or loads."),
                    ("cache_write_usage", "write_usage", "Fraction of CPU blocks pinned by pending stores."),
                    ("cache_read_usage", "read_usage", "Fraction of CPU blocks pinned by loads."),
                    ("cache_blocks", "num_blocks", "Capacity of the CPU cache in blocks."),
                    ("cache_blocks_present", "num_present", "CPU blocks holding a key."),
                    ("cache_blocks_free", "num_free", "Unused CPU blocks."),
                    ("cache_blocks_evictable", "num_evictable", "CPU blocks that may be evicted."),
                )
                for name, key, help_ in gauges:
                    full = family(name, "gauge", help_)
                    lines.append(f"{full} {_go_float(cache.get(key, 0))}")
                full = family("cache_stores_skipped", "counter", "Stores skipped by the admission threshold.")
                lines.append(f"{full} {_go_float(cache['stores_skipped'])}")
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        with self._lock:
            parts = ", ".join(f"{d}: {s.transfers} transfers, {s.bytes} B" for d, s in self._dirs.items())
        return f"TransferMetrics({parts})"


class MetricsServer(ThreadingHTTPServer):
    """The HTTP server of :func:`serve_metrics`; serves ``GET /metrics`` from a daemon thread."""

    daemon_threads = True

    def __init__(self, metrics: TransferMetrics, addr: str, port: int, prefix: str) -> None:
        self.metrics = metrics
        self.prefix = prefix
        super().__init__((addr, port), _MetricsHandler)
        self._thread = threading.Thread(target=self.serve_forever, name="kvoff-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound port (useful with ``port=0``)."""
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        host = self.server_address[0]
        if isinstance(host, bytes):
            host = host.decode()
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stops serving and closes the socket. Idempotent."""
        if self._thread.is_alive():
            self.shutdown()
            self._thread.join()
        self.server_close()


class _MetricsHandler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] not in ("/metrics", "/metrics/"):
            self.send_error(404, "only /metrics is served here")
            return
        try:
            body = self.server.metrics.prometheus_text(self.server.prefix).encode()
        except Exception as e:  # noqa: BLE001 - report any failure as a 500, never kill the thread
            self.send_error(500, f"kvoff metrics failed: {e}")
            return
        self.send_response(200)
        self.send_header("Content-Type", _CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_metrics(
    metrics: TransferMetrics, port: int, addr: str = "127.0.0.1", *, prefix: str = "kvoff"
) -> MetricsServer:
    """Serves ``metrics`` at ``http://addr:port/metrics`` from a daemon thread (stdlib
    ``http.server``); ``port=0`` picks a free port (see ``server.port``). Call ``server.close()``
    to stop.

    Raises:
        OSError: the address cannot be bound.
    """
    if not isinstance(metrics, TransferMetrics):
        raise TypeError(f"metrics must be a kvoff.TransferMetrics, got {type(metrics).__name__}")
    return MetricsServer(metrics, addr, int(port), prefix)
