"""``kvoff demo``: a simulated serving loop that offloads a model-shaped KV cache through kvoff.

The KV cache has Llama-3-8B's per-layer shapes: 32 layers, each a FlashAttention-layout tensor
``(2, num_gpu_blocks, 16 tokens, 8 KV heads, 128)`` in bf16, so 64 canonical tensors (K and V) of
32 KiB pages, 2 MiB per 16-token block. It lives on the GPU when there is one (CUDA engine), else in
host memory standing in for the GPU (host engine). The "GPU" pool is small and has its own LRU
prefix cache; requests share Pareto-distributed prefixes (docs/performance.md's manager workload, in blocks).

Per request, as an engine with kvoff would do it:

1. leading blocks found in the GPU pool are GPU hits;
2. the following blocks that the kvoff manager has (``lookup_prefix``) are pinned (``prepare_load``);
3. GPU blocks are freed by LRU eviction; the evicted blocks are offloaded (``prepare_store`` →
   GPU→CPU transfer → ``complete_store``; blocks already on the host are not copied again);
4. the CPU hits are loaded into fresh GPU blocks (CPU→GPU transfer → ``complete_load``) while the
   remaining blocks are "computed" (filled with their pattern);
5. **every reloaded block is compared byte for byte** with the pattern that was stored (each block
   holds a pattern derived from its key: per-layer random words plus a 64-bit key hash), and so are
   the GPU hits (a transfer that wrote a wrong block would corrupt them).

Transfers are observed by a :class:`kvoff.TransferMetrics` (GB/s per direction, engine-timed) and
the time saved is estimated against recomputing the loaded tokens at an assumed prefill rate.
"""

from __future__ import annotations

import hashlib
import math
import platform
import random
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import kvoff
from kvoff._names import EngineName, PolicyName
from kvoff.metrics import TransferMetrics
from kvoff.tools._progress import Progress
from kvoff.tools._toolbase import available_memory

# Llama-3-8B KV geometry.
LAYERS = 32
KV_HEADS = 8
HEAD_DIM = 128
BLOCK_TOKENS = 16
DTYPE_BYTES = 2  # bf16
PAGE_BYTES = BLOCK_TOKENS * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 32 KiB per layer per K/V
BLOCK_BYTES = 2 * LAYERS * PAGE_BYTES  # 2 MiB per 16-token block

#: Assumed prefill throughput of an 8B model on one H100/H200-class GPU, tokens/s. Rough: 8B
#: parameters ≈ 16 GFLOP per token, ≈ 400 TFLOP/s sustained in bf16 → ~25k tokens/s; attention
#: and batching overheads bring it to ~20k. Override with ``--prefill-tokens-per-s``.
DEFAULT_PREFILL_TOKENS_PER_S = 20_000.0

SWEEP_PAGES = (4 << 10, 16 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20)


@dataclass
class DemoConfig:
    """Settings of :func:`run_demo` (``None`` sizes are scaled to the memory at hand)."""

    requests: int = 160
    blocks_per_request: int = 24
    min_prefix_blocks: int = 4
    num_prefixes: int = 64
    gpu_blocks: int | None = None
    cpu_blocks: int | None = None
    policy: str = "arc"
    engine: str = "auto"
    device: str = "auto"
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    seed: int = 0
    show_progress: bool | None = None


