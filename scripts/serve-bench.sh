#!/usr/bin/env bash
# Load benchmark of `specdecode serve` on the Qwen pair: speculation off, always on (auto, fixed k=5) and
# load-aware (auto, adaptive), at concurrency 1, 4 and 8, measured level by level in one run.
# Usage: scripts/serve-bench.sh [OUT_DIR] [extra `specdecode bench` args...]
set -euo pipefail
OUT=${1:-bench-out/serve}; shift || true
SD=${SPECDECODE:-.venv/bin/specdecode}
COMMON=(--target qwen2.5-coder-1.5b --dtype bf16 --threads 2 --max-batch 8 --log-level warning)
declare -A MODES=([off]="--draft none" [always]="--draft auto --no-adaptive --k 5" [load-aware]="--draft auto --adaptive")
declare -A PORTS=([off]=8301 [always]=8302 [load-aware]=8303)
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT
for mode in off always load-aware; do  # one at a time: loading is memory-hungry
  # shellcheck disable=SC2086
  $SD serve "${COMMON[@]}" ${MODES[$mode]} --port "${PORTS[$mode]}" &
  PIDS+=($!)
  until curl -sf "http://127.0.0.1:${PORTS[$mode]}/health" >/dev/null; do sleep 2; done
  echo "[serve-bench] $mode server up" >&2
done
$SD bench --endpoint off=http://127.0.0.1:8301 --endpoint always=http://127.0.0.1:8302 \
  --endpoint load-aware=http://127.0.0.1:8303 --concurrency 1,4,8 --requests 8 --per-task 1 \
  --max-new-tokens 64 --out "$OUT" "$@"
for mode in off always load-aware; do
  curl -s "http://127.0.0.1:${PORTS[$mode]}/metrics" | grep -E '^specdecode_(steps_total|batch_steps_total|draft_tokens_total|accepted_tokens_total)' \
    | sed "s/^/$mode /" >> "$OUT/metrics.txt"
done
