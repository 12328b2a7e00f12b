"""The file tier through Python (docs/spec.md §9): restart persistence across processes, corruption, sharing
a directory between processes, SIGKILL during writes, start-up errors, full disk, lookup cost."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import kvoff
import numpy as np
import pytest
from kvoff.tier import TieredOffloadingManager

BLOCK = 64 * 1024
NUM = 16


def K(i: int) -> bytes:
    return kvoff.make_offload_key(f"block-{i}".encode(), 0)


def content(i: int) -> np.ndarray:
    return np.random.default_rng(i + 1).integers(0, 256, BLOCK, dtype=np.uint8)


def make(disk: Path, **kw: object) -> tuple[TieredOffloadingManager, kvoff.HostRegion]:
    region = kvoff.HostRegion.private(NUM, BLOCK)
    kw.setdefault("rescan_interval_s", None)
    m = TieredOffloadingManager("lru", NUM, region, str(disk), 1 << 30, namespace="test", **kw)  # type: ignore[arg-type]
    return m, region


def rows(region: kvoff.HostRegion) -> np.ndarray:
    return region.view_numpy(0, 0, BLOCK)


def store(m: TieredOffloadingManager, region: kvoff.HostRegion, ids: list[int]) -> None:
    out = m.prepare_store([K(i) for i in ids])
    assert out is not None
    view = rows(region)
    by_key = {K(i): i for i in ids}
    for k, b in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
        view[b] = content(by_key[k])
    m.complete_store(out.keys_to_store)


def wait_ready(m: TieredOffloadingManager, key: bytes, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while m.lookup(key) is not True:
        assert time.monotonic() - t0 < timeout, "promotion never finished"
        time.sleep(0.001)


def load_bytes(m: TieredOffloadingManager, region: kvoff.HostRegion, key: bytes) -> np.ndarray:
    spec = m.prepare_load([key])
    data = rows(region)[int(spec.block_ids[0])].copy()
    m.complete_load([key])
    return data


CHILD = textwrap.dedent(
    """
    import sys, time, numpy as np, kvoff
    from kvoff.tier import TieredOffloadingManager
    disk, mode, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    BLOCK, NUM = 64 * 1024, 16
    K = lambda i: kvoff.make_offload_key(f"block-{i}".encode(), 0)
    content = lambda i: np.random.default_rng(i + 1).integers(0, 256, BLOCK, dtype=np.uint8)
    region = kvoff.HostRegion.private(NUM, BLOCK)
    m = TieredOffloadingManager("lru", NUM, region, disk, 1 << 40, namespace="test",
                                rescan_interval_s=None, owner="child-" + mode)
    view = region.view_numpy(0, 0, BLOCK)
    i = first
    while mode == "forever" or i < first + count:
        keys = [K(j) for j in range(i, i + 8)]
        out = m.prepare_store(keys)
        if out is None:
            m.flush()
            continue
        for k, b in zip(out.keys_to_store, out.store_spec.block_ids):
            view[b] = content(i + keys.index(k))
        m.complete_store(out.keys_to_store)
        i += 8
    m.flush()
    m.shutdown()
    print("ok")
    """
)


def child(disk: Path, mode: str, first: int, count: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(disk), mode, str(first), str(count)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_restart_in_another_process_serves_from_files(tmp_path: Path) -> None:
    p = child(tmp_path, "write", 0, 64)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    m, region = make(tmp_path)
    assert m.get_stats()["disk_indexed_files"] == 64
    served = 0
    for i in range(64):
        assert m.lookup(K(i)) is None, "host miss + file hit answers pending"
        wait_ready(m, K(i))
        assert np.array_equal(load_bytes(m, region, K(i)), content(i))
        served += 1
    assert served == 64
    s = m.get_stats()
    assert s["disk_promotions"] == 64 and s["disk_corrupt_files"] == 0
    m.shutdown()
    region.close()


def test_write_through_and_events(tmp_path: Path) -> None:
    m, region = make(tmp_path, enable_events=True, block_size=16)
    store(m, region, [1, 2])
    m.flush()
    s = m.get_stats()
    assert s["disk_files_written"] == 2 and s["read_usage"] == 0.0
    assert [e.keys for e in m.take_events()] == [[K(1), K(2)]]
    assert m.disk_contains(K(1)) and os.path.exists(m.disk_path_of(K(1)))
    m.reset()
    assert m.lookup(K(1)) is None
    m.flush()
    assert m.lookup(K(1)) is True
    ev = m.take_events()
    assert len(ev) == 1 and ev[0].keys == [K(1)] and not ev[0].removed and ev[0].block_size == 16
    assert np.array_equal(load_bytes(m, region, K(1)), content(1))
    assert m.lookup_prefix([K(1), K(2), K(3)]) is None  # 2 is promoted
    m.flush()
    assert m.lookup_prefix([K(1), K(2), K(3)]) == 2
    m.shutdown()
    with pytest.raises(kvoff.InvalidStateError):
        m.lookup(K(1))
    m.shutdown()
    region.close()


def test_disk_file_bytes_is_the_length_of_a_written_file(tmp_path: Path) -> None:
    """``kvoff.tier.disk_file_bytes`` (what a capacity of n blocks needs) equals the length of the
    files the tier writes, for a block of 4 KiB multiples and for one that is not."""
    from kvoff.tier import disk_file_bytes

    assert disk_file_bytes(BLOCK) == 4096 + BLOCK
    assert disk_file_bytes(0) == 4096 and disk_file_bytes(1) == 8192
    with pytest.raises(ValueError):
        disk_file_bytes(-1)
    m, region = make(tmp_path)
    store(m, region, [1])
    m.flush()
    assert os.path.getsize(m.disk_path_of(K(1))) == disk_file_bytes(BLOCK)
    m.shutdown()
    region.close()
    odd = 5000
    r2 = kvoff.HostRegion.private(2, odd)
    m2 = TieredOffloadingManager(
        "lru", 2, r2, str(tmp_path / "odd"), 2 * disk_file_bytes(odd), namespace="odd"
    )
    out = m2.prepare_store([K(7), K(8)])
    assert out is not None
    m2.complete_store(out.keys_to_store)
    m2.flush()
    assert m2.get_stats()["disk_files_written"] == 2
    for k in (K(7), K(8)):
        assert os.path.getsize(m2.disk_path_of(k)) == disk_file_bytes(odd) == 4096 + 8192
    m2.shutdown()
    r2.close()


def test_flipped_byte_is_detected(tmp_path: Path) -> None:
    m, region = make(tmp_path)
    store(m, region, [1, 2])
    m.flush()
    path = Path(m.disk_path_of(K(1)))
    m.shutdown()
    data = bytearray(path.read_bytes())
    data[4096 + 777] ^= 0x04
    path.write_bytes(bytes(data))
    m, region2 = make(tmp_path)
    assert m.lookup(K(1)) is None
    m.flush()
    assert m.lookup(K(1)) is False, "a corrupt file is never served"
    s = m.get_stats()
    assert s["disk_corrupt_files"] == 1 and s["disk_promotions_failed"] == 1
    assert not path.exists()
    assert m.lookup(K(2)) is None  # the intact one still serves
    wait_ready(m, K(2))
    assert np.array_equal(load_bytes(m, region2, K(2)), content(2))
    m.shutdown()


def test_two_processes_share_a_directory(tmp_path: Path) -> None:
    m, region = make(tmp_path, rescan_interval_s=0.05)
    assert m.lookup(K(3)) is False
    p = child(tmp_path, "write", 0, 32)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    t0 = time.monotonic()
    while not all(m.disk_contains(K(i)) for i in range(32)):
        assert time.monotonic() - t0 < 10, "the other process's files never became visible"
        time.sleep(0.01)
    for i in range(0, 32, 3):
        assert m.lookup(K(i)) is None
        wait_ready(m, K(i))
        assert np.array_equal(load_bytes(m, region, K(i)), content(i))
    assert m.get_stats()["disk_own_files"] == 0, "the other engine's files are not this one's"
    m.shutdown()


def test_sigkill_during_writes_never_serves_a_torn_block(tmp_path: Path) -> None:
    for delay in (0.8, 1.2):
        p = child(tmp_path, "forever", 1000, 0)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=30)
    m, region = make(tmp_path)
    n = m.get_stats()["disk_indexed_files"]
    assert n > 0, "the child wrote nothing before it was killed"
    served = failed = 0
    i = 1000
    while served + failed < n and i < 1000 + 200_000:
        if m.disk_contains(K(i)):
            assert m.lookup(K(i)) is None
            m.flush()
            if m.lookup(K(i)) is True:
                assert np.array_equal(load_bytes(m, region, K(i)), content(i)), f"block {i} served torn"
                served += 1
                m.reset()
            else:
                failed += 1
        i += 1
    assert served + failed == n
    assert failed == 0, f"{failed} published files were torn"
    leftovers = [f for f in Path(m.disk_dir).rglob(".tmp.*")]
    assert leftovers == [], "temporary files of the killed process are removed at start"
    m.shutdown()


def test_unusable_directory_is_a_config_error(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    region = kvoff.HostRegion.private(4, BLOCK)
    for bad in (f, f / "sub"):
        with pytest.raises(kvoff.ConfigError, match="disk_path"):
            TieredOffloadingManager("lru", 4, region, str(bad), 1 << 20)
    with pytest.raises(kvoff.ConfigError, match="direct_io"):
        TieredOffloadingManager("lru", 4, region, str(tmp_path), 1 << 20, direct_io="maybe")
    with pytest.raises(ValueError, match="policy"):
        TieredOffloadingManager("fifo", 4, region, str(tmp_path), 1 << 20)
    with pytest.raises(ValueError, match="num_blocks"):
        TieredOffloadingManager("lru", 5, region, str(tmp_path), 1 << 20)
    with pytest.raises(TypeError):
        TieredOffloadingManager("lru", 4, object(), str(tmp_path), 1 << 20)  # type: ignore[arg-type]
    region.close()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="mounting a tmpfs needs root")
def test_full_disk_skips_stores_and_keeps_serving(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=False).returncode
        != 0
    ):
        pytest.skip("mount -t tmpfs refused")
    try:
        m, region = make(mnt)
        store(m, region, list(range(16)))  # 16 x 68 KiB files do not fit in 1 MiB
        m.flush()
        s = m.get_stats()
        assert s["disk_write_errors"] > 0 and "No space" in s["disk_last_error"]
        assert s["disk_files_written"] + s["disk_write_errors"] == 16
        assert s["read_usage"] == 0.0, "failed writes released their host blocks"
        assert len(m) == 16 and all(m.lookup(K(i)) is True for i in range(16)), "host tier unaffected"
        m.shutdown()
        m, region = make(mnt)
        ok = 0
        for i in range(16):
            if m.lookup(K(i)) is None:
                wait_ready(m, K(i))
                assert np.array_equal(load_bytes(m, region, K(i)), content(i))
                ok += 1
        assert ok == s["disk_files_written"]
        m.shutdown()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_lookup_that_hits_a_file_answers_pending_then_hits(tmp_path: Path) -> None:
    """A lookup that misses host memory and finds a file answers pending (it reserves a host block
    and queues the read, no I/O on the caller's thread); once the reads ran, every key hits. Its
    cost per key is a benchmark figure (``kvoff bench disk``'s lookup column, BENCHMARKS.md "File
    tier"), not a wall-clock bound here."""
    n = 2000
    region = kvoff.HostRegion.private(n, 4096)
    m = TieredOffloadingManager(
        "lru",
        n,
        region,
        str(tmp_path),
        1 << 40,
        rescan_interval_s=None,
        max_queued_writes=n + 1,
        io_threads=1,
    )
    keys = [K(i) for i in range(n)]
    for start in range(0, n, 256):
        out = m.prepare_store(keys[start : start + 256])
        assert out is not None
        m.complete_store(out.keys_to_store)
    m.flush()
    assert m.get_stats()["disk_files_written"] == n
    m.reset()  # host memory empty, every key on disk
    for k in keys:
        assert m.lookup(k) is None, "a file hit must answer pending"
    m.flush()
    assert all(m.lookup(k) for k in keys)
    m.shutdown()
    region.close()


def test_scheduler_calls_reach_the_extension_directly(tmp_path: Path) -> None:
    """``lookup`` and ``lookup_prefix`` are the extension's own methods (no Python frame between
    the scheduler and the Rust call: BENCHMARKS.md "Remote tier"), and take every form of the
    manager's arguments: ``req_context`` by position or name, ``after`` by name, keys as any
    iterable of bytes; anything else is a ``TypeError``, and a shut-down manager a clear error."""
    m, region = make(tmp_path / "d")
    core = m._core  # what the scheduler's calls must reach
    assert m.lookup.__self__ is core and m.lookup_prefix.__self__ is core  # type: ignore[attr-defined]
    keys = [K(i) for i in range(4)]
    assert m.lookup(keys[0]) is False and m.lookup(keys[0], None) is False
    assert m.lookup_prefix(keys, {"req": 1}) == 0
    store(m, region, [0, 1, 2, 3])
    assert m.lookup_prefix(keys) == 4
    assert m.lookup_prefix(iter(keys), {"req": 1}) == 4
    assert m.lookup_prefix((k for k in keys[:2]), req_context=None) == 2
    assert m.lookup(keys[1], {"req": 1}, after=keys[0]) is True
    assert m.lookup(keys[2], req_context=None, after=keys[1]) is True
    assert m.lookup(keys[3], None, keys[2]) is True
    with pytest.raises(TypeError):
        m.lookup_prefix([1, 2])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        m.lookup("not bytes")  # type: ignore[arg-type]
    m.shutdown()
    with pytest.raises(kvoff.InvalidStateError):
        m.lookup(keys[0])
    region.close()


def test_use_after_fork_is_a_clear_error(tmp_path: Path) -> None:
    m, region = make(tmp_path)
    store(m, region, [1])
    m.flush()
    pid = os.fork()
    if pid == 0:  # child: no I/O threads here
        code = 1
        try:
            try:
                m.lookup(K(1))
            except kvoff.InvalidStateError as e:
                code = 0 if "fork" in str(e) else 2
            m.shutdown()  # must not wait for the parent's threads
            del m
        finally:
            os._exit(code)
    t0 = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > 30:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the forked child hung")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert m.lookup(K(1)) is True, "the parent keeps working"
    m.shutdown()
    region.close()


def _recording_errors(errors: list[BaseException], f: Callable[..., None]) -> Callable[..., None]:
    """``f`` wrapped to append whatever it raises to ``errors`` (for a thread's target)."""

    def run(*args: object) -> None:
        try:
            f(*args)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    return run


def _check_ready_blocks(m: TieredOffloadingManager, region: kvoff.HostRegion, n: int) -> None:
    """Every one of blocks ``0..n`` that reads back ready (after its pending store) has its bytes."""
    for i in range(n):
        if m.lookup(K(i)) is None:
            wait_ready(m, K(i))
        if m.lookup(K(i)) is True:
            assert np.array_equal(load_bytes(m, region, K(i)), content(i)), f"block {i}"


def test_concurrent_use_from_threads(tmp_path: Path) -> None:
    """Stores, lookups (promotions), flushes and stats from several threads at once: no error, no
    hang, and every block that reads back ready has its bytes."""
    import threading

    m, region = make(tmp_path, max_queued_writes=4096)
    errors: list[BaseException] = []
    lock = threading.Lock()  # the host rows are written by the storing threads only under it

    def storer(base: int) -> None:
        for i in range(base, base + 40):
            out = m.prepare_store([K(i)])
            if out is None or not out.keys_to_store:
                continue
            with lock:
                rows(region)[int(out.store_spec.block_ids[0])] = content(i)
            m.complete_store(out.keys_to_store)

    def looker() -> None:
        for _ in range(200):
            for i in range(0, 80, 7):
                m.lookup(K(i))
            m.get_stats()

    def flusher() -> None:
        for _ in range(20):
            m.flush()

    threads = [
        threading.Thread(target=_recording_errors(errors, f), args=a)
        for f, a in [(storer, (0,)), (storer, (40,)), (looker, ()), (flusher, ())]
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread hung"
    assert errors == []
    m.flush()
    _check_ready_blocks(m, region, 80)
    m.shutdown()
    region.close()
