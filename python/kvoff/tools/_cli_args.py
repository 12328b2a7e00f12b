"""Argument checking shared by the ``kvoff`` command line (:mod:`kvoff.tools.cli`) and its subcommands:
the ``type=`` factories, the allowed range of every numeric option, and the checks against the machine.

Every numeric option is parsed by one of the ``type=`` factories below, which state the allowed
range; a value outside it (negative, zero, huge, not a number) is a one-line error naming the
option and the range, exit status 2, never a traceback::

    kvoff bench managers: error: argument --reps: -3 is out of range: an integer from 1 to 100

:class:`Parser` is the parser class (its ``error`` prints that one line instead of argparse's usage
block); checks that involve several options or the machine (memory) raise :class:`UsageError`
from a subcommand's handler, which :func:`kvoff.tools.cli.main` prints the same way.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn

#: Exit status of a usage error (argparse's).
USAGE_EXIT = 2


class UsageError(Exception):
    """A bad combination of options found after parsing (``argument --x: ...``): printed as
    ``<prog>: error: <message>``, exit status 2."""


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (the prog, the message and where help
    is), exit status 2. ``add_subparsers`` makes its subparsers of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def usage_exit(prog: str, message: str) -> int:
    """Prints a usage error as :class:`Parser` does; returns the exit status to return."""
    print(f"{prog}: error: {message} (see {prog} --help)", file=sys.stderr)
    return USAGE_EXIT


def _fmt(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def int_range(lo: int, hi: int, what: str = "an integer") -> Callable[[str], int]:
    """``type=`` for an integer option in ``[lo, hi]``."""

    def parse(s: str) -> int:
        try:
            v = int(s.strip().replace("_", ""), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{s!r} is not {what} (allowed: {what} from {_fmt(lo)} to {_fmt(hi)})"
            ) from None
        if not lo <= v <= hi:
            shown = s if len(s) <= 24 else s[:21] + "..."
            raise argparse.ArgumentTypeError(
                f"{shown} is out of range (allowed: {what} from {_fmt(lo)} to {_fmt(hi)})"
            )
        return v

    parse.__name__ = "integer"
    return parse


def float_range(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[str], float]:
    """``type=`` for a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    lo_txt = f"above {_fmt(lo)}" if lo_open else f"from {_fmt(lo)}"
    allowed = f"a number {lo_txt} to {_fmt(hi)}"

    def parse(s: str) -> float:
        try:
            v = float(s.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a number (allowed: {allowed})") from None
        if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
            shown = s if len(s) <= 24 else s[:21] + "..."
            raise argparse.ArgumentTypeError(f"{shown} is out of range (allowed: {allowed})")
        return v

    parse.__name__ = "number"
    return parse


def int_list(lo: int, hi: int, max_items: int = 64) -> Callable[[str], list[int]]:
    """``type=`` for a comma-separated list of 1..``max_items`` integers, each in ``[lo, hi]``."""
    one = int_range(lo, hi)

    def parse(s: str) -> list[int]:
        items = [x for x in s.split(",") if x.strip()]
        if not items or len(items) > max_items:
            raise argparse.ArgumentTypeError(
                f"{s!r}: expected 1 to {max_items} comma-separated integers from {_fmt(lo)} to {_fmt(hi)}"
            )
        out = []
        for x in items:
            try:
                out.append(one(x))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"{e} in {s!r}") from None
        return out

    parse.__name__ = "list"
    return parse


# ---------------------------------------------------------------------------------------------
# Allowed ranges of the numeric options (one place, shared by the subcommands)
# ---------------------------------------------------------------------------------------------

REPS = int_range(1, 100)
#: Manager workload: requests of 64 keys (~5 KiB of keys each, all held in memory).
REQUESTS = int_range(1, 100_000)
#: Manager capacity in blocks: at least one request's 64 keys (below that nothing can be stored).
CAPACITY = int_range(64, 1 << 24)
#: MiB per transfer job; the machine's memory is checked too (``kvoff.tools.cli._check_job_memory``).
JOB_MIB = int_range(1, 16384)
PLOT_REPEATS = int_range(1, 20)
DISK_BLOCKS = int_range(1, 16384)
IO_THREADS = int_range(1, 256)
SECONDS = float_range(0.0, 60.0, lo_open=True)
ROUNDS = int_range(1, 100)
PAGES_KIB = int_list(1, 1 << 16)
JOBS_MIB = int_list(1, 16384)
DEMO_REQUESTS = int_range(1, 100_000)
#: 2 MiB blocks per demo request (a request of 1024 blocks is 16 384 tokens, 2 GiB of KV).
BLOCKS_PER_REQUEST = int_range(1, 1024)
POOL_BLOCKS = int_range(1, 1 << 20)
PREFILL_RATE = float_range(0.0, 1e9, lo_open=True)
SEED = int_range(0, (1 << 63) - 1)
PORT = int_range(0, 65535)
REMOTE_BLOCKS = int_range(1, 1 << 20)
REMOTE_IO_THREADS = int_range(1, 64)
BENCH_PIPELINES = int_list(1, 1024)
NATIVE_THREADS_ARG = int_list(1, 256)


# ---------------------------------------------------------------------------------------------
# Checks against the machine
# ---------------------------------------------------------------------------------------------


def has_torch() -> bool:
    """Whether torch is importable."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def available_memory() -> int:
    """Bytes of memory available now (:func:`kvoff.tools._toolbase.available_memory`)."""
    from kvoff.tools._toolbase import available_memory as now

    return now()


def check_memory(option: str, value: object, need: int, unit: str = "") -> None:
    """:class:`UsageError` naming ``option`` when ``need`` bytes exceed the memory available now."""
    avail = available_memory()
    if need > avail:
        raise UsageError(
            f"argument {option}: {value}{unit} needs about {need / 2**30:.1f} GiB of memory, "
            f"{avail / 2**30:.1f} GiB is available now"
        )
