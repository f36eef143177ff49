"""One request at a time: the batched engine's step with a single row, behind an iterator.

Plain decoding is the same loop with an empty draft, so the baseline shares every line of cache code with
speculation, and a request here decodes exactly as the same request alone in the server.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .batch import BatchEngine
from .drafters.base import Drafter
from .sampling import SamplingParams
from .sequence import GenerationResult, Sequence, validate_request
from .stopping import StopCondition

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


class SpeculativeEngine:
    """Target model (a transformers model or a Backend) + optional drafter. Greedy output equals the target's
    own greedy output; sampled output follows the target's distribution exactly."""

    def __init__(self, target, drafter: Drafter | None = None, tokenizer=None, k: int = 5, adaptive: bool = False):
        # Measured costs and acceptance outlive one request: the adaptive controller is the engine's.
        self._engine = BatchEngine(target, drafter, tokenizer, k=k, adaptive=adaptive, max_batch=1)
        self.tokenizer = tokenizer

    @property
    def backend(self):
        return self._engine.backend

    @property
    def drafter(self) -> Drafter | None:
        return self._engine.drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        if drafter is not None:
            drafter.check_vocab(self.backend.vocab_size, self.tokenizer)
        self._engine.drafter = drafter

    @property
    def controller(self):
        return self._engine.controller

    @property
    def adaptive(self) -> bool:
        return self._engine.adaptive

    @property
    def k(self) -> int:
        return self._engine.k

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    @property
    def context_window(self) -> int | None:
        return self.backend.context_window

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
        """Start generating after input_ids [1, L]; iterate the Generation for token chunks. Starting another
        generation abandons one not iterated to its end."""
        self._engine.abort()
        seq = self._engine.submit(
            input_ids, max_new_tokens=max_new_tokens, k=k, sampling=sampling, stop=stop, speculate=speculate,
            logprobs=logprobs,
        )
        return Generation(self._steps(seq), seq.result)

    def _steps(self, seq: Sequence) -> Iterator[list[int]]:
        while not seq.finished:
            for _, chunk in self._engine.step().events:
                yield chunk
        if seq.exception is not None:  # alone, a failing drafter or pass is the caller's error
            raise seq.exception
