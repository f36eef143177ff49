#!/usr/bin/env python3
"""What a llama.cpp pass of W new tokens costs with logits at the last position only (what llama-bench's `pp W`
times) and at every position (what verifying a draft needs), through the same context our backend runs.

    scripts/llama-pass-costs.py ~/.cache/specdecode/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.backends.llamacpp import LlamaCppBackend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200, help="tokens in the row before each pass")
    parser.add_argument("--widths", default="1,2,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=3, help="the fastest of this many counts")
    args = parser.parse_args()
    backend = LlamaCppBackend(args.gguf, threads=args.threads, max_rows=1, prefix_cache=False)
    backend.add_row((torch.arange(args.context) * 7 + 100).remainder(backend.vocab_size)[None])
    context, seq, start = backend.context, backend._seqs[0], args.context
    print(f"{backend.describe()}, {args.threads} threads, {args.context}-token context; ms per pass")
    print(f"{'width':>6} {'last only':>10} {'every position':>15}")
    for width in (int(w) for w in args.widths.split(",")):
        tokens = [(i * 13 + 5) % 1000 + 100 for i in range(width)]
        best = {}
        for every in (False, True):
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = context.decode(tokens, list(range(start, start + width)), [seq] * width,
                                     [every] * (width - 1) + [True])
                out.clone()  # as the backend hands them on (a view into llama.cpp's buffer)
                seconds = time.perf_counter() - t0
                context.forget(seq, start)  # back to the context alone
                best[every] = min(best.get(every, seconds), seconds)
        print(f"{width:>6} {best[False] * 1e3:>10.1f} {best[True] * 1e3:>15.1f}")


if __name__ == "__main__":
    main()
