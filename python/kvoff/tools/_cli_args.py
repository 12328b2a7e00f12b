"""Argument checking shared by the ``kvoff`` command line (:mod:`kvoff.tools.cli`) and its subcommands.

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
