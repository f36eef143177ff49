"""`specdecode.generate(model, assistant_model=draft, ...)`: the call shape transformers users know."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafters import ModelDrafter, NgramDrafter
from .engine import SpeculativeEngine
from .encoding import eos_token_ids
from .sampling import SamplingParams
from .stats import GenerationStats
from .stopping import StopCondition


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [1, L + new]: prompt then generated tokens, like transformers
    stats: GenerationStats
    finish_reason: str


def generate(
    model,
    input_ids: torch.Tensor,
    *,
    assistant_model=None,
    prompt_lookup_num_tokens: int | None = None,
    num_assistant_tokens: int = 5,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    stop_strings: list[str] | None = None,
    tokenizer=None,
    return_dict_in_generate: bool = False,
):
    """Speculative `generate`: with `assistant_model` (a draft model of the same vocabulary) or
    `prompt_lookup_num_tokens` (n-gram drafting from the context), else plain decoding.

    Greedy (do_sample=False) output is token for token the model's own greedy output; sampled output
    follows the model's distribution (temperature / top-k / top-p) exactly. Unlike transformers,
    top_k defaults to 0 (off). Returns the sequences [1, L+new], or a GenerateOutput with stats.
    """
    if assistant_model is not None and prompt_lookup_num_tokens:
        raise ValueError("give either assistant_model or prompt_lookup_num_tokens, not both")
    if assistant_model is not None:
        drafter, k = ModelDrafter(assistant_model, tokenizer), num_assistant_tokens
    elif prompt_lookup_num_tokens:
        drafter, k = NgramDrafter(), prompt_lookup_num_tokens
    else:
        drafter, k = None, num_assistant_tokens
    engine = SpeculativeEngine(model, drafter, tokenizer=tokenizer, k=k)
    if eos_token_id is None:
        eos = eos_token_ids(engine.backend, tokenizer)
    else:
        eos = frozenset(eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])
    sampling = SamplingParams(temperature=temperature if do_sample else 0.0, top_k=top_k, top_p=top_p, seed=seed)
    result = engine.generate(
        input_ids, max_new_tokens=max_new_tokens, sampling=sampling, stop=StopCondition(eos, tuple(stop_strings or ()), tokenizer)
    ).result()
    sequences = torch.cat([input_ids.cpu(), torch.tensor([result.token_ids], dtype=torch.long)], dim=1)
    if return_dict_in_generate:
        return GenerateOutput(sequences, result.stats, result.finish_reason)
    return sequences
