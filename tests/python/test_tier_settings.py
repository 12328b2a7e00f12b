"""Each tier's settings and metrics tables (``kvoff.tiers``, docs/design.md "A new tier") as the one
place every surface reads from, and the remote and object settings through the bindings' checked
types on every surface: ``ValueError`` out of range (never ``OverflowError``), ``TypeError`` for
``bool`` (the config-dict surfaces — vLLM's extra config, SGLang's — raise their ``ConfigError``, a
``ValueError``, naming the key); every accessor raises ``InvalidStateError`` after ``shutdown()``;
kvoff's own Prometheus collector exports every tier's figures (scraped here from a real
``redis-server`` and SeaweedFS).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import uuid
from pathlib import Path
from typing import Any

import kvoff
import numpy as np
import pytest
import redis_servers as rs
import seaweed as sw
from kvoff import _native, tiers
from kvoff.errors import ConfigError, InvalidStateError
from kvoff.tier import DISK_METRICS, REMOTE_METRICS, TieredOffloadingManager

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 4096

#: The remote integer settings and the values out of their range.
REMOTE_INTS = {
    "remote_io_threads": (-1, 2**64, 0, 65),
    "remote_max_queued_writes": (-1, 2**64),
    "remote_max_inflight_bytes": (-1, 2**64),
    "remote_max_fetch_keys": (-1, 2**64),
    "remote_store_threshold": (-1, 2**32, 2**64),
}
#: The remote seconds settings and values out of their range.
REMOTE_SECONDS = {
    "remote_ttl_s": (-1, 0, float("inf"), 2**1100),
    "remote_connect_timeout_s": (-1, 0, float("nan")),
    "remote_timeout_s": (-1, 0, float("inf")),
    "remote_negative_ttl_s": (-1, 0),
    "remote_idle_spin_s": (-1, 0.5),
    "remote_idle_nap_s": (-1, 0.5),
}
#: The object integer settings and values out of their range.
OBJECT_INTS = {
    "object_io_threads": (-1, 0, 65, 2**64),
    "object_max_requests": (-1, 0, 4097),
    "object_max_retries": (-1, 2**64),
    "object_max_queued_writes": (-1, 2**64),
    "object_max_inflight_bytes": (-1, 2**64),
    "object_multipart_bytes": (-1, 1, (5 << 30) + 1),
    "object_bytes_to_use": (-1, 0, 2**64),
    "object_store_threshold": (-1, 2**32, 2**64),
}
#: The object seconds settings and values out of their range.
OBJECT_SECONDS = {
    "object_ttl_s": (-1, 0, float("inf"), 2**1100),
    "object_connect_timeout_s": (-1, 0, float("nan")),
    "object_timeout_s": (-1, 0, float("inf")),
    "object_negative_ttl_s": (-1, 0),
    "object_list_interval_s": (-1, 0),
}
#: Settings only the tiered manager takes (the block store has no chain of tiers).
MANAGER_ONLY = {"remote_store_threshold", "disk_store_threshold", "object_store_threshold"}
#: Settings without a default (none, or chosen by the surface or the environment).
NO_DEFAULT = {"remote_url", "remote_namespace", "remote_tls_ca_file", "trusted_uids", "trusted_gid"} | {
    "object_url",
    "object_endpoint",
    "object_namespace",
    "object_bytes_to_use",
    "object_profile",
}

UNUSED_URL = "redis://127.0.0.1:1"


def _manager(**kw: Any) -> TieredOffloadingManager:
    region = kvoff.HostRegion.private(4, BLOCK)
    kw.setdefault("remote_url", UNUSED_URL)
    kw.setdefault("remote_connect_timeout_s", 0.2)
    return TieredOffloadingManager("lru", 4, region, **kw)


def _store(**kw: Any) -> Any:
    kw.setdefault("remote_url", UNUSED_URL)
    kw.setdefault("remote_connect_timeout_s", 0.2)
    return _native.BlockStore(None, 0, BLOCK, **kw)


# --- the tables ----------------------------------------------------------------------------------


def test_every_registered_tier_has_its_tables() -> None:
    """A tier registered in the crate (``tier::registry::TIERS``) has a settings table and a metrics
    table here, and nothing else does; each metric row is its tier's, and each of the tier's own
    stats a manager reports that the table lists is named ``<kind>_<name>``."""
    kinds = list(_native.TIERS)
    assert kinds == list(tiers.SETTINGS) == list(tiers.METRICS)
    for kind, own in _native.TIERS.items():
        keys = {m.key for m in tiers.METRICS[kind]}
        assert all(k.startswith(kind + "_") for k in keys), kind
        assert all(s.name.startswith(kind + "_") or kind == "disk" for s in tiers.SETTINGS[kind])
        assert own, kind


def test_defaults_come_from_the_crate_and_every_table_setting_is_read() -> None:
    names = {s.name for rows in tiers.SETTINGS.values() for s in rows}
    # Every tier setting with a default has it in TIER_DEFAULTS (read from the crate's configs).
    for n in names - NO_DEFAULT:
        assert n in tiers.TIER_DEFAULTS, n
    assert tiers.TIER_DEFAULTS["remote_connect_timeout_s"] == 1.0
    assert tiers.TIER_DEFAULTS["max_tracker_size"] == 64_000
    assert tiers.TIER_DEFAULTS["remote_io_threads"] == 4
    assert tiers.TIER_DEFAULTS["io_threads"] == 8
    # The one reader takes every setting on the surfaces the table names, and refuses it elsewhere.
    for rows in tiers.SETTINGS.values():
        for s in rows:
            value = {"remote_url": UNUSED_URL, "remote_tls_ca_file": "/etc/hostname"}.get(s.name, s.default)
            for surface in ("manager", "store"):
                if surface in s.surfaces:
                    tiers.check_settings(surface, **{s.name: value})
                else:
                    with pytest.raises(TypeError, match=s.name):
                        tiers.check_settings(surface, **{s.name: value})
    with pytest.raises(TypeError, match="remote_tiemout_s"):
        tiers.check_settings("manager", remote_tiemout_s=1.0)


def test_the_manager_surface_takes_every_table_setting_with_the_table_default() -> None:
    """Each setting is a keyword of the manager with the table's default, or (the object tier's,
    besides its URL and budget) goes through its ``**object_settings`` to the native reader, which
    applies the default itself."""
    sig = inspect.signature(TieredOffloadingManager.__init__).parameters
    passed = [p for p in sig.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    assert [p.name for p in passed] == ["object_settings"]
    for kind in tiers.SETTINGS:
        for name in tiers.settings_of(kind, "manager"):
            if name not in sig:
                assert kind == "object" and name.startswith("object_"), name
                continue
            d = tiers.TIER_DEFAULTS.get(name)
            if d is not None and name != "remote_io_threads":  # None there: the tier's default
                assert sig[name].default == d, name


def test_no_surface_restates_a_default() -> None:
    """A default written as a literal next to its setting's name in kvoff's Python sources (outside
    the tables) is a second source; each surface reads ``TIER_DEFAULTS`` instead."""
    literals = {
        n: v
        for n, v in tiers.TIER_DEFAULTS.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v not in (0, 1)
    }
    bad = []
    for path in sorted((ROOT / "python" / "kvoff").rglob("*.py")):
        if "tools" in path.parts or path.name == "tiers.py":
            continue
        text = path.read_text()
        for name, v in literals.items():
            spellings = {
                repr(v),
                repr(float(v)) if isinstance(v, int) else repr(v),
                f"{v:_}" if isinstance(v, int) else "",
            }
            if isinstance(v, int) and v >= 1 << 20 and v & (v - 1) == 0:
                spellings.add(f"{v >> 20} << 20")
            for sp in filter(None, spellings):
                pat = rf"\b{name}\b\s*(?::[^=\n]*)?=\s*{re.escape(sp)}\b"
                if re.search(pat, text):
                    bad.append(f"{path.relative_to(ROOT)}: {name} = {sp}")
    assert not bad, bad


def test_metrics_views_are_read_from_the_tables() -> None:
    def view(kind: str) -> dict[str, tuple[str, str]]:
        return {m.key: (m.prometheus, m.help) for m in tiers.METRICS[kind] if "manager" in m.surfaces}

    assert DISK_METRICS == view("disk") and REMOTE_METRICS == view("remote")
    assert {m.key for m in tiers.METRICS["object"]} >= {"object_hits", "object_rejected_values"}
    for rows in tiers.METRICS.values():
        for m in rows:
            assert m.prometheus.startswith("kvoff_")
            assert m.prometheus.endswith("_total") == (m.kind == "counter"), m
            assert m.generic is None or m.generic in tiers.GENERIC_METRICS, m
    vllm = pytest.importorskip("kvoff.vllm.manager", reason="vLLM not importable")
    assert vllm.DISK_VLLM_METRICS == {m.vllm: (m.kind, m.help) for m in tiers.METRICS["disk"] if m.vllm}
    assert vllm.REMOTE_VLLM_METRICS == {m.vllm: (m.kind, m.help) for m in tiers.METRICS["remote"] if m.vllm}
    assert vllm.OBJECT_VLLM_METRICS == {m.vllm: (m.kind, m.help) for m in tiers.METRICS["object"] if m.vllm}
    assert "vllm:kvoff_object_rejected_values" in vllm.OBJECT_VLLM_METRICS
    for kind, rows in tiers.METRICS.items():
        assert vllm.VLLM_METRICS[kind] == {m.vllm: (m.kind, m.help) for m in rows if m.vllm}, kind
    tiering = pytest.importorskip("kvoff.vllm.tiering", reason="vLLM's tiering not importable")
    assert set(tiering.TIER_VLLM_METRICS) == {f"vllm:kvoff_tier_{g}" for g in tiers.GENERIC_METRICS}
    assert tiering.TIER_VLLM_METRICS["vllm:kvoff_tier_rejected"][2] == {
        "disk": "disk_corrupt_files",
        "remote": "remote_rejected_values",
        "object": "object_rejected_values",
    }


def test_block_store_stats_hold_every_store_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each tier's rows on the ``store`` surface are keys of the block store's ``stats()`` on that
    tier (the figures SGLang's backend and vLLM's tiering report); the manager-only ones (hits,
    misses and promotions of the chain) are not. Nothing is reached: the servers are unused."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "KVOFFUNUSED")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "unused")
    stores = {
        "disk": _native.BlockStore(str(tmp_path), 1 << 20, BLOCK),
        "remote": _store(),
        "object": _native.BlockStore(
            None, 1 << 20, BLOCK, object_url="s3://kvoff-unused/p", object_endpoint="http://127.0.0.1:1"
        ),
    }
    try:
        for kind, s in stores.items():
            assert s.kind == kind
            st = s.stats()
            for m in tiers.METRICS[kind]:
                assert (m.key in st) == ("store" in m.surfaces), (kind, m.key)
    finally:
        for s in stores.values():
            s.shutdown()


# --- the remote settings on every surface ---------------------------------------------------------


@pytest.mark.parametrize("surface", ["manager", "store"])
def test_remote_settings_out_of_range_and_bools(surface: str) -> None:
    make = _manager if surface == "manager" else _store
    for name, bad in {**REMOTE_INTS, **REMOTE_SECONDS}.items():
        if surface == "store" and name in MANAGER_ONLY:
            with pytest.raises(TypeError, match=name):
                make(**{name: 1})
            continue
        for v in bad:
            with pytest.raises(ValueError, match=name) as e:
                make(**{name: v})
            assert not isinstance(e.value, OverflowError), (name, v)
        with pytest.raises(TypeError, match=name):
            make(**{name: True})
        with pytest.raises(TypeError, match=name):
            make(**{name: "1"})
    for name in ("remote_cluster",):
        with pytest.raises(TypeError, match=name):
            make(**{name: 1})
    for name in ("remote_password_env", "remote_namespace"):
        with pytest.raises(TypeError, match=name):
            make(**{name: 1})


def test_remote_settings_in_range_are_applied() -> None:
    """The edges of the ranges are accepted (a manager and a block store open on them)."""
    m = _manager(
        remote_io_threads=64,
        remote_max_queued_writes=0,
        remote_max_inflight_bytes=2**64 - 1,
        remote_max_fetch_keys=0,
        remote_store_threshold=2**32 - 1,
        remote_idle_spin_s=0,
        remote_idle_nap_s=0.01,
        remote_ttl_s=1,
    )
    m.shutdown()
    s = _store(remote_io_threads=1, remote_max_queued_writes=1, remote_negative_ttl_s=9e6)
    assert s.kind == "remote"
    s.shutdown()


def test_vllm_spec_settings() -> None:
    config = pytest.importorskip("kvoff.vllm.config", reason="vLLM not importable")
    base = {"cpu_bytes_to_use": 1 << 20, "remote_url": "redis://127.0.0.1:6379"}
    takes = {f.name for f in dataclasses.fields(config.KvoffOffloadConfig)}
    for name, bad in {**REMOTE_INTS, **REMOTE_SECONDS}.items():
        if name not in takes:
            continue
        for v in (*bad, True, "x"):
            with pytest.raises(ConfigError, match=name):
                config.KvoffOffloadConfig.from_extra_config({**base, name: v})
    c = config.KvoffOffloadConfig.from_extra_config({**base, "remote_store_threshold": 2**32 - 1})
    assert c.remote_store_threshold == 2**32 - 1
    assert c.remote_connect_timeout_s == tiers.TIER_DEFAULTS["remote_connect_timeout_s"]


def test_vllm_spec_object_settings() -> None:
    """The object tier in vLLM's extra config: its keys are the table's (none restated), each checked
    by the bindings' reader (a ``ConfigError`` naming the key), the URL's form and the budget checked
    before the engine starts; what is given passes through as given."""
    config = pytest.importorskip("kvoff.vllm.config", reason="vLLM not importable")
    C = config.KvoffOffloadConfig
    url = "s3://kv-cache/vllm"
    base = {"cpu_bytes_to_use": 1 << 20, "object_url": url, "object_bytes_to_use": 8e9}
    assert config.OBJECT_KEYS == tiers.settings_of("object", "manager")
    assert set(config.OBJECT_KEYS) <= set(C.valid_keys())
    assert "object_settings" not in C.valid_keys()
    assert not any(f.name.startswith("object_") for f in dataclasses.fields(C) if f.name != "object_settings")
    c = C.from_extra_config(base)
    assert c.uses_object and c.uses_tiers and not c.uses_disk and not c.uses_remote
    assert c.object_url == url and c.object_settings == {"object_url": url, "object_bytes_to_use": 8 * 10**9}
    assert not C.from_extra_config({"cpu_bytes_to_use": 1 << 20}).uses_object
    # Every setting given (at the table's defaults), passed through as given; an explicit None
    # included (object_list_interval_s=None: list only at start, not the default's 30 s).
    every = {n: tiers.TIER_DEFAULTS.get(n) for n in config.OBJECT_KEYS}
    every.update(object_url=url, object_bytes_to_use=8 * 10**9, object_endpoint="http://127.0.0.1:8333")
    every.update(object_namespace="ns", object_profile="p", object_list_interval_s=None)
    assert C.from_extra_config({"cpu_bytes_to_use": 1 << 20, **every}).object_settings == every
    # Types and ranges: the bindings' reader, as a ConfigError naming the key.
    for name, bad in {**OBJECT_INTS, **OBJECT_SECONDS}.items():
        for v in (*bad, True, "x"):
            with pytest.raises(ConfigError, match=name):
                C.from_extra_config({**base, name: v})
    for name in ("object_endpoint", "object_region", "object_namespace", "object_profile"):
        with pytest.raises(ConfigError, match=name):
            C.from_extra_config({**base, name: 3})
    # The URL's form (its bucket's name and the prefix's characters when the tier opens, below).
    for bad_url in ("http://kv-cache/vllm", "s3://", "s3:///vllm", "", 3, "redis://127.0.0.1:6379"):
        with pytest.raises(ConfigError, match="object_url"):
            C.from_extra_config({**base, "object_url": bad_url})
    with pytest.raises(ConfigError, match="object_bytes_to_use"):
        C.from_extra_config({**base, "object_bytes_to_use": None})
    with pytest.raises(ConfigError, match=r"\['object_ttl_s'\] need 'object_url'"):
        C.from_extra_config({"cpu_bytes_to_use": 1 << 20, "object_ttl_s": 60})
    with pytest.raises(ConfigError, match="shared host region"):
        C.from_extra_config({**base, "shared_region": False})
    # An unknown object_* key: the config's ConfigError listing the valid keys (every config key
    # is checked that way); the table's reader, which the tiered manager uses, raises TypeError.
    with pytest.raises(ConfigError, match=r"object_nonsense.*valid keys: .*'object_endpoint'"):
        C.from_extra_config({**base, "object_nonsense": 1})
    with pytest.raises(TypeError, match="object_nonsense"):
        tiers.check_settings("manager", object_url=url, object_nonsense=1)
    # vLLM's metrics of the tier (vllm:kvoff_object_*) are declared when the tier is configured.
    spec = pytest.importorskip("kvoff.vllm.spec", reason="vLLM not importable")
    from kvoff.vllm.manager import OBJECT_VLLM_METRICS

    declared = spec.KvoffOffloadingSpec.build_metric_definitions(base)
    assert OBJECT_VLLM_METRICS and set(OBJECT_VLLM_METRICS) <= set(declared)
    assert not set(OBJECT_VLLM_METRICS) & set(spec.KvoffOffloadingSpec.build_metric_definitions({}))


def test_vllm_tiering_settings() -> None:
    try:
        import test_tiering_vllm033 as base
        import torch
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError as e:  # pragma: no cover - the main env has vLLM 0.33
        pytest.skip(f"vLLM 0.33's tiering is not importable: {e}")
    tensor = torch.zeros((4, BLOCK), dtype=torch.uint8)

    def make(**kw: Any) -> Any:
        cfg = {"type": "KvoffRemoteTier", "module_path": "kvoff.vllm.tiering", "remote_url": UNUSED_URL}
        cfg.update(kw)
        return SecondaryTierFactory.create_secondary_tier(
            cfg, memoryview(tensor.numpy()), base._Spec(base._config("test-model"))
        )

    sig = inspect.signature(
        __import__("kvoff.vllm.tiering", fromlist=["x"]).KvoffFileTier.__init__
    ).parameters
    for name, bad in {**REMOTE_INTS, **REMOTE_SECONDS}.items():
        if name not in sig:
            continue
        for v in bad:
            with pytest.raises(ValueError, match=name) as e:
                make(**{name: v})
            assert not isinstance(e.value, OverflowError), (name, v)
        with pytest.raises(TypeError, match=name):
            make(**{name: True})


# --- after shutdown -------------------------------------------------------------------------------


def test_every_accessor_raises_after_shutdown(tmp_path: Path) -> None:
    m = _manager(disk_path=str(tmp_path / "d"), disk_bytes_to_use=1 << 20)
    assert m.remote_url == UNUSED_URL and m.disk_dir is not None
    m.shutdown()
    for get in (
        lambda: m.remote_url,
        lambda: m.disk_dir,
        lambda: m.num_blocks,
        lambda: len(m),
        m.get_stats,
        lambda: m.remote_known(b"k" * 16),
    ):
        with pytest.raises(InvalidStateError):
            get()
    s = _store()
    s.shutdown()
    for get in (lambda: s.block_bytes, lambda: s.kind, lambda: s.dir, s.stats):
        with pytest.raises(InvalidStateError):
            get()


# --- kvoff's Prometheus collector -----------------------------------------------------------------


def test_collector_exports_every_tier(
    tmp_path: Path, redis_server: rs.RedisServer, seaweed: sw.SeaweedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    region = kvoff.HostRegion.private(8, BLOCK)
    m = TieredOffloadingManager(
        "lru",
        8,
        region,
        str(tmp_path / "d"),
        1 << 20,
        remote_url=redis_server.url,
        namespace=f"scrape-{uuid.uuid4().hex}",
        object_url=f"s3://{seaweed.bucket}/scrape",
        object_endpoint=seaweed.endpoint,
        object_bytes_to_use=1 << 20,
    )
    try:
        keys = [kvoff.make_offload_key(f"s{i}".encode(), 0) for i in range(3)]
        out = m.prepare_store(keys)
        assert out is not None
        view = region.view_numpy(0, 0, BLOCK)
        for b in out.store_spec.block_ids:
            view[b] = np.arange(BLOCK, dtype=np.uint8)
        m.complete_store(out.keys_to_store)
        m.flush()
        tm = kvoff.TransferMetrics()
        tm.attach_manager(m)
        reg = prometheus_client.CollectorRegistry()
        reg.register(kvoff.TransferMetricsCollector(tm))
        text = prometheus_client.generate_latest(reg).decode()
        samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
        stats = m.get_stats()
        for kind, rows in tiers.METRICS.items():
            for row in rows:
                if "manager" in row.surfaces:
                    assert row.key in stats, (kind, row.key)
                    assert row.prometheus in samples, (kind, row.prometheus)
        assert samples["kvoff_remote_writes_total"] == 3
        assert samples["kvoff_disk_files_written_total"] == 3
        assert samples["kvoff_remote_up"] == 1
        assert samples["kvoff_object_writes_total"] == 3 and samples["kvoff_object_up"] == 1
        assert f"# HELP kvoff_remote_hits_total {REMOTE_METRICS['remote_hits'][1]}" in text
    finally:
        m.shutdown()
