"""The model and the workloads of ``kvoff bench serve`` (:mod:`kvoff.tools.bench_serve`): a
Llama-shaped preset built with random weights at run time, and the closed-loop multi-turn (``reuse``)
and unique-prompt (``noreuse``) workloads."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: vLLM's block size in tokens (the CPU attention backend needs a multiple of 32).
BLOCK = 32

# --- model -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPreset:
    """A Llama-shaped model (grouped-query attention, SwiGLU MLP, RMSNorm, untied head)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    #: Standard deviation of the random weights: large enough that greedy decoding has clear
    #: margins between the top logits, so float rounding does not flip a near-tie.
    init_range: float

    @property
    def params(self) -> int:
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attn + mlp + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes

    def describe(self) -> str:
        return (
            f"Llama-shaped, {self.params / 1e6:.3g} M parameters ({self.layers} layers, hidden "
            f"{self.hidden}, {self.heads} heads / {self.kv_heads} KV heads of {self.head_dim}, MLP "
            f"{self.intermediate}, vocabulary {self.vocab}), random weights"
        )


PRESETS: dict[str, ModelPreset] = {
    # A test-sized model: seconds per configuration.
    "tiny": ModelPreset(128, 2, 4, 2, 32, 256, 512, 0.5),
    # ~125 M parameters: prefill dominates on a CPU.
    "125m": ModelPreset(768, 12, 12, 4, 64, 2048, 32000, 0.2),
    # ~250 M parameters.
    "250m": ModelPreset(1024, 16, 16, 4, 64, 2816, 32000, 0.15),
}

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def build_model(model_dir: Path, preset: str, dtype: str, seed: int = 0) -> None:
    """Saves the preset as a Hugging Face checkpoint with random weights (needs torch and
    transformers; vLLM's environment has both). A directory already holding this preset is kept."""
    stamp = model_dir / "kvoff-preset.json"
    want = {"preset": preset, "dtype": dtype, "seed": seed, **asdict(PRESETS[preset])}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return
    import importlib

    import torch

    transformers: Any = importlib.import_module("transformers")  # untyped here
    p = PRESETS[preset]
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=p.vocab,
        hidden_size=p.hidden,
        intermediate_size=p.intermediate,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        head_dim=p.head_dim,
        max_position_embeddings=8192,
        initializer_range=p.init_range,
        tie_word_embeddings=False,
        torch_dtype=dtype,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    stamp.write_text(json.dumps(want))


# --- workloads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """N users × T turns, closed loop. ``kind``: ``"reuse"`` or ``"noreuse"``."""

    kind: str
    users: int
    turns: int
    system_tokens: int
    first_tokens: int
    turn_tokens: int
    output_tokens: int
    seed: int = 0
    #: Requests in flight at most (the users take turns for the engine beyond that).
    concurrency: int = 1

    def message_tokens(self, turn: int) -> int:
        return self.first_tokens if turn == 0 else self.turn_tokens

    def prompt_tokens(self, turn: int) -> int:
        """Length of a user's prompt at ``turn`` (0-based): system + history + new message."""
        history = sum(self.message_tokens(k) + self.output_tokens for k in range(turn))
        return self.system_tokens + history + self.message_tokens(turn)

    @property
    def max_request_tokens(self) -> int:
        return self.prompt_tokens(self.turns - 1) + self.output_tokens

    @property
    def working_set_tokens(self) -> int:
        """Tokens whose KV the reuse workload could reuse: the system prompt plus every user's
        whole conversation."""
        return self.system_tokens + self.users * (self.max_request_tokens - self.system_tokens)

    def describe(self) -> str:
        head = f"{self.users} users x {self.turns} turns, closed loop, {self.concurrency} in flight"
        if self.kind == "reuse":
            return (
                f"{head}; a {self.system_tokens}-token system prompt shared by all users + each user's "
                f"history; first message {self.first_tokens} tokens, then {self.turn_tokens}; "
                f"{self.output_tokens} output tokens per turn"
            )
        return (
            f"{head}; every prompt unique (same lengths as reuse: {self.prompt_tokens(0)}-"
            f"{self.prompt_tokens(self.turns - 1)} tokens); {self.output_tokens} output tokens per request"
        )


WORKLOADS = ("reuse", "noreuse")
