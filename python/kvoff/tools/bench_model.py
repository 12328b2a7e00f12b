"""``kvoff bench model``: kvoff's transfers beside a real model's forward on one GPU.

A Llama-shaped model (Llama-3-8B by default, random bf16 weights built from its config:
:mod:`kvoff.tools.model_llama`) runs one of three workloads on the main thread's stream — a decode
step of 64 sequences over a ~2k-token static cache, eagerly (about a thousand kernel launches a
step) or replayed from a CUDA graph, and an eager prefill of 4,096 tokens — and each step ends with
a synchronize, as a serving engine's step does. Its step time is measured alone and while kvoff
moves KV blocks of the model's geometry (64 tensors = 32 layers × K, V; 32 KiB pages) in two call
patterns:

- ``thread``: a side thread submits jobs (one direction or both at once) back to back on a side
  stream, waiting for each (as SGLang's HiCache controller or a Rust server's I/O thread would);
- ``vllm``: the model's own thread submits one job per direction right before each forward (the
  caller's stream is the model's, as in vLLM 0.33's worker) and collects finished ones without
  blocking; the CPU time of those ``transfer_async`` calls is reported (µs per call).

Per cell: engine (``auto`` = kvoff's default, ``dma`` = plain batched DMA, one entry per page, the
same-run reference), job size, directions, pattern, and whether the model's stream is passed as
``compute_streams``. Alone and beside rounds alternate (alone, beside, alone, ...); the slowdown is
the median over beside rounds of its time over the mean of its two alone neighbours, - 1 (drift
cancels). kvoff's GB/s is bytes finished over the beside rounds' wall time.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvoff.tools import model_llama
from kvoff.tools.bench_interference import blocked_delta, format_blocked
from kvoff.tools.model_llama import ModelShape

#: KV tensors of the transfers (Llama-3-8B: 32 layers × K, V).
TENSORS = 64
#: Seconds of one timed round of model steps (at least 3 steps).
ROUND_S = 0.5


@dataclass(frozen=True)
class Cell:
    workload: str  #: decode | graph | prefill
    engine: str  #: auto | dma (plain batched DMA) | any engine name, or label:engine:tune
    job_mib: int
    dirs: str  #: load | store | both
    pattern: str = "thread"  #: thread | vllm
    stream: bool = True  #: the model's stream passed as compute_streams
    layout: str = "layers"  #: the KV tensors' layout (see _Kv)

    @property
    def label(self) -> str:
        return self.engine.split(":", 1)[0]


@dataclass
class Result:
    cell: Cell
    slowdown: float
    alone_ms: float
    beside_ms: float
    gb_s: float
    failed: int
    methods: dict[str, int] = field(default_factory=dict)
    submit_us: float = float("nan")  #: vllm pattern: median CPU µs of one transfer_async
    submit_p99_us: float = float("nan")
    #: medians over the counted submits of the device's driver contention (of 1024): calls
    #: blocked, and their time blocked (``last_submit_stats()["driver_contention"]``)
    contention: tuple[float, float] = (float("nan"), float("nan"))
    #: the device's sampled copy calls and the blocked ones by time off the CPU over the counted
    #: submits (``last_submit_stats()["driver_blocked"]``)
    blocked_hist: tuple[int, list[int]] | None = None


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _engine_args(engine: str) -> tuple[str, str]:
    """``auto`` → (auto, ""), ``dma`` → (dma, pitched=0), ``label:engine:tune`` → (engine, tune);
    the tune's keys are joined by ``+`` (``--engines`` is a comma-separated list), as
    ``KVOFF_CUDA_TUNE``'s by commas."""
    if engine == "dma":
        return "dma", "pitched=0"
    parts = engine.split(":", 2)
    if len(parts) == 1:
        return engine, ""
    return parts[1], parts[2].replace("+", ",") if len(parts) > 2 else ""


