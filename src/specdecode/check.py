"""`specdecode check`: prove on your prompts that speculation preserved the output.

Greedy: plain and speculative outputs must be identical. Where they differ, the target's top-2 logit
gap at the first differing position tells a numeric near-tie (a batched verify pass and a one-token
pass can round differently in bf16) from a real divergence (a bug).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .batch import BatchEngine
from .pipeline import SpecDecoder
from .prompts import Prompt
from .sampling import SamplingParams
from .stopping import StopCondition



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


def top2_gap(backend, input_ids: torch.Tensor) -> float:
    """The target's top-2 logit gap after input_ids [1, L], from a one-off row of its own."""
    logits = backend.add_row(input_ids)[0]
    backend.remove_rows([backend.rows - 1])
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def check_greedy(decoder: SpecDecoder, prompts: list[Prompt], max_new_tokens: int, chat: bool = True, progress=None):
    """Run plain and speculative greedy decoding on each prompt and compare them token for token."""
    backend = decoder.engine.backend
    threshold = backend.near_tie_gap
    cases = []
    for prompt in prompts:
        plain = decoder.generate(prompt.text, chat=chat, max_new_tokens=max_new_tokens, speculate=False)
        spec = decoder.generate(prompt.text, chat=chat, max_new_tokens=max_new_tokens)
        diff = first_difference(plain.token_ids, spec.token_ids)
        case = GreedyCase(prompt.id, prompt.task, diff is None, len(plain.token_ids))
        if diff is not None:
            prefix = torch.tensor([plain.token_ids[:diff]], dtype=torch.long)
            gap = top2_gap(backend, torch.cat([decoder.encode(prompt.text, chat=chat), prefix], dim=1))
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


@dataclass
class SamplingCase:
    id: str
    position: int  # generated-token index (0 is sampled by the prefill alone, so checks start at 1)
    samples: int
    pvalue: float
    tvd: float
    verdict: str  # PASS | FAIL | INCONCLUSIVE (too few samples: most tokens too rare to test)

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"


def two_sample_test(a: list[int], b: list[int], min_expected: float = 5.0) -> tuple[float, float, float]:
    """(chi-square p-value, total-variation distance, pooled fraction) for two token samples sharing one
    distribution. Tokens too rare for the chi-square approximation are pooled into one bin; the pooled
    fraction says how much of the samples the test could not tell apart token by token."""
    import numpy as np
    from scipy.stats import chi2_contingency

    tokens = sorted(set(a) | set(b))
    index = {t: i for i, t in enumerate(tokens)}
    counts = np.zeros((2, len(tokens)))
    for row, sample in enumerate((a, b)):
        for t in sample:
            counts[row, index[t]] += 1
    tvd = 0.5 * float(np.abs(counts[0] / len(a) - counts[1] / len(b)).sum())
    total = counts.sum(0)
    common = total >= 2 * min_expected
    table = np.concatenate([counts[:, common], counts[:, ~common].sum(1, keepdims=True)], axis=1)
    table = table[:, table.sum(0) > 0]
    pooled = float(counts[:, ~common].sum() / counts.sum())
    if table.shape[1] < 2:
        return 1.0, tvd, pooled  # a single bin: nothing to compare
    return float(chi2_contingency(table).pvalue), tvd, pooled


SAMPLING_ROWS = 32  # completions drawn side by side where the backend holds that many rows
CONTEXT_ROWS = 8  # rows of the llama.cpp context `check --temperature` loads (8 x 4,096 positions: ~0.9 GB of cells)


def draw_samples(decoder: SpecDecoder, input_ids: torch.Tensor, samples: int, max_new_tokens: int,
                 sampling: SamplingParams, speculate: bool) -> list[list[int]]:
    """`samples` completions of one prompt. Unseeded requests, each from its own torch seed: the min(1, p/q) rule
    they are judged by (a seeded request's text is the seed's whether it drafts or not: sampling.KeyedDraws, tested
    in the suite). As rows of one batch (target passes shared; fixed draft length), as many as the backend holds."""
    backend = decoder.engine.backend
    rows = min(SAMPLING_ROWS, samples, backend.max_rows or SAMPLING_ROWS)
    engine = BatchEngine(backend, decoder.drafter if speculate else None, decoder.tokenizer, k=decoder.engine.k,
                         max_batch=rows)
    stop = StopCondition(decoder.eos, (), decoder.tokenizer)
    seqs = []
    for i in range(samples):
        torch.manual_seed(2 * i + int(speculate))
        seqs.append(engine.submit(input_ids, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                                  speculate=speculate))
    while engine.has_work:
        engine.step()
    return [seq.result.token_ids for seq in seqs]


def check_sampling(
    decoder: SpecDecoder,
    prompts: list[Prompt],
    *,
    samples: int,
    positions: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    alpha: float = 1e-3,
    max_pooled: float = 0.2,
    chat: bool = True,
    progress=None,
) -> list[SamplingCase]:
    """Draw `samples` completions of `positions + 1` tokens per prompt with speculative and with plain
    sampling (disjoint seeds), and test per generated position that both follow one distribution.
    A position where more than `max_pooled` of the samples are tokens too rare to test is INCONCLUSIVE."""
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    cases = []
    for prompt in prompts:
        input_ids = decoder.encode(prompt.text, chat=chat)
        drawn = {speculate: draw_samples(decoder, input_ids, samples, positions + 1, sampling, speculate)
                 for speculate in (True, False)}
        for position in range(1, positions + 1):
            spec = [ids[position] for ids in drawn[True] if len(ids) > position]
            plain = [ids[position] for ids in drawn[False] if len(ids) > position]
            if not spec or not plain:
                continue  # every sample ended before this position
            pvalue, tvd, pooled = two_sample_test(spec, plain)
            verdict = "INCONCLUSIVE" if pooled > max_pooled else ("PASS" if pvalue > alpha else "FAIL")
            cases.append(SamplingCase(prompt.id, position, min(len(spec), len(plain)), pvalue, tvd, verdict))
            if progress:
                progress(cases[-1])
    return cases
