"""Transfer metrics (docs/spec.md §8): per-direction bytes, seconds, transfer counts and a size histogram,
plus the attached manager's usage gauges, as a dict, as a ``prometheus_client`` collector that a
service registers in its own registry, or over a standalone HTTP endpoint.

::

    m = kvoff.TransferMetrics()
    h = kvoff.CpuGpuOffloadingHandlers(kv_caches, 1, num_cpu_blocks, metrics=m)   # observed for you
    m.attach_manager(manager)           # adds kvoff_cache_* usage gauges from manager.get_stats()

    # in a service that already runs prometheus_client (its /metrics now shows kvoff_*):
    prometheus_client.REGISTRY.register(kvoff.TransferMetricsCollector(m))

    # or standalone (prometheus_client's start_http_server on a registry of its own):
    server = kvoff.serve_metrics(m, port=9400)                  # GET http://127.0.0.1:9400/metrics
    server.close()

The collector, the server and ``prometheus_text()`` need ``prometheus_client`` (``pip install
prometheus_client``, or ``pip install '.[prometheus]'`` in a kvoff checkout): the exposition is prometheus_client's own; without it they raise
``ImportError`` saying so, and everything else here (observing, ``snapshot()``) works.

Families (``prefix="kvoff"``), each ``offload_*`` one with the label
``transfer_type="GPU_to_CPU"|"CPU_to_GPU"``:

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
A :class:`kvoff.TieredOffloadingManager` attached adds each of its tiers' families, as
:data:`kvoff.tiers.METRICS` names them: the file tier's ``kvoff_disk_*``, the remote tier's
``kvoff_remote_*`` and the object tier's ``kvoff_object_*`` (bytes and seconds per direction, so
GB/s = rate of bytes / rate of seconds; hits, promotions, rejected values, errors, own bytes,
whether the server or store is up). Every tier of that table is exported, none named here.

Counters are exposed as prometheus_client exposes every counter: the sample (and its
``# HELP``/``# TYPE`` lines) is the family name plus ``_total``, e.g.
``kvoff_offload_total_bytes_total{transfer_type="GPU_to_CPU"}``. (kvoff before the collector wrote
the counter samples without ``_total``; prometheus_client's registry cannot expose a counter that
way, and its parser already read those samples as ``…_total``.)

Several sources in one registry: one collector holds any number of :class:`TransferMetrics`, each
with its own constant labels (``collector.add(m2, labels={"engine": "b"})``); two collectors with
the same prefix in one registry are refused by the registry (duplicated timeseries).

Inside vLLM the same figures are reported under vLLM's own names (``vllm:kv_offload_*``) by vLLM's
metrics machinery, from its workers to the API server that serves ``/metrics``; this module is for
services that hold kvoff's objects in the process that serves their metrics, and for standalone use.
All methods are thread-safe; a collection holds this object's lock only to copy numbers, and calls
the manager's ``get_stats()`` outside it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from kvoff._metrics_base import (
    _LABEL_NAME,
    _RESERVED_LABELS,
    DIRECTIONS,
    PROMETHEUS_EXTRA,
    SIZE_BUCKETS_BYTES,
    _check_prefix,
    _checked_size_time,
    _Direction,
    _direction,
    _Family,
    _go_float,
    _prometheus_client,
)

__all__ = [
    "DIRECTIONS",
    "PROMETHEUS_EXTRA",
    "SIZE_BUCKETS_BYTES",
    "MetricsServer",
    "TransferMetrics",
    "TransferMetricsCollector",
    "serve_metrics",
]

logger = logging.getLogger(__name__)

# -- the families, in the order they are written -----------------------------------------------------

_COUNTERS: tuple[tuple[str, str, str], ...] = (
    # (name after the prefix, help, _Direction attribute)
    ("offload_total_bytes", "Bytes moved by KV offloading transfers.", "bytes"),
    ("offload_total_time", "Seconds spent in KV offloading transfers (device-timed on a GPU).", "seconds"),
    ("offload_transfers", "Successful KV offloading transfers.", "transfers"),
    ("offload_failed_transfers", "Failed KV offloading transfers.", "failed"),
)
_HISTOGRAM = ("offload_size", "Bytes per KV offloading transfer.")
_CACHE_GAUGES: tuple[tuple[str, str, str], ...] = (
    # (name after the prefix, get_stats() key, help)
    ("cache_usage", "usage", "Fraction of CPU blocks pinned by pending stores or loads."),
    ("cache_write_usage", "write_usage", "Fraction of CPU blocks pinned by pending stores."),
    ("cache_read_usage", "read_usage", "Fraction of CPU blocks pinned by loads."),
    ("cache_blocks", "num_blocks", "Capacity of the CPU cache in blocks."),
    ("cache_blocks_present", "num_present", "CPU blocks holding a key."),
    ("cache_blocks_free", "num_free", "Unused CPU blocks."),
    ("cache_blocks_evictable", "num_evictable", "CPU blocks that may be evicted."),
)
_CACHE_SKIPPED = ("cache_stores_skipped", "Stores skipped by the admission threshold.")


def _tier_family(m: Any) -> str:
    """A tier figure's family name without the prefix (``kvoff.tiers.Metric``; counters without
    ``_total``)."""
    name: str = m.prometheus.removeprefix("kvoff_")
    return name.removesuffix("_total") if m.kind == "counter" else name


def _describe(prefix: str) -> list[_Family]:
    """Every family a collector with this prefix may write, without samples."""
    from kvoff.tiers import METRICS

    fams = [_Family(f"{prefix}_{name}", "counter", help_) for name, help_, _ in _COUNTERS]
    fams.append(_Family(f"{prefix}_{_HISTOGRAM[0]}", "histogram", _HISTOGRAM[1]))
    fams += [_Family(f"{prefix}_{name}", "gauge", help_) for name, _, help_ in _CACHE_GAUGES]
    fams += [
        _Family(f"{prefix}_{_tier_family(m)}", m.kind, m.help) for rows in METRICS.values() for m in rows
    ]
    fams.append(_Family(f"{prefix}_{_CACHE_SKIPPED[0]}", "counter", _CACHE_SKIPPED[1]))
    return fams


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
            ValueError: ``transfer_type`` is not one of the two directions, ``transfer_size`` is
                negative or 2**63 or more, ``transfer_time`` is negative, NaN or infinite.
            TypeError: ``transfer_size`` is not an int, ``transfer_time`` not a number (``bool``
                is neither). Nothing is counted when it raises.
        """
        d = _direction(result.transfer_type)
        size, secs = _checked_size_time(result.transfer_size, result.transfer_time)
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

    def _cache_stats(self, strict: bool) -> dict[str, Any] | None:
        """The attached manager's stats with ``stores_skipped`` accumulated here. ``get_stats()``
        runs outside this object's lock (it waits for the manager's); ``strict=False`` turns its
        failure (e.g. a shut-down manager) into ``None``."""
        with self._lock:
            manager = self._manager
        if manager is None:
            return None
        try:
            stats = dict(manager.get_stats())
        except Exception:
            if strict:
                raise
            logger.debug(
                "kvoff metrics: get_stats() of %r failed; cache gauges skipped", manager, exc_info=True
            )
            return None
        skipped = int(stats.get("stores_skipped", 0))
        with self._lock:
            self._stores_skipped += skipped
            stats["stores_skipped"] = self._stores_skipped
        return stats

    def _copy_dirs(self) -> dict[str, _Direction]:
        with self._lock:
            return {d: self._dirs[d].copy() for d in DIRECTIONS}

    def _families(self, prefix: str, labels: Mapping[str, str], strict: bool = False) -> list[_Family]:
        """The current values as families (see :class:`TransferMetricsCollector`)."""
        dirs = self._copy_dirs()
        cache = self._cache_stats(strict)
        fams: list[_Family] = []

        def family(name: str, type_: str, help_: str) -> _Family:
            f = _Family(f"{prefix}_{name}", type_, help_)
            fams.append(f)
            return f

        for name, help_, attr in _COUNTERS:
            f = family(name, "counter", help_)
            for d, s in dirs.items():
                f.samples.append((f"{f.name}_total", {**labels, "transfer_type": d}, float(getattr(s, attr))))
        f = family(_HISTOGRAM[0], "histogram", _HISTOGRAM[1])
        for d, s in dirs.items():
            lab = {**labels, "transfer_type": d}
            cum = 0
            for le, n in zip((*SIZE_BUCKETS_BYTES, math.inf), s.bucket_counts, strict=True):
                cum += n
                f.samples.append((f"{f.name}_bucket", {**lab, "le": _go_float(le)}, float(cum)))
            f.samples.append((f"{f.name}_sum", lab, float(s.bytes)))
            f.samples.append((f"{f.name}_count", lab, float(s.transfers)))
        if cache is not None:
            for name, key, help_ in _CACHE_GAUGES:
                family(name, "gauge", help_).samples.append(
                    (f"{prefix}_{name}", dict(labels), float(cache.get(key, 0)))
                )
            f = family(_CACHE_SKIPPED[0], "counter", _CACHE_SKIPPED[1])
            f.samples.append((f"{f.name}_total", dict(labels), float(cache["stores_skipped"])))
            # A manager with tiers behind it (kvoff.TieredOffloadingManager): each tier's figures
            # under the names of its kvoff.tiers.METRICS table (counters end in _total).
            from kvoff.tiers import METRICS

            for rows in METRICS.values():
                for m in rows:
                    if m.key not in cache:
                        continue
                    f = family(_tier_family(m), m.kind, m.help)
                    sample = f.name + "_total" if m.kind == "counter" else f.name
                    f.samples.append((sample, dict(labels), float(cache[m.key])))
        return fams

    def snapshot(self) -> dict[str, Any]:
        """The current values::

            {"GPU_to_CPU": {"bytes", "seconds", "transfers", "failed_transfers", "gb_per_s",
                            "size_buckets": {le_bytes: cumulative count, ..., inf: count},
                            "size_sum", "size_count"},
             "CPU_to_GPU": {...},
             "cache": manager.get_stats() with stores_skipped accumulated (only with a manager)}

        ``gb_per_s`` = bytes / seconds / 1e9 (0.0 before any transfer). Raises what the attached
        manager's ``get_stats()`` raises (e.g. ``InvalidStateError`` once it was shut down); the
        collector skips the cache gauges instead.
        """
        dirs = self._copy_dirs()
        out: dict[str, Any] = {}
        for d in ("GPU_to_CPU", "CPU_to_GPU"):
            s = dirs[d]
            cum, buckets = 0, {}
            for le, n in zip((*SIZE_BUCKETS_BYTES, math.inf), s.bucket_counts, strict=True):
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
        cache = self._cache_stats(strict=True)
        if cache is not None:
            out["cache"] = cache
        return out

    def prometheus_text(self, prefix: str = "kvoff") -> str:
        """The metrics in the Prometheus text exposition format (0.0.4), names ``{prefix}_offload_*``
        and ``{prefix}_cache_*``; ends with a newline. The same text as a registry holding
        ``TransferMetricsCollector(self, prefix=prefix)`` (``prometheus_client.generate_latest``).

        Raises:
            ImportError: prometheus_client is not installed (``pip install prometheus_client``).
        """
        _check_prefix(prefix)
        pc = _prometheus_client()
        return str(pc.generate_latest(TransferMetricsCollector(self, prefix=prefix)).decode())

    def __repr__(self) -> str:
        with self._lock:
            parts = ", ".join(f"{d}: {s.transfers} transfers, {s.bytes} B" for d, s in self._dirs.items())
        return f"TransferMetrics({parts})"


