#!/usr/bin/env python3
"""How fast could suffix drafts decode these answers on this pass table? Replays the target's own greedy answers (a
`specdecode bench` results.json with a `plain` method) teacher-forced through the suffix drafter, and prices each
pass by width from a pass table (ms, `scripts/llama-pass-costs.py`'s "every position" column):

  - plain:   one pass of width 1 a token;
  - oracle:  each step's draft cut to the length that, knowing what will be accepted, decodes the answer in the
             least time (dynamic programming over the answer's positions): the best any trim of these drafts can do;
  - cut:     each draft cut to what it will accept (what a perfect stopping rule per step would give);
  - whole:   every draft verified whole (llama.cpp's ngram-mod does so);
  - ours:    the adaptive controller (AdaptiveK.trim) cutting each draft, learning as it goes (one controller
             over the prompts in order, as one engine serves them).

Variants of the drafter (its cap of the draft at the match length, its probability floor, the longest draft) say
what the drafter leaves on the table; the gap between oracle and a measured run says what the controller does.
`--cross-request` keeps one suffix cache over the prompts in order, as a server does (agent traffic: each request
drafts from the earlier answers too); `--depth` sets the trees' depth (a match of m tokens continues at most depth - m);
`--alternatives` the runner-ups the drafter's tree holds (the product's 2: its chain is cut from that tree; 0: a path);
`--no-chains` turns off the drafter's long exact chains (llama-server's `ngram-mod` rule: a 24-token context chaining
48-64 tokens, source `suffix/chain`); `--belief-ms` seeds the controller with another table than the one passes cost;
`--loss STAKE:SHARE` sets the controller's loss limit; `--offers FILE` writes every lookup draft our controller was
offered (JSON lines: its source, match class, the class's first-token rate then, the length verified, and how many of
its leading tokens the answer has): how well the rates it bets on predict. Last, our controller on whole requests (the
prompt read at what a position costs at the table's wide end, ~100 tokens a second on the EPYC curve): what a bench's
per-prompt ratio sees, and the mean of those ratios (a bench's "vs plain mean") for the oracle and ours.

    .venv/bin/python scripts/suffix-oracle.py docs/bench/llama-edits-epyc-s20/results.json --prompts edits \
        --pass-ms 1:35,2:63,4:110,8:250,12:320,16:305,20:415,24:454,32:540,48:790,64:860 --variants 1:0.1:63,4:0.1:63
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch

from specdecode.control import AdaptiveK, priors
from specdecode.control.calibrate import WIDEST, observe_calibration_pass, too_wide, widths
from specdecode.control.measurements import match_class
from specdecode.control.step import RowOutcome, StepOutcome, StepPlan
from specdecode.drafters import suffix
from specdecode.drafters.base import Draft
from specdecode.encoding import encode_prompt
from specdecode.models import load_tokenizer
from specdecode.prompts import load_prompts


def pass_table(spec: str, widest: int) -> np.ndarray:
    """'w:ms,...' -> ms by width 0..widest, linear between the points given (flat past the last)."""
    points = sorted((int(w), float(ms)) for w, ms in (p.split(":") for p in spec.split(",")))
    widths, ms = zip(*points)
    return np.interp(np.arange(widest + 1), widths, ms)


def drafts_along(prompt: list[int], answer: list[int], k: int, factor: float, floor: float,
                 cache=None, chains=None, max_new_tokens: int | None = None, alternatives: int = 0,
                 ends: frozenset[int] = frozenset()) -> list[Draft]:
    """The suffix drafter's draft (its chain: tokens, source, match length, the draft it may be swapped for) at each
    position of the answer, the answer so far committed, none past max_new_tokens (as the engine's draft budget) or
    past a token of `ends`; `cache` / `chains`: a suffix cache and context chains holding earlier answers (a server's,
    kept across requests), else fresh ones."""
    suffix.MAX_SPEC_FACTOR = factor  # the drafter reads its cap from the module (a constant in the product)
    drafter = suffix.SuffixDrafter(cache if cache is not None else suffix.shared_cache(), alternatives=alternatives,
                                   min_token_prob=floor, chains=chains)
    ids = torch.tensor([prompt + answer])
    drafter.begin(ids[:, : len(prompt)])
    budget = max_new_tokens or 1 << 30
    out = []
    for t in range(len(answer)):
        draft = drafter.propose(ids[:, : len(prompt) + t], k, None, None)
        draft.truncate(budget - t - 1)
        draft.end_at(ends)
        draft.drop_leaves()
        out.append(draft)
    drafter.reset()
    return out


def accepted(draft: list[int], rest: list[int]) -> int:
    n = 0
    while n < len(draft) and n < len(rest) and draft[n] == rest[n]:
        n += 1
    return n


def oracle_ms(answer: list[int], drafts: list[Draft], cost: np.ndarray) -> float:
    """Least time to decode the answer when each step's draft may be cut anywhere (knowing the verdicts)."""
    T = len(answer)
    best = np.full(T + 1, np.inf)
    best[T] = 0.0
    for t in range(T - 1, -1, -1):
        draft = drafts[t].tokens[0].tolist()
        acc = accepted(draft, answer[t:])
        for length in range(len(draft) + 1):
            step = min(length, acc) + 1
            best[t] = min(best[t], cost[1 + length] + best[min(T, t + step)])
    return float(best[0])


def cut_ms(answer: list[int], drafts: list[Draft], cost: np.ndarray, rule) -> float:
    t, ms = 0, 0.0
    while t < len(answer):
        draft = drafts[t].tokens[0].tolist()
        acc = accepted(draft, answer[t:])
        length = rule(draft, acc)
        ms += cost[1 + length]
        t += min(length, acc) + 1
    return ms


def seeded_controller(cost: np.ndarray, widest: int, tokenizer=None) -> AdaptiveK:
    """AdaptiveK seeded with the pass table as `calibrate` would time it (given the tokenizer, as the engine's)."""
    ctl = AdaptiveK()
    if tokenizer is not None:
        ctl.read_vocabulary(tokenizer)
    passes: dict[int, float] = {}
    for width in widths(widest):
        if too_wide(passes, width):
            break
        passes[width] = cost[min(width, len(cost) - 1)] / 1e3
        observe_calibration_pass(ctl, width, passes[width])
    ctl.rows_changed()
    return ctl


def controller_ms(prompt: list[int], answer: list[int], drafts: list[Draft], cost: np.ndarray, ctl: AdaptiveK,
                  row: int, offers: list | None = None) -> float:
    """Our controller trimming each draft as the engine's `fit` does and learning from each step's outcome and, as
    the tokens come, from each whole draft in hindsight (one controller for every prompt, as one engine serves
    them); `offers` collects each lookup draft offered, with the class's first-token rate it was priced at."""
    ctl.observe(StepOutcome((row,), 1, None, []))  # the row joins
    seq = SimpleNamespace(serial=row, ids=torch.tensor([prompt]), prompt=torch.tensor([prompt]), finished=False,
                          generated=0, stats=SimpleNamespace(cached_prompt_tokens=0))
    t, ms = 0, 0.0
    while t < len(answer):
        seq.ids, seq.generated = torch.tensor([prompt + answer[:t]]), t
        ctl.judge_in_hindsight()
        offered = drafts[t]
        step = [replace(offered, instead=offered.instead and replace(offered.instead))]  # fit cuts and swaps in place
        logged = offers is not None and offered.length
        rate = ctl.measured.lookup_rates(offered.source, offered.match_len)[0].value if logged else None  # as fit reads it
        ctl.fit([seq], StepPlan([]), step)
        draft = step[0]
        if logged:
            offers.append(dict(row=row, position=t, source=offered.source, match_class=match_class(offered.match_len),
                               first_rate=round(rate, 4), offered=offered.length, verified=draft.length,
                               right=accepted(offered.tokens[0].tolist(), answer[t:])))
        acc = accepted(draft.tokens[0].tolist(), answer[t:])
        ms += cost[1 + draft.length]
        ctl.observe(StepOutcome((row,), 1 + draft.length, cost[1 + draft.length] / 1e3, [RowOutcome(
            draft.source, None, draft.length, acc, 0.0, draft.match_len, positions=1 + draft.length)]))
        t += acc + 1
    seq.ids, seq.finished = torch.tensor([prompt + answer]), True
    ctl.judge_in_hindsight()
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a bench results.json holding the plain method's token ids")
    parser.add_argument("--prompts", default="edits")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--pass-ms", required=True, help="width:ms,... (every-position pass costs)")
    parser.add_argument("--belief-ms", default=None,
                        help="width:ms,... the controller's calibration reads (default: --pass-ms); it learns the "
                             "passes it runs at --pass-ms prices, as a server whose load minute was off does")
    parser.add_argument("--variants", default="1:0.1:63,4:0.1:63,64:0.1:63,64:0.0:63",
                        help="factor:floor:longest,... of the suffix drafter")
    parser.add_argument("--cross-request", action="store_true",
                        help="one suffix cache over the prompts in order, as a server keeps (agent traffic)")
    parser.add_argument("--depth", type=int, default=suffix.MAX_TREE_DEPTH, help="the suffix trees' depth")
    parser.add_argument("--alternatives", type=int, default=2, help="runner-ups in the drafter's tree (the product's: 2)")
    parser.add_argument("--no-chains", action="store_true", help="the drafter without its long exact chains")
    parser.add_argument("--no-sentences", action="store_true",
                        help="the controller without the vocabulary (no rate of its own after a sentence's end)")
    parser.add_argument("--loss", default=None, metavar="STAKE:SHARE",
                        help="the controller's loss limit (priors.LOSS_STAKE, LOSS_SHARE) instead of the product's")
    parser.add_argument("--offers", default=None, metavar="FILE",
                        help="write every lookup draft offered to our controller (the first variant's), JSON lines")
    args = parser.parse_args()
    if args.loss:
        priors.LOSS_STAKE, priors.LOSS_SHARE = map(float, args.loss.split(":"))
    suffix.MAX_TREE_DEPTH = args.depth
    results = json.load(open(args.results))
    rows = {r["prompt_id"]: r for r in results["rows"] if r["method"] == "plain"}
    max_new_tokens = results.get("config", {}).get("max_new_tokens")
    tokenizer = load_tokenizer(args.target)
    ends = frozenset(i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if i is not None)
    prompts = [p for p in load_prompts(args.prompts) if p.id in rows]
    variants = [(float(f), float(p), int(k)) for f, p, k in (v.split(":") for v in args.variants.split(","))]
    cost = pass_table(args.pass_ms, max(max(k for *_, k in variants) + 1, 65))
    print(f"{'prompt':<18} {'tokens':>6} {'plain s':>8}" + "".join(f" {'x' + str(f) + ' p' + str(p) + ' k' + str(k):>23}" for f, p, k in variants))
    totals = np.zeros((len(variants), 4))
    worst = [np.inf] * len(variants)
    plain_total = 0.0
    # whole requests: the prompt read at what a position costs at the table's wide end (as the controller prices it)
    read_ms = (cost[64] - cost[32]) / 32
    whole, worst_whole, plain_whole = np.zeros(len(variants)), [np.inf] * len(variants), 0.0
    by_prompt = [([], []) for _ in variants]  # whole requests, each prompt's speedup: (oracle, ours), as a bench's mean
    belief = pass_table(args.belief_ms, len(cost) - 1) if args.belief_ms else cost
    controllers = [seeded_controller(belief, max(WIDEST, k + 1), None if args.no_sentences else tokenizer)
                   for *_, k in variants]
    fresh_chains = lambda: suffix.ContextChains(capacity=0 if args.no_chains else suffix.CHAIN_CONTEXTS)  # noqa: E731
    caches = [(suffix.shared_cache(), fresh_chains()) if args.cross_request else (None, None) for _ in variants]
    offers: list[dict] = []
    for row, prompt in enumerate(prompts):
        ids = encode_prompt(tokenizer, prompt.text, chat=True)[0].tolist()
        answer = json.loads(rows[prompt.id]["token_ids"]) if isinstance(rows[prompt.id]["token_ids"], str) else rows[prompt.id]["token_ids"]
        plain = cost[1] * len(answer)
        plain_total += plain
        reading = read_ms * len(ids)
        plain_whole += reading + plain
        cells = []
        for i, (factor, floor, k) in enumerate(variants):
            cache, chains = caches[i]
            drafts = drafts_along(ids, answer, k, factor, floor, cache, chains if chains is not None else fresh_chains(),
                                  max_new_tokens, args.alternatives, ends)
            oracle = oracle_ms(answer, drafts, cost)
            cut = cut_ms(answer, drafts, cost, lambda d, acc: acc)
            full = cut_ms(answer, drafts, cost, lambda d, acc: len(d))
            ours = controller_ms(ids, answer, drafts, cost, controllers[i], row, offers if i == 0 else None)
            totals[i] += (oracle, cut, full, ours)
            worst[i] = min(worst[i], plain / ours)
            whole[i] += reading + ours
            worst_whole[i] = min(worst_whole[i], (reading + plain) / (reading + ours))
            by_prompt[i][0].append((reading + plain) / (reading + oracle))
            by_prompt[i][1].append((reading + plain) / (reading + ours))
            cells.append(f"{plain / oracle:>6.2f} {plain / cut:>5.2f} {plain / full:>5.2f} {plain / ours:>5.2f}")
        print(f"{prompt.id:<18} {len(answer):>6} {plain / 1e3:>8.2f}" + "".join(f" {c:>23}" for c in cells))
    print(f"{'worst prompt':<18} {'':>6} {'':>8}" + "".join(f" {'':>20} {w:>5.2f}" for w in worst))
    print(f"{'all (time)':<18} {'':>6} {plain_total / 1e3:>8.2f}" + "".join(
        f" {plain_total / o:>6.2f} {plain_total / c:>5.2f} {plain_total / f:>5.2f} {plain_total / u:>5.2f}" for o, c, f, u in totals))
    print(f"{'ours, whole requests (all / worst prompt)':<33}" + "".join(
        f" {'':>13} {plain_whole / w:>5.2f} / {ww:>4.2f}" for w, ww in zip(whole, worst_whole)))
    print(f"{'whole requests, mean of prompts':<33}" + "".join(
        f" {'oracle':>6} {np.mean(o):>5.2f} ours {np.mean(u):>5.2f}" for o, u in by_prompt))
    print("columns: decode speedup over plain: oracle cut / cut at what is accepted / whole drafts / our controller "
          f"(prompt reading not included); whole requests: the prompt read at {read_ms:.1f} ms a token")
    if args.offers:
        with open(args.offers, "w") as out:
            out.writelines(json.dumps(offer) + "\n" for offer in offers)


if __name__ == "__main__":
    main()