class _Kv:
    """KV tensors of the model's geometry (separate from the model's own cache) and their handlers.

    ``layers`` (vLLM's layout): one allocation per layer holding its K and V pages, ``[2, blocks,
    page]``, each its own device allocation, so a block's pages in different layers form no
    regular grid; ``pool``: 64 ``[blocks, page]`` tensors from torch's caching allocator, which
    may carve them evenly spaced from one cached segment (then DMA moves a block's 64 pages as one
    pitched copy)."""

    def __init__(
        self, torch: Any, page: int, blocks: int, layout: str = "layers", device: str = "cuda"
    ) -> None:
        self.torch, self.device = torch, device
        self.blocks = blocks
        # GPU block ids are drawn from a pool 8x (layers) the job's blocks per half, so a job's
        # blocks are rarely consecutive (as in a serving engine's block pool after some churn).
        self.ngpu = (16 if layout == "layers" else 4) * blocks
        self.ncpu = 4 * blocks
        if layout == "layers":
            if device == "cuda":
                torch.cuda.empty_cache()  # each layer then gets an allocation of its own
            self.layers = [
                torch.empty(2, self.ngpu, page, dtype=torch.uint8, device=device) for _ in range(TENSORS // 2)
            ]
            self.kv = [t[i] for t in self.layers for i in (0, 1)]
        elif layout == "pool":
            self.kv = [torch.empty(self.ngpu, page, dtype=torch.uint8, device=device) for _ in range(TENSORS)]
        else:
            raise ValueError(f"unknown KV layout {layout!r} (layers, pool)")
        g = torch.Generator(device=device).manual_seed(3)
        for t in self.kv:
            t.random_(0, 256, generator=g)

    def handlers(self, kvoff: Any, engine: str, streams: list[Any]) -> Any:
        import os

        name, tune = _engine_args(engine)
        if self.device == "cpu":  # the harness on a machine without a GPU: kvoff's host engine
            name, tune, streams = "host", "", []
        old = os.environ.get("KVOFF_CUDA_TUNE")
        if tune:
            os.environ["KVOFF_CUDA_TUNE"] = tune
        else:
            os.environ.pop("KVOFF_CUDA_TUNE", None)
        try:
            return kvoff.CpuGpuOffloadingHandlers(self.kv, 1, self.ncpu, engine=name, compute_streams=streams)
        finally:
            if old is None:
                os.environ.pop("KVOFF_CUDA_TUNE", None)
            else:
                os.environ["KVOFF_CUDA_TUNE"] = old


class _Mover:
    """Submits jobs of ``dirs`` (``thread`` pattern: from its own thread until stopped; ``vllm``
    pattern: :meth:`submit_step` from the model's thread) and counts what finished."""

    def __init__(self, torch: Any, kvoff: Any, h: Any, kv: _Kv, dirs: str) -> None:
        self.torch, self.kvoff, self.h, self.kv, self.dirs = torch, kvoff, h, kv, dirs
        self.rng = random.Random(1)
        self.job = 1
        self.nbytes = 0
        self.failed = 0
        self.counting = False
        self.methods: dict[str, int] = {}
        self.submit_s: list[float] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.pending: list[tuple[Any, int]] = []
        #: thread pattern: poll get_finished (every 50 µs) instead of blocking in wait
        self.poll = False
        #: the device's driver contention at each counted submit (shares of 1024)
        self.contention: list[tuple[int, int, int]] = []
        #: the device's blocked-call counts at the first and the last counted submit
        self.hist: list[Any] = [None, None]
        #: counted submits whose stats were not read yet (:meth:`note_stats`)
        self.unnoted: list[tuple[Any, bool]] = []

    def _specs(self, store: bool) -> tuple[Any, Any]:
        k, b, r = self.kvoff, self.kv.blocks, self.rng
        half_g, half_c = self.kv.ngpu // 2, self.kv.ncpu // 2
        if store:
            g, c = r.sample(range(half_g), b), r.sample(range(half_c), b)
            return k.GPULoadStoreSpec(g), k.CPULoadStoreSpec(c)
        c = [half_c + i for i in r.sample(range(half_c), b)]
        g = [half_g + i for i in r.sample(range(half_g), b)]
        return k.CPULoadStoreSpec(c), k.GPULoadStoreSpec(g)

    def submit_step(self, note: bool = True) -> None:
        """One job per direction of ``dirs`` (the caller's current stream orders them). ``note``:
        read the submits' stats now; else :meth:`note_stats` reads them later (reading them waits
        for the handler's submit thread, which vLLM's thread never does before its forward)."""
        for store in (True, False):
            if self.dirs == ("load" if store else "store"):
                continue
            hd = self.h.gpu_to_cpu_handler if store else self.h.cpu_to_gpu_handler
            spec = self._specs(store)
            t0 = time.perf_counter()
            hd.transfer_async(self.job, spec)
            dt = time.perf_counter() - t0
            if self.counting:
                self.submit_s.append(dt)
                self.unnoted.append((hd, store))
            self.pending.append((hd, self.job))
            self.job += 1
        if note:
            self.note_stats()

    def note_stats(self) -> None:
        """Counts the methods and driver contention of the submits not noted yet."""
        for hd, store in self.unnoted:
            s = hd.last_submit_stats
            mk = f"{'st' if store else 'ld'} {s.get('method')}{' polite' if s.get('polite') else ''}"
            self.methods[mk] = self.methods.get(mk, 0) + 1
            c = s.get("driver_contention")
            if c is not None:
                self.contention.append((int(c[0]), int(c[1]), int(c[2]) if len(c) > 2 else 0))
            b = s.get("driver_blocked")
            self.hist = [self.hist[0] or b, b]
        self.unnoted.clear()

    def collect(self) -> int:
        """Notes finished jobs; returns how many."""
        done = self.h.gpu_to_cpu_handler.get_finished() + self.h.cpu_to_gpu_handler.get_finished()
        for r in done:
            if self.counting:
                self.failed += not r.success
                self.nbytes += r.transfer_size
        return len(done)

    def run_thread(self) -> None:
        cuda = self.kv.device == "cuda"
        side = self.torch.cuda.Stream() if cuda else None
        try:
            with self.torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                while not self.stop.is_set():
                    self.submit_step()
                    if self.poll:
                        want = len(self.pending)
                        while want and not self.stop.is_set():
                            want -= self.collect()
                            time.sleep(5e-5)
                        self.pending.clear()
                        continue
                    for hd, j in self.pending:
                        hd.wait([j])
                    self.pending.clear()
                    self.collect()
        except BaseException as e:  # noqa: BLE001 - reported by the caller (measure_cell raises it)
            self.error = e

    def drain(self) -> None:
        for hd, j in self.pending:
            hd.wait([j])
        self.pending.clear()
        self.collect()


def _round(torch: Any, wl: Any, steps: int, mover: _Mover | None) -> float:
    """Milliseconds per step of ``steps`` steps, each ended by a synchronize (a serving engine's
    step); with ``mover`` in the vllm pattern, its jobs are submitted before each step."""
    cuda = wl.device == "cuda"
    e0, e1 = (
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
    )
    total = 0.0
    for _ in range(steps):
        if mover is not None:
            mover.submit_step(note=False)
        if e0 is not None and e1 is not None:
            e0.record()
            wl.step()
            e1.record()
            e1.synchronize()
            total += e0.elapsed_time(e1)
        else:  # CPU: the step is synchronous
            t0 = time.perf_counter()
            wl.step()
            total += (time.perf_counter() - t0) * 1e3
        if mover is not None:
            mover.note_stats()
            mover.collect()
    return total / steps


def measure_cell(
    torch: Any, kvoff: Any, wl: Any, kv: _Kv, cell: Cell, steps: int, rounds: int, model_stream: Any
) -> Result:
    streams = [model_stream] if cell.stream else []
    h = kvoff_handlers = kv.handlers(kvoff, cell.engine, streams)
    alone, beside = [_round(torch, wl, steps, None)], []
    mover = _Mover(torch, kvoff, h, kv, cell.dirs)
    wall = 0.0
    warm = False
    try:
        for _ in range(rounds):
            if cell.pattern == "thread":
                th = threading.Thread(target=mover.run_thread, daemon=True)
                th.start()
                time.sleep(0.05)  # the transfers are running when the model's round starts
                mover.counting = True
                t0 = time.perf_counter()
                beside.append(_round(torch, wl, steps, None))
                wall += time.perf_counter() - t0
                mover.counting = False
                mover.stop.set()
                th.join(timeout=60)
                if th.is_alive():
                    raise RuntimeError("the transfer thread did not stop")
                mover.stop.clear()
                mover.drain()
            else:
                if not warm:
                    # One step before counting: the first submits of new handlers allocate
                    # the engine's staging ring and descriptor buffers (milliseconds, once; a
                    # serving engine keeps its handlers).
                    _round(torch, wl, 1, mover)
                    mover.drain()
                    warm = True
                mover.counting = True
                t0 = time.perf_counter()
                beside.append(_round(torch, wl, steps, mover))
                mover.drain()
                wall += time.perf_counter() - t0
                mover.counting = False
            if mover.error is not None:
                raise RuntimeError(f"transfers failed: {mover.error!r}")
            alone.append(_round(torch, wl, steps, None))
    finally:
        mover.stop.set()
        kvoff_handlers.shutdown()
    slow = _median([b / ((alone[i] + alone[i + 1]) / 2) for i, b in enumerate(beside)]) - 1
    sub = [x * 1e6 for x in mover.submit_s]
    return Result(
        cell,
        slow,
        _median(alone),
        _median(beside),
        mover.nbytes / max(wall, 1e-9) / 1e9,
        mover.failed,
        mover.methods,
        _median(sub) if cell.pattern == "vllm" else float("nan"),
        _pct(sub, 0.99) if cell.pattern == "vllm" else float("nan"),
        (
            (
                _median([float(c[1]) for c in mover.contention]),
                _median([float(c[2]) for c in mover.contention]),
            )
            if mover.contention
            else (float("nan"), float("nan"))
        ),
        blocked_delta(mover.hist[0], mover.hist[1]),
    )


def default_cells(
    workloads: list[str],
    jobs_mib: list[int],
    engines: list[str],
    dirs: tuple[str, ...] = ("load", "both"),
    patterns: tuple[str, ...] = ("thread", "vllm"),
) -> list[Cell]:
    """The grid: each workload × job size × ``dirs`` × stream passed or not × engine, from a
    side thread; then the vllm pattern on eager decode (both directions, stream passed). ``patterns``
    keeps either part alone."""
    unknown = set(patterns) - {"thread", "vllm"}
    if unknown:
        raise ValueError(f"unknown patterns {sorted(unknown)} (thread, vllm)")
    cells = [
        Cell(w, e, j, d, "thread", s)
        for w in workloads
        for j in jobs_mib
        for d in dirs
        for s in (True, False)
        for e in engines
        if "thread" in patterns
    ]
    if "decode" in workloads and "vllm" in patterns:
        cells += [Cell("decode", e, j, "both", "vllm", True) for j in (8, 128, 512) for e in engines]
    return cells


def bench_model(
    shape: ModelShape,
    cells: list[Cell],
    impl: str = "auto",
    rounds: int = 3,
    log: Any = None,
    device: str = "cuda",
    round_s: float = ROUND_S,
) -> dict[str, Any]:
    """Runs ``cells``; returns ``{"device", "impl", "alone", "rows"}``. ``device="cpu"`` runs the
    harness on the CPU with kvoff's host engine (its test; graph cells need CUDA)."""
    import torch

    import kvoff

    if device == "cuda" and not (torch.cuda.is_available() and kvoff.cuda_available()):
        raise RuntimeError("kvoff bench model needs a CUDA GPU and torch with CUDA")
    say = log or (lambda *_: None)
    t0 = time.perf_counter()
    model, used = model_llama.build(torch, shape, impl, device)
    say(f"model: {used} {shape} built in {time.perf_counter() - t0:.1f} s")
    model_stream = torch.cuda.current_stream() if device == "cuda" else None
    wls: dict[str, Any] = {}
    impls: dict[str, str] = {}
    for w in dict.fromkeys(c.workload for c in cells):
        try:
            wls[w] = model_llama.Workload(torch, model, w, used, shape, device)
            impls[w] = used
        except Exception as e:  # e.g. a transformers version whose forward cannot be captured
            if used != "transformers":
                raise
            say(f"{w}: {used} failed ({e!r}); using the torch implementation")
            tm = model_llama.TorchLlama(torch, shape, device)
            wls[w] = model_llama.Workload(torch, tm, w, "torch", shape, device)
            impls[w] = "torch"
    steps: dict[str, int] = {}
    alone: dict[str, float] = {}
    for w, wl in wls.items():
        _round(torch, wl, 2, None)
        ms = _round(torch, wl, 3, None)
        steps[w] = max(3, int(round_s * 1e3 / max(ms, 1e-3)))
        alone[w] = _round(torch, wl, steps[w], None)
        say(f"{w} ({impls[w]}): {alone[w]:.2f} ms per step alone, {steps[w]} steps a round")
    kvs: dict[tuple[int, str], _Kv] = {}
    rows: list[Result] = []
    page = shape.kv_page_bytes
    for c in cells:
        blocks = max(1, (c.job_mib << 20) // (TENSORS * page))
        if (blocks, c.layout) not in kvs:
            kvs.clear()
            if device == "cuda":
                torch.cuda.empty_cache()
            kvs[(blocks, c.layout)] = _Kv(torch, page, blocks, c.layout, device)
        r = measure_cell(
            torch, kvoff, wls[c.workload], kvs[(blocks, c.layout)], c, steps[c.workload], rounds, model_stream
        )
        rows.append(r)
        say(format_row(r))
    ok = _roundtrip(
        torch, kvoff, kvs[next(iter(kvs))] if kvs else _Kv(torch, page, 4, device=device), model_stream
    )
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (host engine)",
        "impl": impls,
        "alone_ms": alone,
        "page_bytes": page,
        "rows": rows,
        "roundtrip_ok": ok,
    }


def _roundtrip(torch: Any, kvoff: Any, kv: _Kv, model_stream: Any) -> bool:
    """Stores blocks and loads them into other GPU blocks with the default engine; true when every
    byte matches."""
    h = kv.handlers(kvoff, "auto", [model_stream] if model_stream is not None else [])
    try:
        rng = random.Random(2)
        src = rng.sample(range(kv.ngpu // 2), kv.blocks)
        dst = [kv.ngpu // 2 + i for i in rng.sample(range(kv.ngpu // 2), kv.blocks)]
        cpu = rng.sample(range(kv.ncpu), kv.blocks)
        before = [t[src].clone() for t in kv.kv]
        h.gpu_to_cpu_handler.transfer_async(1, (kvoff.GPULoadStoreSpec(src), kvoff.CPULoadStoreSpec(cpu)))
        h.gpu_to_cpu_handler.wait([1])
        h.cpu_to_gpu_handler.transfer_async(2, (kvoff.CPULoadStoreSpec(cpu), kvoff.GPULoadStoreSpec(dst)))
        h.cpu_to_gpu_handler.wait([2])
        if kv.device == "cuda":
            torch.cuda.synchronize()
        res = h.gpu_to_cpu_handler.get_finished() + h.cpu_to_gpu_handler.get_finished()
        return all(r.success for r in res) and all(
            torch.equal(b, t[dst]) for b, t in zip(before, kv.kv, strict=True)
        )
    finally:
        h.shutdown()


HEADER = (
    f"{'workload':<8} {'engine':<10} {'job':>5} {'dirs':<5} {'pattern':<7} {'stream':<6} "
    f"{'alone ms':>9} {'slowdown':>9} {'GB/s':>7} {'submit µs':>10}  methods"
)


def format_row(r: Result) -> str:
    c = r.cell
    sub = "-" if r.submit_us != r.submit_us else f"{r.submit_us:.0f}/{r.submit_p99_us:.0f}"
    meth = " ".join(f"{k}:{v}" for k, v in sorted(r.methods.items()))
    if r.contention[0] == r.contention[0]:
        meth += f"  blocked calls/time {r.contention[0]:.0f}/{r.contention[1]:.0f} of 1024"
    if r.blocked_hist is not None and r.blocked_hist[0] > 0:
        meth += f"  [{format_blocked(r.blocked_hist)}]"
    return (
        f"{c.workload:<8} {c.label:<10} {c.job_mib:>4}M {c.dirs:<5} {c.pattern:<7} {'yes' if c.stream else 'no':<6} "
        f"{r.alone_ms:>9.2f} {r.slowdown * 100:>+8.1f}% {r.gb_s:>7.1f} {sub:>10}  {meth}"
        + (f"  FAILED {r.failed}" if r.failed else "")
    )


def format_model(res: dict[str, Any]) -> str:
    lines = [
        f"device: {res['device']}; model: {res['impl']}; pages {res['page_bytes'] >> 10} KiB × {TENSORS} tensors",
        "alone: " + ", ".join(f"{k} {v:.2f} ms" for k, v in res["alone_ms"].items()),
        HEADER,
    ]
    lines += [format_row(r) for r in res["rows"]]
    lines.append(f"round trip byte-exact: {res['roundtrip_ok']}")
    return "\n".join(lines)


def plot_model(res: dict[str, Any], path: str) -> None:
    """Slowdown against kvoff's GB/s per cell, one marker per engine (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for eng in dict.fromkeys(r.cell.label for r in res["rows"]):
        rs = [r for r in res["rows"] if r.cell.label == eng]
        ax.scatter([r.gb_s for r in rs], [r.slowdown * 100 for r in rs], label=eng)
        for r in rs:
            c = r.cell
            ax.annotate(
                f"{c.workload[:3]} {c.job_mib}M {c.dirs[:2]}{'' if c.stream else ' ns'}",
                (r.gb_s, r.slowdown * 100),
                fontsize=6,
            )
    ax.axhline(5, ls="--", c="gray")
    ax.axhline(2, ls=":", c="gray")
    ax.set_xlabel("kvoff GB/s (both directions)")
    ax.set_ylabel("model slowdown %")
    ax.set_title(f"kvoff beside a Llama forward on {res['device']}")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def add_arguments(p: Any) -> None:
    """``kvoff bench model``'s options (also ``python -m kvoff.tools.bench_model``)."""
    p.add_argument(
        "--shape", default="llama3-8b", help="llama3-8b or tiny, with overrides: llama3-8b:layers=8"
    )
    p.add_argument("--impl", default="auto", choices=["auto", "transformers", "torch"])
    p.add_argument("--workloads", default="decode,graph,prefill")
    p.add_argument("--jobs", default="8,128", help="job sizes in MiB (side-thread cells)")
    p.add_argument(
        "--engines",
        default="auto,dma",
        help="auto, dma (plain batched DMA) or label:engine:tune (tune keys joined by +)",
    )
    p.add_argument("--dirs", default="load,both", help="directions of the side-thread cells")
    p.add_argument(
        "--patterns",
        default="thread,vllm",
        help="thread (jobs from a side thread) and/or vllm (before each step)",
    )
    p.add_argument("--layout", default="layers", choices=["layers", "pool"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default="", help="write a plot (PNG) here")


def run(args: Any) -> int:
    import json
    import sys

    shape = model_llama.shape_by_name(args.shape)
    cells = default_cells(
        [w for w in args.workloads.split(",") if w],
        [int(j) for j in args.jobs.split(",") if j],
        [e for e in args.engines.split(",") if e],
        tuple(d for d in args.dirs.split(",") if d),
        tuple(p for p in args.patterns.split(",") if p),
    )
    cells = [Cell(c.workload, c.engine, c.job_mib, c.dirs, c.pattern, c.stream, args.layout) for c in cells]
    res = bench_model(
        shape, cells, args.impl, args.rounds, log=lambda m: print(m, file=sys.stderr, flush=True)
    )
    if args.json:
        out = dict(res)
        out["rows"] = [
            {**r.cell.__dict__, **{k: v for k, v in r.__dict__.items() if k != "cell"}} for r in res["rows"]
        ]
        print(json.dumps(out, indent=1))
    else:
        print(format_model(res))
    if args.plot:
        plot_model(res, args.plot)
    return 0 if res["roundtrip_ok"] and not any(r.failed for r in res["rows"]) else 1


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvoff.tools.bench_model", description=__doc__)
    add_arguments(ap)
    raise SystemExit(run(ap.parse_args()))
