"""What running has measured, in one object both policies read (a row alone: adaptive.AdaptiveK; a batch:
batch.BatchPolicy): costs of draft tokens and passes, how acceptance follows confidence and draft position, and
how often tree leaves hold the correction. Only `AdaptiveK.observe` writes it."""

from __future__ import annotations

import copy

from ..drafters.base import CONTESTED
from . import priors
from .costs import ConfidenceCalibrator, CostModel, Ema, PassCostLine
from .hindsight import Verdict
from .sentences import SentenceEnds


def match_class(match_len: int) -> int:
    """Lookup drafts are told apart by how long a match they came from: 0 (none given), 1, 2, 3, 4-7, 8-15, 16+."""
    return match_len if match_len < 4 else min(4 + (match_len.bit_length() - 3), 6)


class CopyRate:
    """P(a lookup draft's token is right | the draft's tokens before it were), one rate for every position past the
    first, from decayed counts of the positions judged (their weight halves every ~35 judged positions). A copy breaks
    at an edit, not more often deep in a draft: a moving average per position held a class right 98 % of the time at
    15-token drafts for many drafts after one rejection at a deep position, which only that position's own judgements
    could lift (docs/results.md, session 23)."""

    def __init__(self, prior: float):
        self.judged, self.rejected = priors.COPY_PRIOR_WEIGHT, priors.COPY_PRIOR_WEIGHT * (1 - prior)

    @property
    def value(self) -> float:
        return 1 - self.rejected / self.judged

    def update(self, right: int, wrong: int) -> None:
        kept = priors.COPY_DECAY ** (right + wrong)
        self.judged = self.judged * kept + right + wrong
        self.rejected = self.rejected * kept + wrong


