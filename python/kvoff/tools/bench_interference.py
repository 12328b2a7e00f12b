"""``kvoff bench interference``: transfers beside compute on one GPU (issue #12).

Per cell (page size, job size, directions, method) it measures, in one run with same-run
references: the model's slowdown (a persistent bf16 GEMM and a memory-bound kernel streaming
1 GiB on the SMs, ``torch.add`` over float32, each timed alone too, on the main thread's stream) while kvoff moves jobs continuously from another
thread on a side stream; the transfer GB/s beside each compute proxy and on an idle GPU; the
launch latency (CPU time of one small kernel launch) that a third thread sees while kvoff submits,
against its value with kvoff idle; and a byte-exact round trip (store, then load into other GPU
blocks) with GEMMs queued. Layout: ``TENSORS`` KV tensors (Llama-3-8B: 32 layers × K, V), one page
per tensor per block.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any, cast

from kvoff import _native
from kvoff._names import EngineName

TENSORS = 64
#: Seconds of compute queued (beside phases) or of idle transfers (idle phases) before measuring.
WARMUP_S = 0.1
#: Seconds of GEMMs before each cell's GEMM rounds (the power controller settles).
PREHEAT_S = 1.5
#: Chunks of ~5 ms of compute queued at most (``_Compute.run``).
_DEPTH = 4
#: Seconds of each GEMM round: at its power cap (700 W on an H100 SXM) a GEMM loop's SM clock
#: oscillates by about +-8% with a period of about a second (SW power cap), so much shorter rounds
#: in a fixed schedule read the oscillation's phase, not kvoff (0.2 s rounds read every method,
#: plain DMA included, 1-4% faster beside the transfers).
GEMM_ROUND_S = 1.0

#: (label, engine, compute_budget, KVOFF_CUDA_TUNE) of the default methods: every method with the
#: idle-GPU policy, ``auto`` with the default budget (2%: the serving policy while the model is seen
#: computing, the idle-GPU policy otherwise) and ``auto-serve``, the serving policy on every job.
#: ``dma`` is plain batched DMA (one batch entry per page, as vLLM moves blocks: the baseline);
#: ``dma2d`` is kvoff's DMA engine, which moves regular runs of pages as pitched copies.
DEFAULT_METHODS = [
    ("dma", "dma", None, "pitched=0"),
    ("dma2d", "dma", None, ""),
    ("kernel", "kernel", None, ""),
    ("staged", "staged", None, ""),
    ("auto-idle", "auto", None, ""),
    ("auto-serve", "auto", _native.DEFAULT_COMPUTE_BUDGET, "idleafter=0"),
    ("auto", "auto", _native.DEFAULT_COMPUTE_BUDGET, ""),
]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


class _Compute:
    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        self.b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        # The memory-bound proxy: a float32 add over 1 GiB, a kernel at the HBM's peak (3.0 TB/s
        # counting reads and writes on an H100, as the driver's device copy of the same bytes:
        # scripts/probe/mem_proxy.py).
        self.x = torch.empty(1 << 28, dtype=torch.float32, device="cuda").uniform_()
        self.y = torch.empty_like(self.x)
        self.n: dict[str, int] = {}
        self.secs = {"gemm": 1.0, "mem": 1.0}
        self.chunk: dict[str, int] = {}
        self.marks: list[Any] = []

    def run(self, kind: str, n: int) -> float:
        """Milliseconds per op of ``n`` back-to-back ops, at most ``_DEPTH`` chunks of ~5 ms queued
        at once (the thread sleeps on an event meanwhile, as a serving engine's thread waits on its
        step): a second of GEMMs queued at once fills the driver's launch queue, and the thread then
        waits inside the driver, where other threads' calls on its stream wait behind it."""
        torch = self.torch
        chunk = max(1, self.chunk.get(kind, 1))
        if not self.marks:
            self.marks = [torch.cuda.Event(blocking=True) for _ in range(_DEPTH)]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(n):
            self.op(kind)
            if (i + 1) % chunk == 0:
                m = self.marks[((i + 1) // chunk) % _DEPTH]
                m.synchronize()
                m.record()
        e.record()
        e.synchronize()
        return float(s.elapsed_time(e)) / n

    def queue(self, kind: str, seconds: float) -> None:
        """Queues about ``seconds`` of ops without waiting (``calibrate`` first)."""
        per_s = self.n[kind] / max(self.secs[kind], 1e-9)
        for _ in range(max(1, int(per_s * seconds))):
            self.op(kind)

    def op(self, kind: str) -> None:
        """One op of the proxy ``kind`` on the current stream."""
        if kind == "gemm":
            self.torch.mm(self.a, self.b)
        else:
            self.torch.add(self.x, 1.0, out=self.y)

    def calibrate(self, seconds: float, gemm_seconds: float | None = None) -> None:
        """Sizes a round: ``gemm_seconds`` of GEMMs (default ``seconds``), ``seconds`` of the
        memory-bound kernel."""
        self.secs = {"gemm": seconds if gemm_seconds is None else gemm_seconds, "mem": seconds}
        for kind in ("gemm", "mem"):
            self.run(kind, 5)
            ms = self.run(kind, 10)
            self.chunk[kind] = max(1, int(5.0 / ms + 0.999))
            self.n[kind] = max(10, int(self.secs[kind] * 1e3 / ms))

    def timed(self, kind: str, reps: int = 3) -> float:
        return _median([self.run(kind, self.n[kind]) for _ in range(reps)])


def _launch_latency(torch: Any, stop: threading.Event, out: list[float]) -> None:
    """Seconds (wall) that each small kernel launch on its own stream takes to return (every
    ~200 µs), until ``stop``."""
    s = torch.cuda.Stream()
    t = torch.zeros(256, device="cuda")
    with torch.cuda.stream(s):
        while not stop.is_set():
            t0 = time.perf_counter()
            t.add_(1)
            out.append(time.perf_counter() - t0)
            time.sleep(0.0002)
    s.synchronize()


def blocked_delta(first: Any, last: Any) -> tuple[int, list[int]] | None:
    """The device's sampled and blocked copy calls (``last_submit_stats()["driver_blocked"]``)
    between two readings, or ``None`` without both."""
    if not first or not last:
        return None
    return int(last[0] - first[0]), [int(b - a) for a, b in zip(first[1], last[1], strict=True)]


def format_blocked(d: tuple[int, list[int]] | None) -> str:
    """Sampled calls and, per mille of them, the blocked ones by time off the CPU (µs buckets)."""
    if d is None or d[0] <= 0:
        return "-"
    n, h = d
    return f"{n} sampled, blocked ‰ by µs 3/6/12/24/48/96/192/384+: " + "/".join(
        f"{1000 * x / n:.0f}" for x in h
    )


def _transfer_loop(
    torch: Any,
    kvoff: Any,
    h: Any,
    dirs: str,
    blocks: int,
    ngpu: int,
    ncpu: int,
    stop: threading.Event,
    stats: dict[str, Any],
    measuring: threading.Event,
) -> None:
    st, ld = h.gpu_to_cpu_handler, h.cpu_to_gpu_handler
    rng = random.Random(1)
    side = torch.cuda.Stream()
    try:
        _transfer_steps(torch, kvoff, st, ld, dirs, blocks, ngpu, ncpu, stop, stats, rng, side, measuring)
    except BaseException as e:  # reported by the caller
        stats["error"] = repr(e)
        raise


def _transfer_steps(
    torch: Any,
    kvoff: Any,
    st: Any,
    ld: Any,
    dirs: str,
    blocks: int,
    ngpu: int,
    ncpu: int,
    stop: threading.Event,
    stats: dict[str, Any],
    rng: random.Random,
    side: Any,
    measuring: threading.Event,
) -> None:
    """Moves jobs until ``stop``; counts bytes, failures and the policy of ``auto`` from when
    ``measuring`` is set (the warm-up before it is not counted)."""
    job, nbytes, failed = 1, 0, 0
    sms, longest, cpu = 0, 0, 0
    policies: dict[str, int] = {}
    methods: dict[str, int] = {}  # "st dma", "ld staged", ...: jobs per direction and method
    contention: list[tuple[int, ...]] = []  # the device's driver contention at each submit
    hist: list[Any] = [None, None]  # the device's blocked-call counts at the first and last submit
    t0: float | None = None
    with torch.cuda.stream(side):
        while not stop.is_set():
            if t0 is None and measuring.is_set():
                t0, nbytes, failed, policies, methods = time.perf_counter(), 0, 0, {}, {}
                contention = []
                hist = [None, None]
                sms, longest, cpu = 0, 0, 0
            ids = []
            if dirs in ("store", "both"):
                g = rng.sample(range(ngpu // 2), blocks)
                c = rng.sample(range(ncpu // 2), blocks)
                st.transfer_async(job, (kvoff.GPULoadStoreSpec(g), kvoff.CPULoadStoreSpec(c)))
                ids.append((st, job))
                s = st.last_submit_stats
                sms, longest = max(sms, s["sms"]), max(longest, s["longest_call_ns"])
                cpu = max(cpu, s["longest_call_cpu_ns"])
                policies[str(s.get("policy"))] = policies.get(str(s.get("policy")), 0) + 1
                mk = f"st {s.get('method')}{' polite' if s.get('polite') else ''} [{s.get('reason')}]"
                methods[mk] = methods.get(mk, 0) + 1
                contention.append(tuple(s.get("driver_contention") or ()))
                if t0 is not None:
                    hist = [hist[0] or s.get("driver_blocked"), s.get("driver_blocked")]
            if dirs in ("load", "both"):
                c = [ncpu // 2 + i for i in rng.sample(range(ncpu // 2), blocks)]
                g = [ngpu // 2 + i for i in rng.sample(range(ngpu // 2), blocks)]
                ld.transfer_async(job + 1, (kvoff.CPULoadStoreSpec(c), kvoff.GPULoadStoreSpec(g)))
                ids.append((ld, job + 1))
                s = ld.last_submit_stats
                sms, longest = max(sms, s["sms"]), max(longest, s["longest_call_ns"])
                cpu = max(cpu, s["longest_call_cpu_ns"])
                policies[str(s.get("policy"))] = policies.get(str(s.get("policy")), 0) + 1
                mk = f"ld {s.get('method')}{' polite' if s.get('polite') else ''} [{s.get('reason')}]"
                methods[mk] = methods.get(mk, 0) + 1
                contention.append(tuple(s.get("driver_contention") or ()))
                if t0 is not None:
                    hist = [hist[0] or s.get("driver_blocked"), s.get("driver_blocked")]
            for hd, j in ids:
                hd.wait([j])
            for r in st.get_finished() + ld.get_finished():
                failed += not r.success
                nbytes += r.transfer_size
            job += 2
    if t0 is None:  # stopped before the warm-up ended
        t0, nbytes = time.perf_counter(), 0
    stats["gb_s"] = nbytes / max(time.perf_counter() - t0, 1e-9) / 1e9
    stats["policies"] = policies
    stats["methods"] = methods
    full = [c for c in contention if len(c) >= 3]
    # Medians (of 1024): copy calls blocked on the driver's lock, and their time blocked.
    stats["contention"] = (
        (_median([float(c[1]) for c in full]), _median([float(c[2]) for c in full])) if full else None
    )
    stats["blocked_hist"] = blocked_delta(hist[0], hist[1])
    stats["failed"] = failed
    stats["sms"] = sms
    stats["longest_call_us"] = longest / 1e3
    stats["longest_call_cpu_us"] = cpu / 1e3


def _roundtrip(torch: Any, kvoff: Any, h: Any, comp: _Compute, blocks: int, ngpu: int, ncpu: int) -> bool:
    """Stores random blocks and loads them into other GPU blocks with GEMMs queued before and
    between; true when every byte matches."""
    rng = random.Random(2)
    src = rng.sample(range(ngpu // 2), blocks)
    dst = [ngpu // 2 + i for i in rng.sample(range(ngpu // 2), blocks)]
    cpu = rng.sample(range(ncpu), blocks)
    before = [t[src].clone() for t in h.gpu_tensors]
    st, ld = h.gpu_to_cpu_handler, h.cpu_to_gpu_handler
    side = torch.cuda.Stream()
    for _ in range(20):
        torch.mm(comp.a, comp.b)
    with torch.cuda.stream(side):
        st.transfer_async(10**9, (kvoff.GPULoadStoreSpec(src), kvoff.CPULoadStoreSpec(cpu)))
        st.wait([10**9])
    for _ in range(20):
        torch.mm(comp.a, comp.b)
    with torch.cuda.stream(side):
        ld.transfer_async(10**9 + 1, (kvoff.CPULoadStoreSpec(cpu), kvoff.GPULoadStoreSpec(dst)))
        ld.wait([10**9 + 1])
    torch.cuda.synchronize()
    ok = all(r.success for r in st.get_finished() + ld.get_finished())
    return ok and all(torch.equal(b, t[dst]) for b, t in zip(before, h.gpu_tensors, strict=True))


def _run_phase(
    torch: Any,
    kvoff: Any,
    h: Any,
    dirs: str,
    blocks: int,
    ngpu: int,
    ncpu: int,
    seconds: float,
    comp: _Compute | None,
    kind: str,
    lat: list[float] | None,
) -> tuple[dict[str, Any], float]:
    stop, measuring = threading.Event(), threading.Event()
    stats: dict[str, Any] = {}
    th = threading.Thread(
        target=_transfer_loop,
        args=(torch, kvoff, h, dirs, blocks, ngpu, ncpu, stop, stats, measuring),
        daemon=True,
    )
    lstop = threading.Event()
    lt = (
        threading.Thread(target=_launch_latency, args=(torch, lstop, lat), daemon=True)
        if lat is not None
        else None
    )
    if comp is not None:
        # The model is already computing when the transfers start (steady state: kvoff's
        # serving policy has seen it); this warm-up work is queued before the timed ops.
        comp.queue(kind, WARMUP_S)
    th.start()
    if lt:
        lt.start()
    # Warm-up, not counted: longer than the serving policy's idle window (100 ms), so an idle
    # phase measures the idle-GPU policy and not the end of the window of the phase before.
    # Beside compute, a little shorter than the queued warm-up, so the GPU never idles between
    # it and the timed ops (it does not before the alone reference either).
    time.sleep(WARMUP_S * 0.8 if comp is not None else 0.15)
    measuring.set()
    if comp is not None:
        ms = comp.timed(kind, reps=1)
    else:
        time.sleep(seconds)
        ms = 0.0
    stop.set()
    th.join(timeout=60)
    lstop.set()
    if lt:
        lt.join(timeout=10)
    if th.is_alive() or "gb_s" not in stats:
        raise RuntimeError(f"transfer loop did not finish ({stats})")
    return stats, ms


def serving_share(policies: dict[str, int]) -> float | None:
    """Share of jobs that ``auto`` ran with its serving policy (``None``: no job chose by policy)."""
    n = policies.get("serving", 0) + policies.get("idle", 0)
    return policies.get("serving", 0) / n if n else None


def method_mix(counts: dict[str, int]) -> str:
    """``{"st dma": 3, "st staged": 1, "ld staged": 4}`` as ``"st dma 75% staged 25%; ld staged 100%"``."""
    out = []
    for d in ("st", "ld"):
        mine = {k.split(" ", 1)[1]: v for k, v in counts.items() if k.startswith(d + " ")}
        n = sum(mine.values())
        if n:
            parts = " ".join(
                f"{m} {v * 100 / n:.0f}%" for m, v in sorted(mine.items(), key=lambda kv: -kv[1])
            )
            out.append(f"{d} {parts}")
    return "; ".join(out) or "-"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}"


def slowdown_row(kind: str, alone: list[float], beside: list[float], gbs: list[float]) -> dict[str, float]:
    """A proxy's slowdown and the transfers' median GB/s beside it.

    With bracketed rounds (A B A B ... A: one more alone round than beside rounds, beside round
    ``i`` between alone rounds ``i`` and ``i + 1``) the slowdown is the median over rounds of the
    time beside over the mean of its two neighbours, - 1: a drift of the proxy over the cell
    (clocks, power, heat) cancels to first order. Otherwise (paired rounds) it is the median beside
    over the median alone, - 1. ``{kind}_drift`` is the last alone round over the first, - 1."""
    if len(alone) == len(beside) + 1:
        slow = _median([b / ((alone[i] + alone[i + 1]) / 2) for i, b in enumerate(beside)]) - 1
    else:
        slow = _median(beside) / _median(alone) - 1
    return {
        f"{kind}_slowdown": slow,
        f"{kind}_gb_s": _median(gbs),
        f"{kind}_alone_ms": _median(alone),
        f"{kind}_drift": alone[-1] / alone[0] - 1,
    }


def _handlers(
    kvoff: Any, torch: Any, kv: list[Any], ncpu: int, engine: str, budget: float | None, tune: str
) -> Any:
    """Handlers over ``kv`` with ``KVOFF_CUDA_TUNE=tune`` set while their engines are made (the
    variable is restored afterwards)."""
    old = os.environ.get("KVOFF_CUDA_TUNE")
    if tune:
        os.environ["KVOFF_CUDA_TUNE"] = tune
    else:
        os.environ.pop("KVOFF_CUDA_TUNE", None)
    try:
        return kvoff.CpuGpuOffloadingHandlers(
            kv,
            1,
            ncpu,
            engine=cast(EngineName, engine),
            compute_budget=budget,
            compute_streams=[torch.cuda.current_stream()],
        )
    finally:
        if old is None:
            os.environ.pop("KVOFF_CUDA_TUNE", None)
        else:
            os.environ["KVOFF_CUDA_TUNE"] = old


def parse_method(s: str) -> tuple[str, str, float | None, str]:
    """``label:engine[:budget[:tune]]`` (budget a fraction or ``none``)."""
    parts = s.split(":", 3)
    if len(parts) == 1:
        for m in DEFAULT_METHODS:  # a default method by its label (auto-idle, auto-serve, ...)
            if m[0] == s:
                return m
        return (s, s, _native.DEFAULT_COMPUTE_BUDGET if s == "auto" else None, "")
    budget = None if len(parts) < 3 or parts[2] in ("", "none") else float(parts[2])
    return (parts[0], parts[1], budget, parts[3] if len(parts) > 3 else "")


def _launch_refs(torch: Any, seconds: float) -> dict[str, float]:
    """Kernel-launch latency with no transfers (p50, p99, max in µs), the reference of the cells'."""
    lat0: list[float] = []
    stop = threading.Event()
    lt = threading.Thread(target=_launch_latency, args=(torch, stop, lat0), daemon=True)
    lt.start()
    time.sleep(max(0.3, seconds))
    stop.set()
    lt.join()
    return {
        "launch_p50_us": _median(lat0) * 1e6,
        "launch_p99_us": _pct(lat0, 0.99) * 1e6,
        "launch_max_us": max(lat0) * 1e6,
    }


def _cell_row(
    torch: Any,
    kvoff: Any,
    h: Any,
    comp: Any,
    d: str,
    label: str,
    page_kib: int,
    job_bytes: int,
    blocks: int,
    ngpu: int,
    ncpu: int,
    seconds: float,
    rounds: int,
    say: Any,
) -> dict[str, Any]:
    """One cell of the grid: direction ``d`` of method ``label`` on handlers ``h``, idle and beside
    each compute proxy (``rounds`` rounds, bracketed by rounds alone)."""
    row: dict[str, Any] = {
        "page_kib": page_kib,
        "job_mib": job_bytes >> 20,
        "copies": blocks * TENSORS,
        "dirs": d,
        "method": label,
    }
    lat: list[float] = []
    st, _ = _run_phase(torch, kvoff, h, d, blocks, ngpu, ncpu, seconds, None, "", lat)
    row["idle_gb_s"] = st["gb_s"]
    row["serving_idle"] = serving_share(st["policies"])
    beside_policies: dict[str, int] = {}
    beside_methods: dict[str, int] = {}
    row["launch_p99_us"] = _pct(lat, 0.99) * 1e6
    row["launch_max_us"] = max(lat) * 1e6 if lat else float("nan")
    failed = st["failed"]
    sms, longest, cpu = st["sms"], st["longest_call_us"], st["longest_call_cpu_us"]
    blocked: dict[str, list[tuple[float, float]]] = {}
    hists: dict[str, tuple[int, list[int]]] = {}
    for kind in ("gemm", "mem"):
        alone, beside, gbs = [], [], []
        if kind == "gemm":
            # A GEMM loop runs an H100 SXM at its power cap, and the power
            # controller takes about a second to settle (SM clock 1245–1980
            # MHz seen): rounds taken meanwhile drift by ±8% whatever kvoff does.
            comp.run(kind, int(comp.n[kind] * PREHEAT_S / comp.secs[kind]) + 1)
        # Alone rounds bracket the beside rounds (see slowdown_row), each after
        # the same warm-up as the measurement beside the transfers: a GEMM
        # loop's clock falls as the GPU heats.
        comp.queue(kind, WARMUP_S)
        alone.append(comp.timed(kind, reps=1))
        for _ in range(rounds):
            st, ms = _run_phase(torch, kvoff, h, d, blocks, ngpu, ncpu, seconds, comp, kind, None)
            beside.append(ms)
            comp.queue(kind, WARMUP_S)
            alone.append(comp.timed(kind, reps=1))
            gbs.append(st["gb_s"])
            for k, v in st["policies"].items():
                beside_policies[k] = beside_policies.get(k, 0) + v
            for k, v in st["methods"].items():
                beside_methods[k] = beside_methods.get(k, 0) + v
            if st.get("contention"):
                blocked.setdefault(kind, []).append(st["contention"])
            if st.get("blocked_hist"):
                n0, h0 = hists.get(kind, (0, [0] * len(st["blocked_hist"][1])))
                n1, h1 = st["blocked_hist"]
                hists[kind] = (n0 + n1, [a + b for a, b in zip(h0, h1, strict=True)])
            failed += st["failed"]
            sms, longest = max(sms, st["sms"]), max(longest, st["longest_call_us"])
            cpu = max(cpu, st["longest_call_cpu_us"])
        row.update(slowdown_row(kind, alone, beside, gbs))
    row["serving_beside"] = serving_share(beside_policies)
    row["sms"] = sms
    row["longest_call_us"] = longest
    row["longest_call_cpu_us"] = cpu
    row["failed"] = failed
    row["methods_beside"] = method_mix(beside_methods)
    row["blocked_beside"] = {
        k: (_median([c[0] for c in v]), _median([c[1] for c in v])) for k, v in blocked.items()
    }
    say(format_row(row))
    if len({k.split()[1] for k in beside_methods}) > 1 or "auto" in label:
        bl = "; ".join(f"{k} {a:.0f}/{b:.0f}" for k, (a, b) in row["blocked_beside"].items())
        say(
            f"{'':>20}methods beside compute: {row['methods_beside']}"
            + (f"; blocked calls/time of 1024: {bl}" if bl else "")
        )
    for k, hv in hists.items():
        say(f"{'':>20}{label} beside {k}: {format_blocked(hv)}")
    row["blocked_hist"] = hists
    return row


def bench_interference(
    pages_kib: list[int] | None = None,
    jobs_mib: list[int] | None = None,
    dirs: list[str] | None = None,
    methods: list[str] | None = None,
    seconds: float = 0.3,
    log: Any = None,
    rounds: int = 3,
) -> dict[str, Any]:
    """Runs the grid; returns ``{"device", "refs", "rows"}`` (see the module docstring).

    Each compute proxy is timed beside the transfers ``rounds`` times, each round bracketed by
    rounds alone (alone, beside, alone, ..., alone), and the slowdown is the median over rounds of
    beside over the mean of its two neighbours (``slowdown_row``): the proxies drift by a few
    percent over a run (clocks, power, temperature), as much as the budget itself, so a reference
    taken once per cell, or only before each round, would bias the cells."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    import torch

    import kvoff

    if not (torch.cuda.is_available() and kvoff.cuda_available()):
        raise RuntimeError("kvoff bench interference needs a CUDA GPU and torch with CUDA")
    pages_kib = pages_kib or [4, 32]
    jobs_mib = jobs_mib or [8, 128]
    dirs = dirs or ["store", "both"]
    meths = [parse_method(m) for m in methods] if methods else DEFAULT_METHODS
    say = log or (lambda *_: None)
    comp = _Compute(torch)
    comp.calibrate(seconds, GEMM_ROUND_S)
    refs = {k: comp.timed(k) for k in ("gemm", "mem")}
    refs.update(_launch_refs(torch, seconds))
    say(f"refs: {refs}")
    rows: list[dict[str, Any]] = []
    for page_kib in pages_kib:
        for job_mib in jobs_mib:
            page = page_kib << 10
            blocks = max(1, (job_mib << 20) // (TENSORS * page))
            job_bytes = blocks * TENSORS * page
            ngpu, ncpu = 4 * blocks, 4 * blocks
            kv = [torch.empty(ngpu, page, dtype=torch.uint8, device="cuda") for _ in range(TENSORS)]
            for t in kv:
                t.random_(0, 255)
            for label, engine, budget, tune in meths:
                h = _handlers(kvoff, torch, kv, ncpu, engine, budget, tune)
                try:
                    for d in dirs:
                        row = _cell_row(
                            torch,
                            kvoff,
                            h,
                            comp,
                            d,
                            label,
                            page_kib,
                            job_bytes,
                            blocks,
                            ngpu,
                            ncpu,
                            seconds,
                            rounds,
                            say,
                        )
                        rows.append(row)
                    rt = _roundtrip(torch, kvoff, h, comp, blocks, ngpu, ncpu)
                    for r in rows[-len(dirs) :]:
                        r["roundtrip_ok"] = rt
                finally:
                    h.shutdown()
            del kv
            torch.cuda.empty_cache()
    refs["gemm_end"] = comp.timed("gemm")
    refs["mem_end"] = comp.timed("mem")
    return {"device": torch.cuda.get_device_name(), "refs": refs, "rows": rows}


HEADER = (
    f"{'page':>6}{'job':>6}{'copies':>8} {'dirs':<6}{'method':<12}{'idle':>7}{'gemm%':>8}{'GB/s':>7}"
    f"{'mem%':>8}{'GB/s':>7}{'drift%':>12}{'srv%':>9}{'sms':>5}{'call':>7}{'cpu':>6}{'lat99':>8}{'latmax':>9} ok"
)


def _drift(r: dict[str, Any]) -> str:
    """The proxies' drift over the cell, GEMM / memory-bound, in percent ("-" where not measured)."""
    g, m = r.get("gemm_drift"), r.get("mem_drift")
    if g is None or m is None:
        return "-"
    return f"{g * 100:+.1f}/{m * 100:+.1f}"


def format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['page_kib']:>5}K{r['job_mib']:>5}M{r['copies']:>8} {r['dirs']:<6}{r['method']:<12}"
        f"{r['idle_gb_s']:>7.1f}{r['gemm_slowdown'] * 100:>+7.1f}%{r['gemm_gb_s']:>7.1f}"
        f"{r['mem_slowdown'] * 100:>+7.1f}%{r['mem_gb_s']:>7.1f}"
        f"{_drift(r):>12}"
        f"{_share(r.get('serving_idle')) + '/' + _share(r.get('serving_beside')):>9}{r.get('sms', 0):>5}"
        f"{r.get('longest_call_us', 0.0):>7.0f}{r.get('longest_call_cpu_us', 0.0):>6.0f}{r['launch_p99_us']:>8.0f}"
        f"{r['launch_max_us']:>9.0f} {'ok' if r.get('roundtrip_ok', True) and not r['failed'] else 'FAIL'}"
    )


def format_interference(res: dict[str, Any]) -> str:
    refs = res["refs"]
    lines = [
        (
            f"transfers beside compute: {res['device']}; GEMM 8192³ bf16 {refs['gemm']:.3f} ms "
            f"(end {refs['gemm_end']:.3f}), 1 GiB float32 add {refs['mem']:.3f} ms (end {refs['mem_end']:.3f}); "
            f"launch latency alone p99 {refs['launch_p99_us']:.0f} µs, max {refs['launch_max_us']:.0f} µs"
        ),
        (
            "idle/GB/s: transfer GB/s (both directions summed) idle and beside each proxy; gemm%/mem%: its slowdown"
            " (median over rounds of beside / the mean of the alone rounds around it); drift%: the proxies' alone time,"
            " last round / first - 1 (GEMM/memory-bound; it cancels in the slowdown); sms: SMs kvoff's copy kernels may occupy;"
            " srv%: share of jobs auto ran with its serving policy, idle/beside compute;"
            " call/cpu: kvoff's longest driver call (µs wall / µs thread CPU); lat99/latmax: how long a second thread's kernel launch takes to return (µs)"
            " while kvoff submits"
        ),
        HEADER,
    ]
    lines += [format_row(r) for r in res["rows"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Page-size sweep and plot: kvoff beside the batch-DMA baseline and the contiguous-copy limit,
# idle, beside the GEMM and beside the memory-bound kernel
# ---------------------------------------------------------------------------------------------

#: Page sizes of the plot's sweep (KiB).
PLOT_PAGES_KIB = [4, 32, 128, 2048]
#: The compute proxies of the plot's sweep: (key, legend label, line style, marker).
PLOT_PROXIES = [
    ("idle", "idle", "-", "o"),
    ("gemm", "beside a GEMM", "--", "s"),
    ("mem", "beside a memory-bound kernel", ":", "^"),
]


def _contig_loop(
    torch: Any, dst: Any, src: Any, stop: threading.Event, stats: dict[str, Any], measuring: threading.Event
) -> None:
    """Contiguous copies of ``src`` into ``dst`` on a side stream until ``stop`` (the link's limit),
    counted from when ``measuring`` is set, as kvoff's transfers are."""
    side = torch.cuda.Stream()
    n, t0 = 0, None
    with torch.cuda.stream(side):
        while not stop.is_set():
            if t0 is None and measuring.is_set():
                n, t0 = 0, time.perf_counter()
            dst.copy_(src, non_blocking=True)
            side.synchronize()
            n += src.numel()
    if t0 is None:
        t0, n = time.perf_counter(), 0
    stats["gb_s"] = n / max(time.perf_counter() - t0, 1e-9) / 1e9


def _contig_phase(
    torch: Any, nbytes: int, direction: str, seconds: float, comp: _Compute | None, kind: str = "gemm"
) -> float:
    """GB/s of contiguous copies of ``nbytes`` in ``direction``, idle (``comp`` ``None``) or beside
    ``seconds`` of the proxy ``kind``."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst, src = (host, dev) if direction == "store" else (dev, host)
    stop, measuring, stats = threading.Event(), threading.Event(), cast(dict[str, Any], {})
    th = threading.Thread(target=_contig_loop, args=(torch, dst, src, stop, stats, measuring), daemon=True)
    # The same warm-up as kvoff's phases (_run_phase).
    if comp is not None:
        comp.queue(kind, WARMUP_S)
    th.start()
    time.sleep(WARMUP_S * 0.8 if comp is not None else 0.15)
    measuring.set()
    if comp is not None:
        comp.timed(kind, reps=1)
    else:
        time.sleep(seconds)
    stop.set()
    th.join(timeout=60)
    return float(stats.get("gb_s", float("nan")))


def sweep_for_plot(
    pages_kib: list[int] | None = None, job_mib: int = 64, seconds: float = 0.3, log: Any = None
) -> list[dict[str, Any]]:
    """GB/s per page size and direction for kvoff's default (``auto``, 2% budget), plain batched
    DMA and one contiguous copy of the same bytes, idle, beside the bf16 GEMM loop and beside the
    memory-bound kernel (a float32 add at the HBM's peak). Rows:
    ``{page_kib, dir, method, idle_gb_s, gemm_gb_s, mem_gb_s}``.

    Each figure is one phase of about ``seconds`` (plus a ~0.1 s warm-up): 18 phases per page size,
    about 8 s per page size at the default 0.3 s, half a minute for :data:`PLOT_PAGES_KIB`."""
    import torch

    import kvoff
    from kvoff.tools._toolbase import sweep_row_line

    if not (torch.cuda.is_available() and kvoff.cuda_available()):
        raise RuntimeError("kvoff bench interference --plot needs a CUDA GPU and torch with CUDA")
    say = log or (lambda *_: None)
    comp = _Compute(torch)
    comp.calibrate(seconds)
    rows: list[dict[str, Any]] = []
    for page_kib in pages_kib or PLOT_PAGES_KIB:
        page = page_kib << 10
        tensors = max(1, min(TENSORS, (job_mib << 20) // (page * 4)))
        blocks = max(4, (job_mib << 20) // (tensors * page))
        ngpu = ncpu = 4 * blocks
        kv = [torch.empty(ngpu, page, dtype=torch.uint8, device="cuda") for _ in range(tensors)]
        for label, engine, budget in (
            ("kvoff auto", "auto", _native.DEFAULT_COMPUTE_BUDGET),
            ("batched DMA", "dma", None),
        ):
            # Plain batched DMA (one batch entry per page) as the baseline.
            h = _handlers(kvoff, torch, kv, ncpu, engine, budget, "pitched=0" if engine == "dma" else "")
            try:
                for d in ("store", "load"):
                    row: dict[str, Any] = {"page_kib": page_kib, "dir": d, "method": label}
                    idle, _ = _run_phase(torch, kvoff, h, d, blocks, ngpu, ncpu, seconds, None, "", None)
                    row["idle_gb_s"] = idle["gb_s"]
                    for kind in ("gemm", "mem"):
                        near, _ = _run_phase(
                            torch, kvoff, h, d, blocks, ngpu, ncpu, seconds, comp, kind, None
                        )
                        row[f"{kind}_gb_s"] = near["gb_s"]
                    rows.append(row)
                    say(sweep_row_line(row))
            finally:
                h.shutdown()
        del kv
        torch.cuda.empty_cache()
        nbytes = blocks * tensors * page
        for d in ("store", "load"):
            row = {"page_kib": page_kib, "dir": d, "method": "contiguous copy"}
            row["idle_gb_s"] = _contig_phase(torch, nbytes, d, seconds, None)
            for kind in ("gemm", "mem"):
                row[f"{kind}_gb_s"] = _contig_phase(torch, nbytes, d, seconds, comp, kind)
            rows.append(row)
            say(sweep_row_line(row))
    return rows


def plot_sweep_rows(
    rows: list[dict[str, Any]],
    path: str,
    title: str = "",
    panel_titles: dict[str, str] | None = None,
    note: str = "",
) -> list[str]:
    """One panel per direction: GB/s against page size, one colour per method, solid idle, dashed
    beside the GEMM and dotted beside the memory-bound kernel (each drawn where the rows have it:
    ``{kind}_gb_s``), with a band from ``{kind}_gb_s_min`` to ``_max`` where the rows have them
    (repeated sweeps, :func:`kvoff.tools.bench.repeat_sweeps`). ``note``: lines under the panels. Returns
    the legend labels, in order."""
    from kvoff.tools._toolbase import require_matplotlib

    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panel_titles = panel_titles or {"store": "stores (GPU → host)", "load": "loads (host → GPU)"}
    dirs = [d for d in ("store", "load") if any(r["dir"] == d for r in rows)]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    drawn = [k for k, *_ in PLOT_PROXIES if all(r.get(f"{k}_gb_s") is not None for r in rows)]
    # One legend under the panels, a row per method: room for it (and the note) below the axes.
    note_h = 0.25 * (note.count("\n") + 1) + 0.05 if note else 0.0
    below = 0.15 + 0.22 * len(methods) + note_h
    height = 4.2 + below
    fig, axes = plt.subplots(1, max(1, len(dirs)), figsize=(6.5 * max(1, len(dirs)), height), squeeze=False)
    handles: dict[str, Any] = {}
    # strict=False: with no directions there is still one (empty) axis, and nothing to draw.
    for ax, d in zip(axes[0], dirs, strict=False):
        for i, m in enumerate(methods):
            mine = sorted(
                (r for r in rows if r["dir"] == d and r["method"] == m), key=lambda r: r["page_kib"]
            )
            if not mine:
                continue
            xs = [r["page_kib"] << 10 for r in mine]
            for kind, what, ls, marker in PLOT_PROXIES:
                ys = [r.get(f"{kind}_gb_s") for r in mine]
                if any(y is None for y in ys):
                    continue
                label = f"{m}, {what}"
                (line,) = ax.plot(xs, ys, marker=marker, ls=ls, color=f"C{i}", label=label)
                handles.setdefault(label, line)
                lo = [r.get(f"{kind}_gb_s_min") for r in mine]
                hi = [r.get(f"{kind}_gb_s_max") for r in mine]
                if all(v is not None for v in lo + hi):
                    ax.fill_between(xs, lo, hi, color=f"C{i}", alpha=0.18, linewidth=0)
        ticks = sorted({r["page_kib"] << 10 for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{p >> 20} MiB" if p >= 1 << 20 else f"{p >> 10} KiB" for p in ticks])
        ax.set_xlabel("page size (bytes per block per tensor)")
        ax.set_ylabel("GB/s")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.set_title(panel_titles.get(d, d))
    labels = list(handles)
    fig.legend(
        list(handles.values()),
        labels,
        loc="lower center",
        bbox_to_anchor=(0.5, note_h / height),
        ncol=max(1, len(drawn)),
        fontsize=8,
        frameon=False,
    )
    fig.suptitle(title or "kvoff transfers: idle, beside a GEMM and beside a memory-bound kernel")
    if note:
        fig.text(0.5, 0.06 / height, note, ha="center", va="bottom", fontsize=9, style="italic", wrap=True)
    fig.tight_layout(rect=(0.0, below / height, 1.0, 1.0))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return labels


def format_sweep_rows(rows: list[dict[str, Any]]) -> str:
    """The sweep's rows as a table; the beside-compute columns only where some row has them, the
    idle figure's min-max over repeated sweeps where the rows have it."""
    beside = [
        (k, h)
        for k, h in (("gemm", "beside GEMM"), ("mem", "beside mem"))
        if any(f"{k}_gb_s" in r for r in rows)
    ]
    width = max([16] + [len(str(r["method"])) + 2 for r in rows])
    spread = all("idle_gb_s_min" in r for r in rows)
    lines = [
        f"{'page':>8} {'dir':<6}{'method':<{width}}{'idle GB/s':>10}"
        + (f"{'min-max':>14}" if spread else "")
        + "".join(f"{h:>12}" for _, h in beside)
    ]
    for r in rows:
        p = r["page_kib"]
        ps = f"{p >> 10} MiB" if p >= 1024 else f"{p} KiB"
        cells = "".join(
            f"{'-':>12}" if r.get(f"{k}_gb_s") is None else f"{r[f'{k}_gb_s']:>12.1f}" for k, _ in beside
        )
        mm = f"{r['idle_gb_s_min']:.1f}-{r['idle_gb_s_max']:.1f}" if spread else ""
        lines.append(
            f"{ps:>8} {r['dir']:<6}{r['method']:<{width}}{r['idle_gb_s']:>10.1f}"
            + (f"{mm:>14}" if spread else "")
            + cells
        )
    return "\n".join(lines)
