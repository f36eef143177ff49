#!/usr/bin/env python3
"""Side by side: the same decoder from two source trees (say, main before and after a change), prompt by prompt in
alternating order, one process per tree holding its models (only one computes at a time).

    git worktree add /tmp/before <commit>
    scripts/ab-compare.py --a /tmp/before/src --b src --per-task 2 -- --target qwen2.5-coder-1.5b --draft auto \\
        --dtype bf16 --threads 2 --backend torch

Everything after `--` goes to `SpecDecoder.from_specs` (as --name value pairs); an option a tree's from_specs does not
take (--backend, before backends existed) is left out there, with a notice. Prints per-prompt tok/s ratios b/a, their
mean, median and min–max, the same for decode only (time to first token left out: a long prompt's reading, the same
work in both trees, otherwise carries most of the noise), and whether the outputs are identical; writes them as JSON
with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, sys
from specdecode import SpecDecoder
from specdecode.prompts import load_prompts
options = json.loads(sys.argv[1])
prompts = load_prompts(options.pop("prompts"), tasks=options.pop("tasks"), per_task=options.pop("per_task"))
max_new_tokens = options.pop("max_new_tokens")
import inspect
known = inspect.signature(SpecDecoder.from_specs).parameters
dropped = sorted(set(options) - set(known))  # e.g. backend, on a tree from before backends (torch only there)
if dropped:
    print(f"[ab-compare] {sys.path[0] or '.'}: from_specs takes no {dropped}; left out", file=sys.stderr)
decoder = SpecDecoder.from_specs(options.pop("target"), options.pop("draft"),
                                 **{k: v for k, v in options.items() if k in known})
decoder.generate(prompts[0].text, chat=True, max_new_tokens=4)  # one-time costs out of every timing
print(json.dumps({"ready": len(prompts)}), flush=True)
for line in sys.stdin:
    prompt = prompts[int(line)]
    out = decoder.generate(prompt.text, chat=True, max_new_tokens=max_new_tokens)
    stats = out.stats
    decode_s = stats.total_time_s - stats.time_to_first_token_s  # the prompt's reading left out
    print(json.dumps({"id": prompt.id, "task": prompt.task, "tokens": out.token_ids, "tok_s": stats.tokens_per_s,
                      "decode_tok_s": (stats.new_tokens - 1) / decode_s if decode_s > 0 else 0.0}), flush=True)
"""


def parse_options(extra: list[str]) -> dict:
    options = {}
    for name, value in zip(extra[::2], extra[1::2]):
        key = name.lstrip("-").replace("-", "_")
        options[key] = int(value) if value.isdigit() else value
    return options


def start(src: str, options: dict) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    worker = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(options)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    ready = json.loads(worker.stdout.readline())
    return worker, ready["ready"]


def ask(worker: subprocess.Popen, index: int) -> dict:
    worker.stdin.write(f"{index}\n")
    worker.stdin.flush()
    return json.loads(worker.stdout.readline())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="source tree A (the baseline), e.g. /tmp/before/src")
    parser.add_argument("--b", required=True, help="source tree B")
    parser.add_argument("--prompts", default=None, help="a shipped set (specbench, edits) or a file (default: specbench)")
    parser.add_argument("--tasks", default=None, help="comma-separated tasks to keep (default: all)")
    parser.add_argument("--per-task", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args, extra = parser.parse_known_args()
    extra = [e for e in extra if e != "--"]
    options = {"target": "qwen2.5-coder-1.5b", "draft": "auto", **parse_options(extra), "per_task": args.per_task,
               "max_new_tokens": args.max_new_tokens, "prompts": args.prompts,
               "tasks": args.tasks.split(",") if args.tasks else None}
    a, n = start(args.a, dict(options))
    b, _ = start(args.b, dict(options))
    rows = []
    for i in range(n):
        order = [("a", a), ("b", b)] if i % 2 == 0 else [("b", b), ("a", a)]
        runs = {label: ask(worker, i) for label, worker in order}
        ratio = runs["b"]["tok_s"] / runs["a"]["tok_s"]
        decode_ratio = runs["b"]["decode_tok_s"] / max(runs["a"]["decode_tok_s"], 1e-9)
        lengths = {label: len(run["tokens"]) for label, run in runs.items()}  # tok/s counts the prompt's reading too
        rows.append(dict(id=runs["a"]["id"], task=runs["a"]["task"], a_tok_s=runs["a"]["tok_s"], b_tok_s=runs["b"]["tok_s"],
                         ratio=ratio, decode_ratio=decode_ratio, identical=runs["a"]["tokens"] == runs["b"]["tokens"], first=order[0][0],
                         a_tokens=lengths["a"], b_tokens=lengths["b"]))
        same = "same output" if rows[-1]["identical"] else f"DIFFERENT output ({lengths['a']} vs {lengths['b']} tokens)"
        print(f"{rows[-1]['task']:>15} {rows[-1]['id']:>6}: a {runs['a']['tok_s']:6.2f}  b {runs['b']['tok_s']:6.2f} tok/s"
              f"  b/a {ratio:.3f} (decode only {decode_ratio:.3f})  {same}", flush=True)
    for worker in (a, b):
        worker.stdin.close()
        worker.wait()
    summary = dict(identical=sum(r["identical"] for r in rows), n=len(rows))
    for key, label in (("ratio", "b/a per prompt"), ("decode_ratio", "decode only (TTFT out)")):
        ratios = [r[key] for r in rows]
        summary[key] = dict(mean=statistics.mean(ratios), median=statistics.median(ratios), min=min(ratios), max=max(ratios))
        print(f"{label}: mean {summary[key]['mean']:.3f}, median {summary[key]['median']:.3f}, "
              f"min {summary[key]['min']:.3f}, max {summary[key]['max']:.3f}")
    print(f"identical outputs {summary['identical']}/{summary['n']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(options=options, a=args.a, b=args.b, summary=summary, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
