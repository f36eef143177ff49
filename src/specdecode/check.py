"""`specdecode check`: prove on your prompts that speculation preserved the output.

Greedy: plain and speculative outputs must be identical. Where they differ, the target's top-2 logit
gap at the first differing position tells a numeric near-tie (a batched verify pass and a one-token
pass can round differently in bf16) from a real divergence (a bug).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .pipeline import SpecDecoder
from .prompts import Prompt

# Below this top-2 logit gap a difference can come from rounding alone.
NEAR_TIE_GAP = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}


@dataclass
class GreedyCase:
    id: str
    task: str
    identical: bool
    new_tokens: int
    first_difference: int | None = None  # index into the generated tokens
    top2_gap: float | None = None
    verdict: str = "identical"  # identical | near-tie | DIVERGENCE


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def top2_gap(model, input_ids: torch.Tensor) -> float:
    logits = model(input_ids=input_ids.to(model.device), logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def check_greedy(decoder: SpecDecoder, prompts: list[Prompt], max_new_tokens: int, chat: bool = True, progress=None):
    """Run plain and speculative greedy decoding on each prompt and compare them token for token."""
    threshold = NEAR_TIE_GAP.get(decoder.target.dtype, 1e-3)
    cases = []
    for prompt in prompts:
        plain = decoder.generate(prompt.text, chat=chat, max_new_tokens=max_new_tokens, speculate=False)
        spec = decoder.generate(prompt.text, chat=chat, max_new_tokens=max_new_tokens)
        diff = first_difference(plain.token_ids, spec.token_ids)
        case = GreedyCase(prompt.id, prompt.task, diff is None, len(plain.token_ids))
        if diff is not None:
            prefix = torch.tensor([plain.token_ids[:diff]], dtype=torch.long)
            gap = top2_gap(decoder.target, torch.cat([decoder.encode(prompt.text, chat=chat), prefix], dim=1))
            case.first_difference, case.top2_gap = diff, gap
            case.verdict = "near-tie" if gap < threshold else "DIVERGENCE"
        cases.append(case)
        if progress:
            progress(case)
    return cases


def summarize_greedy(cases: list[GreedyCase]) -> dict:
    return dict(
        identical=sum(c.identical for c in cases),
        total=len(cases),
        near_ties=sum(c.verdict == "near-tie" for c in cases),
        divergences=sum(c.verdict == "DIVERGENCE" for c in cases),
        cases=[asdict(c) for c in cases],
    )
