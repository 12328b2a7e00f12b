"""Each tier's settings table and metrics table: the one place kvoff's surfaces read a tier's setting
names, defaults, metric names, kinds and help from (docs/design.md "A new tier").

- :data:`SETTINGS` — per tier (``"disk"``, ``"remote"``, ``"object"``), its settings: name, default (from
  ``kvoff._native.TIER_DEFAULTS``, i.e. the crate's configs: one source for every default) and on
  which surfaces it exists (the tiered manager, the block store). Both native constructors read the
  settings with one reader (``src/python/tiers.rs``), which :func:`check_settings` runs without
  opening anything (vLLM's and SGLang's configs call it before an engine starts).
- :data:`METRICS` — per tier, its figures: the stats key (``get_stats()`` of a
  :class:`kvoff.TieredOffloadingManager`, ``stats()`` of a :class:`kvoff.BlockStore`), the kind,
  the help, kvoff's Prometheus name (:class:`kvoff.TransferMetricsCollector`), the vLLM name
  (:mod:`kvoff.vllm`) and the tier-neutral name under vLLM's tiering
  (``vllm:kvoff_tier_<name>``, :data:`kvoff.vllm.tiering.TIER_VLLM_METRICS`).

A new tier adds one entry to each of the two tables (and its reader in ``src/python/tiers.rs``);
every surface picks it up from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvoff import _native

__all__ = [
    "GENERIC_METRICS",
    "METRICS",
    "SETTINGS",
    "TIER_DEFAULTS",
    "Metric",
    "Setting",
    "check_settings",
    "metric",
    "settings_of",
]

#: Every tier setting's default as the native constructors apply it (``None``: none, or chosen by
#: the machine or the surface; see each setting).
TIER_DEFAULTS: dict[str, Any] = dict(_native.TIER_DEFAULTS)

Surface = Literal["manager", "store"]


@dataclass(frozen=True)
class Setting:
    """One setting of a tier: its keyword name, default, meaning and the surfaces that take it
    (``"manager"``: :class:`kvoff.TieredOffloadingManager` and vLLM's connector; ``"store"``:
    :class:`kvoff.BlockStore`, i.e. SGLang's backend and vLLM's tiering)."""

    name: str
    help: str
    surfaces: tuple[Surface, ...] = ("manager", "store")

    @property
    def default(self) -> Any:
        return TIER_DEFAULTS.get(self.name)


_BOTH: tuple[Surface, ...] = ("manager", "store")
_MANAGER: tuple[Surface, ...] = ("manager",)

#: Each tier's settings (besides the layout's and the host manager's, which every tier shares).
SETTINGS: dict[str, tuple[Setting, ...]] = {
    "disk": (
        Setting(
            "io_threads", "I/O threads (files; the block store's remote tier too unless remote_io_threads)"
        ),
        Setting("write_threads", "most I/O threads writing at once (the rest serve reads)"),
        Setting("max_queued_writes", "writes queued before new ones are dropped (counted)"),
        Setting("fsync", "fsync each file before it is published"),
        Setting("direct_io", "O_DIRECT: 'auto', 'on' or 'off'"),
        Setting("rescan_interval_s", "how often the directory is listed again (None: only at start)"),
        Setting("trusted_uids", "users besides this one whose files the tier trusts (docs/tier.md Trust)"),
        Setting("trusted_gid", "a group whose files the tier trusts"),
        Setting(
            "allow_writable_dir", "accept directories writable by untrusted users without the sticky bit"
        ),
        Setting("disk_store_threshold", "write a block to disk once it was stored this many times", _MANAGER),
    ),
    "remote": (
        Setting("remote_url", "redis://, rediss://, redis+cluster:// URL (None: no remote tier)"),
        Setting("remote_cluster", "treat a redis:// URL as a Cluster's seed node"),
        Setting("remote_namespace", "the remote tier's namespace (default: namespace)"),
        Setting(
            "remote_store_threshold",
            "write a block to the server once it was stored this many times",
            _MANAGER,
        ),
        Setting("remote_ttl_s", "time to live of each value (None: none)"),
        Setting("remote_connect_timeout_s", "timeout of each connection attempt"),
        Setting("remote_timeout_s", "timeout of each read/write on a connection"),
        Setting(
            "remote_io_threads",
            "I/O threads, one connection each per node (1 to 64; the block store: its io_threads "
            "unless given, see docs/tier.md 'The block store')",
        ),
        Setting(
            "remote_idle_spin_s",
            "how long an idle I/O thread looks for jobs before it sleeps (None: by CPUs)",
        ),
        Setting("remote_idle_nap_s", "how often one idle I/O thread looks for jobs (None: by CPUs)"),
        Setting(
            "remote_max_queued_writes",
            "writes queued before new ones are dropped (block store: max_queued_writes)",
        ),
        Setting("remote_max_inflight_bytes", "bytes of values in flight before writes are dropped"),
        Setting("remote_negative_ttl_s", "how long a miss is remembered"),
        Setting("remote_max_fetch_keys", "keys per batched fetch"),
        Setting("remote_password_env", "environment variable holding the password when the URL has none"),
        Setting("remote_tls_ca_file", "PEM file of the CA of the servers' certificates (rediss://)"),
    ),
    "object": (
        Setting("object_url", "s3://bucket/prefix of an S3-compatible store (None: no object tier)"),
        Setting(
            "object_endpoint",
            "the store's endpoint, http(s)://host:port (None: $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, AWS)",
        ),
        Setting("object_region", "the region (None: $AWS_REGION, $AWS_DEFAULT_REGION, us-east-1)"),
        Setting("object_namespace", "the object tier's namespace (default: namespace)"),
        Setting(
            "object_bytes_to_use",
            "byte budget of this rank's values in the namespace (required with object_url in the "
            "tiered manager; the block store: capacity_bytes unless given)",
        ),
        Setting(
            "object_store_threshold",
            "write a block to the object store once it was stored this many times",
            _MANAGER,
        ),
        Setting("object_ttl_s", "values older than this are neither served nor kept (None: none)"),
        Setting("object_connect_timeout_s", "timeout of each connection attempt"),
        Setting("object_timeout_s", "bound of one whole request, its body included"),
        Setting("object_max_retries", "retries of a failed or throttled request (503 SlowDown)"),
        Setting("object_io_threads", "threads of the tier's async runtime (1 to 64)"),
        Setting("object_max_requests", "requests in flight at once"),
        Setting("object_max_queued_writes", "writes queued before new ones are dropped (counted)"),
        Setting("object_max_inflight_bytes", "bytes of values in flight before writes are dropped"),
        Setting("object_negative_ttl_s", "how long a miss is remembered"),
        Setting(
            "object_list_interval_s",
            "how often the namespace is listed again (None: only at start)",
        ),
        Setting("object_multipart_bytes", "values larger than this go as multipart uploads"),
        Setting(
            "object_profile",
            "profile of the shared credentials file when $AWS_ACCESS_KEY_ID is not set "
            "(None: $AWS_PROFILE, default)",
        ),
    ),
}


def settings_of(kind: str, surface: Surface) -> tuple[str, ...]:
    """The names of tier ``kind``'s settings that ``surface`` takes."""
    return tuple(s.name for s in SETTINGS[kind] if surface in s.surfaces)


