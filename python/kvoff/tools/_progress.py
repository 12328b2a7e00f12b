"""A tiny dependency-free progress bar for the command line (stderr, only on a terminal or when asked)."""

from __future__ import annotations

import os
import sys
import time


class Progress:
    """``with Progress(total, "label") as p: p.update(n)``; draws at most 10 times a second."""

    def __init__(self, total: int, label: str, *, enabled: bool | None = None) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.done = 0
        self._last = 0.0
        self._start = time.perf_counter()
        if enabled is None:
            enabled = sys.stderr.isatty() or os.environ.get("KVOFF_PROGRESS") == "1"
        self.enabled = enabled

    def __enter__(self) -> Progress:  # noqa: PYI034 (Self needs typing_extensions on 3.10)
        self._draw(force=True)
        return self

    def update(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        frac = min(self.done / self.total, 1.0)
        width = 30
        fill = int(frac * width)
        bar = "█" * fill + "·" * (width - fill)
        sys.stderr.write(f"\r{self.label:<28} {bar} {frac * 100:5.1f}% {now - self._start:6.1f}s")
        sys.stderr.flush()

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.done = self.total
            self._draw(force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()
