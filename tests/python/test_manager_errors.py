"""Error paths of the managers (docs/spec.md §2.2, §7): the right exception class, and no state change."""

from __future__ import annotations

from collections.abc import Callable

import kvoff
import pytest
from helpers import POLICIES, K, ids_of, ks, snapshot, store, store_complete
from kvoff import (
    ARCOffloadingManager,
    ConfigError,
    InvalidStateError,
    KvoffError,
    LRUOffloadingManager,
    OffloadingManager,
    create_manager,
)

CONSTRUCTORS: list[Callable[..., OffloadingManager]] = [
    LRUOffloadingManager,
    ARCOffloadingManager,
    lambda n, **kw: create_manager("lru", n, **kw),
    lambda n, **kw: create_manager("arc", n, **kw),
]


@pytest.fixture(params=POLICIES)
def m(request: pytest.FixtureRequest) -> OffloadingManager:
    """Capacity 4: 1,2,7 ready (2 loaded once), 3 pending, 9 evicted (a B1 ghost for ARC), 8 failed.

    Events enabled and drained.
    """
    mgr = create_manager(request.param, 4, enable_events=True)
    store(mgr, 8)
    mgr.complete_store(ks(8), success=False)  # frees id 0
    store_complete(mgr, 9, 1, 2, 7)
    store(mgr, 3)  # evicts 9 (→ B1 for ARC)
    mgr.prepare_load(ks(2))
    mgr.take_events()
    return mgr


def assert_unchanged(mgr: OffloadingManager, before: dict) -> None:
    assert snapshot(mgr) == before
    assert mgr.take_events() == []


def test_fixture_state(m: OffloadingManager) -> None:
    assert [m.lookup(K(i)) for i in (1, 2, 3, 7, 8, 9)] == [True, True, None, True, False, False]
    s = m.get_stats()
    assert (s["num_present"], s["num_evictable"]) == (4, 2)


# --------------------------------------------------------------------------- InvalidStateError


@pytest.mark.parametrize(
    "keys",
    [ks(3), ks(4), ks(9), ks(1, 3), ks(1, 2, 4), ks(4, 1), ks(1, 1, 3)],
    ids=[
        "pending",
        "absent",
        "ghost-or-evicted",
        "ready+pending",
        "ready+absent",
        "absent-first",
        "dup+pending",
    ],
)
def test_prepare_load_non_ready_is_invalid_state(m: OffloadingManager, keys: list[bytes]) -> None:
    before = snapshot(m)
    with pytest.raises(InvalidStateError):
        m.prepare_load(keys)
    # Nothing was pinned: the ready keys in the list are still evictable (stats unchanged), and a
    # complete_load of 1 still fails.
    assert_unchanged(m, before)
    with pytest.raises(InvalidStateError):
        m.complete_load(ks(1))
    assert_unchanged(m, before)


@pytest.mark.parametrize(
    "keys",
    [ks(1), ks(3), ks(4), ks(2, 2), ks(2, 1), ks(1, 2), ks(2, 2, 2), ks(2, 4)],
    ids=[
        "ready-not-loading",
        "pending",
        "absent",
        "dup-more-than-loaded",
        "loaded+not",
        "not+loaded",
        "triple",
        "loaded+absent",
    ],
)
def test_complete_load_without_load_is_invalid_state(m: OffloadingManager, keys: list[bytes]) -> None:
    before = snapshot(m)
    with pytest.raises(InvalidStateError):
        m.complete_load(keys)
    assert_unchanged(m, before)
    # 2 is still loading exactly once.
    m.complete_load(ks(2))
    with pytest.raises(InvalidStateError):
        m.complete_load(ks(2))


@pytest.mark.parametrize("policy", POLICIES)
def test_complete_load_more_than_loaded_rolls_back(policy: str) -> None:
    mgr = create_manager(policy, 4)
    store_complete(mgr, 1, 2)
    mgr.prepare_load(ks(1, 1, 2))  # 1 loaded twice, 2 once
    before = snapshot(mgr)
    with pytest.raises(InvalidStateError):
        mgr.complete_load(ks(1, 2, 1, 1))
    assert snapshot(mgr) == before
    mgr.complete_load(ks(1, 2, 1))
    assert mgr.get_stats()["num_evictable"] == 2


# --------------------------------------------------------------------------- TypeError on keys

BAD_ITEMS = ["abcd", 1, None, 1.5, bytearray(b"1\x00\x00\x00\x00"), memoryview(b"abcd"), [b"x"]]

