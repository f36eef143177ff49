"""Prompt lookup: copy what followed the latest earlier occurrence of the text's own suffix.

Costs no model pass; pays where the answer repeats the context (summaries, RAG, code edits).
"""

from __future__ import annotations

from .base import Draft, Drafter


class NgramDrafter(Drafter):
    name = "ngram"
    free = True

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, input_ids, k, sampling, draws, keep_going=None) -> Draft:
        ids = input_ids[0]
        L = ids.shape[0]
        # Longest suffix first: a longer match predicts the continuation better.
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = ids[L - n :]
            windows = ids[: L - 1].unfold(0, n, 1)  # [L-n, n]: every earlier n-gram (not the suffix itself)
            starts = (windows == suffix).all(-1).nonzero().flatten()
            if len(starts):
                follow = int(starts[-1]) + n  # latest match: the most local context
                tokens = ids[follow : follow + k]
                if len(tokens):
                    return Draft(tokens[None].clone(), source=self.name, match_len=n)
        return Draft.empty(1, input_ids.device)

    def propose_free(self, input_ids, k) -> Draft:
        return self.propose(input_ids, k, None, None)
