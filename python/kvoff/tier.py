"""The file tier behind host memory (docs/spec.md §9): offloaded blocks kept as files on local NVMe or a
shared filesystem, persistent across restarts and shared between engines.

:class:`TieredOffloadingManager` is an offloading manager (the docs/spec.md §2 protocol and types) with a
directory of files behind its host blocks:

- a block stored in host memory is also written to a file (write-through after ``complete_store``;
  the host block is pinned only while an I/O thread copies it out);
- a lookup that misses host memory but finds a valid file answers ``None`` ("pending", retry) and
  promotes the file into a host block in the background; the next lookup answers ``True`` and the
  block loads through the normal handlers;
- at start the directory's files are indexed (a restart is warm); several engines may share the
  directory (their files become visible at the next rescan, every ``rescan_interval_s``);
- a file whose header or checksum does not match is never served (a miss; removed; counted);
- ``disk_bytes_to_use`` bounds the bytes of the files this instance wrote (least recently used
  removed first);
- I/O errors (full disk, permissions) are counted in ``get_stats()`` and the store is skipped; a
  directory that cannot be used is a :class:`kvoff.ConfigError` at construction.

With ``remote_url`` (docs/tier.md "Remote tier") a Redis/Valkey server or Cluster sits behind the
files (or directly behind host memory without ``disk_path``): stored blocks are written there too
(each tier with its own store threshold and bounded queue), and a lookup that misses host memory
and the files answers ``None`` while one batched fetch of the following keys of the prefix runs in
the background; found values are promoted like files, misses are remembered for
``remote_negative_ttl_s``. No call waits on the network; a server that is slow or gone turns into
misses and failed stores, counted in the ``remote_*`` stats (see :data:`REMOTE_METRICS`).

With ``object_url`` (docs/tier.md "Object tier") an S3-compatible store sits last: capacity priced
like disk, shared by a fleet, surviving every engine. Its index is in memory (this engine's writes,
listings of the namespace in the background, HEAD fetches started by lookups); the namespace stays
within ``object_bytes_to_use`` (least-recently-used values deleted); values are checked and a bad
one is never served. Counted in the ``object_*`` stats (:data:`kvoff.tiers.METRICS` ``["object"]``).

The host memory is a :class:`kvoff.HostRegion` (one rank's slot of each row holds a block), e.g. the
``region`` of :class:`kvoff.CpuGpuOffloadingHandlers`. Shut the manager down before closing the
region: its I/O threads copy into the region until then (the manager keeps the region's memory
mapped until its ``shutdown``, so closing the region first never unmaps it under them).

The directory is a shared place: only regular files and directories of trusted owners are used, and
every other entry found there is skipped and counted (``disk_rejected_files``); see docs/tier.md
"Trust".
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from kvoff._names import DirectIoName, PolicyName
from kvoff._native import (
    ChainManagerCore,
    CPULoadStoreSpec,
    HostRegion,
    OffloadingEvent,
    PrepareStoreOutput,
    bench_disk,
)
from kvoff.errors import ConfigError
from kvoff.tiers import METRICS, TIER_DEFAULTS

__all__ = [
    "DISK_METRICS",
    "REMOTE_HEADER_BYTES",
    "REMOTE_METRICS",
    "TieredOffloadingManager",
    "bench_disk",
    "bench_disk_rows",
    "disk_file_bytes",
    "format_disk_rows",
]

#: Stats keys of the disk tier and the Prometheus names a metrics exporter should give them
#: (``kvoff_disk_*``; counters end in ``_total``), with their help: a view of
#: :data:`kvoff.tiers.METRICS` ``["disk"]``.
DISK_METRICS: dict[str, tuple[str, str]] = {
    m.key: (m.prometheus, m.help) for m in METRICS["disk"] if "manager" in m.surfaces
}


def disk_file_bytes(block_bytes: int) -> int:
    """Bytes of the tier file of one block of ``block_bytes``: a 4 KiB header, then the block
    rounded up to 4 KiB (docs/tier.md "Pieces", file format; ``tier::format::file_len`` in the crate). A
    ``disk_bytes_to_use`` of ``n`` times this holds ``n`` blocks."""
    if block_bytes < 0:
        raise ValueError(f"block_bytes must be >= 0, got {block_bytes}")
    return 4096 + -(-block_bytes // 4096) * 4096


#: Bytes of the header in front of each block on a Redis/Valkey server (docs/tier.md "Remote tier":
#: a tier file's header unpadded, with room for the longest key): a value is this plus the block.
REMOTE_HEADER_BYTES = 1096

#: Stats keys of the remote tier and their Prometheus names (``kvoff_remote_*``; counters end in
#: ``_total``; GB/s per direction = bytes / seconds): a view of :data:`kvoff.tiers.METRICS` ``["remote"]``.
REMOTE_METRICS: dict[str, tuple[str, str]] = {
    m.key: (m.prometheus, m.help) for m in METRICS["remote"] if "manager" in m.surfaces
}

#: The defaults (one source: the crate's configs through ``kvoff._native.TIER_DEFAULTS``).
_D = TIER_DEFAULTS


def _check_tiers(
    disk_path: object, disk_bytes_to_use: object, remote_url: object, object_url: object, object_settings: Any
) -> None:
    """Which tiers the arguments name: at least one, each with what it needs."""
    if remote_url is None and object_url is None and (disk_path is None or disk_bytes_to_use is None):
        raise ConfigError(
            "TieredOffloadingManager needs disk_path and disk_bytes_to_use, remote_url or object_url"
        )
    for k in object_settings:
        if not k.startswith("object_"):
            raise TypeError(f"TieredOffloadingManager() got an unexpected keyword argument {k!r}")
    if remote_url is not None and not isinstance(remote_url, str):
        raise ConfigError(f"remote_url must be a string, got {type(remote_url).__name__}")
    if disk_path is not None and disk_bytes_to_use is None:
        raise ConfigError("disk_bytes_to_use is required with disk_path")


class TieredOffloadingManager:
    """An LRU/ARC offloading manager with a file tier, a remote tier or both behind it (see the module docs).

    Args:
        policy: ``"lru"`` or ``"arc"``.
        num_blocks: host capacity in CPU blocks.
        region: the host memory (:class:`kvoff.HostRegion`); block ``b`` is ``block_bytes`` at
            offset ``rank * slot_bytes`` of row ``b`` (``rank=None``: offset 0, up to all ranks'
            slots, one file per block for the whole engine; e.g. the scheduler's
            :meth:`HostRegion.attach` view of a vLLM engine's region).
        disk_path: directory of the files (created if missing; shared by engines); ``None``: no
            file tier (then ``remote_url`` or ``object_url`` is required).
        disk_bytes_to_use: bytes of files this instance may own (required with ``disk_path``).
        block_bytes: bytes of one block of this rank (default: the region's slot).
        rank: this process's rank (its slot and file names), or ``None`` for every rank's slot.
        namespace: model / cache id; engines with different namespaces never share files.
        page_sizes, block_size_factor, dtype, world_size: the layout, part of the fingerprint.
        block_size, enable_events, store_threshold, max_tracker_size: as for the host managers.
        disk_store_threshold: write a block to disk only once it was stored this many times (< 2:
            always).
        io_threads, write_threads (most I/O threads writing at once), max_queued_writes, fsync,
        direct_io (``"auto"``, ``"on"``, ``"off"``),
        rescan_interval_s (``None``: index only at start), owner: see ``kvoff::tier::TierConfig``.
        trusted_uids, trusted_gid: users and a group besides this one whose files and directories
            the tier trusts (a directory shared by several users); allow_writable_dir: accept
            directories writable by untrusted users without the sticky bit (docs/tier.md "Trust").
        remote_url: ``redis://[user:password@]host:port``, ``rediss://…`` (TLS),
            ``redis+cluster://host:port[,host:port]`` (a Cluster's seed nodes) or ``None`` (no
            remote tier). A password missing from the URL is read from ``remote_password_env``
            (default ``KVOFF_REMOTE_PASSWORD``); it is never printed.
        remote_cluster: treat a ``redis://`` URL as a Cluster's seed node.
        remote_namespace: the remote tier's namespace (default: ``namespace``).
        remote_store_threshold: write a block to the server only once it was stored this many
            times (< 2: always).
        remote_ttl_s: time to live of each value (``None``: none).
        remote_connect_timeout_s, remote_timeout_s: timeouts of each connection attempt, and the
            deadline for writing a node's pipeline and again for reading all its replies
            (docs/tier.md "Faults").
        remote_io_threads (one connection each; ``None``: 4), remote_idle_spin_s (how long an
            I/O thread that ran out of jobs looks for more before it sleeps, 0 to 0.01 s;
            ``None``: 50 µs on a machine with 8 or more CPUs, 0 below), remote_idle_nap_s (after
            that, how often one idle I/O thread looks for jobs, sleeping between looks, for up to
            50 ms after its last job, so that a lookup after a scheduler's step needs no wake-up
            either; 0 to 0.01 s, 0: never; ``None``: 100 µs on 8 or more CPUs, 0 below),
            remote_max_queued_writes,
        remote_max_inflight_bytes, remote_negative_ttl_s (how long a miss is remembered),
        remote_max_fetch_keys (keys per batched fetch): see ``kvoff::tier::remote::RemoteConfig``.
        remote_tls_ca_file: PEM file of the certificate authority that signed the servers'
            certificates, for ``rediss://`` (``None``: the system's roots); a
            :class:`kvoff.ConfigError` with a ``redis://`` URL or a file that cannot be read.
        object_url: ``s3://bucket/prefix`` of an S3-compatible store (AWS S3, SeaweedFS, MinIO…)
            behind the other tiers (docs/tier.md "Object tier"), or ``None``; credentials come
            from ``$AWS_ACCESS_KEY_ID``/``$AWS_SECRET_ACCESS_KEY`` or a profile of the shared
            credentials file, never printed.
        object_bytes_to_use: byte budget of this rank's values in the namespace (required with
            ``object_url``); least-recently-used values are deleted to stay within it.
        object_settings: the object tier's other ``object_*`` settings (``object_endpoint``,
            ``object_namespace``, ``object_store_threshold``, ``object_ttl_s``, timeouts and
            bounds): :data:`kvoff.tiers.SETTINGS` ``["object"]`` lists them with their defaults.

    Raises:
        TypeError: an argument of the wrong type (``bool`` is not an int; ``disk_path`` is a
            ``str`` or ``os.PathLike``, never ``bytes``).
        ValueError: an argument out of range.
        kvoff.ConfigError: a directory that cannot be used or is not trusted.
    """

    def __init__(
        self,
        policy: PolicyName,
        num_blocks: int,
        region: HostRegion,
        disk_path: str | os.PathLike[str] | None = None,
        disk_bytes_to_use: int | None = None,
        *,
        block_bytes: int | None = None,
        rank: int | None = 0,
        namespace: str = "",
        page_sizes: Sequence[int] = (),
        block_size_factor: int = 1,
        dtype: str = "",
        world_size: int | None = None,
        block_size: int = _D["block_size"],
        enable_events: bool = False,
        store_threshold: int = _D["store_threshold"],
        max_tracker_size: int = _D["max_tracker_size"],
        disk_store_threshold: int = _D["disk_store_threshold"],
        io_threads: int = _D["io_threads"],
        write_threads: int = _D["write_threads"],
        max_queued_writes: int = _D["max_queued_writes"],
        fsync: bool = False,
        direct_io: DirectIoName = _D["direct_io"],
        rescan_interval_s: float | None = _D["rescan_interval_s"],
        owner: str | None = None,
        max_promotions: int = _D["max_promotions"],
        trusted_uids: Sequence[int] = (),
        trusted_gid: int | None = None,
        allow_writable_dir: bool = False,
        remote_url: str | None = None,
        remote_cluster: bool = False,
        remote_namespace: str | None = None,
        remote_store_threshold: int = _D["remote_store_threshold"],
        remote_ttl_s: float | None = None,
        remote_connect_timeout_s: float = _D["remote_connect_timeout_s"],
        remote_timeout_s: float = _D["remote_timeout_s"],
        remote_io_threads: int | None = None,
        remote_max_queued_writes: int = _D["remote_max_queued_writes"],
        remote_max_inflight_bytes: int = _D["remote_max_inflight_bytes"],
        remote_negative_ttl_s: float = _D["remote_negative_ttl_s"],
        remote_max_fetch_keys: int = _D["remote_max_fetch_keys"],
        remote_password_env: str = _D["remote_password_env"],
        remote_tls_ca_file: str | os.PathLike[str] | None = None,
        remote_idle_spin_s: float | None = None,
        remote_idle_nap_s: float | None = None,
        object_url: str | None = None,
        object_bytes_to_use: int | None = None,
        **object_settings: Any,
    ) -> None:
        for name, v in (("num_blocks", num_blocks), ("block_bytes", block_bytes), ("rank", rank)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if disk_path is not None and (
            not isinstance(disk_path, (str, os.PathLike)) or isinstance(os.fspath(disk_path), bytes)
        ):
            raise TypeError(
                f"disk_path must be a str or an os.PathLike of str, got {type(disk_path).__name__}"
            )
        if not isinstance(region, HostRegion):
            raise TypeError(f"region must be a kvoff.HostRegion, got {type(region).__name__}")
        if region.closed:
            raise ValueError("the host region is closed")
        ws = region.world_size if world_size is None else world_size
        if rank is None:
            # Every rank's slot: the block is the row's first world_size × slot_bytes bytes.
            offset, limit, what = 0, region.world_size * region.slot_bytes, "the row's slots"
        elif 0 <= rank < region.world_size:
            offset, limit, what = rank * region.slot_bytes, region.slot_bytes, "the slot"
        else:
            raise ValueError(f"rank {rank} out of range for a region of {region.world_size} ranks")
        nbytes = limit if block_bytes is None else block_bytes
        if not 0 < nbytes <= limit:
            raise ValueError(f"block_bytes must be in 1..{limit} ({what}), got {nbytes}")
        if num_blocks > region.num_cpu_blocks:
            raise ValueError(f"num_blocks = {num_blocks} but the region holds {region.num_cpu_blocks} blocks")
        self.region = region
        self.block_size = block_size
        _check_tiers(disk_path, disk_bytes_to_use, remote_url, object_url, object_settings)
        # One tiered manager over every tier (docs/tier.md "Tier chain"): files, then the remote store.
        self._core = ChainManagerCore(
            policy,
            num_blocks,
            disk_path,
            disk_bytes_to_use,
            region.ptr + offset,
            region.num_cpu_blocks,
            region.row_stride_bytes,
            nbytes,
            region,
            namespace=namespace,
            page_sizes=list(page_sizes),
            block_size_factor=block_size_factor,
            dtype=dtype,
            world_size=ws,
            rank=0 if rank is None else rank,
            block_size=block_size,
            enable_events=enable_events,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            disk_store_threshold=disk_store_threshold,
            io_threads=io_threads,
            write_threads=write_threads,
            max_queued_writes=max_queued_writes,
            fsync=fsync,
            direct_io=direct_io,
            rescan_interval_s=rescan_interval_s,
            owner=owner,
            max_promotions=max_promotions,
            trusted_uids=list(trusted_uids),
            trusted_gid=trusted_gid,
            allow_writable_dir=allow_writable_dir,
            remote_url=remote_url,
            remote_cluster=remote_cluster,
            remote_namespace=remote_namespace,
            remote_store_threshold=remote_store_threshold,
            remote_ttl_s=remote_ttl_s,
            remote_connect_timeout_s=remote_connect_timeout_s,
            remote_timeout_s=remote_timeout_s,
            remote_io_threads=remote_io_threads,
            remote_max_queued_writes=remote_max_queued_writes,
            remote_max_inflight_bytes=remote_max_inflight_bytes,
            remote_negative_ttl_s=remote_negative_ttl_s,
            remote_max_fetch_keys=remote_max_fetch_keys,
            remote_password_env=remote_password_env,
            remote_tls_ca_file=remote_tls_ca_file,
            remote_idle_spin_s=remote_idle_spin_s,
            remote_idle_nap_s=remote_idle_nap_s,
            object_url=object_url,
            object_bytes_to_use=object_bytes_to_use,
            **object_settings,
        )
        # The scheduler's per-step calls go straight to the extension, whose methods take the
        # same arguments as the ones below: a Python frame in between cost a call after a
        # scheduler's pause 1 µs at its median and 4-5 µs at p99 on the H100 host (BENCHMARKS.md
        # "Remote tier").
        self.lookup = self._core.lookup  # type: ignore[method-assign]
        self.lookup_prefix = self._core.lookup_prefix  # type: ignore[method-assign]

    # --- docs/spec.md §2 protocol -------------------------------------------------------------------------

    def lookup(self, key: bytes, req_context: Any = None, after: bytes | None = None) -> bool | None:
        """``True`` ready, ``None`` pending (a store, a promotion or a fetch in flight), ``False``.

        ``after``: the key before ``key`` in its prefix, looked up just before, for a caller that
        looks a prefix up one key at a time, in order (vLLM's connector): while the tiers have not
        answered for ``after``, ``key`` waits (pending) rather than start a fetch of its own; once
        a tier is promoting ``after``, ``key`` is read straight into a host block if no tier knows
        it yet (docs/tier.md "Tier chain").
        """
        return self._core.lookup(key, after=after)

    def lookup_prefix(self, keys: Iterable[bytes], req_context: Any = None) -> int | None:
        """Leading ready keys; ``None`` when the first other key is pending or being promoted."""
        return self._core.lookup_prefix(keys)

    def prepare_load(self, keys: Iterable[bytes], req_context: Any = None) -> CPULoadStoreSpec:
        """Pins the keys for a load (all must be ready, else InvalidStateError, nothing changes)."""
        return CPULoadStoreSpec(self._core.prepare_load(list(keys)))

    def touch(self, keys: Iterable[bytes], req_context: Any = None) -> None:
        """Recency update (the first key ends most recently used)."""
        self._core.touch(list(keys))

    def complete_load(self, keys: Iterable[bytes], req_context: Any = None) -> None:
        """Unpins loaded keys."""
        self._core.complete_load(list(keys))

    def prepare_store(self, keys: Iterable[bytes], req_context: Any = None) -> PrepareStoreOutput | None:
        """docs/spec.md §2.3 over the host blocks; ``None`` when nothing can be evicted."""
        out = self._core.prepare_store(list(keys))
        if out is None:
            return None
        stored, ids, evicted = out
        return PrepareStoreOutput(stored, CPULoadStoreSpec(ids), evicted)

    def complete_store(self, keys: Iterable[bytes], success: bool = True, req_context: Any = None) -> None:
        """Finishes stores; on success the blocks are written through to the files."""
        self._core.complete_store(list(keys), success)

    def take_events(self, req_context: Any = None) -> list[OffloadingEvent]:
        """Host events in order (a promotion appears as a store)."""
        return [OffloadingEvent(k, self.block_size, "CPU", r) for k, r in self._core.take_events()]

    def get_stats(self, req_context: Any = None) -> dict[str, Any]:
        """docs/spec.md §2.2 gauges plus the ``disk_*`` counters (see :data:`DISK_METRICS`)."""
        return self._core.get_stats()

    def reset(self, req_context: Any = None) -> None:
        """Waits for disk I/O, then forgets every host key (files stay)."""
        self._core.reset()

    def shutdown(self, req_context: Any = None) -> None:
        """Waits for disk I/O and stops the I/O threads. Idempotent."""
        self._core.shutdown()

    def __len__(self) -> int:
        return len(self._core)

    @property
    def num_blocks(self) -> int:
        return self._core.num_blocks

    # --- disk tier --------------------------------------------------------------------------------

    def poll(self) -> None:
        """Applies finished disk I/O (every other call does this too). Never blocks."""
        self._core.poll()

    def flush(self) -> None:
        """Waits until the queued disk I/O has run and applies it (tests, tools; not for a scheduler)."""
        self._core.flush()

    @property
    def disk_dir(self) -> str | None:
        """The directory holding this layout's files (``None`` without a file tier)."""
        return self._core.disk_dir

    def disk_path_of(self, key: bytes) -> str:
        """Path of a key's file, whether or not it exists (InvalidStateError without a file tier)."""
        return self._core.disk_path_of(key)

    def disk_contains(self, key: bytes) -> bool:
        """Whether a key has a published file (from the index; no I/O)."""
        return self._core.tier_index("disk", key) is True

    def disk_rescan(self) -> None:
        """Lists the directory now: files of other engines become visible (InvalidStateError
        without a file tier)."""
        self._core.disk_rescan()

    # --- remote tier ------------------------------------------------------------------------------

    @property
    def remote_url(self) -> str | None:
        """The remote URL with its password hidden (``None`` without a remote tier)."""
        return self._core.remote_url

    def remote_known(self, key: bytes) -> bool | None:
        """What the remote tier's in-memory index knows (no I/O): ``True`` present, ``False``
        absent or remembered miss, ``None`` unknown (the next lookup fetches it)."""
        return self._core.tier_index("remote", key)

    def __enter__(self) -> TieredOffloadingManager:  # noqa: PYI034 (Self needs typing_extensions on 3.10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


# --- benchmark ------------------------------------------------------------------------------------

#: Layouts of ``kvoff bench disk``: (name, page sizes).
DISK_LAYOUTS: list[tuple[str, list[int]]] = [
    ("2MiB", [2 << 20]),
    ("llama3-8b", [32 << 10] * 64),
    ("64x4KiB", [4 << 10] * 64),
]


def bench_disk_rows(
    dir: str,
    num_blocks: int = 256,
    reps: int = 5,
    io_threads: int = _D["io_threads"],
    direct_io: DirectIoName = _D["direct_io"],
) -> list[dict[str, Any]]:
    """Runs :func:`bench_disk` for every layout of :data:`DISK_LAYOUTS` (the 4 KiB-page layout with
    8× as many blocks, so that every layout moves the same bytes)."""
    rows = []
    for name, pages in DISK_LAYOUTS:
        n = num_blocks * 8 if sum(pages) < (1 << 20) else num_blocks
        rows.append(bench_disk(dir, name, pages, n, reps, io_threads, direct_io))
    return rows


def format_disk_rows(rows: list[dict[str, Any]]) -> str:
    """A table of :func:`bench_disk_rows` results."""
    head = (
        f"{'layout':<10} {'block':>9} {'direct':>6} {'fill_w':>7} {'tier_w':>7} {'seq_w':>7} {'scat_w':>7} "
        f"{'w%':>5} {'tier_r':>7} {'seq_r':>7} {'scat_r':>7} {'r%':>5} {'prom_p50':>9} {'prom_p90':>9} {'cpu_w':>7} {'cpu_r':>7} "
        f"{'cpu_seq':>7} {'lookup':>7}"
    )
    note = (
        "(GB/s = 1e9 B/s; w%/r% = tier / same-run sequential O_DIRECT (one thread); scat = the same "
        "bytes as block-size O_DIRECT requests at shuffled offsets from io_threads threads; cpu in us "
        "per block; lookup = scheduler ns per key that hits a file)"
    )
    lines = [head, note]
    for r in rows:
        lines.append(
            f"{r['label']:<10} {r['block_bytes']:>9} {r['direct_io']!s:>6} {r['fill_write_gbps']:>7.2f} "
            f"{r['tier_write_gbps']:>7.2f} {r['seq_write_gbps']:>7.2f} {r['scattered_write_gbps']:>7.2f} "
            f"{100 * r['write_ratio']:>5.0f} {r['tier_read_gbps']:>7.2f} {r['seq_read_gbps']:>7.2f} "
            f"{r['scattered_read_gbps']:>7.2f} {100 * r['read_ratio']:>5.0f} "
            f"{r['promotion_p50_us']:>7.0f}us {r['promotion_p90_us']:>7.0f}us "
            f"{r['write_cpu_us_per_block']:>7.0f} {r['read_cpu_us_per_block']:>7.0f} "
            f"{r['seq_cpu_us_per_block']:>7.0f} {r['lookup_hit_ns_per_key']:>5.0f}ns"
        )
    return "\n".join(lines)
