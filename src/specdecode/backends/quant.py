"""Make a draft model cheaper per token without touching what the target outputs.

A draft only changes acceptance, never the output, so it may be approximate: weight-only int8 or int4
for one-row steps (a decode step is memory-bound on CPU: fewer weight bytes, faster steps), and an
output head restricted to the tokens a draft is likely to need (q = 0 elsewhere keeps speculative
sampling lossless: the target's residual covers them).
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


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


class PackedLinear(nn.Module):
    """A Linear that multiplies one- or two-row (decode) inputs with packed low-bit weights, wider inputs
    with the originals: the packed kernels are faster for one row but slower for several, so prefill and
    catch-up passes keep the original weights (memory: +50 % of the layer for int8, +25 % for int4)."""

    MAX_PACKED_ROWS = 2

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > self.MAX_PACKED_ROWS or x.dtype != self.linear.weight.dtype or x.device.type != "cpu":
            return self.linear(x)
        y = self._packed_mm(x.reshape(rows, -1))
        if self.linear.bias is not None:
            y = y + self.linear.bias
        return y.reshape(*x.shape[:-1], -1)


class Int8Linear(PackedLinear):
    """Symmetric int8 per output row (`_weight_int8pack_mm`)."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        qweight, scale = _quantize_rows(linear.weight)
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scale", scale.to(linear.weight.dtype), persistent=False)

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scale)


class Int4Linear(PackedLinear):
    """Asymmetric 4-bit weights, min–max per group of `group_size` input columns
    (`_weight_int4pack_mm_for_cpu`: w = (q - 8) * scale + zero). Half the bytes of int8: a one-row draft
    step is memory-bound on CPU, so this one is ~35 % faster than int8 (Qwen2.5-0.5B, 2 threads: 35 vs
    55 ms), at a small cost in agreement with the target (0.759 vs 0.772 top-1 on the dev set)."""

    GROUP_SIZES = (64, 32)  # the first that divides in_features; 64 measured as good as 32 and as fast

    @staticmethod
    def group_size_for(in_features: int) -> int | None:
        return next((g for g in Int4Linear.GROUP_SIZES if in_features % g == 0), None)

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self.group_size = self.group_size_for(linear.in_features)
        if self.group_size is None:
            raise ValueError(f"int4 needs in_features divisible by one of {self.GROUP_SIZES}, got {linear.in_features}")
        w = linear.weight.detach().float()
        groups = w.reshape(w.shape[0], -1, self.group_size)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-8)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).reshape(w.shape).to(torch.int32)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), persistent=False)
        # [in_features / group, out_features, (scale, zero)], zero = the value of q = 8
        scales_and_zeros = torch.stack([scale.T, (low + 8 * scale).T], -1).to(linear.weight.dtype).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)


def quantize(model: nn.Module, bits: int = 8, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Swap every nn.Linear in model (but `skip`) for a packed int8 or int4 one in place; returns how many.
    With bits=4, a layer int4 cannot pack (in_features not a multiple of 32) gets int8 instead."""
    if bits not in (4, 8):
        raise ValueError(f"draft weights can be packed to 8 or 4 bits, not {bits}")
    if not int8_available() or (bits == 4 and not int4_available()):
        return 0
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not any(name.endswith(s) for s in skip)
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        four = bits == 4 and Int4Linear.group_size_for(module.in_features) is not None
        setattr(model.get_submodule(parent_name) if parent_name else model, child, Int4Linear(module) if four else Int8Linear(module))
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


def fastest_weight_format(model: nn.Module, repeats: int = 20) -> str | None:
    """'int4', 'int8' or None (the model's own weights): whichever runs a one-row step of the model's widest Linear
    fastest here, measured now. int4 wins with AVX-512 (35 vs 55 ms a Qwen-0.5B step) and loses ~10x without it,
    so no fixed choice fits both CPUs."""
    import time

    linears = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and not name.endswith("lm_head")]
    if not linears or not int8_available():
        return None
    widest = max(linears, key=lambda m: m.weight.numel())
    candidates: dict[str | None, nn.Module] = {None: widest, "int8": Int8Linear(widest)}
    if int4_available() and Int4Linear.group_size_for(widest.in_features):
        candidates["int4"] = Int4Linear(widest)
    x = torch.randn(1, widest.in_features, dtype=widest.weight.dtype)
    best, best_s = None, float("inf")
    with torch.inference_mode():
        for name, layer in candidates.items():
            layer(x)  # warm-up
            t0 = time.perf_counter()
            for _ in range(repeats):
                layer(x)
            seconds = time.perf_counter() - t0
            if seconds < best_s:
                best, best_s = name, seconds
    return best
