#!/usr/bin/env bash
# Builds what the GPU machine needs (it has no Rust and no network) into .carry/ (git-ignored):
# the release wheel, the Rust GPU test binaries and the transfer benchmarks. Then, through the
# device tool: `scripts/gpu_check.sh <step>` with carry [".carry"] (its header lists the steps).
# `gpu_stage.sh remote`: the wheel and this machine's redis-server, redis-cli and redis-benchmark
# with their shared libraries and loader (.carry/redis; the GPU machine has none) for the `remote`
# step, without the Rust binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .carry && mkdir -p .carry/bin .carry/wheel
python3 -m maturin build --release --locked -q -o .carry/wheel
if [ "${1:-}" = remote ]; then
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
git rev-parse --short HEAD > .carry/commit
git status --porcelain | grep -q . && echo "+dirty" >> .carry/commit || true
du -sh .carry
