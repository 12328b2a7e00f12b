# requires: torch and a CUDA GPU (a probe run by hand on a GPU machine; not part of the kvoff package)
"""Probe: what does the memory-bound proxy of the interference benchmarks compete with?

The driver's device-to-device copy (``y.copy_(x)``, ``cuMemcpyDtoDAsync``) against an SM kernel
moving the same bytes (``torch.add(x, 1, out=y)`` on float32): each alone, beside a bf16 8192^3 GEMM loop on another
stream (an SM kernel must share the SMs, a copy-engine copy need not), and the host->device DMA
rate of 256 MiB pinned copies alone and beside each (copy-engine or HBM contention).
Prints one table; run on the GPU machine: ``python3 scripts/probe/mem_proxy.py``."""

import torch

N = 1 << 30
dev = "cuda"
x = torch.empty(N, dtype=torch.uint8, device=dev).random_(0, 100)
y = torch.empty_like(x)
xf, yf = x.view(torch.float32), y.view(torch.float32)
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
dbuf = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
s_main, s_side, s_dma = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()

OPS = {
    "driver copy": lambda: y.copy_(x),
    "add kernel": lambda: torch.add(xf, 1.0, out=yf),
    "gemm": lambda: torch.mm(a, b),
}


def timed(name: str, n: int, stream) -> float:
    """ms per op of n ops on ``stream`` (events)."""
    with torch.cuda.stream(stream):
        for _ in range(3):
            OPS[name]()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            OPS[name]()
        e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / n


def busy(name: str, ms: float, stream) -> None:
    """Queues about ``ms`` of ``name`` on ``stream``."""
    per = timed(name, 5, stream)
    with torch.cuda.stream(stream):
        for _ in range(int(ms / per) + 1):
            OPS[name]()


def dma_gbs(stream, n: int = 8) -> float:
    with torch.cuda.stream(stream):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            dbuf.copy_(host, non_blocking=True)
        e1.record()
    e1.synchronize()
    return n * host.numel() / (e0.elapsed_time(e1) / 1e3) / 1e9


rows = []
dma_alone = dma_gbs(s_dma)
for name in ("driver copy", "add kernel"):
    alone = timed(name, 20, s_main)
    torch.cuda.synchronize()
    busy("gemm", 400, s_side)
    beside_gemm = timed(name, 20, s_main)
    torch.cuda.synchronize()
    busy(name, 400, s_side)
    dma = dma_gbs(s_dma)
    torch.cuda.synchronize()
    moved = 2 * N / (alone / 1e3) / 1e12
    rows.append((name, alone, moved, beside_gemm / alone, dma))
print(f"{torch.cuda.get_device_name()}; host->device DMA alone {dma_alone:.1f} GB/s (256 MiB copies)")
print(f"{'op on 1 GiB':<22}{'ms alone':>9}{'TB/s r+w':>10}{'x beside GEMM':>15}{'DMA GB/s beside':>17}")
for name, alone, moved, r, dma in rows:
    print(f"{name:<22}{alone:>9.3f}{moved:>10.2f}{r:>15.2f}{dma:>17.1f}")
