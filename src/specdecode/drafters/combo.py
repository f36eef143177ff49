"""N-gram lookup where the context has a confident match, a draft model or a short lookup everywhere else."""

from __future__ import annotations

import time

from .base import Draft, Drafter
from .model import ModelDrafter
from .ngram import NgramDrafter


class ComboDrafter(Drafter):
    """A suffix match of at least `min_match` tokens drafts by lookup (copying is likely). Without one, two
    ways compete: the draft model, or a lookup on a 1- or 2-token match (free to make, often wrong, but on
    text that copies its context the model's passes are pure cost). Each is scored by the tokens per second
    of the steps it drafted — measured from one propose to the next, so verify time, catch-up reading and
    plain steps all count — and the better one drafts; the other is tried now and then, less often each
    time it loses, so a change in the text can bring it back. The scores belong to one sequence."""

    name = "auto"
    EXPLORE_EVERY = 4  # fallback steps before the other way is first tried; doubles while it keeps losing
    EXPLORE_MAX = 32
    SHORT = "ngram-short"  # the source of short-match lookups: the controller learns their acceptance apart
    RATE_ALPHA = 0.3  # weight of the newest step in a way's moving average

    def __init__(self, model: ModelDrafter, ngram: NgramDrafter | None = None, min_match: int = 3, ngram_stretch: int = 1,
                 short_lookups: bool = True):
        self.model, self.ngram, self.min_match = model, ngram or NgramDrafter(), min_match
        # Copied text runs long and n-gram drafts cost nothing to make: ngram_stretch > 1 lets them run
        # past k (the adaptive controller still trims them; `auto` uses 2).
        self.ngram_stretch = ngram_stretch
        self.short_lookups = short_lookups
        self.name = f"auto({model.name})"
        self._reset_choice()

    def _reset_choice(self) -> None:
        self.rates: dict[str, float | None] = {"model": None, "lookup": None}  # tokens/s of the fallback steps each drafted
        self.fallback_steps = {"model": 0, "lookup": 0}
        self._explore_every, self._since_explore = self.EXPLORE_EVERY, 0
        self._last = None  # (way, exploring, start time, committed length, draft length) of the last fallback step

    @property
    def forward_passes(self) -> int:
        return self.model.forward_passes

    def spawn(self) -> "ComboDrafter":
        return ComboDrafter(self.model.spawn(), self.ngram.spawn(), self.min_match, self.ngram_stretch, self.short_lookups)

    def reset(self) -> None:
        self.model.reset()
        self.ngram.reset()
        self._reset_choice()

    def prefill(self, prompt_ids) -> None:
        self.model.prefill(prompt_ids)

    def check_vocab(self, vocab_size, tokenizer=None) -> None:
        self.model.check_vocab(vocab_size, tokenizer)

    def _lookup(self, input_ids, k) -> Draft:
        return self.ngram.propose(input_ids, k * self.ngram_stretch, None, None)

    def propose_free(self, input_ids, k) -> Draft:
        # A long suffix match predicts copying well; a short one is a coin toss the model does better.
        draft = self._lookup(input_ids, k)
        if draft.length and self.ngram.last_match_len >= self.min_match:
            return draft
        return Draft.empty(1, input_ids.device)

    def propose(self, input_ids, k, sampling, generator, keep_going=None) -> Draft:
        self._score_last_step(input_ids.shape[1])
        draft = self._lookup(input_ids, k)
        if draft.length and self.ngram.last_match_len >= self.min_match:
            return draft
        way, exploring = self._choose() if self.short_lookups else ("model", False)
        start = time.perf_counter()
        if way == "lookup":
            draft.source = self.SHORT  # may be empty (no match at all): a plain step
        else:
            draft = self.model.propose(input_ids, k, sampling, generator, keep_going)
        self._last = (way, exploring, start, input_ids.shape[1], draft.length)
        return draft

    def _choose(self) -> tuple[str, bool]:
        """The way with the better measured rate (the model until the other has one); now and then the other."""
        model, lookup = self.rates["model"], self.rates["lookup"]
        best = "lookup" if lookup is not None and (model is None or lookup > model) else "model"
        self._since_explore += 1
        if self._since_explore >= self._explore_every:
            self._since_explore = 0
            return ("model" if best == "lookup" else "lookup"), True
        return best, False

    def _score_last_step(self, committed_len: int) -> None:
        """Score the last fallback step by its tokens per second, if exactly one step followed it."""
        if self._last is None:
            return
        way, exploring, start, before, drafted = self._last
        self._last = None
        gained = committed_len - before
        if not 1 <= gained <= drafted + 1:  # plain steps came between, or another sequence: no clean sample
            return
        leader = lambda: max(self.rates, key=lambda w: self.rates[w] or 0.0)  # noqa: E731
        leader_before = leader()
        rate, old = gained / max(time.perf_counter() - start, 1e-9), self.rates[way]
        self.rates[way] = rate if old is None else (1 - self.RATE_ALPHA) * old + self.RATE_ALPHA * rate
        self.fallback_steps[way] += 1
        if exploring:  # lost again: try it less often; won: it leads now, and the other gets explored soon
            lost = leader() == leader_before
            self._explore_every = min(2 * self._explore_every, self.EXPLORE_MAX) if lost else self.EXPLORE_EVERY

    def commit(self, input_ids) -> None:
        self.model.commit(input_ids)
