"""A request's loss limit (AdaptiveK.may_lose): a lookup bet goes out only as wide as its worst case could lose within
priors.LOSS_STAKE + LOSS_SHARE x the request's tokens + what its drafts have saved, whatever the shared acceptance
rates say."""

from types import SimpleNamespace

import pytest
import torch

from specdecode.control import priors
from specdecode.control.step import RowOutcome, StepOutcome, StepPlan
from specdecode.drafters.base import Draft

from replay import EPYC_LLAMA_200 as EPYC, epyc_controller

PLAIN_S = EPYC.verify_s(1)


def copy(length=63):
    return Draft(torch.arange(100, 100 + length)[None], source="suffix/copy", match_len=8)


def taught_long_copies(ctl):
    """The rates other requests taught: copies from an 8-15 token match ran 63 tokens."""
    for _ in range(20):
        ctl.measured.observe_lookup("suffix/copy", 8, 63, 63)


def step(ctl, seq, draft, accepted):
    """The row's step with `draft` verified, `accepted` of it taken -> its pass's seconds."""
    seconds = EPYC.verify_s(1 + draft.length)
    ctl.observe(StepOutcome((seq.serial,), 1 + draft.length, seconds, [RowOutcome(
        draft.source, None, draft.length, accepted, 0.0, draft.match_len, positions=1 + draft.length)]))
    seq.generated += accepted + 1
    return seconds


def lost_at_worst(length):
    return EPYC.verify_s(1 + length) / PLAIN_S - 1


def test_a_new_request_bets_its_stake_and_then_what_it_saved():
    ctl = epyc_controller()
    taught_long_copies(ctl)
    assert ctl.trim(copy()).length == 63  # the shared rates alone bet the widest pass (24.6 plain passes)
    seq = SimpleNamespace(serial=1, generated=0)
    ctl.observe(StepOutcome((seq.serial,), 1, PLAIN_S, [RowOutcome("suffix", None, 0, 0, 0.0)]))  # the row joins
    first = ctl.trim(copy(), seq)
    assert 8 <= first.length < 63 and lost_at_worst(first.length) <= priors.LOSS_STAKE
    assert lost_at_worst(first.length + 1) > priors.LOSS_STAKE  # as wide as the stake allows, no narrower
    step(ctl, seq, first, accepted=first.length)  # all taken: the row saved, its next bet is wider
    second = ctl.trim(copy(), seq)
    assert second.length > first.length
    assert lost_at_worst(second.length) <= ctl.may_lose(seq) < lost_at_worst(second.length + 1)

    seq = SimpleNamespace(serial=2, generated=0)
    ctl.observe(StepOutcome((seq.serial,), 1, PLAIN_S, [RowOutcome("suffix", None, 0, 0, 0.0)]))
    step(ctl, seq, ctl.trim(copy(), seq), accepted=0)  # its first bet lost: little is left to bet
    taught_long_copies(ctl)
    assert ctl.trim(copy(), seq).length < 3 and ctl.may_lose(seq) < 1


@pytest.mark.parametrize("limited", [True, False], ids=["loss-limit", "no-limit"])
def test_a_request_whose_copies_all_break_loses_at_most_its_limit(limited):
    """Every step offers a 63-token copy that breaks at its first token, while other requests keep teaching that such
    copies run long: the request never costs more than LOSS_STAKE + (1 + LOSS_SHARE) x its tokens in plain passes.
    Without the limit (the control) the same request runs at a fraction of plain decoding's speed."""
    ctl = epyc_controller()
    seq = SimpleNamespace(serial=1, generated=0)
    clock = 0.0
    while seq.generated < 128:
        taught_long_copies(ctl)
        clock += step(ctl, seq, ctl.trim(copy(), seq if limited else None), accepted=0)
    bound = priors.LOSS_STAKE + (1 + priors.LOSS_SHARE) * seq.generated
    if limited:
        assert clock / PLAIN_S <= bound + 1e-6, (clock / PLAIN_S, bound)
        assert clock / PLAIN_S > seq.generated  # it did bet
    else:
        assert clock / PLAIN_S > 3 * bound


@pytest.mark.parametrize("lookup_only", [False, True], ids=["row-by-row", "one-length-for-the-batch"])
def test_the_limit_holds_in_fit_for_each_row_of_a_batch(lookup_only):
    """`fit` holds each row's draft to its own limit, priced by the batch's pass (`plan_free` then picks the batch's
    one length among what the rows may bet): a row that lost bets nothing beside one that saved."""
    ctl = epyc_controller()
    taught_long_copies(ctl)
    won, lost = (SimpleNamespace(serial=serial, generated=40, ids=torch.tensor([[1, 2]]), finished=False)
                 for serial in (1, 2))
    ctl.observe(StepOutcome((1, 2), 1, None, [RowOutcome("suffix", None, 0, 0, 0.0)] * 2))  # the rows join
    ctl.rows = 2
    ctl.saved.update({1: 30.0, 2: -priors.LOSS_STAKE - priors.LOSS_SHARE * 40})
    drafts = [copy(), copy()]
    ctl.fit([won, lost], StepPlan([], lookup_only=lookup_only), drafts)
    assert drafts[0].length > 8 and drafts[1].length == 0
    assert ctl._lost_at_worst(1 + drafts[0].length) <= ctl.may_lose(won)
