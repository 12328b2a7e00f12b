"""Transfer handlers under threads, fork() and freed memory (docs/spec.md §7), host engine.

Every scenario runs in a child process with a time limit: a hang or a crash fails the test
instead of the suite. Reproducers from kvoff 1526e41: ``untyped_storage().resize_(0)`` then
``transfer_async`` → SIGSEGV; after ``fork()`` a child's ``transfer_async`` was accepted and its
``wait()`` never returned; a thread in ``wait()`` stalled every other Python thread that submitted.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="the handlers adapt torch tensors")

TIMEOUT_S = 60

PRELUDE = """
import os, sys, threading, time
import torch, kvoff
def handlers(blocks=64, page=65536, layers=4):
    kv = {f"l{i}": torch.randint(0, 256, (blocks, page), dtype=torch.uint8) for i in range(layers)}
    return kv, kvoff.CpuGpuOffloadingHandlers(kv, 1, blocks, engine="host")
G = kvoff.GPULoadStoreSpec
C = kvoff.CPULoadStoreSpec
def wait_child(pid, seconds=20):
    deadline = time.time() + seconds
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9); raise SystemExit("child hung")
"""


def _run(body: str) -> str:
    code = PRELUDE + textwrap.dedent(body)
    try:
        p = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"scenario hung (> {TIMEOUT_S}s)")
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout}\n{p.stderr[-3000:]}"
    return p.stdout


def test_resized_storage_is_refused_not_written() -> None:
    out = _run(
        """
        kv, h = handlers()
        kv["l1"].untyped_storage().resize_(0)
        try:
            h.gpu_to_cpu_handler.transfer_async(1, (G([0, 1]), C([0, 1])))
        except ValueError as e:
            assert "resized or reallocated" in str(e), e
            print("ValueError")
        h.shutdown()
        """
    )
    assert out.strip() == "ValueError"


def test_forked_child_fails_clearly() -> None:
    out = _run(
        """
        kv, h = handlers()
        s = h.gpu_to_cpu_handler
        s.transfer_async(1, (G([0]), C([0]))); s.wait([1]); s.get_finished()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                s.transfer_async(2, (G([1]), C([1])))
            except kvoff.InvalidStateError as e:
                code = 0 if "fork" in str(e) else 2
            for call in (lambda: s.wait([2]), s.get_finished):
                try:
                    call(); code = 3
                except kvoff.InvalidStateError:
                    pass
            # The native handler refuses too (it has no submit thread in the child).
            n = s._native
            for call in (n.get_finished, lambda: n.wait([2]), lambda: n.last_submit_stats,
                         lambda: n.submit(2, [1], None, None, [1], None)):
                try:
                    call(); code = 4
                except kvoff.InvalidStateError:
                    pass
            n.shutdown()  # nothing to do in the child
            h.shutdown()  # the parent's engine: nothing to do in the child, and no hang
            os._exit(code)
        code = wait_child(pid)
        assert code == 0, code
        s.transfer_async(3, (G([2]), C([2]))); s.wait([3])   # the parent still works
        assert [r.job_id for r in s.get_finished()] == [3]
        h.shutdown()
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_forked_child_drops_the_parents_handlers_without_touching_them() -> None:
    """A child forked while the parent's submit thread hands jobs to the engine (its locks may be
    held then) drops the handlers it inherited without waiting for anything; the parent's jobs
    all finish, byte-exact."""
    out = _run(
        """
        import gc
        kv, h = handlers(blocks=256, page=1 << 16, layers=8)
        s = h.gpu_to_cpu_handler
        for round in range(5):
            for j in range(32):
                s.transfer_async(round * 100 + j, (G([8 * j + k for k in range(8)]), C([8 * j + k for k in range(8)])))
            pid = os.fork()
            if pid == 0:
                del s, h
                gc.collect()
                os._exit(0)
            code = wait_child(pid)
            assert code == 0, code
            ids = [round * 100 + j for j in range(32)]
            s.wait(ids)
            got = s.get_finished()
            assert [r.job_id for r in got] == ids and all(r.success for r in got), got
        cpu = h.cpu_tensors
        for i, t in enumerate(kv.values()):
            assert torch.equal(cpu[i], t), i
        h.shutdown()
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_submit_and_wait_from_several_threads_byte_exact() -> None:
    out = _run(
        """
        kv, h = handlers(blocks=64, page=65536, layers=4)
        st, ld = h.gpu_to_cpu_handler, h.cpu_to_gpu_handler
        errors = []
        def worker(t):
            try:
                for j in range(20):
                    jid = t * 1000 + j
                    b = (t * 8 + j) % 64
                    st.transfer_async(jid, (G([b]), C([b])))
                    st.wait([jid])
            except Exception as e:
                errors.append(repr(e))
        ts = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
        for t in ts: t.start()
        for t in ts: t.join()
        assert not errors, errors
        res = st.get_finished()
        assert len(res) == 120 and all(r.success for r in res), res[:3]
        for i, name in enumerate(kv):
            assert torch.equal(h.cpu_tensors[i][:48], kv[name][:48]), name
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_wait_in_one_thread_does_not_stall_the_interpreter() -> None:
    out = _run(
        """
        kv, h = handlers(blocks=256, page=262144, layers=8)   # 512 MiB per full job
        st, ld = h.gpu_to_cpu_handler, h.cpu_to_gpu_handler
        ids = list(range(256))
        st.transfer_async(1, (G(ids), C(ids)))
        started = threading.Event()
        def waiter():
            started.set(); st.wait([1])
        w = threading.Thread(target=waiter); w.start(); started.wait()
        time.sleep(0.002)
        # Another thread submits to the same handler while the waiter holds it: this thread may
        # wait, but the rest of the interpreter must keep running meanwhile.
        ticks = []
        stop = threading.Event()
        def ticker():
            while not stop.is_set():
                ticks.append(time.perf_counter()); time.sleep(0.001)
        tk = threading.Thread(target=ticker); tk.start()
        st.transfer_async(2, (G([0]), C([0])))
        st.wait([2]); w.join(); stop.set(); tk.join()
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        print("maxgap", max(gaps) if gaps else 0.0)
        h.shutdown()
        """
    )
    gap = float(out.split()[1])
    assert gap < 0.05, f"the interpreter stalled {gap * 1e3:.0f} ms while one thread waited on a handler"
