#!/usr/bin/env bash
# Probe (run by hand; not part of the kvoff package): `kvoff bench remote` on servers that do their
# socket I/O on several threads, against kvoff's I/O thread count (BENCHMARKS.md "Remote tier",
# "On Valkey 8"). For each server in SERVERS it starts one on loopback (no persistence), runs the
# bench by URL (its references, redis-benchmark / valkey-benchmark and redis-py, on that server
# too) once per kvoff thread count in THREADS, and stops it. Logs go to $OUT (default /tmp).
#
#   SERVERS: space-separated NAME:IO_THREADS, NAME valkey or redis (default "valkey:1 valkey:4")
#   THREADS: kvoff --io-threads values (default "4 16"); SIZES: --sizes (default 2MiB,32KiB)
#   VALKEY_BIN / REDIS_BIN: folders with valkey-server, valkey-cli, valkey-benchmark (redis-*);
#   default: found on PATH.
set -uo pipefail
OUT=${OUT:-/tmp}
SERVERS=${SERVERS:-valkey:1 valkey:4}
THREADS=${THREADS:-4 16}
SIZES=${SIZES:-2MiB,32KiB}
bindir() { # product
  local v
  if [ "$1" = valkey ]; then v=${VALKEY_BIN:-}; else v=${REDIS_BIN:-}; fi
  if [ -n "$v" ]; then echo "$v"; else dirname "$(command -v "$1-server")"; fi
}
for s in $SERVERS; do
  product=${s%%:*} io=${s##*:}
  bin=$(bindir "$product")
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  extra=(--io-threads "$io")
  [ "$product" = redis ] && [ "$io" -gt 1 ] && extra+=(--io-threads-do-reads yes)
  "$bin/$product-server" --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir /tmp \
    "${extra[@]}" >"$OUT/${product}_io${io}_server.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do "$bin/$product-cli" -p "$port" PING 2>/dev/null | grep -q PONG && break; sleep 0.1; done
  for t in $THREADS; do
    echo "== $product with $io I/O threads, kvoff --io-threads $t"
    PATH=$bin:$PATH python3 -m kvoff.tools.cli bench remote --url "redis://127.0.0.1:$port" \
      --sizes "$SIZES" --reps 3 --io-threads "$t" --pipelines 1,16 --clients 4,16 \
      >"$OUT/${product}_io${io}_t$t.log" 2>&1
    grep -E "best|again|kvoff remote|store .*load|alternated" "$OUT/${product}_io${io}_t$t.log"
  done
  "$bin/$product-cli" -p "$port" SHUTDOWN NOSAVE >/dev/null 2>&1 || kill "$pid"
  wait "$pid" 2>/dev/null
done