class TransferMetricsCollector:
    """A ``prometheus_client`` collector of kvoff's metrics: register it in a registry and
    kvoff's families appear wherever that registry is served::

        collector = kvoff.TransferMetricsCollector(m)          # or (m, labels={"engine": "a"})
        prometheus_client.REGISTRY.register(collector)         # the service's /metrics
        collector.add(m2, labels={"engine": "b"})              # more sources: one collector
        prometheus_client.REGISTRY.unregister(collector)

    Each source is a :class:`TransferMetrics` with constant labels (added to every one of its
    series); two sources may not have the same labels (their series would collide). Collecting
    never raises into the registry: a source whose manager fails ``get_stats()`` (shut down) is
    reported without its cache gauges, and a source that fails otherwise is skipped (logged).
    ``describe()`` names every family, so a second collector with the same prefix in one registry
    is refused there at ``register`` (prometheus_client's "Duplicated timeseries").

    Args:
        metrics: the first source (optional).
        labels: its constant labels (``{name: value}``; not ``transfer_type`` or ``le``).
        prefix: the family name prefix (``"kvoff"``).

    Raises:
        ImportError: prometheus_client is not installed (``pip install prometheus_client``).
    """

    def __init__(
        self,
        metrics: TransferMetrics | None = None,
        *,
        labels: Mapping[str, str] | None = None,
        prefix: str = "kvoff",
    ) -> None:
        self._pc = _prometheus_client()
        self.prefix = _check_prefix(prefix)
        self._lock = threading.Lock()
        self._sources: list[tuple[TransferMetrics, dict[str, str]]] = []
        if metrics is not None:
            self.add(metrics, labels)
        elif labels:
            raise TypeError("labels= needs metrics= (they label that source's series)")

    def add(self, metrics: TransferMetrics, labels: Mapping[str, str] | None = None) -> None:
        """Adds a source with its constant labels.

        Raises:
            TypeError: ``metrics`` is not a :class:`TransferMetrics`, or a label is not a string.
            ValueError: a label name is invalid or reserved, or the source or its label set is
                already in this collector.
        """
        if not isinstance(metrics, TransferMetrics):
            raise TypeError(f"metrics must be a kvoff.TransferMetrics, got {type(metrics).__name__}")
        lab: dict[str, str] = {}
        for k, v in (labels or {}).items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"labels must map str to str, got {k!r}: {v!r}")
            if not _LABEL_NAME.match(k) or k.startswith("__") or k in _RESERVED_LABELS:
                raise ValueError(
                    f"invalid label name {k!r} ([a-zA-Z_][a-zA-Z0-9_]*, not __*, transfer_type or le)"
                )
            lab[k] = v
        with self._lock:
            for m, other in self._sources:
                if m is metrics:
                    raise ValueError("this TransferMetrics is already a source of the collector")
                if other == lab:
                    raise ValueError(
                        f"another source already has the labels {lab!r}: give each source distinct labels"
                    )
            self._sources.append((metrics, lab))

    def remove(self, metrics: TransferMetrics) -> None:
        """Removes a source (its series disappear at the next collection).

        Raises:
            ValueError: it is not a source of this collector.
        """
        with self._lock:
            for i, (m, _) in enumerate(self._sources):
                if m is metrics:
                    del self._sources[i]
                    return
        raise ValueError("this TransferMetrics is not a source of the collector")

    @property
    def sources(self) -> list[tuple[TransferMetrics, dict[str, str]]]:
        """``(metrics, labels)`` of each source, in the order added (a copy)."""
        with self._lock:
            return [(m, dict(lab)) for m, lab in self._sources]

    def _to_metric(self, f: _Family) -> Any:
        m = self._pc.metrics_core.Metric(f.name, f.help, f.type)
        for name, labels, value in f.samples:
            m.add_sample(name, labels, value)
        return m

    def describe(self) -> list[Any]:
        """Every family this collector may write (no samples), for the registry's name checks."""
        return [self._to_metric(f) for f in _describe(self.prefix)]

    def collect(self) -> Iterator[Any]:
        """The current families of every source (``prometheus_client.core.Metric`` objects)."""
        merged: dict[str, _Family] = {}
        for metrics, labels in self.sources:
            try:
                fams = metrics._families(self.prefix, labels)
            except Exception:  # never raise into the registry: the rest of /metrics must still work
                logger.exception("kvoff metrics: collecting a source labelled %r failed; skipped", labels)
                continue
            for f in fams:
                into = merged.setdefault(f.name, _Family(f.name, f.type, f.help))
                into.samples += f.samples
        for f in merged.values():
            yield self._to_metric(f)

    def __repr__(self) -> str:
        return f"TransferMetricsCollector(prefix={self.prefix!r}, sources={len(self.sources)})"


