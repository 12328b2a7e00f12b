"""The README's snippets run as written: every ```python block in a fresh interpreter of its own,
and the ```rust block as ``src/main.rs`` of a tiny crate whose ``Cargo.toml`` has the README's
``[dependencies]`` line (``path = "../kvoff"``, a link to this checkout beside the crate, both
under ``target/readme-snippets``), built and run with cargo. A block preceded by ``<!-- readme-test: skip (reason) -->`` is not run, and the
reason is reported; a block needing an optional package that is missing is skipped, saying which.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SKIP = re.compile(r"<!-- readme-test: skip \((?P<reason>[^)]*(?:\([^)]*\)[^)]*)*)\) -->\s*$")


def _blocks(lang: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason)`` of each fenced block of ``lang``."""
    lines = README.read_text().splitlines()
    out = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == f"```{lang}":
            start = i + 1
            j = start
            while lines[j].strip() != "```":
                j += 1
            m = SKIP.match(lines[i - 1].strip()) if i else None
            out.append((start, "\n".join(lines[start:j]) + "\n", m.group("reason") if m else None))
            i = j
        i += 1
    return out


PYTHON = _blocks("python")
RUST = _blocks("rust")
TOML = _blocks("toml")


def test_the_readme_has_its_snippets() -> None:
    assert len(PYTHON) >= 6 and len(RUST) == 1 and len(TOML) == 1
    assert sum(reason is not None for *_, reason in PYTHON) == 1  # the vLLM one (needs a model)


#: Optional packages a snippet may import: the snippet is skipped (saying so) where one is missing.
OPTIONAL = ("torch", "prometheus_client", "vllm")
#: kvoff calls that need prometheus_client (the exposition is its own).
NEEDS_PROMETHEUS = re.compile(r"serve_metrics\(|prometheus_text\(|TransferMetricsCollector\(")


@pytest.mark.parametrize(("line", "code", "reason"), PYTHON, ids=[f"README.md:{b[0]}" for b in PYTHON])
def test_python_snippet_runs(
    line: int, code: str, reason: str | None, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if reason is not None:
        pytest.skip(f"README.md:{line}: {reason}")
    for mod in OPTIONAL:
        imported = re.search(rf"^\s*(import|from)\s+[\w, ]*\b{mod}\b", code, re.MULTILINE)
        if imported or (mod == "prometheus_client" and NEEDS_PROMETHEUS.search(code)):
            try:
                __import__(mod)
            except ImportError:
                pytest.skip(f"README.md:{line} needs {mod}, which is not installed here")
    env = dict(os.environ)
    if "object_url=" in code:
        # The object tier's snippet runs against a real SeaweedFS (the session's), its endpoint and
        # bucket in place of the example's, credentials in the environment as the snippet says.
        srv = request.getfixturevalue("seaweed")
        m = re.search(r'object_url="s3://([a-z0-9.-]+)/', code)
        assert m is not None
        srv.create_bucket(m.group(1))
        code = re.sub(r'object_endpoint="[^"]*"', f'object_endpoint="{srv.endpoint}"', code)
        env.update(srv.env())
    p = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    assert p.returncode == 0, f"README.md:{line}:\n{code}\n--- stderr:\n{p.stderr[-4000:]}"


def test_rust_snippet_builds_and_runs() -> None:
    """A new crate beside a `kvoff` link to this checkout, with the README's dependency line as
    written; `cargo run` must build it and the snippet's asserts must hold. The crate and its
    CARGO_TARGET_DIR live at fixed places under target/readme-snippets in this checkout, so that
    later runs reuse the build (kvoff's package id includes its path)."""
    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.skip("cargo is not installed here (the README's requirements list Rust >= 1.85 with cargo)")
    ((_, toml, _),) = TOML
    ((line, code, _),) = RUST
    assert 'kvoff = { path = "../kvoff" }' in toml
    base = ROOT / "target" / "readme-snippets"
    crate = base / "crate"
    crate.mkdir(parents=True, exist_ok=True)
    link = crate / "kvoff"
    if not link.is_symlink():
        link.symlink_to(ROOT, target_is_directory=True)
    app = crate / "app"
    (app / "src").mkdir(parents=True, exist_ok=True)
    files = {
        app / "Cargo.toml": (
            '[package]\nname = "readme-snippet"\nversion = "0.0.0"\nedition = "2021"\npublish = false\n\n'
            "[workspace]\n\n" + toml
        ),
        app / "src" / "main.rs": code,
    }
    for path, text in files.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    # The checkout's lock file: the same dependency versions as kvoff's own build, no resolution.
    shutil.copy(ROOT / "Cargo.lock", app / "Cargo.lock")
    # Without debug info: the snippet is only built and run (disk, as in Cargo.toml's [profile.dev]).
    env = dict(os.environ, CARGO_TARGET_DIR=str(base / "target"), CARGO_PROFILE_DEV_DEBUG="false")
    p = subprocess.run(
        [cargo, "run", "--quiet"], cwd=app, env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    assert p.returncode == 0, f"README.md:{line}:\n{code}\n--- cargo:\n{p.stderr[-4000:]}"
