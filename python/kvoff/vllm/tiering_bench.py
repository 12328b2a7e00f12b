"""kvoff's tier against vLLM's ``fs`` tier under vLLM 0.33's tiering: same directory, same blocks,
same run (``python -m kvoff.vllm.tiering_bench``).

Both tiers are built by vLLM's ``SecondaryTierFactory`` over one page-aligned CPU tensor standing
in for the CPU tier, each under its own subdirectory of ``--dir`` (so one filesystem). Per
repetition, in alternating order: store every chunk (jobs of ``--chunks-per-job`` chunks, as
requests cascade them), wait, then load them all back into other rows and wait; the loaded bytes
are checked. Figures are wall-clock GB/s of payload; the ratio is kvoff / fs of the medians.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np


def _spec(model: str) -> Any:
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    class Spec:
        config = OffloadingConfig(
            groups=(),
            worker_kv_bytes_per_block=0,
            enable_kv_cache_events=False,
            extra_config={},
            engine_id="kvoff-bench",
            model=OffloadingModelConfig(name=model, dtype="float16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0,
                world_size=1,
                tp_size=1,
                pp_size=1,
                pcp_size=1,
                dcp_size=1,
                data_parallel_index=0,
                data_parallel_size=1,
                data_parallel_rank_local=None,
                is_parallelism_agnostic=False,
            ),
        )
        blocks_per_chunk = 1
        kv_events_config = OffloadingKVEventsConfig(
            enable_kv_cache_events=False, self_describing_kv_events=False
        )

    return Spec()


def _aligned(rows: int, row_bytes: int) -> np.ndarray:
    raw = np.zeros(rows * row_bytes + mmap.PAGESIZE, dtype=np.uint8)
    shift = (-raw.ctypes.data) % mmap.PAGESIZE
    return raw[shift : shift + rows * row_bytes].reshape(rows, row_bytes)


def _run_one(
    name: str, cfg: dict[str, Any], mem: np.ndarray, n: int, per_job: int, rep: int
) -> tuple[float, float]:
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    ctx = ReqContext(req_id="bench")
    tier = SecondaryTierFactory.create_secondary_tier(cfg, memoryview(mem.data), _spec("bench-model"))
    keys = [make_offload_key(f"{name}-{rep}-{i}".encode().ljust(32, b"."), 0) for i in range(n)]
    row_bytes = mem.shape[1]

    def run(is_load: bool) -> float:
        t0 = time.perf_counter()
        jid = 0
        for s in range(0, n, per_job):
            ks = keys[s : s + per_job]
            rows = [(i + n) if is_load else i for i in range(s, s + len(ks))]
            job = TransferJob(
                job_id=rep * 1_000_000 + (500_000 if is_load else 0) + jid,
                keys=ks,
                chunk_ids=np.array(rows, dtype=np.int64),
                is_promotion=is_load,
                req_context=ctx,
            )
            (tier.submit_load if is_load else tier.submit_store)(job)
            jid += 1
        tier.drain_jobs()
        res = list(tier.get_finished_jobs())
        dt = time.perf_counter() - t0
        if len(res) != jid or not all(r.success for r in res):
            raise RuntimeError(f"{name}: {sum(not r.success for r in res)} failed jobs of {jid}")
        return float(n * row_bytes / dt / 1e9)

    try:
        w = run(False)
        r = run(True)
        if not np.array_equal(mem[n : 2 * n], mem[:n]):
            raise RuntimeError(f"{name}: loaded bytes differ from the stored ones")
        mem[n : 2 * n] = 0
        return w, r
    finally:
        tier.shutdown()


def bench(
    directory: str,
    chunks: int,
    chunk_bytes: int,
    per_job: int,
    reps: int,
    kvoff_settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    mem = _aligned(2 * chunks, chunk_bytes)
    mem[:chunks] = np.random.default_rng(0).integers(0, 256, size=(chunks, chunk_bytes), dtype=np.uint8)
    fs_dir = os.path.join(directory, "vllm-fs")
    kv_dir = os.path.join(directory, "kvoff")
    tiers = {
        "fs": {"type": "fs", "root_dir": fs_dir},
        "kvoff": {
            "type": "KvoffFileTier",
            "module_path": "kvoff.vllm.tiering",
            "disk_path": kv_dir,
            **(kvoff_settings or {}),
        },
    }
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in tiers}
    for rep in range(reps):
        order = list(tiers) if rep % 2 == 0 else list(reversed(tiers))
        for name in order:
            runs[name].append(_run_one(name, tiers[name], mem, chunks, per_job, rep))
    med = {
        k: (statistics.median(w for w, _ in v), statistics.median(r for _, r in v)) for k, v in runs.items()
    }
    return {
        "chunks": chunks,
        "chunk_bytes": chunk_bytes,
        "chunks_per_job": per_job,
        "reps": reps,
        "kvoff_settings": kvoff_settings or {},
        "fs_write_gbps": med["fs"][0],
        "fs_read_gbps": med["fs"][1],
        "kvoff_write_gbps": med["kvoff"][0],
        "kvoff_read_gbps": med["kvoff"][1],
        "write_ratio": med["kvoff"][0] / med["fs"][0],
        "read_ratio": med["kvoff"][1] / med["fs"][1],
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--dir", default=None, help="directory for both tiers' files (default: a temporary one)")
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--chunk-bytes", type=int, default=2 << 20)
    p.add_argument("--chunks-per-job", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--kvoff-settings",
        default="{}",
        help="JSON object of kvoff tier settings (e.g. '{\"io_threads\": 16}'; default: its defaults)",
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    tmp = None
    d = a.dir
    if d is None:
        tmp = d = tempfile.mkdtemp(prefix="kvoff-tierbench-", dir=os.environ.get("KVOFF_BENCH_DIR"))
    try:
        r = bench(d, a.chunks, a.chunk_bytes, a.chunks_per_job, a.reps, json.loads(a.kvoff_settings))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        print(json.dumps(r))
    else:
        print(
            f"{r['chunks']} chunks of {r['chunk_bytes'] >> 10} KiB, {r['chunks_per_job']} per job, "
            f"median of {r['reps']}:\n"
            f"  vLLM fs : write {r['fs_write_gbps']:.2f} GB/s, read {r['fs_read_gbps']:.2f} GB/s\n"
            f"  kvoff   : write {r['kvoff_write_gbps']:.2f} GB/s, read {r['kvoff_read_gbps']:.2f} GB/s\n"
            f"  kvoff/fs: write x{r['write_ratio']:.2f}, read x{r['read_ratio']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
