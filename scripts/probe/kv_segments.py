"""Where torch's caching allocator puts the interference bench's per-layer KV tensors.

The Python bench frees one cell's tensors (and the proxies' 1 GiB buffers stay) before it makes
the next cell's: are the 64 "per-layer" tensors then separate driver allocations (as in a fresh
vLLM worker), or carved from one reused segment, evenly spaced (which kvoff's DMA takes for
pitched runs)? Prints, for the bench's shapes, how many distinct segments hold the tensors and
the spacing between neighbours. Run on a GPU: python3 scripts/probe/kv_segments.py
"""

import torch

TENSORS = 64


def segments_of(ts: list[torch.Tensor]) -> tuple[int, set[int]]:
    segs = torch.cuda.memory_snapshot()
    hits = set()
    for t in ts:
        p = t.data_ptr()
        for s in segs:
            if s["address"] <= p < s["address"] + s["total_size"]:
                hits.add(s["address"])
    gaps = {ts[i + 1].data_ptr() - ts[i].data_ptr() for i in range(len(ts) - 1)}
    return len(hits), gaps


x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # the memory-bound proxy's buffers
y = torch.empty_like(x)
for page_kib, job_mib in [(4, 8), (4, 128), (32, 8), (32, 128)]:
    page = page_kib << 10
    ngpu = max(64, 4 * (job_mib << 20) // (page * TENSORS))
    for trial in ("fresh", "after a freed cell"):
        kv = [torch.empty(ngpu, page, dtype=torch.uint8, device="cuda") for _ in range(TENSORS)]
        n, gaps = segments_of(kv)
        print(f"{page_kib:>3} KiB x {job_mib:>3} MiB jobs, {ngpu} blocks/tensor ({trial}): "
              f"{n} segment(s) for {TENSORS} tensors; neighbour gaps {sorted(gaps)[:4]}")
        del kv