def check_settings(surface: Surface, **settings: Any) -> None:
    """Checks settings as the native constructors read them (``TypeError``: wrong type or unknown
    setting; ``ValueError``: out of range), opening nothing."""
    _native.check_tier_settings(surface, **settings)


@dataclass(frozen=True)
class Metric:
    """One figure of a tier (see the module docs). ``prometheus``: kvoff's collector's name with
    the ``kvoff`` prefix (counters end in ``_total``); ``vllm``: the name vLLM's connector reports
    (``None``: not reported there); ``generic``: the tier-neutral name under vLLM's tiering."""

    key: str
    kind: Literal["counter", "gauge"]
    help: str
    prometheus: str
    vllm: str | None = None
    generic: str | None = None
    #: The surfaces whose stats hold it (the tiered manager's ``get_stats()``, the block store's
    #: ``stats()``).
    surfaces: tuple[Surface, ...] = ("manager", "store")


def _m(
    key: str,
    help_: str,
    prometheus: str,
    *,
    gauge: bool = False,
    vllm: bool | str = True,
    generic: str | None = None,
    store_only: bool = False,
    manager_only: bool = False,
) -> Metric:
    name = ("vllm:kvoff_" + key if vllm is True else vllm) or None
    surfaces: tuple[Surface, ...] = ("store",) if store_only else ("manager",) if manager_only else _BOTH
    return Metric(key, "gauge" if gauge else "counter", help_, prometheus, name, generic, surfaces)


