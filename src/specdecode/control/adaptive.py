"""How long to draft, step by step, from what running has measured.

A cost model learns the draft time per token and the verify time as a function of the number of scored
positions (seeded at load by `calibrate`); a calibrator learns how often a drafted token with a given draft
confidence is accepted. The adaptive controller then
- keeps drafting only while one more token adds expected tokens faster than the step's average rate
  (the marginal rule, `DraftPlan.keep_going`; the draft's confidence predicts the next acceptance);
- skips drafting (plain decoding) when even one drafted token is expected to lose against plain
  decoding, and probes again now and then so a change in the text can bring speculation back.
A batch of rows is decided together (`batch.BatchPolicy`). None of this changes the output: it only decides
how many tokens to propose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import priors
from .batch import BatchDecision, BatchPolicy, most_saving
from .hindsight import Hindsight
from .measurements import Measurements
from .sentences import sentence_ends
from .step import LOOKUP, MODEL, RowPlan, StepOutcome, StepPlan

if TYPE_CHECKING:
    from ..drafters.base import Draft
    from ..sequence import Sequence


@dataclass
class DraftPlan:
    """One row's drafting decision for one step: up to `length` tokens (0: a plain step), their tree leaves
    verified or not. The drafter asks `keep_going` between tokens; the plan carries the running expectation
    that rule compares with (None controller: draft the whole length)."""

    length: int
    leaves: bool = False
    controller: AdaptiveK | None = None
    offered: int = 0  # leaves the drafter offers per token (their width until the actual count is measured)
    expected: float = 1.0  # tokens the step is expected to bring so far (the target's own token at least)
    elapsed: float = 0.0  # seconds it is expected to cost so far
    survive: float = 1.0  # probability that every token drafted so far is accepted

    def keep_going(self, drafted: int, confidence: float) -> bool:
        """After `drafted` tokens, the last with draft confidence `confidence`: draft one more?"""
        ctl = self.controller
        t_draft = ctl.measured.costs.draft_time() if ctl is not None else 0.0
        if not t_draft:
            return True
        accept, leaf_hit = ctl.measured.calibrator.predict(confidence), ctl.measured.leaf_hit_rate(self.leaves)
        self.expected += self.survive * (accept + (1 - accept) * leaf_hit)  # this token, or a leaf at its place
        self.survive *= accept
        verify = lambda positions: ctl.verify_model_draft(positions, self.leaves, self.offered)  # noqa: E731
        self.elapsed += t_draft + verify(drafted + 1) - verify(drafted)
        gain = self.survive * (accept + (1 - accept) * leaf_hit)  # the next token is predicted to fare like this one
        cost = t_draft + verify(drafted + 2) - verify(drafted + 1)
        return gain / max(cost, 1e-9) > self.expected / max(self.elapsed, 1e-9)


def _widths(draft) -> list[int]:
    """[n]: the pass's width for the draft's first n tokens with their tree leaves (0 <= n <= length)."""
    leaves = [0] * draft.length if draft.alternatives is None else (draft.alternatives[0] >= 0).sum(-1).tolist()
    widths = [1]
    for count in leaves:
        widths.append(widths[-1] + 1 + count)
    return widths


class AdaptiveK:
    """Draft length and on/off chosen per step from measured costs and calibrated acceptance, for one sequence;
    `batch` decides for a batch of rows from the same measurements."""

    def __init__(self, max_k: int = 8, probe_every: int = priors.PROBE_EVERY):
        self.max_k, self.probe_every = max_k, probe_every
        self.measured = Measurements()
        self.plain_steps = 0
        self.probe_interval = probe_every  # plain steps before the next probe (doubles while probes lose)
        self.skipped_steps = 0  # steps decoded plainly because drafting was expected to lose
        self.hindsight = Hindsight()  # lookup drafts judged whole against what the target went on to commit
        self.model_off: str | None = None  # why model drafts are off on this machine (None: they may pay)
        self.batch = BatchPolicy(self.measured, max_k, probe_every)
        self.rows = 1  # rows in the step being planned (a row's share of the pass)
        self.reading = 0  # prompt tokens the planned step's pass reads beside the rows (plan_step)
        self.pads = False  # the backend runs a one-row pass wider where that measures cheaper (Backend.pads_passes)
        self._padded = 0  # passes pass_width padded (every PAD_RECHECK-th runs unpadded instead)
        self._rows_seen: tuple[int, ...] = ()  # the rows of the last pass observed
        self.saved: dict[int, float] = {}  # by row serial: plain passes its steps saved so far (negative: lost)
        self._can_pay: tuple[tuple, bool] | None = None  # model_can_pay's last answer: (key, answer)
        self._drafted: dict[int, list[int]] = {}  # by row serial: the lookup draft fit chose this step, for observe

    def read_vocabulary(self, tokenizer) -> None:
        """Price lookup positions after a sentence's end apart (control/sentences.py): the tokenizer says which
        tokens end one."""
        self.measured.sentences = sentence_ends(tokenizer)

    @property
    def costs(self):
        return self.measured.costs

    @property
    def pass_line(self):
        return self.measured.pass_line

    # --- the cost of a step, as measured -----------------------------------------------------------

    def _verify(self, positions: int) -> float:
        """This row's share of a verify pass where every row scores `positions` positions."""
        rows = self.rows
        t = self.measured.pass_line.time(positions) if rows == 1 else None
        if t is None:
            t = self.measured.costs.verify_time(positions, rows)
        return t / rows if t is not None else 0.0

    def verify_model_draft(self, positions: int, leaves: bool, offered: int = 0) -> float:
        """A pass over [last] + positions - 1 model-drafted tokens and, if on, their leaves (`offered` per token
        until the drafter's actual count is measured)."""
        per_token = 0.0
        if leaves:
            per_token = self.measured.leaves_per_token.value if self.measured.leaves_per_token.value is not None else offered
        return self._verify(1 + (positions - 1) * (1 + per_token))

    def _speculative_rate(self, leaves: bool, offered: int = 0) -> float:
        """Expected tokens per second of a one-token draft (the on/off rule's yardstick)."""
        a = self.measured.first_accept.value
        verify = self.verify_model_draft(2, leaves, offered)
        return (1 + a + (1 - a) * self.measured.leaf_hit_rate(leaves)) / (self.measured.costs.draft_time() + verify)

    def _best_case_rate(self, t_plain: float, max_len: int, accept: float = 1.0, t_draft: float | None = None) -> float:
        """Tokens per second of the best draft length if the target accepted each drafted token with probability
        `accept` (1: every one), with passes priced by the pass table (measured by width at load, then every step;
        interpolated between): a line through a curve that is flat in places made a hopeless draft look as if it
        could pay on llama.cpp."""
        t_draft = self.measured.costs.draft_time() if t_draft is None else t_draft

        def expected(k: int) -> float:  # 1 + accept + ... + accept^k
            return k + 1 if accept >= 1 else (1 - accept ** (k + 1)) / (1 - accept)

        return max(expected(k) / (k * t_draft + self.measured.costs.verify_time(k + 1)) for k in range(1, max(max_len, 1) + 1))

    def model_can_pay(self, max_len: int) -> bool:
        """Whether a model draft could beat plain decoding on this machine at the best acceptance drafts reach
        (BEST_ACCEPT per token), from the measured costs. Where it cannot, a draft model that has not read the prompt
        reads nothing and runs no probe, and one that has runs nothing but its rare probes (which time it again): only
        lookups are drafted (`model_off` says why)."""
        costs = self.measured.costs
        t_plain, share = costs.verify_time(1), costs.draft_share()
        if t_plain is None or not share:
            return True  # not measured yet: nothing says it cannot
        # Every price here is in plain passes (the draft's as when it was timed: `draft_share`), so the answer moves
        # only with those prices (`prices_moved`) or the draft's: asked at every step on fresh text, it is kept till
        # then.
        key = (max_len, costs.prices_moved, share)
        if self._can_pay is not None and self._can_pay[0] == key:
            return self._can_pay[1]
        best = self._best_case_rate(t_plain, max_len, priors.BEST_ACCEPT, share * t_plain) * t_plain
        if best >= priors.MIN_GAIN:
            self.model_off = None
        else:
            self.model_off = (f"model drafts off: at {priors.BEST_ACCEPT:.0%} acceptance they would reach {best:.2f}x "
                              "plain decoding on this machine's measured costs; lookup drafts only")
        self._can_pay = (key, self.model_off is None)
        return self.model_off is None

    def _leaves_pay(self, offered: int) -> bool:
        """Leaves pay where a wider pass is nearly free (AVX-512 bf16: 25 positions ~ 9) and lose where every position
        costs (AVX2 with emulated bf16: 170 ms each): decided from the measured slope, one draft token's worth."""
        return bool(offered) and (
            self.measured.pass_line.slope is None or self._speculative_rate(True, offered) >= self._speculative_rate(False))

    # --- the engine's step (control.step.Controller) -------------------------------------------------

    def plan_step(self, rows: list[Sequence], trees: bool, reading: int = 0) -> StepPlan:
        """Every row's draft: the batch's cap first (the pass is as wide as its widest row), then each row by the
        single-sequence rule under it. A batch size whose plain pass is not measured yet runs one plain step first:
        drafting there is priced against it. In a pass that also reads `reading` prompt tokens, each drafted position
        costs what it adds to that pass (batch and lookup pricing; a row alone too)."""
        n = self.rows = len(rows)
        self.reading = reading
        self.judge_in_hindsight()
        if not self.measured.costs.measured(1, n):
            return StepPlan([RowPlan() for _ in rows])
        drafting = [seq for seq in rows if seq.drafter is not None]
        unread = sum(seq.prompt.shape[1] for seq in drafting if not seq.drafter_ready)
        batch = self.batch.plan(n, unread, ready_rows=sum(seq.drafter_ready for seq in drafting), reading=reading)
        lookup_only = n > 1 and batch.cap == 0  # model drafting does not pay for this batch; free lookups still may
        return StepPlan([self._row(seq, trees, batch, lookup_only) for seq in rows], batch.cap, lookup_only)

    def _row(self, seq: Sequence, trees: bool, batch: BatchDecision, lookup_only: bool) -> RowPlan:
        budget = seq.draft_budget
        if seq.drafter is None or budget <= 0:
            return RowPlan()
        if lookup_only:  # the batch cuts every row's lookup to one length (fit)
            return RowPlan(LOOKUP, seq.k)
        offered = seq.drafter.alternatives if trees else 0
        if seq.drafter.free:  # nothing to read, no model pass: its measured gain decides its length (fit)
            return RowPlan(LOOKUP, self.lookup_length(), bool(offered))
        plan = self.plan(min(budget, seq.k), seq.drafter_ready, seq.drafter_unread, offered, remaining=budget,
                         generated=seq.generated, batch=batch)
        if plan.length == 0:  # model drafting does not pay this step; a lookup that costs nothing still may
            return RowPlan(LOOKUP, self.lookup_length(), bool(offered))
        return RowPlan(MODEL, plan.length, plan.leaves, plan.keep_going, read_prompt=not seq.drafter_ready)

    def fit(self, rows: list[Sequence], plan: StepPlan, drafts: list[Draft]) -> None:
        offered = [[(d, d.tokens[0].tolist()) for d in (draft, draft.instead) if d is not None and d.confidence is None
                    and d.length] for draft in drafts]
        if plan.lookup_only:  # the batch's one length for each row's first draft, within each row's loss limit
            for seq, draft in zip(rows, drafts):
                draft.instead = None
                draft.truncate(self._longest_within(_widths(draft), self.may_lose(seq)))
            keep = self.batch.plan_free(len(rows), drafts, self.reading)
            for draft in drafts:
                draft.truncate(keep)
        else:
            drafts[:] = [self.trim(draft, seq) for seq, draft in zip(rows, drafts)]
        self._drafted = {}
        for seq, candidates, draft in zip(rows, offered, drafts):
            for candidate, tokens in candidates:  # the one not chosen is judged too, as if verified for nothing
                verified = draft.length if candidate is draft else 0
                self.hindsight.offer(seq, tokens, candidate.source, candidate.match_len, verified)
                if verified:
                    self._drafted[seq.serial] = tokens

    def judge_in_hindsight(self) -> None:
        """Learn from the lookup drafts whose verdicts the rows' committed tokens now give."""
        for verdict in self.hindsight.judge():
            self.measured.observe_hindsight(verdict)

    def observe(self, outcome: StepOutcome) -> None:
        for row in outcome.rows:
            for tokens, seconds in row.readings:
                self.observe_reading(tokens, seconds)
        if outcome.row_ids != self._rows_seen:  # a row joined or left
            self.rows_changed()
            self._rows_seen = outcome.row_ids
            self.saved = {serial: self.saved.get(serial, 0.0) for serial in outcome.row_ids}
        self._count_savings(outcome)
        if outcome.verify_s is not None:
            self.observe_pass(outcome.positions, len(outcome.row_ids), outcome.verify_s)
        for serial, row in zip(outcome.row_ids, outcome.rows):
            self.observe_row(row.source, row.confidence, row.drafted, row.accepted, row.draft_s, row.leaf_used,
                             row.positions, row.match_len, self._drafted.get(serial))
        self._drafted = {}

    # --- one row's decision ------------------------------------------------------------------------

    def plan(self, max_len: int, ready: bool = True, unread: int = 0, leaves: int = 0,
             remaining: int | None = None, generated: int | None = None, batch: BatchDecision | None = None) -> DraftPlan:
        """This step's plan for a row that may draft up to max_len tokens. ready: its drafter has read the prompt;
        unread: tokens it would have to read before drafting; leaves: runner-ups the drafter offers per token
        (0: none, or the engine cannot verify them); remaining: tokens the request may still make (default max_len);
        generated: tokens it has made so far (default: as many as remain); batch: what the batch policy decided for
        the step (None or no cap: the row is alone, the single-sequence rule)."""
        if max_len <= 0:
            return DraftPlan(0)
        if batch is not None and batch.cap is not None:
            return DraftPlan(batch.row_length(max_len, ready), controller=self, elapsed=self._verify(1))
        with_leaves = self._leaves_pay(leaves)
        remaining = max_len if remaining is None else remaining
        generated = remaining if generated is None else generated
        length = self._length(max_len, remaining, ready, unread, with_leaves, leaves, generated)
        return DraftPlan(length, with_leaves, self, offered=leaves, elapsed=self._verify(1))

    def _length(self, max_len: int, remaining: int, ready: bool, unread: int, with_leaves: bool, offered: int,
                generated: int) -> int:
        # The gate compares with plain passes as measured: the line's level fits wide passes, and where the first
        # positions cost most (AVX2 bf16: 1 -> 5 positions x4) it put a plain pass 25 % too dear.
        t_plain, t_draft = self.measured.costs.verify_time(1), self.measured.costs.draft_time()
        if not self.measured.costs.measured(1):  # first a plain pass: drafting is judged against it (a plain step never loses)
            return 0
        # A drafter that has not read the prompt costs nothing until it is expected to pay: not where even its best
        # case loses, and not before the answer has run long enough to earn the reading back.
        if not ready and (not self.model_can_pay(max_len)
                          or not self._reading_pays(t_plain, unread, remaining, generated, with_leaves, offered)):
            self.skipped_steps += 1
            return 0
        if not t_draft:  # the draft not measured yet: a short draft measures it and a wider pass
            return min(priors.START_DRAFT, max_len)
        # A drafter in step with the text drafts only where its best case could pay: its rate, read off a few probes,
        # came out above that best now and then, and it drafted at a loss (replays: 5-10 %). Its probes still run.
        if self._speculative_rate(with_leaves, offered) >= priors.MIN_GAIN / t_plain and self.model_can_pay(max_len):
            self.plain_steps = 0
            self.probe_interval = self.probe_every
            return max_len
        if self.plain_steps < self.probe_interval:
            self.plain_steps += 1
            self.skipped_steps += 1
            return 0
        # Now and then a probe of one token: it re-measures exactly what this rule reads (the draft's time, a
        # two-position pass, first-token acceptance). Each probe that finds drafting still losing waits twice as long
        # for the next (where a draft step costs two plain ones, probes every 8 steps alone cost 15 %). Where not
        # even drafts all accepted would pay, it waits the longest interval; and a drafter that has not read the
        # prompt yet does not read it for that probe before then (a reading for a probe can cost more than the probe
        # could ever win back, where the costs measured at load already say drafting loses).
        self.plain_steps = 0
        if self._best_case_rate(t_plain, max_len) >= priors.MIN_GAIN / t_plain:
            self.probe_interval = min(2 * self.probe_interval, priors.MAX_PROBE_INTERVAL)
        elif not ready and self.probe_interval < priors.MAX_PROBE_INTERVAL:
            self.probe_interval = priors.MAX_PROBE_INTERVAL
            self.skipped_steps += 1
            return 0
        else:
            self.probe_interval = priors.MAX_PROBE_INTERVAL
        return 1

    def _reading_pays(self, t_plain: float, unread: int, remaining: int, generated: int, with_leaves: bool,
                      offered: int) -> bool:
        """A drafter that has not read the prompt reads it once the request has decoded plainly for as long as the
        reading would take to earn back at the expected saving per token (ski rental: what the answer has run so far
        is the best guess of what is left; a bet on max_new_tokens lost on short answers), and only when the tokens
        left could earn it back. Where drafting is not expected to pay, it is not read for a probe: probes are for
        drafters in step with the text (a reading for a probe cost 10 % of a 400-token answer on AVX2 fp32)."""
        per_token = self.measured.costs.draft_prefill_token_s.value
        if per_token is None or not unread:
            return True
        spec_rate = self._speculative_rate(with_leaves, offered)
        if spec_rate * t_plain < priors.MIN_GAIN:  # drafting is not expected to pay: nothing would earn the reading back
            return False
        saving = max(t_plain - 1 / spec_rate, 0.0)  # seconds a drafted token saves
        return min(generated, remaining) * saving >= priors.READ_PAYBACK * unread * per_token

    def lookup_length(self) -> int:
        """The longest lookup draft worth proposing: what the widest pass measured can verify (at least max_k)."""
        return max(self.max_k, self.measured.costs.widest() - 1)

    def trim(self, draft: Draft, seq: Sequence | None = None) -> Draft:
        """Cut a draft made all at once (no confidence: a lookup) to the length that maximises expected tokens per
        second, from its source's measured acceptance by position and match length and the pass's measured cost by
        width (its tree leaves included); verify it only where the expected tokens exceed the pass's cost in plain
        passes by FREE_MIN_GAIN, and no wider than its row's loss limit allows (`may_lose`; no row given: none).
        Where none of it pays, the draft it may be swapped for (`Draft.instead`: the suffix tree's, where the copy
        pointer's runs further) is priced the same way and returned cut in its place. No probes: whatever length is
        verified, the whole draft is judged in hindsight (`Hindsight`), so a class kept short or undrafted still shows
        how far it would have been right."""
        if draft.confidence is not None or draft.length == 0 or self.measured.costs.verify_time(1, self.rows) is None:
            return draft
        other, draft.instead = draft.instead, None
        most_lost = self.may_lose(seq) if seq is not None else None
        length, value = self._cut(draft, most_lost)
        if other is not None and other.length:
            other_length, other_value = self._cut(other, most_lost)
            if not length and other_value > value:
                draft, length = other, other_length
        draft.truncate(length)
        return draft

    def _cut(self, draft: Draft, most_lost: float | None = None) -> tuple[int, float]:
        """(length, its value) of the lookup draft's best cut: seconds saved beside a prompt reading, else expected
        tokens per second (a length of 0: a plain step's), among the lengths that lose at most `most_lost` plain passes
        where every drafted position is rejected (None: any length)."""
        width, rows = _widths(draft), self.rows
        expected = self.measured.expected_accepted(draft.source, draft.length, draft.match_len, draft.tokens[0])
        affordable = lambda n: most_lost is None or self._lost_at_worst(width[n]) <= most_lost  # noqa: E731
        if self.reading:  # beside a prompt reading: the length that saves the most time
            per_position, saves = self.measured.costs.riding(rows)
            saved = [accepted * saves - priors.FREE_MIN_GAIN * per_position * (width[n] - 1) if affordable(n) else -math.inf
                     for n, accepted in enumerate(expected, 1)]
            best = most_saving(saved)
            return best, saved[best - 1] if best else 0.0
        # Priced by the pass table, measured by width up to 64 (a line through it misprices a curve that is flat
        # in places and steep in others, as llama.cpp's is); a row's share of the batch's pass.
        verify = lambda positions: self._pass(positions)[1] / rows  # noqa: E731
        best_len, best_rate = 0, priors.FREE_MIN_GAIN / max(verify(1), 1e-9)
        for n, accepted in enumerate(expected, 1):
            rate = (1 + accepted) / max(verify(width[n]), 1e-9)
            if rate > best_rate and affordable(n):
                best_len, best_rate = n, rate
        widest = self.measured.costs.widest()
        if rows == 1 and width[best_len] == widest and draft.length > best_len:
            # The best length is the widest pass ever measured and the draft runs on: past it the cost is only a
            # conservative guess that would keep every later draft this short. One pass this wide measures it.
            best_len = self._longest_within(width, most_lost, shortest=best_len)
        return best_len, best_rate

    def may_lose(self, seq: Sequence) -> float:
        """Plain passes the row's next lookup bet may lose at worst: its loss limit (priors.LOSS_STAKE, LOSS_SHARE) plus
        what its drafts have saved so far."""
        return priors.LOSS_STAKE + priors.LOSS_SHARE * seq.generated + self.saved.get(seq.serial, 0.0)

    def _longest_within(self, width: list[int], most_lost: float | None, shortest: int = 0) -> int:
        """The longest cut n >= shortest of a draft whose pass, `width[n]` positions, loses at most `most_lost` plain
        passes where every drafted position is rejected (None: no limit); `shortest` where none longer does."""
        longest = len(width) - 1
        if most_lost is None:
            return longest
        return next((n for n in range(longest, shortest, -1) if self._lost_at_worst(width[n]) <= most_lost), shortest)

    def _lost_at_worst(self, width: int) -> float:
        """Plain passes a row's step of `width` positions loses against a plain step where every drafted position is
        rejected: beside a prompt reading, what its positions add to that pass; else its pass against a plain one
        (not measured: no bet is safe)."""
        if width <= 1:
            return 0.0
        if self.reading and (riding := self.measured.costs.riding(self.rows)) is not None:
            per_position, saves = riding
            return per_position * (width - 1) / saves
        wide, plain = self._pass(width)[1], self._pass(1)[1]
        return math.inf if wide is None or not plain else wide / plain - 1

    def _count_savings(self, outcome: StepOutcome) -> None:
        """Each row's step against a plain one, in plain passes at the prices its plan was made with: the tokens it
        took, less what its positions and its draft added."""
        plain = self._pass(1)[1]
        if not plain:
            return
        for serial, row in zip(outcome.row_ids, outcome.rows):
            added = self._lost_at_worst(row.positions) + row.draft_s / plain
            self.saved[serial] = self.saved.get(serial, 0.0) + row.accepted - added

    def pass_width(self, positions: int) -> int:
        """The width to run this step's pass of `positions` at (one row alone, where the backend pads): padded where
        that measures cheaper, except every PAD_RECHECK-th time, when it runs at its own width to be timed again."""
        width = self._pass(positions)[0]
        if width != positions:
            self._padded += 1
            if self._padded % priors.PAD_RECHECK == 0:
                return positions
        return width

    def _pass(self, positions: int) -> tuple[int, float | None]:
        """(width, seconds) of this step's pass of `positions` per row: padded where that measures cheaper."""
        costs = self.measured.costs
        if self.pads and self.rows == 1:
            return costs.cheapest_pass(positions)
        return positions, costs.verify_time(positions, self.rows)

    # --- what the engine measured --------------------------------------------------------------------

    def observe_reading(self, tokens: int, seconds: float) -> None:
        """A drafter read `tokens` committed tokens (its prompt, or a catch-up after plain steps) in `seconds`."""
        self.measured.costs.observe_draft_prefill(tokens, seconds)

    def rows_changed(self) -> None:
        """A row joined or left: the next passes are not comparable with the last one's (pass line)."""
        self.measured.pass_line.new_context()

    def observe_pass(self, positions: int, rows: int, seconds: float) -> None:
        """A verify pass of `rows` rows x `positions` positions (the batch's widest draft + 1) took `seconds`.
        A row alone's passes also draw its pass line."""
        self.measured.costs.observe_verify(positions, seconds, rows)
        if rows == 1:
            self.measured.pass_line.observe(positions, seconds)

    def observe_row(
        self, source: str, confidences: list[float] | None, drafted: int, accepted: int, draft_s: float,
        leaf_used: bool | None = None, positions: int | None = None, match_len: int = 0, tokens: list[int] | None = None,
    ) -> None:
        """What one row drafted in `draft_s` seconds and how much of it the target accepted (leaf_used: whether
        a tree leaf held the correction, None: the draft had no leaves; positions: what the row's pass scored,
        more than drafted + 1 with leaves; match_len: a lookup draft's match; tokens: a lookup draft's tokens)."""
        before = self.measured.costs.draft_token_s.get(source)
        if drafted and before is not None and before.value and draft_s / drafted < priors.REGIME_CHANGE * before.value:
            self.probe_interval = self.probe_every  # drafting got much cheaper (a busy stretch over): probe again soon
        self.measured.costs.observe_draft(source, drafted, draft_s)
        if leaf_used is not None and drafted and positions:
            self.measured.leaves_per_token.update((positions - 1 - drafted) / drafted)
        if leaf_used is not None and accepted < drafted:
            self.measured.leaf_hit.update(1.0 if leaf_used else 0.0)
        if not drafted:
            return
        self.measured.first_accept.update(1.0 if accepted else 0.0)
        if confidences:
            self.measured.calibrator.update(confidences, accepted)
        else:  # at once, for the next step; what lies past the verified part comes in hindsight (plan_step)
            self.measured.observe_lookup(source, match_len, drafted, accepted, tokens)
