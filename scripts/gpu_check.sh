#!/usr/bin/env bash
# Runs on the GPU machine (device tool) over what scripts/gpu_stage.sh put in .carry/:
#   tests  — Rust GPU tests (the `#[ignore = "needs a CUDA GPU"]` ones too: `--include-ignored`),
#            compute-sanitizer memcheck over cuda_engine, the GPU pytest suite;
#   idle   — `kvoff bench transfers` (idle GPU, 512 MiB jobs, one direction and both at once);
#   beside — `kvoff bench interference` (Python) with KVOFF_GRID_* overrides;
#   model  — `kvoff bench model`: transfers beside a Llama-3-8B-shaped model's forward (eager and
#            CUDA-graph decode, eager prefill; transformers' LlamaForCausalLM), KVOFF_MODEL_ARGS;
#   rust   — `cargo bench --bench interference` (the Rust twin) with KVOFF_BENCH_* overrides;
#   remote — `kvoff bench remote` against a private redis-server from .carry/redis
#            (`gpu_stage.sh remote`): the remote tier on a many-core serving machine;
#   remote-valkey — the same on Valkey 8 (.carry/valkey): its private server, then one with 4 I/O
#            threads reached by URL;
#   tiering — `python -m kvoff.vllm.tiering_bench` (kvoff's file tier against vLLM 0.33's fs tier)
#             with vLLM's Python code from .carry/vllm-site.tar.xz (`gpu_stage.sh tiering`).
# Logs go to $OUT; a short summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-index --force-reinstall .carry/wheel/kvoff-*.whl >/dev/null 2>&1 \
  || python3 -m pip install -q --no-deps --no-index --force-reinstall --break-system-packages .carry/wheel/kvoff-*.whl
