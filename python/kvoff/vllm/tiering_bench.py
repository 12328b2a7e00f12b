"""kvoff's tier against vLLM's ``fs`` tier under vLLM 0.33's tiering: same directory, same blocks,
same run (``python -m kvoff.vllm.tiering_bench``).

Both tiers are built by vLLM's ``SecondaryTierFactory`` over one page-aligned CPU tensor standing
in for the CPU tier, each under its own subdirectory of ``--dir`` (so one filesystem). Per
repetition, in alternating order: store every chunk (jobs of ``--chunks-per-job`` chunks, as
requests cascade them), wait, then load them all back into other rows and wait; the loaded bytes
are checked. Figures are wall-clock GB/s of payload; the ratio is kvoff / fs of the medians.

The disk's own speed for the same bytes runs in the same rotation: ``--disk-threads`` threads (16,
as many as the ``fs`` tier has per direction) write the chunks into one file at their offsets, then
read them back, with ``O_DIRECT`` where the filesystem takes it and requests of one chunk. The file
is filled once before, so its timed writes overwrite allocated blocks: no file creation, no rename,
no header, no checksum. Each tier's GB/s is also given as a share of it.

``--at-capacity`` gives kvoff's tier room for one repetition's files, so that from the second
repetition on each of its writes overwrites an evicted own file, as a tier at its capacity does;
vLLM's ``fs`` tier has no capacity and keeps creating files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvoff.tier import disk_file_bytes


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
    name: str, cfg: dict[str, Any], mem: np.ndarray, n: int, per_job: int, rep: int, run_id: str
) -> tuple[float, float]:
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    ctx = ReqContext(req_id="bench")
    tier = SecondaryTierFactory.create_secondary_tier(cfg, memoryview(mem.data), _spec("bench-model"))
    # New keys per run and repetition: files left in a reused --dir are never hits.
    keys = [make_offload_key(f"{name}-{run_id}-{rep}-{i}".encode().ljust(32, b"."), 0) for i in range(n)]
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


class _Disk:
    """One file of ``n`` chunks, filled once, that ``threads`` threads write and read at the
    chunks' offsets (``O_DIRECT`` where possible)."""

    def __init__(self, directory: str, mem: np.ndarray, n: int, threads: int) -> None:
        self.mem, self.n, self.threads = mem, n, threads
        self.path = os.path.join(directory, "disk-reference.bin")
        os.makedirs(directory, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT
        # O_DIRECT needs 4 KiB-aligned memory, offsets and lengths (the rows are page-aligned).
        self.direct = hasattr(os, "O_DIRECT") and mem.shape[1] % 4096 == 0
        try:
            self.fd = os.open(self.path, flags | (os.O_DIRECT if self.direct else 0), 0o600)
        except OSError:
            self.direct = False
            self.fd = os.open(self.path, flags, 0o600)
        self._each(lambda i: os.pwrite(self.fd, memoryview(mem[i].data), i * mem.shape[1]))

    def _each(self, op: Callable[[int], int]) -> float:
        nxt = iter(range(self.n))
        lock = threading.Lock()
        errors: list[OSError] = []

        def work() -> None:
            try:
                while True:
                    with lock:
                        i = next(nxt, None)
                    if i is None:
                        return
                    if op(i) != self.mem.shape[1]:
                        raise OSError(f"short transfer of chunk {i}")
            except OSError as e:  # reported on the caller's thread
                errors.append(e)

        t0 = time.perf_counter()
        ts = [threading.Thread(target=work) for _ in range(self.threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return float(self.n * self.mem.shape[1] / dt / 1e9)

    def run(self) -> tuple[float, float]:
        mem, n, cb = self.mem, self.n, self.mem.shape[1]
        w = self._each(lambda i: os.pwrite(self.fd, memoryview(mem[i].data), i * cb))
        r = self._each(lambda i: os.preadv(self.fd, [memoryview(mem[n + i].data)], i * cb))
        if not np.array_equal(mem[n : 2 * n], mem[:n]):
            raise RuntimeError("disk reference: read bytes differ from the written ones")
        mem[n : 2 * n] = 0
        return w, r

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.path))


def bench(
    directory: str,
    chunks: int,
    chunk_bytes: int,
    per_job: int,
    reps: int,
    kvoff_settings: dict[str, Any] | None = None,
    disk_threads: int = 16,
    at_capacity: bool = False,
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
    if at_capacity:
        # Room for one repetition's files: from the second repetition on, each write overwrites an
        # evicted own file (docs/tier.md "Publication and durability"). vLLM's fs tier has no
        # capacity: it keeps creating files.
        tiers["kvoff"]["disk_bytes_to_use"] = chunks * disk_file_bytes(chunk_bytes)
    run_id = os.urandom(4).hex()
    disk = _Disk(os.path.join(directory, "disk"), mem, chunks, disk_threads)
    names = [*tiers, "disk"]
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in names}
    try:
        for rep in range(reps):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                if name == "disk":
                    runs[name].append(disk.run())
                else:
                    runs[name].append(_run_one(name, tiers[name], mem, chunks, per_job, rep, run_id))
    finally:
        disk.close()
    med = {
        k: (statistics.median(w for w, _ in v), statistics.median(r for _, r in v)) for k, v in runs.items()
    }
    return {
        "chunks": chunks,
        "chunk_bytes": chunk_bytes,
        "chunks_per_job": per_job,
        "reps": reps,
        "kvoff_settings": kvoff_settings or {},
        "at_capacity": at_capacity,
        "fs_write_gbps": med["fs"][0],
        "fs_read_gbps": med["fs"][1],
        "kvoff_write_gbps": med["kvoff"][0],
        "kvoff_read_gbps": med["kvoff"][1],
        "write_ratio": med["kvoff"][0] / med["fs"][0],
        "read_ratio": med["kvoff"][1] / med["fs"][1],
        "disk_threads": disk_threads,
        "disk_direct_io": disk.direct,
        "disk_write_gbps": med["disk"][0],
        "disk_read_gbps": med["disk"][1],
        "fs_write_of_disk": med["fs"][0] / med["disk"][0],
        "fs_read_of_disk": med["fs"][1] / med["disk"][1],
        "kvoff_write_of_disk": med["kvoff"][0] / med["disk"][0],
        "kvoff_read_of_disk": med["kvoff"][1] / med["disk"][1],
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
        "--disk-threads", type=int, default=16, help="threads of the disk reference (default 16, as fs)"
    )
    p.add_argument(
        "--kvoff-settings",
        default="{}",
        help="JSON object of kvoff tier settings (e.g. '{\"io_threads\": 16}'; default: its defaults)",
    )
    p.add_argument(
        "--at-capacity",
        action="store_true",
        help="kvoff's tier holds one repetition's files: later writes overwrite evicted ones",
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    tmp = None
    d = a.dir
    if d is None:
        tmp = d = tempfile.mkdtemp(prefix="kvoff-tierbench-", dir=os.environ.get("KVOFF_BENCH_DIR"))
    try:
        r = bench(
            d,
            a.chunks,
            a.chunk_bytes,
            a.chunks_per_job,
            a.reps,
            json.loads(a.kvoff_settings),
            a.disk_threads,
            a.at_capacity,
        )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        print(json.dumps(r))
    else:
        print(
            f"{r['chunks']} chunks of {r['chunk_bytes'] >> 10} KiB, {r['chunks_per_job']} per job, "
            f"median of {r['reps']}{', kvoff at capacity' if r['at_capacity'] else ''}:\n"
            f"  vLLM fs : write {r['fs_write_gbps']:.2f} GB/s, read {r['fs_read_gbps']:.2f} GB/s\n"
            f"  kvoff   : write {r['kvoff_write_gbps']:.2f} GB/s, read {r['kvoff_read_gbps']:.2f} GB/s\n"
            f"  kvoff/fs: write x{r['write_ratio']:.2f}, read x{r['read_ratio']:.2f}\n"
            f"  disk    : write {r['disk_write_gbps']:.2f} GB/s, read {r['disk_read_gbps']:.2f} GB/s "
            f"({r['disk_threads']} threads, {'O_DIRECT' if r['disk_direct_io'] else 'buffered'}, "
            "one filled file, requests of one chunk)\n"
            f"  of disk : fs write {r['fs_write_of_disk']:.0%}, read {r['fs_read_of_disk']:.0%}; "
            f"kvoff write {r['kvoff_write_of_disk']:.0%}, read {r['kvoff_read_of_disk']:.0%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
