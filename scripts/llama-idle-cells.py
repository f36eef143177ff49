#!/usr/bin/env python3
"""What idle prefix-cache cells cost a one-token pass and a prompt reading on this CPU: one row decodes, and then a
prompt of each `--read` length is read, beside finished rows' spares (other sequences' cells in the same unified KV
cache), rounds alternating the order of the sizes. The prefix cache keeps
spares whole because on the AMD EPYC (session 30) 0 / 1,000 / 3,000 idle cells measured alike; run this on another
CPU before trusting that there. Not part of CI.

Usage: .venv/bin/python scripts/llama-idle-cells.py [--cells 0,1000,3000] [--spare 250] [--read 64,512] [--rounds 3]
       [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import llama_cpp
import torch

from specdecode.batch import BatchEngine
from specdecode.pipeline import load_components


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="0,1000,3000", help="idle cells to hold beside the row, per measurement")
    ap.add_argument("--spare", type=int, default=250, help="tokens per finished prompt (spare) holding them")
    ap.add_argument("--read", default="64,512", help="prompt lengths whose reading (one pass each) is timed too")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    args = ap.parse_args()
    sizes = [int(c) for c in args.cells.split(",")]
    reads = [int(n) for n in args.read.split(",") if n]

    passes: list[tuple[int, float]] = []
    original = llama_cpp.llama_decode

    def timed_decode(ctx, batch):
        start = time.perf_counter()
        status = original(ctx, batch)
        passes.append((batch.n_tokens, time.perf_counter() - start))
        return status

    llama_cpp.llama_decode = timed_decode
    backend, _, _, _, _ = load_components(args.target, "none", backend="llama.cpp", threads=args.threads, max_rows=8,
                                          k=None, adaptive=False)
    engine = BatchEngine(backend, None, max_batch=8)
    tokens = torch.Generator().manual_seed(0)

    def run(prompt_len: int, new: int) -> None:
        engine.submit(torch.randint(1000, 30000, (1, prompt_len), generator=tokens), max_new_tokens=new)
        while engine.has_work:
            engine.step()

    ms: dict[int, list[float]] = {size: [] for size in sizes}
    read_ms: dict[tuple[int, int], list[float]] = {(size, n): [] for size in sizes for n in reads}
    for r in range(args.rounds):
        for size in sizes if r % 2 == 0 else sizes[::-1]:
            backend.drop_cached_prefixes()
            for _ in range(size // args.spare):
                run(args.spare, 1)  # a finished row: its cells stay as a spare
            held = backend.prefix_cache.tokens if backend.prefix_cache is not None else 0
            passes.clear()
            run(100, 64)
            one_token = [seconds for n, seconds in passes if n == 1][4:]
            ms[size].append(1e3 * statistics.median(one_token))
            for n in reads:  # a fresh prompt read in one pass, beside the same spares
                passes.clear()
                run(n, 1)
                read_ms[size, n].append(1e3 * sum(seconds for tokens, seconds in passes if tokens == n))
            print(f"round {r + 1}: {held:>5} idle cells: one-token pass {ms[size][-1]:.2f} ms (median)"
                  + "".join(f", {n}-token read {read_ms[size, n][-1]:.0f} ms" for n in reads), flush=True)
    for size, values in ms.items():
        print(f"{size:>5} idle cells: one-token pass {statistics.median(values):.2f} ms (rounds: "
              f"{', '.join(f'{v:.2f}' for v in values)})"
              + "".join(f"; {n}-token read {statistics.median(read_ms[size, n]):.0f} ms" for n in reads))


if __name__ == "__main__":
    main()
