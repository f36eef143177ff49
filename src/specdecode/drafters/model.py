"""A smaller causal LM of the same vocabulary drafts k tokens with its own KV cache."""

from __future__ import annotations

import copy
import sys
import time

import torch
from transformers import DynamicCache

from ..backends.prefix import common_prefix
from ..backends.torchmodel import rollback
from ..sampling import SamplingParams
from .base import Draft, Drafter, catch_up, draft_chain
from .quant import RestrictedHead, quantize


class ModelDrafter(Drafter):
    """Drafts with a small model. `quant` ("int8" or "int4") swaps its Linear layers for weight-only
    packed ones (one- and two-row steps); `head_tokens` restricts its output head to that many common
    tokens plus the prompt's; `compile` runs its one-token step through torch.compile (compiled once,
    here: a one-token step is ~half framework overhead on CPU); `alternatives` offers up to that many runner-up
    tokens at each drafted position (tree leaves, see tree.py), those likely enough to pay for their place in the
    pass (`leaf_min_mass`). None changes the target's output."""

    QUANT_BITS = {"int8": 8, "int4": 4}

    def __init__(
        self, model, tokenizer=None, name: str | None = None, *, quant: str | None = None, head_tokens: int | None = None,
        compile: bool = False, alternatives: int = 0, leaf_min_mass: float = 0.0,
    ):
        if not isinstance(alternatives, int) or alternatives < 0:
            raise ValueError(f"alternatives must be an integer >= 0, got {alternatives!r}")
        self.model = model
        self.alternatives = alternatives
        # A leaf widens the verify pass by one position; it pays when the target is likely to reach its place and
        # pick it: keep runner-ups whose (draft's estimate of reaching the position) x (draft probability) is at
        # least this. 0 keeps all: on this CPU a position costs ~1 % of a pass and 0.02 measured neutral (1.007x
        # over 12 prompts); where a pass grows with its width (a GPU under load) a threshold saves positions.
        self.leaf_min_mass = leaf_min_mass
        self.tokenizer = tokenizer
        self.name = name or getattr(model, "spec", None) or model.config.name_or_path or "model"
        if quant is not None:
            if quant not in self.QUANT_BITS:
                raise ValueError(f"unknown draft weight format {quant!r}: use one of {sorted(self.QUANT_BITS)}")
            quantize(model, self.QUANT_BITS[quant])
        self.head = None
        if head_tokens:
            specials = list(getattr(tokenizer, "all_special_ids", []) or []) if tokenizer is not None else []
            self.head = RestrictedHead(model.get_output_embeddings(), head_tokens, specials, int8=quant is not None)
        self.reset()
        self._one_token_step = None
        # torch.compile's stance for the step: compile while warming up, then never inside a timed step
        self._stance = "default"
        if compile:
            self._compile()

    def spawn(self) -> "ModelDrafter":
        twin = copy.copy(self)
        twin.head = copy.copy(self.head)  # the per-prompt part of the head is per sequence
        twin.forward_passes = 0
        twin.reset()
        return twin

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.cached_ids = torch.empty(1, 0, dtype=torch.long)  # tokens whose K/V the cache holds

    def unread(self, input_ids: torch.Tensor) -> int:
        return max(input_ids.shape[1] - self.cached_ids.shape[1], 0)

    def check_vocab(self, vocab_size: int, tokenizer=None) -> None:
        own = self.model.get_output_embeddings().weight.shape[0]
        if own != vocab_size:
            raise ValueError(
                f"draft model {self.name!r} has a vocabulary of {own} tokens but the target has {vocab_size}: "
                "draft and target must share one tokenizer"
            )
        if tokenizer is not None and self.tokenizer is not None and tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"draft model {self.name!r} uses a different tokenizer from the target's: they must be the same")

    @torch.inference_mode()
    def _next_logits(self, new_tokens: torch.Tensor) -> torch.Tensor:
        hidden = self._read(new_tokens)
        if self.head is None:
            return self.model.get_output_embeddings()(hidden).float()  # [B, V]
        return self.head.logits(hidden)  # our smaller head

    @torch.inference_mode()
    def _compile(self) -> None:
        """Compile the one-token step (the cache length is dynamic: one graph serves every context) and pay
        the compilation now, on a dummy sequence, so no timed step does. Wider passes (prompt, catch-up)
        stay eager: each width would be a graph of its own, and they are rare."""
        t0 = time.perf_counter()
        print(f"[specdecode] compiling {self.name}'s one-token draft step (once per process; about a minute on "
              "2 CPU cores the first time, faster once torch's compile cache is warm) ...", file=sys.stderr, flush=True)
        self._one_token_step = torch.compile(self.model.base_model.forward, dynamic=True)
        # A cache length that matches no other dimension (dynamo would tie equal sizes together); steps on a
        # cache just grown (contiguous) and just rolled back (a view): both layouts get their graph now.
        dummy = torch.zeros(1, 6, dtype=torch.long, device=self.model.device)
        try:
            self._read(dummy)
            for rollback_to in (None, None, 6, None, 5):
                if rollback_to is not None:
                    self.commit(self.cached_ids[:, :rollback_to])
                self._read(dummy[:, :1])
        except Exception as error:  # e.g. no C++ compiler: drafting still works, only slower
            self._one_token_step = None
            print(f"[specdecode] could not compile the draft step ({type(error).__name__}: {str(error)[:200]}); "
                  "drafting without compilation", file=sys.stderr, flush=True)
        else:
            print(f"[specdecode] compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        # From now on an input no graph fits runs eagerly instead of compiling inside a timed draft step
        self._stance = "eager_on_recompile"
        self.reset()
        self.forward_passes = 0

    @torch.inference_mode()
    def _read(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens through the base model into the cache -> the last position's hidden state [B, H]
        (no output head: reading a prompt or catching up needs none)."""
        self.forward_passes += 1
        if self._one_token_step is not None and new_tokens.shape[1] == 1:
            # a fresh contiguous inference tensor every time: the graph is guarded on strides and dispatch keys
            new_tokens = new_tokens.clone(memory_format=torch.contiguous_format)
            with torch.compiler.set_stance(self._stance):
                output = self._one_token_step(input_ids=new_tokens, cache=self.cache, use_cache=True)
        else:
            output = self.model.base_model(input_ids=new_tokens, cache=self.cache, use_cache=True)
        hidden = output.last_hidden_state
        self.cached_ids = torch.cat([self.cached_ids, new_tokens.cpu()], dim=1)
        return hidden[:, -1]

    def prefill(self, prompt_ids: torch.Tensor) -> None:
        if self.head is not None:  # the prompt's tokens join the restricted head
            self.head.set_context(prompt_ids)
        self._read(prompt_ids.to(self.model.device))

    def propose(self, input_ids, k, sampling: SamplingParams, draws, keep_going=None) -> Draft:
        if self.cached_ids.shape[1] >= input_ids.shape[1]:  # always feed at least the last token
            self.commit(input_ids[:, :-1])
        pending, reading_s = catch_up(self._read, input_ids[:, self.cached_ids.shape[1] :].to(self.model.device))
        tokens, probs, confidence, runners_up = draft_chain(
            self._next_logits, pending, k, sampling, draws, input_ids.shape[1], keep_going,
            self._runners_up if self.alternatives else None)
        alternatives = torch.tensor([runners_up]) if runners_up else None
        return Draft(
            torch.stack(tokens, 1).cpu(), torch.stack(probs, 1) if probs else None, confidence, self.name, reading_s,
            alternatives=alternatives,
        )

    def _runners_up(self, q: torch.Tensor, chosen: int, reach: float) -> list[int]:
        """The draft's most likely tokens after the one it chose (sampling may have chosen any), -1 where a
        runner-up is too unlikely to be worth its position in the pass."""
        top_q, top = q.topk(self.alternatives + 1)
        kept = [t if reach * p >= self.leaf_min_mass else -1 for t, p in zip(top.tolist(), top_q.tolist()) if t != chosen]
        return kept[: self.alternatives]

    def commit(self, input_ids: torch.Tensor) -> None:
        keep = common_prefix(self.cached_ids[0], input_ids[0].cpu())
        rollback(self.cache, keep)
        self.cached_ids = self.cached_ids[:, :keep]
