#!/usr/bin/env bash
# llama.cpp's own server against `specdecode serve --backend llama.cpp` on the Qwen Q4_K_M pair, through the same
# load benchmark (`specdecode bench --endpoint`, streaming chat, concurrency 1, 4 and 8): llama-server plain, with
# its draft-model speculation (draft-simple, the same 0.5B GGUF) and with its ngram-mod lookup, then ours (auto,
# load-aware). One server resident at a time; rounds alternate the order; `bench --pool` pools them. 24 prompts (4 per
# task) by default: 3 levels x 8 requests, none a repeat of an earlier one.
# Needs the tools of scripts/build-llama-server.sh. Not part of CI.
# Usage: [ONLY="llama-server specdecode"] [LOGLEVEL=debug: our server logs every step] scripts/llama-server-bench.sh [OUT_DIR] [ROUNDS] [extra `specdecode bench` args...]
# The venv's install is editable: a server started mid-run imports the checkout as it is then. To edit while it runs,
# bench a worktree: git worktree add /tmp/wt HEAD; SPECDECODE="env PYTHONPATH=/tmp/wt/src .venv/bin/specdecode" ...
# e.g. conversations: ... bench-out/chat 1 --traffic chat --turns 4 --concurrency 1 --requests 3 --prompts edits
set -euo pipefail
OUT=${1:-bench-out/llama-server}; shift || true
ROUNDS=${1:-1}; shift || true
SD=${SPECDECODE:-.venv/bin/specdecode}
BIN=${LLAMA_BIN:-.llama-cpp-tools/build/bin}
PORT=${PORT:-8311}
THREADS=${THREADS:-2}
$SD models pull --backend llama.cpp qwen2.5-coder-1.5b qwen2.5-coder-0.5b >/dev/null
GGUF=${GGUF_DIR:-$HOME/.cache/specdecode/gguf}
TARGET=$GGUF/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
DRAFT=$GGUF/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
# 8 slots sharing one 16k-token cache (kv-unified), as our backend holds its rows
LLAMA=("$BIN/llama-server" -m "$TARGET" -t "$THREADS" -tb "$THREADS" -np 8 -c 16384 -kvu --port "$PORT")
declare -A SERVERS=(
  [llama-server]="${LLAMA[*]}"
  [llama-server-draft]="${LLAMA[*]} -md $DRAFT --spec-type draft-simple -td $THREADS -tbd $THREADS"
  [llama-server-ngram-mod]="${LLAMA[*]} --spec-type ngram-mod"
  [specdecode]="$SD serve --target qwen2.5-coder-1.5b --draft auto --adaptive --backend llama.cpp --threads $THREADS --max-batch 8 --log-level ${LOGLEVEL:-info} --port $PORT"
  # another tree of ours beside this one (SPECDECODE_B="env PYTHONPATH=/tmp/wt-old/src .venv/bin/specdecode"): A/B
  [specdecode-b]="${SPECDECODE_B:-$SD} serve --target qwen2.5-coder-1.5b --draft auto --adaptive --backend llama.cpp --threads $THREADS --max-batch 8 --log-level ${LOGLEVEL:-info} --port $PORT"
  # no drafter: what serving costs beside llama-server plain, speculation apart
  [specdecode-plain]="$SD serve --target qwen2.5-coder-1.5b --draft none --backend llama.cpp --threads $THREADS --max-batch 8 --log-level ${LOGLEVEL:-info} --port $PORT"
)
NAMES=${ONLY:-llama-server llama-server-draft llama-server-ngram-mod specdecode}  # which, in the first round's order
PID=
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null || true' EXIT
rm -rf "$OUT/runs"
mkdir -p "$OUT/runs"
RUNS=()
for round in $(seq 1 "$ROUNDS"); do
  read -r -a order <<< "$NAMES"
  (( round % 2 == 0 )) && for ((i = 0, j = ${#order[@]} - 1; i < j; i++, j--)); do t=${order[i]}; order[i]=${order[j]}; order[j]=$t; done
  for name in "${order[@]}"; do
    # shellcheck disable=SC2086
    ${SERVERS[$name]} > "$OUT/runs/$name-r$round.log" 2>&1 &
    PID=$!
    until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
      kill -0 "$PID" 2>/dev/null || { echo "[llama-server-bench] $name did not start: $OUT/runs/$name-r$round.log" >&2; exit 1; }
      sleep 1
    done
    echo "[llama-server-bench] round $round: $name" >&2
    run="$OUT/runs/r$round-$name"
    $SD bench --endpoint "$name=http://127.0.0.1:$PORT" --concurrency 1,4,8 --requests 8 --per-task 4 \
      --max-new-tokens 64 --rounds 1 --out "$run" "$@" >/dev/null || echo "[llama-server-bench] $name: some requests failed (see $run/load.md)" >&2
    # what the server counted (ours: drafts by source, the pass prices it calibrated); llama-server: only with --metrics
    curl -sf "http://127.0.0.1:$PORT/metrics" > "$run/metrics.txt" 2>/dev/null || rm -f "$run/metrics.txt"
    kill "$PID"; wait "$PID" 2>/dev/null || true; PID=
    RUNS+=("$run")
  done
done
$SD bench --pool "${RUNS[@]}" --out "$OUT"