#: Each tier's figures, in the order the surfaces list them.
METRICS: dict[str, tuple[Metric, ...]] = {
    "disk": (
        _m(
            "disk_bytes_written",
            "payload bytes written to files",
            "kvoff_disk_written_bytes_total",
            generic="bytes_written",
        ),
        _m("disk_files_written", "files published", "kvoff_disk_files_written_total", generic="writes"),
        _m(
            "disk_write_seconds",
            "I/O thread seconds spent writing",
            "kvoff_disk_write_seconds_total",
            generic="write_seconds",
        ),
        _m(
            "disk_write_errors",
            "writes failed (store skipped)",
            "kvoff_disk_write_errors_total",
            generic="write_errors",
        ),
        _m(
            "disk_writes_dropped",
            "writes dropped (queue full / no room)",
            "kvoff_disk_writes_dropped_total",
            generic="writes_dropped",
        ),
        _m(
            "disk_bytes_read",
            "payload bytes promoted into host memory",
            "kvoff_disk_read_bytes_total",
            generic="bytes_read",
        ),
        _m("disk_promotions", "promotions completed", "kvoff_disk_promotions_total", manager_only=True),
        _m(
            "disk_reads",
            "reads into the block store's rows or pieces",
            "kvoff_disk_reads_total",
            vllm=False,
            generic="reads",
            store_only=True,
        ),
        _m(
            "disk_read_seconds",
            "I/O thread seconds spent reading",
            "kvoff_disk_read_seconds_total",
            generic="read_seconds",
        ),
        _m(
            "disk_read_errors",
            "promotions whose file vanished",
            "kvoff_disk_read_errors_total",
            vllm=False,
            generic="read_errors",
        ),
        _m(
            "disk_corrupt_files",
            "files rejected by header/checksum",
            "kvoff_disk_corrupt_files_total",
            generic="rejected",
        ),
        _m(
            "disk_rejected_files",
            "foreign entries skipped (FIFOs, links, untrusted owners; docs/tier.md Trust)",
            "kvoff_disk_rejected_files_total",
            vllm=False,
            manager_only=True,
        ),
        _m(
            "disk_evicted_files",
            "own files removed for capacity",
            "kvoff_disk_evicted_files_total",
            generic="evicted",
        ),
        _m("disk_hits", "host misses found on disk", "kvoff_disk_hits_total", manager_only=True),
        _m(
            "disk_indexed_files",
            "files indexed",
            "kvoff_disk_files",
            gauge=True,
            vllm="vllm:kvoff_disk_files",
            generic="entries",
        ),
        _m(
            "disk_own_bytes",
            "bytes of this instance's files",
            "kvoff_disk_own_bytes",
            gauge=True,
            generic="stored_bytes",
        ),
    ),
    "remote": (
        _m(
            "remote_hits",
            "host (and file) misses found on the server",
            "kvoff_remote_hits_total",
            manager_only=True,
        ),
        _m(
            "remote_misses",
            "keys the server did not hold (or could not be asked)",
            "kvoff_remote_misses_total",
            manager_only=True,
        ),
        _m(
            "remote_promotions",
            "values promoted into host memory",
            "kvoff_remote_promotions_total",
            manager_only=True,
        ),
        _m(
            "remote_reads",
            "reads into the block store's rows or pieces",
            "kvoff_remote_reads_total",
            vllm=False,
            generic="reads",
            store_only=True,
        ),
        _m(
            "remote_bytes_read",
            "payload bytes promoted from the server",
            "kvoff_remote_read_bytes_total",
            generic="bytes_read",
        ),
        _m(
            "remote_read_seconds",
            "I/O thread seconds spent fetching and reading",
            "kvoff_remote_read_seconds_total",
            generic="read_seconds",
        ),
        _m(
            "remote_bytes_written",
            "payload bytes written to the server",
            "kvoff_remote_written_bytes_total",
            generic="bytes_written",
        ),
        _m(
            "remote_write_seconds",
            "I/O thread seconds spent writing",
            "kvoff_remote_write_seconds_total",
            generic="write_seconds",
        ),
        _m("remote_writes", "values written", "kvoff_remote_writes_total", generic="writes"),
        _m(
            "remote_write_errors",
            "writes failed (server error, timeout, down)",
            "kvoff_remote_write_errors_total",
            generic="write_errors",
        ),
        _m(
            "remote_writes_dropped",
            "writes dropped (queue or in-flight bytes full)",
            "kvoff_remote_writes_dropped_total",
            generic="writes_dropped",
        ),
        _m(
            "remote_read_errors",
            "promotions whose value vanished or failed",
            "kvoff_remote_read_errors_total",
            generic="read_errors",
        ),
        _m(
            "remote_rejected_values",
            "values rejected by header/checksum (deleted)",
            "kvoff_remote_rejected_values_total",
            generic="rejected",
        ),
        _m(
            "remote_fetch_errors",
            "keys whose fetch failed or was skipped (their node down)",
            "kvoff_remote_fetch_errors_total",
            generic="fetch_errors",
        ),
        _m("remote_reconnects", "recoveries of a node after a failure", "kvoff_remote_reconnects_total"),
        _m(
            "remote_fetches",
            "batched fetches started",
            "kvoff_remote_fetches_total",
            vllm=False,
            manager_only=True,
        ),
        _m(
            "remote_known_present",
            "keys the index knows the server holds",
            "kvoff_remote_known_present",
            gauge=True,
            vllm=False,
            generic="entries",
        ),
        _m(
            "remote_up",
            "1 while some node of the server or Cluster is reachable",
            "kvoff_remote_up",
            gauge=True,
            generic="up",
        ),
    ),
    "object": (
        _m(
            "object_hits",
            "misses of the tiers before found in the object store",
            "kvoff_object_hits_total",
            manager_only=True,
        ),
        _m(
            "object_misses",
            "keys the object store did not hold (or could not be asked)",
            "kvoff_object_misses_total",
            manager_only=True,
        ),
        _m(
            "object_promotions",
            "values promoted into host memory",
            "kvoff_object_promotions_total",
            manager_only=True,
        ),
        _m(
            "object_reads",
            "reads into the block store's rows or pieces",
            "kvoff_object_reads_total",
            vllm=False,
            generic="reads",
            store_only=True,
        ),
        _m(
            "object_bytes_read",
            "payload bytes promoted from the object store",
            "kvoff_object_read_bytes_total",
            generic="bytes_read",
        ),
        _m(
            "object_read_seconds",
            "request seconds spent reading",
            "kvoff_object_read_seconds_total",
            generic="read_seconds",
        ),
        _m(
            "object_bytes_written",
            "payload bytes written to the object store",
            "kvoff_object_written_bytes_total",
            generic="bytes_written",
        ),
        _m(
            "object_write_seconds",
            "request seconds spent writing",
            "kvoff_object_write_seconds_total",
            generic="write_seconds",
        ),
        _m("object_writes", "values written", "kvoff_object_writes_total", generic="writes"),
        _m(
            "object_write_errors",
            "writes failed (server error, throttling, timeout, down)",
            "kvoff_object_write_errors_total",
            generic="write_errors",
        ),
        _m(
            "object_writes_dropped",
            "writes dropped (queue, in-flight bytes or budget full)",
            "kvoff_object_writes_dropped_total",
            generic="writes_dropped",
        ),
        _m(
            "object_read_errors",
            "promotions whose value vanished or failed",
            "kvoff_object_read_errors_total",
            generic="read_errors",
        ),
        _m(
            "object_rejected_values",
            "values rejected by length/header/checksum (deleted)",
            "kvoff_object_rejected_values_total",
            generic="rejected",
        ),
        _m(
            "object_fetch_errors",
            "keys whose HEAD failed or was skipped (the store down)",
            "kvoff_object_fetch_errors_total",
            generic="fetch_errors",
        ),
        _m("object_reconnects", "recoveries of the store after a failure", "kvoff_object_reconnects_total"),
        _m(
            "object_evictions",
            "values deleted to stay within object_bytes_to_use",
            "kvoff_object_evictions_total",
            generic="evicted",
        ),
        _m("object_expired", "values deleted past object_ttl_s", "kvoff_object_expired_total", vllm=False),
        _m(
            "object_listings", "listings of the namespace finished", "kvoff_object_listings_total", vllm=False
        ),
        _m(
            "object_index_entries",
            "entries of the in-memory index (values and remembered misses)",
            "kvoff_object_index_entries",
            gauge=True,
            generic="entries",
        ),
        _m(
            "object_known_bytes",
            "bytes of this rank's values in the namespace, as the index sees them",
            "kvoff_object_known_bytes",
            gauge=True,
            generic="stored_bytes",
        ),
        _m(
            "object_up",
            "1 while the object store is reachable",
            "kvoff_object_up",
            gauge=True,
            generic="up",
        ),
    ),
}

