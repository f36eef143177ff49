#!/usr/bin/env python3
"""What a busy stretch leaves in the controller's prices: one engine (llama.cpp, `auto`, adaptive, a batch of 8)
serves Spec-Bench requests one after another while, from request HOG_FROM to HOG_TO, processes spinning on the CPU
share its cores (a CPU hog: another tenant, a test run). After each request: its inter-token latency, what it drafted
and accepted, the width a plain pass would run at (padded where a wider one measures cheaper), and one row's passes by
width as stored and as priced now (`CostModel._curve`). A price left far above what its width costs once the machine
is quiet is never drafted, so never timed again. Timings vary from run to run with where the hog's deschedulings fall:
compare trees in alternated runs (`PYTHONPATH=<tree>/src`). Not part of CI.

Usage: .venv/bin/python scripts/busy-minute.py [--hog-from 2|-1] [--hog-to 5] [--requests 12] [--hogs 2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from specdecode.batch import BatchEngine
from specdecode.encoding import encode_prompt
from specdecode.pipeline import load_components
from specdecode.prompts import load_prompts


def spin(processes: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hog-from", type=int, default=2, help="request at which the hog starts (-1: before loading, so "
                    "the pass table timed at load is a busy one)")
    ap.add_argument("--hog-to", type=int, default=5, help="request at which it stops")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--hogs", type=int, default=2, help="spinning processes")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    hogs: list[subprocess.Popen] = []
    try:
        if args.hog_from < 0:
            print("-- hog on (load)", flush=True)
            hogs = spin(args.hogs)
        model, tok, drafter, k, _ = load_components("qwen2.5-coder-1.5b", "auto", backend="llama.cpp",
                                                    threads=args.threads, max_rows=8, k=None, adaptive=True)
        engine = BatchEngine(model, drafter, tok, k=k, adaptive=True, max_batch=8)
        texts = [p.text for p in load_prompts("specbench", per_task=4)]
        controller = engine.controller
        for i in range(args.requests):
            if i == args.hog_from:
                print("-- hog on", flush=True)
                hogs = spin(args.hogs)
            if i == args.hog_to:
                print("-- hog off", flush=True)
                for hog in hogs:
                    hog.kill()
                hogs = []
            seq = engine.submit(encode_prompt(tok, texts[i % len(texts)], chat=True), max_new_tokens=args.tokens)
            first = None
            while engine.has_work:
                engine.step()
                if first is None and seq.result.token_ids:
                    first = time.perf_counter()
            n, stats = len(seq.result.token_ids), seq.result.stats
            itl_ms = (time.perf_counter() - first) / max(n - 1, 1) * 1e3
            costs = controller.measured.costs
            stored = {w: round(e.value * 1e3, 1) for w, e in sorted(costs.verify_s.items()) if e.value and w <= 8}
            now = {w: round(t * 1e3, 1) for w, t in sorted(costs._curve().items()) if w <= 8}
            print(f"req {i:2d} ITL {itl_ms:5.1f} ms drafted {stats.drafted_tokens:3d} accepted {stats.accepted_tokens:3d}"
                  f" | plain runs {controller._pass(1)[0]}-wide | ms stored {stored} now {now}", flush=True)
    finally:
        for hog in hogs:
            hog.kill()


if __name__ == "__main__":
    main()
