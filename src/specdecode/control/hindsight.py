"""Lookup drafts judged in hindsight: each draft a lookup offered is compared, whole, with the tokens the target went on
to commit, past the length the controller verified (or in full, where it verified none).

Judged only where verified, a class of lookups that the controller keeps short never shows how far it would have been
right: a one-token draft says nothing of the positions after it, and a draft cut to nothing says nothing at all, so
copies from short matches stayed undrafted however long they ran. Hindsight costs no pass: the tokens committed next
are the target's verdicts. It holds under sampling too: a lookup's token is accepted with probability p(token) (its
draft distribution is one-hot), the probability with which plain sampling commits that token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..sequence import Sequence


@dataclass(frozen=True)
class Verdict:
    """A lookup draft judged against its row's committed tokens: of the `judged` positions compared, the first `right`
    were right (judged > right: the next one was wrong); the first `verified` of them were verified by the step."""

    source: str
    match_len: int
    verified: int
    judged: int
    right: int
    tokens: list[int] | None = field(default=None, compare=False)  # the draft itself: where sentences end in it


@dataclass
class _Offered:
    tokens: list[int]  # the whole draft, from position `start` of its row's text
    source: str
    match_len: int
    verified: int
    start: int
    right: int = 0  # leading tokens found right so far


class Hindsight:
    """Offered lookup drafts per row, judged as their rows commit tokens."""

    def __init__(self):
        self.pending: dict[int, tuple[Sequence, list[_Offered]]] = {}  # by row serial

    def offer(self, seq: Sequence, tokens: list[int], source: str, match_len: int, verified: int) -> None:
        """A lookup draft of `tokens` offered to the row `seq` at its current end, `verified` of them in this step."""
        if tokens:
            record = _Offered(tokens, source, match_len, verified, seq.ids.shape[1])
            self.pending.setdefault(seq.serial, (seq, []))[1].append(record)

    def judge(self) -> list[Verdict]:
        """The verdicts the rows' committed tokens now give: at a wrong token, at the draft's end, or where its row
        finished first (what was judged by then)."""
        verdicts = []
        for serial in list(self.pending):
            seq, records = self.pending[serial]
            first = min(record.start + record.right for record in records)
            text = seq.ids[0, first:].tolist()
            still = []
            for record in records:
                known = text[record.start + record.right - first :]
                for token in known[: len(record.tokens) - record.right]:
                    if token != record.tokens[record.right]:
                        verdicts.append(Verdict(record.source, record.match_len, record.verified, record.right + 1,
                                                record.right, record.tokens))
                        break
                    record.right += 1
                else:
                    if record.right == len(record.tokens) or seq.finished:
                        if record.right:  # a row that ended before its next token says nothing
                            verdicts.append(Verdict(record.source, record.match_len, record.verified, record.right,
                                                    record.right, record.tokens))
                    else:
                        still.append(record)
            if still:
                self.pending[serial] = (seq, still)
            else:
                del self.pending[serial]
        return verdicts
