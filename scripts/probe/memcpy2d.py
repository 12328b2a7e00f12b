"""Probe: can pitched (2D) DMA copies move kvoff's strided page sets at link speed?
One 2D copy per KV block (rows = tensors, width = page), vs the contiguous copy."""
import time, ctypes
import cupy as cp
rt = cp.cuda.runtime
TENSORS = 64
def run(page, job_mib, d2h, reps=5):
    blocks = (job_mib << 20) // (TENSORS * page)
    ngpu = 4 * blocks
    gpu = cp.cuda.alloc(TENSORS * ngpu * page)
    host = cp.cuda.alloc_pinned_memory(TENSORS * blocks * page)
    hp = ctypes.addressof(ctypes.c_char.from_buffer(host)) if False else host.ptr
    s = cp.cuda.Stream(non_blocking=True)
    kind = rt.memcpyDeviceToHost if d2h else rt.memcpyHostToDevice
    best, cpu = 0.0, []
    for r in range(reps):
        s.synchronize()
        t = time.perf_counter()
        for b in range(blocks):
            g = gpu.ptr + (b * 3 % ngpu) * page     # block b of tensor 0; tensor t at + t*ngpu*page
            h = hp + b * TENSORS * page
            c0 = time.thread_time_ns()
            if d2h:
                rt.memcpy2DAsync(h, page, g, ngpu * page, page, TENSORS, kind, s.ptr)
            else:
                rt.memcpy2DAsync(g, ngpu * page, h, page, page, TENSORS, kind, s.ptr)
            cpu.append((time.thread_time_ns() - c0) / 1e3)
        s.synchronize()
        dt = time.perf_counter() - t
        best = max(best, blocks * TENSORS * page / dt / 1e9)
    cpu.sort()
    return best, cpu[len(cpu) // 2], cpu[int(len(cpu) * 0.99)], cpu[-1]
def contig(mib, d2h):
    n = mib << 20
    gpu = cp.cuda.alloc(n); host = cp.cuda.alloc_pinned_memory(n); s = cp.cuda.Stream(non_blocking=True)
    best = 0
    for r in range(5):
        s.synchronize(); t = time.perf_counter()
        if d2h: rt.memcpyAsync(host.ptr, gpu.ptr, n, rt.memcpyDeviceToHost, s.ptr)
        else: rt.memcpyAsync(gpu.ptr, host.ptr, n, rt.memcpyHostToDevice, s.ptr)
        s.synchronize(); best = max(best, n / (time.perf_counter() - t) / 1e9)
    return best
print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
for d2h in (True, False):
    print(("d2h" if d2h else "h2d"), "contiguous 128 MiB: %.1f GB/s" % contig(128, d2h))
    for page in (4096, 16384, 32768, 2 << 20 >> 6):
        for mib in (8, 128):
            g, p50, p99, mx = run(page, mib, d2h)
            print(f"  2D page {page>>10:>4}K job {mib:>4}M: {g:6.1f} GB/s  call cpu p50 {p50:.1f} p99 {p99:.1f} max {mx:.1f} us")
