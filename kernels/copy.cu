// kvoff gather/scatter copy kernel.
//
// Copies a list of (src, dst, bytes) descriptors between device memory and host memory that is
// mapped into the device address space (pinned/registered host memory under UVA: the host pointer
// is the device pointer). One warp handles one descriptor at a time; the host splits long copies
// into chunks so that warps stay balanced. When both ends are 16-byte aligned, each lane moves
// 16-byte words with UNROLL loads in flight before the stores (enough bytes in flight to cover
// PCIe latency with a bounded number of CTAs); otherwise it falls back to a byte loop.
//
// Built to PTX by kernels/build_ptx.py (NVRTC 13.0, virtual arch compute_75); the PTX is committed
// as kernels/copy.ptx and loaded by the driver's module loader at run time.

struct KvoffCopy {
    unsigned long long src;
    unsigned long long dst;
    unsigned long long bytes;
};

#define KVOFF_UNROLL 8

// LOAD(p): how a 16-byte word is read. kvoff_copy uses plain loads; kvoff_copy_nc reads through the
// non-coherent (read-only) path, which can keep more reads of host memory in flight per SM.
#define KVOFF_COPY_BODY(LOAD)                                                                    \
    const unsigned lane = threadIdx.x & 31u;                                                     \
    const unsigned long long warp =                                                              \
        ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;                        \
    const unsigned long long nwarps = ((unsigned long long)gridDim.x * blockDim.x) >> 5;         \
    for (unsigned long long i = warp; i < n; i += nwarps) {                                      \
        const unsigned long long src = copies[i].src;                                            \
        const unsigned long long dst = copies[i].dst;                                            \
        const unsigned long long bytes = copies[i].bytes;                                        \
        if (((src | dst) & 15ull) == 0ull) {                                                     \
            const uint4* __restrict__ s = (const uint4*)src;                                     \
            uint4* __restrict__ d = (uint4*)dst;                                                 \
            const unsigned long long n16 = bytes >> 4;                                           \
            unsigned long long j = lane;                                                         \
            for (; j + 32ull * (KVOFF_UNROLL - 1) < n16; j += 32ull * KVOFF_UNROLL) {            \
                uint4 v[KVOFF_UNROLL];                                                           \
                _Pragma("unroll") for (int u = 0; u < KVOFF_UNROLL; ++u) v[u] = LOAD(s + j + 32ull * u); \
                _Pragma("unroll") for (int u = 0; u < KVOFF_UNROLL; ++u) d[j + 32ull * u] = v[u]; \
            }                                                                                    \
            for (; j < n16; j += 32ull) d[j] = LOAD(s + j);                                      \
            const unsigned long long done = n16 << 4;                                            \
            if (done + lane < bytes) {                                                           \
                ((unsigned char*)dst)[done + lane] = ((const unsigned char*)src)[done + lane];   \
            }                                                                                    \
        } else {                                                                                 \
            for (unsigned long long j = lane; j < bytes; j += 32ull) {                           \
                ((unsigned char*)dst)[j] = ((const unsigned char*)src)[j];                       \
            }                                                                                    \
        }                                                                                        \
    }

#define KVOFF_PLAIN_LOAD(p) (*(p))
#define KVOFF_NC_LOAD(p) __ldg(p)

extern "C" __global__ void __launch_bounds__(1024)
kvoff_copy(const KvoffCopy* __restrict__ copies, unsigned long long n)
{
    KVOFF_COPY_BODY(KVOFF_PLAIN_LOAD)
}

extern "C" __global__ void __launch_bounds__(1024)
kvoff_copy_nc(const KvoffCopy* __restrict__ copies, unsigned long long n)
{
    KVOFF_COPY_BODY(KVOFF_NC_LOAD)
}

// Test helper: keeps one thread busy for at least `ns` nanoseconds of wall time (used by the
// ordering tests to make work queued on the caller's stream slow).
extern "C" __global__ void kvoff_sleep(unsigned long long ns)
{
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
