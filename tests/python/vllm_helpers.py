"""Shared helpers of the vLLM plug-in tests: the real vLLM (0.32/0.33) config objects they need."""

from __future__ import annotations

from typing import Any


def make_offloading_config(
    extra: dict[str, Any],
    *,
    worker_kv_bytes_per_block: int = 4096,
    blocks_per_chunk: int = 1,
    world_size: int = 1,
    rank: int = 0,
    enable_events: bool = True,
    engine_id: str = "kvoff-test-engine",
) -> Any:
    """vLLM's ``OffloadingConfig``: the normalized boundary vLLM's connector builds from a
    ``VllmConfig`` + ``KVCacheConfig`` (``build_offloading_config``) and hands to the spec."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    model_fields = OffloadingModelConfig.__dataclass_fields__
    model_kw = {"name": "tiny", "dtype": "float16", "max_model_len": 1024}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=enable_events,
        extra_config=extra,
        engine_id=engine_id,
        # max_model_len: vLLM 0.33 only
        model=OffloadingModelConfig(**{k: v for k, v in model_kw.items() if k in model_fields}),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def kvoff_extra(**kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "spec_name": "KvoffOffloadingSpec",
        "spec_module_path": "kvoff.vllm",
        "cpu_bytes_to_use": 1 << 20,
    }
    d.update(kw)
    return d
