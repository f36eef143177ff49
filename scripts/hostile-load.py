#!/usr/bin/env python3
"""Careless clients against a real `specdecode serve` on loopback (a benchmark-style check, not CI):

1. 64 concurrent clients, streaming and not; half of them hang up at a random point. Every client that stays
   must get its whole answer (0 lost), equal to the same request sent alone (greedy; a different answer that is
   another prompt's is "mixed up"), and every row must be free afterwards.
2. Server RSS before and after 1,000 short requests, after ten 5 MB bodies (refused before tokenizing), and
   after ten 1.2 MB ones (tokenized, then refused: past the context window).

    scripts/hostile-load.py [--target smollm2-135m] [--draft ngram] [--threads 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time

import httpx
import psutil

PROMPTS = [f"Count from {i} to {i + 40}, separated by commas:" for i in range(1, 9)] + [
    "List the planets of the solar system, one per line:",
    "Write a Python function that reverses a string.",
    "The capital cities of Europe are",
    "def fibonacci(n):",
    "Translate to French: The cat sits on the mat.",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Explain what a hash table is in two sentences.",
    "Here is a haiku about the sea:",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, stream: bool, hang_up_after: float | None):
    """-> (text, finish_reason) or None when this client hung up on purpose."""
    async def run():
        if not stream:
            response = await client.post(url, json=body(prompt, max_tokens, False))
            response.raise_for_status()
            choice = response.json()["choices"][0]
            return choice["text"], choice["finish_reason"]
        text, finish = [], None
        async with client.stream("POST", url, json=body(prompt, max_tokens, True)) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
        return "".join(text), finish

    if hang_up_after is None:
        return await run()
    try:
        await asyncio.wait_for(run(), timeout=hang_up_after)  # the connection is closed when the task is cancelled
    except asyncio.TimeoutError:
        pass
    return None


async def load_phase(base: str, clients: int, expected: dict, rng: random.Random) -> dict:
    url = base + "/v1/completions"
    jobs = []
    for i in range(clients):
        prompt, max_tokens = rng.choice(list(expected))
        hang_up = rng.uniform(0.2, 6.0) if i % 2 else None
        jobs.append((prompt, max_tokens, rng.random() < 0.5, hang_up))
    limits = httpx.Limits(max_connections=clients + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, url, *job) for job in jobs), return_exceptions=True)
        seconds = time.perf_counter() - start
    stayed = [(job, r) for job, r in zip(jobs, results) if job[3] is None]
    lost = [r for _, r in stayed if isinstance(r, BaseException) or r is None or r[1] is None]
    answers = {text for text, _ in expected.values()}
    differ = [(job, r) for job, r in stayed if not isinstance(r, BaseException) and r and r[0] != expected[job[:2]][0]]
    mixed = [d for d in differ if d[1][0] in answers]
    return {"clients": clients, "stayed": len(stayed), "hung_up": clients - len(stayed), "seconds": round(seconds, 1),
            "lost": len(lost), "mixed_up": len(mixed), "differ_from_solo": len(differ),
            "errors": [repr(r)[:200] for r in results if isinstance(r, BaseException)][:5]}


def rss_mb(process: psutil.Process) -> float:
    return round(sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) / 2**20, 1)


async def many_requests(base: str, count: int, concurrency: int = 8) -> int:
    ok = 0
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:
        async def send(i):
            nonlocal ok
            async with semaphore:
                stream = i % 3 == 0
                r = await client.post(base + "/v1/completions", json=body(PROMPTS[i % len(PROMPTS)], 8, stream))
                ok += r.status_code == 200
        await asyncio.gather(*(send(i) for i in range(count)))
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "serve", "--target", args.target, "--draft", args.draft,
                               "--dtype", args.dtype, "--threads", str(args.threads), "--port", str(port), "--log-level", "warning"])
    report: dict = {"target": args.target, "draft": args.draft, "dtype": args.dtype}
    try:
        deadline = time.time() + 600
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("the server did not come up")
            time.sleep(0.5)
        process = psutil.Process(server.pid)
        # what each request gives alone
        expected = {}
        for prompt in PROMPTS:
            max_tokens = rng.choice([24, 48, 96])
            r = httpx.post(base + "/v1/completions", json=body(prompt, max_tokens, False), timeout=300).json()["choices"][0]
            expected[(prompt, max_tokens)] = (r["text"], r["finish_reason"])
        print(f"[hostile-load] {len(expected)} solo answers recorded", file=sys.stderr)
        report["load"] = asyncio.run(load_phase(base, args.clients, expected, rng))
        start = time.time()
        while (health := httpx.get(base + "/health").json())["running"] or health["waiting"]:
            if time.time() - start > 60:
                break
            time.sleep(0.1)
        report["load"]["rows_busy_after"] = health["running"] + health["waiting"]
        report["load"]["seconds_until_all_rows_free"] = round(time.time() - start, 2)
        print(f"[hostile-load] load: {report['load']}", file=sys.stderr)

        report["rss_mb_before_1000"] = rss_mb(process)
        report["ok_of_1000"] = asyncio.run(many_requests(base, 1000))
        report["rss_mb_after_1000"] = rss_mb(process)
        big = json.dumps(body("hello " * (5_000_000 // 6), 4, False)).encode()
        codes = []
        for _ in range(10):
            codes.append(httpx.post(base + "/v1/completions", content=big, headers={"content-type": "application/json"},
                                    timeout=300).status_code)
        report["five_mb_bodies_status"] = codes
        report["rss_mb_after_ten_5mb_bodies"] = rss_mb(process)
        # bodies under the character bound: tokenized, then refused for the context window
        tokenized = json.dumps(body("hello " * 200_000, 4, False)).encode()
        report["tokenized_1mb_bodies_status"] = [
            httpx.post(base + "/v1/completions", content=tokenized, headers={"content-type": "application/json"},
                       timeout=300).status_code for _ in range(10)]
        report["rss_mb_after_ten_tokenized_1mb_bodies"] = rss_mb(process)
        metrics = httpx.get(base + "/metrics").text
        report["metrics"] = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
                             if line.startswith(("specdecode_requests_total", "specdecode_finished_requests_total"))}
        report["health_after"] = httpx.get(base + "/health").json()
    finally:
        server.terminate()
        server.wait(30)
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    load = report["load"]
    return 0 if load["lost"] == 0 and load["mixed_up"] == 0 and load["rows_busy_after"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
