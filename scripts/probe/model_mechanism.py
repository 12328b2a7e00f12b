"""Where does an eager model wait while kvoff moves data? (GPU machine; issue 45.)

Runs a Llama-3-8B-shaped model (kvoff.tools.model_llama) and, per cell, its step time alone and
beside kvoff (as ``kvoff bench model``), plus the model thread's host time to enqueue one step
(launch-bound when it exceeds the GPU time), for ablations of the engine's knobs and references
that isolate the mechanism: a side thread that only takes the GIL, and plain torch copies of a
contiguous pinned buffer (one DMA call per job). ``--profile`` adds a torch.profiler summary of the
model thread's CUDA API calls alone and beside kvoff.

Usage: python scripts/probe/model_mechanism.py [--impl torch|transformers] [--cells a,b] [--profile]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import kvoff
import torch
from kvoff.tools import bench_model as bm
from kvoff.tools import model_llama


def host_round(wl: Any, steps: int, mover: Any = None) -> tuple[float, float]:
    """(GPU ms per step, host ms to enqueue one step), each step ended by a synchronize."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = host = 0.0
    for _ in range(steps):
        if mover is not None:
            mover.submit_step()
        e0.record()
        t0 = time.perf_counter()
        wl.step()
        host += time.perf_counter() - t0
        e1.record()
        e1.synchronize()
        gpu += e0.elapsed_time(e1)
        if mover is not None:
            mover.collect()
    return gpu / steps, host * 1e3 / steps


class Side:
    """A side activity in a thread: ``gil`` (a Python loop that sleeps 100 µs a turn) or
    ``torchcopy`` (contiguous pinned copies of ``nbytes`` both ways on a side stream)."""

    def __init__(self, kind: str, nbytes: int) -> None:
        self.kind, self.stop, self.moved = kind, threading.Event(), 0
        self.lat: list[float] = []
        if kind == "torchcopy":
            self.h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.h2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            self.d2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def run(self) -> None:
        if self.kind == "query":
            ev = torch.cuda.Event()
            ev.record()
            ev.synchronize()
            while not self.stop.is_set():
                t0 = time.perf_counter()
                ev.query()
                self.lat.append(time.perf_counter() - t0)
                time.sleep(0.0002)
            return
        if self.kind == "gil":
            while not self.stop.is_set():
                time.sleep(0.0001)
            return
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        while not self.stop.is_set():
            with torch.cuda.stream(s1):
                self.d.copy_(self.h, non_blocking=True)
            with torch.cuda.stream(s2):
                self.h2.copy_(self.d2, non_blocking=True)
            s1.synchronize()
            s2.synchronize()
            self.moved += 2 * self.h.numel()


def side_cell(wl: Any, steps: int, kind: str, nbytes: int, rounds: int = 3) -> str:
    alone, beside, hosts_a, hosts_b = [], [], [], []
    g, h = host_round(wl, steps)
    alone.append(g)
    hosts_a.append(h)
    side = Side(kind, nbytes)
    wall = 0.0
    for _ in range(rounds):
        side.stop.clear()
        th = threading.Thread(target=side.run, daemon=True)
        th.start()
        time.sleep(0.05)
        m0, t0 = side.moved, time.perf_counter()
        g, h = host_round(wl, steps)
        wall += time.perf_counter() - t0
        side.moved -= 0
        moved = side.moved - m0
        side.stop.set()
        th.join()
        beside.append(g)
        hosts_b.append(h)
        g, h = host_round(wl, steps)
        alone.append(g)
        hosts_a.append(h)
    slow = bm._median([b / ((alone[i] + alone[i + 1]) / 2) for i, b in enumerate(beside)]) - 1
    gbs = moved * rounds / max(wall, 1e-9) / 1e9
    if kind == "query":
        lat = sorted(side.lat)
        q = [lat[int(f * (len(lat) - 1))] * 1e6 for f in (0.5, 0.9, 0.99)]
        kind = f"query p50/90/99 {q[0]:.1f}/{q[1]:.1f}/{q[2]:.1f}us"
    return (
        f"{kind:<28} slowdown {slow * 100:+7.1f}%  GB/s {gbs:6.1f}  host ms/step alone "
        f"{bm._median(hosts_a):7.2f} beside {bm._median(hosts_b):7.2f}  gpu ms alone {bm._median(alone):7.2f}"
    )