LIST_METHODS: dict[str, Callable[[OffloadingManager, object], object]] = {
    "lookup_prefix": lambda m, keys: m.lookup_prefix(keys),
    "prepare_load": lambda m, keys: m.prepare_load(keys),
    "touch": lambda m, keys: m.touch(keys),
    "complete_load": lambda m, keys: m.complete_load(keys),
    "prepare_store": lambda m, keys: m.prepare_store(keys),
    "complete_store": lambda m, keys: m.complete_store(keys),
    "complete_store_fail": lambda m, keys: m.complete_store(keys, success=False),
}


@pytest.mark.parametrize("bad", BAD_ITEMS, ids=lambda b: type(b).__name__)
@pytest.mark.parametrize("method", list(LIST_METHODS))
def test_non_bytes_key_is_type_error(m: OffloadingManager, method: str, bad: object) -> None:
    call = LIST_METHODS[method]
    # Valid keys first (each would change state on its own: 1 touched/loaded, 2 unloaded, 3 completed,
    # 5,6 stored), the bad one last: nothing may have changed.
    valid = {
        "lookup_prefix": ks(1, 2),
        "prepare_load": ks(1, 2),
        "touch": ks(1, 2, 9),
        "complete_load": ks(2),
        "prepare_store": ks(5, 6, 9),
        "complete_store": ks(3),
        "complete_store_fail": ks(3),
    }[method]
    before = snapshot(m)
    for keys in ([bad], valid + [bad], (*valid, bad), [bad, *valid]):
        with pytest.raises(TypeError):
            call(m, keys)
        assert_unchanged(m, before)


@pytest.mark.parametrize("bad", BAD_ITEMS, ids=lambda b: type(b).__name__)
def test_lookup_non_bytes_is_type_error(m: OffloadingManager, bad: object) -> None:
    before = snapshot(m)
    with pytest.raises(TypeError):
        m.lookup(bad)  # type: ignore[arg-type]
    assert_unchanged(m, before)


@pytest.mark.parametrize("method", list(LIST_METHODS))
@pytest.mark.parametrize("arg", [K(1), b"", "abcd", 5, None, 1.5], ids=repr)
def test_single_bytes_or_non_iterable_is_type_error(m: OffloadingManager, method: str, arg: object) -> None:
    before = snapshot(m)
    with pytest.raises(TypeError):
        LIST_METHODS[method](m, arg)
    assert_unchanged(m, before)


@pytest.mark.parametrize("policy", POLICIES)
def test_generator_with_bad_item_changes_nothing(policy: str) -> None:
    mgr = create_manager(policy, 2, enable_events=True)
    store_complete(mgr, 1, 2)
    mgr.take_events()
    before = snapshot(mgr)
    # Would evict both 1 and 2 if it went through.
    with pytest.raises(TypeError):
        mgr.prepare_store(x for x in [K(5), K(6), 7])
    assert_unchanged(mgr, before)
    with pytest.raises(TypeError):
        mgr.touch(x for x in [K(2), "1"])
    assert_unchanged(mgr, before)


@pytest.mark.parametrize("policy", POLICIES)
def test_error_in_generator_propagates_and_changes_nothing(policy: str) -> None:
    mgr = create_manager(policy, 2)
    store_complete(mgr, 1, 2)
    before = snapshot(mgr)

    def gen():
        yield K(5)
        raise RuntimeError("boom")

    for method in LIST_METHODS.values():
        with pytest.raises(RuntimeError, match="boom"):
            method(mgr, gen())
        assert snapshot(mgr) == before


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_type_check_keeps_stores_skipped(policy: str) -> None:
    mgr = create_manager(policy, 4, store_threshold=2)
    assert store(mgr, 1, 2) == ([], [], [])  # 2 skipped, counted until the next get_stats
    with pytest.raises(TypeError):
        mgr.prepare_store([K(1), K(2), "x"])
    assert mgr.get_stats()["stores_skipped"] == 2
    # The tracker did not count the failed offer: 1 and 2 are admitted exactly on the second offer.
    assert store(mgr, 1, 2) == (ks(1, 2), [0, 1], [])


@pytest.mark.parametrize("policy", POLICIES)
def test_none_from_prepare_store_changes_nothing(policy: str) -> None:
    mgr = create_manager(policy, 2, enable_events=True, store_threshold=2, max_tracker_size=2)
    store(mgr, 1, 2)
    store_complete(mgr, 1, 2)  # second offer: admitted
    mgr.prepare_load(ks(1))
    mgr.take_events()
    store(mgr, 3, 4)  # first offer of 3,4: skipped, tracker now [3,4] (1,2 dropped)
    assert mgr.get_stats()["stores_skipped"] == 4  # 1,2 and 3,4 skipped once each; reset here
    before = snapshot(mgr)
    # 3,4 would be admitted now but cannot fit (1 loading) → None, tracker untouched.
    assert mgr.prepare_store(ks(3, 4)) is None
    assert_unchanged(mgr, before)
    # Still admitted (count 2) once there is room: the None call did not count as an offer and did
    # not drop anything from the tracker.
    mgr.complete_load(ks(1))
    out = store(mgr, 3, 4)
    assert out is not None
    assert out[0] == ks(3, 4)


