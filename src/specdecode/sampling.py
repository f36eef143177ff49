"""Logits -> processed probabilities, and seeded sampling.

Speculative sampling is lossless when q is the distribution the draft really sampled its token from (the
target's p is processed as the user asked; q may be anything that covers the draft's choice). Both go through
`kept_distribution` with the same parameters because a q close to p is accepted more often, not for correctness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .verify import argmax, gumbel_max, keyed_accept, sample_tokens, speculative_accept

# As vLLM's sampling epsilon: logits of ~1e2 over 1e-5 stay far inside fp32's range.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 mean no truncation. A temperature below
    GREEDY_BELOW is greedy too: dividing logits by it would overflow to inf, and its limit is the argmax."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def draws(self) -> "StreamDraws | KeyedDraws | None":
        """Where this request's random choices come from: none when greedy; keyed by position when seeded (the text
        is then the seed's whatever the steps drafted); else one stream started from torch's global generator (so
        `torch.manual_seed` makes a script reproducible, as with transformers' generate)."""
        if self.greedy:
            return None
        if self.seed is not None:
            return KeyedDraws(self.seed)
        return StreamDraws(torch.Generator().manual_seed(int(torch.randint(0, 2**62, ()))))


@dataclass(frozen=True)
class Kept:
    """A processed distribution over the tokens top-k / top-p keep: probs [..., C] of the token ids [..., C], most
    likely first (columns past a position's kept tokens at 0), or over the whole vocabulary (ids None). A sampled
    row is judged on these: over Qwen's 151,936 tokens a dozen vocabulary-wide ops cost ~1.4 ms a position right
    after a pass (AMD EPYC, one torch thread), the kept ones almost nothing."""

    probs: torch.Tensor
    ids: torch.Tensor | None
    vocab: int

    def dense(self) -> torch.Tensor:
        """[..., V] probabilities, 0 outside the kept tokens."""
        if self.ids is None:
            return self.probs
        zeros = self.probs.new_zeros(*self.probs.shape[:-1], self.vocab)  # on the device the logits were
        return zeros.scatter_(-1, self.ids, self.probs)


def kept_distribution(logits: torch.Tensor, params: SamplingParams) -> Kept:
    """[..., V] logits -> the sampled distribution after temperature, top-k (exactly k tokens) and top-p (the fewest
    most likely tokens whose mass reaches top_p; the most likely always stays), not greedy."""
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if params.top_k and params.top_k < vocab:
        values, ids = torch.topk(logits, params.top_k, dim=-1)
        ranked = values.softmax(-1)
    elif params.top_p < 1.0:
        ranked, ids = _ranked(logits.softmax(-1), params.top_p)
    else:
        return Kept(logits.softmax(-1), None, vocab)
    if params.top_p < 1.0:
        cumulative = ranked.cumsum(-1)
        keep = cumulative - ranked < params.top_p
        keep[..., 0] = True  # even when top_p rounds to 0 in fp32 (5e-324 did)
        # the mass kept, as the running sum at the last kept token: the same bits whatever the candidates were, so a
        # position's draws are the same in a step of any width (a seed's text does not depend on drafting)
        mass = cumulative.gather(-1, keep.sum(-1, keepdim=True) - 1)
        ranked = ranked.masked_fill(~keep, 0.0) / mass
    return Kept(ranked, ids, vocab)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities after temperature, top-k and top-p (`kept_distribution`).

    Greedy params give the one-hot of the argmax, so greedy is the temperature -> 0 limit.
    """
    if params.greedy:
        logits = logits.float()
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    return kept_distribution(logits, params).dense()


# Tokens ranked before a wider ranking, then a full sort, is needed. Over Qwen's 151,936 tokens on one torch thread
# (AMD EPYC AVX-512): top 64 0.3-0.4 ms, top 1,024 0.7-0.9 ms, top 16,384 2.9 ms, a full sort ~14 ms a row. Sampled
# at temperature 1 and top-p 0.95 (Spec-Bench, Qwen2.5-Coder 1.5B) the nucleus held more than 64 tokens at 11 % of
# positions, more than 1,024 at 2.3 %, more than 16,384 at 0.13 %.
NUCLEUS_CANDIDATES = (64, 1024, 16384)


def _ranked(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities most likely first, their token ids) over the fewest NUCLEUS_CANDIDATES that reach top_p in
    every row (the nucleus then lies among them), over the whole sorted vocabulary when none do."""
    for candidates in NUCLEUS_CANDIDATES:
        if candidates >= probs.shape[-1]:
            break
        ranked, ids = torch.topk(probs, candidates, dim=-1)
        if bool((ranked.cumsum(-1)[..., -1] >= top_p).all()):  # the running sum the nucleus is cut by
            return ranked, ids
    return torch.sort(probs, dim=-1, descending=True)


class StreamDraws:
    """Random choices from one stream, in the order they are made (requests without a seed). Drafts are judged by
    the optimal lossless rule, min(1, p/q) and the residual (verify.speculative_accept); which draws a step
    consumes depends on how much it drafted, so the text depends on the drafting decisions (not its distribution)."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def sample(self, p: Kept, position: int) -> torch.Tensor:
        """A [B, ...] distribution -> [B] token ids."""
        index = sample_tokens(p.probs, self.generator)
        return index if p.ids is None else p.ids.gather(-1, index[:, None]).squeeze(-1)

    def accept(self, draft_tokens, draft_probs, target: Kept, start: int):
        return speculative_accept(draft_tokens, draft_probs, target.probs, self.generator, target_ids=target.ids)

    def forget_before(self, position: int) -> None:
        pass


class KeyedDraws:
    """Random choices keyed by (seed, position) (seeded requests): the token at position i is argmax(log p_i + g_i),
    with Gumbel noise g_i drawn from a generator keyed by the whole 64-bit seed and i. That is an exact sample from
    p_i (Gumbel-max) and depends on nothing else, so a seed gives the same text whether steps drafted or not, and
    however long the drafts were. A draft samples its q with the same g_i (verify.keyed_accept), so a draft near the
    target often proposes the target's own token; a drafted token is accepted iff it is that token. Acceptance is
    a little below min(1, p/q)'s (Gumbel coupling agrees with probability >= (1 - TV) / (1 + TV) against 1 - TV);
    n-gram drafts (q one-hot) are accepted exactly as often."""

    def __init__(self, seed: int):
        if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**64:
            raise ValueError(f"seed must be a 64-bit integer, got {seed!r}")
        self.seed = seed % 2**64  # signed and unsigned spellings of one 64-bit value are one seed
        self._noise: dict[int, torch.Tensor] = {}

    def noise(self, position: int, vocab: int) -> torch.Tensor:
        """Gumbel noise [V] of a position (the same for the draft and the target)."""
        g = self._noise.get(position)
        if g is None or g.shape[0] != vocab:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, position])))
            u = rng.random(vocab, dtype=np.float32)
            g = torch.from_numpy(-np.log(-np.log(u)))  # u = 0 gives -inf: that token is never drawn
            self._noise[position] = g
        return g

    def forget_before(self, position: int) -> None:
        """Positions before this one are committed: their noise is never asked for again."""
        for old in [p for p in self._noise if p < position]:
            del self._noise[old]

    def sample(self, p: Kept, position: int) -> torch.Tensor:
        """A [B, ...] distribution -> [B] token ids (each row at the same position)."""
        return gumbel_max(p.probs, self.noise(position, p.vocab), p.ids)

    def accept(self, draft_tokens, draft_probs, target: Kept, start: int):
        """target [1, n+1, ...] at positions start.. : the target's own keyed tokens there, and the draft's longest
        prefix that equals them."""
        noise = torch.stack([self.noise(start + j, target.vocab) for j in range(target.probs.shape[1])])
        return keyed_accept(draft_tokens, target.probs, noise, target.ids)
