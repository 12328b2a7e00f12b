# requires: kvoff with its remote tier and native reference, numpy, redis-server and redis-cli on
# PATH (a probe run by hand; not part of the kvoff package)
"""Probe: what a 2 MiB store costs the server and the client, kvoff against the native client.

On one private redis-server, rounds alternate the native client's SET pass (4 threads, one SET
per key in flight per connection) with kvoff's store (``kvoff bench remote``'s: a fresh engine,
warmed by 8 untimed values, stores 128 blocks until the server acknowledged them;
``KVOFF_REMOTE_TUNE`` set by the caller applies). For each, per GB of values: the server's CPU
seconds (its main thread), this process's CPU seconds, and for kvoff the remote tier's I/O
threads' alone. Medians over the rounds. docs/performance.md "Tier tuning table" (the stored
value's checksum) holds what it measured.

Run: ``python3 scripts/probe/remote_store_cost.py [ROUNDS]``; A/B two builds by running it with
each on ``PYTHONPATH``, alternated.
"""

import os
import statistics
import sys
import time

import kvoff
import numpy as np
from kvoff import _native
from kvoff.tier import REMOTE_HEADER_BYTES, TieredOffloadingManager
from kvoff.tools import bench_remote as br
from kvoff.tools import bench_remote_refs as refs

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 7
VALUE = 2 << 20
BLOCK = VALUE - REMOTE_HEADER_BYTES
N = 128
WARM = 8


def main() -> None:
    with refs.local_redis() as ctl:
        ns = f"probe-store-{os.getpid()}"
        keys = [kvoff.make_offload_key(f"{ns}-{i}".encode(), 0) for i in range(N)]
        base = np.frombuffer(os.urandom(BLOCK), dtype=np.uint8)

        def engine() -> tuple[TieredOffloadingManager, kvoff.HostRegion]:
            region = kvoff.HostRegion.private(N + WARM, BLOCK)
            m = TieredOffloadingManager(
                "lru", N + WARM, region, remote_url=ctl.url, namespace=ns, remote_timeout_s=2.0
            )
            return m, region

        # Every timed store replaces values the server holds (as the bench's do).
        w, rw = engine()
        br._store_remote(w, rw, keys, BLOCK, base)
        w.shutdown()
        rw.close()
        ref = _native.NativeRemoteRef(ctl.url, VALUE, N)
        gb = N * VALUE / 1e9
        kv: list[tuple[float, float, float, float]] = []
        nat: list[tuple[float, float, float]] = []
        try:
            ref.set(4)
            for r in range(ROUNDS):
                c0, p0 = ctl.cpu_s(), time.process_time()
                g = float(ref.set(4))
                c1, p1 = ctl.cpu_s(), time.process_time()
                if c0 is not None and c1 is not None:
                    nat.append((g, (c1 - c0) / gb, (p1 - p0) / gb))
                a, ra = engine()
                try:
                    warm = [kvoff.make_offload_key(f"warm-{r}-{i}".encode(), 0) for i in range(WARM)]
                    br._store_remote(a, ra, warm, BLOCK, base)
                    spent: list[dict[str, float | None]] = []
                    g = br._store_remote(a, ra, keys, BLOCK, base, ctl.cpu_s, spent)
                    s = spent[0]
                    if s["server"] is not None and s["process"] is not None and s["io"] is not None:
                        kv.append((g, s["server"] / gb, s["process"] / gb, s["io"] / gb))
                finally:
                    a.shutdown()
                    ra.close()
        finally:
            ref.close()

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    print(
        f"kvoff  GB/s {med([x[0] for x in kv]):.2f}  server s/GB {med([x[1] for x in kv]):.3f}"
        f"  process s/GB {med([x[2] for x in kv]):.3f}  I/O threads s/GB {med([x[3] for x in kv]):.3f}"
    )
    print(
        f"native GB/s {med([x[0] for x in nat]):.2f}  server s/GB {med([x[1] for x in nat]):.3f}"
        f"  process s/GB {med([x[2] for x in nat]):.3f}"
    )


if __name__ == "__main__":
    main()
