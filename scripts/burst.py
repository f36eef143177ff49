"""In-process burst on the llama.cpp backend, without HTTP: N chat requests submitted at once to an idle engine, as
`bench --endpoint` at N concurrent clients starts a level. Compares the engine as it is with a variant (--vs):
`apart`, prompt chunks read in a decode of their own beside the rows' pass instead of in the rows' own; `unpriced`,
drafts priced as if the pass read no prompt beside the rows; `chunk:N`, N prompt tokens a step (`--chunk` fixes the
engine's own, default measured); `reread`, a prompt neither waits for the reading of a prefix it shares nor starts
from the cells of a row still being read (each reads what it shares again); `none`, the engine as is alone (to compare
two trees run one after the other). Alternates the order each round; a fresh engine and drafter each run (no drafts
from an earlier run's answers), prefix cache emptied.

`--traffic agent` makes the burst agent requests (bench --traffic agent: one file of the edit prompts' code, then
each edit); `--running N` starts N fresh requests first and sends the burst once they decode (a burst arriving beside
running rows); the run then ends when the burst is answered. `--long-first` sends the burst's longest prompt alone and
the rest after the engine's first step, as a server often hands a burst over when a long prompt's request came first.

  .venv/bin/python scripts/burst.py [--vs apart|unpriced|chunk:N|reread|none] [--chunk N] [--requests 8] [--rounds 2]
                                    [--max-new-tokens 64] [--draft auto|none] [--traffic fresh|agent] [--running N]
                                    [--long-first]

Prints per run: wall, tok/s, TTFT p50 / max, when the last prompt was read, and per step what it read.
"""

import argparse
import statistics
import time

import torch

from specdecode.batch import BatchEngine
from specdecode.bench.load import agent_requests
from specdecode.encoding import encode_chat, eos_token_ids
from specdecode.pipeline import load_components
from specdecode.prompts import load_prompts
from specdecode.stopping import StopCondition

parser = argparse.ArgumentParser()
parser.add_argument("--target", default="qwen2.5-coder-1.5b")
parser.add_argument("--draft", default="auto")
parser.add_argument("--requests", type=int, default=8)
parser.add_argument("--first", type=int, default=16, help="the first of the Spec-Bench prompts (4 a task) to send")
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--vs", default="apart", help="apart, unpriced, chunk:N or none (the engine as is only)")
parser.add_argument("--chunk", type=int, default=None, help="prompt tokens a step as is (default: measured)")
parser.add_argument("--verbose", action="store_true", help="print every step that read a prompt")
parser.add_argument("--traffic", choices=("fresh", "agent"), default="fresh")
parser.add_argument("--running", type=int, default=0, help="fresh requests decoding when the burst arrives")
parser.add_argument("--long-first", action="store_true", help="the longest prompt first, the rest after one step")
args = parser.parse_args()

draft = None if args.draft == "none" else args.draft
model, tok, _, k, adaptive = load_components(args.target, None, backend="llama.cpp", threads=args.threads,
                                             max_rows=args.requests + args.running, adaptive=draft is not None)
stop = StopCondition(eos_token_ids(model, tok), (), tok)
# As `bench --endpoint --per-task 4 --requests 8` gives its third level (concurrency 8, one round): prompts 16-23
fresh = [p.text for p in load_prompts(per_task=4)]
if args.traffic == "agent":
    # the file of `bench --traffic agent --prompts edits --per-task 8` (1,484 tokens), or more
    burst = agent_requests([p.text for p in load_prompts("edits", per_task=max(8, args.requests))])[: args.requests]
else:
    burst = [[{"role": "user", "content": text}] for text in fresh[args.first : args.first + args.requests]]
prompts = [torch.tensor([encode_chat(tok, messages)]) for messages in burst]
running = [torch.tensor([encode_chat(tok, [{"role": "user", "content": text}])]) for text in fresh[: args.running]]
print(f"{model.describe()}; prompts of {sorted(p.shape[1] for p in prompts)} tokens; {args.max_new_tokens} new; "
      f"{args.running} running")


