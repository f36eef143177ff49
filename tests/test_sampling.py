"""Speculative sampling must follow the target's distribution exactly (temperature, top-k, top-p)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import specdecode.sampling as sampling_module
from specdecode import ModelDrafter, SamplingParams, SpeculativeEngine
from specdecode.batch import BatchEngine
from specdecode.sampling import logits_to_probs
from specdecode.verify import argmax, greedy_verdicts, gumbel_max, speculative_accept
from stats_check import fit
from tiny import random_prompt, tiny_model

ALPHA = 1e-3  # a correct sampler fails one check in a thousand; a biased one fails them all


# ----------------------------------------------------------------------------- processing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torchs_first_of_ties_on_any_layout(dtype):
    """Greedy identity rests on plain and speculative steps picking the same token: ties, NaN, -inf and views."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (3, 5, 257), generator=g).to(dtype)  # many ties
    logits[0, 1, 7] = float("nan")
    logits[1, 2] = float("-inf")
    for x in (logits, logits[:, 1:4], logits.transpose(0, 1), logits[1, 0], logits[:, :, ::2]):
        got = argmax(x)
        assert got.dtype == torch.long and got.shape == x.shape[:-1]
        assert torch.equal(got, x.argmax(-1))


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.randn(4, 50)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=5))
    assert ((probs > 0).sum(-1) == 5).all()
    assert torch.allclose(probs.sum(-1), torch.ones(4))


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.allclose(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def full_sort_nucleus_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """top-p by a sort of the whole vocabulary: the definition the ranked-candidates shortcut must equal."""
    sorted_probs, order = torch.sort(logits.softmax(-1), dim=-1, descending=True)
    drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    drop_sorted[..., 0] = False
    return drop_sorted.scatter(-1, order, drop_sorted)


@pytest.mark.parametrize("sharpness", [0.1, 1.0, 2.0, 5.0, 30.0])  # flat rows need the full sort, peaked ones do not
@pytest.mark.parametrize("top_p", [1e-9, 0.3, 0.9, 0.999])
def test_nucleus_from_ranked_candidates_equals_a_full_sort(monkeypatch, sharpness, top_p):
    monkeypatch.setattr(sampling_module, "NUCLEUS_CANDIDATES", (4, 16))
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(int(sharpness * 10))) * sharpness
    expected = full_sort_nucleus_mask(logits, top_p)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.equal(probs == 0, expected)
    assert torch.allclose(probs.sum(-1), torch.ones(6))
    kept = (~expected).sum(-1)
    assert ((kept >= 1) & (kept <= 500)).all()


def test_sample_tokens_follows_each_rows_distribution_and_never_draws_a_zero():
    from specdecode.verify import sample_tokens

    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 2.0, 6.0]])  # the second row not normalized
    g = torch.Generator().manual_seed(0)
    samples = torch.stack([sample_tokens(probs, g) for _ in range(4000)])  # [N, 2]
    for row in range(2):
        pv, tvd = fit(samples[:, row].tolist(), probs[row] / probs[row].sum())
        assert pv > ALPHA and tvd < 0.03, (row, pv, tvd)
    assert not (samples[:, 0] == 1).any() and not (samples[:, 0] == 4).any() and (samples[:, 1] >= 3).all()


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    assert torch.allclose(logits_to_probs(logits, SamplingParams(temperature=0.5)), (logits / 0.5).softmax(-1))


# ----------------------------------------------------------------------------- the acceptance rule alone


def wrong_rule_resample_from_p(draft_tokens, draft_probs, target_probs, generator=None, draft_lens=None,
                               target_ids=None):
    """A classic bug: on rejection, sample from p instead of the residual max(0, p - q)."""
    B, k = draft_tokens.shape
    if target_ids is not None:  # p given over the tokens it keeps: spread over the vocabulary
        vocab = 1 + max(int(target_ids.max()), int(draft_tokens.max()) if draft_tokens.numel() else 0)
        target_probs = torch.zeros(*target_probs.shape[:-1], vocab).scatter(-1, target_ids, target_probs)
    p_x = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    u = torch.rand(B, k, generator=generator)
    accepted_len = (u * q_x < p_x).long().cumprod(-1).sum(-1)
    p_at = target_probs[torch.arange(B), accepted_len]
    return accepted_len, torch.multinomial(p_at, 1, generator=generator).squeeze(-1)


