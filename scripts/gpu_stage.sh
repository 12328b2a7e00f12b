#!/usr/bin/env bash
# Builds what the GPU machine needs (it has no Rust and no network) into .carry/ (git-ignored):
# the release wheel, the Rust GPU test binaries and the transfer benchmarks. Then, through the
# device tool: `scripts/gpu_check.sh <step>` with carry [".carry"] (its header lists the steps).
# `gpu_stage.sh remote`: the wheel and this machine's redis-server, redis-cli and redis-benchmark
# with their shared libraries and loader (.carry/redis; the GPU machine has none), and redis-py's wheel
# (.carry/pywheels), for the `remote` step, without the Rust binaries; Valkey's server and tools where
# the test command unpacked them (.carry/valkey), for the `remote-valkey` step. KVOFF_WHEEL: carry
# that wheel instead of building one. `gpu_stage.sh all`: the full stage and the remote step's
# servers. `gpu_stage.sh tiering`: the wheel and vLLM 0.33's Python code with the packages it imports
# that the GPU machine lacks (.carry/vllm-site.tar.xz) for the `tiering` step.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .carry && mkdir -p .carry/bin .carry/wheel
if [ -n "${KVOFF_WHEEL:-}" ]; then
  cp "$KVOFF_WHEEL" .carry/wheel/  # a wheel built from this tree already (the test command's)
else
  python3 -m maturin build --release --locked -q -o .carry/wheel
fi
if [ "${1:-}" = tiering ]; then
  # vLLM 0.33's Python files and its fs tier's C helper (fs_io_C: libc and the C++ runtime only)
  # from the test command's vLLM environment, plus CPython 3.12 wheels of the packages they import
  # that the GPU machine lacks (versions as in that environment), for the `tiering` step.
  VPY=${KVOFF_VLLM_PY:-${KVOFF_ENV_CACHE:-$HOME/.cache/kvoff/envs}/main/bin/python}
  SP=$("$VPY" -c 'import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))')
  S=$(mktemp -d)
  trap 'rm -rf "$S"' EXIT
  mkdir -p "$S/site"
  (cd "$SP" && find vllm -name '*.py' -o -name 'fs_io_C*.so' | tar cf - -T - vllm-*.dist-info) | tar xf - -C "$S/site"
  PKGS="pyzmq httpx2 httpcore2 truststore pydantic pydantic_core typing-inspection annotated-types cbor2
    oss-harmony openai sniffio pybase64 cachetools msgspec xgrammar apache-tvm-ffi fastapi starlette
    partial-json-parser llguidance"
  PLAT=(--platform manylinux2014_x86_64)
  for m in 17 24 26 27 28 31 34; do
    PLAT+=(--platform "manylinux_2_${m}_x86_64")
  done
  for p in $PKGS; do
    v=$("$VPY" -c "import importlib.metadata as m; print(m.version('$p'))")
    "$VPY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLAT[@]}" -d "$S/whl" "$p==$v"
  done
  for w in "$S"/whl/*.whl; do python3 -m zipfile -e "$w" "$S/site"; done
  tar cJf .carry/vllm-site.tar.xz -C "$S" site
  git rev-parse --short HEAD > .carry/commit
  git status --porcelain | grep -q . && echo "+dirty" >> .carry/commit || true
  du -sh .carry
  exit 0
fi
stage_redis() {
  mkdir -p .carry/redis/bin .carry/redis/lib .carry/redis/real
  for b in redis-server redis-cli redis-benchmark; do
    cp -L "$(command -v $b)" .carry/redis/real/$b
    ldd "$(command -v $b)" | awk '/=>/ {print $3}' | xargs -r cp -L -t .carry/redis/lib
    # Run through the carried loader and libraries (argv[0] keeps the tool's name: redis-server
    # and redis-check-rdb are one binary that reads it).
    printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")/..\nexec "$d/lib/ld-linux-x86-64.so.2" --library-path "$d/lib" "$d/real/%s" "$@"\n' \
      $b > .carry/redis/bin/$b
    chmod +x .carry/redis/bin/$b
  done
  cp -L /lib64/ld-linux-x86-64.so.2 .carry/redis/lib/
  # Valkey's tools too, where the test command unpacked them (scripts/redis.sh ensure_valkey), for
  # the `remote-valkey` step; they share .carry/redis/lib.
  VK=${KVOFF_ENV_CACHE:-$HOME/.cache/kvoff/envs}/valkey/usr/bin
  if [ -x "$VK/valkey-server" ]; then
    mkdir -p .carry/valkey/bin .carry/valkey/real
    for b in valkey-server valkey-cli valkey-benchmark; do
      cp -L "$VK/$b" .carry/valkey/real/$b
      ldd "$VK/$b" | awk '/=>/ {print $3}' | xargs -r cp -L -n -t .carry/redis/lib
      printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")/..\nl=$d/../redis/lib\nexec "$l/ld-linux-x86-64.so.2" --library-path "$l" "$d/real/%s" "$@"\n' \
        $b > .carry/valkey/bin/$b
      chmod +x .carry/valkey/bin/$b
    done
  fi
  # redis-py (pure Python), at the test command's version, for the bench's redis-py reference.
  VPY=${KVOFF_VLLM_PY:-${KVOFF_ENV_CACHE:-$HOME/.cache/kvoff/envs}/main/bin/python}
  v=$("$VPY" -c "import importlib.metadata as m; print(m.version('redis'))")
  "$VPY" -m pip download -q --no-deps --only-binary=:all: -d .carry/pywheels "redis==$v"
}
if [ "${1:-}" = remote ]; then
  stage_redis
  git rev-parse --short HEAD > .carry/commit
  git status --porcelain | grep -q . && echo "+dirty" >> .carry/commit || true
  du -sh .carry
  exit 0
fi
exe() { grep -E "^  Executable $1 " | sed -E 's/.*\((.*)\)/\1/'; }
T=$(cargo test --release --locked --no-run 2>&1)
B=$(cargo bench --locked --no-run 2>&1)
cp "$(echo "$T" | exe 'unittests src/lib.rs')" .carry/bin/lib
for t in cuda_engine cuda_fault worker_region worker_engine; do
  cp "$(echo "$T" | exe "tests/$t.rs")" ".carry/bin/$t"
done
for b in interference transfers; do
  cp "$(echo "$B" | exe "benches/$b.rs")" ".carry/bin/bench_$b"
done
# `gpu_stage.sh all`: the Rust binaries and the remote step's servers, for one lease that runs both.
if [ "${1:-}" = all ]; then stage_redis; fi
git rev-parse --short HEAD > .carry/commit
git status --porcelain | grep -q . && echo "+dirty" >> .carry/commit || true
du -sh .carry
