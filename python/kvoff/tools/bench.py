"""Benchmarks behind ``kvoff bench``.

``transfers``: docs/performance.md's scattered-block scenarios through the handler API (CUDA engine methods on
a GPU, the host engine otherwise), against one contiguous copy of the same bytes in the same run
(:mod:`kvoff.tools.bench_transfers`, re-exported here with its page-size sweeps).

``managers``: the manager workload of docs/performance.md through the Python API, for both policies, with the
pure-Python reference managers (``kvoff.tools._pyref``, built like vLLM's) measured in the same run as the
baseline, and vLLM's own offloading managers (``CPUOffloadingManager``) too where vLLM is installed.
Every figure is a ratio against a reference measured in the same run.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import kvoff
from kvoff._names import PolicyName
from kvoff.tools._progress import Progress
from kvoff.tools._pyref import PyARC, PyLRU
from kvoff.tools.bench_transfers import (
    GPU_DIRS,
    HOST_CONTIGUOUS,
    HOST_DIRS,
    HOST_DIRS_NOTE,
    HOST_KVOFF,
    HOST_MIN_BYTES_PER_THREAD,
    HOST_PARALLEL_MIN_BYTES,
    HOST_PER_COPY,
    HOST_PLOT_JOB_MIB,
    HOST_PLOT_NOTE,
    HOST_PLOT_PAGES_KIB,
    MIN_BLOCKS,
    SPREAD_LIMIT,
    TRANSFER_SCENARIOS,
    Spread,
    ThreadedCopy,
    bench_transfers,
    format_spread,
    format_transfer_rows,
    host_engine_threads,
    plot_host_sweep_rows,
    repeat_sweeps,
    sweep_host_for_plot,
    time_host_contiguous,
)

__all__ = [
    "GPU_DIRS",
    "HOST_CONTIGUOUS",
    "HOST_DIRS",
    "HOST_DIRS_NOTE",
    "HOST_KVOFF",
    "HOST_MIN_BYTES_PER_THREAD",
    "HOST_PARALLEL_MIN_BYTES",
    "HOST_PER_COPY",
    "HOST_PLOT_JOB_MIB",
    "HOST_PLOT_NOTE",
    "HOST_PLOT_PAGES_KIB",
    "KEYS_PER_REQUEST",
    "MIN_BLOCKS",
    "SPREAD_LIMIT",
    "TRANSFER_SCENARIOS",
    "VLLM_RATIO_TARGETS",
    "Spread",
    "ThreadedCopy",
    "Workload",
    "bench_managers",
    "bench_transfers",
    "format_manager_rows",
    "format_spread",
    "format_transfer_rows",
    "host_engine_threads",
    "make_workload",
    "plot_host_sweep_rows",
    "repeat_sweeps",
    "sweep_host_for_plot",
    "time_host_contiguous",
    "vllm_manager_factory",
]

KEYS_PER_REQUEST = 64


@dataclass
class Workload:
    """docs/performance.md's manager workload: requests of 64 keys sharing Pareto-distributed prefixes."""

    capacity: int
    requests: list[list[bytes]]


def make_workload(num_requests: int = 2000, capacity: int = 20_000, seed: int = 0) -> Workload:
    rng = random.Random(seed)

    def key(*parts: object) -> bytes:
        h = hashlib.sha256(repr(parts).encode()).digest()
        return kvoff.make_offload_key(h, 0)

    requests = []
    for r in range(num_requests):
        p = min(int(rng.paretovariate(1.2)) - 1, 399)
        length = rng.randint(8, KEYS_PER_REQUEST)
        keys = [key("prefix", p, j) for j in range(length)]
        keys += [key("req", r, j) for j in range(KEYS_PER_REQUEST - length)]
        requests.append(keys)
    return Workload(capacity, requests)


def _run_kvoff(m: Any, wl: Workload, progress: Progress | None) -> tuple[int, int, int]:
    """One pass; returns (key_ops, hits, lookups)."""
    ops = hits = looked = 0
    lookup_prefix = m.lookup_prefix
    prepare_load = m.prepare_load
    complete_load = m.complete_load
    prepare_store = m.prepare_store
    complete_store = m.complete_store
    touch = m.touch
    take_events = m.take_events
    for i, keys in enumerate(wl.requests):
        h = lookup_prefix(keys) or 0
        ops += min(h + 1, KEYS_PER_REQUEST)  # keys looked up until the first non-hit
        looked += KEYS_PER_REQUEST
        hits += h
        if h:
            prefix = keys[:h]
            prepare_load(prefix)
            complete_load(prefix)
            ops += 2 * h
        rest = keys[h:]
        if rest:
            out = prepare_store(rest)
            ops += len(rest)
            if out is not None:
                stored = out.keys_to_store
                complete_store(stored)
                ops += len(stored)
        touch(keys)
        ops += KEYS_PER_REQUEST
        take_events()
        if progress is not None and i % 100 == 99:
            progress.update(100)
    return ops, hits, looked


