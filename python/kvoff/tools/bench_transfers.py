"""``kvoff bench transfers`` (:mod:`kvoff.tools.bench` re-exports it): docs/performance.md's
scattered-block scenarios through the handler API (CUDA engine methods on a GPU, the host engine
otherwise), against one contiguous copy of the same bytes in the same run; and the page-size sweeps
that ``--plot`` draws (host engine here; the GPU's in :mod:`kvoff.tools.bench_interference`).
"""

from __future__ import annotations

import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import kvoff
from kvoff._names import Direction, EngineName
from kvoff._native import CPULoadStoreSpec
from kvoff.tools._progress import Progress
from kvoff.tools._toolbase import available_memory, sweep_row_line

#: docs/performance.md's scattered-block scenarios: (page bytes, tensors).
TRANSFER_SCENARIOS = [(4 << 10, 64), (32 << 10, 64), (128 << 10, 64), (2 << 20, 1)]
MIN_BLOCKS = 256


_available_memory = available_memory


def _fill_pattern(t: Any, seed: int) -> None:
    """Non-zero, block-distinct bytes, fast on CPU and GPU (no RNG over gigabytes)."""
    import torch

    flat = t.view(-1)
    n4 = flat.numel() // 4
    x = torch.arange(seed, seed + n4, dtype=torch.int32, device=t.device)
    x.mul_(-1640531535).bitwise_xor_(x >> 13)
    flat[: n4 * 4].copy_(x.view(torch.uint8))


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


#: What the host engine (src/engine/host.rs) does with one job: below ``HOST_PARALLEL_MIN_BYTES``
#: the dispatcher thread copies alone; above, the bytes are split over up to ``threads`` threads,
#: at least ``HOST_MIN_BYTES_PER_THREAD`` each.
HOST_PARALLEL_MIN_BYTES = 8 << 20
HOST_MIN_BYTES_PER_THREAD = 2 << 20


