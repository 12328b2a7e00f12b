#!/usr/bin/env bash
# kvoff's whole test suite, as the README documents it: Rust formatting, lints (with and without the
# python feature), Rust tests, then the Python package built and installed into a virtualenv,
# pytest, a check of the native module's type stub, and ruff over the Python code.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVOFF_VENV:-.venv}

step() { printf '\n== %s ==\n' "$*"; }

step "cargo fmt --check"
cargo fmt --check
step "cargo clippy (no features)"
cargo clippy --all-targets --locked -- -D warnings
step "cargo clippy (python feature)"
cargo clippy --all-targets --locked --features python -- -D warnings
step "cargo test"
cargo test --locked

step "python package"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv --system-site-packages "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check ".[test]"
step "pytest"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider
step "stub check (mypy.stubtest kvoff._native)"
"$VENV/bin/python" -m mypy.stubtest kvoff._native
step "ruff check (python package and tests)"
"$VENV/bin/python" -m ruff check python tests/python

# The vLLM plug-in's tests need vLLM 0.33 (and its torch), which live in their own virtualenv
# (.ci/run makes it; KVOFF_VLLM_VENV points elsewhere). Without it they are skipped, saying so.
VLLM_VENV=${KVOFF_VLLM_VENV:-.venv-vllm}
if [ -x "$VLLM_VENV/bin/python" ] && "$VLLM_VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
  step "kvoff into the vLLM env ($VLLM_VENV)"
  "$VLLM_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall .
  step "pytest -m vllm (vLLM env)"
  "$VLLM_VENV/bin/python" -m pytest -q -p no:cacheprovider -m vllm tests/python/test_vllm_*.py
else
  step "pytest -m vllm: skipped (no vLLM env at $VLLM_VENV; .ci/run creates it)"
fi
step "all tests passed"
