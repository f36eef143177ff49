"""In-process burst on the llama.cpp backend, without HTTP: N chat requests submitted at once to an idle engine, as
`bench --endpoint` at N concurrent clients starts a level. Compares prompt chunks read in the rows' own decode (the
default) with chunks read in a decode of their own beside the rows' pass, alternating the order each round; a fresh
engine and drafter each run (no drafts from an earlier run's answers), prefix cache emptied.

  .venv/bin/python scripts/burst.py [--requests 8] [--rounds 2] [--max-new-tokens 64] [--draft auto|none]

Prints per run: wall, tok/s, TTFT p50 / max, when the last prompt was read, and per step what it read.
"""

import argparse
import statistics
import time

import torch

from specdecode.batch import BatchEngine
from specdecode.encoding import encode_chat, eos_token_ids
from specdecode.pipeline import load_components
from specdecode.prompts import load_prompts
from specdecode.stopping import StopCondition

parser = argparse.ArgumentParser()
parser.add_argument("--target", default="qwen2.5-coder-1.5b")
parser.add_argument("--draft", default="auto")
parser.add_argument("--requests", type=int, default=8)
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--verbose", action="store_true", help="print every step that read a prompt")
args = parser.parse_args()

draft = None if args.draft == "none" else args.draft
model, tok, _, k, adaptive = load_components(args.target, None, backend="llama.cpp", threads=args.threads,
                                             max_rows=args.requests, adaptive=draft is not None)
stop = StopCondition(eos_token_ids(model, tok), (), tok)
texts = [p.text for p in load_prompts(per_task=2)][: args.requests]
prompts = [torch.tensor([encode_chat(tok, [{"role": "user", "content": text}])]) for text in texts]
print(f"{model.describe()}; prompts of {sorted(p.shape[1] for p in prompts)} tokens; {args.max_new_tokens} new")


def run(fused: bool) -> dict:
    model.reads_in_pass = fused
    model.drop_cached_prefixes()
    drafter = model.make_drafter(draft, tokenizer=tok, threads=args.threads) if draft else None
    engine = BatchEngine(model, drafter, tok, k=k, adaptive=adaptive, max_batch=args.requests)
    start = time.perf_counter()
    seqs = [engine.submit(p, max_new_tokens=args.max_new_tokens, stop=stop) for p in prompts]
    first: dict[int, float] = {}
    read_until = 0.0
    while engine.has_work:
        report = engine.step()
        now = time.perf_counter() - start
        for seq, _ in report.events:
            first.setdefault(id(seq), now)
        if report.prefill_tokens:
            read_until = now
            if args.verbose:
                print(f"  {now:6.1f}s read {report.prefill_tokens:4d} (in pass {report.read_in_pass:4d}) rows "
                      f"{report.rows} width {report.width} verify {report.verify_s:.2f}s step {report.step_s:.2f}s")
    wall = time.perf_counter() - start
    tokens = sum(len(s.result.token_ids) for s in seqs)
    ttft = sorted(first.values())
    return dict(wall=wall, tps=tokens / wall, ttft_p50=statistics.median(ttft), ttft_max=ttft[-1], read=read_until)


rows = []
for r in range(args.rounds):
    for fused in ((True, False) if r % 2 == 0 else (False, True)):
        result = run(fused)
        rows.append((fused, result))
        print(f"round {r + 1} {'in the rows pass' if fused else 'apart          '}: wall {result['wall']:6.1f} s, "
              f"{result['tps']:5.2f} tok/s, TTFT p50 {result['ttft_p50']:5.1f} s max {result['ttft_max']:5.1f} s, "
              f"reading done at {result['read']:5.1f} s", flush=True)
for fused in (True, False):
    walls = [res["wall"] for f, res in rows if f == fused]
    print(f"{'in the rows pass' if fused else 'apart'}: wall median {statistics.median(walls):.1f} s "
          f"(min {min(walls):.1f}, max {max(walls):.1f})")
