#!/usr/bin/env bash
# llama.cpp's own server against `specdecode serve --backend llama.cpp` on the Qwen Q4_K_M pair, through the same
# load benchmark (`specdecode bench --endpoint`, streaming chat, concurrency 1, 4 and 8): llama-server plain, with
# its draft-model speculation (draft-simple, the same 0.5B GGUF) and with its ngram-mod lookup, then ours (auto,
# load-aware). All the servers named are resident at once, each on a port of its own (an idle one costs the others
# nothing measurable: ~0.2 % of a core for ours, none for llama-server), and one `bench --endpoint` run takes them level
# by level, order reversed every other round, so each round of a level compares servers measured minutes apart; the
# report gives each server's tok/s against the first one's round by round. 24 prompts a round (4 per task): 3 levels x
# 8 requests, none a repeat of an earlier one (servers stay resident: a repeat would be served from their caches).
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
NAMES=${ONLY:-llama-server llama-server-draft llama-server-ngram-mod specdecode}  # the first is the baseline
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
rm -rf "$OUT/runs"
mkdir -p "$OUT/runs"
ENDPOINTS=()
port=$PORT
for name in $NAMES; do
  # each server on a port of its own; llama-server's own are given theirs in place of $PORT
  command=${SERVERS[$name]/--port $PORT/--port $port}
  # shellcheck disable=SC2086
  $command > "$OUT/runs/$name.log" 2>&1 &
  PIDS+=($!)
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 "${PIDS[-1]}" 2>/dev/null || { echo "[llama-server-bench] $name did not start: $OUT/runs/$name.log" >&2; exit 1; }
    sleep 1
  done
  ENDPOINTS+=(--endpoint "$name=http://127.0.0.1:$port")
  port=$((port + 1))
done
echo "[llama-server-bench] all resident: $NAMES; $ROUNDS round(s), order reversed every other round" >&2
# servers stay resident: every round needs prompts of its own (3 levels x 8 requests = 24 a round, 4 per task)
$SD bench "${ENDPOINTS[@]}" --concurrency 1,4,8 --requests 8 --per-task $((4 * ROUNDS)) --max-new-tokens 64 --rounds "$ROUNDS" \
  --out "$OUT" "$@" || echo "[llama-server-bench] some requests failed (see $OUT/load.md)" >&2
# what each server counted (ours: drafts by source, the pass prices it calibrated); llama-server: only with --metrics
port=$PORT
for name in $NAMES; do
  curl -sf "http://127.0.0.1:$port/metrics" > "$OUT/runs/$name-metrics.txt" 2>/dev/null || rm -f "$OUT/runs/$name-metrics.txt"
  port=$((port + 1))
done
