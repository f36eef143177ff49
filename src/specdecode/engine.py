"""The decoding loop for one sequence: prefill, propose, verify, accept, roll back, stream.

Plain decoding is the same loop with an empty draft, so the baseline shares every line of cache
code with speculation. The per-sequence logic lives in `sequence.Sequence`, shared with the
batched engine (`batch.BatchEngine`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from transformers import DynamicCache

from .control import AdaptiveK, FixedK
from .drafters.base import Drafter
from .drafters.model import rollback
from .sampling import SamplingParams
from .sequence import GenerationResult, Sequence, context_window, validate_request
from .stopping import StopCondition
from .tree import TreeLayout, keep_leaf

__all__ = ["Generation", "GenerationResult", "SpeculativeEngine", "validate_request"]


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


def target_logits(target, tokens: torch.Tensor, cache: DynamicCache, last_only: bool = False, **kwargs) -> torch.Tensor:
    """One target pass over tokens [B, n] on top of `cache` -> fp32 logits on the CPU [B, n or 1, V]."""
    with torch.inference_mode():
        out = target(
            input_ids=tokens.to(target.device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            **kwargs,
        )
    return out.logits.float().cpu()


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

    @property
    def context_window(self) -> int | None:
        return context_window(self.target)

    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        k: int | None = None,
        sampling: SamplingParams = SamplingParams(),
        stop: StopCondition | None = None,
        speculate: bool = True,
        logprobs: int | None = None,
    ) -> Generation:
        """Start generating after input_ids [1, L]; iterate the Generation for token chunks."""
        k = self.k if k is None else k
        validate_request(input_ids, max_new_tokens, k, self.context_window)
        seq = Sequence(
            input_ids, max_new_tokens=max_new_tokens, k=k, sampling=sampling, stop=stop,
            drafter=self.drafter if speculate else None, logprobs=logprobs,
        )
        return Generation(self._steps(seq), seq.result)

    def _steps(self, seq: Sequence) -> Iterator[list[int]]:
        controller = self.controller or FixedK(seq.k)
        if self.controller is not None:
            self.controller.leaves = getattr(seq.drafter, "alternatives", 0)
            self.controller.pass_line.new_context()
        stats = seq.stats
        cache = DynamicCache(config=self.target.config)
        seq.start(target_logits(self.target, seq.prompt, cache, last_only=True)[:, -1])
        while True:
            chunk = seq.emit()
            if chunk:
                yield chunk
            if seq.finished:
                return
            t0 = time.perf_counter()
            draft = seq.propose(controller)
            t1 = time.perf_counter()
            # Verify [last] + draft (+ its alternatives, tree.py) in one target pass, then roll the cache back
            # to the committed tokens.
            past = seq.ids.shape[1] - 1
            tree = TreeLayout(seq.ids[:, -1:], draft.tokens, draft.alternatives)
            logits = target_logits(self.target, tree.tokens, cache, **tree.model_inputs(past, self.target.dtype))
            accepted = seq.judge(draft, *tree.split_logits(logits))
            if seq.leaf is not None:
                keep_leaf(cache, past, tree, *seq.leaf)
            rollback(cache, seq.ids.shape[1] - 1)
            t2 = time.perf_counter()
            controller.observe(
                draft.source, draft.confidence, draft.length, accepted, t1 - t0 - draft.reading_s, t2 - t1,
                positions=tree.width, leaf_used=(seq.leaf is not None) if tree.leaves else None,
            )
            stats.draft_time_s += t1 - t0
            stats.verify_time_s += t2 - t1
