#!/usr/bin/env python3
"""A load level's closed loop replayed on a pass-cost curve: how llama-server schedules (every arrival read whole in
the next pass, beside the rows) against how our engine does (the shortest waiting prompt first, read beside the rows
in chunks of READ_PER_ROWS_PART x the rows' part of a step, 512 a step while 512+ wait; alone and whole on an idle
engine). Requests are a load.json's rounds (prompt and answer lengths, in the order they were sent where load.json
has send times, `sent_s`, else shuffled into several arrival orders); a pass of n tokens costs the curve at n (single
sequence, depth 0: llama-bench's pp/tg). Prints tok/s, the slowest request's latency and median TTFT by policy, round
by round. What the scheduling alone is worth at that level, apart from the machine's noise. `--hold F` adds session
37's rule to ours: an arrival is not opened while rows run and none is being read if every row would end (at its
token limit) within F x the arrival's reading time (a rule tried here, not in the engine). Not part of CI.

Usage: python scripts/level-sim.py LOAD_JSON [--concurrency 4] [--label llama-server] [--orders 30]
           [--hold F --max-new-tokens 64] [--pass-ms 1:34.4,4:74.7,16:188,32:321,64:592,128:1151,256:2372,512:4669,826:8019]
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics

SYSTEM_TOKENS = 24  # the chat template's system prompt: served from the prefix cache on both servers
UBATCH = 512
# specdecode.batch's chunk rule (kept here so the replay runs without torch)
READ_PER_ROWS_PART, DEFAULT_PREFILL_CHUNK, MAX_PREFILL_CHUNK = 8, 64, 512


def pass_seconds(curve: list[tuple[int, float]], n: int) -> float:
    """One decode of n tokens, split into ubatches of UBATCH as llama.cpp does; linear between the curve's points."""
    total, widths = 0.0, [w for w, _ in curve]
    while n > 0:
        m, n = min(n, UBATCH), n - UBATCH
        i = bisect.bisect_left(widths, m)
        if i == len(curve):
            total += curve[-1][1] * m / curve[-1][0]
        elif i == 0 or widths[i] == m:
            total += curve[i][1]
        else:
            (w0, t0), (w1, t1) = curve[i - 1], curve[i]
            total += t0 + (t1 - t0) * (m - w0) / (w1 - w0)
    return total / 1000


def simulate(requests: list[tuple[int, int]], policy: str, concurrency: int, curve, hold: float = 0.0,
             max_new_tokens: int = 64) -> tuple[float, float, float]:
    """(tok/s, slowest latency, median TTFT) of `requests` (prompt, answer tokens) sent `concurrency` at a time."""
    queue, now = list(range(len(requests))), 0.0
    arrival, first, done = {}, {}, {}
    waiting: list[int] = []
    rows: dict[int, int] = {}  # request -> tokens still to make
    reading: dict[int, int] = {}  # request -> prompt tokens still to read

    def send():
        if queue:
            i = queue.pop(0)
            arrival[i] = now
            waiting.append(i)

    def decode_rows():
        for i in list(rows):
            rows[i] -= 1
            if rows[i] == 0:
                del rows[i]
                done[i] = now
                send()

    def join(i):
        first[i] = now
        rows[i] = requests[i][1] - 1
        if rows[i] == 0:
            del rows[i]
            done[i] = now
            send()

    for _ in range(concurrency):
        send()
    prompt = {i: requests[i][0] - SYSTEM_TOKENS for i in range(len(requests))}
    read_s_per_token = curve[-1][1] / curve[-1][0] / 1000  # the curve's widest pass: a prompt read whole
    while len(done) < len(requests):
        if policy == "llama-server":
            new, waiting[:] = list(waiting), []
            now += pass_seconds(curve, len(rows) + sum(prompt[i] for i in new))
            decode_rows()
            for i in new:
                join(i)
        elif not rows and not reading:
            i = min(waiting, key=prompt.get)
            waiting.remove(i)
            now += pass_seconds(curve, prompt[i])
            join(i)
        else:
            to_read = sum(reading.values()) + sum(prompt[i] for i in waiting)
            rows_part = pass_seconds(curve, len(rows)) if rows else 0.0
            wanted = READ_PER_ROWS_PART * rows_part / read_s_per_token
            budget = (MAX_PREFILL_CHUNK if to_read >= MAX_PREFILL_CHUNK
                      else int(min(MAX_PREFILL_CHUNK, max(DEFAULT_PREFILL_CHUNK, wanted))))
            reads = []
            for i in sorted(waiting, key=prompt.get):
                if hold and rows and not reading:
                    may_make = max(max_new_tokens - (requests[j][1] - rows[j]) for j in rows)  # the engine knows no more
                    if may_make * pass_seconds(curve, len(rows)) <= hold * prompt[i] * read_s_per_token:
                        continue
                if len(rows) + len(reading) < concurrency:
                    waiting.remove(i)
                    reading[i] = prompt[i]
            for i in list(reading):
                if budget <= 0:
                    break
                take = min(budget, reading[i])
                reads.append((i, take))
                budget -= take
            now += pass_seconds(curve, len(rows) + sum(take for _, take in reads))
            decode_rows()
            for i, take in reads:
                reading[i] -= take
                if reading[i] == 0:
                    del reading[i]
                    join(i)
    tokens = sum(answer for _, answer in requests)
    return tokens / now, max(done[i] - arrival[i] for i in done), statistics.median(first[i] - arrival[i] for i in first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("load_json")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--label", default="llama-server", help="whose rows' requests to replay (all servers got the same)")
    ap.add_argument("--orders", type=int, default=30)
    ap.add_argument("--hold", type=float, default=0.0, help="session 37's hold rule for ours, at this factor (0: off)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="the load's token limit (what --hold bounds rows by)")
    ap.add_argument("--pass-ms", default="1:34.4,4:74.7,16:188,32:321,64:592,128:1151,256:2372,512:4669,826:8019")
    args = ap.parse_args()
    curve = sorted((int(w), float(ms)) for w, ms in (p.split(":") for p in args.pass_ms.split(",")))
    for row in json.load(open(args.load_json))["rows"]:
        if row["label"] != args.label or row["concurrency"] != args.concurrency:
            continue
        per_round = len(row["raw"]) // row["rounds"]
        for r in range(row["rounds"]):
            sent = row["raw"][r * per_round : (r + 1) * per_round]
            requests = [(x["prompt_tokens"], x["completion_tokens"]) for x in sent]
            if all("sent_s" in x for x in sent):  # the queue's order is the order sent
                orders = [[requests[i] for i in sorted(range(len(sent)), key=lambda i: sent[i]["sent_s"])]]
            else:
                orders = [random.Random(seed).sample(requests, len(requests)) for seed in range(args.orders)]
            line = []
            for policy in ("llama-server", "ours"):
                runs = [simulate(order, policy, args.concurrency, curve, args.hold, args.max_new_tokens) for order in orders]
                line.append(f"{policy}: {statistics.median(x[0] for x in runs):.2f} tok/s, slowest "
                            f"{statistics.median(x[1] for x in runs):.1f} s, TTFT p50 {statistics.median(x[2] for x in runs):.1f} s")
            print(f"round {r + 1}: " + "; ".join(line))


if __name__ == "__main__":
    main()