def emitted_at(position, draft_tokens, accepted_len, next_token):
    """Token emitted at `position` by rows that got that far in this step."""
    reached = accepted_len >= position
    from_draft = accepted_len > position
    tokens = torch.where(from_draft, draft_tokens[:, min(position, draft_tokens.shape[1] - 1)], next_token)
    return tokens[reached]


@pytest.mark.parametrize("rule, should_pass", [(speculative_accept, True), (wrong_rule_resample_from_p, False)])
def test_acceptance_rule_preserves_target_distribution(rule, should_pass):
    g = torch.Generator().manual_seed(0)
    B, k, V = 40_000, 3, 12
    p = torch.distributions.Dirichlet(torch.full((V,), 0.5)).sample((k + 1,))  # [k+1, V], fixed per position
    q = torch.distributions.Dirichlet(torch.full((V,), 0.5)).sample((k,))  # [k, V]
    draft_tokens = torch.stack([torch.multinomial(q[i], B, replacement=True, generator=g) for i in range(k)], 1)
    accepted_len, next_token = rule(draft_tokens, q.expand(B, k, V), p.expand(B, k + 1, V), g)
    # Given the target's distribution does not depend on the context here, the token emitted at
    # position j (by rows that reach j) must be distributed as p[j].
    results = [fit(emitted_at(j, draft_tokens, accepted_len, next_token), p[j]) for j in range(2)]
    if should_pass:
        assert all(pv > ALPHA and tvd < 0.03 for pv, tvd in results), results
    else:
        assert any(pv < ALPHA for pv, _ in results), results


def test_deterministic_draft_rule_preserves_distribution():
    """An n-gram draft has q one-hot: accept with p(x), else sample from p without x."""
    g = torch.Generator().manual_seed(1)
    B, V = 40_000, 10
    p = torch.distributions.Dirichlet(torch.ones(V)).sample((2,))
    draft_tokens = torch.full((B, 1), int(p[0].argmin()))  # a poor guess: mostly rejected
    accepted_len, next_token = speculative_accept(draft_tokens, None, p.expand(B, 2, V), g)
    pv, tvd = fit(emitted_at(0, draft_tokens, accepted_len, next_token), p[0])
    assert pv > ALPHA and tvd < 0.03


# ----------------------------------------------------------------------------- end to end on tiny models

VOCAB = 16
SAMPLES = 1500
# The first token comes from the prefill, so the first step may draft k = 2 tokens (budget 4 - 1 - 1): generated
# tokens 2 and 3 come from that step (accepted, or the correction at draft index 0 or 1), token 4 is its bonus
# token when both were accepted.
MAX_NEW_TOKENS, K = 4, 2
CHECKED = (1, 2, 3)  # indices of the generated tokens whose marginals are compared


@pytest.fixture(scope="module")
def small_vocab_pair():
    return tiny_model(11, vocab=VOCAB, sharpness=6.0), tiny_model(12, vocab=VOCAB, sharpness=6.0)


def exact_marginals(model, prompt, params: SamplingParams) -> list[torch.Tensor]:
    """Exact distributions of generated tokens 2, 3 and 4 under plain sampling, by enumeration."""
    with torch.no_grad():
        joint = logits_to_probs(model(prompt).logits[0, -1], params)  # [V]: token 1
        seqs = torch.arange(VOCAB)[:, None]
        marginals = []
        for depth in range(len(CHECKED)):
            full = torch.cat([prompt.expand(seqs.shape[0], -1), seqs], 1)
            next_probs = logits_to_probs(model(full).logits[:, -1], params)  # [V^(depth+1), V]
            joint = joint.reshape(-1)[:, None] * next_probs
            marginals.append(joint.view(-1, VOCAB).sum(0))
            seqs = torch.cat([seqs.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(seqs.shape[0])[:, None]], 1)
    return marginals


