# requires: torch and a CUDA GPU (a probe run by hand on a GPU machine; not part of the kvoff package)
"""Probe: are equal-sized torch CUDA allocations (one per layer, as vLLM allocates its KV cache)
evenly spaced? Pitched DMA across tensors needs a constant distance ≤ 2^31 − 1."""

import torch

for n, mib in ((32, 64), (64, 256), (32, 1024), (32, 3000)):
    try:
        ts = [torch.empty(mib << 20, dtype=torch.uint8, device="cuda") for _ in range(n)]
    except torch.OutOfMemoryError:
        print(f"{n} x {mib} MiB: out of memory")
        continue
    d = sorted({ts[i + 1].data_ptr() - ts[i].data_ptr() for i in range(n - 1)})
    print(f"{n} x {mib} MiB: distinct distances {len(d)}: {[x >> 20 for x in d[:6]]} MiB")
    del ts
    torch.cuda.empty_cache()