#: The tier-neutral figures under vLLM's tiering (``vllm:kvoff_tier_<name>``): name → (kind, help).
#: Each tier's :data:`METRICS` rows name theirs in ``generic``; ``lookup_hits``/``lookup_misses`` are
#: counted by the tier's Python side.
GENERIC_METRICS: dict[str, tuple[Literal["counter", "gauge"], str]] = {
    "lookup_hits": ("counter", "chunks the tier's index held when looked up"),
    "lookup_misses": ("counter", "chunks the tier's index did not hold"),
    "reads": ("counter", "chunks read into vLLM's CPU tier"),
    "bytes_read": ("counter", "bytes read into vLLM's CPU tier"),
    "read_seconds": ("counter", "I/O thread seconds spent reading"),
    "read_errors": ("counter", "reads that failed (value vanished, I/O, timeout)"),
    "writes": ("counter", "chunks written"),
    "bytes_written": ("counter", "bytes written"),
    "write_seconds": ("counter", "I/O thread seconds spent writing"),
    "write_errors": ("counter", "writes that failed (store skipped)"),
    "writes_dropped": ("counter", "writes dropped (queue full or no room)"),
    "rejected": ("counter", "values rejected by their header or checksum"),
    "fetch_errors": ("counter", "remote lookups that failed or were skipped while the server was down"),
    "evicted": ("counter", "values removed for capacity (own files; object-store values)"),
    "stored_bytes": ("gauge", "bytes the tier holds against its capacity"),
    "entries": ("gauge", "values in the tier's index"),
    "up": ("gauge", "1 while the tier's store is reachable"),
}


def metric(kind: str, generic: str) -> Metric | None:
    """Tier ``kind``'s figure whose tier-neutral name is ``generic`` (``None``: it has none)."""
    return next((m for m in METRICS[kind] if m.generic == generic), None)
