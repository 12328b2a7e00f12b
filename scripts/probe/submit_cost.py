"""Where the CPU time of one ``transfer_async`` goes (docs/performance.md, "The cost of a submit").

Run on the GPU machine: ``python3 scripts/probe/submit_cost.py [--blocks 4,64,256]``. Builds KV
tensors of Llama-3-8B's geometry (``kvoff bench model``'s: 32 per-layer allocations, 32 KiB pages,
64 pages a block), the default handlers with the "model" stream passed, and times, per job size,
the store and the load submitted back to back from the model's thread after a step of eager work
(2,000 small kernels on the model stream, then a synchronize: vLLM's pattern). Per call it splits
the wall time into the Python wrapper's checks (process, storages, current stream) and the
native call on the caller's thread (ids, the check, the stream's mark, the queue), and gives the
engine's ``submit_ns`` on the handler's submit thread (its driver calls, the choice) with the
engine's own stats.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import kvoff
import torch
from kvoff.tools.bench_model import _Kv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", default="4,64,256")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--tune", default="")
    a = ap.parse_args()
    model = torch.cuda.Stream()
    x = torch.zeros(1 << 16, device="cuda")
    print(
        f"{'blocks':>6} {'dir':>5} {'total':>7} {'p99':>7} {'checks':>7} {'stream':>7} {'native':>7} "
        f"{'engine':>7} {'calls':>5} {'longest':>8} {'paced':>7} method"
    )
    for blocks in [int(b) for b in a.blocks.split(",")]:
        kv = _Kv(torch, 32768, blocks)
        h = kv.handlers(kvoff, "auto" if not a.tune else f"x:auto:{a.tune}", [model])
        r = random.Random(1)
        rows: dict[str, list[tuple[float, ...]]] = {"store": [], "load": []}
        methods: dict[str, dict[str, int]] = {"store": {}, "load": {}}
        job = 0
        for it in range(a.calls + 5):
            with torch.cuda.stream(model):
                for _ in range(2000):
                    x.add_(1.0)
            model.synchronize()
            for d, hd in (("store", h.gpu_to_cpu_handler), ("load", h.cpu_to_gpu_handler)):
                half_g, half_c = kv.ngpu // 2, kv.ncpu // 2
                if d == "store":
                    g = kvoff.GPULoadStoreSpec(r.sample(range(half_g), blocks))
                    c = kvoff.CPULoadStoreSpec(r.sample(range(half_c), blocks))
                    spec = (g, c)
                else:
                    c = kvoff.CPULoadStoreSpec([half_c + i for i in r.sample(range(half_c), blocks)])
                    g = kvoff.GPULoadStoreSpec([half_g + i for i in r.sample(range(half_g), blocks)])
                    spec = (c, g)
                job += 1
                with torch.cuda.stream(model):
                    t0 = time.perf_counter()
                    hd.transfer_async(job, spec)
                    total = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    hd._check_process()
                    hd._check_storages()
                    checks = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    int(torch.cuda.current_stream().cuda_stream)
                    cur = time.perf_counter() - t0
                s = hd.last_submit_stats
                job += 1
                gpu, cpu = (spec[0], spec[1]) if d == "store" else (spec[1], spec[0])
                stream = int(model.cuda_stream)
                t0 = time.perf_counter()
                hd._native.submit(job, gpu.block_ids, None, None, cpu.block_ids, stream)
                native = time.perf_counter() - t0
                if it >= 5:
                    rows[d].append(
                        (
                            total,
                            checks,
                            cur,
                            native,
                            s["submit_ns"] * 1e-9,
                            s["driver_calls"],
                            s["longest_call_ns"] * 1e-9,
                            s["paced_ns"] * 1e-9,
                        )
                    )
                    key = f"{s['method']}{' fed' if s['fed'] else ''}{' polite' if s['polite'] else ''}"
                    methods[d][key] = methods[d].get(key, 0) + 1
            torch.cuda.synchronize()
            h.gpu_to_cpu_handler.get_finished()
            h.cpu_to_gpu_handler.get_finished()
        for d, rs in rows.items():
            med = [statistics.median(col) for col in zip(*rs, strict=True)]
            p99 = sorted(x[0] for x in rs)[max(0, int(len(rs) * 0.99) - 1)]
            us = lambda v: f"{v * 1e6:7.0f}"
            print(
                f"{blocks:6} {d:>5} {us(med[0])} {us(p99)} {us(med[1])} {us(med[2])} {us(med[3])} "
                f"{us(med[4])} {med[5]:5.0f} {med[6] * 1e6:8.0f} {us(med[7])} {methods[d]}"
            )
        h.shutdown()
        del kv, h
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
