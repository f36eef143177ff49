#!/usr/bin/env python3
"""Per-token time outside `llama_decode`: our engine (plain or a drafter) against llama-cpp-python's `Llama.generate`
on the same GGUF, in one process, pairs alternating which runs first. Every `llama_decode` call is timed apart, so
the rest is each loop's own work (Python, sampling, bookkeeping). Not part of CI.

Usage: .venv/bin/python scripts/llama-overhead.py [plain|auto|<draft spec>] [PAIRS] [--tokens N] [--prompt TEXT]
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
from specdecode.sampling import SamplingParams

DEMO = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("method", nargs="?", default="plain")
    ap.add_argument("pairs", nargs="?", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompt", default=DEMO)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

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

    plain = args.method == "plain"
    model, tok, drafter, k, _ = load_components("qwen2.5-coder-1.5b", None if plain else args.method,
                                                backend="llama.cpp", threads=args.threads, max_rows=1, k=None,
                                                adaptive=not plain)
    engine = BatchEngine(model, drafter, tok, k=k, adaptive=not plain, max_batch=1)
    theirs = LlamaCppMethod("llama-cpp", model.gguf_path, frozenset(model.eos_token_ids), args.threads, 2048)
    ids = encode_prompt(tok, args.prompt, chat=True)

    def ours() -> int:
        if engine.drafter is not None:
            engine.drafter.forget_last_request()  # no drafting from the previous run's answer
        seq = engine.submit(ids, max_new_tokens=args.tokens)
        while engine.has_work:
            engine.step()
        return len(seq.result.token_ids)

    def llama() -> int:
        return len(theirs.run(ids, args.tokens, SamplingParams()).token_ids)

    runs = collections.defaultdict(list)
    for pair in range(args.pairs + 1):  # pair 0 warms both up
        for name, run in (("ours", ours), ("llama-cpp-python", llama))[:: 1 if pair % 2 else -1]:
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
    ratios = [theirs_[0] / ours_[0] for ours_, theirs_ in zip(runs["ours"], runs["llama-cpp-python"])]
    print("llama-cpp-python wall / ours, by pair:", " ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
