"""A smaller causal LM of the same vocabulary drafts token by token, run as one row of a backend."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..backends.base import DraftModel
from ..backends.prefix import common_prefix
from ..backends.torchdraft import TorchDraftModel
from ..sampling import SamplingParams
from .base import Draft, Drafter, catch_up, draft_chain


class ModelDrafter(Drafter):
    """Drafts with a small model run as one row (backends.base.DraftModel): a llama.cpp context on its GGUF file, or a
    transformers model, which runs as backends.torchdraft.TorchDraftModel with its options (`quant` "int8" / "int4",
    `head_tokens`, `compile`). Its cache follows the committed tokens by truncation to their common prefix.
    `alternatives` offers up to that many runner-up tokens at each drafted position (tree leaves, see tree.py), those
    likely enough to pay for their place in the pass (`leaf_min_mass`). Deterministic drafts when greedy; with sampling
    each token is drawn from the draft's processed distribution q, which goes with the draft (lossless rule). None of
    this changes the target's output."""

    def __init__(
        self, model: DraftModel | nn.Module, tokenizer=None, name: str | None = None, *, quant: str | None = None,
        head_tokens: int | None = None, compile: bool = False, alternatives: int = 0, leaf_min_mass: float = 0.0,
    ):
        if not isinstance(alternatives, int) or alternatives < 0:
            raise ValueError(f"alternatives must be an integer >= 0, got {alternatives!r}")
        if isinstance(model, nn.Module):  # a transformers model: the torch backend runs it as one row
            specials = list(getattr(tokenizer, "all_special_ids", []) or []) if tokenizer is not None else []
            model = TorchDraftModel(model, quant=quant, head_tokens=head_tokens, specials=specials, compile=compile)
        elif quant or head_tokens or compile:
            raise ValueError("int8 / int4 weights, a restricted head and a compiled step are options of a transformers "
                             "draft model (the torch backend); a GGUF draft runs as it is")
        self.model, self.tokenizer = model, tokenizer
        self.name = name or model.model_name
        self.alternatives = alternatives
        # A leaf widens the verify pass by one position; it pays when the target is likely to reach its place and
        # pick it: keep runner-ups whose (draft's estimate of reaching the position) x (draft probability) is at
        # least this. 0 keeps all (where a position costs ~1 % of a pass, 0.02 measured neutral); where a pass
        # grows with its width (a GPU under load) a threshold saves positions.
        self.leaf_min_mass = leaf_min_mass
        self.reset()

    @property
    def model(self) -> DraftModel:
        if self._model is None:
            self._model = self._twin_of.twin()
        return self._model

    @model.setter
    def model(self, model: DraftModel) -> None:
        self._model, self._twin_of = model, None

    def spawn(self) -> "ModelDrafter":
        twin = copy.copy(self)
        # Its own row is made when it first drafts: a llama.cpp context takes ~0.1 s to make, on a request's way to its
        # first token, and where model drafts cannot pay a row never drafts.
        twin._model, twin._twin_of = None, self.model
        twin.forward_passes = 0
        twin.reset()
        return twin

    def reset(self) -> None:
        if self._model is not None:
            self._model.clear()
        self.cached_ids = torch.empty(1, 0, dtype=torch.long)  # tokens whose K/V the model's row holds

    def unread(self, input_ids: torch.Tensor) -> int:
        return max(input_ids.shape[1] - self.cached_ids.shape[1], 0)

    def check_vocab(self, vocab_size: int, tokenizer=None) -> None:
        if self.model.vocab_size != vocab_size:
            raise ValueError(
                f"draft model {self.name!r} has a vocabulary of {self.model.vocab_size} tokens but the target has "
                f"{vocab_size}: draft and target must share one tokenizer"
            )
        if tokenizer is not None and self.tokenizer is not None and tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"draft model {self.name!r} uses a different tokenizer from the target's: they must be the same")

    def _read(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens [1, n] after the cached ones -> the logits after the last [1, V]."""
        self.forward_passes += 1
        logits = self.model.add_row(tokens) if self.model.rows == 0 else self.model.extend(0, tokens)
        self.cached_ids = torch.cat([self.cached_ids, tokens.cpu()], dim=1)
        return logits

    def prefill(self, prompt_ids: torch.Tensor) -> None:
        self.reset()
        self._read(prompt_ids)

    def commit(self, input_ids: torch.Tensor) -> None:
        if not self.cached_ids.shape[1]:  # nothing read (its drafts are off): nothing to roll back
            return
        keep = common_prefix(self.cached_ids[0], input_ids[0].cpu())
        if keep < self.cached_ids.shape[1]:
            if keep == 0:
                self.model.clear()
            else:
                self.model.truncate(0, keep)
            self.cached_ids = self.cached_ids[:, :keep]

    def propose(self, input_ids, k, sampling: SamplingParams, draws, keep_going=None) -> Draft:
        if self.cached_ids.shape[1] >= input_ids.shape[1]:  # always feed at least the last token
            self.commit(input_ids[:, :-1])
        else:
            self.commit(input_ids)
        pending, reading_s = catch_up(self._read, input_ids[:, self.cached_ids.shape[1] :])
        tokens, probs, confidence, runners_up = draft_chain(
            self._read, pending, k, sampling, draws, input_ids.shape[1], keep_going,
            self._runners_up if self.alternatives else None)
        alternatives = torch.tensor([runners_up]) if runners_up else None
        return Draft(torch.stack(tokens, 1).cpu(), torch.stack(probs, 1) if probs else None, confidence, self.name,
                     reading_s, alternatives=alternatives)

    def _runners_up(self, q: torch.Tensor, chosen: int, reach: float) -> list[int]:
        """The draft's most likely tokens after the one it chose (sampling may have chosen any), -1 where a
        runner-up is too unlikely to be worth its position in the pass."""
        top_q, top = q.topk(self.alternatives + 1)
        kept = [t if reach * p >= self.leaf_min_mass else -1 for t, p in zip(top.tolist(), top_q.tolist()) if t != chosen]
        return kept[: self.alternatives]
