"""One request between steps: its committed tokens, its drafter, its sampling, its stop rules; its first token,
the judging of its draft, and cutting its output at a stop or its budget.

Invariant between steps: `ids` holds every committed token; the target's cache holds K/V for all of them but the
last, which is fed at the next verify pass.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .drafters.base import Draft, Drafter
from .sampling import SamplingParams, kept_distribution, logits_to_probs
from .stats import GenerationStats
from .stopping import StopCondition
from .verify import argmax, greedy_accept


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the target's distribution it was chosen from (greedy: the raw
    softmax; sampling: after temperature, top-k and top-p), with the `top` most likely tokens there."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when asked for
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", "cancelled" or "error"
    stats: GenerationStats = field(default_factory=GenerationStats)
    error: str | None = None  # what went wrong, when finish_reason is "error"


def check_draft_length(k) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"the draft length k must be an integer >= 1, got {k!r}")


def validate_request(input_ids: torch.Tensor, max_new_tokens: int, k: int, window: int | None = None) -> None:
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if input_ids.shape[0] != 1:
        raise ValueError(f"one sequence per call (got a batch of {input_ids.shape[0]})")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    check_draft_length(k)
    if window and input_ids.shape[1] + max_new_tokens > window:
        raise ValueError(
            f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's context window ({window} tokens)"
        )


class Sequence:
    _serials = itertools.count()

    def __init__(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        k: int,
        sampling: SamplingParams = SamplingParams(),
        stop: StopCondition | None = None,
        drafter: Drafter | None = None,
        logprobs: int | None = None,
    ):
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0):
            raise ValueError(f"logprobs (how many top tokens to list) must be an integer >= 0, got {logprobs!r}")
        self.serial = next(Sequence._serials)  # tells rows apart across steps (a pass over other rows is not comparable)
        self.prompt = input_ids.cpu()
        self.max_new_tokens, self.k, self.sampling = max_new_tokens, k, sampling
        self.stop = stop or StopCondition()
        self.drafter = drafter
        self.speculate = drafter is not None  # the batched engine hands it a drafter when it joins the rows
        self.prompt_read = 0  # prompt tokens the target has read (a long prompt is read over several steps)
        self.overtaken = 0  # requests that came later but were read before it (the engine bounds this)
        self.draws = sampling.draws()  # None when greedy
        self.result = GenerationResult()
        self.result.stats.prompt_tokens = self.prompt.shape[1]
        self.ids = self.prompt  # committed tokens [1, n]
        self._buffer: torch.Tensor | None = None  # ids and room to grow (see _append)
        self._buffer_np: np.ndarray | None = None
        self.new: list[int] = []  # committed by the last step, not yet emitted
        self.top_logprobs = logprobs  # None: no log-probabilities kept
        self.new_logprobs: list[TokenLogprob] = []  # of self.new
        if logprobs is not None:
            self.result.logprobs = []
        self.drafter_ready = False  # the drafter has read the prompt
        self.cancelled = False
        self.exception: Exception | None = None  # what made it fail
        self.leaf: tuple[int, int] | None = None  # the tree leaf the last step used (position, rank)
        self.started = time.perf_counter()

    @property
    def stats(self) -> GenerationStats:
        return self.result.stats

    @property
    def finished(self) -> bool:
        return self.result.finish_reason is not None

    def start(self, logits: torch.Tensor) -> None:
        """The prefill's last-position logits [1, V] give the first token. A draft model reads the prompt at the first
        step that drafts with it: a request whose drafting never pays never pays for that reading."""
        self.stats.target_passes += 1
        first = self._choose(logits, self.prompt.shape[1])
        self.new = [int(first)]
        self._append(self.new)
        self.new_logprobs = self._logprobs(logits, self.new)
        self.stats.time_to_first_token_s = time.perf_counter() - self.started
        self.drafter_ready = False
        if self.drafter is not None:
            self.drafter.reset()
            self.drafter.begin(self.prompt)

    def emit(self) -> list[int]:
        """Move the last step's tokens to the output, cut at EOS / stop string / budget; returns what was added."""
        generated = self.result.token_ids
        start = len(generated)
        generated.extend(self.new)
        if self.result.logprobs is not None:
            self.result.logprobs.extend(self.new_logprobs)
        self.new, self.new_logprobs = [], []
        keep = self.stop.first_stop(generated, start)
        if keep is None and len(generated) >= self.max_new_tokens:
            keep = self.max_new_tokens
            self.result.finish_reason = "length"
        elif keep is not None:
            self.result.finish_reason = "stop"
        if keep is not None:
            del generated[keep:]
            if self.result.logprobs is not None:
                del self.result.logprobs[keep:]
        self.stats.new_tokens = len(generated)
        self.stats.total_time_s = time.perf_counter() - self.started
        return generated[start:]

    def cancel(self) -> None:
        self.cancelled = True

    def fail(self, error: Exception) -> None:
        self.result.finish_reason = "error"
        self.result.error = f"{type(error).__name__}: {error}"
        self.exception = error

    @property
    def draft_budget(self) -> int:
        """No need to draft past the budget: the target adds one token of its own."""
        return self.max_new_tokens - len(self.result.token_ids) - 1

    @property
    def prompt_left(self) -> int:
        """Prompt tokens the target has yet to read."""
        return self.prompt.shape[1] - self.prompt_read

    @property
    def generated(self) -> int:
        return len(self.result.token_ids) + len(self.new)

    @property
    def drafter_unread(self) -> int:
        """Committed tokens its drafter would read before drafting (all of them before it has read the prompt)."""
        return self.drafter.unread(self.ids) if self.drafter_ready else self.ids.shape[1]

    def _choose(self, logits: torch.Tensor, position: int) -> torch.Tensor:
        """The target's own token at `position` from its logits [1, V]: the argmax, or the request's draw."""
        if self.sampling.greedy:
            return argmax(logits)
        return self.draws.sample(kept_distribution(logits, self.sampling), position)

    def _logprobs(self, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob]:
        """The target's log-probabilities of `tokens` from their logits [n, V] (nothing when not asked for)."""
        if self.top_logprobs is None:
            return []
        if self.sampling.greedy:
            dist = torch.log_softmax(logits.float(), -1)
        else:
            dist = torch.log(logits_to_probs(logits, self.sampling))  # -inf outside top-k / top-p
        chosen = dist.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        if not self.top_logprobs:
            return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
        values, ids = dist.topk(min(self.top_logprobs, dist.shape[-1]), dim=-1)
        return [
            TokenLogprob(t, lp, [(i, v) for i, v in zip(row_ids, row_values) if v != float("-inf")])
            for t, lp, row_ids, row_values in zip(tokens, chosen, ids.tolist(), values.tolist())
        ]

    def judge(self, draft: Draft, logits: torch.Tensor, leaf_logits: dict | None = None) -> int:
        """Accept a prefix of the draft from the target's logits [1, n+1, V] at [last] + draft; commit it
        and the target's own next token. Returns how many draft tokens were accepted.

        leaf_logits {(position, rank): [1, V]}: the target's logits after each leaf (tree.py). When the
        target's own token at the first rejection is one of them, the target's next token after it is known
        too and is committed as well; `self.leaf` then says which leaf ((position, rank), else None)."""
        if self.sampling.greedy:
            accepted_len, next_token = greedy_accept(draft.tokens, logits)
        else:
            target = kept_distribution(logits, self.sampling)
            accepted_len, next_token = self.draws.accept(draft.tokens, draft.probs, target, self.ids.shape[1])
        return self.commit(draft, int(accepted_len[0]), int(next_token[0]), logits, leaf_logits)

    def _append(self, tokens: list[int]) -> None:
        """ids grows in place in a buffer (a torch.cat a step costs ~40 us right after a pass); views handed out
        before keep their tokens, since nothing before the end is ever rewritten."""
        n, m = self.ids.shape[1], len(tokens)
        if self._buffer is None or n + m > self._buffer.shape[1]:
            grown = torch.empty(1, max(2 * (n + m), n + self.max_new_tokens + self.k + 2), dtype=torch.long)
            grown[:, :n] = self.ids
            self._buffer, self._buffer_np = grown, grown.numpy()[0]
        self._buffer_np[n : n + m] = tokens
        self.ids = self._buffer[:, : n + m]

    def commit(self, draft: Draft, accepted: int, correction: int, logits: torch.Tensor | None = None,
               leaf_logits: dict | None = None) -> int:
        """Commit the draft's first `accepted` tokens and the target's own next token `correction` (judged by `judge`,
        or for greedy chains by the engine for all rows at once). logits [1, n+1, V]: for log-probabilities (None
        where none are asked for); leaf_logits as in `judge`. Returns `accepted`."""
        start = self.ids.shape[1]  # the position of the first drafted token
        self.new = draft.tokens[0, :accepted].tolist() + [correction]
        self.new_logprobs = self._logprobs(logits[0, : accepted + 1], self.new) if logits is not None else []
        self.leaf = None
        if leaf_logits is not None and accepted < draft.length:
            runners_up = draft.alternatives[0, accepted].tolist()
            if correction in runners_up:
                self.leaf = (accepted, runners_up.index(correction))
                after = leaf_logits[self.leaf]  # [1, V]: the target's logits after the correction
                self.new.append(int(self._choose(after, start + accepted + 1)))
                self.new_logprobs += self._logprobs(after, self.new[-1:])
                self.stats.leaf_tokens += 1
        self._append(self.new)
        if self.draws is not None:
            self.draws.forget_before(self.ids.shape[1])
        if self.drafter is not None:
            self.drafter.commit(self.ids)
        self.stats.target_passes += 1
        self.stats.record_step(draft.length, accepted, draft.source)
        return accepted
