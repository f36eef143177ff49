"""The drafter protocol: the engine knows drafters only through this."""

from __future__ import annotations

import copy
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..sampling import SamplingParams, kept_distribution
from ..verify import argmax


# A lookup source's refinement for a draft from a short match the text went on from in more than one way
# ("suffix/contested"): the controller prices its first token from its own low prior (control/priors.py)
CONTESTED = "/contested"


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, n] proposed tokens, n <= k (n = 0: nothing to propose)
    probs: torch.Tensor | None = None  # [B, n, V] processed q; None: deterministic draft (q one-hot)
    confidence: list[float] | None = None  # per token, the draft's own probability of it (row 0)
    source: str = ""  # which drafter proposed it (a combination drafter has several)
    # Of the time proposing took, the seconds spent reading committed tokens the drafter had not seen (after
    # plain or lookup steps): a one-off catch-up, not what drafting costs per token.
    reading_s: float = 0.0
    # [B, n, m]: at each position, up to m other likely tokens the target may correct to (leaves verified with
    # the chain in one pass, see tree.py; -1: no leaf there); None: none offered
    alternatives: torch.Tensor | None = None
    match_len: int = 0  # a lookup draft: how many tokens of the text's end matched (its acceptance depends on it)
    # A lookup draft from other evidence that the controller may verify instead where this one does not pay (the suffix
    # tree's own, shorter, where the copy pointer's runs further; AdaptiveK.trim)
    instead: Draft | None = None

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    def truncate(self, length: int) -> None:
        """Keep at most the first `length` tokens (of the draft it may be swapped for too)."""
        self._cut(length)
        if self.instead is not None:
            self.instead.truncate(length)

    def end_at(self, ends: frozenset[int]) -> None:
        """Keep the tokens up to the first of `ends` (a token that ends the answer): nothing after it is ever kept."""
        if self.length and ends:
            for n, token in enumerate(self.tokens[0].tolist(), 1):
                if token in ends:
                    self._cut(n)
                    break
        if self.instead is not None:
            self.instead.end_at(ends)

    def drop_leaves(self) -> None:
        """Verify the chain alone (of the draft it may be swapped for too)."""
        self.alternatives = None
        if self.instead is not None:
            self.instead.drop_leaves()

    def _cut(self, length: int) -> None:
        if self.length > length:
            self.tokens = self.tokens[:, :length]
            self.probs = None if self.probs is None else self.probs[:, :length]
            self.confidence = None if self.confidence is None else self.confidence[:length]
            self.alternatives = None if self.alternatives is None else self.alternatives[:, :length]

    @staticmethod
    def empty(batch: int = 1, device: torch.device | str = "cpu") -> "Draft":
        if batch == 1 and str(device) == "cpu":
            return Draft(_NO_TOKENS)  # a plain step's draft: one shared empty tensor (it holds nothing to change)
        return Draft(torch.empty(batch, 0, dtype=torch.long, device=device))


_NO_TOKENS = torch.empty(1, 0, dtype=torch.long)


