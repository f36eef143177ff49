"""How long to draft, step by step, from what running has measured.

A cost model learns, while generating, the draft time per token and the verify time as a function of
the number of scored positions; a calibrator learns how often a drafted token with a given draft
confidence is accepted. The adaptive controller then
- keeps drafting only while one more token adds expected tokens faster than the step's average rate
  (the marginal rule; the draft's confidence predicts the next acceptance);
- skips drafting (plain decoding) when even one drafted token is expected to lose against plain
  decoding, and probes again now and then so a change in the text can bring speculation back.
None of this changes the output: it only decides how many tokens to propose.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


class Ema:
    def __init__(self, alpha: float, value: float | None = None):
        self.alpha, self.value = alpha, value

    def update(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


class ConfidenceCalibrator:
    """P(accept | draft confidence) in confidence bins; starts from the identity (a calibrated draft
    is accepted with its own probability) and learns from every token the target judged."""

    BINS = 10

    def __init__(self, prior_weight: float = 4.0):
        self.bins = [[(b + 0.5) / self.BINS * prior_weight, prior_weight] for b in range(self.BINS)]  # [accepted, seen]

    def _bin(self, confidence: float) -> list[float]:
        return self.bins[min(int(confidence * self.BINS), self.BINS - 1)]

    def predict(self, confidence: float) -> float:
        accepted, seen = self._bin(confidence)
        return accepted / seen

    def update(self, confidences: list[float], accepted_len: int) -> None:
        # Tokens after the first rejection were never judged by the target: they teach nothing.
        for i, conf in enumerate(confidences[: accepted_len + 1]):
            b = self._bin(conf)
            b[0] += 1.0 if i < accepted_len else 0.0
            b[1] += 1.0


@dataclass
class CostModel:
    """Seconds per draft token and per verify pass, as moving averages. A verify pass is keyed by the
    tokens it scores (rows x positions): a batch of 8 rows verifying 6 positions each costs what a
    48-token pass costs, which is how verification stops being free as the batch grows."""

    alpha: float = 0.2
    draft_token_s: dict[str, Ema] = field(default_factory=dict)
    verify_s: dict[int, Ema] = field(default_factory=dict)
    draft_prefill_token_s: Ema = field(default_factory=lambda: Ema(0.2))  # a drafter reading a prompt, per token

    def observe_draft_prefill(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.draft_prefill_token_s.update(seconds / tokens)

    def observe_draft(self, source: str, tokens: int, seconds: float) -> None:
        if tokens:
            self.draft_token_s.setdefault(source, Ema(self.alpha)).update(seconds / tokens)

    def observe_verify(self, positions: int, seconds: float, rows: int = 1) -> None:
        self.verify_s.setdefault(rows * positions, Ema(self.alpha)).update(seconds)

    def measured(self, positions: int, rows: int = 1) -> bool:
        e = self.verify_s.get(rows * positions)
        return e is not None and e.value is not None

    def widest(self) -> int:
        """The most tokens a measured pass scored (0: none yet)."""
        return max((n for n, e in self.verify_s.items() if e.value is not None), default=0)

    def draft_time(self) -> float:
        """Seconds per drafted token of the costliest drafter seen (with several, the model one)."""
        return max((e.value for e in self.draft_token_s.values() if e.value is not None), default=0.0)

    # Past the widest pass measured, a pass is assumed to grow at least this fraction of proportionally with
    # its tokens: one-row passes look free up to ~9 tokens on a CPU, and extrapolating that flat to an
    # 8-row x 9-position pass (measured 0.57 s against 0.24 s plain) made a batch verify drafts it could not afford.
    UNMEASURED_GROWTH = 0.5

    def verify_time(self, positions: int, rows: int = 1) -> float | None:
        """Seconds for a pass of `rows` rows x `positions` positions: measured, or interpolated linearly
        between the nearest measured sizes, or extrapolated conservatively past them (None: nothing yet)."""
        positions *= rows
        known = sorted((n, e.value) for n, e in self.verify_s.items() if e.value is not None)
        if not known:
            return None
        for n, t in known:
            if n == positions:
                return t
        below = [(n, t) for n, t in known if n < positions]
        above = [(n, t) for n, t in known if n > positions]
        if below and above:
            (n0, t0), (n1, t1) = below[-1], above[0]
            return t0 + (t1 - t0) * (positions - n0) / (n1 - n0)
        if not below:  # smaller than anything measured
            return known[0][1]
        n1, t1 = known[-1]
        slope = (t1 - known[-2][1]) / (n1 - known[-2][0]) if len(known) > 1 else 0.0
        return t1 + max(slope, self.UNMEASURED_GROWTH * t1 / n1) * (positions - n1)


class PassCostLine:
    """One sequence's verify pass as level + slope x positions. The level follows the current context (a pass
    over 700 cached tokens costs ~2x one over 100 here); the slope, which is what deciding one more drafted token
    reads, is learned only from consecutive passes (same context, same machine load) of clearly different widths.
    A table keyed by width alone remembered each width at whatever context it was last measured in.

    The slope is the median of the latest samples, not a clamped average: a position costs ~1 ms on one CPU and
    ~170 ms on another (bf16 emulated), so no bound in seconds fits both, while a median shrugs off a hiccup."""

    MIN_WIDTH_GAP = 3  # closer widths: their time difference is mostly noise
    SLOPE_SAMPLES = 9

    def __init__(self, alpha_level: float = 0.3):
        self.level = Ema(alpha_level)
        self.slope_samples: list[float] = []
        self.recent: list[float] = []  # the latest passes' seconds: none costs less than the cheapest of them
        self._last: tuple[int, float] | None = None

    @property
    def slope(self) -> float | None:
        if not self.slope_samples:
            return None
        return statistics.median(self.slope_samples)

    def observe(self, positions: int, seconds: float) -> None:
        if self._last is not None and abs(positions - self._last[0]) >= self.MIN_WIDTH_GAP:
            sample = (seconds - self._last[1]) / (positions - self._last[0])
            self.slope_samples = [*self.slope_samples[-(self.SLOPE_SAMPLES - 1):], max(sample, 0.0)]
        self._last = (positions, seconds)
        self.recent = [*self.recent[-(self.SLOPE_SAMPLES - 1):], seconds]
        if self.slope is not None:
            self.level.update(seconds - self.slope * positions)

    def new_context(self) -> None:
        """A new request: its passes are not comparable with the last one's."""
        self._last = None
        self.recent = []

    def time(self, positions: int) -> float | None:
        """A line cannot follow a pass flat up to some width and steep past it: it would put the narrow passes
        below zero. They cost at least what the cheapest recent pass did."""
        if self.level.value is None:
            return None
        return max(self.level.value + self.slope * positions, min(self.recent, default=0.0))


