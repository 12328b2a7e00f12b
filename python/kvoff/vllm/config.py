"""The one place that reads kvoff's settings from vLLM's ``kv_connector_extra_config``.

Keys are of two kinds: kvoff's own (the dataclass fields below) and the keys vLLM's offloading
connector itself reads from the same dict (``spec_name``, ``spec_module_path``, ``block_size``,
``blocks_per_chunk``, …), which are accepted and left to vLLM. Anything else is rejected with a
:class:`~kvoff.ConfigError` that lists the valid keys, so a typo never silently falls back to a
default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, cast

from kvoff import _native
from kvoff._names import DirectIoName, EngineName, PolicyName
from kvoff.errors import ConfigError
from kvoff.handlers import ENGINES
from kvoff.tiers import TIER_DEFAULTS as _D
from kvoff.tiers import check_settings, settings_of

__all__ = ["ENGINE_CHOICES", "OBJECT_KEYS", "POLICIES", "TIER_KEYS", "VLLM_KEYS", "KvoffOffloadConfig"]

POLICIES: tuple[str, ...] = _native.POLICIES
ENGINE_CHOICES = tuple(e for e in ENGINES if e != "loop")

#: Keys of ``kv_connector_extra_config`` that vLLM 0.33's offloading connector (not the spec)
#: reads; kvoff accepts them and leaves them to vLLM.
VLLM_KEYS = (
    "spec_name",
    "spec_module_path",
    "self_describing_kv_events",
    "offload_prompt_only",
    "sync_load_budget_bytes",
    "canonical_layout",
)

#: The object tier's keys: every setting of :data:`kvoff.tiers.SETTINGS` ``["object"]`` the tiered
#: manager takes, read from that table (a setting added there is a key here), checked by the
#: bindings' one reader and passed to :class:`kvoff.TieredOffloadingManager` as given.
OBJECT_KEYS: tuple[str, ...] = settings_of("object", "manager")

#: Per tier behind host memory, the key whose presence puts it there (and adds its metrics).
TIER_KEYS: dict[str, str] = {"disk": "disk_path", "remote": "remote_url", "object": "object_url"}


def _int(d: Mapping[str, Any], key: str, default: int | None, minimum: int) -> int | None:
    v = d.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be an integer, got {v!r}")
    try:
        f = float(v)
    except (ValueError, OverflowError):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be an integer, got {v!r}") from None
    if f != int(f):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be an integer, got {v!r}")
    if int(f) < minimum:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be >= {minimum}, got {v!r}")
    return int(f)


@dataclass(frozen=True)
class KvoffOffloadConfig:
    """kvoff's settings inside vLLM (``kv_connector_extra_config``).

    Attributes:
        cpu_bytes_to_use: host memory for offloaded KV, in bytes, for all ranks together
            (required; numbers such as ``8e9`` are accepted).
        eviction_policy: ``"lru"`` or ``"arc"``.
        store_threshold: a block is stored only once it has been offered this many times
            (values < 2 store everything).
        max_tracker_size: how many offered keys the store-threshold tracker remembers.
        engine: kvoff's transfer engine: ``"auto"`` (CUDA when the KV caches are on a GPU, else
            host memcpy), ``"host"``, ``"cuda"``, ``"dma"``, ``"kernel"`` or ``"staged"``.
        block_size: tokens per offloaded (CPU) block; a multiple of vLLM's GPU block size.
            vLLM derives the block size factor from it. Exclusive with ``blocks_per_chunk``.
        blocks_per_chunk: GPU blocks per offloaded block (the block size factor).
        shared_region: place the host memory of all ranks in one shared mapping in /dev/shm
            (``None``: when the engine has more than one rank).
        region_timeout_s: how long a rank waits for the others to size the shared region.
        compute_budget: the model slowdown kvoff's transfers may cost while they run beside it
            on the GPU (fraction, default 0.02; ``None``: the idle-GPU policy, fastest when
            nothing else runs). While no model work was seen for 100 ms kvoff takes the fastest
            method anyway. See ``CpuGpuOffloadingHandlers``.
        disk_path: a directory for the file tier behind host memory (local NVMe or a shared
            filesystem; ``None``: no file tier). Blocks stored in host memory are written through
            to one file per block; a lookup that misses host memory but finds a file answers
            "pending" while kvoff promotes it; the files survive restarts and can be shared by
            engines serving the same model (same ``disk_namespace`` and layout). Needs the shared
            host region (the scheduler's process attaches to it).
        disk_bytes_to_use: bytes of files this engine may own (required with ``disk_path``).
        disk_store_threshold: write a block to disk only once it was stored this many times
            (< 2: every stored block).
        disk_namespace: the id that decides which engines share files (default: the model name
            and KV dtype); engines with different namespaces never serve each other's files.
        disk_direct_io: ``"auto"`` (O_DIRECT where the filesystem allows it), ``"on"``, ``"off"``.
        disk_rescan_interval_s: how often files written by other engines are picked up (seconds;
            ``None``: only at start).
        disk_trusted_uids, disk_trusted_gid: users besides the engine's, and a group, whose files
            and directories the file tier trusts (a directory shared by several users; docs/tier.md
            "Trust").
        disk_allow_writable_dir: accept a tier directory writable by untrusted users without the
            sticky bit.
        remote_url: a Redis/Valkey server behind host memory (and the files), shared by engines
            on many machines (docs/tier.md "Remote tier"): ``redis://[user:password@]host:port``,
            ``rediss://…`` (TLS), ``redis+cluster://host:port[,host:port]`` (a Cluster); the
            password may instead be in the environment variable ``KVOFF_REMOTE_PASSWORD``. Blocks
            stored in host memory are written there too; a lookup that misses host memory (and
            the files) answers "pending" while one batched fetch runs. Needs the shared host
            region (the scheduler's process attaches to it).
        remote_cluster: treat a ``redis://`` URL as a Cluster seed node.
        remote_namespace: the id that decides which engines share values (default: the model
            name and KV dtype, like ``disk_namespace``).
        remote_store_threshold: write a block to the server only once it was stored this many
            times (< 2: every stored block).
        remote_ttl_s: time to live of each value in seconds (``None``: none).
        remote_timeout_s: deadline for writing a node's pipeline, and again for reading its
            replies (seconds, default 2; docs/tier.md "Faults").
        remote_connect_timeout_s: timeout of each connection attempt (seconds, default 1).
        remote_negative_ttl_s: how long a miss is remembered (seconds, default 2).
        remote_idle_spin_s: how long an I/O thread that ran out of jobs looks for more before it
            sleeps, so that a lookup's fetch needs no wake-up (0 to 0.01 s; default 50 µs on a
            machine with 8 or more CPUs, 0 below; 0 never spins).
        remote_idle_nap_s: after its spin, how often one idle I/O thread looks for jobs (sleeping
            between looks, for up to 50 ms after its last job), so that a lookup after a
            scheduler's step needs no wake-up either (0 to 0.01 s; default 100 µs on a machine
            with 8 or more CPUs, 0 below; 0 never naps).
        remote_tls_ca_file: PEM file of the certificate authority that signed the servers'
            certificates, for ``rediss://`` (default: the system's roots).
        remote_io_threads: I/O threads, one connection each per node (1 to 64; default 4; 16
            for Valkey >= 8 running ``io-threads`` 4 or more, docs/tier.md "Remote tier").
        object_settings: the object tier's keys as given (:data:`OBJECT_KEYS`, i.e. every
            ``object_*`` setting of :data:`kvoff.tiers.SETTINGS` ``["object"]``; empty: no object
            tier). ``object_url`` (``s3://bucket/prefix``) puts an S3-compatible store (AWS S3,
            SeaweedFS, MinIO…) last behind host memory, the files and the server (docs/tier.md
            "Object tier"): blocks stored in host memory are written there too; a lookup that misses
            the tiers before it answers "pending" while kvoff reads the value, checks it and
            promotes it. ``object_bytes_to_use`` (required with it) bounds the bytes of this
            engine's values in the namespace; ``object_namespace`` (default: the model name and KV
            dtype, like ``disk_namespace``) decides which engines share them; ``object_endpoint``
            (default ``$AWS_ENDPOINT_URL``) names a store other than AWS's. Credentials come only
            from the environment (``$AWS_ACCESS_KEY_ID``/``$AWS_SECRET_ACCESS_KEY``, or a profile of
            the shared credentials file, ``object_profile``), never from this dict; none found is a
            :class:`~kvoff.ConfigError` when the scheduler opens the tier. Needs the shared host
            region (the scheduler's process attaches to it).
    """

    cpu_bytes_to_use: int
    eviction_policy: PolicyName = "lru"
    store_threshold: int = 0
    max_tracker_size: int = _D["max_tracker_size"]
    engine: EngineName = "auto"
    block_size: int | None = None
    blocks_per_chunk: int | None = None
    shared_region: bool | None = None
    region_timeout_s: float = 60.0
    compute_budget: float | None = _native.DEFAULT_COMPUTE_BUDGET
    disk_path: str | None = None
    disk_bytes_to_use: int | None = None
    disk_store_threshold: int = _D["disk_store_threshold"]
    disk_namespace: str | None = None
    disk_direct_io: DirectIoName = _D["direct_io"]
    disk_rescan_interval_s: float | None = _D["rescan_interval_s"]
    disk_trusted_uids: tuple[int, ...] = ()
    disk_trusted_gid: int | None = None
    disk_allow_writable_dir: bool = False
    remote_url: str | None = None
    remote_cluster: bool = False
    remote_namespace: str | None = None
    remote_store_threshold: int = _D["remote_store_threshold"]
    remote_ttl_s: float | None = None
    remote_timeout_s: float = _D["remote_timeout_s"]
    remote_connect_timeout_s: float = _D["remote_connect_timeout_s"]
    remote_negative_ttl_s: float = _D["remote_negative_ttl_s"]
    remote_tls_ca_file: str | None = None
    remote_idle_spin_s: float | None = None
    remote_idle_nap_s: float | None = None
    remote_io_threads: int | None = None
    object_settings: dict[str, Any] = field(default_factory=dict)

    @property
    def uses_disk(self) -> bool:
        """Whether the file tier is configured."""
        return self.disk_path is not None

    @property
    def uses_remote(self) -> bool:
        """Whether the remote tier is configured."""
        return self.remote_url is not None

    @property
    def object_url(self) -> str | None:
        """The object tier's ``s3://bucket/prefix`` (``None``: no object tier)."""
        url: str | None = self.object_settings.get("object_url")
        return url

    @property
    def uses_object(self) -> bool:
        """Whether the object tier is configured."""
        return self.object_url is not None

    @property
    def uses_tiers(self) -> bool:
        """Whether any tier is behind host memory (the scheduler then attaches to the region)."""
        return self.uses_disk or self.uses_remote or self.uses_object

    @classmethod
    def valid_keys(cls) -> tuple[str, ...]:
        own = tuple(f.name for f in fields(cls) if f.name != "object_settings")
        return own + OBJECT_KEYS + VLLM_KEYS

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any] | None) -> KvoffOffloadConfig:
        """Reads and validates the settings.

        Raises:
            ConfigError: an unknown key (the message lists the valid ones), a missing or
                non-positive ``cpu_bytes_to_use``, or a bad value.
        """
        d = dict(extra_config or {})
        valid = cls.valid_keys()
        unknown = sorted(k for k in d if k not in valid)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown} for kvoff; valid keys: {sorted(valid)}"
            )
        if d.get("cpu_bytes_to_use") is None:
            raise ConfigError(
                "kv_connector_extra_config must set 'cpu_bytes_to_use' (host bytes for offloaded KV, all "
                'ranks together), e.g. "cpu_bytes_to_use": 8000000000'
            )
        cpu_bytes = _int(d, "cpu_bytes_to_use", None, 1)
        assert cpu_bytes is not None

        policy = d.get("eviction_policy", "lru")
        if not isinstance(policy, str) or policy.lower() not in POLICIES:
            raise ConfigError(
                f"kv_connector_extra_config['eviction_policy'] = {policy!r} is not a kvoff policy; "
                f"valid choices: {list(POLICIES)}"
            )
        engine = d.get("engine", "auto")
        if not isinstance(engine, str) or engine not in ENGINE_CHOICES:
            raise ConfigError(
                f"kv_connector_extra_config['engine'] = {engine!r} is not a kvoff engine; valid choices: "
                f"{list(ENGINE_CHOICES)}"
            )
        block_size = _int(d, "block_size", None, 1)
        blocks_per_chunk = _int(d, "blocks_per_chunk", None, 1)
        if block_size is not None and blocks_per_chunk is not None:
            raise ConfigError(
                "kv_connector_extra_config: set only one of 'block_size' (tokens per offloaded block) and "
                "'blocks_per_chunk' (GPU blocks per offloaded block)"
            )
        shared = d.get("shared_region")
        if shared is not None and not isinstance(shared, bool):
            raise ConfigError(
                f"kv_connector_extra_config['shared_region'] must be true/false, got {shared!r}"
            )
        timeout = d.get("region_timeout_s", 60.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"kv_connector_extra_config['region_timeout_s'] must be > 0, got {timeout!r}")
        if d.get("canonical_layout"):
            raise ConfigError(
                "kvoff does not support vLLM's canonical_layout; remove 'canonical_layout' from "
                "kv_connector_extra_config (or set it to false)"
            )
        budget = d.get("compute_budget", _native.DEFAULT_COMPUTE_BUDGET)
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1
        ):
            raise ConfigError(
                f"kv_connector_extra_config['compute_budget'] must be a fraction in [0, 1] or null, got {budget!r}"
            )
        budget = None if budget is None else float(budget)
        disk = _disk_settings(d, shared)
        remote = _remote_settings(d, shared)
        object_settings = _object_settings(d, shared)
        store_threshold = _int(d, "store_threshold", 0, 0)
        max_tracker_size = _int(d, "max_tracker_size", _D["max_tracker_size"], 1)
        assert store_threshold is not None and max_tracker_size is not None
        return cls(
            cpu_bytes_to_use=cpu_bytes,
            eviction_policy=cast(PolicyName, policy.lower()),  # checked above
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            engine=cast(EngineName, engine),  # checked above
            block_size=block_size,
            blocks_per_chunk=blocks_per_chunk,
            shared_region=shared,
            region_timeout_s=float(timeout),
            compute_budget=budget,
            **disk,
            **remote,
            object_settings=object_settings,
        )


