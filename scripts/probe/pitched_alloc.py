# requires: cupy, torch and a CUDA GPU (a probe run by hand on a GPU machine; not part of the kvoff package)
"""Probe: does a pitched copy (cudaMemcpy2DAsync) whose rows lie in *different* allocations run
as fast as one whose rows lie in one allocation?

Why: the Python interference bench's 64 per-layer KV tensors of 512 KiB (torch's small pool, four
to a 2 MiB segment, the segments adjacent) form pitched runs in emission order, yet kvoff's DMA
moved them at 3-5 GB/s, where the same shape inside one allocation (the Rust bench) moves 36.
Layouts compared, D2H and H2D, 64 rows of 4 KiB per 2D copy (a KV block's pages across 64
tensors), the host side contiguous (pinned):
  one   - the 64 tensors are slices of one allocation (pitch 512 KiB);
  split - 64 separate torch allocations of 512 KiB that the allocator placed evenly (checked);
Also 64 batched 1D copies of the same rows as a reference (cudaMemcpyAsync each).

Run on a GPU machine: python3 scripts/probe/pitched_alloc.py
"""

import time

import cupy
import torch

ROW = 4096
ROWS = 64
TENSOR = 512 << 10
REPS = 400


def layouts() -> dict[str, list[int]]:
    one = torch.empty(ROWS * TENSOR, dtype=torch.uint8, device="cuda")
    split = [torch.empty(TENSOR, dtype=torch.uint8, device="cuda") for _ in range(ROWS)]
    ptrs = [t.data_ptr() for t in split]
    d = {ptrs[i + 1] - ptrs[i] for i in range(ROWS - 1)}
    print(f"split: strides between consecutive tensors: {sorted(d)[:6]}")
    keep.extend([one, split])
    out = {"one": [one.data_ptr() + i * TENSOR for i in range(ROWS)], "split": ptrs}
    # 2 MiB driver allocations (as torch's small pool makes them), four tensors to each; look
    # for 16 adjacent ones in ascending order among 64 tries.
    segs = sorted(cupy.cuda.runtime.malloc(2 << 20) for _ in range(64))
    keep.extend(segs)
    for i in range(len(segs) - 15):
        if all(segs[i + k + 1] - segs[i + k] == 2 << 20 for k in range(15)):
            out["segs"] = [segs[i] + k * TENSOR for k in range(ROWS)]
            break
    else:
        print("no 16 adjacent 2 MiB allocations found")
    return out


keep: list[object] = []


def main() -> None:
    rt = cupy.cuda.runtime
    host = torch.empty(REPS * ROWS * ROW, dtype=torch.uint8, pin_memory=True)
    s = cupy.cuda.Stream(non_blocking=True)
    print(torch.cuda.get_device_name())
    for name, ptrs in layouts().items():
        even = all(ptrs[i + 1] - ptrs[i] == ptrs[1] - ptrs[0] for i in range(ROWS - 1))
        pitch = ptrs[1] - ptrs[0]
        for d2h in (True, False):
            for mode in ("2d", "1d"):
                if mode == "2d" and not (even and pitch > 0):
                    continue
                torch.cuda.synchronize()
                t = time.perf_counter()
                for r in range(REPS):
                    h = host.data_ptr() + r * ROWS * ROW
                    # Each rep uses a different block offset inside the tensors (row r mod 128).
                    off = (r % (TENSOR // ROW)) * ROW
                    if mode == "2d":
                        if d2h:
                            rt.memcpy2DAsync(h, ROW, ptrs[0] + off, pitch, ROW, ROWS, 2, s.ptr)
                        else:
                            rt.memcpy2DAsync(ptrs[0] + off, pitch, h, ROW, ROW, ROWS, 1, s.ptr)
                    else:
                        for i in range(ROWS):
                            if d2h:
                                rt.memcpyAsync(h + i * ROW, ptrs[i] + off, ROW, 2, s.ptr)
                            else:
                                rt.memcpyAsync(ptrs[i] + off, h + i * ROW, ROW, 1, s.ptr)
                s.synchronize()
                dt = time.perf_counter() - t
                gb = REPS * ROWS * ROW / dt / 1e9
                print(
                    f"{name:6} even={even!s:5} pitch={pitch:>8} {'D2H' if d2h else 'H2D'} {mode}: "
                    f"{gb:6.2f} GB/s ({dt / REPS * 1e6:7.1f} us per 64-row copy)"
                )


if __name__ == "__main__":
    main()