def check_results(generated: list[list[int]], target, prompt, params) -> list[tuple[float, float]]:
    """(p-value, TVD) of each checked token position of many sampled generations against the exact marginal."""
    exact = exact_marginals(target, prompt, params)
    return [fit([tokens[i] for tokens in generated], p) for i, p in zip(CHECKED, exact)]


def assert_lossless(results, lossless: bool = True) -> None:
    if lossless:
        assert all(pv > ALPHA for pv, _ in results), results
    else:  # a negative control: the check must see the wrong rule
        assert any(pv < ALPHA for pv, _ in results), results


def assert_drafts_reached_the_second_position(stats_list) -> None:
    """The check is only worth something if drafts were 2 long and rejections happened at draft index 1."""
    drafted_second = sum(s.drafted_per_position[1] if len(s.drafted_per_position) > 1 else 0 for s in stats_list)
    rejected_second = sum(s.accepted_len_histogram[1] if len(s.accepted_len_histogram) > 1 else 0 for s in stats_list)
    assert drafted_second > len(stats_list) // 4 and rejected_second > len(stats_list) // 20, (drafted_second, rejected_second)


def sample_generations(engine, prompt, params: SamplingParams, n: int) -> tuple[list[list[int]], list]:
    """n generations; unseeded (params.seed None: the min(1, p/q) rule, each run from its own torch seed) or seeded
    with seeds params.seed, params.seed + 1, ... (position-keyed draws). A BatchEngine runs them as rows side by side
    (each row's draws start from its own torch seed when it is submitted), a SpeculativeEngine one at a time."""

    def request(i: int) -> dict:
        torch.manual_seed(i)
        seed = None if params.seed is None else params.seed + i
        return dict(input_ids=prompt, max_new_tokens=MAX_NEW_TOKENS, k=K,
                    sampling=SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed))

    if isinstance(engine, BatchEngine):
        seqs = [engine.submit(**request(i)) for i in range(n)]
        while engine.has_work:
            engine.step()
        results = [seq.result for seq in seqs]
    else:
        results = [engine.generate(**request(i)).result() for i in range(n)]
    return [r.token_ids for r in results], [r.stats for r in results]


def batched(target, drafter) -> BatchEngine:
    """Rows side by side (target passes shared): the suite's sampling checks run in a third less time."""
    return BatchEngine(target, drafter, k=K, max_batch=64)


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=5),
]
SETTING_IDS = lambda p: f"T{p.temperature}-p{p.top_p}-k{p.top_k}" + ("" if p.seed is None else "-seeded")  # noqa: E731
# Seeded requests are judged by position-keyed draws (sampling.KeyedDraws), unseeded ones by min(1, p/q); top-k puts
# log(0) = -inf into the perturbed scores
SEEDED = [SamplingParams(temperature=0.8, top_k=5, seed=90_000), SamplingParams(temperature=1.0, seed=50_000)]


@pytest.mark.parametrize("params", SETTINGS + SEEDED[:1], ids=SETTING_IDS)
def test_speculative_sampling_matches_target_distribution(small_vocab_pair, params):
    target, draft = small_vocab_pair
    prompt = random_prompt(5, 6, vocab=VOCAB)
    generated, stats = sample_generations(batched(target, ModelDrafter(draft)), prompt, params, SAMPLES)
    assert_drafts_reached_the_second_position(stats)
    assert_lossless(check_results(generated, target, prompt, params))


