"""A Llama-shaped model for ``kvoff bench model``: built from a config with random weights, no hub.

Two builds of the same blocks (embedding, per layer RMSNorm → GQA attention with rotary
embeddings over a static KV cache → RMSNorm → SwiGLU MLP, final norm and LM head):

- ``transformers``' ``LlamaForCausalLM`` where transformers is installed (what an engine author
  would try first; its eager forward launches about a thousand kernels per decode step);
- a small torch implementation (:class:`TorchLlama`) otherwise, or when asked for.

Each gives three workloads with one interface (:class:`Workload`): a decode step of ``batch``
sequences over a ``ctx``-token static cache, eager or replayed from a CUDA graph, and an eager
prefill of ``prefill`` tokens. The KV cache is filled with random values (never timed on zeros).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """A Llama geometry and the workloads' sizes."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int  #: decode: sequences per step
    ctx: int  #: decode: static cache length (tokens per sequence)
    prefill: int  #: prefill: tokens of the one sequence

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_page_bytes(self) -> int:
        """Bytes of one layer's K (or V) for a block of 16 tokens in bf16: kvoff's page."""
        return 16 * self.kv_heads * self.head_dim * 2


#: Llama-3-8B (32 layers, 4096 wide, 32 heads, 8 KV heads, vocab 128256): 32 KiB pages.
LLAMA3_8B = ModelShape(4096, 14336, 32, 32, 8, 128256, batch=64, ctx=2048, prefill=4096)
#: A tiny shape for tests on the CPU.
TINY = ModelShape(64, 128, 2, 4, 2, 256, batch=2, ctx=32, prefill=16)


def shape_by_name(name: str) -> ModelShape:
    """``llama3-8b`` or ``tiny``, optionally with overrides ``name:layers=4,batch=8``."""
    base, _, over = name.partition(":")
    shapes = {"llama3-8b": LLAMA3_8B, "tiny": TINY}
    if base not in shapes:
        raise ValueError(f"unknown model shape {base!r} (known: {', '.join(shapes)})")
    s = shapes[base]
    for kv in filter(None, over.split(",")):
        k, _, v = kv.partition("=")
        if k not in s.__dataclass_fields__:
            raise ValueError(f"unknown model shape field {k!r}")
        s = replace(s, **{k: int(v)})
    return s