def host_engine_threads() -> int:
    """Threads the host engine splits a job over: the CPUs this process may run on, at most 8
    (``HostEngine::new``: ``min(available_parallelism, 8)``)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


class ThreadedCopy:
    """One contiguous copy of a buffer split over threads as the host engine splits a job (the
    same thread count, the same thresholds): the reference that kvoff's host engine is measured
    against. numpy's ``copyto`` releases the GIL, so the pieces copy in parallel."""

    def __init__(self, threads: int | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.threads = threads or host_engine_threads()
        self._pool = ThreadPoolExecutor(self.threads - 1) if self.threads > 1 else None

    def pieces(self, nbytes: int) -> int:
        if nbytes < HOST_PARALLEL_MIN_BYTES:
            return 1
        return max(1, min(self.threads, nbytes // HOST_MIN_BYTES_PER_THREAD))

    def copy(self, dst: Any, src: Any) -> None:
        """``dst[:] = src`` for 1-D uint8 numpy arrays of one size."""
        import numpy as np

        n = self.pieces(int(src.nbytes))
        if n == 1 or self._pool is None:
            np.copyto(dst, src)
            return
        cuts = [src.nbytes * k // n for k in range(n + 1)]
        futs = [
            self._pool.submit(np.copyto, dst[cuts[k] : cuts[k + 1]], src[cuts[k] : cuts[k + 1]])
            for k in range(1, n)
        ]
        np.copyto(dst[cuts[0] : cuts[1]], src[cuts[0] : cuts[1]])
        for f in futs:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> ThreadedCopy:  # noqa: PYI034 (Self needs typing_extensions on 3.10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def time_host_contiguous(nbytes: int, reps: int) -> tuple[float, int]:
    """GB/s of one contiguous copy of ``nbytes`` in host memory on the host engine's threads
    (:class:`ThreadedCopy`; median of ``reps`` after one warm-up) and the threads it used."""
    import numpy as np

    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    with ThreadedCopy() as tc:
        ts = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            tc.copy(dst, src)
            if i:  # the first copy also faults the destination's pages in
                ts.append(time.perf_counter() - t0)
        return nbytes / max(_median(ts), 1e-9) / 1e9, tc.pieces(nbytes)


#: Direction labels of the transfer tables: on a GPU the link's; on the host engine (no GPU) the
#: KV side is host memory standing in for GPU memory, so the table says store / load.
GPU_DIRS = ("GPU->CPU", "CPU->GPU")
HOST_DIRS = ("store", "load")
HOST_DIRS_NOTE = (
    "store: KV blocks (host memory standing in for GPU memory, no GPU here) -> a kvoff host region; "
    "load: back"
)


def _time_contiguous(torch: Any, nbytes: int, cuda: bool, reps: int) -> dict[str, float]:
    """GB/s of one contiguous copy of ``nbytes`` per direction (the same-run limit)."""
    if cuda:
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        _fill_pattern(dev, 1)
        _fill_pattern(host, 2)
        out = {}
        for name, dst, src in (("GPU->CPU", host, dev), ("CPU->GPU", dev, host)):
            ts = []
            for i in range(reps + 1):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst.copy_(src, non_blocking=True)
                b.record()
                b.synchronize()
                if i:
                    ts.append(a.elapsed_time(b) / 1e3)
            out[name] = nbytes / _median(ts) / 1e9
        return out
    # No GPU: the host engine's reference, a contiguous copy on the engine's threads.
    gbs, threads = time_host_contiguous(nbytes, reps)
    return {"store": gbs, "load": gbs, "threads": threads}


def bench_transfers(
    job_mib: int | None = None,
    reps: int = 5,
    methods: list[str] | None = None,
    show_progress: bool | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Scattered-block transfers through the handler API (docs/performance.md scenarios, scaled to the machine).

    Each job moves ``blocks`` random GPU blocks of every tensor to random CPU blocks (and back);
    figures are GB/s from the engine's own timing (CUDA events on a GPU), with the median of
    ``reps`` repetitions, and the ratio to one contiguous copy of the same bytes measured in the
    same run. The bytes of the last repetition of each direction are verified. Without torch the
    host engine runs on plain host buffers (numpy arrays and a :class:`kvoff.HostRegion`).
    """
    try:
        import torch
    except ImportError:
        if methods not in (None, ["host"]):
            raise RuntimeError(
                f"methods {methods} need torch and a CUDA GPU; without torch only 'host' runs"
            ) from None
        return _bench_transfers_host(job_mib, reps, show_progress, seed)

    from kvoff.handlers import CpuGpuOffloadingHandlers, GPULoadStoreSpec

    cuda = torch.cuda.is_available() and kvoff.cuda_available()
    device = "cuda" if cuda else "cpu"
    if methods is None:
        methods = ["auto", "auto-idle", "dma", "kernel", "staged"] if cuda else ["host"]
    if job_mib is None:
        job_mib = 512 if cuda else int(max(32, min(128, _available_memory() // (24 << 20))))
    job_target = job_mib << 20
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    steps = len(TRANSFER_SCENARIOS) * len(methods) * 2 * (reps + 1)
    with Progress(steps, "kvoff transfers", enabled=False if show_progress is False else None) as bar:
        for page, max_tensors in TRANSFER_SCENARIOS:
            ntensors = max(1, min(max_tensors, job_target // (page * MIN_BLOCKS)))
            blocks = max(MIN_BLOCKS, job_target // (page * ntensors))
            job_bytes = blocks * page * ntensors
            pool = 2 * blocks
            kv = [torch.empty(pool, page, dtype=torch.uint8, device=device) for _ in range(ntensors)]
            for i, t in enumerate(kv):
                _fill_pattern(t, 7919 * i + 1)
            ref = _time_contiguous(torch, job_bytes, cuda, reps)
            for method in methods:
                # "auto" is the handlers' default (serving budget 2%); "auto-idle" the idle-GPU policy.
                h = (
                    CpuGpuOffloadingHandlers(kv, 1, pool, engine="auto", compute_budget=None)
                    if method == "auto-idle"
                    else CpuGpuOffloadingHandlers(kv, 1, pool, engine=cast(EngineName, method))
                )
                try:
                    store_dir, load_dir = GPU_DIRS if cuda else HOST_DIRS
                    for direction, handler in (
                        (store_dir, h.gpu_to_cpu_handler),
                        (load_dir, h.cpu_to_gpu_handler),
                    ):
                        secs, walls = [], []
                        gids: list[int] = []
                        cids: list[int] = []
                        for r in range(reps + 1):
                            gids = rng.sample(range(pool), blocks)
                            cids = rng.sample(range(pool), blocks)
                            src, dst = (GPULoadStoreSpec(gids), CPULoadStoreSpec(cids))
                            spec = (src, dst) if direction == store_dir else (dst, src)
                            if cuda:
                                torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            handler.transfer_async(r, spec)
                            handler.wait([r])
                            wall = time.perf_counter() - t0
                            (res,) = handler.get_finished()
                            if not res.success:
                                raise RuntimeError(f"transfer failed: {res.error}")
                            if r:
                                secs.append(res.transfer_time)
                                walls.append(wall)
                            bar.update(1)
                        _verify(torch, h, gids, cids)
                        gbs = job_bytes / _median(secs) / 1e9
                        rows.append(
                            {
                                "device": torch.cuda.get_device_name()
                                if cuda
                                else platform.processor() or platform.machine(),
                                "engine": (
                                    h.engine
                                    if method in ("host", "auto")
                                    else "cuda:auto-idle"
                                    if method == "auto-idle"
                                    else f"cuda:{method}"
                                ),
                                "page_bytes": page,
                                "tensors": ntensors,
                                "blocks": blocks,
                                "job_bytes": job_bytes,
                                "direction": direction,
                                "gb_s": gbs,
                                "wall_gb_s": job_bytes / _median(walls) / 1e9,
                                "contiguous_gb_s": ref[direction],
                                "contiguous_threads": ref.get("threads"),
                                "ratio": gbs / ref[direction],
                                "verified_bytes": job_bytes,
                            }
                        )
                finally:
                    h.shutdown()
            del kv
    return rows


def _host_layout(
    page: int, ntensors: int, pool: int
) -> tuple[list[Any], Any, list[Any], list[list[tuple[int, int]]]]:
    """The host engine's buffers without torch: ``ntensors`` numpy arrays of ``pool`` pages (the
    "GPU" side, as the KV caches of a CPU engine, filled with a non-zero pattern) and a private
    :class:`kvoff.HostRegion` of ``pool`` block-major rows (the CPU side, as the handlers lay it
    out), with its per-tensor views and the native handler's tensor refs."""
    import numpy as np

    from kvoff import _native

    gpu = []
    for i in range(ntensors):
        a = np.empty((pool, page), dtype=np.uint8)
        a.view(np.uint32)[:] = (np.arange(pool * page // 4, dtype=np.uint32) * 2654435761 + i).reshape(
            pool, page // 4
        )
        gpu.append(a)
    region = _native.HostRegion.private(pool, page * ntensors)
    cpu = [region.view_numpy(0, i * page, page) for i in range(ntensors)]
    return gpu, region, cpu, [[(i, page) for i in range(ntensors)]]


def _bench_transfers_host(
    job_mib: int | None, reps: int, show_progress: bool | None, seed: int
) -> list[dict[str, Any]]:
    """:func:`bench_transfers` without torch: the host engine between numpy arrays (the "GPU" side,
    as the KV caches of a CPU engine) and a private :class:`kvoff.HostRegion` (the CPU side, one
    block-major row per CPU block, as the handlers lay it out), through the native handler."""
    import numpy as np

    from kvoff import _native

    if job_mib is None:
        job_mib = int(max(32, min(128, _available_memory() // (24 << 20))))
    job_target = job_mib << 20
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    device = platform.processor() or platform.machine()
    steps = len(TRANSFER_SCENARIOS) * 2 * (reps + 1)
    with Progress(
        steps, "kvoff transfers (host engine, numpy)", enabled=False if show_progress is False else None
    ) as bar:
        for page, max_tensors in TRANSFER_SCENARIOS:
            ntensors = max(1, min(max_tensors, job_target // (page * MIN_BLOCKS)))
            blocks = max(MIN_BLOCKS, job_target // (page * ntensors))
            job_bytes = blocks * page * ntensors
            pool = 2 * blocks
            gpu, region, cpu, refs = _host_layout(page, ntensors, pool)
            # The reference: one contiguous copy of the same bytes on the engine's threads, timed
            # just before each of kvoff's jobs, so that what else the machine does meanwhile
            # weighs on both alike.
            src_c, dst_c = np.ones(job_bytes, dtype=np.uint8), np.zeros(job_bytes, dtype=np.uint8)
            tc = ThreadedCopy()
            threads = tc.pieces(job_bytes)
            try:
                dirs: tuple[tuple[str, Direction], ...] = (
                    (HOST_DIRS[0], "gpu_to_cpu"),
                    (HOST_DIRS[1], "cpu_to_gpu"),
                )
                for direction, d in dirs:
                    h = _native.TransferHandler(d, gpu, cpu, refs, 1, "host")
                    secs, walls, contig = [], [], []
                    gids = cids = np.zeros(0, dtype=np.int64)
                    try:
                        for r in range(reps + 1):
                            gids = np.array(rng.sample(range(pool), blocks), dtype=np.int64)
                            cids = np.array(rng.sample(range(pool), blocks), dtype=np.int64)
                            t0 = time.perf_counter()
                            tc.copy(dst_c, src_c)
                            t_contig = time.perf_counter() - t0
                            t0 = time.perf_counter()
                            h.submit(r, gids, None, None, cids)
                            h.wait([r])
                            wall = time.perf_counter() - t0
                            ((_, ok, _, seconds, error),) = h.get_finished()
                            if not ok:
                                raise RuntimeError(f"transfer failed: {error}")
                            if r:  # the first repetition warms up (and faults pages in)
                                secs.append(seconds)
                                walls.append(wall)
                                contig.append(t_contig)
                            bar.update(1)
                    finally:
                        h.shutdown()
                    contiguous = job_bytes / max(_median(contig), 1e-9) / 1e9
                    for g, c in zip(gpu, cpu, strict=True):
                        if not np.array_equal(g[gids], c[cids]):
                            raise RuntimeError(
                                "transferred bytes differ from their source: kvoff bug, please report"
                            )
                    gbs = job_bytes / _median(secs) / 1e9
                    rows.append(
                        {
                            "device": device,
                            "engine": "host",
                            "page_bytes": page,
                            "tensors": ntensors,
                            "blocks": blocks,
                            "job_bytes": job_bytes,
                            "direction": direction,
                            "gb_s": gbs,
                            "wall_gb_s": job_bytes / _median(walls) / 1e9,
                            "contiguous_gb_s": contiguous,
                            "contiguous_threads": threads,
                            "ratio": gbs / contiguous,
                            "verified_bytes": job_bytes,
                        }
                    )
            finally:
                tc.close()
                del cpu
                region.close()
            del gpu, src_c, dst_c
    return rows


#: Page sizes (KiB) and default MiB per job of the host engine's page-size sweep (``kvoff bench --plot``
#: without a GPU): small jobs, a few seconds in all on two cores.
HOST_PLOT_PAGES_KIB = [4, 32, 128, 2048]
HOST_PLOT_JOB_MIB = 32
#: The host sweep's methods, as the plot labels them.
HOST_KVOFF = "kvoff host engine"
HOST_CONTIGUOUS = "contiguous copy (one memcpy on the engine's threads)"
HOST_PER_COPY = "per-copy baseline (one numpy copy per page)"
#: The host plot's note: what it does not show.
HOST_PLOT_NOTE = "idle only: beside-compute curves need a GPU (kvoff bench --plot on a GPU with torch)"


def sweep_host_for_plot(
    pages_kib: list[int] | None = None,
    job_mib: int | None = None,
    reps: int = 3,
    log: Callable[[Any], None] | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """The page-size sweep without a GPU (no torch needed): GB/s per page size and direction of
    kvoff's host engine (numpy arrays and a :class:`kvoff.HostRegion`, through the native handler,
    as :func:`bench_transfers` runs it without torch), of one contiguous ``memcpy`` of the same
    bytes split over the host engine's threads as it splits a job (:class:`ThreadedCopy`: the
    limit) and of one numpy copy per page (the CPU analogue of one batch entry
    per page, the batched-DMA baseline on a GPU). Wall time per job, median of ``reps`` after one
    warm-up; kvoff's last job per direction is verified byte for byte. Rows:
    ``{page_kib, dir, method, idle_gb_s, job_bytes, tensors, blocks}`` (``dir``: ``store`` moves the
    arrays' pages into the region, ``load`` back)."""
    import numpy as np

    from kvoff import _native

    say = log or (lambda *_: None)
    job_target = (job_mib or HOST_PLOT_JOB_MIB) << 20
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []

    def gbs(nbytes: int, ts: list[float]) -> float:
        return nbytes / max(_median(ts), 1e-9) / 1e9

    for page_kib in pages_kib or HOST_PLOT_PAGES_KIB:
        page = page_kib << 10
        # The GPU sweep's layout (bench_interference.sweep_for_plot): up to 64 tensors, >= 4 blocks.
        ntensors = max(1, min(64, job_target // (page * 4)))
        blocks = max(4, job_target // (ntensors * page))
        job_bytes = blocks * ntensors * page
        pool = 2 * blocks
        src_c, dst_c = np.ones(job_bytes, dtype=np.uint8), np.zeros(job_bytes, dtype=np.uint8)
        gpu, region, cpu, refs = _host_layout(page, ntensors, pool)
        tc = ThreadedCopy()
        try:
            dirs: tuple[tuple[str, Direction], ...] = (("store", "gpu_to_cpu"), ("load", "cpu_to_gpu"))
            for d, direction in dirs:
                h = _native.TransferHandler(direction, gpu, cpu, refs, 1, "host")
                times: dict[str, list[float]] = {HOST_KVOFF: [], HOST_PER_COPY: [], HOST_CONTIGUOUS: []}
                try:
                    # The three methods in turn within each repetition, so that what else the
                    # machine does meanwhile weighs on each alike.
                    for r in range(reps + 1):
                        t0 = time.perf_counter()
                        tc.copy(dst_c, src_c)
                        t_contiguous = time.perf_counter() - t0
                        gids = np.array(rng.sample(range(pool), blocks), dtype=np.int64)
                        cids = np.array(rng.sample(range(pool), blocks), dtype=np.int64)
                        t0 = time.perf_counter()
                        h.submit(r, gids, None, None, cids)
                        h.wait([r])
                        t_kvoff = time.perf_counter() - t0
                        ((_, ok, _, _, error),) = h.get_finished()
                        if not ok:
                            raise RuntimeError(f"transfer failed: {error}")
                        if r == reps:
                            for g, c in zip(gpu, cpu, strict=True):
                                if not np.array_equal(g[gids], c[cids]):
                                    raise RuntimeError(
                                        "transferred bytes differ from their source: kvoff bug, please report"
                                    )
                        g_ids, c_ids = rng.sample(range(pool), blocks), rng.sample(range(pool), blocks)
                        pairs = (
                            list(zip(c_ids, g_ids, strict=True))
                            if d == "store"
                            else list(zip(g_ids, c_ids, strict=True))
                        )
                        t0 = time.perf_counter()
                        for g, c in zip(gpu, cpu, strict=True):
                            dst, src = (c, g) if d == "store" else (g, c)
                            for di, si in pairs:
                                dst[di] = src[si]  # one copy of one page
                        t_per_copy = time.perf_counter() - t0
                        if r:  # the first repetition warms up
                            times[HOST_CONTIGUOUS].append(t_contiguous)
                            times[HOST_KVOFF].append(t_kvoff)
                            times[HOST_PER_COPY].append(t_per_copy)
                finally:
                    h.shutdown()
                for method, ts in times.items():
                    rows.append(
                        {
                            "page_kib": page_kib,
                            "dir": d,
                            "method": method,
                            "idle_gb_s": gbs(job_bytes, ts),
                            "job_bytes": job_bytes,
                            "tensors": ntensors,
                            "blocks": blocks,
                        }
                    )
                    say(sweep_row_line(rows[-1]))
        finally:
            tc.close()
            del cpu
            region.close()
        del gpu, src_c, dst_c
    return rows


#: Largest min-max spread of a point, as a fraction of its median, that ``--plot`` still calls
#: readable: beyond it the machine was too busy for the curves' order to mean anything.
SPREAD_LIMIT = 0.25
#: The figures of a sweep row that repeated sweeps spread (``{kind}_gb_s``).
_SWEEP_KINDS = ("idle", "gemm", "mem")


@dataclass
class Spread:
    """How far repeated sweeps disagree: ``worst`` is the largest (max - min) / median of any
    point, at ``where``."""

    sweeps: int
    worst: float
    where: str

    @property
    def too_large(self) -> bool:
        return self.sweeps > 1 and self.worst > SPREAD_LIMIT

    @property
    def note(self) -> str:
        """A line for the plot and the table."""
        if self.sweeps < 2:
            return "1 sweep: no spread measured (--plot-repeats 3 draws the min-max band of 3)"
        text = (
            f"{self.sweeps} sweeps: median line, min-max band; largest spread {self.worst:.0%} of the "
            f"median ({self.where})"
        )
        if self.too_large:
            text += (
                f". SPREAD TOO LARGE TO READ (> {SPREAD_LIMIT:.0%}): the machine was busy; "
                "rerun when idle or with more --plot-repeats"
            )
        return text


def repeat_sweeps(
    run: Callable[[], list[dict[str, Any]]], repeats: int, log: Callable[[str], None] | None = None
) -> tuple[list[dict[str, Any]], Spread]:
    """Runs a page-size sweep ``repeats`` times; returns one row per (page, direction, method)
    with each figure ``{kind}_gb_s`` the median of the sweeps and ``{kind}_gb_s_min`` /
    ``_max`` its spread, and the :class:`Spread` of all points."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sweeps = []
    for k in range(repeats):
        if log is not None and repeats > 1:
            log(f"page-size sweep {k + 1} of {repeats}")
        sweeps.append(run())
    merged: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
    values: dict[tuple[Any, Any, Any], dict[str, list[float]]] = {}
    for rows in sweeps:
        for r in rows:
            key = (r["page_kib"], r["dir"], r["method"])
            merged.setdefault(key, dict(r))
            for kind in _SWEEP_KINDS:
                v = r.get(f"{kind}_gb_s")
                if v is not None:
                    values.setdefault(key, {}).setdefault(kind, []).append(float(v))
    worst, where = 0.0, ""
    for key, row in merged.items():
        row["sweeps"] = repeats
        for kind, vs in values.get(key, {}).items():
            med = _median(vs)
            row[f"{kind}_gb_s"], row[f"{kind}_gb_s_min"], row[f"{kind}_gb_s_max"] = med, min(vs), max(vs)
            spread = (max(vs) - min(vs)) / med if med > 0 else 0.0
            if spread > worst:
                p = int(key[0])
                page = f"{p >> 10} MiB" if p >= 1024 else f"{p} KiB"
                worst, where = spread, f"{key[2]}, {key[1]}, {page}, {kind}"
    return list(merged.values()), Spread(repeats, worst, where)


def format_spread(spread: Spread) -> str:
    return f"spread: {spread.note}"


def plot_host_sweep_rows(rows: list[dict[str, Any]], path: str, spread_note: str = "") -> list[str]:
    """:func:`sweep_host_for_plot`'s rows as ``kvoff bench --plot`` draws them without a GPU (idle
    only, with :data:`HOST_PLOT_NOTE` and ``spread_note`` under the panels); returns the legend
    labels."""
    from kvoff.tools.bench_interference import plot_sweep_rows

    device = platform.processor() or platform.machine()
    return plot_sweep_rows(
        rows,
        path,
        title=f"kvoff host engine vs a contiguous memcpy and one copy per page, idle ({device})",
        panel_titles={"store": "stores (KV arrays → host region)", "load": "loads (host region → KV arrays)"},
        note=HOST_PLOT_NOTE + (f"\n{spread_note}" if spread_note else ""),
    )


def _verify(torch: Any, h: Any, gids: list[int], cids: list[int]) -> None:
    """The GPU-side blocks ``gids`` and the CPU blocks ``cids`` hold the same bytes (after either
    direction's last job)."""
    g = torch.tensor(gids, dtype=torch.long)
    c = torch.tensor(cids, dtype=torch.long)
    for gt, ct in zip(h.gpu_tensors, h.cpu_tensors, strict=True):
        a = gt.index_select(0, g.to(gt.device)).cpu()
        b = ct.index_select(0, c)
        if not torch.equal(a, b):
            raise RuntimeError("transferred bytes differ from their source: kvoff bug, please report")


def format_transfer_rows(rows: list[dict[str, Any]]) -> str:
    """The transfer rows as a table, then what the reference is and what was verified."""
    if not rows:
        return "no transfer results"
    host = all(r["direction"] in HOST_DIRS for r in rows)
    lines = [
        f"scattered block transfers (docs/performance.md scenarios, scaled): {rows[0]['device']}, kvoff {kvoff.__version__}",
        (
            f"{'engine':<14}{'page':>9}{'tensors':>8}{'blocks':>7}{'MiB':>6}  {'direction':<9}{'GB/s':>8}"
            f"{'wall GB/s':>10}{'contig GB/s':>12}{'ratio':>7}"
        ),
    ]
    for r in rows:
        page = r["page_bytes"]
        p = f"{page >> 20} MiB" if page >= 1 << 20 else f"{page >> 10} KiB"
        lines.append(
            f"{r['engine']:<14}{p:>9}{r['tensors']:>8}{r['blocks']:>7}{r['job_bytes'] >> 20:>6}  "
            f"{r['direction']:<9}{r['gb_s']:>8.2f}{r['wall_gb_s']:>10.2f}{r['contiguous_gb_s']:>12.2f}"
            f"{r['ratio'] * 100:>6.0f}%"
        )
    if host:
        threads = sorted({r.get("contiguous_threads") or 1 for r in rows})
        lines.append(HOST_DIRS_NOTE)
        lines.append(
            "contig: one contiguous memcpy of the same bytes in host memory, split over the host "
            f"engine's threads as it splits a job ({'/'.join(map(str, threads))} here); ratio = GB/s / contig"
        )
    else:
        lines.append("contig: one contiguous copy of the same bytes over the link; ratio = GB/s / contig")
    verified = sum(int(r.get("verified_bytes", 0)) for r in rows)
    lines.append(
        f"verified: the last job of each of the {len(rows)} rows compared byte for byte with its "
        f"source, {verified / 2**20:,.0f} MiB in all: all equal"
    )
    return "\n".join(lines)