@pytest.mark.parametrize("params", [SETTINGS[0], SETTINGS[2], SETTINGS[3]], ids=SETTING_IDS)
def test_distribution_check_fails_for_a_wrong_acceptance_rule(small_vocab_pair, monkeypatch, params):
    monkeypatch.setattr(sampling_module, "speculative_accept", wrong_rule_resample_from_p)
    target, draft = small_vocab_pair
    prompt = random_prompt(5, 6, vocab=VOCAB)
    generated, _ = sample_generations(batched(target, ModelDrafter(draft)), prompt, params, SAMPLES)
    assert_lossless(check_results(generated, target, prompt, params), lossless=False)


# ----------------------------------------------------------------------------- seeded requests (position-keyed draws)


def wrong_keyed_rule_accept_every_draft(draft_tokens, target_probs, noise, target_ids=None):
    """Wrong: keeps the whole draft, so drafted tokens follow q instead of p."""
    k = draft_tokens.shape[1]
    accepted_len = torch.full((draft_tokens.shape[0],), k)
    ids = None if target_ids is None else target_ids[:, k]
    return accepted_len, gumbel_max(target_probs[:, k], noise[k], ids)


def test_seeded_distribution_check_fails_for_a_wrong_keyed_rule(small_vocab_pair, monkeypatch):
    monkeypatch.setattr(sampling_module, "keyed_accept", wrong_keyed_rule_accept_every_draft)
    target, draft = small_vocab_pair
    prompt = random_prompt(5, 6, vocab=VOCAB)
    generated, _ = sample_generations(batched(target, ModelDrafter(draft)), prompt, SEEDED[1], SAMPLES)
    assert_lossless(check_results(generated, target, prompt, SEEDED[1]), lossless=False)


@pytest.mark.parametrize("top_p", [1.0, 0.8], ids=["whole-vocabulary", "nucleus"])
def test_a_seed_gives_the_same_text_whether_steps_draft_or_not(small_vocab_pair, monkeypatch, top_p):
    """Drafting off, fixed drafts of 1, 3 and 6 tokens, adaptive, a model draft or lookups: one seed, one text. With
    top-p a step's positions are ranked among as many candidates as its flattest one needs (2, 4, 8 or all 16
    here), so one position is ranked among different numbers of tokens in steps of different widths."""
    from specdecode import NgramDrafter
    from specdecode.batch import BatchEngine

    monkeypatch.setattr(sampling_module, "NUCLEUS_CANDIDATES", (2, 4, 8))
    target, draft = small_vocab_pair
    prompt = random_prompt(7, 9, vocab=VOCAB)
    for seed in (0, 1, 2**40 + 3):
        sampling = SamplingParams(temperature=1.0, top_p=top_p, seed=seed)
        plain = SpeculativeEngine(target, None).generate(prompt, max_new_tokens=24, sampling=sampling).result()
        runs = [SpeculativeEngine(target, ModelDrafter(draft), k=k, adaptive=False) for k in (1, 3, 6)]
        runs += [SpeculativeEngine(target, ModelDrafter(draft), k=4, adaptive=True),
                 SpeculativeEngine(target, NgramDrafter(max_ngram=2), k=4, adaptive=False)]
        drafted = 0
        for engine in runs:
            result = engine.generate(prompt, max_new_tokens=24, sampling=sampling).result()
            assert result.token_ids == plain.token_ids, (seed, engine)
            drafted += result.stats.drafted_tokens
        assert drafted > 0 and plain.stats.drafted_tokens == 0
        # a row batched beside others draws the same text too
        batched = BatchEngine(target, ModelDrafter(draft), k=3, adaptive=False, max_batch=4).generate_all(
            [dict(input_ids=random_prompt(s, 5, vocab=VOCAB), max_new_tokens=24, sampling=sampling) for s in (20, 21)]
            + [dict(input_ids=prompt, max_new_tokens=24, sampling=sampling)])
        assert batched[-1].result.token_ids == plain.token_ids