@dataclass
class DemoResult:
    """What :func:`run_demo` measured (``asdict`` gives a JSON-friendly dict)."""

    device: str
    engine: str
    policy: str
    requests: int
    gpu_blocks: int
    cpu_blocks: int
    block_bytes: int
    blocks_requested: int = 0
    gpu_hit_blocks: int = 0
    cpu_hit_blocks: int = 0
    computed_blocks: int = 0
    pending_misses: int = 0
    evicted_from_gpu: int = 0
    stored_blocks: int = 0
    already_on_host: int = 0
    store_rejected: int = 0
    verified_loaded_blocks: int = 0
    verified_gpu_blocks: int = 0
    mismatched_blocks: int = 0
    failed_transfers: int = 0
    wall_s: float = 0.0
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    transfers: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def verified(self) -> bool:
        """Every checked block matched and no transfer failed."""
        return self.mismatched_blocks == 0 and self.failed_transfers == 0

    @property
    def hit_rate(self) -> float:
        """Blocks served from the GPU pool or the host, over all blocks requested."""
        return (self.gpu_hit_blocks + self.cpu_hit_blocks) / max(self.blocks_requested, 1)

    @property
    def offload_hit_rate(self) -> float:
        """Blocks loaded back from the host, over all blocks requested."""
        return self.cpu_hit_blocks / max(self.blocks_requested, 1)

    @property
    def recompute_s(self) -> float:
        """Estimated prefill time of the tokens that were loaded instead."""
        return self.cpu_hit_blocks * BLOCK_TOKENS / self.prefill_tokens_per_s

    @property
    def saved_s(self) -> float:
        """Estimated prefill time saved: recompute estimate minus the time spent loading."""
        loading: float = self.transfers.get("CPU_to_GPU", {}).get("seconds", 0.0)
        return self.recompute_s - loading

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("verified", "hit_rate", "offload_hit_rate", "recompute_s", "saved_s"):
            d[k] = getattr(self, k)
        d["transfers"] = {
            k: {kk: vv for kk, vv in v.items() if kk != "size_buckets"} for k, v in self.transfers.items()
        }
        return d


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is installed where the demo runs
        raise ImportError(
            "kvoff demo needs torch: pip install torch (or, in a kvoff checkout: pip install '.[torch]')"
        ) from e
    return torch


def _available_memory() -> int:
    return available_memory(default=4 << 30)


def _key(*parts: object) -> bytes:
    return kvoff.make_offload_key(hashlib.blake2b(repr(parts).encode(), digest_size=16).digest(), 0)


