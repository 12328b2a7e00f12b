# requires: kvoff with its remote tier and native reference, numpy, redis-server and redis-cli on
# PATH (a probe run by hand; not part of the kvoff package)
"""Probe: what a 2 MiB load costs the server, kvoff against the native client.

On one private redis-server, rounds alternate kvoff's load (``kvoff bench remote``'s: a second
engine looks the keys up as a scheduler does until every block is promoted, at ``remote_io_threads``
of 4 and 8; ``KVOFF_REMOTE_TUNE`` set by the caller applies) with the native client's GET pass (one
GET per key in flight per connection, 4 and 8 threads). For each, per GB of values: the server's CPU seconds (its main thread, user and
system from ``/proc/<pid>/task/<pid>/stat``), its read and write system calls (``/proc/<pid>/io``),
its context switches, and the commands it ran (``INFO commandstats``) per value.

Run: ``python3 scripts/probe/remote_load_cost.py [ROUNDS] [VALUE_MIB]``.
"""

import os
import statistics
import subprocess
import sys
import time

import kvoff
import numpy as np
from kvoff import _native
from kvoff.tier import REMOTE_HEADER_BYTES, TieredOffloadingManager
from kvoff.tools import bench_remote as br
from kvoff.tools import bench_remote_refs as refs

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
VALUE = int(float(sys.argv[2]) * (1 << 20)) if len(sys.argv) > 2 else 2 << 20
N = max(64, (256 << 20) // VALUE)
TICK = os.sysconf("SC_CLK_TCK")


def counters(pid: int, port: str) -> dict[str, float]:
    """The server's counters now: main-thread CPU (user, system), syscalls, context switches,
    and the calls of each command."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        st = f.read().rsplit(")", 1)[1].split()
    out = {"user_s": int(st[11]) / TICK, "sys_s": int(st[12]) / TICK}
    with open(f"/proc/{pid}/schedstat") as f:
        out["cpu_s"] = int(f.read().split()[0]) / 1e9
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            k, v = line.split(":")
            if k in ("syscr", "syscw"):
                out[k] = int(v)
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        for line in f:
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                k, v = line.split(":")
                out[k.split("_")[0]] = int(v)
    info = subprocess.run(
        ["redis-cli", "-p", port, "INFO", "commandstats"], capture_output=True, text=True, check=True
    ).stdout
    for line in info.splitlines():
        if line.startswith("cmdstat_"):
            name, rest = line[len("cmdstat_") :].split(":", 1)
            out["cmd_" + name] = int(rest.split(",")[0].split("=")[1])
    return out


def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a.get(k, 0) for k in b}


def main() -> None:
    block = VALUE - REMOTE_HEADER_BYTES
    base = np.random.default_rng(1).integers(0, 256, block, dtype=np.uint8)
    gb = N * VALUE / 1e9
    rows: dict[str, list[dict[str, float]]] = {}
    with refs.local_redis() as control:
        pid = control._proc.pid
        port = control.url.rsplit(":", 1)[1]
        ns = f"probe-{os.getpid()}"
        keys = [kvoff.make_offload_key(f"{ns}-{i}".encode(), 0) for i in range(N + br.WARM_BLOCKS)]
        kw = {
            "remote_max_queued_writes": N + br.WARM_BLOCKS,
            "remote_max_inflight_bytes": (N + br.WARM_BLOCKS) * VALUE,
            "remote_timeout_s": 2.0,
        }

        def engine(**more: object) -> tuple[TieredOffloadingManager, kvoff.HostRegion]:
            region = kvoff.HostRegion.private(N + br.WARM_BLOCKS, block)
            m = TieredOffloadingManager(
                "lru", N + br.WARM_BLOCKS, region, remote_url=control.url, namespace=ns, **{**kw, **more}
            )
            return m, region

        w, rw = engine()
        br._store_remote(w, rw, keys, block, base)
        w.shutdown()
        rw.close()
        ref = _native.NativeRemoteRef(control.url, VALUE, N)
        ref.set(8)
        try:
            for _ in range(ROUNDS):
                for io in (4, 8):
                    b, region = engine(remote_io_threads=io)
                    try:
                        warm = keys[N:]
                        t0 = time.perf_counter()
                        while b.lookup_prefix(warm) != len(warm):
                            if time.perf_counter() - t0 > 30:
                                raise RuntimeError("warm-up stalled")
                            time.sleep(br.STEP_S)
                        b.prepare_load(warm)
                        b.complete_load(warm)
                        c0, t0 = counters(pid, port), time.perf_counter()
                        gbs, ok = br._load_remote(b, region, keys[:N], block, base, [])
                        d = delta(c0, counters(pid, port))
                        d["gb_s"] = gbs
                        assert ok, "a block came back wrong"
                    finally:
                        b.shutdown()
                        region.close()
                    rows.setdefault(f"kvoff io={io}", []).append(d)
                for t in (4, 8):
                    c0 = counters(pid, port)
                    gbs, ok = ref.get(t)
                    d = delta(c0, counters(pid, port))
                    d["gb_s"] = gbs
                    assert ok, "the native client read a wrong value"
                    rows.setdefault(f"native threads={t}", []).append(d)
        finally:
            ref.close()
    print(f"{N} values of {VALUE} B ({gb:.3f} GB) per pass, {ROUNDS} rounds, median")
    head = "| client | GB/s | server CPU s/GB | user / sys s/GB | syscr / syscw per value |"
    head += " ctx vol / invol per value | commands per value |"
    print(head)
    print("|---" * 7 + "|")
    for name, ds in rows.items():

        def med(k: str, ds: list[dict[str, float]] = ds) -> float:
            return statistics.median(d.get(k, 0.0) for d in ds)

        cmds = sorted({k for d in ds for k in d if k.startswith("cmd_") and med(k) > 0})
        per = ", ".join(f"{k[4:]} {med(k) / N:.2f}" for k in cmds if k != "cmd_info")
        print(
            f"| {name} | {med('gb_s'):.2f} | {med('cpu_s') / gb:.3f} | {med('user_s') / gb:.3f} /"
            f" {med('sys_s') / gb:.3f} | {med('syscr') / N:.1f} / {med('syscw') / N:.1f} |"
            f" {med('voluntary') / N:.2f} / {med('nonvoluntary') / N:.2f} | {per} |"
        )


if __name__ == "__main__":
    main()
