#!/usr/bin/env python3
"""What the prefix cache costs every pass on this CPU. Two engines on the llama.cpp backend in one process:
one aged as a server's is (waves of 8 requests of 300-860 tokens whose finished rows the prefix cache keeps), one kept
clean (its cache dropped before each probe); probes alternate between them. A probe reads a 1,024-token prompt, then
that prompt plus 256 new tokens (the 256 read at depth 1,024 beside the cached prefix, as a chat's next turn is) and
decodes 24 tokens; it reports the 256-token read and the median one-token pass. llama.cpp's attention visits every
cell of the unified cache's used range for each query token, so K/V left in the cache cost what the range spans: on
the AMD EPYC, finished rows kept as spare sequences in the cache (9,552 tokens) made reads 12-29 % and one-token passes
12-32 % dearer (sessions 31-32); copied out to host memory (session 32), 19,104 cached tokens cost nothing measurable.
Not part of CI.

Usage: .venv/bin/python scripts/llama-idle-cells.py [--waves 6] [--rounds 3] [--max-cached-tokens N] [--threads 2]
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
    ap.add_argument("--waves", type=int, default=6, help="waves of 8 requests that age the first engine's cache")
    ap.add_argument("--rounds", type=int, default=3, help="probe pairs, the order alternating")
    ap.add_argument("--max-cached-tokens", type=int, default=None,
                    help="bound the aged engine's prefix cache in tokens (default: the backend's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    args = ap.parse_args()

    passes: list[tuple[int, float]] = []
    original = llama_cpp.llama_decode

    def timed_decode(ctx, batch):
        start = time.perf_counter()
        status = original(ctx, batch)
        passes.append((batch.n_tokens, time.perf_counter() - start))
        return status

    llama_cpp.llama_decode = timed_decode
    tokens = torch.Generator().manual_seed(0)

    def engine() -> BatchEngine:
        backend, _, _, _, _ = load_components(args.target, "none", backend="llama.cpp", threads=args.threads,
                                              max_rows=8, k=None, adaptive=False)
        return BatchEngine(backend, None, max_batch=8)

    def run(engine: BatchEngine, requests: list[tuple[torch.Tensor, int]]) -> None:
        for prompt, new in requests:
            engine.submit(prompt, max_new_tokens=new)
        while engine.has_work:
            engine.step()

    def probe(engine: BatchEngine) -> tuple[float, float]:
        base = torch.randint(1000, 30000, (1, 1024), generator=tokens)
        run(engine, [(base, 1)])
        passes.clear()
        run(engine, [(torch.cat([base, torch.randint(1000, 30000, (1, 256), generator=tokens)], 1), 24)])
        read = sum(seconds for n, seconds in passes if n > 1)
        return 1e3 * read, 1e3 * statistics.median(seconds for n, seconds in passes if n == 1)

    aged, clean = engine(), engine()
    if args.max_cached_tokens is not None:
        aged.backend.prefix_cache.max_tokens = args.max_cached_tokens
    for _ in range(args.waves):
        run(aged, [(torch.randint(1000, 30000, (1, 300 + 80 * i), generator=tokens), 4 + 4 * i) for i in range(8)])
    print(f"aged engine: its prefix cache holds {aged.backend.prefix_cache.tokens} tokens in "
          f"{len(aged.backend.prefix_cache.entries)} entries", flush=True)
    results: dict[str, list[tuple[float, float]]] = {"aged": [], "clean": []}
    for r in range(args.rounds):
        for name in ("aged", "clean") if r % 2 == 0 else ("clean", "aged"):
            if name == "clean":
                clean.backend.drop_cached_prefixes()
            results[name].append(probe(aged if name == "aged" else clean))
            read, one = results[name][-1]
            print(f"round {r + 1} {name:>5}: 256-token read at depth 1,024 {read:.0f} ms, one-token pass {one:.1f} ms",
                  flush=True)
    for name, values in results.items():
        print(f"{name:>5}: read {statistics.median(v[0] for v in values):.0f} ms, one-token pass "
              f"{statistics.median(v[1] for v in values):.1f} ms (medians of {len(values)})")
    for i, ((read_a, one_a), (read_c, one_c)) in enumerate(zip(results["aged"], results["clean"]), 1):
        print(f"round {i}: aged / clean read {read_a / read_c:.2f}x, one-token pass {one_a / one_c:.2f}x")


if __name__ == "__main__":
    main()