def test_every_bit_of_a_64_bit_seed_counts():
    from specdecode.sampling import KeyedDraws

    seeds = [0, 2**32, -(2**63), 2**63 - 1, -1, 1]
    noises = [KeyedDraws(s).noise(3, 64) for s in seeds]
    for i in range(len(seeds)):
        for j in range(i + 1, len(seeds)):
            assert not torch.equal(noises[i], noises[j]), (seeds[i], seeds[j])
    assert torch.equal(KeyedDraws(-1).noise(3, 64), KeyedDraws(2**64 - 1).noise(3, 64))  # one 64-bit value
    assert torch.equal(KeyedDraws(7).noise(3, 64), KeyedDraws(7).noise(3, 64))
    assert not torch.equal(KeyedDraws(7).noise(3, 64), KeyedDraws(7).noise(4, 64))
    with pytest.raises(ValueError, match="64-bit"):
        KeyedDraws(2**64)


# ----------------------------------------------------------------------------- drafts that cost no model pass


@pytest.mark.parametrize("chained", [False, True], ids=["trees", "chains"])
@pytest.mark.parametrize("lossless", [True, False], ids=["speculative-rule", "wrong-rule"])
def test_suffix_drafts_keep_the_target_distribution(small_vocab_pair, monkeypatch, lossless, chained):
    """Suffix-tree drafts (deterministic: q one-hot) from the prompt and earlier samples' answers, 2 tokens and more,
    with their tree leaves, or its chained copies (short ones here); a rule that resamples from p instead of the
    residual must show."""
    from specdecode import SuffixDrafter
    from specdecode.drafters.suffix import ContextChains

    if not lossless:
        monkeypatch.setattr(sampling_module, "speculative_accept", wrong_rule_resample_from_p)
    target, _ = small_vocab_pair
    # A pattern the trees propose to go on with and the target mostly does not: rejections, where a wrong rule shows
    # (of 12 such prompts this one shows it clearest, p ~ 1e-6 at 1500 samples)
    prompt = random_prompt(3, 2, vocab=VOCAB).repeat(1, 3)
    params = SETTINGS[0]
    drafter = SuffixDrafter(chains=ContextChains(context=2, shortest=2, longest=4) if chained else None)
    generated, stats = sample_generations(batched(target, drafter), prompt, params, SAMPLES)
    assert_drafts_reached_the_second_position(stats)
    assert any(source.endswith("/chain") for s in stats for source in s.by_source) == chained
    assert_lossless(check_results(generated, target, prompt, params), lossless=lossless)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_greedy_verdicts_on_the_cpu_equal_the_batched_rule(data):
    """The CPU path (numpy's argmax, Python compares) and the batched tensor rule (any other device or dtype) give
    the same accepted lengths and next tokens as the rule written out, for drafts of different lengths that match
    the target's argmax for a while."""
    rows, vocab = data.draw(st.integers(1, 4)), data.draw(st.integers(2, 6))
    lengths = data.draw(st.lists(st.integers(0, 5), min_size=rows, max_size=rows))
    width = max(lengths) + 1
    logits = torch.randn(rows, width, vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 999))))
    target = logits.argmax(-1)
    drafts = []
    for row, length in enumerate(lengths):
        right = data.draw(st.integers(0, length))  # the first `right` tokens match; the next one, if any, differs
        draft = target[row, :length].clone()
        if right < length:
            draft[right] = (draft[right] + data.draw(st.integers(1, vocab - 1))) % vocab
        drafts.append(draft)
    expected_lens = [next((n for n in range(len(d)) if d[n] != target[r, n]), len(d)) for r, d in enumerate(drafts)]
    expected = (expected_lens, [int(target[r, n]) for r, n in enumerate(expected_lens)])
    rows_drafts = [draft[None] for draft in drafts]  # [1, n] each, as drafts carry them
    assert greedy_verdicts(rows_drafts, logits) == expected
    assert greedy_verdicts(rows_drafts, logits.double()) == expected  # not CPU fp32: the batched rule
