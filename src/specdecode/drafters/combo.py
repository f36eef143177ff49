"""N-gram lookup where the context has a confident match, a draft model everywhere else."""

from __future__ import annotations

from .base import Draft, Drafter
from .model import ModelDrafter
from .ngram import NgramDrafter


class ComboDrafter(Drafter):
    name = "auto"

    def __init__(self, model: ModelDrafter, ngram: NgramDrafter | None = None, min_match: int = 3, ngram_stretch: int = 1):
        self.model, self.ngram, self.min_match = model, ngram or NgramDrafter(), min_match
        # Copied text runs long and n-gram drafts cost nothing to make: ngram_stretch > 1 lets them run
        # past k (the adaptive controller still trims them; `auto` uses 2).
        self.ngram_stretch = ngram_stretch
        self.name = f"auto({model.name})"

    @property
    def alternatives(self) -> int:
        return self.model.alternatives

    @property
    def forward_passes(self) -> int:
        return self.model.forward_passes

    def spawn(self) -> "ComboDrafter":
        return ComboDrafter(self.model.spawn(), self.ngram.spawn(), self.min_match, self.ngram_stretch)

    def reset(self) -> None:
        self.model.reset()
        self.ngram.reset()

    def unread(self, input_ids) -> int:
        return self.model.unread(input_ids)

    def prefill(self, prompt_ids) -> None:
        self.model.prefill(prompt_ids)

    def check_vocab(self, vocab_size, tokenizer=None) -> None:
        self.model.check_vocab(vocab_size, tokenizer)

    def propose_free(self, input_ids, k) -> Draft:
        # A long suffix match predicts copying well; a short one is a coin toss the model does better.
        draft = self.ngram.propose(input_ids, k * self.ngram_stretch, None, None)
        if draft.length and self.ngram.last_match_len >= self.min_match:
            return draft
        return Draft.empty(1, input_ids.device)

    def propose(self, input_ids, k, sampling, draws, keep_going=None) -> Draft:
        draft = self.propose_free(input_ids, k)
        if draft.length:
            return draft
        return self.model.propose(input_ids, k, sampling, draws, keep_going)

    def commit(self, input_ids) -> None:
        self.model.commit(input_ids)
