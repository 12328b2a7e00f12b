"""The SGLang HiCache storage backend over one of kvoff's tiers — files, Redis/Valkey or an
S3-compatible store — through ``kvoff._native.BlockStore``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvoff import _native
from kvoff.errors import ConfigError
from kvoff.tiers import TIER_DEFAULTS, check_settings, settings_of

__all__ = ["KvoffHiCacheStorage", "storage_namespace"]

log = logging.getLogger(__name__)

#: The URLs that choose the tier (besides ``disk_path``: the file tier).
_URLS = {"remote": "remote_url", "object": "object_url"}

#: A tier's own namespace: on this surface it stands for ``namespace`` (it replaces SGLang's model
#: name, and the backend still adds each pool's geometry and the parallel layout); handed to the
#: block store as it is, it would replace all of that, and pools of one geometry (the KV pool and an
#: SWA pool) would share values.
_TIER_NAMESPACES = {"remote": "remote_namespace", "object": "object_namespace"}

#: The tiers' settings passed through to ``BlockStore`` as they are (:data:`kvoff.tiers.SETTINGS`,
#: those the block store takes), checked when the backend is built.
_TIER_SETTINGS = tuple(
    n
    for kind in ("disk", "remote", "object")
    for n in settings_of(kind, "store")
    if n not in _URLS.values() and n not in _TIER_NAMESPACES.values()
)

#: Settings read from ``--hicache-storage-backend-extra-config`` (besides SGLang's own keys).
SETTINGS = (
    "disk_path",
    "disk_bytes_to_use",
    "namespace",
    "slots",
    "owner",
    *_URLS.values(),
    *_TIER_NAMESPACES.values(),
    *_TIER_SETTINGS,
)

#: How long ``batch_exists`` waits for the server's answers about keys the index does not know
#: (``remote_timeout_s`` / ``object_timeout_s``; the file tier's index knows every file: no wait).
_LOOKUP_WAIT = {"remote": "remote_timeout_s", "object": "object_timeout_s"}

#: Where this backend's defaults differ from the block store's (``kvoff.tiers.TIER_DEFAULTS``):
#: a ``batch_set`` queues up to ``slots`` (512) pages at once, so the queue holds more than that
#: and a full batch is never dropped.
_SURFACE_DEFAULTS: dict[str, Any] = {"max_queued_writes": 4096}


def storage_namespace(
    cfg: HiCacheStorageConfig, pool: Any, namespace: str | None = None
) -> tuple[str, int, int]:
    """``(namespace, rank, world_size)`` of a rank's files.

    The namespace holds the model (``namespace`` overrides SGLang's model name), the page size,
    the host pool's layout, dtype and geometry, and the parallel layout; MHA ranks hold different
    heads, so each TP rank is its own kvoff rank; MLA's KV is the same on every rank, so they
    share one file per page (rank 0 of 1). With the file tier's fingerprint over them, pages of
    different models, page sizes, layouts or ranks never mix.
    """
    model = namespace if namespace is not None else (cfg.model_name or "")
    geometry = (
        f"{type(pool).__name__}|{pool.layout}|{pool.dtype}|page{pool.page_size}"
        f"|layers{getattr(pool, 'layer_num', getattr(pool, 'num_mamba_layers', ''))}"
        f"|{getattr(pool, 'head_num', '')}x{getattr(pool, 'head_dim', '')}"
        f"x{getattr(pool, 'v_head_dim', getattr(pool, 'kv_lora_rank', ''))}"
    )
    par = f"pp{cfg.pp_rank}/{cfg.pp_size}|cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}|dcp{cfg.dcp_rank}/{cfg.dcp_size}"
    if cfg.is_mla_model:
        return f"sglang|{model}|mla|{geometry}|{par}", 0, 1
    return f"sglang|{model}|tp{cfg.tp_size}|{geometry}|{par}|dp{cfg.dp_rank}", cfg.tp_rank, cfg.tp_size


@dataclass
class _Stats:
    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


@dataclass
class _PoolStore:
    """A registered host pool (v2) and the block store of its pages."""

    pool: Any
    store: Any
    page_bytes: int
    page_size: int
    #: Replicated across TP ranks (MLA): only SGLang's storage writer writes.
    replicated: bool
    #: Through SGLang's flat data pages (no zero-copy page description for this pool).
    flat: bool = False


class KvoffHiCacheStorage(HiCacheStorage):
    """SGLang's L3 storage on one of kvoff's tiers: files, Redis/Valkey or an S3-compatible store.

    Built by SGLang's ``StorageBackendFactory`` (``dynamic`` backend) as
    ``KvoffHiCacheStorage(storage_config, kwargs)``; the tier is opened when SGLang registers the
    host pool (the page's bytes are known then). Settings, from the extra config — exactly one of
    ``disk_path``, ``remote_url`` and ``object_url`` chooses the tier:

    - ``disk_path`` (``file_storage_path`` also accepted): directory of the files; or
    - ``remote_url`` instead: kvoff's remote tier on Redis/Valkey (``redis://``, ``rediss://``,
      ``redis+cluster://``; docs/tier.md "Remote tier"), with ``remote_cluster``, ``remote_ttl_s``,
      ``remote_timeout_s`` (2.0; also the most ``batch_exists`` waits for the server),
      ``remote_connect_timeout_s``, ``remote_max_inflight_bytes``, ``remote_negative_ttl_s``,
      ``remote_max_fetch_keys``, ``remote_password_env``, ``remote_tls_ca_file`` (a PEM CA for
      ``rediss://``), ``remote_io_threads`` (default ``io_threads``), ``remote_max_queued_writes``,
      ``remote_idle_spin_s``, ``remote_idle_nap_s``; or
    - ``object_url`` instead (``s3://bucket/prefix``): kvoff's object tier on an S3-compatible
      store (AWS S3, SeaweedFS, MinIO, Ceph RGW; docs/tier.md "Object tier"), with
      ``object_endpoint`` (default ``$AWS_ENDPOINT_URL``, else AWS), ``object_region``,
      ``object_bytes_to_use`` (this rank's byte budget in the namespace per pool; default
      ``disk_bytes_to_use``'s), ``object_ttl_s``, ``object_timeout_s`` (5.0; also the most
      ``batch_exists`` waits for the store's answers), ``object_connect_timeout_s``,
      ``object_max_retries``, ``object_io_threads``, ``object_max_requests``,
      ``object_max_queued_writes``, ``object_max_inflight_bytes``, ``object_negative_ttl_s``,
      ``object_list_interval_s``, ``object_multipart_bytes``, ``object_profile``. Credentials come
      from ``$AWS_ACCESS_KEY_ID``/``$AWS_SECRET_ACCESS_KEY`` or a profile, never from this config.
    - Every block-store setting of :data:`kvoff.tiers.SETTINGS` is read, and checked by the block
      store's reader when the backend is built (a :class:`kvoff.ConfigError` naming the key).
    - ``disk_bytes_to_use`` (100 GiB): capacity of this rank's own files (LRU eviction).
    - ``namespace``: replaces SGLang's model name in the namespace (engines sharing pages must
      agree on it); ``remote_namespace`` / ``object_namespace`` do the same on their tier (the
      pool's geometry and the parallel layout are added to either).
    - ``io_threads`` (8), ``write_threads`` (4), ``max_queued_writes`` (4096), ``trusted_uids``,
      ``trusted_gid``, ``allow_writable_dir``, ``slots`` (512 pages
      in flight per call), ``direct_io`` (``auto``/``on``/``off``), ``fsync`` (false),
      ``rescan_interval_s`` (2.0), ``owner``.

    MLA: the KV is the same on every TP rank; only the storage writer (SGLang's
    ``is_storage_writer``, rank 0) writes, every rank reads the shared pages.

    kvoff's figures: :meth:`kvoff_stats` (the tier's rows of :data:`kvoff.tiers.METRICS`:
    ``disk_*``, ``remote_*`` or ``object_*``).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        path = extra.get("disk_path", extra.get("file_storage_path"))
        self.remote_url: str | None = extra.get("remote_url")
        self.object_url: str | None = extra.get("object_url")
        named = [
            n
            for n, given in (
                ("disk_path", bool(path)),
                ("remote_url", self.remote_url is not None),
                ("object_url", self.object_url is not None),
            )
            if given
        ]
        if len(named) > 1:
            raise ConfigError(
                "kvoff's HiCache backend is on one tier — files ('disk_path'), Redis/Valkey "
                "('remote_url') or an S3-compatible store ('object_url') — not both "
                f"({', '.join(named[:-1])} and {named[-1]} given)"
            )
        if not named:
            raise ConfigError(
                "kvoff's HiCache backend needs 'disk_path', 'remote_url' or 'object_url' in the extra config"
            )
        #: ``"disk"``, ``"remote"`` or ``"object"``: the tier of every pool's block store.
        self.kind = {"disk_path": "disk", "remote_url": "remote", "object_url": "object"}[named[0]]
        self.path = str(path) if path else None
        self.settings = {k: extra[k] for k in SETTINGS if k in extra}
        #: The tier's settings for ``BlockStore``, checked now by its own reader (a bad value fails
        #: SGLang's start, not the first registered pool).
        self.tier_settings = {**_SURFACE_DEFAULTS, **{k: extra[k] for k in _TIER_SETTINGS if k in extra}}
        namespaces = {n: extra[n] for n in _TIER_NAMESPACES.values() if n in extra}
        try:
            check_settings(
                "store",
                remote_url=self.remote_url,
                object_url=self.object_url,
                **namespaces,
                **self.tier_settings,
            )
        except (TypeError, ValueError) as e:
            raise ConfigError(f"kvoff's HiCache backend, extra config: {e}") from None
        #: What replaces SGLang's model name in each pool's namespace: the tier's own namespace,
        #: else ``namespace``, else ``None`` (the model name).
        own = namespaces.get(_TIER_NAMESPACES.get(self.kind, ""))
        self.namespace_base: str | None = own if own is not None else self.settings.get("namespace")
        # batch_exists on the remote and object tiers: keys the index does not know are asked of
        # the server (one batched round trip; HEAD requests), waiting at most this long; the file
        # tier never waits.
        wait_key = _LOOKUP_WAIT.get(self.kind)
        wait = (self.tier_settings.get(wait_key) or TIER_DEFAULTS[wait_key]) if wait_key else 0.0
        self.lookup_wait_s = float(wait)
        self.is_mla = bool(storage_config.is_mla_model)
        self.is_writer = bool(storage_config.is_storage_writer)
        self.store: Any = None
        self.namespace = ""
        self.stats_ = _Stats()
        self.enable_metrics = bool(storage_config.enable_storage_metrics)
        self.page_bytes = 0
        #: v2: one block store per registered pool (``PoolName`` value → :class:`_PoolStore`).
        self.pools: dict[str, _PoolStore] = {}
        self.logical_anchor = False

    # --- set-up ----------------------------------------------------------------------------------

    def _open(self, ns: str, page_bytes: int, dtype: str, rank: int, world: int) -> Any:
        s = self.settings
        return _native.BlockStore(
            self.path,
            int(s.get("disk_bytes_to_use", 100 << 30)),
            page_bytes,
            slots=int(s.get("slots", 512)),
            namespace=ns,
            page_sizes=[page_bytes],
            dtype=dtype,
            world_size=world,
            rank=rank,
            owner=s.get("owner"),
            remote_url=self.remote_url,
            object_url=self.object_url,
            **self.tier_settings,
        )

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        # A new attach: SGLang registers the v2 pools again after this.
        for ps in self.pools.values():
            ps.store.shutdown()
        self.pools.clear()
        if self.store is not None:
            self.store.shutdown()
            self.store = None
        if getattr(pool, "kv_buffer", True) is None:
            # A hybrid model's logical anchor owns only allocation indices; its physical pools
            # (KV included) arrive through register_mem_host_pool_v2.
            self.logical_anchor = True
            return
        self.logical_anchor = False
        page = int(pool.page_size)
        _, sizes = pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
        self.page_bytes = int(sum(int(s) for s in sizes))
        ns, rank, world = storage_namespace(self.storage_config, pool, self.namespace_base)
        self.namespace = ns
        self.store = self._open(ns, self.page_bytes, str(pool.dtype), rank, world)
        log.info(
            "kvoff HiCache storage: %s, %d bytes per page, %s layout, rank %d of %d%s",
            self.store.dir,
            self.page_bytes,
            pool.layout,
            rank,
            world,
            " (MLA, this rank writes)" if self.is_mla and self.is_writer else "",
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """v2 (hybrid models): one block store per pool, its own namespace (pool name, geometry).

        Mamba states are TP-sharded even in MLA models (each rank writes its own files); the other
        pools of an MLA model are replicated like its KV (one writer, shared files). A pool whose
        pages SGLang cannot describe for zero-copy I/O (Mamba with side states) goes through
        SGLang's flat data pages instead.
        """
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        old = self.pools.pop(name, None)
        if old is not None and old.store is not self.store:
            old.store.shutdown()
        if name == "kv" and host_pool is self.mem_pool_host and self.store is not None:
            self.pools[name] = _PoolStore(
                host_pool, self.store, self.page_bytes, int(host_pool.page_size), self.is_mla
            )
            return
        page = int(getattr(host_pool, "page_size", 1) or 1)
        flat = False
        try:
            _, sizes = host_pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
            pieces = ",".join(str(int(s)) for s in sizes)
            nbytes = int(sum(int(s) for s in sizes))
        except (NotImplementedError, ValueError):
            d = host_pool.get_dummy_flat_data_page()
            nbytes, flat = int(d.numel() * d.element_size()), True
            pieces = f"flat{nbytes}"
        sharded = name == "mamba" or not self.is_mla
        ns, rank, world = storage_namespace(self.storage_config, host_pool, self.namespace_base)
        if self.is_mla and sharded:
            # Mamba in an MLA model: each TP rank's own shard.
            cfg = self.storage_config
            ns, rank, world = ns.replace("|mla|", f"|tp{cfg.tp_size}|", 1), cfg.tp_rank, cfg.tp_size
        # The pool's name and the pieces of a page (their order and sizes) decide its bytes; a
        # Mamba pool's state shapes and dtypes too.
        shapes = "|".join(
            f"{a}={getattr(host_pool, a)}"
            for a in ("temporal_state_shape", "conv_state_shapes", "temporal_dtype", "conv_dtype")
            if hasattr(host_pool, a)
        )
        ns = f"{ns}|pool={name}|pieces={pieces}|{shapes}"
        store = self._open(ns, nbytes, str(getattr(host_pool, "dtype", "")), rank, world)
        self.pools[name] = _PoolStore(host_pool, store, nbytes, page, not sharded, flat)
        if name == "kv" and self.logical_anchor:
            self.store, self.page_bytes, self.namespace = store, nbytes, ns
        log.info("kvoff HiCache storage: pool %s in %s, %d bytes per page", name, store.dir, nbytes)

    def _ready(self) -> Any:
        if self.store is None:
            raise RuntimeError("kvoff HiCache storage: no host pool registered (register_mem_pool_host)")
        return self.store

    @staticmethod
    def _keys(keys: list[str]) -> list[bytes]:
        return [k.encode() for k in keys]

    # --- v1: zero-copy against the host pool -----------------------------------------------------

    def _meta(self, keys: list[str], host_indices: torch.Tensor) -> tuple[list[int], list[int]]:
        pool = self.mem_pool_host
        if len(host_indices) != len(keys) * pool.page_size:
            raise ValueError(
                f"{len(keys)} keys for {len(host_indices)} host indices (page size {pool.page_size})"
            )
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        return [int(p) for p in ptrs], [int(s) for s in sizes]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        store = self._ready()
        if not keys:
            return []
        ptrs, sizes = self._meta(keys, host_indices)
        t0 = time.perf_counter()
        out = list(store.read_segments(self._keys(keys), ptrs, sizes))
        self._record(self.stats_.prefetch_pgs, self.stats_.prefetch_bandwidth, sum(out), t0)
        return out

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        store = self._ready()
        if not keys:
            return []
        if self.is_mla and not self.is_writer:
            # One writer for MLA's replicated KV (SGLang's rule); the others read its files.
            return [True] * len(keys)
        ptrs, sizes = self._meta(keys, host_indices)
        t0 = time.perf_counter()
        out = list(store.write_segments(self._keys(keys), ptrs, sizes))
        self._record(self.stats_.backup_pgs, self.stats_.backup_bandwidth, sum(out), t0)
        return out

    def _record(self, pgs: list[int], bw: list[float], n: int, t0: float) -> None:
        if not self.enable_metrics or n == 0:
            return
        dt = max(time.perf_counter() - t0, 1e-9)
        pgs.append(n)
        bw.append(n * self.page_bytes / dt / 1e9)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Leading run of stored pages, from kvoff's in-memory index (no I/O on the file tier; the
        remote tier asks the server about keys its index does not know, one batched round trip
        bounded by ``remote_timeout_s``; the object tier HEADs them, bounded by
        ``object_timeout_s``)."""
        return int(self._ready().leading_run(self._keys(keys), self.lookup_wait_s)) if keys else 0

    def exists(self, key: str) -> bool:
        return bool(self._ready().contains_many([key.encode()], self.lookup_wait_s)[0])

    # --- v2: hybrid models (several host pools: KV, Mamba, SWA, ...) ------------------------------

    def _pool(self, name: Any) -> _PoolStore:
        n = str(name)
        ps = self.pools.get(n)
        if ps is None and n == "kv" and self.store is not None and not self.logical_anchor:
            ps = self.pools[n] = _PoolStore(
                self.mem_pool_host,
                self.store,
                self.page_bytes,
                int(self.mem_pool_host.page_size),
                self.is_mla,
            )
        if ps is None:
            raise ValueError(
                f"kvoff HiCache storage: pool {n!r} is not registered (register_mem_host_pool_v2)"
            )
        return ps

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None, extra_info: Any = None
    ) -> PoolTransferResult:
        """The usable prefix over the KV pages and every extra pool's hit policy, from kvoff's
        in-memory indexes (no I/O): ``all_pages`` needs each page of the prefix, ``trailing_pages``
        the last ``len(transfer.keys)`` pages before each stop point (SGLang's semantics, as its
        ``file`` backend)."""
        if self.logical_anchor and "kv" not in self.pools:
            kv_pages = len(keys)
        else:
            kv_pages = (
                int(self._pool("kv").store.leading_run(self._keys(keys), self.lookup_wait_s)) if keys else 0
            )
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            have = list(
                self._pool(t.name).store.contains_many(self._keys(keys[:kv_pages]), self.lookup_wait_s)
            )
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = have.index(False) if False in have else kv_pages
                ok = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(t.keys) if t.keys else 1)
                ok = {n for n in range(1, kv_pages + 1) if all(have[max(0, n - trailing) : n])}
                boundary = max(ok, default=0)
            else:
                raise ValueError(f"kvoff HiCache storage: unsupported pool hit policy {t.hit_policy}")
            if boundary:
                hits[t.name] = boundary
            restorable = [n for n in restorable if n in ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def _io_v2(self, transfers: list[PoolTransfer], write: bool) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            ps = self._pool(t.name)
            keys = list(t.keys or [])
            idx = t.host_indices
            if idx is None or int(idx.numel()) != len(keys) * ps.page_size:
                raise ValueError(
                    f"kvoff HiCache storage: pool {t.name}: {len(keys)} keys for "
                    f"{0 if idx is None else int(idx.numel())} host indices (page size {ps.page_size})"
                )
            if not keys:
                out[t.name] = []
                continue
            if write and ps.replicated and not self.is_writer:
                out[t.name] = [True] * len(keys)
                continue
            t0 = time.perf_counter()
            if ps.flat:
                res = self._flat_io(ps, keys, idx, write)
            else:
                p, s = ps.pool.get_page_buffer_meta(idx)
                ptrs, sizes = [int(x) for x in p], [int(x) for x in s]
                op = ps.store.write_segments if write else ps.store.read_segments
                res = list(op(self._keys(keys), ptrs, sizes))
            if t.name == PoolName.KV or str(t.name) == "kv":
                st = self.stats_
                pgs, bw = (
                    (st.backup_pgs, st.backup_bandwidth)
                    if write
                    else (st.prefetch_pgs, st.prefetch_bandwidth)
                )
                self._record(pgs, bw, sum(res), t0)
            out[t.name] = res
        return out

    def _flat_io(self, ps: _PoolStore, keys: list[str], idx: torch.Tensor, write: bool) -> list[bool]:
        """A pool without zero-copy page description: SGLang's flat data pages as staging."""
        starts = [int(i) for i in idx.reshape(-1, ps.page_size)[:, 0].tolist()]
        if write:
            pages = [ps.pool.get_data_page(i, flat=True).contiguous() for i in starts]
            return list(
                ps.store.write_segments(
                    self._keys(keys), [int(t.data_ptr()) for t in pages], [ps.page_bytes] * len(pages)
                )
            )
        pages = [ps.pool.get_dummy_flat_data_page().contiguous().clone() for _ in starts]
        res = list(
            ps.store.read_segments(
                self._keys(keys), [int(t.data_ptr()) for t in pages], [ps.page_bytes] * len(pages)
            )
        )
        for ok, i, t in zip(res, starts, pages, strict=True):
            if ok:
                ps.pool.set_from_flat_data_page(i, t)
        return res

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[str, list[bool]]:
        """Reads each transfer's pages into its pool's host slots; per pool, per page, whether its
        bytes arrived (checked before they land)."""
        return self._io_v2(transfers, write=False)

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[str, list[bool]]:
        """Writes each transfer's pages from its pool's host slots; per pool, per page, whether it
        is stored."""
        return self._io_v2(transfers, write=True)

    # --- the older tensor interface (a page as one flat tensor) -----------------------------------

    def _flat(self, t: torch.Tensor) -> tuple[list[int], list[int]]:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("kvoff HiCache storage: a page tensor must be contiguous host memory")
        n = t.numel() * t.element_size()
        if n != self.page_bytes:
            raise ValueError(f"a page tensor of {n} bytes, pages are {self.page_bytes}")
        return [int(t.data_ptr())], [n]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        store = self._ready()
        t = target_location
        if t is None:
            t = self.mem_pool_host.get_dummy_flat_data_page()
        p, s = self._flat(t)
        return t if store.read_segments([key.encode()], p, s)[0] else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        locs = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, locs, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        store = self._ready()
        if self.is_mla and not self.is_writer:
            return True
        if value is None:
            return False
        p, s = self._flat(value)
        return bool(store.write_segments([key.encode()], p, s)[0])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if values is None:
            return False
        return all(self.set(k, v) for k, v in zip(keys, values, strict=True))

    # --- housekeeping ----------------------------------------------------------------------------

    def clear(self) -> None:
        """SGLang's cache flush: kvoff's pages stay (they are shared and checked); nothing to do."""

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per prefetch and backup since the last call),
        when ``--enable-cache-report``/storage metrics are on; ``None`` otherwise."""
        if not self.enable_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        st = self.stats_
        m.prefetch_pgs.extend(st.prefetch_pgs)
        m.backup_pgs.extend(st.backup_pgs)
        m.prefetch_bandwidth.extend(st.prefetch_bandwidth)
        m.backup_bandwidth.extend(st.backup_bandwidth)
        self.stats_ = _Stats()
        return m

    def kvoff_stats(self, pool: str | None = None) -> dict[str, Any]:
        """kvoff's counters and gauges for this rank's KV pages, or for a v2 pool's
        (``pool="mamba"``, ...): the block store's ``stats()``, under the keys of the tier's rows of
        :data:`kvoff.tiers.METRICS` (``disk_*``, ``remote_*`` or ``object_*``, as ``self.kind``)."""
        if pool is not None:
            return dict(self._pool(pool).store.stats())
        return dict(self._ready().stats())

    def close(self) -> None:
        for ps in self.pools.values():
            ps.store.shutdown()
        if self.store is not None:
            self.store.shutdown()
