"""Concurrency stress for the managers (docs/spec.md §7): no deadlock, no crash, invariants kept.

Each scenario runs in a child process with a time limit, so a regression (a hang) fails the test
instead of hanging the suite. The scenarios are the ones that hung kvoff 1526e41:

- one thread looks up while another calls ``prepare_load`` on an absent key and catches
  ``InvalidStateError`` (building the error used to release the GIL with the manager's lock held);
- ``touch`` raising ``TypeError`` (a non-bytes key) beside lookups;
- ``reset()`` and ``shutdown()`` while 8 threads hammer the manager;
- key iterables that call back into the same manager (``m.touch(k for k in ks if m.lookup(k))``);
- a slow generator in one thread must not hold up another thread's lookups.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

TIMEOUT_S = 60

PRELUDE = """
import sys, threading, time
import kvoff
K = lambda i: kvoff.make_offload_key(str(i).encode(), 0)
POLICY = sys.argv[1]
def mgr(n=64):
    m = kvoff.create_manager(POLICY, n)
    m.prepare_store([K(i) for i in range(n // 2)])
    m.complete_store([K(i) for i in range(n // 2)])
    return m
def run_threads(fns):
    ts = [threading.Thread(target=f) for f in fns]
    for t in ts: t.start()
    for t in ts: t.join()
"""


def _run(body: str, policy: str) -> str:
    code = PRELUDE + textwrap.dedent(body)
    try:
        p = subprocess.run(
            [sys.executable, "-c", code, policy],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"scenario hung (> {TIMEOUT_S}s): a deadlock")
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


POLICIES = ["lru", "arc"]


@pytest.mark.parametrize("policy", POLICIES)
def test_lookup_beside_raising_prepare_load(policy: str) -> None:
    out = _run(
        """
        m = mgr()
        N = 20000
        def looker():
            for _ in range(N):
                assert m.lookup(K(1)) is True
        def raiser():
            n = 0
            for _ in range(N):
                try:
                    m.prepare_load([K(99)])
                except kvoff.InvalidStateError:
                    n += 1
            assert n == N
        def type_raiser():
            for _ in range(N // 4):
                try:
                    m.touch([K(1), 5])
                except TypeError:
                    pass
        run_threads([looker, raiser, type_raiser, looker])
        print("ok", len(m))
        """,
        policy,
    )
    assert out.split() == ["ok", "32"]


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_and_shutdown_under_load(policy: str) -> None:
    out = _run(
        """
        m = mgr()
        stop = threading.Event()
        errors = []
        def worker(seed):
            i = seed
            while not stop.is_set():
                i += 1
                try:
                    k = K(i % 100)
                    m.lookup(k)
                    out = m.prepare_store([k])
                    if out is not None:
                        m.complete_store(out.keys_to_store)
                    if m.lookup(k):
                        m.prepare_load([k]); m.complete_load([k])
                    m.touch([k]); m.take_events(); m.get_stats(); len(m)
                except kvoff.InvalidStateError:
                    pass
                except Exception as e:  # anything else is a bug
                    errors.append(repr(e)); return
        ts = [threading.Thread(target=worker, args=(s * 1000,)) for s in range(8)]
        for t in ts: t.start()
        for _ in range(20):
            time.sleep(0.01)
            m.reset()
        time.sleep(0.05)
        m.shutdown()
        time.sleep(0.05)
        stop.set()
        for t in ts: t.join()
        assert not errors, errors
        for call in (lambda: len(m), lambda: m.num_blocks, lambda: m.lookup(K(1)), lambda: repr(m)):
            try:
                call()
            except kvoff.InvalidStateError:
                pass
            else:
                raise AssertionError("a call after shutdown() did not raise")
        print("ok")
        """,
        policy,
    )
    assert out.strip() == "ok"


@pytest.mark.parametrize("policy", POLICIES)
def test_iterables_that_call_back_into_the_manager(policy: str) -> None:
    out = _run(
        """
        m = mgr()
        m.touch(k for k in [K(2)] if m.lookup(k))
        assert m.lookup_prefix(k for k in [K(1), K(2)] if m.lookup(k) is not None) == 2
        spec = m.prepare_load(k for k in [K(3)] if len(m) > 0)
        m.complete_load(k for k in [K(3)] if m.lookup(k))
        out = m.prepare_store(k for k in [K(100)] if not m.lookup(k))
        m.complete_store(k for k in out.keys_to_store if m.lookup(k) is None)
        assert m.lookup(K(100)) is True
        def reentrant():
            for i in range(3):
                m.touch([K(i)])          # the same manager, from inside the iteration
                yield K(i)
        m.touch(reentrant())
        print("ok")
        """,
        policy,
    )
    assert out.strip() == "ok"


@pytest.mark.parametrize("policy", POLICIES)
def test_slow_generator_does_not_block_other_threads(policy: str) -> None:
    out = _run(
        """
        m = mgr()
        started = threading.Event()
        def slow_keys():
            started.set()
            for i in range(10):
                time.sleep(0.05)
                yield K(i)
        worst = []
        def looker():
            started.wait()
            w = 0.0
            for _ in range(200):
                t = time.perf_counter(); m.lookup(K(1)); w = max(w, time.perf_counter() - t)
                time.sleep(0.001)
            worst.append(w)
        run_threads([lambda: m.touch(slow_keys()), looker])
        print("worst", worst[0])
        """,
        policy,
    )
    worst = float(out.split()[1])
    assert worst < 0.04, f"a lookup waited {worst:.3f}s behind another thread's slow key iterable"