class Measurements:
    def __init__(self):
        self.costs = CostModel()
        self.calibrator = ConfidenceCalibrator()
        self.first_accept = Ema(priors.EMA_ALPHA, priors.FIRST_ACCEPT)  # a step's first draft token, any confidence
        self.pass_line = PassCostLine()  # one sequence's verify cost by width (the table serves batches)
        # Lookup drafts (no confidence), by (source, match class): P(the first token is right), and P(a later one is |
        # the ones before it were)
        self.lookup: dict[tuple[str, int], tuple[Ema, CopyRate]] = {}
        self.judged_lookups: set[tuple[str, int]] = set()  # (source, match class) with a draft judged
        # P(a lookup's token is right | the ones before it were, and a sentence ended just before it), by source:
        # where the vocabulary is known (`sentences`), a position after a sentence's end is priced at the lower of
        # this and its class's later rate (control/sentences.py)
        self.sentences: SentenceEnds | None = None
        self.after_sentence: dict[str, CopyRate] = {}
        # At a rejection one of the tree leaves is the target's correction this often (one more token)
        self.leaf_hit = Ema(priors.LEAF_HIT_ALPHA, priors.LEAF_HIT)
        self.leaves_per_token = Ema(priors.EMA_ALPHA)  # leaves a drafted token carried (unlikely ones are left out)

    def leaf_hit_rate(self, leaves: bool) -> float:
        return self.leaf_hit.value if leaves else 0.0

    def expected_accepted(self, source: str, length: int, match_len: int = 0, tokens=None) -> list[float]:
        """[n - 1]: expected accepted tokens of the first n tokens of a draft without confidences (a lookup), from the
        measured acceptance of drafts from that source with a match of about that length (and, given its tokens,
        at a sentence's end)."""
        first, later = self.lookup_rates(source, match_len)
        marks = self._sentence_marks(tokens)
        if marks is None:
            return _expected(first.value, later.value, length)
        return _expected(first.value, later.value, length, marks, min(self.after_sentence_rate(source).value, later.value))

    def after_sentence_rate(self, source: str) -> CopyRate:
        """The source's rate after a sentence's end; a refined source ("suffix/chain") starts from its parent's."""
        if source not in self.after_sentence:
            parent, slash, _ = source.rpartition("/")
            self.after_sentence[source] = (copy.deepcopy(self.after_sentence[parent]) if slash and parent in self.after_sentence
                                           else CopyRate(priors.AFTER_SENTENCE_ACCEPT))
        return self.after_sentence[source]

    def _sentence_marks(self, tokens):
        """Where a sentence ended before each of a draft's tokens; None where none did (or the vocabulary is not known)."""
        return None if tokens is None or self.sentences is None else self.sentences.after(tokens)

    def lookup_rates(self, source: str, match_len: int) -> tuple[Ema, CopyRate]:
        """The first token's rate and the later tokens', both starting from the match class's prior: a later position
        is no less likely right than the first (a rate of its own, lower, kept lookups at one token forever, since a
        position never drafted is never measured). A refined source ("suffix/chain": drafts a source makes on stronger
        evidence) starts from where its parent's rates for that class stand, then learns its own: at a fixed prior
        its first bets were as wide as long copies are here, where the traffic had already taught that its long
        copies break early (a summary: 0.98x -> 0.87x in replay). A contested short match ("suffix/contested") is
        the exception: its first token starts from priors.CONTESTED_ACCEPT, whatever its parent and siblings stand at."""
        key = (source, match_class(match_len))
        contested = source.endswith(CONTESTED)
        if key not in self.lookup:
            parent, slash, _ = source.rpartition("/")
            prior = priors.POSITION_ACCEPT_BY_MATCH[key[1]]
            if contested:  # its first token is its own evidence; later ones copy as the class's do
                self.lookup[key] = Ema(priors.EMA_ALPHA, priors.CONTESTED_ACCEPT), CopyRate(prior)
            elif slash and (parent, key[1]) in self.lookup:
                first, later = self.lookup[(parent, key[1])]
                self.lookup[key] = copy.deepcopy(first), copy.deepcopy(later)
            else:
                self.lookup[key] = Ema(priors.EMA_ALPHA, prior), CopyRate(prior)
        if key[1] in priors.SHORT_MATCH_CLASSES and not contested and key not in self.judged_lookups:
            self._start_from_siblings(key)
        return self.lookup[key]

    def _start_from_siblings(self, key: tuple[str, int]) -> None:
        """A short match class not judged yet starts its first token's rate where its judged short siblings (same
        source) stand against their priors: the text, more than the match's length, decides whether short matches
        copy, so fresh text pays one bet on short matches, not one per class."""
        source, cls = key
        shifts = [self.lookup[(source, c)][0].value - priors.POSITION_ACCEPT_BY_MATCH[c]
                  for c in priors.SHORT_MATCH_CLASSES if (source, c) in self.judged_lookups]
        if shifts:
            start = priors.POSITION_ACCEPT_BY_MATCH[cls] + sum(shifts) / len(shifts)
            self.lookup[key][0].value = min(max(start, 0.0), 1.0)

    def observe_hindsight(self, verdict: Verdict) -> None:
        """A lookup draft judged whole against what its row committed (`Hindsight`): a draft the step did not verify
        counts as if verified whole; one whose verified part was all accepted adds the positions past it (the verified
        part was observed at its step)."""
        if not verdict.verified:
            self.observe_lookup(verdict.source, verdict.match_len, verdict.judged, verdict.right, verdict.tokens)
        elif verdict.right >= verdict.verified and verdict.judged > verdict.verified:
            self._observe_later(verdict.source, verdict.match_len, verdict.verified, verdict.right, verdict.judged,
                                verdict.tokens)

    def observe_lookup(self, source: str, match_len: int, drafted: int, accepted: int, tokens=None) -> None:
        """A lookup draft of `drafted` tokens (`tokens`, where known), `accepted` of them accepted: positions up to the
        first rejection."""
        first, _ = self.lookup_rates(source, match_len)
        self.judged_lookups.add((source, match_class(match_len)))
        first.update(1.0 if accepted else 0.0)
        if accepted:
            self._observe_later(source, match_len, 1, accepted, drafted, tokens)

    def _observe_later(self, source: str, match_len: int, start: int, right: int, judged: int, tokens) -> None:
        """Positions start..judged - 1 of a draft judged: those before `right` right, the one at `right` (if judged)
        wrong. The class's later rate counts them all; those right after a sentence's end count in the source's rate
        there too."""
        _, later = self.lookup_rates(source, match_len)
        wrong = 1 if judged > right else 0
        later.update(right - start, wrong)
        marks = self._sentence_marks(tokens)
        if marks is not None:
            right_after = int(marks[start:right].sum())
            wrong_after = wrong if right < len(marks) and marks[right] else 0
            if right_after or wrong_after:
                self.after_sentence_rate(source).update(right_after, wrong_after)


def _expected(first: float, later: float, length: int, after_sentence=None, at_sentence: float = 0.0) -> list[float]:
    """[n - 1]: expected accepted tokens of a draft's first n tokens, the first right with probability `first` and each
    later one, given the ones before it, with `later` (`at_sentence` where `after_sentence` marks a sentence's end
    just before it)."""
    expected, survive, total = [], first, 0.0
    next_after = after_sentence[1:].tolist() if after_sentence is not None else []  # one conversion, not one a position
    for i in range(length):
        total += survive
        expected.append(total)
        survive *= at_sentence if i < len(next_after) and next_after[i] else later
    return expected
