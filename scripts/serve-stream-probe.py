#!/usr/bin/env python3
"""What a server step costs by how answers leave it: one `specdecode serve` (no drafter by default), the same requests
alternating not streamed, streamed to a client that only reads bytes, and streamed through the `openai` client; each
request's ms a step from the server's own log (decode time after the first token / steps). If streaming or the client
cost the server's steps, the three columns part. `--kinds` picks columns; `in-process` runs the same request in this
process (the server's engine: same model, 8 rows, drafter and controller, loaded and stepped on one thread),
between the server's, so a server step and an in-process step are timed in the same minute. `ours-client` and
`llama-server` (llama.cpp's own server, `--llama-bin`, on the next port, the same GGUF and threads) are timed by the
client instead: ms a token between the first and the last streamed token, and the time to the first.
`--concurrency N` (N > 1): a load level instead of one request, for `in-process`, `ours-client` and `llama-server`:
each runs `--requests` fresh Spec-Bench prompts (tasks in turn, a slice of its own every pair, the same slice for
every kind), N at a time, the next sent as one ends (the load benchmark's closed loop), with end tokens; tok/s. Where
a level's loss lies: the engine (in-process against llama-server) or serving (our server against in-process). Not part
of CI.

Usage: .venv/bin/python scripts/serve-stream-probe.py [--draft none] [--pairs 8] [--tokens 96] [--port 8398]
           [--kinds not-streamed,bytes,openai,in-process,ours-client,llama-server] [--prompt TEMPLATE]
           [--concurrency 4 --requests 8 --first 0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import openai


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default="none")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--port", type=int, default=8398)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kinds", default="not-streamed,bytes,openai")
    ap.add_argument("--llama-bin", default=".llama-cpp-tools/build/bin")
    ap.add_argument("--prompt", default="Write a Python class for a {i}-legged robot, with methods to walk, turn and "
                    "report its state.", help="{i}: the pair's number (a prompt of its own every pair)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--requests", type=int, default=8, help="a level's requests (with --concurrency N > 1)")
    ap.add_argument("--first", type=int, default=0, help="the first Spec-Bench prompt of a level (tasks in turn)")
    args = ap.parse_args()
    level = args.concurrency > 1
    kind_names = args.kinds.split(",")
    base, llama_base = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.port + 1}"
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    servers = [(base, log, subprocess.Popen(
        [sys.executable, "-m", "specdecode.cli", "serve", "--target", "qwen2.5-coder-1.5b", "--draft", args.draft,
         "--backend", "llama.cpp", "--threads", str(args.threads), "--port", str(args.port)],
        stdout=log, stderr=subprocess.STDOUT))]
    if "llama-server" in kind_names:
        gguf = os.path.expanduser("~/.cache/specdecode/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
        llama_log = tempfile.NamedTemporaryFile("w+", suffix=".log")
        servers.append((llama_base, llama_log, subprocess.Popen(
            [os.path.join(args.llama_bin, "llama-server"), "-m", gguf, "-t", str(args.threads), "-tb", str(args.threads),
             "-np", "8", "-c", "16384", "-kvu", "--port", str(args.port + 1)], stdout=llama_log, stderr=subprocess.STDOUT)))
    try:
        for url, server_log, server in servers:
            while not _healthy(url):
                if server.poll() is not None:
                    raise SystemExit(f"a server did not start: {open(server_log.name).read()[-2000:]}")
                time.sleep(1)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")

        def body(i: int, stream: bool) -> dict:
            return dict(model="qwen2.5-coder-1.5b", max_tokens=args.tokens, temperature=0, stream=stream,
                        messages=[{"role": "user", "content": args.prompt.format(i=i)}])

        def not_streamed(i):
            httpx.post(base + "/v1/chat/completions", json=body(i, False), timeout=300)

        def bytes_only(i):
            with httpx.stream("POST", base + "/v1/chat/completions", json=body(i, True), timeout=300) as response:
                for _ in response.iter_bytes():
                    pass

        def openai_client(i):
            for _ in client.chat.completions.create(**body(i, True)):
                pass

        def client_timed(url, i):
            """ms a token after the first (one token a streamed piece: no drafter), and the first token's time (s), as
            the client reads the stream."""
            started, arrivals = time.perf_counter(), []
            with httpx.stream("POST", url + "/v1/chat/completions", json=body(i, True), timeout=300) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", [])):
                        arrivals.append(time.perf_counter())
            ttft.setdefault(url, []).append(arrivals[0] - started)
            return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) * 1e3

        ttft: dict[str, list[float]] = {}
        engine = None
        if "in-process" in kind_names:  # the server's engine: 8 rows, its drafter and controller
            from specdecode.batch import BatchEngine
            from specdecode.encoding import encode_prompt
            from specdecode.pipeline import load_components
            model, tok, drafter, k, adaptive = load_components(
                "qwen2.5-coder-1.5b", None if args.draft == "none" else args.draft, backend="llama.cpp",
                threads=args.threads, max_rows=8)
            engine = BatchEngine(model, drafter, tok, k=k, adaptive=adaptive, max_batch=8)

        def in_process(i):
            seq = engine.submit(encode_prompt(tok, body(i, False)["messages"], chat=True), max_new_tokens=args.tokens)
            while engine.has_work:
                engine.step()
            stats = seq.stats
            return (stats.total_time_s - stats.time_to_first_token_s) / stats.steps * 1e3

        if level:  # every pair's prompts, read once: tasks in turn, so a longer list keeps the same first slices
            from specdecode.bench.load import tasks_in_turn
            from specdecode.prompts import load_prompts
            end = args.first + args.pairs * args.requests
            spec_bench = tasks_in_turn(load_prompts("specbench", per_task=-(-end // 6)))

        def level_prompts(pair: int) -> list[list[dict]]:
            """The pair's slice of fresh Spec-Bench prompts, as chat messages (the same for every kind)."""
            first = args.first + pair * args.requests
            return [[{"role": "user", "content": p.text}] for p in spec_bench[first : first + args.requests]]

        def in_process_level(pair):
            """tok/s of the closed loop on the server's engine in this process, ending at end tokens as a server does."""
            from specdecode.encoding import eos_token_ids
            from specdecode.stopping import StopCondition
            inputs = [encode_prompt(tok, messages, chat=True) for messages in level_prompts(pair)]
            stop, running, done = StopCondition(eos_token_ids(engine.backend, tok), (), tok), [], []
            start = time.perf_counter()
            while inputs or running:
                while inputs and len(running) < args.concurrency:
                    running.append(engine.submit(inputs.pop(0), max_new_tokens=args.tokens, stop=stop))
                engine.step()
                done += [seq for seq in running if seq.finished]
                running = [seq for seq in running if not seq.finished]
            return sum(len(seq.result.token_ids) for seq in done) / (time.perf_counter() - start)

        def client_level(url, pair):
            """tok/s of the closed loop through a server (the load benchmark's client)."""
            import asyncio

            from specdecode.bench.load import run_level
            result = asyncio.run(run_level(url, None, level_prompts(pair), args.concurrency, args.requests, args.tokens,
                                           0.0, 900.0))
            return sum(r.completion_tokens for r in result.requests if r.ok) / result.wall_s

        every = {"not-streamed": not_streamed, "bytes": bytes_only, "openai": openai_client, "in-process": in_process,
                 "ours-client": lambda i: client_timed(base, i), "llama-server": lambda i: client_timed(llama_base, i)}
        if level:
            every = {"in-process": in_process_level, "ours-client": lambda i: client_level(base, i),
                     "llama-server": lambda i: client_level(llama_base, i)}
            if set(kind_names) - set(every):
                raise SystemExit(f"--concurrency runs only {', '.join(every)}")
        kinds = [(name, every[name]) for name in kind_names]
        by_kind: dict[str, list[float]] = {}
        logged = []  # every request to our server, in the order sent: its log's lines, in that order
        for pair in range(args.pairs):
            for name, send in kinds if pair % 2 else kinds[::-1]:
                ms = send(pair if level else pair + 3)  # prompts of its own every pair
                if name not in ("in-process", "llama-server") and not level:
                    logged.append(name if ms is None else f"{name} (server log)")
                if ms is not None:
                    by_kind.setdefault(name, []).append(ms)
    finally:
        for _, _, server in servers:
            server.terminate()
            server.wait()
    text = open(log.name).read()
    steps = [(float(total) - float(first)) / int(n) * 1e3
             for total, first, n in re.findall(r"new in ([0-9.]+) s \(first after ([0-9.]+) s, (\d+) steps", text)]
    for name, ms in zip(logged, steps):
        by_kind.setdefault(name, []).append(ms)
    load = re.search(r"scored: 1: ([0-9.]+)", text)
    print(f"one-token pass timed at load: {load.group(1) if load else '?'} ms")
    unit = f"tok/s at {args.concurrency} at a time" if level else "ms a step"
    for name, values in by_kind.items():
        print(f"{name:>14}: {statistics.median(values):.1f} {unit} (median; {' '.join(f'{v:.1f}' for v in values)})")
    first = next(iter(by_kind))
    for name, values in by_kind.items():
        if name != first and len(values) == len(by_kind[first]):
            ratios = sorted(v / w for v, w in zip(values, by_kind[first]))
            print(f"{name} / {first}, pair by pair: median {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")
    for url, seconds in ttft.items():
        print(f"first token from {url}: {statistics.median(seconds):.3f} s (median; {' '.join(f'{v:.2f}' for v in seconds)})")


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
