"""In-process check of load-aware batching without HTTP: the load benchmark's 8 chat requests (dev prompts,
64 tokens) arriving as a server sees them at 8 concurrent clients (one, then seven after the first step).
Prints every step that drafted or took 0.15 s beyond its draft and verify time, then tokens/s.

  .venv/bin/python scripts/batch-arrival.py [--warm N] [--draft auto|none]

--warm N: first serve N requests one at a time (as a server that ran the 1-request level first).
"""

import argparse
import time

import torch

from specdecode.batch import BatchEngine
from specdecode.models import load_model
from specdecode.pipeline import eos_token_ids, make_drafter
from specdecode.prompts import load_prompts
from specdecode.stopping import StopCondition

parser = argparse.ArgumentParser()
parser.add_argument("--warm", type=int, default=0)
parser.add_argument("--draft", default="auto")
args = parser.parse_args()
torch.set_num_threads(2)
target, tok = load_model("qwen2.5-coder-1.5b", dtype="bf16")
stop = StopCondition(eos_token_ids(target, tok), (), tok)
texts = [p.text for p in load_prompts(per_task=1)]
prompts = [torch.tensor([tok.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}],
                                                 add_generation_prompt=True, return_dict=False)]) for i in range(8)]
drafter = None if args.draft == "none" else make_drafter(args.draft, dtype="bf16", tokenizer=tok, target=target)
engine = BatchEngine(target, drafter, tok, k=8, adaptive=True, max_batch=8)
if args.warm:
    engine.max_batch = 1
    engine.generate_all([dict(input_ids=x, max_new_tokens=64, stop=stop) for x in prompts[: args.warm]])
    engine.max_batch = 8
seqs = [engine.submit(prompts[0], max_new_tokens=64, stop=stop)]
start = time.perf_counter()
while engine.has_work:
    t0 = time.perf_counter()
    report = engine.step()
    wall = time.perf_counter() - t0
    if report.speculative or wall - report.draft_s - report.verify_s > 0.15:
        print(f"rows {report.rows} cap {report.cap} lookup_only {report.lookup_only} drafted {report.drafted} "
              f"draft {report.draft_s:.2f}s verify {report.verify_s:.2f}s step {wall:.2f}s", flush=True)
    if len(seqs) == 1:
        seqs += [engine.submit(x, max_new_tokens=64, stop=stop) for x in prompts[1:]]
elapsed = time.perf_counter() - start
tokens = sum(len(s.result.token_ids) for s in seqs)
print(f"{tokens} tokens in {elapsed:.1f} s: {tokens / elapsed:.2f} tok/s")