def _run_ref(m: Any, wl: Workload, progress: Progress | None) -> tuple[int, int, int]:
    ops = hits = looked = 0
    for i, keys in enumerate(wl.requests):
        h = m.lookup_prefix(keys) or 0
        ops += min(h + 1, KEYS_PER_REQUEST)
        looked += KEYS_PER_REQUEST
        hits += h
        if h:
            prefix = keys[:h]
            m.prepare_load(prefix)
            m.complete_load(prefix)
            ops += 2 * h
        rest = keys[h:]
        if rest:
            out = m.prepare_store(rest)
            ops += len(rest)
            if out is not None:
                m.complete_store(out[0])
                ops += len(out[0])
        m.touch(keys)
        ops += KEYS_PER_REQUEST
        m.take_events()
        if progress is not None and i % 100 == 99:
            progress.update(100)
    return ops, hits, looked


def _run_vllm(m: Any, wl: Workload, progress: Progress | None) -> tuple[int, int, int]:
    """One pass through vLLM's ``CPUOffloadingManager`` API (per-key ``lookup`` until the first
    non-hit, a ``ReqContext`` per request), counting key-ops exactly as :func:`_run_kvoff` does."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    hit = LookupResult.HIT
    ops = hits = looked = 0
    for i, keys in enumerate(wl.requests):
        ctx = ReqContext(req_id=str(i))
        m.on_new_request(ctx)
        h = 0
        for k in keys:
            if m.lookup(k, ctx) != hit:
                break
            h += 1
        ops += min(h + 1, KEYS_PER_REQUEST)
        looked += KEYS_PER_REQUEST
        hits += h
        if h:
            prefix = keys[:h]
            m.prepare_load(prefix, ctx)
            m.complete_load(prefix, ctx)
            ops += 2 * h
        rest = keys[h:]
        if rest:
            out = m.prepare_store(rest, ctx)
            ops += len(rest)
            if out is not None:
                m.complete_store(out.keys_to_store, ctx)
                ops += len(out.keys_to_store)
        m.touch(keys, ctx)
        ops += KEYS_PER_REQUEST
        for _ in m.take_events():
            pass
        m.on_request_finished(ctx)
        if progress is not None and i % 100 == 99:
            progress.update(100)
    return ops, hits, looked


def vllm_manager_factory() -> tuple[str, Callable[[str, int], Any]] | None:
    """``(version, make(policy, capacity))`` for vLLM's own offloading managers, or ``None`` where
    vLLM (with ``vllm.v1.kv_offload.cpu.manager``) cannot be imported."""
    try:
        import vllm
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None

    def make(policy: str, capacity: int) -> Any:
        return CPUOffloadingManager(capacity, cache_policy=policy, enable_events=True)

    return str(getattr(vllm, "__version__", "?")), make


#: kvoff's targets against vLLM's managers on this workload (docs/performance.md), by policy. They
#: need vLLM's managers measured in the same run: without vLLM they are "not measured" (the Python
#: reference is built like vLLM's managers but is not vLLM, so it cannot stand in for it).
VLLM_RATIO_TARGETS = {"lru": 10.0, "arc": 5.0}


def _time(
    make: Callable[[], Any],
    run: Callable[..., tuple[int, int, int]],
    wl: Workload,
    reps: int,
    label: str,
    show: bool,
) -> dict[str, float]:
    rates = []
    result = (0, 0, 0)
    with Progress(reps * len(wl.requests), label, enabled=None if show else False) as bar:
        for _ in range(reps):
            m = make()
            t0 = time.perf_counter()
            result = run(m, wl, bar)
            dt = time.perf_counter() - t0
            rates.append(result[0] / dt)
    rates.sort()
    ops, hits, looked = result
    return {"key_ops": ops, "key_ops_per_s": rates[len(rates) // 2], "hit_rate": hits / max(looked, 1)}


def bench_managers(
    num_requests: int = 2000,
    capacity: int = 20_000,
    reps: int = 5,
    ref_reps: int = 3,
    show_progress: bool | None = None,
    vllm: bool | None = None,
) -> list[dict[str, Any]]:
    """Runs the manager workload; returns one row per (policy, implementation).

    ``vllm``: also run vLLM's own managers (``None``: where vLLM is installed; ``True``: raise
    ``RuntimeError`` if it is not). Rows: ``policy``, ``impl`` (``python-ref``, ``vllm``,
    ``kvoff``), ``key_ops``, ``key_ops_per_s``, ``hit_rate``, ``ratio`` (to the Python reference)
    and, on kvoff rows, ``vs_vllm`` (to vLLM in the same run, ``None`` without vLLM),
    ``vllm_target`` and ``target_met`` (``None``: not measured, as without vLLM the target has no
    baseline)."""
    wl = make_workload(num_requests, capacity)
    factory = vllm_manager_factory() if vllm is not False else None
    if vllm and factory is None:
        raise RuntimeError("vLLM's offloading managers (vllm.v1.kv_offload) cannot be imported here")
    rows = []
    for policy, ref_cls in (("lru", PyLRU), ("arc", PyARC)):
        show = show_progress is not False
        ref = _time(
            functools.partial(ref_cls, capacity), _run_ref, wl, ref_reps, f"python reference {policy}", show
        )
        rows.append({"policy": policy, "impl": "python-ref", **ref, "ratio": 1.0})
        vl = None
        if factory is not None:
            version, make = factory
            vl = _time(
                functools.partial(make, policy, capacity), _run_vllm, wl, ref_reps, f"vllm {policy}", show
            )
            rows.append(
                {
                    "policy": policy,
                    "impl": "vllm",
                    "version": version,
                    **vl,
                    "ratio": vl["key_ops_per_s"] / ref["key_ops_per_s"],
                }
            )
        kv = _time(
            functools.partial(
                kvoff.create_manager, cast(PolicyName, policy), capacity, enable_events=True, block_size=16
            ),
            _run_kvoff,
            wl,
            reps,
            f"kvoff {policy}",
            show,
        )
        target = VLLM_RATIO_TARGETS[policy]
        vs_vllm = kv["key_ops_per_s"] / vl["key_ops_per_s"] if vl is not None else None
        # None: not measured (no vLLM in this run, so no baseline for the target).
        met = None if vs_vllm is None else vs_vllm >= target
        rows.append(
            {
                "policy": policy,
                "impl": "kvoff",
                **kv,
                "ratio": kv["key_ops_per_s"] / ref["key_ops_per_s"],
                "vs_vllm": vs_vllm,
                "vllm_target": target,
                "target_met": met,
            }
        )
    return rows


def format_manager_rows(rows: list[dict[str, Any]]) -> str:
    lines = [
        (
            f"manager workload (docs/performance.md): {platform.processor() or platform.machine()}, "
            f"Python {platform.python_version()}, kvoff {kvoff.__version__}"
        ),
        f"{'policy':<7}{'impl':<12}{'M key-ops/s':>13}{'hit rate':>10}{'vs python':>11}{'vs vLLM':>9}",
    ]
    for r in rows:
        vs = r.get("vs_vllm")
        lines.append(
            f"{r['policy']:<7}{r['impl']:<12}{r['key_ops_per_s'] / 1e6:>13.2f}"
            f"{r['hit_rate']:>10.3f}{r['ratio']:>10.1f}x{'' if vs is None else f'{vs:>8.1f}x'}"
        )
    for r in rows:
        if r["impl"] != "kvoff":
            continue
        policy, target = r["policy"], r["vllm_target"]
        if r["vs_vllm"] is not None:
            version = next(
                (v.get("version", "?") for v in rows if v["impl"] == "vllm" and v["policy"] == policy), "?"
            )
            verdict = "met" if r["target_met"] else "NOT met"
            lines.append(
                f"target {policy}: >= {target:g}x vLLM {version}'s {policy.upper()} manager in the same run: "
                f"{r['vs_vllm']:.1f}x, {verdict}"
            )
        else:
            lines.append(
                f"target {policy}: >= {target:g}x vLLM's {policy.upper()} manager in the same run: not measured "
                f"(needs vLLM's managers as the baseline; vLLM is not installed here, or --vllm off)"
            )
    return "\n".join(lines)
