"""kvoff's tiers (files, Redis/Valkey, S3-compatible stores) as secondary tiers of vLLM 0.33's own
``TieringOffloadingSpec``.

vLLM keeps its CPU tier (the primary) and hands each secondary tier a memoryview of it; this tier
writes chunks from that memory to kvoff's files and reads them back into it, on kvoff's I/O
threads, with kvoff's file format (docs/tier.md: header with magic, fingerprint, key and
checksums; atomic publication; namespace directory), so a corrupt, truncated or foreign file is
never served. Load it by module path (no registration)::

    "secondary_tiers": [{"type": "kvoff", "module_path": "kvoff.vllm.tiering",
                         "disk_path": "/nvme/kv", "disk_bytes_to_use": 500000000000}]

(``type`` is the class name looked up in ``module_path``: ``KvoffFileTier``; the alias class
``kvoff`` below lets ``"type": "kvoff"`` work too.) On Redis/Valkey (``remote_url``) or an
S3-compatible store (``object_url``) instead of files, the same class under the names
``KvoffRemoteTier`` / ``KvoffObjectTier`` reads better::

    {"type": "KvoffObjectTier", "module_path": "kvoff.vllm.tiering",
     "object_url": "s3://bucket/kv", "object_bytes_to_use": 2000000000000}

Settings: see :class:`KvoffFileTier`.

Lookups answer from kvoff's in-memory index (no I/O on the scheduler thread, no retry round);
stores and loads are queued on kvoff's I/O threads and reported through ``get_finished_jobs``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from kvoff import _native
from kvoff._names import DirectIoName
from kvoff.errors import ConfigError
from kvoff.tiers import GENERIC_METRICS, METRICS, metric
from kvoff.tiers import TIER_DEFAULTS as _D

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = [
    "TIER_VLLM_METRICS",
    "KvoffFileTier",
    "KvoffObjectTier",
    "KvoffRemoteTier",
    "kvoff",
    "tier_namespace",
]


def _tier_keys(generic: str) -> dict[str, str] | None:
    """Each tier's ``stats()`` key for a tier-neutral figure, by tier kind (``"disk"``,
    ``"remote"``, ``"object"``; a tier without one is left out); ``None``: counted by the tier's
    Python side."""
    if generic in ("lookup_hits", "lookup_misses"):
        return None
    return {kind: m.key for kind in METRICS if (m := metric(kind, generic)) is not None}


#: The kvoff tier's counters as vLLM metrics under vLLM's tiering (README "kvoff tiers under vLLM's
#: tiering"), from :data:`kvoff.tiers.GENERIC_METRICS` and each tier's :data:`kvoff.tiers.METRICS`:
#: name → (kind, meaning, each tier's ``stats()`` key by kind — a tier without one is not in it,
#: and reports nothing under that name; ``None`` for a count kept by the tier's Python side). Each
#: carries the label ``kvoff_tier`` (the tier's ``type``), so several kvoff tiers in one
#: ``secondary_tiers`` list are told apart. Counters are cumulative in kvoff and reported to vLLM
#: as increments; GB/s per direction is ``rate(..._bytes) / rate(..._seconds)``.
TIER_VLLM_METRICS: dict[str, tuple[str, str, dict[str, str] | None]] = {
    f"vllm:kvoff_tier_{g}": (kind, help_, _tier_keys(g)) for g, (kind, help_) in GENERIC_METRICS.items()
}

#: The label of :data:`TIER_VLLM_METRICS`.
TIER_METRIC_LABEL = "kvoff_tier"

log = logging.getLogger(__name__)


def tier_namespace(offloading_spec: OffloadingSpec, namespace: str | None) -> str:
    """The namespace id of the tier's files: the user's ``namespace``, else the model name, plus
    what decides the bytes of a chunk (KV dtype, tokens per hash, blocks per chunk, and the
    parallel layout unless vLLM says the bytes are parallelism-agnostic)."""
    cfg = offloading_spec.config
    base = namespace if namespace is not None else cfg.model.name
    par = cfg.parallel
    layout = (
        "agnostic"
        if par.is_parallelism_agnostic
        else f"tp{par.tp_size}.pp{par.pp_size}.pcp{par.pcp_size}.dcp{par.dcp_size}.w{par.world_size}"
    )
    return (
        f"vllm-tiering|{base}|{cfg.model.dtype}|t{cfg.cache.tokens_per_hash}"
        f"|c{cfg.cache.blocks_per_chunk}|{layout}|{'canon' if cfg.canonical_layout else 'direct'}"
    )


@dataclass
class _Job:
    keys: list[OffloadKey]
    is_load: bool
    pending: int
    ok_keys: list[OffloadKey] = field(default_factory=list)
    failed: bool = False
    t0: float = field(default_factory=time.monotonic)


class KvoffFileTier(SecondaryTierManager):
    """kvoff's file tier behind vLLM's CPU tier.

    Settings (the tier's entry in ``secondary_tiers``):

    - ``disk_path`` (required): directory of the files (local NVMe or a shared filesystem);
      ``root_dir`` is accepted as an alias (vLLM ``fs`` tier's name).
    - ``disk_bytes_to_use`` (default 100 GiB): capacity for this instance's own files; the least
      recently used own files are removed to make room (others' files never, unless corrupt).
    - ``namespace``: the id that decides which engines share files (default the model name; the
      KV dtype, block geometry and parallel layout are always added).
    - ``io_threads`` (16; the remote tier 8), ``write_threads`` (8; the remote tier 4; vLLM's ``fs``
      tier runs 16 + 16 threads), ``max_queued_writes`` (4096), ``direct_io``
      (``"auto"``/``"on"``/``"off"``), ``fsync`` (False), ``rescan_interval_s`` (2.0; how often
      other engines' new files are picked up), ``owner`` (the instance's tag; default namespace,
      rank and host name).
    - ``enable_kv_events``, ``locality``: as vLLM's ``fs`` tier.
    - ``remote_url`` (instead of ``disk_path``): kvoff's remote tier on Redis/Valkey
      (``redis://``, ``rediss://``, ``redis+cluster://``; docs/tier.md "Remote tier") behind the CPU
      tier, same header/checksum/namespace rules. Its index may not know a chunk: ``lookup`` then
      starts one batched fetch and answers ``RETRY`` (vLLM asks again next step; never waits).
      ``remote_cluster``, ``remote_ttl_s``, ``remote_timeout_s`` (2.0), ``remote_connect_timeout_s``
      (1.0), ``remote_max_inflight_bytes``, ``remote_negative_ttl_s`` (2.0),
      ``remote_max_fetch_keys`` (64), ``remote_password_env`` (``KVOFF_REMOTE_PASSWORD``),
      ``remote_tls_ca_file`` (a PEM CA for ``rediss://``; default the system's roots);
      ``io_threads`` and ``max_queued_writes`` apply too. :class:`KvoffRemoteTier` is the same
      class under the remote tier's name.
    - ``object_url`` (instead of ``disk_path``; ``s3://bucket/prefix``): kvoff's object tier on an
      S3-compatible store (AWS S3, SeaweedFS, MinIO, Ceph RGW; docs/tier.md "Object tier") behind
      the CPU tier, same header/checksum/namespace rules; ``lookup`` answers ``RETRY`` for a chunk
      its index does not know while one HEAD request runs (never waits). ``object_bytes_to_use``
      (this instance's byte budget in the namespace; default ``disk_bytes_to_use``'s),
      ``object_endpoint`` (default ``$AWS_ENDPOINT_URL``, else AWS), ``object_region``,
      ``object_namespace`` (as ``namespace``, on this tier), ``object_ttl_s``,
      ``object_timeout_s``, ``object_connect_timeout_s``, ``object_max_retries``,
      ``object_io_threads``, ``object_max_requests``, ``object_max_queued_writes``,
      ``object_max_inflight_bytes``, ``object_negative_ttl_s``, ``object_list_interval_s``,
      ``object_multipart_bytes``, ``object_profile``: :data:`kvoff.tiers.SETTINGS` ``["object"]``
      (defaults there). Credentials: ``$AWS_ACCESS_KEY_ID``/``$AWS_SECRET_ACCESS_KEY`` or a
      profile, never the tier's config. :class:`KvoffObjectTier` is the same class under the
      object tier's name.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        disk_path: str | None = None,
        disk_bytes_to_use: int = 100 << 30,
        namespace: str | None = None,
        io_threads: int | None = None,
        write_threads: int | None = None,
        max_queued_writes: int = 4096,
        direct_io: DirectIoName = _D["direct_io"],
        fsync: bool = False,
        rescan_interval_s: float | None = _D["rescan_interval_s"],
        owner: str | None = None,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
        root_dir: str | None = None,
        remote_url: str | None = None,
        remote_cluster: bool = False,
        remote_ttl_s: float | None = None,
        remote_timeout_s: float = _D["remote_timeout_s"],
        remote_connect_timeout_s: float = _D["remote_connect_timeout_s"],
        remote_max_inflight_bytes: int = _D["remote_max_inflight_bytes"],
        remote_negative_ttl_s: float = _D["remote_negative_ttl_s"],
        remote_max_fetch_keys: int = _D["remote_max_fetch_keys"],
        remote_password_env: str = _D["remote_password_env"],
        remote_tls_ca_file: str | None = None,
        object_url: str | None = None,
        object_endpoint: str | None = None,
        object_region: str | None = None,
        object_namespace: str | None = None,
        object_bytes_to_use: int | None = None,
        object_ttl_s: float | None = None,
        object_connect_timeout_s: float = _D["object_connect_timeout_s"],
        object_timeout_s: float = _D["object_timeout_s"],
        object_max_retries: int = _D["object_max_retries"],
        object_io_threads: int = _D["object_io_threads"],
        object_max_requests: int = _D["object_max_requests"],
        object_max_queued_writes: int = _D["object_max_queued_writes"],
        object_max_inflight_bytes: int = _D["object_max_inflight_bytes"],
        object_negative_ttl_s: float = _D["object_negative_ttl_s"],
        object_list_interval_s: float | None = _D["object_list_interval_s"],
        object_multipart_bytes: int = _D["object_multipart_bytes"],
        object_profile: str | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        path = disk_path if disk_path is not None else root_dir
        named = [
            n
            for n, given in (
                ("disk_path", bool(path)),
                ("remote_url", remote_url is not None),
                ("object_url", object_url is not None),
            )
            if given
        ]
        if len(named) > 1:
            raise ConfigError(
                "a kvoff tier is files ('disk_path'), remote ('remote_url') or an object store "
                f"('object_url'), not both ({', '.join(named[:-1])} and {named[-1]} given)"
            )
        if not named:
            raise ConfigError(
                "the kvoff tier needs 'disk_path' (a directory for its files), 'remote_url' or 'object_url'"
            )
        self.locality = Locality(locality) if locality is not None else None
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self.events = []
        rows = np.asarray(primary_kv_view)
        if rows.ndim == 0 or rows.shape[0] == 0:
            raise ConfigError("the primary tier's memory view has no rows")
        self._rows = rows
        strides = primary_kv_view.strides
        if not strides:
            raise ConfigError("the primary tier's memory view has no strides")
        stride = int(strides[0])
        self._block = stride
        # object_namespace stands for namespace (the dtype, geometry and parallel layout are added
        # to either: handed to the block store as it is, it would replace them).
        base = object_namespace if object_url is not None and object_namespace is not None else namespace
        self.namespace = tier_namespace(offloading_spec, base)
        cfg = offloading_spec.config
        net = remote_url is not None or object_url is not None
        # This surface's own defaults: files as vLLM's `fs` tier runs them (16 + 16 threads: 16 + 8
        # here), the remote tier as the block store's (docs/tier.md "The block store").
        if io_threads is None:
            io_threads = _D["io_threads"] if net else 16
        if write_threads is None:
            write_threads = _D["write_threads"] if net else 8
        self.store = _native.BlockStore(
            str(path) if path else None,
            int(disk_bytes_to_use),
            stride,
            rows=(int(rows.ctypes.data), int(rows.shape[0]), stride),
            memory_owner=rows,
            namespace=self.namespace,
            page_sizes=[stride],
            block_size_factor=int(cfg.cache.blocks_per_chunk),
            dtype=str(cfg.model.dtype),
            io_threads=io_threads,
            write_threads=write_threads,
            max_queued_writes=max_queued_writes,
            fsync=fsync,
            direct_io=direct_io,
            rescan_interval_s=rescan_interval_s,
            owner=owner,
            remote_url=remote_url,
            remote_cluster=remote_cluster,
            remote_ttl_s=remote_ttl_s,
            remote_timeout_s=remote_timeout_s,
            remote_connect_timeout_s=remote_connect_timeout_s,
            remote_max_inflight_bytes=remote_max_inflight_bytes,
            remote_negative_ttl_s=remote_negative_ttl_s,
            remote_max_fetch_keys=remote_max_fetch_keys,
            remote_password_env=remote_password_env,
            remote_tls_ca_file=remote_tls_ca_file,
            object_url=object_url,
            object_endpoint=object_endpoint,
            object_region=object_region,
            object_bytes_to_use=object_bytes_to_use,
            object_ttl_s=object_ttl_s,
            object_connect_timeout_s=object_connect_timeout_s,
            object_timeout_s=object_timeout_s,
            object_max_retries=object_max_retries,
            object_io_threads=object_io_threads,
            object_max_requests=object_max_requests,
            object_max_queued_writes=object_max_queued_writes,
            object_max_inflight_bytes=object_max_inflight_bytes,
            object_negative_ttl_s=object_negative_ttl_s,
            object_list_interval_s=object_list_interval_s,
            object_multipart_bytes=object_multipart_bytes,
            object_profile=object_profile,
        )
        self._jobs: dict[JobId, _Job] = {}
        # (key, chunk id) of a queued write or read -> its job (a key is written once at a time;
        # the same key may be read into two chunks).
        self._writes: dict[tuple[bytes, int], JobId] = {}
        self._reads: dict[tuple[bytes, int], list[JobId]] = {}
        self._finished: list[JobResult] = []
        self._hits = 0
        self._misses = 0
        self._seen: dict[str, float] = {}
        log.info(
            "kvoff tier %r: %s (%d bytes per chunk, %d chunks in the CPU tier, direct I/O %s)",
            tier_type,
            self.store.dir,
            stride,
            rows.shape[0],
            self.store.stats().get("disk_direct_io", f"n/a ({self.store.kind})"),
        )

    # --- lookups ---------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """``HIT`` when the tier's index holds the chunk (no I/O), ``MISS`` when it does not; the
        remote and object tiers: ``RETRY`` while the index does not know (a fetch or HEAD request
        is started; no waiting)."""
        (known,) = self.store.lookup([bytes(key)])
        if known is None:
            return LookupResult.RETRY
        if known:
            self._hits += 1
            return LookupResult.HIT
        self._misses += 1
        return LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    # --- jobs ------------------------------------------------------------------------------------

    def _finish(self, job_id: JobId, job: _Job, success: bool) -> None:
        del self._jobs[job_id]
        n = len(job.ok_keys)
        if job.is_load and not success:
            ok: Collection[OffloadKey] | None = tuple(job.ok_keys) if job.ok_keys else None
        else:
            ok = None
        self._finished.append(
            JobResult(
                job_id=job_id,
                success=success,
                successful_keys=ok,
                transfer_time=time.monotonic() - job.t0,
                transfer_bytes=n * self._block if n else None,
            )
        )
        if success and not job.is_load and self.events is not None and job.keys:
            self.events.append(
                OffloadingEvent(
                    keys=list(job.keys), medium=self.medium, removed=False, locality=self.locality
                )
            )

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunks = [int(c) for c in job_metadata.chunk_ids]
        job_id = job_metadata.job_id
        job = _Job(keys=keys, is_load=False, pending=0)
        self._jobs[job_id] = job
        todo = [
            (bytes(k), c, k) for k, c in zip(keys, chunks, strict=True) if not self.store.contains(bytes(k))
        ]
        job.ok_keys.extend(k for k in keys if all(bytes(k) != t[0] for t in todo))
        queued = self.store.submit_write([t[0] for t in todo], [t[1] for t in todo]) if todo else []
        for (kb, c, k), q in zip(todo, queued, strict=True):
            if q:
                self._writes[(kb, c)] = job_id
                job.pending += 1
            elif self.store.contains(kb):
                job.ok_keys.append(k)
            else:
                job.failed = True  # dropped: write queue full or no capacity
        if job.pending == 0:
            self._finish(job_id, job, not job.failed)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunks = [int(c) for c in job_metadata.chunk_ids]
        job_id = job_metadata.job_id
        job = _Job(keys=keys, is_load=True, pending=0)
        self._jobs[job_id] = job
        queued = self.store.submit_read([bytes(k) for k in keys], chunks)
        for k, c, q in zip(keys, chunks, queued, strict=True):
            if q:
                self._reads.setdefault((bytes(k), c), []).append(job_id)
                job.pending += 1
            else:
                job.failed = True
        if job.pending == 0:
            self._finish(job_id, job, not job.failed)

    def _collect(self) -> None:
        writes, reads = self.store.poll()
        for kb, c, ok in writes:
            wid = self._writes.pop((kb, c), None)
            self._done(wid, kb, ok)
        for kb, c, ok in reads:
            ids = self._reads.get((kb, c))
            if not ids:
                continue
            rid = ids.pop(0)
            if not ids:
                del self._reads[(kb, c)]
            self._done(rid, kb, ok)

    def _done(self, job_id: JobId | None, kb: bytes, ok: bool) -> None:
        if job_id is None:
            return
        job = self._jobs.get(job_id)
        if job is None:
            return
        job.pending -= 1
        if ok:
            job.ok_keys.extend(k for k in job.keys if bytes(k) == kb)
        else:
            job.failed = True
        if job.pending == 0:
            self._finish(job_id, job, not job.failed)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._collect()
        out, self._finished = self._finished, []
        return out

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            out, self.events = self.events, []
            return out
        return ()

    def drain_jobs(self) -> None:
        """Waits until every queued job has run (results stay for ``get_finished_jobs``)."""
        self.store.flush()
        self._collect()

    def shutdown(self) -> None:
        self.store.shutdown()

    def stats(self) -> dict[str, Any]:
        """The block store's counters and gauges: the file tier's ``disk_*``, the remote tier's
        ``remote_*`` or the object tier's ``object_*`` (``self.store.kind``; the keys of
        :data:`kvoff.tiers.METRICS`)."""
        return dict(self.store.stats())

    # --- vLLM metrics ----------------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """:data:`TIER_VLLM_METRICS`, declared to vLLM's Prometheus path (``TieringOffloadingSpec``
        merges every secondary tier's definitions)."""
        out: dict[str, OffloadingMetricMetadata] = {}
        for name, (kind, doc, _) in TIER_VLLM_METRICS.items():
            meta = OffloadingGaugeMetadata if kind == "gauge" else OffloadingCounterMetadata
            out[name] = meta(documentation=f"kvoff tier: {doc}.", labelnames=(TIER_METRIC_LABEL,))
        return out

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The increments of :data:`TIER_VLLM_METRICS` since the last call (and the gauges);
        ``TieringOffloadingManager.get_stats`` merges them into the connector's stats."""
        st = self.store.stats()
        st_py = {"vllm:kvoff_tier_lookup_hits": self._hits, "vllm:kvoff_tier_lookup_misses": self._misses}
        out = OffloadingConnectorStats()
        label = (str(self.tier_type),)
        tier = self.store.kind
        for name, (kind, _, keys) in TIER_VLLM_METRICS.items():
            key = None if keys is None else keys.get(tier, "")
            if key == "":
                continue
            value = float(st_py[name] if key is None else st.get(key, 0))
            if kind == "gauge":
                out.set_gauge(name, value, label)
                continue
            delta = value - self._seen.get(name, 0.0)
            self._seen[name] = value
            if delta:
                out.increase_counter(name, delta, label)
        return out


class kvoff(KvoffFileTier):
    """Alias of :class:`KvoffFileTier`, so that ``"type": "kvoff"`` names it."""


class KvoffRemoteTier(KvoffFileTier):
    """:class:`KvoffFileTier` under the remote tier's name (``"type": "KvoffRemoteTier"`` with
    ``remote_url``)."""


class KvoffObjectTier(KvoffFileTier):
    """:class:`KvoffFileTier` under the object tier's name (``"type": "KvoffObjectTier"`` with
    ``object_url``)."""
