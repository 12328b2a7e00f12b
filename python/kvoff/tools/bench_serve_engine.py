"""The engine side of ``kvoff bench serve`` (:mod:`kvoff.tools.bench_serve`): one child process
runs vLLM's async engine over one workload and one configuration and writes its figures to a file
(``python -m kvoff.tools.bench_serve child SPEC.json`` runs :func:`child`)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from kvoff.tools.bench_serve_workload import BLOCK, Workload

#: The line a child prints with the path of its result file.
_RESULT = "KVOFF_SERVE_RESULT "

# --- the child: one engine, one workload -----------------------------------------------------


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _metric_totals() -> dict[str, float]:
    """vLLM's own metrics (its Prometheus registry, as ``LLM.get_metrics`` reads it): counters
    summed over engines, by name (and ``transfer_type`` or ``source`` where set:
    ``vllm:prompt_tokens_by_source{local_compute}``)."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    out: dict[str, float] = {}
    for m in get_metrics_snapshot():
        labels = getattr(m, "labels", {}) or {}
        sub = labels.get("transfer_type") or labels.get("source")
        key = f"{m.name}{{{sub}}}" if sub else m.name
        value = getattr(m, "value", None)
        if value is None:
            value = getattr(m, "sum", None)
        if value is None or isinstance(value, (list, dict)):
            continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


async def _serve(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    wl = Workload(**spec["workload"])
    vocab = int(spec["vocab"])
    kw: dict[str, Any] = {}
    if spec["kvoff"] is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=spec["kvoff"]
        )
    max_len = wl.max_request_tokens + BLOCK
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=spec["model_dir"],
            skip_tokenizer_init=True,
            dtype=spec["dtype"],
            enable_prefix_caching=True,
            block_size=BLOCK,
            num_gpu_blocks_override=int(spec["device_blocks"]),
            max_model_len=max_len,
            max_num_seqs=wl.users,
            max_num_batched_tokens=max(min(int(spec["max_batched_tokens"]), wl.users * max_len), max_len),
            disable_log_stats=False,
            # On the CPU build: the share of host memory vLLM checks is free at start; the KV pool
            # itself is num_gpu_blocks_override blocks.
            gpu_memory_utilization=0.1,
            seed=wl.seed,
            # torch.compile costs minutes per engine start and configuration on a small CPU; the
            # comparison is between configurations of the same mode (--compile: vLLM's default).
            enforce_eager=not spec.get("compile", False),
            **kw,
        )
    )
    startup = time.perf_counter() - t0
    ids = iter(range(1 << 30))

    async def one(prompt: list[int], max_tokens: int) -> dict[str, Any]:
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        tokens: list[int] = []
        t_sub = time.perf_counter()
        t_first = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, f"r{next(ids)}"):
            new = list(out.outputs[0].token_ids)
            if new and t_first is None:
                t_first = time.perf_counter()
            tokens.extend(new)
        t_done = time.perf_counter()
        return {
            "submit": t_sub,
            "ttft_s": (t_first if t_first is not None else t_done) - t_sub,
            "latency_s": t_done - t_sub,
            "prompt_tokens": len(prompt),
            "output_tokens": len(tokens),
            "output": tokens,
        }

    # Warm-up (excluded): the engine's first step pays one-time costs; in the reuse workload it
    # also puts the shared system prompt in the prefix cache, as a running server has it.
    rng = random.Random(wl.seed)
    system = _tokens(rng, wl.system_tokens, vocab)
    warm = system if wl.kind == "reuse" else _tokens(random.Random(wl.seed + 7919), wl.system_tokens, vocab)
    await one([*warm, 3], 2)
    before = _metric_totals()

    results: list[dict[str, Any]] = []
    # FIFO: a user that finished a turn queues behind the others (round robin when 1 in flight).
    slots = asyncio.Semaphore(wl.concurrency)

    async def user(u: int) -> list[list[int]]:
        urng = random.Random(f"{wl.seed}/{wl.kind}/{u}")
        history: list[int] = []
        outs: list[list[int]] = []
        for t in range(wl.turns):
            msg = _tokens(urng, wl.message_tokens(t), vocab)
            if wl.kind == "reuse":
                prompt = system + history + msg
            else:
                prompt = _tokens(urng, wl.prompt_tokens(t), vocab)
            async with slots:
                r = await one(prompt, wl.output_tokens)
            r.update(user=u, turn=t)
            results.append(r)
            history += msg + r["output"]
            outs.append(r["output"])
        return outs

    t1 = time.perf_counter()
    outputs = await asyncio.gather(*(user(u) for u in range(wl.users)))
    wall = time.perf_counter() - t1
    await asyncio.sleep(0.5)  # the last step's stats reach the output handler
    after = _metric_totals()
    metrics = {k: v - before.get(k, 0.0) for k, v in after.items()}
    for r in results:
        r["submit"] -= t1
    results.sort(key=lambda r: (r["user"], r["turn"]))
    threads = thread_cpus_of_engine()
    engine.shutdown()
    return {
        "threads": threads,
        "requests": results,
        "outputs": outputs,
        "wall_s": wall,
        "startup_s": startup,
        "metrics": metrics,
    }


def _descendants(root: int) -> list[int]:
    """The process ids below ``root`` (Linux /proc; empty elsewhere)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def thread_cpus_of_engine() -> list[dict[str, Any]]:
    """Per engine process started by this one: the CPUs (``Cpus_allowed_list``) of its main thread
    and of its kvoff threads (``kvoff-*``)."""
    procs: list[dict[str, Any]] = []
    for pid in _descendants(os.getpid()):
        main, kv = "", set()
        for t in Path(f"/proc/{pid}/task").glob("[0-9]*"):
            try:
                name = (t / "comm").read_text().strip()
                cpus = next(
                    ln.split(":", 1)[1].strip()
                    for ln in (t / "status").read_text().splitlines()
                    if ln.startswith("Cpus_allowed_list")
                )
            except (OSError, StopIteration):
                continue
            if t.name == str(pid):
                main = cpus
            elif name.startswith("kvoff-"):
                kv.add(cpus)
        procs.append({"pid": pid, "main": main, "kvoff": sorted(kv)})
    return procs


def child(spec_path: str) -> int:
    """Runs the engine over the spec written by the parent; writes the result file."""
    spec = json.loads(Path(spec_path).read_text())
    res = asyncio.run(_serve(spec))
    Path(spec["result"]).write_text(json.dumps(res))
    print(_RESULT + spec["result"], flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown; the engine is shut down