def _disk_settings(d: Mapping[str, Any], shared: bool | None) -> dict[str, Any]:
    """The file tier's settings, checked."""
    path = d.get("disk_path")
    keys = [k for k in d if k.startswith("disk_") and k != "disk_path" and d[k] is not None]
    if path is None:
        if keys:
            raise ConfigError(
                f"kv_connector_extra_config: {sorted(keys)} need 'disk_path' (the file tier's directory)"
            )
        return {}
    if not isinstance(path, str) or not path:
        raise ConfigError(f"kv_connector_extra_config['disk_path'] must be a directory path, got {path!r}")
    if shared is False:
        raise ConfigError(
            "kv_connector_extra_config: the file tier ('disk_path') needs the shared host region (the "
            "scheduler's process attaches to it); remove 'shared_region': false"
        )
    if d.get("disk_bytes_to_use") is None:
        raise ConfigError(
            "kv_connector_extra_config must set 'disk_bytes_to_use' (bytes of files this engine may own) "
            "with 'disk_path'"
        )
    nbytes = _int(d, "disk_bytes_to_use", None, 1)
    threshold = _int(d, "disk_store_threshold", _D["disk_store_threshold"], 0)
    namespace = d.get("disk_namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise ConfigError(f"kv_connector_extra_config['disk_namespace'] must be a string, got {namespace!r}")
    direct = d.get("disk_direct_io", _D["direct_io"])
    if direct not in _native.DIRECT_IO:
        raise ConfigError(
            f"kv_connector_extra_config['disk_direct_io'] must be one of {list(_native.DIRECT_IO)}, "
            f"got {direct!r}"
        )
    rescan = d.get("disk_rescan_interval_s", _D["rescan_interval_s"])
    if rescan is not None and (
        isinstance(rescan, bool) or not isinstance(rescan, (int, float)) or not rescan > 0
    ):
        raise ConfigError(
            f"kv_connector_extra_config['disk_rescan_interval_s'] must be > 0 seconds or null, got {rescan!r}"
        )
    uids = d.get("disk_trusted_uids", ())
    if uids is None:
        uids = ()
    if not isinstance(uids, (list, tuple)) or not all(
        isinstance(u, int) and not isinstance(u, bool) and 0 <= u < 1 << 32 for u in uids
    ):
        raise ConfigError(
            f"kv_connector_extra_config['disk_trusted_uids'] must be a list of uids, got {uids!r}"
        )
    gid = d.get("disk_trusted_gid")
    if gid is not None and (isinstance(gid, bool) or not isinstance(gid, int) or not 0 <= gid < 1 << 32):
        raise ConfigError(f"kv_connector_extra_config['disk_trusted_gid'] must be a gid or null, got {gid!r}")
    writable = d.get("disk_allow_writable_dir", False)
    if not isinstance(writable, bool):
        raise ConfigError(
            f"kv_connector_extra_config['disk_allow_writable_dir'] must be a bool, got {writable!r}"
        )
    return {
        "disk_trusted_uids": tuple(uids),
        "disk_trusted_gid": gid,
        "disk_allow_writable_dir": writable,
        "disk_path": path,
        "disk_bytes_to_use": nbytes,
        "disk_store_threshold": threshold,
        "disk_namespace": namespace,
        "disk_direct_io": cast(DirectIoName, direct),
        "disk_rescan_interval_s": None if rescan is None else float(rescan),
    }


def _seconds(d: Mapping[str, Any], key: str, default: float | None, allow_none: bool) -> float | None:
    v = d.get(key, default)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e7:
        more = " or null" if allow_none else ""
        raise ConfigError(f"kv_connector_extra_config['{key}'] must be > 0 seconds{more}, got {v!r}")
    return float(v)


def _remote_settings(d: Mapping[str, Any], shared: bool | None) -> dict[str, Any]:
    """The remote tier's settings, checked (the URL's form here; the client checks the rest at
    start). The password never appears in a message."""
    url = d.get("remote_url")
    keys = [k for k in d if k.startswith("remote_") and k != "remote_url" and d[k] is not None]
    if url is None:
        if keys:
            raise ConfigError(
                f"kv_connector_extra_config: {sorted(keys)} need 'remote_url' (the server's URL)"
            )
        return {}
    schemes = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")
    if not isinstance(url, str) or not url.startswith(schemes) or len(url) <= len(url.split("://")[0]) + 3:
        shown = url.split("://")[0] + "://…" if isinstance(url, str) and "://" in url else type(url).__name__
        raise ConfigError(
            f"kv_connector_extra_config['remote_url'] must be redis://host:port, rediss://…, "
            f"redis+cluster://host:port[,host:port] or rediss+cluster://…; got {shown}"
        )
    if shared is False:
        raise ConfigError(
            "kv_connector_extra_config: the remote tier ('remote_url') needs the shared host region (the "
            "scheduler's process attaches to it); remove 'shared_region': false"
        )
    cluster = d.get("remote_cluster", False)
    if not isinstance(cluster, bool):
        raise ConfigError(f"kv_connector_extra_config['remote_cluster'] must be true/false, got {cluster!r}")
    namespace = d.get("remote_namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise ConfigError(
            f"kv_connector_extra_config['remote_namespace'] must be a string, got {namespace!r}"
        )
    threshold = _int(d, "remote_store_threshold", _D["remote_store_threshold"], 0)
    ca = d.get("remote_tls_ca_file")
    if ca is not None:
        if not isinstance(ca, str) or not ca:
            raise ConfigError(
                f"kv_connector_extra_config['remote_tls_ca_file'] must be a file path, got {ca!r}"
            )
        if not url.startswith("rediss"):
            raise ConfigError(
                "kv_connector_extra_config['remote_tls_ca_file'] needs a rediss:// (TLS) 'remote_url'"
            )
        if not os.path.isfile(ca):
            raise ConfigError(f"kv_connector_extra_config['remote_tls_ca_file']: no such file: {ca}")
    out = {
        "remote_url": url,
        "remote_cluster": cluster,
        "remote_namespace": namespace,
        "remote_store_threshold": threshold,
        "remote_ttl_s": _seconds(d, "remote_ttl_s", None, True),
        "remote_timeout_s": _seconds(d, "remote_timeout_s", _D["remote_timeout_s"], False),
        "remote_connect_timeout_s": _seconds(
            d, "remote_connect_timeout_s", _D["remote_connect_timeout_s"], False
        ),
        "remote_negative_ttl_s": _seconds(d, "remote_negative_ttl_s", _D["remote_negative_ttl_s"], False),
        "remote_tls_ca_file": ca,
        "remote_idle_spin_s": _idle_spin(d, "remote_idle_spin_s"),
        "remote_idle_nap_s": _idle_spin(d, "remote_idle_nap_s"),
        "remote_io_threads": _io_threads(d),
    }
    _checked(out)
    return out


def _object_settings(d: Mapping[str, Any], shared: bool | None) -> dict[str, Any]:
    """The object tier's keys (:data:`OBJECT_KEYS`) as given, checked by the bindings' reader (types,
    ranges) and here for what the reader leaves to the tier's start: the URL's form and the budget.
    The rest of the URL (the bucket's name, the prefix's characters), the endpoint and the
    credentials are checked when the scheduler opens the tier (a :class:`~kvoff.ConfigError`)."""
    given = {k: d[k] for k in OBJECT_KEYS if k in d}
    url = given.get("object_url")
    if url is None:
        keys = sorted(k for k, v in given.items() if v is not None)
        if keys:
            raise ConfigError(
                f"kv_connector_extra_config: {keys} need 'object_url' (the store's s3://bucket/prefix)"
            )
        return {}
    bucket = url.removeprefix("s3://").split("/", 1)[0] if isinstance(url, str) else ""
    if not isinstance(url, str) or not url.startswith("s3://") or not bucket:
        shown = url.split("://")[0] + "://…" if isinstance(url, str) and "://" in url else type(url).__name__
        raise ConfigError(
            f"kv_connector_extra_config['object_url'] must be s3://bucket[/prefix] (an S3-compatible "
            f"store; its endpoint in 'object_endpoint' or $AWS_ENDPOINT_URL); got {shown}"
        )
    if shared is False:
        raise ConfigError(
            "kv_connector_extra_config: the object tier ('object_url') needs the shared host region (the "
            "scheduler's process attaches to it); remove 'shared_region': false"
        )
    if given.get("object_bytes_to_use") is None:
        raise ConfigError(
            "kv_connector_extra_config must set 'object_bytes_to_use' (bytes of this engine's values in "
            "the object store's namespace) with 'object_url'"
        )
    given["object_bytes_to_use"] = _int(d, "object_bytes_to_use", None, 1)  # 8e9 as for the other sizes
    _checked(given)
    return given


def _checked(settings: Mapping[str, Any]) -> None:
    """The settings through the native constructors' own reader (``kvoff.tiers.check_settings``):
    its ``TypeError``/``ValueError`` (wrong type, out of range) as a :class:`~kvoff.ConfigError`."""
    try:
        check_settings("manager", **settings)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"kv_connector_extra_config: {e}") from None


def _io_threads(d: Mapping[str, Any]) -> int | None:
    n = _int(d, "remote_io_threads", None, 1)
    if n is not None and n > _native.MAX_REMOTE_IO_THREADS:
        raise ConfigError(
            f"kv_connector_extra_config['remote_io_threads'] must be 1 to {_native.MAX_REMOTE_IO_THREADS}, got {n}"
        )
    return n


def _idle_spin(d: Mapping[str, Any], name: str) -> float | None:
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= _native.MAX_IDLE_SPIN_S:
        raise ConfigError(
            f"kv_connector_extra_config['{name}'] must be 0 to {_native.MAX_IDLE_SPIN_S} seconds or null, got {v!r}"
        )
    return float(v)
