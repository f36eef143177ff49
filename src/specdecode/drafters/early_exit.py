"""Self-speculation: the target's own first L layers, its final norm and head draft for it.

No second model and no extra weights (the layers are the target's, shared); only a second, shallower
KV cache. L is picked by `calibrate_layers` from one pass over the user's prompt: how often the
early-exit argmax agrees with the full model's, against what L layers cost.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .base import Draft
from .model import ModelDrafter


def _shallow_model(target, layers: int):
    """A view of the target that runs only its first `layers` decoder layers (weights shared)."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    base = copy.copy(target.base_model)
    base._modules = dict(base._modules)  # copy.copy shares the module dict; give the view its own
    base.layers = nn.ModuleList(list(target.base_model.layers)[:layers])
    base.config = config
    shallow = copy.copy(target)
    shallow._modules = dict(shallow._modules)
    setattr(shallow, target.base_model_prefix, base)
    shallow.config = config
    return shallow


@torch.inference_mode()
def early_exit_agreement(target, input_ids: torch.Tensor) -> list[float]:
    """For each L = 1..N-1: the fraction of prompt positions where the first L layers' argmax
    (through the final norm and head) equals the full model's next-token argmax."""
    out = target(input_ids=input_ids.to(target.device), output_hidden_states=True)
    final = out.logits[0].argmax(-1)
    norm, head = target.base_model.norm, target.get_output_embeddings()
    agreement = []
    for hidden in out.hidden_states[1:-1]:  # [0] is the embeddings, [-1] the last layer (already normed)
        agreement.append(float((head(norm(hidden[0])).argmax(-1) == final).float().mean()))
    return agreement


def calibrate_layers(target, input_ids: torch.Tensor, max_k: int = 8) -> tuple[int | None, float]:
    """The L (None: none pays) maximising expected tokens per unit of target-pass time, assuming a
    draft pass of L layers costs L/N of a target pass and verifying k+1 positions costs one pass."""
    agreement = early_exit_agreement(target, input_ids)
    n_layers = len(agreement) + 1
    best_layers, best_rate = None, 1.0  # plain decoding: 1 token per target pass
    for layers, alpha in enumerate(agreement, start=1):
        alpha = min(alpha, 0.999)
        for k in range(1, max_k + 1):
            expected = (1 - alpha ** (k + 1)) / (1 - alpha)
            rate = expected / (1 + k * layers / n_layers)
            if rate > best_rate:
                best_layers, best_rate = layers, rate
    return best_layers, best_rate


class SelfDrafter(ModelDrafter):
    """Drafts with the target's first `layers` layers (its own KV cache, the target's weights).

    layers=None calibrates on the first prompt it sees; when no depth pays, it proposes nothing
    (the engine then decodes plainly).
    """

    def __init__(self, target, layers: int | None = None, tokenizer=None):
        self.target, self.tokenizer, self.layers = target, tokenizer, None
        self.name, self.calibrated = "self", False  # ModelDrafter's own init runs once a depth pays
        if layers is not None:
            self._use(layers)

    def _use(self, layers: int) -> None:
        n_layers = self.target.config.num_hidden_layers
        if not 1 <= layers < n_layers:
            raise ValueError(f"self-speculation needs 1 <= layers < {n_layers} (the target's depth), got {layers}")
        self.layers = layers  # before ModelDrafter's init, whose reset() needs it
        super().__init__(_shallow_model(self.target, layers), self.tokenizer, name=f"self:{layers}")

    def spawn(self) -> "SelfDrafter":
        if self.layers is not None:
            return super().spawn()
        twin = SelfDrafter(self.target, None, self.tokenizer)
        twin.calibrated = self.calibrated  # a depth that did not pay is not looked for again
        return twin

    def reset(self) -> None:
        if self.layers is not None:
            super().reset()

    def check_vocab(self, vocab_size: int, tokenizer=None) -> None:
        pass  # the target's own head

    def unread(self, input_ids: torch.Tensor) -> int:
        return super().unread(input_ids) if self.layers is not None else 0

    def prefill(self, prompt_ids: torch.Tensor) -> None:
        if self.layers is None and not self.calibrated:
            self.calibrated = True
            layers, _ = calibrate_layers(self.target, prompt_ids)
            if layers is not None:
                self._use(layers)
        if self.layers is not None:
            super().prefill(prompt_ids)

    def propose(self, input_ids, k, sampling, draws, keep_going=None):
        if self.layers is None:
            return Draft.empty(input_ids.shape[0])
        return super().propose(input_ids, k, sampling, draws, keep_going)

    def commit(self, input_ids) -> None:
        if self.layers is not None:
            super().commit(input_ids)