class TorchLlama:
    """The same blocks as ``LlamaForCausalLM`` in plain torch ops (eager: ~40 launches a layer)."""

    def __init__(self, torch: Any, s: ModelShape, device: str) -> None:
        self.torch, self.s = torch, s
        bf = torch.bfloat16
        g = torch.Generator(device=device).manual_seed(0)

        def w(*shape: int) -> Any:
            return torch.randn(*shape, device=device, dtype=bf, generator=g) / math.sqrt(shape[-1])

        d, kvd = s.hidden, s.kv_heads * s.head_dim
        self.embed = torch.randn(s.vocab, d, device=device, dtype=bf, generator=g)
        self.layers = [
            {
                "ln1": torch.ones(d, device=device, dtype=bf),
                "wq": w(d, d),
                "wk": w(kvd, d),
                "wv": w(kvd, d),
                "wo": w(d, d),
                "ln2": torch.ones(d, device=device, dtype=bf),
                "wg": w(s.intermediate, d),
                "wu": w(s.intermediate, d),
                "wd": w(d, s.intermediate),
            }
            for _ in range(s.layers)
        ]
        self.norm = torch.ones(d, device=device, dtype=bf)
        self.head = w(s.vocab, d)
        pos = torch.arange(max(s.ctx, s.prefill), device=device, dtype=torch.float32)
        inv = 1.0 / (
            500000.0 ** (torch.arange(0, s.head_dim, 2, device=device, dtype=torch.float32) / s.head_dim)
        )
        ang = torch.outer(pos, inv)
        ang = torch.cat([ang, ang], dim=-1)
        self.cos, self.sin = ang.cos().to(bf), ang.sin().to(bf)

    def _rms(self, x: Any, wt: Any) -> Any:
        t = self.torch
        xf = x.float()
        return (xf * t.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * wt

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        h = x.shape[-1] // 2
        rot = self.torch.cat([-x[..., h:], x[..., :h]], dim=-1)
        return x * cos + rot * sin

    def forward(self, ids: Any, pos: Any, cache: list[tuple[Any, Any]] | None, mask: Any) -> Any:
        """Logits of the last token. ``pos``: positions of ``ids``' tokens (a device tensor);
        ``cache``: per layer (K, V) of shape [batch, kv_heads, ctx, head_dim] updated at ``pos``
        (decode), or ``None`` (prefill, causal); ``mask``: the decode attention mask."""
        t, s = self.torch, self.s
        f = t.nn.functional
        b, n = ids.shape
        x = self.embed[ids]
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        for i, ly in enumerate(self.layers):
            h = self._rms(x, ly["ln1"])
            q = f.linear(h, ly["wq"]).view(b, n, s.heads, s.head_dim).transpose(1, 2)
            k = f.linear(h, ly["wk"]).view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
            v = f.linear(h, ly["wv"]).view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            if cache is not None:
                ck, cv = cache[i]
                ck.index_copy_(2, pos, k)
                cv.index_copy_(2, pos, v)
                a = f.scaled_dot_product_attention(q, ck, cv, attn_mask=mask, enable_gqa=True)
            else:
                a = f.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + f.linear(a.transpose(1, 2).reshape(b, n, s.hidden), ly["wo"])
            h = self._rms(x, ly["ln2"])
            x = x + f.linear(f.silu(f.linear(h, ly["wg"])) * f.linear(h, ly["wu"]), ly["wd"])
        return f.linear(self._rms(x[:, -1], self.norm), self.head)


class Workload:
    """One of ``decode`` (eager), ``graph`` (decode replayed from a CUDA graph) or ``prefill``
    over a built model; :meth:`step` enqueues one step on the current stream."""

    def __init__(self, torch: Any, model: Any, kind: str, impl: str, s: ModelShape, device: str) -> None:
        self.torch, self.model, self.kind, self.impl, self.s = torch, model, kind, impl, s
        self.device = device
        self.graph: Any = None
        g = torch.Generator(device=device).manual_seed(1)
        if kind == "prefill":
            self.ids = torch.randint(0, s.vocab, (1, s.prefill), device=device, generator=g)
            self.pos = torch.arange(s.prefill, device=device)
            return
        self.ids = torch.randint(0, s.vocab, (s.batch, 1), device=device, generator=g)
        # Decode at position ~ctx - 48 (a ~2k-token context for the default shape), moving by one
        # each step within a window so that the cache is never outgrown.
        self.base = max(0, s.ctx - 48)
        self.pos = torch.tensor([self.base], device=device)
        self.n = 0
        self.cache = self._make_cache()
        self.mask = torch.zeros(1, 1, 1, s.ctx, device=device, dtype=torch.bfloat16)
        self._set_mask()
        if kind == "graph":
            self._capture()

    def _make_cache(self) -> Any:
        t, s = self.torch, self.s
        if self.impl == "torch":
            shp = (s.batch, s.kv_heads, s.ctx, s.head_dim)
            return [
                (
                    t.randn(shp, device=self.device, dtype=t.bfloat16),
                    t.randn(shp, device=self.device, dtype=t.bfloat16),
                )
                for _ in range(s.layers)
            ]
        from transformers import StaticCache

        cfg = self.model.config
        try:
            cache = StaticCache(config=cfg, max_cache_len=s.ctx)
        except TypeError:  # transformers 4.x
            cache = StaticCache(
                config=cfg, max_batch_size=s.batch, max_cache_len=s.ctx, device=self.device, dtype=t.bfloat16
            )
        # One step materializes the (lazily made) layers; then random contents.
        with t.no_grad():
            self.model(
                input_ids=self.ids,
                past_key_values=cache,
                cache_position=t.tensor([0], device=self.device),
                use_cache=True,
            )
        for kt in _cache_tensors(cache):
            kt.normal_()
        return cache

    def _set_mask(self) -> None:
        p = self.base + self.n % 32
        self.pos.fill_(p)
        if self.impl == "torch":
            self.mask.zero_()
            self.mask[..., p + 1 :] = float("-inf")

    def _once(self) -> Any:
        t = self.torch
        with t.no_grad():
            if self.kind == "prefill":
                if self.impl == "torch":
                    return self.model.forward(self.ids, self.pos, None, None)
                return self.model(input_ids=self.ids, use_cache=False, logits_to_keep=1).logits
            if self.impl == "torch":
                return self.model.forward(self.ids, self.pos, self.cache, self.mask)
            return self.model(
                input_ids=self.ids,
                past_key_values=self.cache,
                cache_position=self.pos,
                use_cache=True,
                logits_to_keep=1,
            ).logits

    def _capture(self) -> None:
        t = self.torch
        side = t.cuda.Stream()
        side.wait_stream(t.cuda.current_stream())
        with t.cuda.stream(side):
            for _ in range(2):
                self._once()
        t.cuda.current_stream().wait_stream(side)
        self.graph = t.cuda.CUDAGraph()
        with t.cuda.graph(self.graph):
            self.out = self._once()

    def step(self) -> None:
        if self.kind != "prefill":
            self.n += 1
            self._set_mask()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._once()


def _cache_tensors(cache: Any) -> list[Any]:
    """The K and V tensors of a transformers ``StaticCache`` (5.x: ``layers[i].keys``; 4.x:
    ``key_cache``)."""
    if hasattr(cache, "layers"):
        return [x for ly in cache.layers for x in (ly.keys, ly.values)]
    return list(cache.key_cache) + list(cache.value_cache)


def build(torch: Any, s: ModelShape, impl: str = "auto", device: str = "cuda") -> tuple[Any, str]:
    """The model and the implementation used (``transformers`` or ``torch``)."""
    if impl in ("auto", "transformers"):
        try:
            import transformers
        except ImportError:
            if impl == "transformers":
                raise
        else:
            cfg = transformers.LlamaConfig(
                hidden_size=s.hidden,
                intermediate_size=s.intermediate,
                num_hidden_layers=s.layers,
                num_attention_heads=s.heads,
                num_key_value_heads=s.kv_heads,
                vocab_size=s.vocab,
                max_position_embeddings=max(8192, s.ctx, s.prefill),
                rope_theta=500000.0,
            )
            cfg._attn_implementation = "sdpa"
            old = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with torch.device(device):
                    m = transformers.LlamaForCausalLM(cfg)
            finally:
                torch.set_default_dtype(old)
            return m.eval(), "transformers"
    if impl not in ("auto", "torch"):
        raise ValueError(f"unknown model implementation {impl!r} (auto, transformers, torch)")
    return TorchLlama(torch, s, device), "torch"
