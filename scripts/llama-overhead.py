#!/usr/bin/env python3
"""Per-token time outside `llama_decode`: our engine (plain or a drafter) against llama-cpp-python's `Llama.generate`
on the same GGUF, in one process, pairs alternating which runs first. Every `llama_decode` call is timed apart, so
the rest is each loop's own work (Python, sampling, bookkeeping). `--against plain`: our engine without a drafter
instead of llama-cpp-python. `--prompts SET --per-task N`: a fresh prompt every pair and the drafter's memory of
earlier answers kept, as a server's is (with `--max-batch 8`, its engine). Not part of CI.

Usage: .venv/bin/python scripts/llama-overhead.py [plain|auto|<draft spec>] [PAIRS] [--tokens N] [--prompt TEXT]
           [--against llama-cpp-python|plain] [--max-batch 1] [--prompts SET --per-task N]
           [--temperature T --top-p P --top-k K --seed S]   (sampled decoding, the same settings for both)
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import llama_cpp
import llama_cpp.llama_cpp as llama_cpp_bindings

from specdecode.batch import BatchEngine
from specdecode.bench.methods import LlamaCppMethod
from specdecode.encoding import encode_prompt
from specdecode.pipeline import load_components
from specdecode.prompts import load_prompts
from specdecode.sampling import SamplingParams

DEMO = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("method", nargs="?", default="plain")
    ap.add_argument("pairs", nargs="?", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompt", default=DEMO)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", choices=["llama-cpp-python", "plain"], default="llama-cpp-python")
    ap.add_argument("--max-batch", type=int, default=1)
    ap.add_argument("--prompts", default=None, help="a prompt set (e.g. specbench): a fresh prompt every pair")
    ap.add_argument("--per-task", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if args.max_batch > 1 and not args.prompts and args.method != "plain":
        # rows of a batch engine draft with spawned drafters: forgetting on the engine's own would leave each run's
        # answer in the shared suffix cache, and the next run of the same prompt would copy it
        ap.error("--max-batch > 1 needs --prompts (a fresh prompt every pair)")

    decode_s = collections.Counter()
    original = llama_cpp.llama_decode

    def timed_decode(ctx, batch):
        start = time.perf_counter()
        try:
            return original(ctx, batch)
        finally:
            decode_s["total"] += time.perf_counter() - start

    # both loops call it through one of these two modules
    llama_cpp.llama_decode = llama_cpp_bindings.llama_decode = timed_decode

    def engine_for(method: str) -> tuple[BatchEngine, object]:
        plain = method == "plain"
        model, tok, drafter, k, _ = load_components("qwen2.5-coder-1.5b", None if plain else method,
                                                    backend="llama.cpp", threads=args.threads, max_rows=args.max_batch,
                                                    k=None, adaptive=not plain)
        return BatchEngine(model, drafter, tok, k=k, adaptive=not plain, max_batch=args.max_batch), tok

    engine, tok = engine_for(args.method)
    if args.prompts:
        texts = [p.text for p in load_prompts(args.prompts, per_task=args.per_task)]
        if len(texts) < args.pairs + 1:
            raise SystemExit(f"{len(texts)} prompts for {args.pairs + 1} pairs: raise --per-task")
    else:
        texts = [args.prompt]
    prompts = [encode_prompt(tok, text, chat=True) for text in texts]

    def run_engine(engine: BatchEngine, ids) -> int:
        if engine.drafter is not None and not args.prompts:
            engine.drafter.forget_last_request()  # no drafting from the previous run's answer to the same prompt
        engine.backend.drop_cached_prefixes()  # both read the whole prompt
        seq = engine.submit(ids, max_new_tokens=args.tokens, sampling=sampling)
        while engine.has_work:
            engine.step()
        return len(seq.result.token_ids)

    if args.against == "plain":
        baseline_engine, _ = engine_for("plain")

        def baseline(ids) -> int:
            return run_engine(baseline_engine, ids)
    else:
        theirs = LlamaCppMethod("llama-cpp", engine.backend.gguf_path, frozenset(engine.backend.eos_token_ids),
                                args.threads, 2048)

        def baseline(ids) -> int:
            return len(theirs.run(ids, args.tokens, sampling).token_ids)

    runs = collections.defaultdict(list)
    for pair in range(args.pairs + 1):  # pair 0 warms both up
        ids = prompts[pair % len(prompts)]
        both = (("ours", lambda: run_engine(engine, ids)), (args.against, lambda: baseline(ids)))
        for name, run in both[:: 1 if pair % 2 else -1]:
            decode_s.clear()
            start = time.perf_counter()
            tokens = run()
            wall = time.perf_counter() - start
            if pair:
                runs[name].append((wall, decode_s["total"], tokens))
    for name, rows in runs.items():
        outside = statistics.median((wall - decode) / tokens * 1e3 for wall, decode, tokens in rows)
        per_decode = statistics.median(decode / tokens * 1e3 for _, decode, tokens in rows)
        print(f"{name:>16}: wall {' '.join(f'{w:.3f}' for w, _, _ in rows)} s; llama_decode {per_decode:.2f} ms a "
              f"token; outside it {outside:.3f} ms a token (median)")
    ratios = [theirs_[0] / ours_[0] for ours_, theirs_ in zip(runs["ours"], runs[args.against])]
    print(f"{args.against} wall / ours, by pair: median {statistics.median(ratios):.3f};",
          " ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
