"""Benchmarks behind ``kvoff bench``.

``managers``: the manager workload of PERF.md through the Python API, for both policies, with the
pure-Python reference managers (``kvoff._pyref``, built like vLLM's) measured in the same run as the
baseline. Every figure is a ratio against that same-run reference.
"""

from __future__ import annotations

import hashlib
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kvoff
from kvoff._progress import Progress
from kvoff._pyref import PyARC, PyLRU

KEYS_PER_REQUEST = 64


@dataclass
class Workload:
    """PERF.md's manager workload: requests of 64 keys sharing Pareto-distributed prefixes."""

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


def _time(make: Callable[[], Any], run: Callable[..., tuple[int, int, int]], wl: Workload,
          reps: int, label: str, show: bool) -> dict[str, float]:
    rates = []
    result = (0, 0, 0)
    with Progress(reps * len(wl.requests), label, enabled=show or None) as bar:
        for _ in range(reps):
            m = make()
            t0 = time.perf_counter()
            result = run(m, wl, bar)
            dt = time.perf_counter() - t0
            rates.append(result[0] / dt)
    rates.sort()
    ops, hits, looked = result
    return {"key_ops": ops, "key_ops_per_s": rates[len(rates) // 2], "hit_rate": hits / max(looked, 1)}


def bench_managers(num_requests: int = 2000, capacity: int = 20_000, reps: int = 5,
                   ref_reps: int = 3, show_progress: bool | None = None) -> list[dict[str, Any]]:
    """Runs the manager workload; returns one row per (policy, implementation)."""
    wl = make_workload(num_requests, capacity)
    rows = []
    for policy, ref_cls in (("lru", PyLRU), ("arc", PyARC)):
        show = bool(show_progress)
        ref = _time(lambda c=ref_cls: c(capacity), _run_ref, wl, ref_reps, f"python reference {policy}", show)
        kv = _time(lambda p=policy: kvoff.create_manager(p, capacity, enable_events=True, block_size=16),
                   _run_kvoff, wl, reps, f"kvoff {policy}", show)
        rows.append({"policy": policy, "impl": "python-ref", **ref, "ratio": 1.0})
        rows.append({"policy": policy, "impl": "kvoff", **kv,
                     "ratio": kv["key_ops_per_s"] / ref["key_ops_per_s"]})
    return rows


def format_manager_rows(rows: list[dict[str, Any]]) -> str:
    lines = [
        (
            f"manager workload (PERF.md): {platform.processor() or platform.machine()}, "
            f"Python {platform.python_version()}, kvoff {kvoff.__version__}"
        ),
        f"{'policy':<7}{'impl':<12}{'M key-ops/s':>13}{'hit rate':>10}{'vs python':>11}",
    ]
    for r in rows:
        lines.append(
            f"{r['policy']:<7}{r['impl']:<12}{r['key_ops_per_s'] / 1e6:>13.2f}"
            f"{r['hit_rate']:>10.3f}{r['ratio']:>10.1f}x"
        )
    return "\n".join(lines)