echo "kvoff at $(cat .carry/commit); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
summary=()
for step in "$@"; do
  case $step in
  tests)
    for t in lib cuda_engine cuda_fault worker_region worker_engine; do
      .carry/bin/$t --include-ignored --test-threads=1 >"$OUT/rust_$t.log" 2>&1
      summary+=("rust $t: rc=$? $(grep -E '^test result' "$OUT/rust_$t.log" | tail -1)")
    done
    # (The polite-DMA test times launches: under memcheck's instrumentation it measures the tool.)
    compute-sanitizer --tool memcheck --error-exitcode 9 .carry/bin/cuda_engine --include-ignored --test-threads=1 \
      --skip calibration --skip dma_turns_polite >"$OUT/memcheck.log" 2>&1
    summary+=("memcheck cuda_engine: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)")
    python3 -m pytest -q -p no:cacheprovider -x tests/python/test_worker_gpu.py \
      tests/python/test_torch_layouts.py tests/python/test_worker_handlers.py \
      tests/python/test_stress_handlers.py tests/python/test_hostile_sizes.py \
      tests/python/test_reliability_misc.py tests/python/test_metrics.py tests/python/test_bench.py \
      >"$OUT/pytest_gpu.log" 2>&1
    summary+=("pytest GPU: rc=$? $(tail -1 "$OUT/pytest_gpu.log")")
    ;;
  idle)
    python3 -m kvoff.tools.cli bench transfers --reps 3 >"$OUT/transfers.log" 2>&1
    summary+=("kvoff bench transfers: rc=$?")
    tail -40 "$OUT/transfers.log"
    ;;
  beside)
    python3 -m kvoff.tools.cli bench interference ${KVOFF_GRID:-} >"$OUT/interference.log" 2>&1
    summary+=("kvoff bench interference: rc=$?")
    tail -60 "$OUT/interference.log"
    ;;
  model)
    python3 -m kvoff.tools.cli bench model ${KVOFF_MODEL_ARGS:-} --plot "$OUT/model.png" >"$OUT/model.log" 2>"$OUT/model_progress.log"
    summary+=("kvoff bench model: rc=$?")
    tail -45 "$OUT/model.log"
    ;;
  rust)
    # Power, SM clock and temperature every 200 ms beside the bench (is the GEMM power-capped?).
    nvidia-smi --query-gpu=timestamp,power.draw,power.limit,clocks.sm,temperature.gpu,utilization.gpu \
      --format=csv -lms 200 >"$OUT/smi.csv" 2>&1 &
    SMI=$!
    LD_LIBRARY_PATH=$(python3 -c 'import nvidia.cu13, os; print(os.path.join(list(nvidia.cu13.__path__)[0], "lib"))' 2>/dev/null):${LD_LIBRARY_PATH:-} \
      .carry/bin/bench_interference --bench >"$OUT/interference_rust.log" 2>&1
    summary+=("cargo bench --bench interference: rc=$?")
    kill $SMI 2>/dev/null
    tail -60 "$OUT/interference_rust.log"
    ;;
  remote)
    # redis-py for the bench's redis-py reference, where the stage carried it.
    if ls .carry/pywheels/redis-*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-deps --no-index --target /tmp/kvoff-redis-py .carry/pywheels/redis-*.whl >/dev/null 2>&1
    fi
    PYTHONPATH=/tmp/kvoff-redis-py${PYTHONPATH:+:$PYTHONPATH} \
    PATH=$PWD/.carry/redis/bin:$PATH python3 -m kvoff.tools.cli bench remote --reps ${KVOFF_REMOTE_REPS:-3} \
      >"$OUT/remote.log" 2>&1
    summary+=("kvoff bench remote: rc=$?")
    tail -34 "$OUT/remote.log"
    ;;
  remote-valkey)
    # The same on Valkey 8 (.carry/valkey, `gpu_stage.sh remote` where the test command unpacked
    # it): its private server as the bench starts it (one I/O thread), then a Valkey with 4 I/O
    # threads that the bench reaches by URL (its references run on that server too).
    if ls .carry/pywheels/redis-*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-deps --no-index --target /tmp/kvoff-redis-py .carry/pywheels/redis-*.whl >/dev/null 2>&1
      export PYTHONPATH=/tmp/kvoff-redis-py${PYTHONPATH:+:$PYTHONPATH}
    fi
    VB=$PWD/.carry/valkey/bin
    PATH=$VB:$PATH python3 -m kvoff.tools.cli bench remote --reps ${KVOFF_REMOTE_REPS:-3} \
      >"$OUT/remote_valkey.log" 2>&1
    summary+=("kvoff bench remote on Valkey: rc=$?")
    tail -34 "$OUT/remote_valkey.log"
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    "$VB/valkey-server" --port "$port" --bind 127.0.0.1 --save "" --appendonly no --io-threads 4 \
      --dir /tmp >"$OUT/valkey_io4_server.log" 2>&1 &
    VPID=$!
    for _ in $(seq 100); do "$VB/valkey-cli" -p "$port" PING 2>/dev/null | grep -q PONG && break; sleep 0.1; done
    PATH=$VB:$PATH python3 -m kvoff.tools.cli bench remote --url "redis://127.0.0.1:$port" \
      --reps ${KVOFF_REMOTE_REPS:-3} >"$OUT/remote_valkey_io4.log" 2>&1
    summary+=("kvoff bench remote on Valkey, 4 I/O threads: rc=$?")
    tail -34 "$OUT/remote_valkey_io4.log"
    kill $VPID 2>/dev/null
    ;;
  tiering)
    # kvoff's file tier against vLLM 0.33's fs tier on this machine's disk (vLLM's Python code from
    # .carry/vllm-site.tar.xz: `gpu_stage.sh tiering`; its CPU platform, as the tiers use no GPU).
    rm -rf /tmp/kvoff-vllm-site && mkdir -p /tmp/kvoff-vllm-site
    tar xJf .carry/vllm-site.tar.xz -C /tmp/kvoff-vllm-site
    for args in "--chunks 256 --reps 9" "--chunks 1024 --reps 5" "--chunks 256 --reps 9 --at-capacity"; do
      PYTHONPATH=/tmp/kvoff-vllm-site/site VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= \
        python3 -m kvoff.vllm.tiering_bench --dir /var/tmp/kvoff-tiering $args >>"$OUT/tiering.log" 2>&1
      summary+=("tiering_bench $args: rc=$?")
      rm -rf /var/tmp/kvoff-tiering
    done
    grep -v "^W1\|^Loading" "$OUT/tiering.log" | tail -12
    ;;
  esac
done
printf '%s\n' "${summary[@]}"