class FixedK:
    """Always draft k tokens (the classic setting)."""

    leaves_on = True  # verify whatever leaves the drafter offers

    def __init__(self, k: int):
        self.max_k = k

    def plan(self, max_len: int, ready: bool = True, unread: int = 0) -> int:
        return min(self.max_k, max_len)

    def observe_reading(self, tokens: int, seconds: float) -> None:
        pass

    def keep_going(self, drafted: int, confidence: float) -> bool:
        return True

    def trim(self, draft):
        return draft

    def observe_pass(self, positions: int, rows: int, seconds: float) -> None:
        pass

    def observe_row(self, source, confidences, drafted, accepted, draft_s, leaf_used=None, positions=None) -> None:
        pass

    def rows_changed(self) -> None:
        pass


class AdaptiveK:
    """Draft length and on/off chosen per step from measured costs and calibrated acceptance.

    In a batch (`plan_batch`, the load-aware part) one decision covers all rows, because the verify
    pass is as wide as its widest row: the draft cap k maximising the batch's expected tokens per
    second, where drafting costs every row's draft time (rows draft one after another) and verifying
    costs a pass of rows x (k + 1) tokens. As the batch grows verification stops being free and the
    cap falls to 0 (plain decoding). Within the cap, each row still stops early by the marginal rule,
    charged its share of the pass. When the cap is 0, drafts that cost no model pass (n-gram lookups)
    may still pay: `plan_free` picks how much of them to verify.
    """

    def __init__(self, max_k: int = 8, probe_every: int = 8, min_gain: float = 1.05):
        self.max_k, self.probe_every, self.min_gain = max_k, probe_every, min_gain
        self.costs = CostModel()
        self.calibrator = ConfidenceCalibrator()
        self.first_accept = Ema(0.2, 0.6)  # acceptance of a step's first draft token, any confidence
        self.plain_steps = 0
        self.lookup_skips = 0  # lookup drafts trimmed to nothing since the last one verified (trim's own probes)
        self.lookup_probe_interval = probe_every  # doubles while lookup probes are rejected (a verified position is dear
        # on llama.cpp: ~60 % of a pass), back to probe_every when one is accepted
        self.probe_interval = probe_every  # plain steps before the next probe (doubles while probes lose)
        self.skipped_steps = 0  # steps decoded plainly because drafting was expected to lose
        # For drafts without confidence (n-gram): P(accept position j | positions before accepted).
        self.position_accept: dict[str, list[Ema]] = {}
        self._expected = self._elapsed = 0.0
        self.rows = 1  # rows in the current batch (set by plan_batch)
        # Alternatives a model draft carries per drafted token (tree leaves, tree.py): each widens the pass, and
        # at a rejection one of them is the target's correction this often (one more token: drafting pays more)
        self.leaves = 0
        self.leaves_on = False  # this step verifies leaves (decided in plan from the measured pass slope)
        self.leaf_hit = Ema(0.1, 0.3)
        self.leaves_per_token = Ema(0.2)  # leaves a drafted token actually carried (the drafter leaves out unlikely ones)
        self.pass_line = PassCostLine()  # one sequence's verify cost by width (the table serves batches)
        self.batch_cap: int | None = None  # the batch's draft cap this step (None: single-sequence rule)
        self.batch_plain_steps = 0
        self._probe_rows: int | None = None  # during a batch probe: how many more rows may draft
        self.batch_decisions: dict[int, list[int]] = {}  # rows -> [plain steps, speculative steps]

    def _verify(self, positions: int) -> float:
        """This row's share of a verify pass where every row scores `positions` positions."""
        t = self.pass_line.time(positions) if self.rows == 1 else None
        if t is None:
            t = self.costs.verify_time(positions, self.rows)
        return t / self.rows if t is not None else 0.0

    def _leaf_hit(self, leaves_on: bool | None = None) -> float:
        return self.leaf_hit.value if (self.leaves_on if leaves_on is None else leaves_on) else 0.0

    def _verify_model_draft(self, positions: int, leaves_on: bool | None = None) -> float:
        """A single sequence's pass over [last] + positions - 1 model-drafted tokens (and their leaves, if on)."""
        leaves = 0.0
        if self.leaves_on if leaves_on is None else leaves_on:
            leaves = self.leaves_per_token.value if self.leaves_per_token.value is not None else self.leaves
        return self._verify(1 + (positions - 1) * (1 + leaves))

    def _speculative_rate(self, leaves_on: bool) -> float:
        """Expected tokens per second of a one-token draft (the on/off rule's yardstick)."""
        a = self.first_accept.value
        return (1 + a + (1 - a) * self._leaf_hit(leaves_on)) / (self.costs.draft_time() + self._verify_model_draft(2, leaves_on))

    def _best_case_rate(self, t_plain: float) -> float:
        """Tokens per second of the best draft length if the target accepted every drafted token: with passes as the
        measured line prices them, or, before it has a slope, as the measured one- and two-position passes extend
        linearly (no guess from the table's conservative extrapolation: that must not make drafting look hopeless)."""
        t_draft = self.costs.draft_time()
        measured = self.pass_line.slope is not None
        # Before the line has a slope, widths 1 and 2 measured give one (passes grow at least linearly past them)
        step = max(self.costs.verify_time(2) - t_plain, 0.0) if self.costs.measured(2) else 0.0

        def verify(k: int) -> float:
            return self._verify_model_draft(k + 1, False) if measured else t_plain + step * k

        return max((k + 1) / (k * t_draft + verify(k)) for k in range(1, self.max_k + 1))

    def _choose_leaves(self) -> None:
        """Leaves pay where a wider pass is nearly free (AVX-512 bf16: 25 positions ~ 9) and lose where every position
        costs (AVX2 with emulated bf16: 170 ms each): decided from the measured slope, one draft token's worth."""
        self.leaves_on = bool(self.leaves) and (
            self.pass_line.slope is None or self._speculative_rate(True) >= self._speculative_rate(False))

    def observe_reading(self, tokens: int, seconds: float) -> None:
        """A drafter read `tokens` committed tokens (its prompt, or a catch-up after plain steps) in `seconds`."""
        self.costs.observe_draft_prefill(tokens, seconds)

    # Reading what a drafter has not seen (a long prompt, a catch-up after plain steps) must cost less than this share
    # of the plain decoding time left: on llama.cpp with 2 cores a 0.5B draft reads ~4.6 ms a token, so a probe on an
    # 800-token prompt cost 3.7 s, a third of the whole request.
    READ_SHARE = 0.25

    def plan(self, max_len: int, ready: bool = True, unread: int = 0) -> int:
        """0 means: do not draft this step (plain decoding). ready: the row's drafter has read its prompt; unread:
        tokens it would have to read before drafting."""
        if max_len <= 0:
            return 0
        if self.batch_cap is not None:  # the batch decided
            if self.batch_cap == 0:
                return 0
            if self._probe_rows is not None:  # a probe: one ready row drafts one token, the others wait
                if self._probe_rows == 0 or not ready:
                    return 0
                self._probe_rows -= 1
            self._expected, self._elapsed, self._survive = 1.0, self._verify(1), 1.0
            return min(self.batch_cap, self.max_k, max_len)
        # The gate compares with plain passes as measured: the line's level fits wide passes, and where the first
        # positions cost most (AVX2 bf16: 1 -> 5 positions x4) it put a plain pass 25 % too dear.
        t_plain, t_draft = self.costs.verify_time(1), self.costs.draft_time()
        self._choose_leaves()
        self._expected, self._elapsed, self._survive = 1.0, self._verify(1), 1.0
        if not self.costs.measured(1):  # first a plain pass: drafting is judged against it (a plain step never loses)
            return 0
        per_token = self.costs.draft_prefill_token_s.value
        if per_token is not None and unread * per_token > self.READ_SHARE * max_len * t_plain:
            self.skipped_steps += 1
            return 0
        if not t_draft:  # the draft not measured yet: a short draft measures it and a wider pass
            return min(self.START_DRAFT, self.max_k, max_len)
        if self._speculative_rate(self.leaves_on) < self.min_gain / t_plain:
            if self.plain_steps < self.probe_interval:
                self.plain_steps += 1
                self.skipped_steps += 1
                return 0
            # Now and then a probe of one token: it re-measures exactly what this rule reads (the draft's time, a
            # two-position pass, first-token acceptance). A probe at full length never refreshed the two-position
            # pass, so one slow stretch could keep speculation off for good. Each probe that finds drafting still
            # losing waits twice as long for the next (where a draft step costs two plain ones, probes every 8
            # steps alone cost 15 %).
            self.plain_steps = 0
            hopeless = self._best_case_rate(t_plain) < self.min_gain / t_plain  # not even drafts all accepted would pay
            self.probe_interval = self.MAX_PROBE_INTERVAL if hopeless else min(2 * self.probe_interval, self.MAX_PROBE_INTERVAL)
            return 1
        self.plain_steps = 0
        self.probe_interval = self.probe_every
        return min(self.max_k, max_len)

    START_DRAFT = 1  # a fresh controller's first draft: short, where each position costs (8 tokens + leaves: 8 s on AVX2)
    MAX_PROBE_INTERVAL = 128  # plain steps between probes at most, where drafting keeps losing
    REGIME_CHANGE = 0.5  # a draft token this much cheaper than the average says the machine's load changed

    BATCH_MIN_GAIN = 1.15  # a batch drafts only for a clear predicted gain: estimates are noisy, switching is not free

    def plan_batch(self, rows: int, unread_prompt_tokens: int = 0, ready_rows: int | None = None) -> int:
        """The most any row may draft this step (0: plain step for all) for a batch of `rows` rows.
        unread_prompt_tokens: prompt tokens the drafters of rows that never drafted would have to read
        first (a one-off cost a drafting step pays). ready_rows: rows whose drafter has read its prompt
        (None: all); a probe uses one of them, and is skipped when there is none, so it never pays a
        prompt reading. Lookup drafts (`plan_free`) are planned apart: the cost here is the model's."""
        self.rows = rows
        if rows == 1:
            self.batch_cap = None  # one sequence: the per-step rule of `plan`
            return self.max_k
        self._probe_rows = None
        t = lambda positions: self.costs.verify_time(positions, rows)  # noqa: E731
        t_draft = self.costs.draft_time() if self.costs.draft_token_s else None
        alpha = min(self.first_accept.value, 0.99)
        # Nothing measured yet (a server that starts under load): no model drafting on a guess. A whole batch
        # drafting at full length, every row first reading its prompt, cost 5 s in one step on the Qwen pair.
        # One-row phases measure the draft model; lookup drafts (plan_free) still run meanwhile.
        best_k = 0
        if t(1) is not None and t_draft is not None:
            best_rate = self.BATCH_MIN_GAIN * rows / t(1)
            catch_up = unread_prompt_tokens * (self.costs.draft_prefill_token_s.value or 0.0)
            for k in range(1, self.max_k + 1):
                expected = rows * (1 - alpha ** (k + 1)) / (1 - alpha)  # 1 + alpha + ... + alpha^k per row
                rate = expected / (rows * k * t_draft + t(k + 1) + catch_up)
                if rate > best_rate:
                    best_k, best_rate = k, rate
            if best_k == 0:
                self.batch_plain_steps += 1
                if self.batch_plain_steps >= self.probe_every * rows:  # now and then, see if drafting pays again
                    self.batch_plain_steps = 0
                    if ready_rows is None or ready_rows > 0:
                        best_k, self._probe_rows = 1, 1  # cheaply: one row, one token
            else:
                self.batch_plain_steps = 0
        self.batch_decisions.setdefault(rows, [0, 0])[best_k > 0] += 1
        self.batch_cap = best_k
        return best_k

    FREE_MIN_GAIN = 1.05  # lookup drafts switch nothing on (no prompt reading): a small margin for estimate noise

    def plan_free(self, rows: int, drafts: list) -> int:
        """When model drafting does not pay for the batch: how many tokens of each row's free (lookup)
        draft to verify. The pass is as wide as its widest row, so every row pays for the widest draft;
        the length maximises the batch's expected tokens per second from the measured acceptance by
        position of each draft's source (0: a plain step)."""
        longest = max((d.length for d in drafts), default=0)
        t = lambda positions: self.costs.verify_time(positions, rows)  # noqa: E731
        if not longest or t(1) is None:
            return 0
        expected = [self._expected_accepted(d.source, d.length) for d in drafts if d.length]
        best_n, best_rate = 0, self.FREE_MIN_GAIN * rows / t(1)
        for n in range(1, longest + 1):
            rate = (rows + sum(e[min(n, len(e)) - 1] for e in expected)) / t(n + 1)
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n

    def _expected_accepted(self, source: str, length: int) -> list[float]:
        """[n - 1]: expected accepted tokens of the first n tokens of a draft without confidences (n-gram),
        from the source's measured acceptance by position."""
        accept = self._position_accept(source)
        expected, survive, total = [], 1.0, 0.0
        for j in range(length):
            survive *= accept[min(j, len(accept) - 1)].value
            total += survive
            expected.append(total)
        return expected

    def keep_going(self, drafted: int, confidence: float) -> bool:
        """After `drafted` tokens, the last with draft confidence `confidence`: draft one more?"""
        t_draft = self.costs.draft_time()
        if not t_draft:
            return True  # nothing measured yet: draft the full length once
        accept, leaf_hit = self.calibrator.predict(confidence), self._leaf_hit()
        self._expected += self._survive * (accept + (1 - accept) * leaf_hit)  # this token, or a leaf at its place
        self._survive *= accept
        verify = self._verify_model_draft
        self._elapsed += t_draft + verify(drafted + 1) - verify(drafted)
        gain = self._survive * (accept + (1 - accept) * leaf_hit)  # the next token is predicted to fare like this one
        cost = t_draft + verify(drafted + 2) - verify(drafted + 1)
        return gain / max(cost, 1e-9) > self._expected / max(self._elapsed, 1e-9)

    def _position_accept(self, source: str) -> list[Ema]:
        return self.position_accept.setdefault(source, [Ema(0.2, 0.5) for _ in range(self.max_k)])

    def trim(self, draft):
        """Cut a draft made all at once (no confidence: n-gram) to the length that maximises expected
        tokens per second, from its measured acceptance by position; verify cost is what it risks."""
        if draft.confidence is not None or draft.length == 0 or self.costs.verify_time(1, self.rows) is None:
            return draft
        best_len, best_rate = 0, 1 / max(self._verify(1), 1e-9)
        for n, accepted in enumerate(self._expected_accepted(draft.source, draft.length), 1):
            rate = (1 + accepted) / max(self._verify(n + 1), 1e-9)
            if rate > best_rate:
                best_len, best_rate = n, rate
        widest = self.costs.widest()
        if self.rows == 1 and best_len + 1 == widest and draft.length > best_len:
            # The best length is the widest pass ever measured and the draft runs on: past it the cost is only a
            # conservative guess that would keep every later draft this short. One pass this wide measures it.
            best_len = draft.length
        if best_len == 0 and self.lookup_skips >= self.lookup_probe_interval:  # probe now and then, less while they lose
            best_len, self.lookup_skips = 1, 0
            self.lookup_probe_interval = min(2 * self.lookup_probe_interval, self.MAX_PROBE_INTERVAL)
        elif best_len == 0:
            self.lookup_skips += 1
        draft.truncate(best_len)
        return draft

    def rows_changed(self) -> None:
        """A row joined or left: the next passes are not comparable with the last one's (pass line)."""
        self.pass_line.new_context()

    def observe_pass(self, positions: int, rows: int, seconds: float) -> None:
        """A verify pass of `rows` rows x `positions` positions (the batch's widest draft + 1) took `seconds`.
        A row alone's passes also draw its pass line."""
        self.costs.observe_verify(positions, seconds, rows)
        if rows == 1:
            self.pass_line.observe(positions, seconds)

    def observe_row(
        self, source: str, confidences: list[float] | None, drafted: int, accepted: int, draft_s: float,
        leaf_used: bool | None = None, positions: int | None = None,
    ) -> None:
        """What one row drafted in `draft_s` seconds and how much of it the target accepted (leaf_used: whether
        a tree leaf held the correction, None: the draft had no leaves; positions: what the row's pass scored,
        more than drafted + 1 with leaves)."""
        before = self.costs.draft_token_s.get(source)
        if drafted and before is not None and before.value and draft_s / drafted < self.REGIME_CHANGE * before.value:
            self.probe_interval = self.probe_every  # drafting got much cheaper (a busy stretch over): probe again soon
        self.costs.observe_draft(source, drafted, draft_s)
        if leaf_used is not None and drafted and positions:
            self.leaves_per_token.update((positions - 1 - drafted) / drafted)
        if leaf_used is not None and accepted < drafted:
            self.leaf_hit.update(1.0 if leaf_used else 0.0)
        if not drafted:
            return
        self.first_accept.update(1.0 if accepted else 0.0)
        if confidences:
            self.calibrator.update(confidences, accepted)
        else:
            if accepted:
                self.lookup_probe_interval = self.probe_every
            accept = self._position_accept(source)
            for j in range(min(drafted, accepted + 1, len(accept))):
                accept[j].update(1.0 if j < accepted else 0.0)
