# requires: kvoff with its remote tier, numpy, redis-server and redis-benchmark on PATH (a probe run
# by hand; not part of the kvoff package)
"""Probe: does kvoff's remote tier keep a Redis server as busy as redis-benchmark's C client does
with the same command shape, and what does each cost the server per GB?

kvoff's shape at 32 KiB values (docs/tier.md, remote tier): 4 I/O threads, each with one command
of 8 values in flight (an ``MSET`` per write batch, an ``MGET`` per read job). redis-benchmark runs
that shape (``-P 1 -c 4 -r KEYS``, ``MSET`` / ``MGET`` of 8 keys) on the same private server, and
kvoff stores and loads the same bytes through ``TieredOffloadingManager`` (``kvoff bench remote``'s
store and load), rounds alternated. For each: GB/s of values, the server's CPU seconds per GB (its
event loop's, from ``/proc``) and the share of the time it was busy.

Run: ``python3 scripts/probe/remote_shapes.py [ROUNDS]`` (BENCHMARKS.md "Remote tier").
"""

import os
import subprocess
import sys
import time

import kvoff
import numpy as np
from kvoff.tier import REMOTE_HEADER_BYTES, TieredOffloadingManager
from kvoff.tools import bench_remote as br

VALUE = 32 << 10
KEYS = 8192
PER_COMMAND = 8


def rb(url: str, control: br.ServerControl, cmd: str, n: int) -> tuple[float, float, float]:
    """redis-benchmark ``cmd`` of PER_COMMAND keys, -P 1 -c 4: (GB/s, server s/GB, busy share)."""
    value = os.urandom(VALUE // 2).hex()
    args = []
    for _ in range(PER_COMMAND):
        args += ["key:__rand_int__", value] if cmd == "MSET" else ["key:__rand_int__"]
    port = url.rsplit(":", 1)[1]
    c0, t0 = control.cpu_s(), time.perf_counter()
    r = subprocess.run(
        [
            "redis-benchmark",
            "-p",
            port,
            "-n",
            str(n),
            "-P",
            "1",
            "-c",
            "4",
            "-r",
            str(KEYS),
            "--csv",
            cmd,
            *args,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    c1, dt = control.cpu_s(), time.perf_counter() - t0
    rps = float(r.stdout.strip().splitlines()[-1].split(",")[1].strip('"'))
    gb = n * PER_COMMAND * VALUE / 1e9
    assert c0 is not None and c1 is not None
    return rps * PER_COMMAND * VALUE / 1e9, (c1 - c0) / gb, (c1 - c0) / dt


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    block = VALUE - REMOTE_HEADER_BYTES
    n = KEYS
    base = np.random.default_rng(1).integers(0, 256, block, dtype=np.uint8)
    with br.local_redis() as control:
        url = control.url
        kw = {"remote_max_queued_writes": n, "remote_max_inflight_bytes": n * VALUE, "remote_timeout_s": 2.0}

        def engine() -> tuple[TieredOffloadingManager, kvoff.HostRegion]:
            region = kvoff.HostRegion.private(n, block)
            return TieredOffloadingManager("lru", n, region, remote_url=url, namespace="shapes", **kw), region

        keys = [kvoff.make_offload_key(f"shapes-{i}".encode(), 0) for i in range(n)]
        w, rw = engine()
        br._store_remote(w, rw, keys, block, base)  # every timed store replaces values
        w.shutdown()
        rw.close()
        rb(url, control, "MSET", 4 * KEYS // PER_COMMAND)  # redis-benchmark's keys, written once
        rows: dict[str, list[tuple[float, float, float]]] = {}
        for _ in range(rounds):
            for what in ("redis-benchmark MSET", "kvoff store", "redis-benchmark MGET", "kvoff load"):
                if what.startswith("redis"):
                    got = rb(url, control, what.split()[1], 2 * KEYS // PER_COMMAND)
                else:
                    m, region = engine()
                    spent: list[tuple[float, float]] = []
                    if what == "kvoff store":
                        gbs = br._store_remote(m, region, keys, block, base, control.cpu_s, spent)
                    else:
                        gbs, ok = br._load_remote(m, region, keys, block, base, [], control.cpu_s, spent)
                        assert ok, "a block loaded differs"
                    m.shutdown()
                    region.close()
                    cpu, dt = spent[0]
                    # GB/s of values (header included), as redis-benchmark's are counted.
                    got = (gbs * VALUE / block, cpu / (n * VALUE / 1e9), cpu / dt)
                rows.setdefault(what, []).append(got)
    print(f"{VALUE >> 10} KiB values, {PER_COMMAND} per command, 4 connections; {rounds} rounds alternated")
    print(f"{'':<22} {'GB/s':>22} {'server s/GB':>22} {'server busy':>22}")
    for what, xs in rows.items():
        cols = [
            " ".join(f"{x[0]:.2f}" for x in xs),
            " ".join(f"{x[1]:.3f}" for x in xs),
            " ".join(f"{x[2]:.0%}" for x in xs),
        ]
        print(f"{what:<22} {cols[0]:>22} {cols[1]:>22} {cols[2]:>22}")


if __name__ == "__main__":
    main()