def _seed_of(key: bytes) -> int:
    """The 64-bit word added to every word of the key's block (as a signed int64)."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little", signed=True)


def make_requests(cfg: DemoConfig) -> list[list[bytes]]:
    """Requests of ``blocks_per_request`` block keys: a shared prefix ``p`` (Pareto, α = 1.2, as in
    docs/performance.md's manager workload) of ``min_prefix_blocks..blocks_per_request`` blocks, then blocks
    unique to the request. Keys are chained like block hashes: block ``j`` of prefix ``p`` is the
    same key in every request that shares at least ``j + 1`` blocks of ``p``."""
    rng = random.Random(cfg.seed)
    out = []
    for r in range(cfg.requests):
        p = min(int(rng.paretovariate(1.2)) - 1, cfg.num_prefixes - 1)
        length = rng.randint(min(cfg.min_prefix_blocks, cfg.blocks_per_request), cfg.blocks_per_request)
        keys = [_key("prefix", p, j) for j in range(length)]
        keys += [_key("req", r, j) for j in range(cfg.blocks_per_request - length)]
        out.append(keys)
    return out


class _KVPool:
    """The model-shaped "GPU" KV cache: one allocation, 32 per-layer tensors viewing it."""

    def __init__(self, torch: Any, num_blocks: int, device: str, seed: int) -> None:
        self.torch = torch
        self.device = device
        self.all = torch.zeros(
            (LAYERS, 2, num_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device
        )
        # The caches an engine registers: {layer name: (2, num_blocks, 16, 8, 128)} (K/V split).
        self.kv_caches = {f"model.layers.{i}.self_attn.attn": self.all[i] for i in range(LAYERS)}
        self.words = self.all.view(torch.int64)  # (layers, 2, blocks, 16, 8, 32)
        g = torch.Generator().manual_seed(seed)
        shape = (LAYERS, 2, BLOCK_TOKENS, KV_HEADS, HEAD_DIM * DTYPE_BYTES // 8)
        self.base = torch.randint(-(2**62), 2**62, shape, dtype=torch.int64, generator=g).to(device)

    def _expected(self, keys: list[bytes]) -> Any:
        torch = self.torch
        seeds = torch.tensor([_seed_of(k) for k in keys], dtype=torch.int64, device=self.device)
        return self.base.unsqueeze(2) + seeds.view(1, 1, -1, 1, 1, 1)

    def fill(self, block_ids: list[int], keys: list[bytes]) -> None:
        """Writes each key's pattern into its block (the "prefill")."""
        if block_ids:
            idx = self.torch.tensor(block_ids, dtype=self.torch.long, device=self.device)
            self.words.index_copy_(2, idx, self._expected(keys))

    def mismatches(self, block_ids: list[int], keys: list[bytes]) -> int:
        """Number of blocks whose bytes differ from their key's pattern."""
        if not block_ids:
            return 0
        torch = self.torch
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        got = self.words.index_select(2, idx)
        same = (got == self._expected(keys)).transpose(0, 2).reshape(len(block_ids), -1).all(dim=1)
        return int((~same).sum().item())


def _default_sizes(cfg: DemoConfig, cuda: bool) -> tuple[int, int]:
    """(GPU pool, CPU pool) in blocks: 64 and 192 blocks (128 + 384 MiB) when memory allows."""
    gpu, cpu = cfg.gpu_blocks, cfg.cpu_blocks
    if gpu is None or cpu is None:
        # Keep the demo (KV pool + host copy + temporaries) under ~1/4 of the available memory.
        budget_blocks = max(_available_memory() // 4 // BLOCK_BYTES, 3 * cfg.blocks_per_request)
        scale = min(1.0, budget_blocks / (64 + 192 + 2 * cfg.blocks_per_request))
        if gpu is None:
            gpu = max(cfg.blocks_per_request + 8, int(64 * scale))
        if cpu is None:
            cpu = max(cfg.blocks_per_request, int(192 * scale))
    if gpu < cfg.blocks_per_request:
        raise ValueError(f"gpu_blocks ({gpu}) must hold one request ({cfg.blocks_per_request} blocks)")
    return gpu, cpu


class _DemoLoop:
    """The simulated serving loop of :func:`run_demo`: the GPU pool's LRU and free blocks, the CPU
    tier's manager and handlers, and the result it counts into."""

    def __init__(self, pool: _KVPool, manager: Any, handlers: Any, res: DemoResult, gpu_blocks: int) -> None:
        self.pool = pool
        self.manager = manager
        self.store_h, self.load_h = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
        self.res = res
        self.gpu_lru: OrderedDict[bytes, int] = OrderedDict()  # key → GPU block, LRU first
        self.gpu_free = list(range(gpu_blocks - 1, -1, -1))
        self.job = 0

    def run_job(self, handler: Any, spec: tuple[Any, Any]) -> bool:
        self.job += 1
        handler.transfer_async(self.job, spec)
        handler.wait([self.job])
        ok = all(r.success for r in handler.get_finished())  # observed by `metrics`
        if not ok:
            self.res.failed_transfers += 1
        return ok

    def serve(self, keys: list[bytes]) -> None:
        """One request: GPU hits, then the offloaded prefix loaded while the rest is computed."""
        res, manager, pool = self.res, self.manager, self.pool
        n = len(keys)
        res.blocks_requested += n
        # 1. GPU prefix hits (pinned for this request by moving them to the MRU end).
        g = 0
        while g < n and keys[g] in self.gpu_lru:
            self.gpu_lru.move_to_end(keys[g])
            g += 1
        res.gpu_hit_blocks += g
        hit_blocks = [self.gpu_lru[k] for k in keys[:g]]
        # Blocks after the first GPU miss are recomputed or loaded into fresh GPU blocks; a
        # stale GPU copy of one of them (cached after a gap) is dropped.
        for k in keys[g:]:
            b = self.gpu_lru.pop(k, None)
            if b is not None:
                self.gpu_free.append(b)
        # 2. Offloaded prefix: pin it on the host before any eviction can take it.
        c = manager.lookup_prefix(keys[g:])
        if c is None:  # the first block is still being stored: recompute (retry later)
            res.pending_misses += 1
            c = 0
        load_keys = keys[g : g + c]
        cpu_spec = manager.prepare_load(load_keys) if c else None
        # 3. Free GPU blocks by LRU; offload what is evicted.
        need = n - g
        self._free_gpu_blocks(need)
        # 4. Load the offloaded prefix while the rest is "computed".
        fresh = [self.gpu_free.pop() for _ in range(need)]
        self._load_and_compute(keys[g + c :], load_keys, cpu_spec, fresh[:c], fresh[c:])
        res.mismatched_blocks += pool.mismatches(hit_blocks, keys[:g])
        res.verified_gpu_blocks += g
        manager.touch(keys)
        for k, b in zip(keys[g:], fresh, strict=True):
            self.gpu_lru[k] = b

    def _free_gpu_blocks(self, need: int) -> None:
        """Evicts GPU blocks by LRU until ``need`` are free, storing the evicted ones to the host."""
        res, manager = self.res, self.manager
        victims: list[tuple[bytes, int]] = []
        while len(self.gpu_free) < need:
            k, b = self.gpu_lru.popitem(last=False)
            victims.append((k, b))
            self.gpu_free.append(b)
        res.evicted_from_gpu += len(victims)
        if not victims:
            return
        vkeys = [k for k, _ in victims]
        out = manager.prepare_store(vkeys)
        if out is None:  # the host is full of pinned blocks: these are dropped
            res.store_rejected += len(victims)
            return
        skeys = list(out.keys_to_store)
        res.already_on_host += len(victims) - len(skeys)
        if skeys:
            where = dict(victims)
            gids = [where[k] for k in skeys]
            ok = self.run_job(self.store_h, (kvoff.GPULoadStoreSpec(gids), out.store_spec))
            manager.complete_store(skeys, success=ok)
            res.stored_blocks += len(skeys) if ok else 0

    def _load_and_compute(
        self,
        comp_keys: list[bytes],
        load_keys: list[bytes],
        cpu_spec: Any,
        load_gids: list[int],
        comp_gids: list[int],
    ) -> None:
        """Loads ``load_keys`` into ``load_gids`` while ``comp_keys`` are "computed" into
        ``comp_gids``, then verifies the loaded blocks (recomputing any that failed or differ)."""
        res, pool = self.res, self.pool
        c = len(load_keys)
        if c:
            self.job += 1
            load_job = self.job
            self.load_h.transfer_async(load_job, (cpu_spec, kvoff.GPULoadStoreSpec(load_gids)))
        pool.fill(comp_gids, comp_keys)
        res.computed_blocks += len(comp_keys)
        if not c:
            return
        self.load_h.wait([load_job])
        ok = all(r.success for r in self.load_h.get_finished())
        self.manager.complete_load(load_keys)
        if not ok:
            res.failed_transfers += 1
            pool.fill(load_gids, load_keys)  # recompute what could not be loaded
            return
        # 5. Verify every reloaded block, and the GPU hits, byte for byte.
        bad = pool.mismatches(load_gids, load_keys)
        if bad:  # report, then recompute so the damage does not spread
            res.mismatched_blocks += bad
            pool.fill(load_gids, load_keys)
        res.verified_loaded_blocks += c
        res.cpu_hit_blocks += c


def run_demo(cfg: DemoConfig | None = None, metrics: TransferMetrics | None = None) -> DemoResult:
    """Runs the simulated serving loop (see the module docs) and returns what it measured."""
    cfg = cfg or DemoConfig()
    _check_positive("prefill_tokens_per_s", cfg.prefill_tokens_per_s)
    for name in ("requests", "blocks_per_request", "num_prefixes"):
        if int(getattr(cfg, name)) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    torch = _torch()
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {cfg.device!r}")
    cuda = cfg.device == "cuda" or (
        cfg.device == "auto" and torch.cuda.is_available() and kvoff.cuda_available()
    )
    device = "cuda" if cuda else "cpu"
    gpu_blocks, cpu_blocks = _default_sizes(cfg, cuda)
    requests = make_requests(cfg)

    pool = _KVPool(torch, gpu_blocks, device, cfg.seed)
    manager = kvoff.create_manager(cast(PolicyName, cfg.policy), cpu_blocks, block_size=BLOCK_TOKENS)
    metrics = metrics if metrics is not None else TransferMetrics()
    metrics.attach_manager(manager)
    handlers = kvoff.CpuGpuOffloadingHandlers(
        pool.kv_caches, 1, cpu_blocks, engine=cast(EngineName, cfg.engine), metrics=metrics
    )
    dev_name = torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine() or "cpu")
    res = DemoResult(
        device=f"{device} ({dev_name})",
        engine=handlers.engine,
        policy=cfg.policy,
        requests=cfg.requests,
        gpu_blocks=gpu_blocks,
        cpu_blocks=cpu_blocks,
        block_bytes=BLOCK_BYTES,
        prefill_tokens_per_s=cfg.prefill_tokens_per_s,
    )

    loop = _DemoLoop(pool, manager, handlers, res, gpu_blocks)
    t0 = time.perf_counter()
    try:
        with Progress(cfg.requests, "kvoff demo", enabled=cfg.show_progress) as bar:
            for keys in requests:
                loop.serve(keys)
                bar.update(1)
        if cuda:
            torch.cuda.synchronize()
        res.wall_s = time.perf_counter() - t0
        snap = metrics.snapshot()
        res.transfers = {d: snap[d] for d in ("GPU_to_CPU", "CPU_to_GPU")}
        res.cache = snap.get("cache", {})
    finally:
        handlers.shutdown()  # the manager stays attached to `metrics`: its gauges stay readable
    return res


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def format_result(r: DemoResult) -> str:
    """The human-readable report of a demo run."""

    def pct(x: int) -> str:
        return f"{100 * x / max(r.blocks_requested, 1):5.1f}%"

    lines = [
        f"kvoff {kvoff.__version__} demo: simulated serving loop with Llama-3-8B KV shapes",
        (
            f"  KV cache  32 layers x (K, V), 8 KV heads x 128, {BLOCK_TOKENS}-token blocks, bf16: 64 tensors of "
            f"{PAGE_BYTES >> 10} KiB pages = {_mib(BLOCK_BYTES)} per block"
        ),
        f"  device    {r.device}, engine {r.engine}"
        + ("" if r.device.startswith("cuda") else "  (no GPU: host memory stands in for GPU memory)"),
        (
            f"  pools     GPU {r.gpu_blocks} blocks ({_mib(r.gpu_blocks * BLOCK_BYTES)}, LRU prefix cache), "
            f"host {r.cpu_blocks} blocks ({_mib(r.cpu_blocks * BLOCK_BYTES)}, kvoff {r.policy.upper()} manager)"
        ),
        (
            f"  workload  {r.requests} requests x {r.blocks_requested // max(r.requests, 1)} blocks, "
            f"Pareto-shared prefixes (docs/performance.md's manager workload, in blocks)"
        ),
        "",
        f"  blocks requested     {r.blocks_requested:>7}",
        f"  GPU prefix hits      {r.gpu_hit_blocks:>7}  {pct(r.gpu_hit_blocks)}",
        f"  loaded from host     {r.cpu_hit_blocks:>7}  {pct(r.cpu_hit_blocks)}   (offload hit rate)",
        f"  computed             {r.computed_blocks:>7}  {pct(r.computed_blocks)}",
        f"  hit rate             {100 * r.hit_rate:6.1f}%   (GPU + host)",
        (
            f"  evicted from GPU     {r.evicted_from_gpu:>7}  -> stored {r.stored_blocks}, already on host "
            f"{r.already_on_host}, rejected (host full) {r.store_rejected}"
        ),
    ]
    # Without a GPU the "GPU" pool is host memory too: the labels say what moves where.
    on_gpu = r.device.startswith("cuda")
    labels = ("stores GPU->CPU", "loads  CPU->GPU") if on_gpu else ("stores pool->host", "loads  host->pool")
    for d, label in zip(("GPU_to_CPU", "CPU_to_GPU"), labels, strict=True):
        t = r.transfers.get(d, {})
        lines.append(
            f"  {label:<17}    {_mib(t.get('bytes', 0)):>11} in {t.get('transfers', 0):>4} transfers, "
            f"{t.get('seconds', 0.0):7.3f} s  -> {t.get('gb_per_s', 0.0):6.2f} GB/s (engine-timed)"
        )
    verdict = "OK" if r.verified else "FAILED"
    lines += [
        (
            f"  verification         {verdict}: {r.verified_loaded_blocks} reloaded + {r.verified_gpu_blocks} "
            f"GPU-resident blocks compared byte for byte; {r.mismatched_blocks} mismatched, "
            f"{r.failed_transfers} failed transfers"
        ),
        (
            f"  prefill time saved   ~{r.saved_s:.2f} s = {r.cpu_hit_blocks * BLOCK_TOKENS:,} tokens loaded instead of "
            f"recomputed ({r.recompute_s:.2f} s) - {r.transfers.get('CPU_to_GPU', {}).get('seconds', 0.0):.2f} s "
            f"of loads"
        ),
        (
            f"                       assumption: prefill at {r.prefill_tokens_per_s:,.0f} tokens/s, an 8B model on "
            f"one H100-class GPU (--prefill-tokens-per-s)"
        ),
        f"  wall time            {r.wall_s:.1f} s",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Page-size sweep and plot
# ---------------------------------------------------------------------------------------------


def sweep_page_sizes(
    pages: tuple[int, ...] = SWEEP_PAGES,
    job_mib: int | None = None,
    reps: int = 5,
    engine: str = "auto",
    device: str = "auto",
    seed: int = 0,
    show_progress: bool | None = None,
) -> list[dict[str, Any]]:
    """GB/s per page size and direction: each job moves ``job_mib`` MiB of random blocks of up to 64
    tensors (median of ``reps``, engine-timed). Rows: ``{page_bytes, direction, gb_per_s, engine}``."""
    torch = _torch()
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available() and kvoff.cuda_available())
    dev = "cuda" if cuda else "cpu"
    job_bytes = (job_mib or (256 if cuda else 16)) << 20
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    with Progress(len(pages) * 2 * (reps + 1), "page-size sweep", enabled=show_progress) as bar:
        for page in pages:
            ntensors = max(1, min(64, job_bytes // (page * 64)))
            blocks = max(64, job_bytes // (page * ntensors))
            pool = 2 * blocks
            kv = [torch.full((pool, page), i + 1, dtype=torch.uint8, device=dev) for i in range(ntensors)]
            h = kvoff.CpuGpuOffloadingHandlers(kv, 1, pool, engine=cast(EngineName, engine))
            try:
                for direction, handler in (
                    ("GPU_to_CPU", h.gpu_to_cpu_handler),
                    ("CPU_to_GPU", h.cpu_to_gpu_handler),
                ):
                    secs = []
                    for r in range(reps + 1):
                        gids = kvoff.GPULoadStoreSpec(rng.sample(range(pool), blocks))
                        cids = kvoff.CPULoadStoreSpec(rng.sample(range(pool), blocks))
                        spec = (gids, cids) if direction == "GPU_to_CPU" else (cids, gids)
                        handler.transfer_async(r, spec)
                        handler.wait([r])
                        (result,) = handler.get_finished()
                        if not result.success:
                            raise RuntimeError(f"transfer failed: {result.error}")
                        if r:  # the first is a warm-up
                            secs.append(result.transfer_time)
                        bar.update(1)
                    secs.sort()
                    rows.append(
                        {
                            "page_bytes": page,
                            "tensors": ntensors,
                            "blocks": blocks,
                            "job_bytes": blocks * page * ntensors,
                            "direction": direction,
                            "gb_per_s": blocks * page * ntensors / secs[len(secs) // 2] / 1e9,
                            "engine": h.engine,
                        }
                    )
            finally:
                h.shutdown()
            del kv
    return rows


def plot_sweep(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Draws GB/s against page size, one line per direction, into ``path`` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "kvoff demo --plot needs matplotlib: pip install matplotlib (the demo itself does not)"
        ) from e
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for direction, marker in (("GPU_to_CPU", "o"), ("CPU_to_GPU", "s")):
        pts = sorted((r["page_bytes"], r["gb_per_s"]) for r in rows if r["direction"] == direction)
        if pts:
            ax.plot(
                [p for p, _ in pts], [v for _, v in pts], marker=marker, label=direction.replace("_", " ")
            )
    ax.set_xscale("log", base=2)
    ticks = sorted({r["page_bytes"] for r in rows})
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{p >> 20} MiB" if p >= 1 << 20 else f"{p >> 10} KiB" for p in ticks])
    ax.set_xlabel("page size (bytes per block per tensor)")
    ax.set_ylabel("GB/s (engine-timed, median)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title or f"kvoff scattered block transfers ({rows[0]['engine'] if rows else ''})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_sweep(rows: list[dict[str, Any]]) -> str:
    lines = ["  page-size sweep (random blocks, engine-timed median):"]
    for r in rows:
        p = r["page_bytes"]
        ps = f"{p >> 20} MiB" if p >= 1 << 20 else f"{p >> 10} KiB"
        lines.append(
            f"    {ps:>7} x {r['tensors']:>2} tensors x {r['blocks']:>5} blocks  {r['direction']:<10} "
            f"{r['gb_per_s']:6.2f} GB/s"
        )
    return "\n".join(lines)


def _check_positive(name: str, v: float) -> None:
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a positive number, got {v!r}")