def draw(logits: torch.Tensor, sampling: SamplingParams, draws, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft token for `position` from the draft's logits [B, V] and the distribution q it came from: the argmax
    (q = softmax, for its confidence) when greedy, else a sample from the processed q (which must go with the draft:
    lossless rule) by the request's draws (sampling.StreamDraws / KeyedDraws)."""
    if sampling.greedy:
        return argmax(logits), torch.softmax(logits, -1)
    q = kept_distribution(logits, sampling)
    return draws.sample(q, position), q.dense()


def draft_chain(step: Callable[[torch.Tensor], torch.Tensor], pending: torch.Tensor, k: int, sampling: SamplingParams,
                draws, start: int, keep_going: Callable[[int, float], bool] | None = None,
                runners_up: Callable[[torch.Tensor, int, float], list[int]] | None = None):
    """The token-by-token loop every model drafter runs: step(tokens [1, n]) feeds them and returns the logits after
    the last [1, V]; the first step feeds `pending`, each later one the token drawn before. Draft token i stands at
    position start + i. keep_going is asked before every token after the first; runners_up(q, chosen, reach) gives a
    token's tree leaves (reach: the draft's own estimate that the target gets that far). Returns (tokens, probs,
    confidence, alternatives) as lists, one entry a token (probs only when sampling, alternatives only with
    runners_up)."""
    tokens, probs, confidence, alternatives = [], [], [], []
    for i in range(k):
        if i and keep_going is not None and not keep_going(i, confidence[-1]):
            break
        token, q = draw(step(pending), sampling, draws, start + i)
        if not sampling.greedy:
            probs.append(q)
        tokens.append(token)
        if runners_up is not None:
            alternatives.append(runners_up(q[0], int(token[0]), math.prod(confidence)))
        confidence.append(float(q[0, token[0]]))
        pending = token[:, None]
    return tokens, probs, confidence, alternatives


# After a fully accepted draft two tokens are new (the last drafted one and the target's); more means the drafter sat
# out steps. Those it reads in a pass of its own, timed apart (Draft.reading_s): a one-off catch-up, not drafting.
USUAL_PENDING = 2


def catch_up(read: Callable[[torch.Tensor], object], pending: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Read all but the last of more than USUAL_PENDING new tokens [1, n] with `read`; returns what is left to feed
    with the first draft step and the seconds the catch-up took."""
    if pending.shape[1] <= USUAL_PENDING:
        return pending, 0.0
    t0 = time.perf_counter()
    read(pending[:, :-1])
    return pending[:, -1:], time.perf_counter() - t0


class Drafter(ABC):
    """Proposes tokens ahead of the target; keeps whatever state it needs in line with commits.

    The engine calls `reset` once per sequence, then alternates `propose` (with every committed
    token so far) and `commit` (with the committed tokens after verification).
    """

    name: str = "drafter"
    free: bool = False  # every draft costs no model pass (a lookup): nothing to read, nothing to time
    forward_passes: int = 0  # model forward passes so far (stays 0 for model-free drafters)
    # Runner-up tokens a draft may carry per drafted position (Draft.alternatives: tree leaves, tree.py).
    alternatives: int = 0

    def reset(self) -> None:
        """Forget the previous sequence."""

    def forget_last_request(self) -> None:
        """Take back what the last sequence taught this drafter for later ones (a suffix drafter's earlier answers),
        so that a rerun of the same request drafts as the first run did (a benchmark's repeats)."""

    def begin(self, prompt_ids: torch.Tensor) -> None:
        """A new sequence starts from this prompt [1, L] (after `reset`; no model pass: see `prefill`)."""

    def prefill(self, prompt_ids: torch.Tensor) -> None:
        """Read a new sequence's prompt [B, L] ahead of the first propose (so that cost is not a draft step's)."""

    @abstractmethod
    def propose(
        self,
        input_ids: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        draws,
        keep_going: Callable[[int, float], bool] | None = None,
    ) -> Draft:
        """Up to k tokens that follow input_ids [B, L]; with probs when sampling from a distribution. Draft token i
        stands at position L + i: a sampled one is drawn by `draws.sample(q, L + i)` (see `draw`).

        A drafter that makes tokens one at a time asks keep_going(tokens_so_far, confidence_of_last)
        before each further token, so a controller can stop a draft that will likely be rejected.
        """

    def unread(self, input_ids: torch.Tensor) -> int:
        """Committed tokens it would have to read before its next draft (0: it needs no context pass)."""
        return 0

    def propose_free(self, input_ids: torch.Tensor, k: int) -> Draft:
        """Up to k tokens that cost no model pass (a lookup), or an empty draft. Greedy or sampled alike:
        such drafts are deterministic (q one-hot). Under load a batch drafts only these."""
        return Draft.empty(1, input_ids.device)

    def commit(self, input_ids: torch.Tensor) -> None:
        """input_ids [B, L'] is now the committed sequence (accepted draft prefix + target token)."""

    def spawn(self) -> "Drafter":
        """A drafter for another sequence decoded at the same time: the same weights, its own state."""
        twin = copy.copy(self)
        twin.forward_passes = 0
        twin.reset()
        return twin

    def check_vocab(self, vocab_size: int, tokenizer=None) -> None:
        """Raise ValueError when this drafter cannot propose in the target's vocabulary."""
