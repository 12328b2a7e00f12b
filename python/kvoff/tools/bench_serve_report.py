"""The output of ``kvoff bench serve`` (:mod:`kvoff.tools.bench_serve`): text tables and plots of a
run's ``--json`` document."""

from __future__ import annotations

import math
from typing import Any

# --- output ----------------------------------------------------------------------------------


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f}"


def format_results(doc: dict[str, Any]) -> str:
    """The run as text tables, one per workload."""
    m = doc["model"]
    lines = [
        f"kvoff bench serve: vLLM's engine on {doc['device']}, {doc['date']}, kvoff {doc['kvoff']}",
        f"model: {m['describe']}, {m['dtype']}"
        + ("" if not doc.get("cpu_threads_bind") else f"; model threads on CPUs {doc['cpu_threads_bind']}"),
        (
            f"device KV pool {doc['device_pool_blocks']} blocks of {doc['block_tokens']} tokens "
            f"({_mib(doc['device_pool_bytes'])} MiB; the reuse working set is {doc['working_set_blocks']} "
            f"blocks); kvoff host memory {_mib(doc['cpu_bytes'])} MiB"
        ),
    ]
    for kind, w in doc["workloads"].items():
        lines += ["", f"{kind}: {w['describe']}"]
        head = (
            f"{'configuration':<28}{'TTFT p50':>9}{'p90':>7}{'p99':>7}{'vs none':>8}  "
            f"{'latency p50':>11}{'p90':>7}  {'out tok/s':>9}{'vs none':>8}  "
            f"{'prompt':>7}{'computed':>9}{'device':>7}{'kvoff':>7}  {'load MiB':>8}{'store MiB':>10}"
            f"{'file w/r MiB':>13}  identical"
        )
        lines.append(head)
        for r in w["rows"]:
            ident = r.get("outputs_identical")
            lines.append(
                f"{r['label']:<28}{r['ttft_p50_s']:>8.3f}s{r['ttft_p90_s']:>6.2f}s{r['ttft_p99_s']:>6.2f}s"
                f"{r.get('ttft_p50_vs_none', math.nan):>7.2f}x  "
                f"{r['latency_p50_s']:>10.2f}s{r['latency_p90_s']:>6.2f}s  "
                f"{r['output_tokens_per_s']:>9.1f}{r.get('throughput_vs_none', math.nan):>7.3f}x  "
                f"{r['prompt_tokens']:>7}{r['prompt_tokens_computed']:>9.0f}"
                f"{r['prompt_tokens_device_hit']:>7.0f}{r['prompt_tokens_kvoff_hit']:>7.0f}  "
                f"{_mib(r['load_bytes']):>8}{_mib(r['store_bytes']):>10}"
                f"{_mib(r['disk_bytes_written']) + '/' + _mib(r['disk_bytes_read']):>13}  "
                f"{'-' if ident is None else ('yes' if ident else 'NO')}"
            )
        placed = sorted(
            {
                f"{c} (main thread {p['main']})"
                for r in w["rows"]
                for p in r.get("threads", [])
                for c in p["kvoff"]
            }
        )
        if placed:
            lines.append(f"  kvoff's threads ran on CPUs {'; '.join(placed)}")
        lines.append(
            "  TTFT/latency in seconds over all requests; prompt tokens: computed by the model, served "
            "from vLLM's device prefix cache, served from kvoff (vLLM's own metrics)"
        )
    return "\n".join(lines)


def plot_results(doc: dict[str, Any], path: str) -> None:
    """Per workload: the TTFT distribution of every configuration (CDF) and output tokens/s
    (bars, with the ratio to no offloading), into ``path`` (PNG)."""
    from kvoff.tools._toolbase import require_matplotlib

    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(doc["workloads"])
    fig, axes = plt.subplots(len(kinds), 2, figsize=(12, 4.2 * len(kinds)), squeeze=False)
    for row, kind in zip(axes, kinds, strict=True):
        w = doc["workloads"][kind]
        rows = w["rows"]
        ax = row[0]
        for i, r in enumerate(rows):
            xs = sorted(r["ttft_s"])
            ys = [(j + 1) / len(xs) for j in range(len(xs))]
            ax.step(xs, ys, where="post", color=f"C{i}", label=f"{r['label']} (p50 {r['ttft_p50_s']:.2f}s)")
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (s, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="lower right")
        ax.set_title(f"{kind}: TTFT CDF")
        ax = row[1]
        vals = [r["output_tokens_per_s"] for r in rows]
        bars = ax.bar(range(len(rows)), vals, color=[f"C{i}" for i in range(len(rows))])
        for b, r in zip(bars, rows, strict=True):
            ratio = r.get("throughput_vs_none")
            txt = f"{r['output_tokens_per_s']:.1f}" + ("" if ratio is None else f"\n{ratio:.3f}x")
            ax.annotate(
                txt, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8
            )
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["label"] for r in rows], rotation=12, fontsize=8)
        ax.set_ylabel("output tokens/s")
        ax.set_ylim(0, max(vals) * 1.25 if vals else 1)
        ax.set_title(f"{kind}: throughput")
        ax.grid(True, axis="y", alpha=0.3)
    m = doc["model"]
    fig.suptitle(
        f"kvoff bench serve: vLLM engine on {doc['device']}; {m['params'] / 1e6:.3g} M-param Llama "
        f"({m['dtype']}), device pool {doc['device_pool_blocks']} blocks of {doc['block_tokens']} tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
