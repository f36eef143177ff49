"""Where a lookup draft crosses the end of a sentence. A copy of prose breaks there far more often than inside a
sentence: a summary quotes its article a sentence at a time, then says something of its own. Replayed over the suffix
drafter's drafts along the target's answers (48 Spec-Bench prompts), a copy that was right up to a sentence's end went
on right 62-75 % of the time in summaries and 0 % in rag, conversation and math answers, against 98-99.5 % inside a
sentence; in code edits (docstrings and comments copied whole) 100 % (docs/results.md, session 44). So the position
after a sentence's end has a rate of its own, by source (measurements.Measurements.after_sentence_rate), and is priced
at the lower of it and the class's rate for every later position: a draft that crosses no sentence end is priced as
without it."""

from __future__ import annotations

import functools

import numpy as np

SENTENCE_ENDS = (".", "!", "?")


class SentenceEnds:
    """Which tokens of a vocabulary end a sentence. A sentence ends after a token whose text, stripped of trailing white
    space, ends with . ! or ?, where white space follows (in that token or at the start of the next): `x.y` and `1.5`
    end none. Only tokens whose raw form holds one of those marks are decoded (~7k of Qwen's 152k, ~0.25 s); whether
    a token starts with white space is decoded when a draft asks."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        raw = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        marked = [i for i, r in enumerate(raw) if r and any(mark in r for mark in SENTENCE_ENDS)]
        texts = tokenizer.batch_decode([[i] for i in marked]) if marked else []
        # by token id, and one more entry (False) that every id outside the vocabulary is read as
        self.ends = np.zeros(len(raw) + 1, dtype=bool)  # the token's text ends with a mark (white space after it aside)
        self.spaced = np.zeros(len(raw) + 1, dtype=bool)  # ...and white space follows the mark in the token itself
        for i, text in zip(marked, texts):
            stripped = text.rstrip()
            self.ends[i] = stripped[-1:] in SENTENCE_ENDS
            self.spaced[i] = self.ends[i] and len(stripped) < len(text)
        self._leading_space: dict[int, bool] = {}

    def after(self, tokens) -> np.ndarray | None:
        """[n] bool: a sentence ended just before each of the draft's tokens (a tensor or a list); None where none did,
        as in most drafts. Position 0 is never marked: the first token has a rate of its own."""
        ids = tokens.numpy() if hasattr(tokens, "numpy") else np.asarray(tokens)
        if len(ids) < 2:
            return None
        ends = self.ends[np.clip(ids[:-1], -1, len(self.ends) - 1)]  # -1: the entry past the vocabulary
        if not ends.any():
            return None
        marks = np.zeros(len(ids), dtype=bool)
        for i in np.flatnonzero(ends).tolist():
            marks[i + 1] = self.spaced[ids[i]] or self._starts_with_space(int(ids[i + 1]))
        return marks

    def _starts_with_space(self, token: int) -> bool:
        if token not in self._leading_space:
            self._leading_space[token] = 0 <= token < len(self.ends) - 1 and self.tokenizer.decode([token])[:1].isspace()
        return self._leading_space[token]


@functools.lru_cache(maxsize=4)
def sentence_ends(tokenizer) -> SentenceEnds:
    """The table of a tokenizer, made once."""
    return SentenceEnds(tokenizer)
