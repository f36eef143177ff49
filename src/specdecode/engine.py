"""The decoding loop: prefill, propose, verify, accept, roll back, stream.

Plain decoding is the same loop with an empty draft, so the baseline shares every line of cache
code with speculation. Invariant between steps: `ids` holds every committed token; the target's
cache holds K/V for all of them but the last, which is fed at the next verify pass.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .drafters.base import Draft, Drafter
from .control import AdaptiveK, FixedK
from .drafters.model import rollback
from .sampling import SamplingParams, logits_to_probs, sample
from .stats import GenerationStats
from .stopping import StopCondition
from .verify import greedy_accept, speculative_accept


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    stats: GenerationStats = field(default_factory=GenerationStats)


class Generation:
    """A generation in progress: iterate for the token chunks as they are accepted, or call result()."""

    def __init__(self, steps: Iterator[list[int]], partial: GenerationResult):
        self._steps = steps
        self.partial = partial  # filled in as the generation goes

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._steps

    def result(self) -> GenerationResult:
        for _ in self._steps:
            pass
        return self.partial


def validate_request(input_ids: torch.Tensor, max_new_tokens: int, k: int) -> None:
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if input_ids.shape[0] != 1:
        raise ValueError(f"one sequence per call (got a batch of {input_ids.shape[0]})")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"the draft length k must be an integer >= 1, got {k!r}")


class SpeculativeEngine:
    """Target model + optional drafter. Greedy output equals the target's own greedy output;
    sampled output follows the target's distribution exactly."""

    def __init__(self, target, drafter: Drafter | None = None, tokenizer=None, k: int = 5, adaptive: bool = False):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"the draft length k must be an integer >= 1, got {k!r}")
        self.target, self.drafter, self.tokenizer, self.k = target, drafter, tokenizer, k
        # Measured costs and acceptance outlive one request: the adaptive controller is the engine's.
        self.controller = AdaptiveK(max_k=k) if adaptive else None
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        if drafter is not None:
            drafter.check_vocab(self.vocab_size, tokenizer)

    @torch.inference_mode()
    def _target_logits(self, tokens: torch.Tensor, cache: DynamicCache, last_only: bool = False) -> torch.Tensor:
        out = self.target(
            input_ids=tokens.to(self.target.device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        return out.logits.float().cpu()  # [B, n, V]

    def generate(self, input_ids: torch.Tensor, **kwargs) -> Generation:
        """Start generating after input_ids [1, L]; see `_steps` for the arguments."""
        result = GenerationResult()
        k = kwargs.pop("k", None)
        k = self.k if k is None else k
        validate_request(input_ids, kwargs.get("max_new_tokens", 0), k)
        window = getattr(self.target.config, "max_position_embeddings", None)
        if window and input_ids.shape[1] + kwargs["max_new_tokens"] > window:
            raise ValueError(
                f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({kwargs['max_new_tokens']}) exceeds the "
                f"model's context window ({window} tokens)"
            )
        return Generation(self._steps(result, input_ids.cpu(), k=k, **kwargs), result)

    def _steps(
        self,
        result: GenerationResult,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        k: int,
        sampling: SamplingParams = SamplingParams(),
        stop: StopCondition | None = None,
        speculate: bool = True,
    ) -> Iterator[list[int]]:
        stats, generated = result.stats, result.token_ids
        stop = stop or StopCondition()
        controller = self.controller or FixedK(k)
        controller.max_k = k
        generator = None if sampling.greedy else sampling.generator()
        drafter = self.drafter if speculate else None
        stats.prompt_tokens = input_ids.shape[1]
        started = time.perf_counter()

        cache = DynamicCache(config=self.target.config)
        logits = self._target_logits(input_ids, cache, last_only=True)[:, -1]  # [1, V]
        stats.target_passes += 1
        first = logits.argmax(-1) if sampling.greedy else sample(logits_to_probs(logits, sampling), generator)
        ids = torch.cat([input_ids, first[:, None]], dim=1)  # [1, L+1]
        stats.time_to_first_token_s = time.perf_counter() - started
        if drafter is not None:
            drafter.reset()
            drafter.prefill(input_ids)  # the draft reads the prompt once; not a draft step's cost
            stats.draft_prefill_s = time.perf_counter() - started - stats.time_to_first_token_s
        new = [int(first)]

        while True:
            # Emit what this step produced, cut at EOS / stop string / budget.
            start = len(generated)
            generated.extend(new)
            keep = stop.first_stop(generated, start)
            if keep is not None:
                del generated[keep:]
                result.finish_reason = "stop"
            elif len(generated) >= max_new_tokens:
                del generated[max_new_tokens:]
                result.finish_reason = "length"
            stats.new_tokens = len(generated)
            stats.total_time_s = time.perf_counter() - started
            if len(generated) > start:
                yield generated[start:]
            if result.finish_reason:
                return

            # Propose. No need to draft past the budget: the target adds one token of its own.
            t0 = time.perf_counter()
            draft = Draft.empty()
            if drafter is not None:
                budget = max_new_tokens - len(generated) - 1
                draft_len = controller.plan(budget)
                if draft_len > 0:
                    passes_before = drafter.forward_passes
                    draft = controller.trim(drafter.propose(ids, draft_len, sampling, generator, controller.keep_going))
                    draft.truncate(budget)  # a drafter may offer more than asked (n-gram runs)
                    stats.draft_passes += drafter.forward_passes - passes_before
                if draft.length == 0 and budget > 0:
                    stats.plain_steps += 1
            t1 = time.perf_counter()

            # Verify [last] + draft in one target pass.
            logits = self._target_logits(torch.cat([ids[:, -1:], draft.tokens], dim=1), cache)  # [1, n+1, V]
            if sampling.greedy:
                accepted_len, next_token = greedy_accept(draft.tokens, logits)
            else:
                target_probs = logits_to_probs(logits, sampling)
                accepted_len, next_token = speculative_accept(draft.tokens, draft.probs, target_probs, generator)
            accepted = int(accepted_len[0])
            new = draft.tokens[0, :accepted].tolist() + [int(next_token[0])]

            # Roll back: the cache keeps every committed token but the newest one.
            ids = torch.cat([ids, torch.tensor([new])], dim=1)
            rollback(cache, ids.shape[1] - 1)
            if drafter is not None:
                drafter.commit(ids)
            t2 = time.perf_counter()
            controller.observe(draft.source, draft.confidence, draft.length, accepted, t1 - t0, t2 - t1)
            stats.target_passes += 1
            stats.record_step(draft.length, accepted)
            stats.draft_time_s += t1 - t0
            stats.verify_time_s += t2 - t1
