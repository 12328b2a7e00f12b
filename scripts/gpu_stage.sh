#!/usr/bin/env bash
# Builds what the GPU machine needs (it has no Rust and no network) into .carry/ (git-ignored):
# the release wheel, the Rust GPU test binaries and the transfer benchmarks. Then, through the
# device tool: `scripts/gpu_check.sh <step>` with carry [".carry"] (its header lists the steps).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .carry && mkdir -p .carry/bin .carry/wheel
python3 -m maturin build --release --locked -q -o .carry/wheel
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