def kvoff_cell(wl: Any, steps: int, kv: Any, cell: bm.Cell, model_stream: Any, rounds: int = 3) -> str:
    """As bench_model.measure_cell, with the host enqueue time of each round."""
    h = kv.handlers(kvoff, cell.engine, [model_stream] if cell.stream else [])
    mover = bm._Mover(torch, kvoff, h, kv, cell.dirs)
    mover.poll = cell.pattern == "poll"
    alone, beside, hosts_a, hosts_b = [], [], [], []
    g, hh = host_round(wl, steps)
    alone.append(g)
    hosts_a.append(hh)
    wall = 0.0
    try:
        for _ in range(rounds):
            if cell.pattern in ("thread", "poll"):
                th = threading.Thread(target=mover.run_thread, daemon=True)
                th.start()
                time.sleep(0.05)
                mover.counting = True
                t0 = time.perf_counter()
                g, hh = host_round(wl, steps)
                wall += time.perf_counter() - t0
                mover.counting = False
                mover.stop.set()
                th.join(60)
                mover.stop.clear()
                mover.drain()
            else:
                mover.counting = True
                t0 = time.perf_counter()
                g, hh = host_round(wl, steps, mover)
                mover.drain()
                wall += time.perf_counter() - t0
                mover.counting = False
            beside.append(g)
            hosts_b.append(hh)
            g, hh = host_round(wl, steps)
            alone.append(g)
            hosts_a.append(hh)
    finally:
        h.shutdown()
    slow = bm._median([b / ((alone[i] + alone[i + 1]) / 2) for i, b in enumerate(beside)]) - 1
    sub = sorted(mover.submit_s)
    subs = f" submit µs p50 {sub[len(sub) // 2] * 1e6:.0f} max {sub[-1] * 1e6:.0f}" if sub else ""
    meth = " ".join(f"{k}:{v}" for k, v in sorted(mover.methods.items()))
    if mover.contention:
        cw = sorted(c[0] for c in mover.contention)
        cb = sorted(c[1] for c in mover.contention)
        meth += f" | contention wall p50 {cw[len(cw) // 2]} max {cw[-1]} blocked p50 {cb[len(cb) // 2]} max {cb[-1]}"
    name = f"{cell.engine} {cell.job_mib}M {cell.dirs} {cell.pattern} {'s' if cell.stream else 'ns'}"
    return (
        f"{name:<28} slowdown {slow * 100:+7.1f}%  GB/s {mover.nbytes / max(wall, 1e-9) / 1e9:6.1f}  host ms/step "
        f"alone {bm._median(hosts_a):7.2f} beside {bm._median(hosts_b):7.2f}  gpu ms alone "
        f"{bm._median(alone):7.2f}{subs} {meth}"
    )


def profile(wl: Any, steps: int, kv: Any, engine: str, model_stream: Any) -> None:
    """CUDA API calls of the model's thread (CPU time), alone and beside kvoff (128 MiB both)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    for label in ("alone", "beside"):
        mover = None
        th = None
        h = None
        if label == "beside":
            h = kv.handlers(kvoff, engine, [model_stream])
            mover = bm._Mover(torch, kvoff, h, kv, "both")
            th = threading.Thread(target=mover.run_thread, daemon=True)
            th.start()
            time.sleep(0.1)
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            host_round(wl, steps)
        if mover is not None and th is not None and h is not None:
            mover.stop.set()
            th.join(60)
            mover.drain()
            h.shutdown()
        print(f"--- profile {label} ({engine}) ---")
        ka = p.key_averages()
        rows = [e for e in ka if e.key.startswith("cuda") or e.key.startswith("cu")]
        rows.sort(key=lambda e: -e.cpu_time_total)
        for e in rows[:8]:
            print(
                f"  {e.key:<32} n={e.count:>6} cpu total {e.cpu_time_total / 1e3:9.2f} ms  avg {e.cpu_time_total / max(e.count, 1):8.1f} µs"
            )
        # GPU busy share of the model's kernels within the profiled window
        kern = [e for e in p.events() if e.device_type.name == "CUDA"]
        busy = sum(e.device_time for e in kern) / 1e3 if kern else 0.0
        print(f"  model GPU kernel time in window: {busy:.1f} ms over {steps} steps")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--workloads", default="decode")
    ap.add_argument("--cells", default="")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layout", default="layers")
    a = ap.parse_args()
    shape = model_llama.LLAMA3_8B
    model, used = model_llama.build(torch, shape, a.impl)
    print(f"model {used}; {torch.cuda.get_device_name()}", flush=True)
    model_stream = torch.cuda.current_stream()
    page = shape.kv_page_bytes
    kvs: dict[int, Any] = {}
    for w in a.workloads.split(","):
        try:
            wl = model_llama.Workload(torch, model, w, used, shape, "cuda")
        except Exception as e:  # noqa: BLE001 - a probe: say why and go on
            print(f"{w}: {used} failed: {e!r}; torch implementation")
            wl = model_llama.Workload(
                torch, model_llama.TorchLlama(torch, shape, "cuda"), w, "torch", shape, "cuda"
            )
        host_round(wl, 2)
        g, h = host_round(wl, 3)
        steps = max(3, int(500 / g))
        print(
            f"== {w} ({wl.impl}): gpu {g:.2f} ms/step, host enqueue {h:.2f} ms/step, {steps} steps a round",
            flush=True,
        )
        for spec in a.cells.split(";"):
            if not spec:
                continue
            f = spec.split("/")
            if f[0] in ("gil", "torchcopy", "query"):
                print(
                    side_cell(wl, steps, f[0], int(f[1]) << 20 if len(f) > 1 else 128 << 20, a.rounds),
                    flush=True,
                )
                continue
            cell = bm.Cell(w, f[0], int(f[1]), f[2], f[3], f[4] == "s")
            blocks = max(1, (cell.job_mib << 20) // (bm.TENSORS * page))
            if blocks not in kvs:
                kvs.clear()
                torch.cuda.empty_cache()
                kvs[blocks] = bm._Kv(torch, page, blocks, a.layout)
            try:
                print(kvoff_cell(wl, steps, kvs[blocks], cell, model_stream, a.rounds), flush=True)
            except Exception as e:  # noqa: BLE001 - a probe: say why and go on
                print(f"{spec}: failed {e!r}", flush=True)
        if a.profile:
            blocks = max(1, (128 << 20) // (bm.TENSORS * page))
            kv = kvs.get(blocks) or bm._Kv(torch, page, blocks, a.layout)
            profile(wl, 3, kv, "auto", model_stream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
