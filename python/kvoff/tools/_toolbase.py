"""Small helpers shared by the ``kvoff`` command's tools (bench, interference, demo): the lowest
module of the tooling, importing no other tool module, so the tools form no import cycle."""

from __future__ import annotations

from typing import Any


def available_memory(default: int = 8 << 30) -> int:
    """Bytes of host memory available now (``MemAvailable``), or ``default`` where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return default


def sweep_row_line(r: dict[str, Any]) -> str:
    """One sweep row as a log line: page, direction, method and its GB/s."""
    p = int(r["page_kib"])
    page = f"{p >> 10} MiB" if p >= 1024 else f"{p} KiB"
    figs = ", ".join(
        f"{k} {r[f'{k}_gb_s']:.1f}" for k in ("idle", "gemm", "mem") if r.get(f"{k}_gb_s") is not None
    )
    return f"  {page:>7} {r['dir']:<5} {r['method']}: {figs} GB/s"


def require_matplotlib() -> None:
    """Raises a clear ImportError when matplotlib is missing (checked before a long run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "kvoff demo --plot needs matplotlib: pip install matplotlib (the demo itself does not)"
        ) from e
