#!/usr/bin/env python3
"""A load level's closed loop replayed on a pass-cost curve: how llama-server schedules (every arrival read whole in
the next pass, beside the rows) against how our engine does (the shortest waiting prompt first, read beside the rows
in chunks of READ_PER_ROWS_PART x the rows' part of a step, 512 a step while 512+ wait; alone and whole on an idle
engine; the arrival-wait rule of `--rule`). Requests are a load.json's rounds: fresh traffic (prompt and answer
lengths, in the order they were sent where load.json has send times, `sent_s`, else shuffled into several arrival
orders) or conversations (`--traffic chat`: each turn sent when the one before it ends, reading what its history's
cache does not hold; conversations are rebuilt from turn numbers and cached tokens). A pass of n tokens costs the
curve at n (single sequence, depth 0: llama-bench's pp/tg). Prints tok/s, the slowest request's latency and median
TTFT by policy, round by round, then ours against llama-server's over every round and order. What the scheduling
alone is worth at that level, apart from the machine's noise. Not part of CI.

Rules for ours (an arrival not opened while rows run and none is being read; S = its reading time):
  ending-row-first  the engine's (batch.BatchEngine._an_ending_row_goes_first): while some row ends, at its token
                    limit, within S and was sent S or more before any waiting request
  all-rows-end      session 37's, reverted: while every row ends within S
  none              read at once (sessions 18-39)

Usage: python scripts/level-sim.py LOAD_JSON [--concurrency 4] [--label llama-server] [--orders 30]
           [--rule ending-row-first] [--max-new-tokens 64]
           [--pass-ms 1:34.4,4:74.7,16:188,32:321,64:592,128:1151,256:2372,512:4669,826:8019]
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
RULES = ("ending-row-first", "all-rows-end", "none")


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


def simulate(chains: list[list[tuple[int, int, int]]], policy: str, concurrency: int, curve, rule: str = "none",
             max_new_tokens: int = 64) -> tuple[float, float, float]:
    """(tok/s, slowest latency, median TTFT) of `chains` of requests (tokens to read, whole prompt, answer tokens; a
    chain's next request is sent when the one before it ends), `concurrency` chains at a time."""
    requests = [r for chain in chains for r in chain]
    heads, follower, n = [], {}, 0
    for chain in chains:
        heads.append(n)
        follower.update((n + k, n + k + 1) for k in range(len(chain) - 1))
        n += len(chain)
    queue, now = heads, 0.0
    arrival, first, done = {}, {}, {}
    waiting: list[int] = []
    rows: dict[int, int] = {}  # request -> tokens still to make
    reading: dict[int, int] = {}  # request -> prompt tokens still to read
    prompt = {i: r[0] for i, r in enumerate(requests)}

    def send(after: int | None = None):
        if after in follower:
            i = follower[after]
        elif queue:
            i = queue.pop(0)
        else:
            return
        arrival[i] = now
        waiting.append(i)

    def end(i):
        done[i] = now
        send(i)

    def decode_rows():
        for i in list(rows):
            rows[i] -= 1
            if rows[i] == 0:
                del rows[i]
                end(i)

    def join(i):
        first[i] = now
        rows[i] = requests[i][2] - 1
        if rows[i] == 0:
            del rows[i]
            end(i)

    def held(i) -> bool:
        if rule == "none" or not rows or reading:
            return False
        stall, step = prompt[i] * read_s_per_token, pass_seconds(curve, len(rows))
        ends_in = {j: (max_new_tokens - (requests[j][2] - rows[j])) * step for j in rows}  # the engine knows no more
        if rule == "all-rows-end":
            return max(ends_in.values()) <= stall
        first_sent = min(arrival[j] for j in waiting)
        return any(ends_in[j] <= stall and first_sent - arrival[j] >= stall for j in rows)

    for _ in range(concurrency):
        send()
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
            to_read = sum(requests[i][1] for i in list(reading) + waiting)  # counted whole, as the engine does
            rows_part = pass_seconds(curve, len(rows)) if rows else 0.0
            wanted = READ_PER_ROWS_PART * rows_part / read_s_per_token
            budget = (MAX_PREFILL_CHUNK if to_read >= MAX_PREFILL_CHUNK
                      else int(min(MAX_PREFILL_CHUNK, max(DEFAULT_PREFILL_CHUNK, wanted))))
            shortest = sorted(waiting, key=prompt.get)
            if shortest and not held(shortest[0]):
                for i in shortest[: concurrency - len(rows) - len(reading)]:
                    waiting.remove(i)
                    reading[i] = prompt[i]
            reads = []
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
    tokens = sum(r[2] for r in requests)
    return tokens / now, max(done[i] - arrival[i] for i in done), statistics.median(first[i] - arrival[i] for i in first)


def conversations(sent: list[dict]) -> list[list[dict]]:
    """A chat round's requests as conversations: each turn follows the earlier turn whose prompt and answer its cached
    tokens match best (the prefix cache holds the history the turn re-sends)."""
    chains = [[x] for x in sent if x["turn"] == 0]
    for turn in sorted({x["turn"] for x in sent} - {0}):
        for x in (x for x in sent if x["turn"] == turn):
            chain = min((c for c in chains if len(c) == turn),
                        key=lambda c: abs(x["cached_tokens"] - c[-1]["prompt_tokens"] - c[-1]["completion_tokens"]))
            chain.append(x)
    return chains


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("load_json")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--label", default="llama-server", help="whose rows' requests to replay (all servers got the same)")
    ap.add_argument("--orders", type=int, default=30)
    ap.add_argument("--rule", choices=RULES, default=RULES[0], help="when an arrival waits for rows to end (ours)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="the load's token limit (what the rules bound rows by)")
    ap.add_argument("--pass-ms", default="1:34.4,4:74.7,16:188,32:321,64:592,128:1151,256:2372,512:4669,826:8019")
    args = ap.parse_args()
    curve = sorted((int(w), float(ms)) for w, ms in (p.split(":") for p in args.pass_ms.split(",")))
    ratios = []  # (tok/s, slowest) ours / llama-server, every round and order
    for row in json.load(open(args.load_json))["rows"]:
        if row["label"] != args.label or row["concurrency"] != args.concurrency:
            continue
        per_round = len(row["raw"]) // row["rounds"]
        for r in range(row["rounds"]):
            sent = row["raw"][r * per_round : (r + 1) * per_round]
            if any(x.get("turn") for x in sent):  # conversations run side by side: their order does not matter
                orders = [conversations(sent)]
            elif all("sent_s" in x for x in sent):  # the queue's order is the order sent
                orders = [[[x] for x in sorted(sent, key=lambda x: x["sent_s"])]]
            else:
                orders = [random.Random(seed).sample([[x] for x in sent], len(sent)) for seed in range(args.orders)]
            orders = [[[(x["prompt_tokens"] - max(x.get("cached_tokens", 0), SYSTEM_TOKENS), x["prompt_tokens"],
                         x["completion_tokens"]) for x in chain] for chain in order] for order in orders]
            runs = {policy: [simulate(order, policy, args.concurrency, curve, args.rule, args.max_new_tokens)
                             for order in orders] for policy in ("llama-server", "ours")}
            ratios += [(o[0] / l[0], o[1] / l[1]) for l, o in zip(runs["llama-server"], runs["ours"])]
            print(f"round {r + 1}: " + "; ".join(
                f"{policy}: {statistics.median(x[0] for x in rs):.2f} tok/s, slowest "
                f"{statistics.median(x[1] for x in rs):.1f} s, TTFT p50 {statistics.median(x[2] for x in rs):.1f} s"
                for policy, rs in runs.items()))
    if ratios:
        slowest = sorted(s for _, s in ratios)
        print(f"ours / llama-server over {len(ratios)} replays: tok/s median {statistics.median(t for t, _ in ratios):.3f}; "
              f"slowest request median {statistics.median(slowest):.3f}, p90 {slowest[int(0.9 * (len(slowest) - 1))]:.3f}, "
              f"max {slowest[-1]:.3f}")


if __name__ == "__main__":
    main()
