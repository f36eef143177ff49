#!/usr/bin/env python3
"""What a server step costs by how answers leave it: one `specdecode serve` (no drafter by default), the same requests
alternating not streamed, streamed to a client that only reads bytes, and streamed through the `openai` client; each
request's ms a step from the server's own log (decode time after the first token / steps). If streaming or the client
cost the server's steps, the three columns part. Not part of CI.

Usage: .venv/bin/python scripts/serve-stream-probe.py [--draft none] [--pairs 8] [--tokens 96] [--port 8398]
"""

from __future__ import annotations

import argparse
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
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    server = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "serve", "--target", "qwen2.5-coder-1.5b",
                               "--draft", args.draft, "--backend", "llama.cpp", "--threads", str(args.threads),
                               "--port", str(args.port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        while not _healthy(base):
            if server.poll() is not None:
                raise SystemExit(f"the server did not start: {open(log.name).read()[-2000:]}")
            time.sleep(1)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")

        def body(i: int, stream: bool) -> dict:
            return dict(model="qwen2.5-coder-1.5b", max_tokens=args.tokens, temperature=0, stream=stream,
                        messages=[{"role": "user", "content": f"Tell me a long story about a {i}-legged robot."}])

        def not_streamed(i):
            httpx.post(base + "/v1/chat/completions", json=body(i, False), timeout=300)

        def bytes_only(i):
            with httpx.stream("POST", base + "/v1/chat/completions", json=body(i, True), timeout=300) as response:
                for _ in response.iter_bytes():
                    pass

        def openai_client(i):
            for _ in client.chat.completions.create(**body(i, True)):
                pass

        kinds = [("not streamed", not_streamed), ("bytes only", bytes_only), ("openai client", openai_client)]
        order = []
        for pair in range(args.pairs):
            for name, send in kinds if pair % 2 else kinds[::-1]:
                send(len(order) + 3)
                order.append(name)
    finally:
        server.terminate()
        server.wait()
    text = open(log.name).read()
    steps = [(float(total) - float(first)) / int(n) * 1e3
             for total, first, n in re.findall(r"new in ([0-9.]+) s \(first after ([0-9.]+) s, (\d+) steps", text)]
    by_kind: dict[str, list[float]] = {}
    for name, ms in zip(order, steps):
        by_kind.setdefault(name, []).append(ms)
    load = re.search(r"scored: 1: ([0-9.]+)", text)
    print(f"one-token pass timed at load: {load.group(1) if load else '?'} ms")
    for name, values in by_kind.items():
        print(f"{name:>14}: {statistics.median(values):.1f} ms a step (median; {' '.join(f'{v:.1f}' for v in values)})")


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
