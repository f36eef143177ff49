"""Logits -> processed probabilities, and seeded sampling.

Speculative sampling is lossless when q is the distribution the draft really sampled its token from (the
target's p is processed as the user asked; q may be anything that covers the draft's choice). Both go through
`logits_to_probs` with the same parameters because a q close to p is accepted more often, not for correctness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities after temperature, top-k and top-p.

    Greedy params give the one-hot of the argmax, so greedy is the temperature -> 0 limit.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already reach top_p; the first one always stays.
        cum_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = cum_before >= params.top_p
        drop_sorted[..., 0] = False  # even when top_p rounds to 0 in fp32 (5e-324 did)
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[B, V] probabilities -> [B] token ids."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
