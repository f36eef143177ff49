"""What running has measured, in one object both policies read (a row alone: adaptive.AdaptiveK; a batch:
batch.BatchPolicy): costs of draft tokens and passes, how acceptance follows confidence and draft position, and
how often tree leaves hold the correction. Only `AdaptiveK.observe` writes it."""

from __future__ import annotations

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
            if accept[j].value is None:  # first judged: from what it was assumed to be
                accept[j].value = before[j]
            accept[j].update(1.0 if j < accepted else 0.0)