# --------------------------------------------------------------------------- constructor arguments


@pytest.mark.parametrize("ctor", CONSTRUCTORS)
@pytest.mark.parametrize("n", [-1, -(2**40), 2**32 - 1, 2**32, 2**40, 2**64])
def test_num_blocks_out_of_range_is_value_error(ctor: Callable, n: int) -> None:
    with pytest.raises(ValueError):
        ctor(n)


@pytest.mark.parametrize("ctor", CONSTRUCTORS)
def test_num_blocks_huge_is_value_error(ctor: Callable) -> None:
    with pytest.raises(ValueError):
        ctor(2**200)


@pytest.mark.parametrize("ctor", CONSTRUCTORS)
@pytest.mark.parametrize("n", [True, False, 4.0, "4", None, b"4"], ids=repr)
def test_num_blocks_wrong_type_is_type_error(ctor: Callable, n: object) -> None:
    with pytest.raises(TypeError):
        ctor(n)


@pytest.mark.parametrize("ctor", CONSTRUCTORS)
@pytest.mark.parametrize("kw", ["block_size", "store_threshold", "max_tracker_size"])
def test_other_int_arguments(ctor: Callable, kw: str) -> None:
    with pytest.raises(ValueError):
        ctor(4, **{kw: -1})
    with pytest.raises(TypeError):
        ctor(4, **{kw: 1.5})
    with pytest.raises(TypeError):
        ctor(4, **{kw: True})
    ctor(4, **{kw: 3})


def test_unknown_keyword_is_type_error() -> None:
    with pytest.raises(TypeError):
        LRUOffloadingManager(4, policy="lru")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        create_manager("arc", 4, nonsense=1)


def test_create_manager_policy_not_str() -> None:
    with pytest.raises(TypeError):
        create_manager(None, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="arc"):
        create_manager("fifo", 4)


def test_num_blocks_zero_is_valid() -> None:
    assert LRUOffloadingManager(0).num_blocks == 0


# --------------------------------------------------------------------------- shutdown

AFTER_SHUTDOWN: dict[str, Callable[[OffloadingManager], object]] = {
    "lookup": lambda m: m.lookup(K(1)),
    "lookup_prefix": lambda m: m.lookup_prefix(ks(1)),
    "prepare_load": lambda m: m.prepare_load(ks(1)),
    "touch": lambda m: m.touch(ks(1)),
    "complete_load": lambda m: m.complete_load(ks(2)),
    "prepare_store": lambda m: m.prepare_store(ks(5)),
    "prepare_store_empty": lambda m: m.prepare_store([]),
    "complete_store": lambda m: m.complete_store(ks(3)),
    "complete_store_fail": lambda m: m.complete_store(ks(3), success=False),
    "take_events": lambda m: m.take_events(),
    "get_stats": lambda m: m.get_stats(),
    "reset": lambda m: m.reset(),
}


@pytest.mark.parametrize("method", list(AFTER_SHUTDOWN))
def test_every_method_after_shutdown_is_invalid_state(m: OffloadingManager, method: str) -> None:
    m.shutdown()
    with pytest.raises(InvalidStateError):
        AFTER_SHUTDOWN[method](m)
    # Still failing on a second try; shutdown stays idempotent.
    m.shutdown()
    with pytest.raises(InvalidStateError):
        AFTER_SHUTDOWN[method](m)


def test_shutdown_idempotent(m: OffloadingManager) -> None:
    assert m.shutdown() is None
    assert m.shutdown() is None
    assert m.shutdown() is None
    with pytest.raises(InvalidStateError):
        m.get_stats()


@pytest.mark.parametrize("policy", POLICIES)
def test_shutdown_fresh_and_type_errors_after(policy: str) -> None:
    mgr = create_manager(policy, 0)
    mgr.shutdown()
    # Either class is acceptable for a bad argument after shutdown, but it must be a clean error.
    with pytest.raises((InvalidStateError, TypeError)):
        mgr.prepare_store("x")
    with pytest.raises(InvalidStateError):
        mgr.lookup(K(1))


# --------------------------------------------------------------------------- exception classes


def test_exception_hierarchy() -> None:
    assert issubclass(InvalidStateError, KvoffError)
    assert issubclass(ConfigError, KvoffError)
    assert issubclass(ConfigError, ValueError)
    assert not issubclass(InvalidStateError, ValueError)
    for name in ("RegionError", "CudaUnavailableError", "CudaError"):
        assert issubclass(getattr(kvoff, name), KvoffError)
    assert issubclass(KvoffError, Exception)
    assert kvoff.errors.InvalidStateError is InvalidStateError


