"""The SGLang HiCache storage backend over kvoff's file tier (``kvoff._native.BlockStore``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvoff import _native
from kvoff._names import DirectIoName
from kvoff.errors import ConfigError

__all__ = ["KvoffHiCacheStorage", "storage_namespace"]

log = logging.getLogger(__name__)

#: Settings read from ``--hicache-storage-backend-extra-config`` (besides SGLang's own keys).
SETTINGS = (
    "disk_path",
    "disk_bytes_to_use",
    "namespace",
    "io_threads",
    "write_threads",
    "max_queued_writes",
    "slots",
    "direct_io",
    "fsync",
    "rescan_interval_s",
    "owner",
)


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
        f"{type(pool).__name__}|{pool.layout}|{pool.dtype}|page{pool.page_size}|layers{pool.layer_num}"
        f"|{getattr(pool, 'head_num', '')}x{getattr(pool, 'head_dim', '')}"
        f"x{getattr(pool, 'v_head_dim', getattr(pool, 'kv_lora_rank', ''))}"
    )
    par = f"pp{cfg.pp_rank}/{cfg.pp_size}|cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}|dcp{cfg.dcp_rank}/{cfg.dcp_size}"
    if cfg.is_mla_model:
        return f"sglang|{model}|mla|{geometry}|{par}", 0, 1
    return f"sglang|{model}|tp{cfg.tp_size}|{geometry}|{par}|dp{cfg.dp_rank}", cfg.tp_rank, cfg.tp_size


def _direct(v: Any) -> DirectIoName:
    if v not in _native.DIRECT_IO:
        raise ConfigError(f"direct_io must be one of {list(_native.DIRECT_IO)}, got {v!r}")
    return cast(DirectIoName, v)


@dataclass
class _Stats:
    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


class KvoffHiCacheStorage(HiCacheStorage):
    """SGLang's L3 storage on kvoff's file tier.

    Built by SGLang's ``StorageBackendFactory`` (``dynamic`` backend) as
    ``KvoffHiCacheStorage(storage_config, kwargs)``; the files are opened when SGLang registers the
    host pool (the page's bytes are known then). Settings, from the extra config:

    - ``disk_path`` (required; ``file_storage_path`` also accepted): directory of the files.
    - ``disk_bytes_to_use`` (100 GiB): capacity of this rank's own files (LRU eviction).
    - ``namespace``: replaces SGLang's model name in the namespace (engines sharing files must
      agree on it).
    - ``io_threads`` (8), ``write_threads`` (4), ``max_queued_writes`` (4096), ``slots`` (512 pages
      in flight per call), ``direct_io`` (``auto``/``on``/``off``), ``fsync`` (false),
      ``rescan_interval_s`` (2.0), ``owner``.

    MLA: the KV is the same on every TP rank; only the storage writer (SGLang's
    ``is_storage_writer``, rank 0) writes, every rank reads the shared files.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        path = extra.get("disk_path", extra.get("file_storage_path"))
        if not path:
            raise ConfigError("kvoff's HiCache backend needs 'disk_path' in the extra config")
        self.path = str(path)
        self.settings = {k: extra[k] for k in SETTINGS if k in extra}
        self.is_mla = bool(storage_config.is_mla_model)
        self.is_writer = bool(storage_config.is_storage_writer)
        self.store: Any = None
        self.namespace = ""
        self.stats_ = _Stats()
        self.enable_metrics = bool(storage_config.enable_storage_metrics)
        self.page_bytes = 0

    # --- set-up ----------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        page = int(pool.page_size)
        _, sizes = pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
        self.page_bytes = int(sum(int(s) for s in sizes))
        ns, rank, world = storage_namespace(self.storage_config, pool, self.settings.get("namespace"))
        self.namespace = ns
        s = self.settings
        if self.store is not None:
            self.store.shutdown()
        self.store = _native.BlockStore(
            self.path,
            int(s.get("disk_bytes_to_use", 100 << 30)),
            self.page_bytes,
            slots=int(s.get("slots", 512)),
            namespace=ns,
            page_sizes=[self.page_bytes],
            dtype=str(pool.dtype),
            world_size=world,
            rank=rank,
            io_threads=int(s.get("io_threads", 8)),
            write_threads=int(s.get("write_threads", 4)),
            max_queued_writes=int(s.get("max_queued_writes", 4096)),
            fsync=bool(s.get("fsync", False)),
            direct_io=_direct(s.get("direct_io", "auto")),
            rescan_interval_s=s.get("rescan_interval_s", 2.0),
            owner=s.get("owner"),
        )
        log.info(
            "kvoff HiCache storage: %s, %d bytes per page, %s layout, rank %d of %d%s",
            self.store.dir,
            self.page_bytes,
            pool.layout,
            rank,
            world,
            " (MLA, this rank writes)" if self.is_mla and self.is_writer else "",
        )

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
        """Leading run of stored pages, from kvoff's in-memory index (no I/O)."""
        return int(self._ready().leading_run(self._keys(keys))) if keys else 0

    def exists(self, key: str) -> bool:
        return bool(self._ready().contains(key.encode()))

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
        return [self.get(k, t) for k, t in zip(keys, locs)]

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
        return all(self.set(k, v) for k, v in zip(keys, values))

    # --- housekeeping ----------------------------------------------------------------------------

    def clear(self) -> None:
        """SGLang's cache flush: kvoff's files stay (they are shared and checked); nothing to do."""

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

    def kvoff_stats(self) -> dict[str, Any]:
        """kvoff's ``disk_*`` counters and gauges for this rank's files."""
        return dict(self._ready().stats())

    def close(self) -> None:
        if self.store is not None:
            self.store.shutdown()
