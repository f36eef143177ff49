"""What running has measured, in one object both policies read (a row alone: adaptive.AdaptiveK; a batch:
batch.BatchPolicy): costs of draft tokens and passes, how acceptance follows confidence and draft position, and
how often tree leaves hold the correction. Only `AdaptiveK.observe` writes it."""

from __future__ import annotations

from dataclasses import dataclass

from . import priors
from .costs import ConfidenceCalibrator, CostModel, Ema, PassCostLine

LOOKUP_POSITIONS = 32  # acceptance is learned per position up to here (later ones fare like the last)


def match_class(match_len: int) -> int:
    """Lookup drafts are told apart by how long a match they came from: 0 (none given), 1, 2, 3, 4-7, 8-15, 16+."""
    return match_len if match_len < 4 else min(4 + (match_len.bit_length() - 3), 6)


def filled(accept: list[Ema]) -> list[float]:
    """Acceptance by position, a position not yet judged taken as the one before it."""
    values = []
    for ema in accept:
        values.append(ema.value if ema.value is not None else values[-1])
    return values


def _judged(position: Ema, assumed: float, accepted: bool) -> None:
    if position.value is None:  # first judged: from what it was assumed to be
        position.value = assumed
    position.update(1.0 if accepted else 0.0)


@dataclass
class _Shadow:
    source: str
    match_len: int
    tokens: tuple[int, ...]
    matched: int = 0  # its first tokens the row has committed so far


class LookupShadows:
    """Every lookup draft judged whole against the tokens its row goes on to commit, whether the pass verified all of
    it, a part or none: what a draft cut short (or to nothing) would have accepted is learned at no cost, where
    learning only from verified drafts left a match class priced at its prior once trim stopped verifying it. The
    committed tokens are the target's own (its argmax, or its draw: a lookup token is accepted with probability
    p(x), the chance a draw equals it), so each verdict is the one verifying the whole draft would have given."""

    def __init__(self):
        self._rows: dict[int, list[_Shadow]] = {}

    def observe(self, row: int, offered: tuple[int, ...], source: str, match_len: int,
                committed: tuple[int, ...]) -> list[tuple[str, int, int, bool]]:
        """Row `row` was offered `offered` (a lookup draft, or nothing) at this step and committed `committed`. Returns
        (source, match_len, position, accepted) of each draft position judged now: a position is learned as soon as
        its token is committed, not when its whole draft is (waiting for that left the trim on stale numbers)."""
        pending = self._rows.setdefault(row, [])
        if offered:
            pending.append(_Shadow(source, match_len, offered))
        judged, left = [], []
        for shadow in pending:
            for token in committed:
                accepted = token == shadow.tokens[shadow.matched]
                judged.append((shadow.source, shadow.match_len, shadow.matched, accepted))
                if not accepted:
                    break
                shadow.matched += 1
                if shadow.matched == len(shadow.tokens):
                    break
            else:
                left.append(shadow)
        self._rows[row] = left
        return judged

    def keep_rows(self, rows: tuple[int, ...]) -> None:
        """Rows that left: their unjudged drafts go (an answer that ended says nothing of them)."""
        self._rows = {row: pending for row, pending in self._rows.items() if row in rows}


class Measurements:
    def __init__(self):
        self.costs = CostModel()
        self.calibrator = ConfidenceCalibrator()
        self.first_accept = Ema(priors.EMA_ALPHA, priors.FIRST_ACCEPT)  # a step's first draft token, any confidence
        self.pass_line = PassCostLine()  # one sequence's verify cost by width (the table serves batches)
        # Lookup drafts (no confidence), by (source, match class): P(accept position j | the positions before accepted)
        self.position_accept: dict[tuple[str, int], list[Ema]] = {}
        # At a rejection one of the tree leaves is the target's correction this often (one more token)
        self.leaf_hit = Ema(priors.LEAF_HIT_ALPHA, priors.LEAF_HIT)
        self.leaves_per_token = Ema(priors.EMA_ALPHA)  # leaves a drafted token carried (unlikely ones are left out)
        self.shadows = LookupShadows()

    def leaf_hit_rate(self, leaves: bool) -> float:
        return self.leaf_hit.value if leaves else 0.0

    def expected_accepted(self, source: str, length: int, match_len: int = 0) -> list[float]:
        """[n - 1]: expected accepted tokens of the first n tokens of a draft without confidences (a lookup), from the
        measured acceptance by position of drafts from that source with a match of about that length."""
        accept = filled(self.accept_by_position(source, match_len))
        expected, survive, total = [], 1.0, 0.0
        for j in range(length):
            survive *= accept[min(j, len(accept) - 1)]
            total += survive
            expected.append(total)
        return expected

    def accept_by_position(self, source: str, match_len: int) -> list[Ema]:
        """Position 0 starts from the prior; a later position, until it is first judged, fares as the one before it
        (given the tokens before were right, the next one is no less likely): a prior of its own, lower, kept lookups
        at one token forever, since a position never drafted is never measured."""
        key = (source, match_class(match_len))
        if key not in self.position_accept:
            first = priors.POSITION_ACCEPT_BY_MATCH[key[1]]
            self.position_accept[key] = [Ema(priors.EMA_ALPHA, first if j == 0 else None) for j in range(LOOKUP_POSITIONS)]
        return self.position_accept[key]

    def observe_lookup(self, source: str, match_len: int, drafted: int, accepted: int) -> None:
        """A lookup draft of `drafted` tokens, `accepted` of them accepted: positions up to the first rejection."""
        accept = self.accept_by_position(source, match_len)
        before = filled(accept)
        for j in range(min(drafted, accepted + 1, len(accept))):
            _judged(accept[j], before[j], j < accepted)

    def observe_lookup_position(self, source: str, match_len: int, position: int, accepted: bool) -> None:
        """Position `position` of a lookup draft was judged (the ones before it accepted)."""
        accept = self.accept_by_position(source, match_len)
        if position < len(accept):
            _judged(accept[position], filled(accept)[position], accepted)