def test_invalid_state_is_catchable_as_kvoff_error() -> None:
    mgr = create_manager("lru", 1)
    with pytest.raises(KvoffError):
        mgr.prepare_load(ks(1))
    with pytest.raises(KvoffError, match=r"."):
        mgr.complete_load(ks(1))


# --------------------------------------------------------------------------- iterables of keys


@pytest.mark.parametrize("policy", POLICIES)
def test_any_iterable_of_bytes(policy: str) -> None:
    mgr = create_manager(policy, 4)
    keys = [K(1), K(2)]
    # prepare_store with a generator returns the caller's very key objects.
    out = mgr.prepare_store(k for k in keys)
    assert out is not None
    assert len(out.keys_to_store) == 2
    assert out.keys_to_store[0] is keys[0]
    assert out.keys_to_store[1] is keys[1]
    assert ids_of(out.store_spec) == [0, 1]
    # A tuple works as well (and also hands back the same objects).
    k3 = K(3)
    out = mgr.prepare_store((k3, keys[0]))
    assert out is not None
    assert out.keys_to_store[0] is k3
    # Every other list-taking method accepts tuples, generators, iterators, dict keys.
    mgr.complete_store(iter([keys[0], keys[1], k3]))
    assert mgr.lookup_prefix(k for k in keys) == 2
    assert mgr.lookup_prefix(tuple(keys)) == 2
    assert ids_of(mgr.prepare_load(dict.fromkeys(keys))) == [0, 1]
    mgr.touch(k for k in reversed(keys))
    mgr.complete_load(tuple(keys))
    mgr.complete_store((k for k in [K(4)]), success=False)
    assert mgr.get_stats()["num_evictable"] == 3

    # A bytes subclass is bytes.
    class B(bytes):
        pass

    assert mgr.lookup(B(K(1))) is True


def test_policy_and_engine_names_come_from_one_list():
    # The Rust enums PolicyKind / EngineKind are the one source of the names; the Python maps,
    # create_manager, the vLLM settings and the handlers take theirs from kvoff._native.
    from kvoff import _native
    from kvoff.handlers import ENGINES

    assert _native.POLICIES == ("lru", "arc")
    assert set(kvoff._POLICIES) == set(_native.POLICIES)
    for name in _native.POLICIES:
        assert kvoff.create_manager(name, 4).policy == name
    with pytest.raises(ValueError, match=r"valid choices: \['lru', 'arc'\]"):
        kvoff.create_manager("LRU", 4)
    assert ENGINES == _native.ENGINES == ("auto", "host", "cuda", "dma", "kernel", "staged", "loop")
    with pytest.raises(ValueError, match='unknown engine "warp"; valid choices: "auto", "host"'):
        _native.resolve_engine("warp", [None])
    assert _native.resolve_engine("auto", [None, None]) == "host"
    with pytest.raises(ValueError, match='engine "host" copies with memcpy, but t1 is on cuda:0'):
        _native.resolve_engine("host", [None, 0], ["t0", "t1"])


def test_literal_types_spell_the_runtime_lists():
    # Type checkers read kvoff._names' Literal types; the runtime reads the Rust enums' lists.
    import typing

    from kvoff import _native

    assert typing.get_args(kvoff.PolicyName) == _native.POLICIES
    assert typing.get_args(kvoff.EngineName) == _native.ENGINES
    assert typing.get_args(kvoff.DirectIoName) == _native.DIRECT_IO


def test_direct_io_names_come_from_one_list(tmp_path):
    # kvoff._native.DIRECT_IO is the one list of the file tier's direct_io modes: the bindings
    # parse them in one place, the vLLM settings and the kvoff command take their choices from it.
    from kvoff import _native
    from kvoff.vllm.config import KvoffOffloadConfig

    assert _native.DIRECT_IO == ("auto", "on", "off")
    for bad in ("ON", "yes", ""):
        with pytest.raises(kvoff.ConfigError, match=r"direct_io must be one of 'auto', 'on', 'off'"):
            _native.BlockStore(str(tmp_path), 4096, 4, direct_io=bad)
    extra = {
        "cpu_bytes_to_use": 1 << 20,
        "disk_path": str(tmp_path),
        "disk_bytes_to_use": 1 << 20,
        "disk_direct_io": "ON",
    }
    with pytest.raises(kvoff.ConfigError, match=r"must be one of \['auto', 'on', 'off'\]"):
        KvoffOffloadConfig.from_extra_config(extra)
