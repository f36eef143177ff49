"""Make a draft model cheaper per token without touching what the target outputs.

A draft only changes acceptance, never the output, so it may be approximate: weight-only int8 for
one-row steps (2–2.5× faster matmuls on CPU), and an output head restricted to the tokens a draft is
likely to need (q = 0 elsewhere keeps speculative sampling lossless: the target's residual covers them).
"""

from __future__ import annotations

import torch
from torch import nn


def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: weight ≈ int8 * scale[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int8_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8Linear(nn.Module):
    """A Linear that multiplies one-row (decode) inputs with int8 weights, wider inputs with the originals.

    The int8 kernel is faster for one row but slower for several, so prefill and catch-up passes keep
    the original weights (memory: +50 % of the layer).
    """

    MAX_INT8_ROWS = 2

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear
        qweight, scale = _quantize_rows(linear.weight)
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scale", scale.to(linear.weight.dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > self.MAX_INT8_ROWS or x.dtype != self.scale.dtype or x.device.type != "cpu":
            return self.linear(x)
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, -1), self.qweight, self.scale)
        if self.linear.bias is not None:
            y = y + self.linear.bias
        return y.reshape(*x.shape[:-1], -1)


def quantize_int8(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Swap every nn.Linear in model (but `skip`) for an Int8Linear in place; returns how many."""
    if not int8_available():
        return 0
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not any(name.endswith(s) for s in skip)
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, Int8Linear(module))
    return len(targets)


class RestrictedHead:
    """The draft's output head over a subset of the vocabulary: the `base` most common token ids
    (byte-level BPE ids are roughly in frequency order), the special tokens, and each prompt's own
    tokens (so copying from the context stays possible). The base part is prepared once; a prompt
    adds a small extra block."""

    def __init__(self, lm_head: nn.Linear, base: int, specials: list[int], int8: bool):
        self.weight = lm_head.weight.detach()
        self.vocab = self.weight.shape[0]
        self.int8 = int8 and int8_available()
        base_ids = torch.cat([torch.arange(min(base, self.vocab)), torch.tensor(specials, dtype=torch.long)])
        self.base = self._block(torch.unique(base_ids))
        self.in_base = torch.zeros(self.vocab, dtype=torch.bool)
        self.in_base[self.base[0].cpu()] = True
        self.set_context(torch.empty(0, dtype=torch.long))

    def _block(self, ids: torch.Tensor) -> tuple:
        ids = ids.to(self.weight.device)
        weight = self.weight.index_select(0, ids)
        if self.int8:
            qweight, scale = _quantize_rows(weight)
            return ids, qweight, scale.to(weight.dtype)
        return ids, weight, None

    def set_context(self, prompt_ids: torch.Tensor) -> None:
        extra = torch.unique(prompt_ids.flatten().cpu())
        extra = extra[~self.in_base[extra]]
        self.extra = self._block(extra) if len(extra) else None
        self.ids = self.base[0] if self.extra is None else torch.cat([self.base[0], self.extra[0]])

    def _apply(self, block: tuple, hidden: torch.Tensor) -> torch.Tensor:
        _, weight, scale = block
        if scale is not None and hidden.dtype == scale.dtype and hidden.device.type == "cpu":
            return torch.ops.aten._weight_int8pack_mm(hidden, weight, scale)
        if scale is not None:
            return (hidden.float() @ weight.float().T) * scale.float()
        return hidden @ weight.T

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] hidden -> [B, V] fp32 logits, -inf outside the subset."""
        full = torch.full((hidden.shape[0], self.vocab), float("-inf"), device=hidden.device)
        full[:, self.base[0]] = self._apply(self.base, hidden).float()
        if self.extra is not None:
            full[:, self.extra[0]] = self._apply(self.extra, hidden).float()
        return full
