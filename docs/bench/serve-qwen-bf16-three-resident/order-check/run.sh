set -e
SD=.venv/bin/specdecode
COMMON="--target qwen2.5-coder-1.5b --dtype bf16 --threads 2 --max-batch 8 --log-level warning"
$SD serve $COMMON --draft none --port 8401 & P1=$!
until curl -sf http://127.0.0.1:8401/health >/dev/null; do sleep 2; done
$SD serve $COMMON --draft auto --adaptive --port 8403 & P3=$!
until curl -sf http://127.0.0.1:8403/health >/dev/null; do sleep 2; done
# teach load-aware at concurrency 1 first (as in the full run), then measure with load-aware FIRST
$SD bench --endpoint load-aware=http://127.0.0.1:8403 --concurrency 1 --requests 4 --per-task 1 --max-new-tokens 64 --out /tmp/ab-warm > /dev/null
$SD bench --endpoint load-aware=http://127.0.0.1:8403 --endpoint off=http://127.0.0.1:8401 --concurrency 4,8 --requests 8 --per-task 1 --max-new-tokens 64 --out /tmp/ab
kill $P1 $P3