def reread(engine) -> None:
    """Each prompt reads what it shares with one still being read (the engine before it waited, or shared those
    cells)."""
    engine._waits_for_reading = lambda seq, to_read: False
    model._held = lambda: zip(model._seqs, model._tokens)


def run(variant: bool) -> dict:
    model.reads_in_pass = not (variant and args.vs == "apart")
    model.drop_cached_prefixes()
    drafter = model.make_drafter(draft, tokenizer=tok, threads=args.threads) if draft else None
    chunk = int(args.vs.split(":")[1]) if variant and args.vs.startswith("chunk:") else args.chunk
    engine = BatchEngine(model, drafter, tok, k=k, adaptive=adaptive, max_batch=args.requests + args.running,
                         prefill_chunk=chunk)
    if variant and args.vs == "reread":
        reread(engine)
    if variant and args.vs == "unpriced":
        plan = engine.controller.plan_step
        engine.controller.plan_step = lambda rows, trees, reading=0: plan(rows, trees)
    runners = [engine.submit(p, max_new_tokens=4 * args.max_new_tokens + 256) for p in running]
    while model.rows < len(runners):
        engine.step()
    start = time.perf_counter()

    def submit(batch: list) -> list:
        return [engine.submit(p, max_new_tokens=args.max_new_tokens, stop=stop) for p in batch]

    longest = max(prompts, key=lambda p: p.shape[1]) if args.long_first else None
    later = [p for p in prompts if p is not longest] if args.long_first else []
    seqs = submit([longest] if args.long_first else prompts)
    first: dict[int, float] = {}
    read_until, read = 0.0, 0
    while later or not all(seq.finished for seq in seqs):
        report = engine.step()
        seqs, later = seqs + submit(later), []
        read += report.prefill_tokens
        now = time.perf_counter() - start
        for seq, _ in report.events:
            first.setdefault(id(seq), now)
        if report.prefill_tokens:
            read_until = now
            if args.verbose:
                print(f"  {now:6.1f}s read {report.prefill_tokens:4d} (in pass {report.read_in_pass:4d}) rows "
                      f"{report.rows} width {report.width} draft {report.draft_s:.2f}s verify {report.verify_s:.2f}s step "
                      f"{report.step_s:.2f}s")
    wall = time.perf_counter() - start
    for seq in runners:
        seq.cancel()
    while engine.has_work:
        engine.step()
    tokens = sum(len(s.result.token_ids) for s in seqs)
    ttft = sorted(first.get(id(seq), wall) for seq in seqs)
    return dict(wall=wall, tps=tokens / wall, ttft=ttft, ttft_p50=statistics.median(ttft), ttft_max=ttft[-1],
                read=read_until, tokens_read=read, cached=sum(s.stats.cached_prompt_tokens for s in seqs),
                drafted=sum(s.stats.drafted_tokens for s in seqs), accepted=sum(s.stats.accepted_tokens for s in seqs))


rows = []
names = {False: "as is", True: args.vs}
for r in range(args.rounds):
    for variant in (False,) if args.vs == "none" else (False, True) if r % 2 == 0 else (True, False):
        result = run(variant)
        rows.append((variant, result))
        print(f"round {r + 1} {names[variant]:>8}: wall {result['wall']:6.1f} s, "
              f"{result['tps']:5.2f} tok/s, TTFT p50 {result['ttft_p50']:5.1f} s max {result['ttft_max']:5.1f} s, "
              f"reading done at {result['read']:5.1f} s ({result['tokens_read']} tokens read, the burst's cached "
              f"{result['cached']}), drafted {result['drafted']} accepted {result['accepted']}; TTFT s "
              f"{' '.join(f'{t:.1f}' for t in result['ttft'])}", flush=True)
for variant in (False,) if args.vs == "none" else (False, True):
    walls = [res["wall"] for v, res in rows if v == variant]
    print(f"{names[variant]}: wall median {statistics.median(walls):.1f} s "
          f"(min {min(walls):.1f}, max {max(walls):.1f})")
