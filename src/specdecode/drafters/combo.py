"""Lookup drafts (n-gram or suffix trees) where the context has a match, a draft model everywhere else."""

from __future__ import annotations

from .base import Draft, Drafter
from .ngram import NgramDrafter


class ComboDrafter(Drafter):
    name = "auto"

    def __init__(self, model: Drafter, lookup: Drafter | None = None, min_match: int = 3, lookup_stretch: int = 1):
        self.model, self.lookup, self.min_match = model, lookup or NgramDrafter(), min_match
        # Copied text runs long and lookup drafts cost nothing to make: lookup_stretch > 1 lets them run past the
        # model's k where the model would draft (the adaptive controller still trims them; `auto` uses 2).
        self.lookup_stretch = lookup_stretch
        self.name = f"auto({model.name})"

    @property
    def alternatives(self) -> int:
        return self.model.alternatives

    @property
    def forward_passes(self) -> int:
        return self.model.forward_passes

    def spawn(self) -> "ComboDrafter":
        return ComboDrafter(self.model.spawn(), self.lookup.spawn(), self.min_match, self.lookup_stretch)

    def reset(self) -> None:
        self.model.reset()
        self.lookup.reset()

    def forget_last_request(self) -> None:
        self.model.forget_last_request()
        self.lookup.forget_last_request()

    def begin(self, prompt_ids) -> None:
        self.lookup.begin(prompt_ids)

    def unread(self, input_ids) -> int:
        return self.model.unread(input_ids)

    def prefill(self, prompt_ids) -> None:
        self.model.prefill(prompt_ids)

    def check_vocab(self, vocab_size, tokenizer=None) -> None:
        self.model.check_vocab(vocab_size, tokenizer)

    def propose_free(self, input_ids, k) -> Draft:
        """The lookup's draft, whatever its match: the controller prices it by its match length."""
        return self.lookup.propose_free(input_ids, k)

    def propose(self, input_ids, k, sampling, draws, keep_going=None) -> Draft:
        # Where the model drafts, a long match predicts copying better than it; a short one is a coin toss it does better.
        draft = self.lookup.propose_free(input_ids, k * self.lookup_stretch)
        if draft.length and draft.match_len >= self.min_match:
            return draft
        return self.model.propose(input_ids, k, sampling, draws, keep_going)

    def commit(self, input_ids) -> None:
        self.model.commit(input_ids)
        self.lookup.commit(input_ids)
