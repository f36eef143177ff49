"""A transformers draft model run by torch as one row (backends.base.DraftModel): its own K/V cache, and the options
that make a one-row step cheaper on a CPU: packed int8 / int4 weights, an output head restricted to the tokens a
draft is likely to need, a one-token step compiled by torch.compile. None of them changes what the target outputs."""

from __future__ import annotations

import copy
import sys
import time

import torch
from transformers import DynamicCache

from .base import BackendError
from .quant import RestrictedHead, quantize
from .torchmodel import rollback


class TorchDraftModel:
    """`quant` ("int8" or "int4") swaps the model's Linear layers for weight-only packed ones; `head_tokens` restricts
    its output head to that many common tokens plus the specials and the row's prompt; `compile` runs its one-token
    step through torch.compile (compiled once, here: a one-token step is ~half framework overhead on a CPU)."""

    QUANT_BITS = {"int8": 8, "int4": 4}

    def __init__(self, model, *, quant: str | None = None, head_tokens: int | None = None, specials=(),
                 compile: bool = False):
        self.hf_model = model
        self.model_name = getattr(model, "spec", None) or model.config.name_or_path or "model"
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        if quant is not None:
            if quant not in self.QUANT_BITS:
                raise ValueError(f"unknown draft weight format {quant!r}: use one of {sorted(self.QUANT_BITS)}")
            quantize(model, self.QUANT_BITS[quant])
        self.head = None
        if head_tokens:
            self.head = RestrictedHead(model.get_output_embeddings(), head_tokens, list(specials), int8=quant is not None)
        self.clear()
        self._one_token_step = None
        # torch.compile's stance for the step: compile while warming up, then never inside a timed step
        self._stance = "default"
        if compile:
            self._compile()

    @property
    def device(self) -> str:
        return str(self.hf_model.device)

    @property
    def rows(self) -> int:
        return 1 if self.cache.get_seq_length() else 0

    def length(self, row: int) -> int:
        return self.cache.get_seq_length()

    def twin(self) -> "TorchDraftModel":
        """Another row on the same weights (and compiled step): a cache of its own."""
        twin = copy.copy(self)
        twin.head = copy.copy(self.head)  # the per-prompt part of the head is per row
        twin.clear()
        return twin

    def clear(self) -> None:
        self.cache = DynamicCache(config=self.hf_model.config)

    def add_row(self, prompt: torch.Tensor) -> torch.Tensor:
        """Start the row from prompt [1, L] (its tokens join a restricted head) -> the logits after it [1, V]."""
        self.clear()
        if self.head is not None:
            self.head.set_context(prompt)
        return self.extend(0, prompt)

    @torch.inference_mode()
    def extend(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [1, n] -> fp32 logits after the last [1, V], where the model runs."""
        if row != 0:
            raise BackendError("a torch draft model holds one row")
        hidden = self._read(tokens.to(self.hf_model.device))
        if self.head is None:
            return self.hf_model.get_output_embeddings()(hidden).float()
        return self.head.logits(hidden)

    def truncate(self, row: int, length: int) -> None:
        rollback(self.cache, length)

    def _read(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens through the base model into the cache -> the last position's hidden state [1, H]."""
        if self._one_token_step is not None and tokens.shape[1] == 1:
            # a fresh contiguous inference tensor every time: the graph is guarded on strides and dispatch keys
            tokens = tokens.clone(memory_format=torch.contiguous_format)
            with torch.compiler.set_stance(self._stance):
                output = self._one_token_step(input_ids=tokens, cache=self.cache, use_cache=True)
        else:
            output = self.hf_model.base_model(input_ids=tokens, cache=self.cache, use_cache=True)
        return output.last_hidden_state[:, -1]

    @torch.inference_mode()
    def _compile(self) -> None:
        """Compile the one-token step (the cache length is dynamic: one graph serves every context) and pay
        the compilation now, on a dummy row, so no timed step does. Wider passes (prompt, catch-up) stay eager:
        each width would be a graph of its own, and they are rare."""
        t0 = time.perf_counter()
        print(f"[specdecode] compiling {self.model_name}'s one-token draft step (once per process; about a minute on "
              "2 CPU cores the first time, faster once torch's compile cache is warm) ...", file=sys.stderr, flush=True)
        self._one_token_step = torch.compile(self.hf_model.base_model.forward, dynamic=True)
        # A cache length that matches no other dimension (dynamo would tie equal sizes together); steps on a
        # cache just grown (contiguous) and just rolled back (a view): both layouts get their graph now.
        dummy = torch.zeros(1, 6, dtype=torch.long)
        try:
            self.add_row(dummy)
            for rollback_to in (None, None, 6, None, 5):
                if rollback_to is not None:
                    self.truncate(0, rollback_to)
                self.extend(0, dummy[:, :1])
        except Exception as error:  # e.g. no C++ compiler: drafting still works, only slower
            self._one_token_step = None
            print(f"[specdecode] could not compile the draft step ({type(error).__name__}: {str(error)[:200]}); "
                  "drafting without compilation", file=sys.stderr, flush=True)
        else:
            print(f"[specdecode] compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        # From now on an input no graph fits runs eagerly instead of compiling inside a timed draft step
        self._stance = "eager_on_recompile"
        self.clear()
        if self.head is not None:
            self.head.set_context(torch.empty(0, dtype=torch.long))
