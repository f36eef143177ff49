"""Logits -> processed probabilities, and seeded sampling.

Speculative sampling is lossless when q is the distribution the draft really sampled its token from (the
target's p is processed as the user asked; q may be anything that covers the draft's choice). Both go through
`logits_to_probs` with the same parameters because a q close to p is accepted more often, not for correctness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .verify import argmax, keyed_accept, sample_tokens, speculative_accept

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


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities after temperature, top-k and top-p.

    Greedy params give the one-hot of the argmax, so greedy is the temperature -> 0 limit.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(outside_nucleus(logits, params.top_p), float("-inf"))
    return logits.softmax(-1)


# Tokens ranked before a wider ranking, then a full sort, is needed. Over Qwen's 151,936 tokens on one torch thread
# (AMD EPYC AVX-512): top 64 0.26 ms, top 1,024 0.7 ms, a full sort ~10 ms a row; a peaked row's nucleus lies in the 64.
NUCLEUS_CANDIDATES = (64, 1024)


def _ranked(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids by rank, the probability mass ranked before each) over the fewest NUCLEUS_CANDIDATES that reach
    top_p in every row (the nucleus then lies among them), over the whole sorted vocabulary when none do."""
    for candidates in NUCLEUS_CANDIDATES:
        if candidates >= probs.shape[-1]:
            break
        ranked, order = torch.topk(probs, candidates, dim=-1)
        cum_before = ranked.cumsum(-1) - ranked
        if bool((cum_before[..., -1] + ranked[..., -1] >= top_p).all()):
            return order, cum_before
    ranked, order = torch.sort(probs, dim=-1, descending=True)
    return order, ranked.cumsum(-1) - ranked


def outside_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] mask of the tokens top-p drops: a token goes when the more likely tokens before it already reach
    top_p; the first one always stays. The same mask as a full sort's, from the fewest candidates that hold it."""
    probs = logits.softmax(-1)
    order, cum_before = _ranked(probs, top_p)
    keep_ranked = cum_before < top_p
    keep_ranked[..., 0] = True  # even when top_p rounds to 0 in fp32 (5e-324 did)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_ranked)
    return ~keep


class StreamDraws:
    """Random choices from one stream, in the order they are made (requests without a seed). Drafts are judged by
    the optimal lossless rule, min(1, p/q) and the residual (verify.speculative_accept); which draws a step
    consumes depends on how much it drafted, so the text depends on the drafting decisions (not its distribution)."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def sample(self, probs: torch.Tensor, position: int) -> torch.Tensor:
        """[B, V] probabilities -> [B] token ids."""
        return sample_tokens(probs, self.generator)

    def accept(self, draft_tokens, draft_probs, target_probs, start: int):
        return speculative_accept(draft_tokens, draft_probs, target_probs, self.generator)

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

    def sample(self, probs: torch.Tensor, position: int) -> torch.Tensor:
        """[B, V] probabilities -> [B] token ids (each row at the same position)."""
        return argmax(probs.log() + self.noise(position, probs.shape[-1]))

    def accept(self, draft_tokens, draft_probs, target_probs, start: int):
        """target_probs [1, n+1, V] at positions start.. : the target's own keyed tokens there, and the draft's
        longest prefix that equals them."""
        n = target_probs.shape[1]
        noise = torch.stack([self.noise(start + j, target_probs.shape[-1]) for j in range(n)])
        return keyed_accept(draft_tokens, target_probs, noise)
