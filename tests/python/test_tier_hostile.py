"""The file tier under hostile directories and misuse (issue 23; docs/tier.md "Trust", docs/spec.md §5/§7/§9):
FIFOs, links, files of other users, a region closed before the manager, fork(), protocol misuse of keys the
tier is promoting, argument types, TransferMetrics.observe() inputs.

Cases that could hang (FIFOs, fork) or crash the interpreter (use after unmap) run in a child Python with a
timeout, so that a regression fails within seconds instead of wedging the suite."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kvoff
import numpy as np
import pytest
from kvoff.tier import TieredOffloadingManager

BLOCK = 64 * 1024
NUM = 16

PRELUDE = textwrap.dedent(
    """
    import os, sys, time, numpy as np, kvoff
    from kvoff.tier import TieredOffloadingManager
    BLOCK, NUM = 64 * 1024, 16
    K = lambda i: kvoff.make_offload_key(f"block-{i}".encode(), 0)
    content = lambda i: np.random.default_rng(i + 1).integers(0, 256, BLOCK, dtype=np.uint8)
    disk = sys.argv[1]

    def make(**kw):
        region = kvoff.HostRegion.private(NUM, BLOCK)
        kw.setdefault("rescan_interval_s", None)
        return TieredOffloadingManager("lru", NUM, region, disk, 1 << 30, namespace="test", **kw), region

    def store(m, region, ids):
        out = m.prepare_store([K(i) for i in ids])
        view = region.view_numpy(0, 0, BLOCK)
        by_key = {K(i): i for i in ids}
        for k, b in zip(out.keys_to_store, out.store_spec.block_ids):
            view[b] = content(by_key[k])
        m.complete_store(out.keys_to_store)

    def seed(ids):
        m, region = make()
        store(m, region, ids)
        m.flush()
        paths = {i: m.disk_path_of(K(i)) for i in ids}
        m.shutdown()
        region.close()
        return paths

    def fifo(p):
        if os.path.lexists(p):
            os.unlink(p)
        os.mkfifo(p)
    """
)


def run_child(body: str, disk: Path, timeout: float = 60.0) -> str:
    """Runs PRELUDE + body in a child Python; fails (instead of hanging) after `timeout` seconds."""
    code = PRELUDE + textwrap.dedent(body) + "\nprint('CHILD-OK', flush=True)\n"
    try:
        r = subprocess.run(
            [sys.executable, "-c", code, str(disk)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung for {timeout} s: {e.stdout!r} {e.stderr!r}")
    assert r.returncode == 0 and "CHILD-OK" in r.stdout, (r.returncode, r.stdout, r.stderr[-3000:])
    return r.stdout


def test_fifos_in_the_directory_never_hang(tmp_path: Path) -> None:
    """A FIFO at a key's name, at a hashed name the start-up scan opens, appearing after the start
    (rescan, promotion), and replacing an evicted own file (write reuse): skipped and counted; the
    constructor, lookups, flush() and shutdown() return; offloading goes on."""
    run_child(
        """
        paths = seed(range(6))
        fifo(paths[0])
        shard = os.path.dirname(paths[0])
        fifo(os.path.join(shard, "h" + "ab" * 16 + ".r0." + "00" * 8 + ".kvb"))
        m, region = make(rescan_interval_s=0.01, io_threads=2)  # the constructor scans: must return
        assert m.lookup(K(0)) is False
        # Two FIFOs replacing indexed files after the start, two I/O threads.
        fifo(paths[1]); fifo(paths[2])
        assert m.lookup_prefix([K(1), K(2)]) is None
        time.sleep(0.1)  # a few rescans
        m.flush()
        assert m.lookup(K(1)) is False and m.lookup(K(2)) is False
        for i in (3, 4, 5):
            while m.lookup(K(i)) is not True:
                m.flush()
            spec = m.prepare_load([K(i)])
            assert (region.view_numpy(0, 0, BLOCK)[int(spec.block_ids[0])] == content(i)).all()
            m.complete_load([K(i)])
        s = m.get_stats()
        assert s["disk_rejected_files"] == 4, s
        assert s["num_evictable"] > 0, s
        assert m.prepare_store([K(100 + i) for i in range(4)]) is not None
        m.shutdown()
        # An evicted own file replaced by a FIFO: the write that reuses it does not block.
        region = kvoff.HostRegion.private(NUM, BLOCK)
        one = os.path.getsize(paths[3])
        m = TieredOffloadingManager("lru", NUM, region, disk, one, namespace="test", owner="small",
                                    rescan_interval_s=None)
        store(m, region, [200]); m.flush()
        fifo(m.disk_path_of(K(200)))
        store(m, region, [201]); m.flush()
        s = m.get_stats()
        assert s["disk_rejected_files"] >= 1 and s["disk_write_errors"] == 0, s
        assert m.disk_contains(K(201))
        m.shutdown()
        """,
        tmp_path,
    )


def test_region_closed_before_the_manager(tmp_path: Path) -> None:
    """`with HostRegion...` ending before shutdown(): the manager keeps the mapping, no SIGSEGV."""
    run_child(
        """
        seed([0, 1])
        with kvoff.HostRegion.private(NUM, BLOCK) as region:
            m = TieredOffloadingManager("lru", NUM, region, disk, 1 << 30, namespace="test",
                                        rescan_interval_s=None)
            out = m.prepare_store([K(i) for i in range(2, 10)])
        assert region.closed
        m.complete_store(out.keys_to_store)  # write-through copies out of the region
        assert m.lookup_prefix([K(0), K(1)]) is None  # promotions copy into it
        m.flush()
        assert m.lookup(K(0)) is True
        m.shutdown()
        """,
        tmp_path,
    )


def test_shutdown_in_forked_children_never_hangs(tmp_path: Path) -> None:
    """40 children fork()ed under busy rescans (the I/O threads' and a parent thread's, which holds the
    manager's lock with the GIL released): each child's shutdown() returns (it takes no lock a parent
    thread may hold), and other calls there raise InvalidStateError."""
    run_child(
        """
        import warnings
        warnings.simplefilter("ignore", DeprecationWarning)
        seed(range(12))
        m, region = make(rescan_interval_s=0.0005, io_threads=4)
        import threading
        stop = threading.Event()
        def rescans():  # holds the manager's lock with the GIL released, as a busy caller may
            while not stop.is_set():
                m.disk_rescan()
        t = threading.Thread(target=rescans)
        t.start()
        pids = []
        for n in range(40):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    m.lookup(K(0))
                    code = 3
                except kvoff.InvalidStateError:
                    pass
                m.shutdown()
                m.shutdown()
                os._exit(code)
            pids.append(pid)
            time.sleep(0.002)
        deadline = time.monotonic() + 20
        hung = []
        for pid in pids:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    assert os.waitstatus_to_exitcode(status) == 0, status
                    break
                if time.monotonic() > deadline:
                    hung.append(pid)
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.005)
        stop.set()
        t.join()
        assert not hung, f"{len(hung)} of 40 children hung in shutdown()"
        assert m.lookup(K(0)) in (True, None)
        m.shutdown()
        """,
        tmp_path,
    )


def K(i: int) -> bytes:
    return kvoff.make_offload_key(f"block-{i}".encode(), 0)


def content(i: int) -> np.ndarray:
    return np.random.default_rng(i + 1).integers(0, 256, BLOCK, dtype=np.uint8)


def make(disk: Path, **kw: Any) -> tuple[TieredOffloadingManager, kvoff.HostRegion]:
    region = kvoff.HostRegion.private(NUM, BLOCK)
    kw.setdefault("rescan_interval_s", None)
    m = TieredOffloadingManager("lru", NUM, region, str(disk), 1 << 30, namespace="test", **kw)
    return m, region


def store(m: TieredOffloadingManager, region: kvoff.HostRegion, ids: list[int]) -> None:
    out = m.prepare_store([K(i) for i in ids])
    assert out is not None
    view = region.view_numpy(0, 0, BLOCK)
    by_key = {K(i): i for i in ids}
    for k, b in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
        view[b] = content(by_key[k])
    m.complete_store(out.keys_to_store)


def test_completes_of_promoting_keys_raise_and_change_nothing(tmp_path: Path) -> None:
    """complete_store(True/False) / complete_load on keys pending only because the tier promotes them:
    InvalidStateError, nothing changes; the promotions then serve the right bytes."""
    m, region = make(tmp_path)
    ids = list(range(8))
    store(m, region, ids)
    m.flush()
    m.shutdown()
    m, region = make(tmp_path)
    keys = [K(i) for i in ids]
    assert m.lookup_prefix(keys) is None
    for success in (True, False):
        with pytest.raises(kvoff.InvalidStateError, match="promoting"):
            m.complete_store(keys, success)
    with pytest.raises(kvoff.InvalidStateError):
        m.complete_load(keys[:1])
    m.flush()
    view = region.view_numpy(0, 0, BLOCK)
    for i, k in zip(ids, keys, strict=True):
        assert m.lookup(k) is True
        spec = m.prepare_load([k])
        assert (view[int(spec.block_ids[0])] == content(i)).all(), i
        m.complete_load([k])
    m.shutdown()


@pytest.mark.parametrize(
    ("kw", "exc"),
    [
        ({"num_blocks": -1}, ValueError),
        ({"num_blocks": True}, TypeError),
        ({"disk_bytes_to_use": -1}, ValueError),
        ({"disk_bytes_to_use": 2**64}, ValueError),
        ({"disk_bytes_to_use": 1.5}, TypeError),
        ({"io_threads": -1}, ValueError),
        ({"io_threads": True}, TypeError),
        ({"page_sizes": [-1]}, ValueError),
        ({"page_sizes": [True]}, TypeError),
        ({"world_size": 2**32}, ValueError),
        ({"rank": True}, TypeError),
        ({"block_bytes": False}, TypeError),
        ({"max_promotions": 2**200}, ValueError),
        ({"rescan_interval_s": True}, TypeError),
        ({"trusted_uids": [-1]}, ValueError),
        ({"trusted_gid": 2**40}, ValueError),
        ({"disk_path": b"/x/y"}, TypeError),
        ({"disk_path": 3}, TypeError),
    ],
)
def test_argument_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kw: dict[str, Any], exc: type
) -> None:
    """TypeError / ValueError as for the other bindings: never OverflowError, bool is not an int, a path
    is a str or os.PathLike (bytes would have created a directory named "b'/x/y'")."""
    monkeypatch.chdir(tmp_path)
    region = kvoff.HostRegion.private(NUM, BLOCK)
    args: dict[str, Any] = {"num_blocks": NUM, "disk_path": str(tmp_path / "d"), "disk_bytes_to_use": 1 << 30}
    args.update(kw)
    with pytest.raises(exc) as info:
        TieredOffloadingManager(
            "lru",
            args.pop("num_blocks"),
            region,
            args.pop("disk_path"),
            args.pop("disk_bytes_to_use"),
            **args,
        )
    assert not isinstance(info.value, OverflowError)
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["d"]), list(tmp_path.iterdir())
    with pytest.raises(TypeError):
        kvoff.tier.bench_disk(b"/x", "l", [4096])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        kvoff.tier.bench_disk(str(tmp_path), "l", [4096], num_blocks=-1)


def test_path_like_disk_path(tmp_path: Path) -> None:
    m, _ = make(tmp_path)
    m.shutdown()
    region = kvoff.HostRegion.private(NUM, BLOCK)
    m = TieredOffloadingManager("lru", NUM, region, tmp_path / "p", 1 << 30, rescan_interval_s=None)
    assert m.disk_dir.startswith(str(tmp_path / "p"))
    m.shutdown()


def is_root() -> bool:
    return os.geteuid() == 0


def test_untrusted_files_links_and_directories(tmp_path: Path) -> None:
    """Files of other users (0644/0666) are not served unless their uid is trusted; a symlinked namespace
    directory is a ConfigError; a hard-linked evicted file is not written through; a world-writable
    directory without the sticky bit is refused unless allow_writable_dir."""
    disk = tmp_path / "disk"
    m, region = make(disk)
    store(m, region, [0, 1])
    m.flush()
    p0, p1 = Path(m.disk_path_of(K(0))), Path(m.disk_path_of(K(1)))
    ns = Path(m.disk_dir)
    m.shutdown()
    os.chmod(p1, 0o666)
    if is_root():
        os.chown(p0, 65534, 65534)
        os.chmod(p0, 0o644)
    m, region = make(disk)
    assert not m.disk_contains(K(1))
    assert m.disk_contains(K(0)) is not is_root()
    assert m.get_stats()["disk_rejected_files"] == (2 if is_root() else 1)
    m.shutdown()
    if is_root():
        m, region = make(disk, trusted_uids=[65534])
        assert m.disk_contains(K(0))
        m.shutdown()
    # Symlinked namespace directory.
    outside = tmp_path / "outside"
    outside.mkdir()
    ns.rename(tmp_path / "moved")
    ns.symlink_to(outside)
    with pytest.raises(kvoff.ConfigError, match="refusing"):
        make(disk)
    assert list(outside.iterdir()) == []
    ns.unlink()
    (tmp_path / "moved").rename(ns)
    # Hard link to an evicted own file.
    region = kvoff.HostRegion.private(NUM, BLOCK)
    one = p1.stat().st_size
    m = TieredOffloadingManager(
        "lru", NUM, region, str(disk), one, namespace="test", owner="one", rescan_interval_s=None
    )
    store(m, region, [10])
    m.flush()
    victim = outside / "victim"
    os.link(m.disk_path_of(K(10)), victim)
    before = victim.read_bytes()
    store(m, region, [11])
    m.flush()
    assert victim.read_bytes() == before
    assert m.get_stats()["disk_rejected_files"] >= 1
    m.shutdown()
    # A directory anyone may write into, without the sticky bit.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(kvoff.ConfigError, match="sticky"):
        make(shared)
    m, _ = make(shared, allow_writable_dir=True)
    m.shutdown()


@pytest.mark.parametrize(
    ("size", "secs", "exc"),
    [
        (-1, 0.1, ValueError),
        (2**200, 0.1, ValueError),
        (2**63, 0.1, ValueError),
        (10, math.nan, ValueError),
        (10, math.inf, ValueError),
        (10, -0.5, ValueError),
        (True, 0.1, TypeError),
        (1.5, 0.1, TypeError),
        (10, "1", TypeError),
        (10, False, TypeError),
    ],
)
def test_observe_validates_its_numbers(size: Any, secs: Any, exc: type) -> None:
    m = kvoff.TransferMetrics()
    good = SimpleNamespace(success=True, transfer_size=100, transfer_time=0.5, transfer_type=("GPU", "CPU"))
    m.observe(good)
    before = m.snapshot()
    bad = SimpleNamespace(success=True, transfer_size=size, transfer_time=secs, transfer_type=("GPU", "CPU"))
    with pytest.raises(exc):
        m.observe(bad)
    after = m.snapshot()
    assert after == before
    m.observe(
        SimpleNamespace(
            success=True,
            transfer_size=np.int64(5),
            transfer_time=np.float32(0.25),
            transfer_type=("GPU", "CPU"),
        )
    )
