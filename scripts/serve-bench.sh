#!/usr/bin/env bash
# Load benchmark of `specdecode serve` on the Qwen pair: speculation off, always on (auto, fixed k=5) and
# load-aware (auto, adaptive), at concurrency 1, 4 and 8.
# One server is resident at a time (as in a deployment; three resident servers measured each other's
# leftovers on this 2-core machine), all its levels measured, then it stops. Rounds alternate the server
# order (off, always, load-aware; then reversed) and `bench --pool` pools the runs per server and level,
# keeping each round's throughput for the spread.
# Usage: scripts/serve-bench.sh [OUT_DIR] [ROUNDS] [extra `specdecode bench` args...]
set -euo pipefail
OUT=${1:-bench-out/serve}; shift || true
ROUNDS=${1:-2}; shift || true
SD=${SPECDECODE:-.venv/bin/specdecode}
PORT=${PORT:-8301}
COMMON=(--target qwen2.5-coder-1.5b --backend "${BACKEND:-torch}" --dtype bf16 --threads 2 --max-batch 8 --log-level warning)
declare -A MODES=([off]="--draft none" [always]="--draft auto --no-adaptive --k 5" [load-aware]="--draft auto --adaptive")
PID=
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null || true' EXIT
rm -rf "$OUT/runs" "$OUT/metrics.txt"
mkdir -p "$OUT/runs"
RUNS=()
for round in $(seq 1 "$ROUNDS"); do
  order=(off always load-aware)
  (( round % 2 == 0 )) && order=(load-aware always off)
  for mode in "${order[@]}"; do
    # shellcheck disable=SC2086
    $SD serve "${COMMON[@]}" ${MODES[$mode]} --port "$PORT" &
    PID=$!
    until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 2; done
    echo "[serve-bench] round $round: $mode" >&2
    run="$OUT/runs/r$round-$mode"
    $SD bench --endpoint "$mode=http://127.0.0.1:$PORT" --concurrency 1,4,8 --requests 8 --per-task 1 \
      --max-new-tokens 64 --rounds 1 --out "$run" "$@" >/dev/null
    curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^specdecode_(steps_total|batch_steps_total|draft_tokens_total|accepted_tokens_total)' \
      | sed "s/^/round $round $mode /" >> "$OUT/metrics.txt"
    kill "$PID"; wait "$PID" 2>/dev/null || true; PID=
    RUNS+=("$run")
  done
done
$SD bench --pool "${RUNS[@]}" --out "$OUT"
