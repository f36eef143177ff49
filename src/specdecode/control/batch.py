"""Load-aware control: one decision for all rows of a batch, because the verify pass is as wide as its widest row."""

from __future__ import annotations

from dataclasses import dataclass

from . import priors
from .measurements import Measurements


def most_saving(saved: list[float]) -> int:
    """[n - 1]: seconds a draft cut to n tokens saves -> the n that saves most (0: none saves any)."""
    best = max(range(len(saved)), key=saved.__getitem__, default=None)
    return 0 if best is None or saved[best] <= 0 else best + 1


@dataclass
class BatchDecision:
    """The batch's draft cap for one step (None: a row alone, decided by the single-sequence rule; 0: no model
    drafts). During a probe only `probe_rows` rows (those whose drafter has read its prompt) may draft."""

    rows: int
    cap: int | None
    probe_rows: int | None = None

    def row_length(self, max_len: int, ready: bool) -> int:
        """How much one row may draft under the cap (a probe: the first ready row one token, the others none)."""
        if not self.cap:
            return 0
        if self.probe_rows is not None:
            if self.probe_rows == 0 or not ready:
                return 0
            self.probe_rows -= 1
        return min(self.cap, max_len)


class BatchPolicy:
    """The draft cap k maximising the batch's expected tokens per second, where drafting costs every row's draft
    time (rows draft one after another) and verifying costs a pass of rows x (k + 1) tokens. As the batch grows
    verification stops being free and the cap falls to 0 (plain decoding). Within the cap, each row still stops
    early by the single-sequence marginal rule, charged its share of the pass. When the cap is 0, drafts that cost
    no model pass (n-gram lookups) may still pay: `plan_free` picks how much of them to verify."""

    def __init__(self, measured: Measurements, max_k: int, probe_every: int = priors.PROBE_EVERY):
        self.measured, self.max_k, self.probe_every = measured, max_k, probe_every
        self.plain_steps = 0
        self.decisions: dict[int, list[int]] = {}  # rows -> [plain steps, speculative steps]

    def plan(self, rows: int, unread_prompt_tokens: int = 0, ready_rows: int | None = None,
             reading: int = 0) -> BatchDecision:
        """The most any row may draft this step for a batch of `rows` rows. unread_prompt_tokens: prompt tokens the
        drafters of rows that never drafted would have to read first (a one-off cost a drafting step pays).
        ready_rows: rows whose drafter has read its prompt (None: all); a probe uses one of them, and is skipped when
        there is none, so it never pays a prompt reading. Lookup drafts (`plan_free`) are planned apart: the cost
        here is the model's. reading: prompt tokens the step's pass reads beside the rows (the rows' positions are
        then priced at what each adds to that pass)."""
        if reading:
            return self._plan_beside_reading(rows, unread_prompt_tokens)
        if rows == 1:
            return BatchDecision(1, None)
        costs = self.measured.costs
        t = lambda positions: costs.verify_time(positions, rows)  # noqa: E731
        t_draft = costs.draft_time() if costs.draft_token_s else None
        alpha = min(self.measured.first_accept.value, 0.99)
        # Nothing measured yet (a server that starts under load): no model drafting on a guess. A whole batch
        # drafting at full length, every row first reading its prompt, is the dearest step there is.
        best_k, probe_rows = 0, None
        if costs.verify_time(1, rows) is not None and t_draft is not None:
            best_rate = priors.BATCH_MIN_GAIN * rows / t(1)
            catch_up = unread_prompt_tokens * (costs.draft_prefill_token_s.value or 0.0)
            for k in range(1, self.max_k + 1):
                expected = rows * (1 - alpha ** (k + 1)) / (1 - alpha)  # 1 + alpha + ... + alpha^k per row
                rate = expected / (rows * k * t_draft + t(k + 1) + catch_up)
                if rate > best_rate:
                    best_k, best_rate = k, rate
            if best_k == 0:
                self.plain_steps += 1
                if self.plain_steps >= self.probe_every * rows:  # now and then, see if drafting pays again
                    self.plain_steps = 0
                    if ready_rows is None or ready_rows > 0:
                        best_k, probe_rows = 1, 1  # cheaply: one row, one token
            else:
                self.plain_steps = 0
        self.decisions.setdefault(rows, [0, 0])[best_k > 0] += 1
        return BatchDecision(rows, best_k, probe_rows)

    def _plan_beside_reading(self, rows: int, unread_prompt_tokens: int) -> BatchDecision:
        """The cap that saves the most time in a pass that also reads a prompt chunk (a row alone too): each drafted
        position costs what it adds to that pass and each accepted token saves its share of a plain step later. On a
        CPU, where a position there costs about a prompt token, model drafts (plus their own time) seldom pay; no
        probes here."""
        costs = self.measured.costs
        riding = costs.riding(rows)
        if riding is None or not costs.draft_token_s:
            return BatchDecision(rows, 0)
        per_position, saves = riding
        alpha = min(self.measured.first_accept.value, 0.99)
        spent = costs.draft_time() + per_position
        catch_up = unread_prompt_tokens * (costs.draft_prefill_token_s.value or 0.0)
        best_k, best_saved = 0, 0.0
        for k in range(1, self.max_k + 1):
            accepted = rows * (alpha - alpha ** (k + 1)) / (1 - alpha)  # alpha + ... + alpha^k per row
            saved = accepted * saves - priors.BATCH_MIN_GAIN * (rows * k * spent + catch_up)
            if saved > best_saved:
                best_k, best_saved = k, saved
        return BatchDecision(rows, best_k)

    def plan_free(self, rows: int, drafts: list, reading: int = 0) -> int:
        """When model drafting does not pay for the batch: how many tokens of each row's free (lookup)
        draft to verify. The pass is as wide as its widest row, so every row pays for the widest draft;
        the length maximises the batch's expected tokens per second from the measured acceptance by
        position of each draft's source (0: a plain step); reading: prompt tokens the pass reads beside the rows."""
        longest = max((d.length for d in drafts), default=0)
        if not longest or self.measured.costs.verify_time(1, rows) is None:
            return 0
        expected = [self.measured.expected_accepted(d.source, d.length, d.match_len, d.tokens[0]) for d in drafts
                    if d.length]
        if reading:  # each row's drafted positions add to the reading pass (rows are not padded there)
            per_position, saves = self.measured.costs.riding(rows)
            saved = [sum(e[min(n, len(e)) - 1] for e in expected) * saves
                     - priors.FREE_MIN_GAIN * per_position * sum(min(len(e), n) for e in expected)
                     for n in range(1, longest + 1)]
            return most_saving(saved)
        t = lambda positions: self.measured.costs.verify_time(positions, rows)  # noqa: E731
        best_n, best_rate = 0, priors.FREE_MIN_GAIN * rows / t(1)
        for n in range(1, longest + 1):
            rate = (rows + sum(e[min(n, len(e)) - 1] for e in expected)) / t(n + 1)
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n
