"""Lookup drafts judged in hindsight against the tokens their row commits (control/hindsight.py), and what the
controller learns from the verdicts."""

from types import SimpleNamespace

import torch

from specdecode.control import AdaptiveK
from specdecode.control.hindsight import Hindsight, Verdict

from replay import epyc_controller


def row(tokens, serial=0):
    return SimpleNamespace(serial=serial, ids=torch.tensor([tokens]), finished=False, generated=0)


def test_a_draft_is_judged_when_a_committed_token_differs():
    seq, hindsight = row([1, 2, 3]), Hindsight()
    hindsight.offer(seq, [4, 5, 6, 7], "suffix", 2, verified=0)
    seq.ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert hindsight.judge() == []  # right so far: waits for more
    seq.ids = torch.tensor([[1, 2, 3, 4, 5, 9, 7]])
    assert hindsight.judge() == [Verdict("suffix", 2, 0, 3, 2)]  # the third position was wrong
    assert hindsight.judge() == [] and not hindsight.pending


def test_a_draft_right_to_its_end_and_one_cut_short_by_the_row_finishing():
    seq, hindsight = row([1]), Hindsight()
    hindsight.offer(seq, [2, 3], "suffix/chain", 24, verified=1)
    seq.ids = torch.tensor([[1, 2]])
    hindsight.offer(seq, [3, 4, 5], "suffix", 1, verified=0)
    assert hindsight.judge() == []
    seq.ids = torch.tensor([[1, 2, 3, 4]])
    assert hindsight.judge() == [Verdict("suffix/chain", 24, 1, 2, 2)]
    seq.finished = True
    assert hindsight.judge() == [Verdict("suffix", 1, 0, 2, 2)]  # the two positions the answer reached


def test_rows_are_judged_apart_and_an_empty_draft_is_not_kept():
    a, b, hindsight = row([1, 2], serial=1), row([7, 8], serial=2), Hindsight()
    hindsight.offer(a, [3], "suffix", 1, verified=0)
    hindsight.offer(b, [3], "suffix", 1, verified=0)
    hindsight.offer(b, [], "suffix", 1, verified=0)
    a.ids, b.ids = torch.tensor([[1, 2, 3]]), torch.tensor([[7, 8, 4]])
    assert sorted(v.right for v in hindsight.judge()) == [0, 1]


def test_a_verdict_teaches_what_verification_did_not_see():
    """An unverified draft counts whole; a verified one all accepted adds its later positions; a verified one with a
    rejection adds nothing (its step said it all)."""
    ctl = AdaptiveK()
    first, later = ctl.measured.lookup_rates("suffix", 2)
    f0, l0 = first.value, later.value
    ctl.measured.observe_hindsight(Verdict("suffix", 2, 2, 3, 1))  # verified 2, rejected at the second: nothing new
    assert (first.value, later.value) == (f0, l0)
    ctl.measured.observe_hindsight(Verdict("suffix", 2, 1, 20, 20))  # verified 1, then 19 more right
    assert first.value == f0 and later.value > l0
    ctl.measured.observe_hindsight(Verdict("suffix", 2, 0, 1, 0))  # never verified, first token wrong
    assert first.value < f0


def test_the_engine_judges_lookups_it_never_verified(target):
    """Through the batched engine: where the cost curve keeps every lookup unverified at its prior (a 2-wide pass costs
    1.8 plain ones), the lookups offered on a repeating prompt are judged in hindsight all the same, the classes
    learn that they copy, drafts are then verified, and the output stays the target's own."""
    from replay import Machine, simulate_costs
    from tiny import random_prompt, reference_greedy

    from specdecode import NgramDrafter
    from specdecode.batch import BatchEngine

    epyc = Machine("avx512_epyc/llama.cpp", {1: 35, 2: 63, 4: 110, 8: 250, 12: 320, 16: 305, 20: 415, 24: 454,
                                              32: 540, 48: 790, 64: 860}, draft_ms=20.0, draft_read_ms=6.0, leaves=0)
    engine = simulate_costs(BatchEngine(target, NgramDrafter(), k=8, adaptive=True, max_batch=2), epyc)
    prompt = random_prompt(0, 6).repeat(1, 4)
    verified = []
    for _ in range(2):  # the first request's last verdicts come at the next request's first step
        seq = engine.submit(prompt, max_new_tokens=60)
        while engine.has_work:
            verified.append(engine.step().drafted)
        assert seq.result.token_ids == reference_greedy(target, prompt, 60)
    assert engine.controller.measured.judged_lookups
    assert sum(verified) > 0


def test_the_tree_draft_goes_out_where_the_copy_is_not_worth_verifying():
    """The copy pointer's draft runs further than the suffix tree's and goes first; where its prices say verify none
    of it, the tree's draft (`Draft.instead`), priced apart, is verified in its place, and both are judged in hindsight
    (the one not verified as verified for nothing). Where the copy pays it stays."""
    from specdecode.control.step import StepPlan
    from specdecode.drafters.base import Draft

    def candidates():
        tree = Draft(torch.tensor([[7, 8, 9, 10]]), source="suffix", match_len=8)
        return Draft(torch.tensor([list(range(7, 47))]), source="suffix/copy", match_len=8, instead=tree)

    ctl = epyc_controller()
    for _ in range(20):  # this class of copies broke at their first token; the tree's matches of 8 held
        ctl.measured.observe_lookup("suffix/copy", 8, 16, 0)
        ctl.measured.observe_lookup("suffix", 8, 4, 4)
    seq = row([1, 2, 3])
    drafts = [candidates()]
    ctl.fit([seq], StepPlan([]), drafts)
    verified = drafts[0].length
    assert drafts[0].source == "suffix" and verified >= 3 and drafts[0].instead is None
    offered = {(r.source, r.verified, len(r.tokens)) for r in ctl.hindsight.pending[0][1]}
    assert offered == {("suffix", verified, 4), ("suffix/copy", 0, 40)}

    ctl = epyc_controller()
    for _ in range(20):  # copies that ran on
        ctl.measured.observe_lookup("suffix/copy", 8, 40, 40)
    drafts = [candidates()]
    ctl.fit([row([1, 2, 3])], StepPlan([]), drafts)
    assert drafts[0].source == "suffix/copy" and drafts[0].length > 4


def test_a_draft_ends_at_an_end_token_and_the_draft_it_may_be_swapped_for_at_its_own():
    from specdecode.drafters.base import Draft

    draft = Draft(torch.tensor([[5, 6, 0, 7, 8]]), instead=Draft(torch.tensor([[5, 9, 9, 0]])))
    draft.end_at(frozenset({0}))
    assert draft.tokens.tolist() == [[5, 6, 0]] and draft.instead.tokens.tolist() == [[5, 9, 9, 0]]
    draft.truncate(2)
    assert draft.tokens.tolist() == [[5, 6]] and draft.instead.tokens.tolist() == [[5, 9]]
