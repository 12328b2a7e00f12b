"""``kvoff demo``: a tiny run verifies every reloaded block and hits the host; a corrupting engine is
caught by the verification; the command line (JSON, --plot, a missing matplotlib)."""

from __future__ import annotations

import json
import sys

import kvoff
import pytest

torch = pytest.importorskip("torch")
from kvoff.tools import demo
from kvoff.tools.cli import main

TINY = {
    "requests": 30,
    "blocks_per_request": 4,
    "min_prefix_blocks": 2,
    "num_prefixes": 4,
    "gpu_blocks": 8,
    "cpu_blocks": 24,
    "device": "cpu",
    "engine": "host",
    "show_progress": False,
}


def test_tiny_demo_verifies_and_hits():
    r = demo.run_demo(demo.DemoConfig(**TINY))
    assert r.verified, r
    assert r.offload_hit_rate > 0 and r.hit_rate >= r.offload_hit_rate
    assert r.verified_loaded_blocks == r.cpu_hit_blocks > 0
    assert r.verified_gpu_blocks == r.gpu_hit_blocks
    assert r.gpu_hit_blocks + r.cpu_hit_blocks + r.computed_blocks == r.blocks_requested == 30 * 4
    # The metrics saw exactly the blocks that moved.
    assert r.transfers["GPU_to_CPU"]["bytes"] == r.stored_blocks * demo.BLOCK_BYTES
    assert r.transfers["CPU_to_GPU"]["bytes"] == r.cpu_hit_blocks * demo.BLOCK_BYTES
    assert r.evicted_from_gpu == r.stored_blocks + r.already_on_host + r.store_rejected
    assert r.cache["num_blocks"] == 24
    assert r.saved_s == pytest.approx(r.recompute_s - r.transfers["CPU_to_GPU"]["seconds"])
    text = demo.format_result(r)
    assert "verification         OK" in text and "tokens/s" in text
    d = r.as_dict()
    json.dumps(d)
    assert d["verified"] is True


def test_verification_catches_corrupted_host_copies(monkeypatch):
    """An engine that flips one byte of every stored block: every reload is reported as mismatched."""
    real = kvoff.CpuGpuOffloadingHandlers

    class Corrupting(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            h = self.gpu_to_cpu_handler
            submit, wait, stored = h.transfer_async, h.wait, []

            def transfer_async(job_id, spec):
                stored.extend(spec[1].block_ids.tolist())
                return submit(job_id, spec)

            def wait_and_corrupt(ids):
                wait(ids)
                for b in stored:
                    self.cpu_tensors[17][b, 1000] ^= 0x40
                stored.clear()

            h.transfer_async, h.wait = transfer_async, wait_and_corrupt

    monkeypatch.setattr(kvoff, "CpuGpuOffloadingHandlers", Corrupting)
    r = demo.run_demo(demo.DemoConfig(**TINY))
    assert r.cpu_hit_blocks > 0
    assert r.mismatched_blocks == r.cpu_hit_blocks
    assert not r.verified
    assert "verification         FAILED" in demo.format_result(r)


def test_pool_pattern_is_per_key():
    pool = demo._KVPool(torch, 4, "cpu", seed=1)
    keys = [demo._key("k", i) for i in range(3)]
    pool.fill([0, 2, 3], keys)
    assert pool.mismatches([0, 2, 3], keys) == 0
    assert pool.mismatches([2, 0], keys[:2]) == 2  # swapped blocks
    pool.all[31, 1, 3].view(-1).view(torch.uint8)[5] ^= 1  # one byte of the last layer's V page
    assert pool.mismatches([0, 2, 3], keys) == 1


def test_requests_share_prefixes():
    reqs = demo.make_requests(demo.DemoConfig(requests=50, blocks_per_request=8, num_prefixes=4))
    assert all(len(r) == 8 for r in reqs)
    firsts = {r[0] for r in reqs}
    assert len(firsts) <= 4 + 50 and len(firsts) < 50  # prefixes are shared


def test_bad_settings():
    with pytest.raises(ValueError, match="gpu_blocks"):
        demo.run_demo(demo.DemoConfig(**{**TINY, "gpu_blocks": 2}))
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        demo.run_demo(demo.DemoConfig(**{**TINY, "prefill_tokens_per_s": 0}))
    with pytest.raises(ValueError, match="device"):
        demo.run_demo(demo.DemoConfig(**{**TINY, "device": "tpu"}))


ARGS = [
    "demo",
    "--requests",
    "12",
    "--blocks-per-request",
    "4",
    "--gpu-blocks",
    "8",
    "--cpu-blocks",
    "16",
    "--device",
    "cpu",
    "--quiet",
]


def test_cli_json(capsys):
    assert main([*ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verified"] is True and out["blocks_requested"] == 48


def test_cli_text_with_plot_and_prometheus(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bw.png"
    assert main([*ARGS, "--plot", str(png), "--sweep-mib", "2", "--prometheus"]) == 0
    out = capsys.readouterr().out
    assert "verification         OK" in out and "page-size sweep" in out
    assert 'kvoff_offload_transfers_total{transfer_type="GPU_to_CPU"}' in out
    assert "kvoff_cache_blocks 16.0" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    assert main([*ARGS, "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_cli_metrics_port(capsys):
    pytest.importorskip("prometheus_client")
    assert main([*ARGS, "--metrics-port", "0", "--json"]) == 0
    assert "serving metrics at http://127.0.0.1:" in capsys.readouterr().err


def test_cli_metrics_port_without_prometheus_client(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import prometheus_client → ImportError
    assert main([*ARGS, "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert "pip install prometheus_client" in err and "kvoff[" not in err
