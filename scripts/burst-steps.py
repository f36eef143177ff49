"""A burst in process, step by step: the requests of the server bench's concurrency-8 level (Spec-Bench, 4 per task:
prompts 16-23, as `bench --endpoint --concurrency 1,4,8 --requests 8 --per-task 4` sends them) submitted at once to a
BatchEngine on the llama.cpp Qwen pair, as `specdecode serve` runs them. Prints every step (rows, width, prompt tokens
read beside the rows, drafted / accepted, seconds), then the decode steps' rate by rows, plain against drafting: where a
server's time at 8 requests goes, without HTTP. Not part of CI.

Usage: .venv/bin/python scripts/burst-steps.py [--draft auto|none] [--max-new-tokens 64] [--threads 2] [--quiet]
"""

import argparse
import time
from collections import defaultdict

from specdecode.batch import BatchEngine
from specdecode.pipeline import load_components
from specdecode.prompts import load_prompts
from specdecode.encoding import encode_prompt

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--draft", default="auto", help="drafter spec, or none")
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--quiet", action="store_true", help="only the summary")
args = parser.parse_args()

model, tokenizer, drafter, k, _ = load_components(
    "qwen2.5-coder-1.5b", None if args.draft == "none" else args.draft, threads=args.threads, backend="llama.cpp",
    max_rows=8)
engine = BatchEngine(model, drafter, tokenizer, k=k, adaptive=True, max_batch=8)
prompts = load_prompts("specbench", per_task=4)[16:24]
inputs = [encode_prompt(tokenizer, [{"role": "user", "content": p.text}], chat=True) for p in prompts]
print("prompt tokens", [ids.shape[1] for ids in inputs], "in all", sum(ids.shape[1] for ids in inputs))

start = time.perf_counter()
seqs = [engine.submit(ids, max_new_tokens=args.max_new_tokens) for ids in inputs]
decode = defaultdict(lambda: [0, 0.0, 0])  # (rows, drafting) -> [steps, seconds, tokens]
reading = [0, 0.0, 0]  # steps that read prompt tokens, their seconds, the tokens read
while engine.has_work:
    report = engine.step()
    if not args.quiet:
        print(f"{time.perf_counter() - start:6.2f} s  rows {report.rows}  width {report.width}  read "
              f"{report.prefill_tokens:4d}  drafted {report.drafted:2d}  accepted {report.accepted:2d}  "
              f"step {report.step_s * 1000:5.0f} ms", flush=True)
    if report.prefill_tokens:
        reading[0] += 1
        reading[1] += report.step_s
        reading[2] += report.prefill_tokens
    elif report.rows:
        entry = decode[report.rows, report.drafted > 0]
        entry[0] += 1
        entry[1] += report.step_s
        entry[2] += report.rows + report.accepted

print(f"wall {time.perf_counter() - start:.1f} s, {sum(len(s.result.token_ids) for s in seqs)} tokens; "
      f"{reading[0]} steps read {reading[2]} prompt tokens in {reading[1]:.1f} s")
for (rows, drafting), (steps, seconds, tokens) in sorted(decode.items()):
    print(f"  {rows} rows, {'drafting' if drafting else 'plain':8s}: {steps:3d} steps, {seconds / steps * 1000:4.0f} ms "
          f"each, {tokens / seconds:5.1f} tok/s")
