"""A draft model run by llama.cpp: a second llama.cpp context on its own GGUF file, one sequence."""

from __future__ import annotations

import torch

from ..backends.llamacpp import LlamaCppBackend
from ..backends.prefix import common_prefix
from ..sampling import SamplingParams
from .base import Draft, Drafter, catch_up, draft_chain


class LlamaDrafter(Drafter):
    """Drafts token by token on a one-row llama.cpp backend (best without a prefix cache: a draft reads a prompt only
    where drafting pays, and benchmarks must not find it warm); its cache follows the committed tokens by
    truncation (`Backend.keep` of the common prefix). Deterministic drafts when greedy; with sampling each token
    is drawn from the draft's processed distribution q, which goes with the draft (lossless rule)."""

    def __init__(self, backend: LlamaCppBackend, name: str | None = None, tokenizer=None):
        self.backend, self.tokenizer = backend, tokenizer
        self.name = name or backend.model.path.stem
        self.reset()

    def spawn(self) -> "LlamaDrafter":
        """Another sequence: a context of its own on the same loaded weights."""
        backend = self.backend
        twin = LlamaCppBackend(backend.model, threads=backend.threads, window=backend.context_window, prefix_cache=False)
        return LlamaDrafter(twin, self.name, self.tokenizer)

    def reset(self) -> None:
        self.backend.clear()
        self.cached_ids = torch.empty(1, 0, dtype=torch.long)

    def unread(self, input_ids: torch.Tensor) -> int:
        return max(input_ids.shape[1] - self.cached_ids.shape[1], 0)

    def check_vocab(self, vocab_size: int, tokenizer=None) -> None:
        if self.backend.vocab_size != vocab_size:
            raise ValueError(
                f"draft model {self.name!r} has a vocabulary of {self.backend.vocab_size} tokens but the target has "
                f"{vocab_size}: draft and target must share one tokenizer"
            )

    def _read(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens [1, n] after the cached ones -> the logits after the last [1, V]."""
        self.forward_passes += 1
        logits = self.backend.add_row(tokens) if self.backend.rows == 0 else self.backend.extend(0, tokens)
        self.cached_ids = torch.cat([self.cached_ids, tokens], dim=1)
        return logits

    def prefill(self, prompt_ids: torch.Tensor) -> None:
        self.reset()
        self._read(prompt_ids.cpu())

    def commit(self, input_ids: torch.Tensor) -> None:
        keep = common_prefix(self.cached_ids[0], input_ids[0].cpu())
        if keep < self.cached_ids.shape[1]:
            if keep == 0:
                self.backend.clear()
            else:
                self.backend.truncate(0, keep)
            self.cached_ids = self.cached_ids[:, :keep]

    def propose(self, input_ids, k, sampling: SamplingParams, draws, keep_going=None) -> Draft:
        input_ids = input_ids.cpu()
        if self.cached_ids.shape[1] >= input_ids.shape[1]:  # always feed at least the last token
            self.commit(input_ids[:, :-1])
        else:
            self.commit(input_ids)
        pending, reading_s = catch_up(self._read, input_ids[:, self.cached_ids.shape[1] :])
        tokens, probs, confidence, _ = draft_chain(self._read, pending, k, sampling, draws, input_ids.shape[1],
                                                   keep_going)
        return Draft(torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None, confidence, self.name, reading_s)