class MetricsServer:
    """The endpoint of :func:`serve_metrics`: ``prometheus_client.start_http_server`` serving a
    registry of its own (``self.registry``, holding ``self.collector``) from a daemon thread."""

    def __init__(
        self,
        metrics: TransferMetrics | TransferMetricsCollector,
        addr: str,
        port: int,
        prefix: str = "kvoff",
    ) -> None:
        pc = _prometheus_client()
        if isinstance(metrics, TransferMetricsCollector):
            self.collector = metrics
            self.metrics: TransferMetrics | None = None
        else:
            self.collector = TransferMetricsCollector(metrics, prefix=prefix)
            self.metrics = metrics
        self.prefix = self.collector.prefix
        self.registry = pc.CollectorRegistry()
        self.registry.register(self.collector)
        self._server, self._thread = pc.start_http_server(int(port), addr=addr, registry=self.registry)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def port(self) -> int:
        """The bound port (useful with ``port=0``)."""
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = self._server.server_address[0]
        if isinstance(host, bytes):
            host = host.decode()
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stops serving and closes the socket. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.shutdown()
        self._thread.join()
        self._server.server_close()

    def __enter__(self) -> MetricsServer:  # noqa: PYI034 (Self needs typing_extensions on 3.10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsServer({self.url}{', closed' if self._closed else ''})"


def serve_metrics(
    metrics: TransferMetrics | TransferMetricsCollector,
    port: int,
    addr: str = "127.0.0.1",
    *,
    prefix: str = "kvoff",
) -> MetricsServer:
    """Serves ``metrics`` at ``http://addr:port/metrics`` from a daemon thread, with
    ``prometheus_client.start_http_server`` on a registry of its own (any path but
    ``/favicon.ico`` answers, as there). ``metrics`` is a :class:`TransferMetrics` (served with
    ``prefix``) or a :class:`TransferMetricsCollector` (several labelled sources; its own prefix).
    ``port=0`` picks a free port (see ``server.port``). Call ``server.close()`` to stop (or use it
    as a context manager).

    Raises:
        ImportError: prometheus_client is not installed (``pip install prometheus_client``).
        OSError: the address cannot be bound.
    """
    if not isinstance(metrics, (TransferMetrics, TransferMetricsCollector)):
        raise TypeError(
            "metrics must be a kvoff.TransferMetrics or kvoff.TransferMetricsCollector, "
            f"got {type(metrics).__name__}"
        )
    return MetricsServer(metrics, addr, int(port), prefix)
