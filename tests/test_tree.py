"""Tree leaves (a draft's runner-up tokens verified with its chain in one pass) keep the target's output."""

import pytest
import torch

from specdecode import ModelDrafter, SpeculativeEngine, SuffixDrafter
from specdecode.backends.torchmodel import TorchBackend
from specdecode.sampling import SamplingParams
from specdecode.control import AdaptiveK
from specdecode.drafters.base import Draft
from specdecode.sequence import Sequence
from specdecode.tree import TreeLayout, pack
from replay import observe_step, simulate_costs
from test_sampling import (  # noqa: F401
    K, SAMPLES, SETTINGS, VOCAB, assert_drafts_reached_the_second_position, assert_lossless, check_results, sample_generations,
    small_vocab_pair,
)
from tiny import random_prompt, reference_greedy, tiny_model

PROMPTS = [(seed, 3 + seed % 11) for seed in range(10)]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def references(target):
    return {seed: reference_greedy(target, random_prompt(seed, n), NEW_TOKENS) for seed, n in PROMPTS}


def generate_all(engine):
    results = [engine.generate(random_prompt(s, n), max_new_tokens=NEW_TOKENS).result() for s, n in PROMPTS]
    return results, sum(r.stats.leaf_tokens for r in results)


def test_tree_pass_scores_each_leaf_as_its_own_sequence(target):
    """Every position of one tree pass gives the logits a plain pass over that position's own path gives."""
    prefix, last = random_prompt(0, 9), torch.tensor([[7]])
    chain, alternatives = torch.tensor([[11, 12, 13]]), torch.tensor([[[21, 22], [31, -1], [-1, 42]]])  # -1: no leaf
    tree = TreeLayout(last, chain, alternatives)
    backend = TorchBackend(target)
    backend.add_row(prefix)
    chain_logits, leaf_logits = tree.split_logits(backend.forward(*pack([tree])))
    path = torch.cat([prefix, last, chain], 1)
    assert tree.width == 1 + 3 + 4 and sorted(leaf_logits) == [(0, 0), (0, 1), (1, 0), (2, 1)]
    with torch.no_grad():
        assert torch.allclose(chain_logits[0], target(path).logits[0, prefix.shape[1]:], atol=1e-5)
        for j, r in leaf_logits:
            own_path = torch.cat([prefix, last, chain[:, :j], alternatives[:, j, r : r + 1]], 1)
            assert torch.allclose(leaf_logits[(j, r)][0], target(own_path).logits[0, -1], atol=1e-5), (j, r)


@pytest.mark.parametrize("alternatives", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_output_equals_target_greedy_with_leaves(target, near_draft, weak_draft, references, alternatives, k):
    leaves = 0
    for draft in (near_draft, weak_draft):
        results, used = generate_all(SpeculativeEngine(target, ModelDrafter(draft, alternatives=alternatives), k=k))
        for (seed, _), result in zip(PROMPTS, results):
            assert result.token_ids == references[seed], f"prompt {seed}, k={k}, alternatives={alternatives}"
        leaves += used
    assert leaves > 0, "no leaf was ever used: the test did not exercise the tree path"


def test_adaptive_engine_with_leaves_keeps_greedy_output(target, near_draft, references):
    # A tiny draft costs what a tiny target pass does: the on/off gate would rightly keep drafting off. Priced where
    # drafting and a wider pass are cheap, the controller drafts with leaves on (the replay tests cover the decisions).
    engine = simulate_costs(SpeculativeEngine(target, ModelDrafter(near_draft, alternatives=2), k=8, adaptive=True))
    results, used = generate_all(engine)
    assert [r.token_ids for r in results] == [references[s] for s, _ in PROMPTS]
    assert used > 0


@pytest.mark.parametrize(
    "mutation",
    ["leaf K/V not moved", "leaf K/V moved one slot late"],
)
def test_a_wrong_cache_after_a_leaf_is_caught(target, near_draft, references, monkeypatch, mutation):
    """The greedy tests above fail if the accepted leaf's K/V is not put where the correction stands."""

    real = TreeLayout.kept_inputs

    def wrong(self, accepted, leaf):
        if leaf is None:
            return real(self, accepted, leaf)
        chain = list(range(2 + accepted))  # the rejected chain token's K/V stays in the correction's slot
        return chain if mutation == "leaf K/V not moved" else chain + [self.leaf_index(*leaf)]

    monkeypatch.setattr(TreeLayout, "kept_inputs", wrong)
    results, used = generate_all(SpeculativeEngine(target, ModelDrafter(near_draft, alternatives=2), k=4))
    assert used > 0
    assert any(r.token_ids != references[s] for r, (s, _) in zip(results, PROMPTS))


def test_batched_engine_uses_leaves_for_a_row_alone(target, near_draft, references):
    """A row running alone verifies its leaves; rows side by side do not (a wider pass is not free there), and a
    row left alone after the others finished starts using them on a cache with holes. Output is the target's."""
    from specdecode.batch import BatchEngine

    engine = BatchEngine(target, ModelDrafter(near_draft, alternatives=2), k=4)
    alone = [engine.generate_all([dict(input_ids=random_prompt(s, n), max_new_tokens=NEW_TOKENS)])[0] for s, n in PROMPTS]
    assert [seq.result.token_ids for seq in alone] == [references[s] for s, _ in PROMPTS]
    assert sum(seq.stats.leaf_tokens for seq in alone) > 0
    budgets = [NEW_TOKENS // 3, NEW_TOKENS, NEW_TOKENS // 2, NEW_TOKENS]  # rows leave at different steps
    together = engine.generate_all(
        [dict(input_ids=random_prompt(s, n), max_new_tokens=b) for (s, n), b in zip(PROMPTS[:4], budgets)]
    )
    assert [seq.result.token_ids for seq in together] == [references[s][:b] for (s, _), b in zip(PROMPTS[:4], budgets)]


def remembered_answers(drafter: SuffixDrafter, answers: list[list[int]]) -> None:
    """Put answers into the drafter's shared cache as earlier requests' responses."""
    for i, answer in enumerate(answers):
        drafter.cache.start_request(f"earlier-{i}", [0])
        drafter.cache.add_active_response(f"earlier-{i}", answer)
        drafter.cache.stop_request(f"earlier-{i}")


@pytest.mark.parametrize("branch_at", [3, 9])
def test_suffix_tree_branches_are_verified_as_leaves(target, references, branch_at):
    """Earlier answers: two that agree with the target's but for one token (and then part ways), and the target's own.
    At that token the suffix tree branches, the chain follows the more frequent wrong branch and the right token is a
    leaf, which the target's correction then uses. Output stays the target's."""
    seed, n = PROMPTS[9]  # its answer does not repeat itself early: the branch is the only one
    reference = references[seed]
    vocab = target.config.vocab_size
    wrong = [list(reference), list(reference)]
    for i, answer in enumerate(wrong):
        answer[branch_at] = (reference[branch_at] + 1) % vocab
        answer[branch_at + 1] = (reference[branch_at + 1] + 2 + i) % vocab
    drafter = SuffixDrafter(alternatives=2)
    remembered_answers(drafter, [*wrong, reference])
    result = SpeculativeEngine(target, drafter, k=8).generate(random_prompt(seed, n), max_new_tokens=NEW_TOKENS).result()
    assert result.token_ids == reference
    assert result.stats.leaf_tokens > 0 and result.stats.drafted_tokens > result.stats.accepted_tokens


# Every token but the drafted one as a leaf (none left out as unlikely): each rejection then goes through a leaf.
ALL_OTHERS = VOCAB - 1


@pytest.mark.parametrize("alternatives, params", [
    (alternatives, params) for alternatives in (2, ALL_OTHERS) for params in SETTINGS[:2]
] + [(ALL_OTHERS, SamplingParams(temperature=1.0, seed=10_000))],  # seeded: position-keyed draws through every leaf
    ids=lambda v: f"T{v.temperature}{'-seeded' if v.seed is not None else ''}" if isinstance(v, SamplingParams) else str(v))
def test_sampling_with_leaves_matches_target_distribution(small_vocab_pair, params, alternatives):  # noqa: F811
    target, draft = small_vocab_pair
    prompt = random_prompt(5, 6, vocab=VOCAB)
    engine = SpeculativeEngine(target, ModelDrafter(draft, alternatives=alternatives, leaf_min_mass=0.0), k=K)
    generated, stats = sample_generations(engine, prompt, params, SAMPLES)
    assert_drafts_reached_the_second_position(stats)
    assert sum(s.leaf_tokens for s in stats) > 0  # leaves were used, so the check covers them
    assert_lossless(check_results(generated, target, prompt, params))


def one_hot_logits(tokens: list[int], vocab: int = VOCAB) -> torch.Tensor:
    logits = torch.full((len(tokens), vocab), -1e9)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return logits


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=0)], ids=["greedy", "sampled"])
def test_the_extra_token_comes_from_the_leaf_the_target_corrected_to(params):
    """Draft [3, 4] with runner-ups [[5, 6], [7, 8]]; the target rejects 3 for 6: the leaf after 6 says 10."""
    draft = Draft(torch.tensor([[3, 4]]), alternatives=torch.tensor([[[5, 6], [7, 8]]]))
    chain = one_hot_logits([6, 0, 0])[None]  # the target wants 6 where the draft put 3
    leaves = {leaf: logits[None] for leaf, logits in zip([(0, 0), (0, 1), (1, 0), (1, 1)], one_hot_logits([9, 10, 11, 12]))}
    seq = Sequence(random_prompt(0, 4, vocab=VOCAB), max_new_tokens=10, k=2, sampling=params)
    assert seq.judge(draft, chain, leaves) == 0
    assert seq.new[-2:] == [6, 10] and seq.leaf == (0, 1) and seq.stats.leaf_tokens == 1
    seq.judge(draft, one_hot_logits([3, 2, 0])[None], leaves)  # corrected to 2: no leaf holds it
    assert seq.new[-2:] == [3, 2] and seq.leaf is None and seq.stats.leaf_tokens == 1


def test_the_speculation_gate_counts_leaf_hits():
    """First tokens accepted 15 % of the time at a draft cost that loses to plain decoding; when a leaf holds
    the correction at half the rejections, each step gains enough to draft."""
    def controller(leaves: int) -> AdaptiveK:
        ctl = AdaptiveK(max_k=4, probe_every=1000)
        for width in range(1, 12):
            ctl.observe_pass(width, 1, 0.25)
        ctl.costs.observe_draft("model", 1, 0.05)
        ctl.measured.first_accept.value = 0.15
        ctl.measured.leaf_hit.value = 0.5
        return ctl

    assert controller(leaves=0).plan(4, leaves=0).length == 0  # (1 + 0.15) / 0.30 s < 1 / 0.25 s: plain decoding
    assert controller(leaves=2).plan(4, leaves=2).length == 4  # (1 + 0.15 + 0.85 * 0.5) / 0.30 s > 1 / 0.25 s


def test_a_leaf_hit_is_learned_only_from_rejections():
    ctl = AdaptiveK(max_k=4)
    before = ctl.measured.leaf_hit.value
    observe_step(ctl, "model", [0.9, 0.9], drafted=2, accepted=2, draft_s=0.05, verify_s=0.25, positions=7, leaf_used=False)
    assert ctl.measured.leaf_hit.value == before  # all accepted: no leaf was asked for
    observe_step(ctl, "model", [0.9, 0.9], drafted=2, accepted=0, draft_s=0.05, verify_s=0.25, positions=7, leaf_used=True)
    assert ctl.measured.leaf_hit.value > before
    assert ctl.costs.measured(7)  # the pass is costed at its real width


def test_the_drafter_leaves_out_runner_ups_unlikely_to_pay():
    """A runner-up gets a leaf only if (the draft's chance of reaching its position) x (its probability) is at
    least leaf_min_mass: none at all with a threshold above 1, every one with 0."""
    prompt = random_prompt(4, 8)

    def alternatives(leaf_min_mass):
        drafter = ModelDrafter(tiny_model(3, sharpness=8.0), alternatives=3, leaf_min_mass=leaf_min_mass)
        drafter.prefill(prompt)
        return drafter.propose(prompt, 4, SamplingParams(), None).alternatives

    assert (alternatives(0.0) >= 0).all()
    assert (alternatives(1.01) == -1).all()
    with torch.no_grad():  # position 0 is reached for sure: its first runner-up stays iff its probability passes
        second = float(torch.softmax(tiny_model(3, sharpness=8.0)(prompt).logits[0, -1], -1).topk(2).values[1])
    assert alternatives(second * 0.99)[0, 0, 0] >= 0 and alternatives(second * 1.01)[0, 0, 0] == -1
    some = alternatives(second * 0.99)
    assert TreeLayout(prompt[:, -1:], torch.zeros(1, 4, dtype=torch.long), some).width == 1 + 4 + int((some >= 0).sum())


def test_a_wide_pass_measured_on_a_long_prompt_does_not_cap_drafts_on_a_short_one():
    """A long prompt's passes cost ~2x a short one's. Widths 7 and 10 are measured on a long prompt, then only 7 on
    a short one: keyed by width alone, 10 keeps its long-context cost and a third token looks 0.23 s dear. The
    pass line learns the slope from passes of one context and the level from the latest ones: drafting goes on."""
    def replay(ctl: AdaptiveK) -> int:
        ctl._leaves_pay = lambda offered: True  # the passes measured had leaves
        for width, seconds in [(7, 0.44), (10, 0.45)] * 10:  # long prompt: 2 or 3 drafted tokens, 2 leaves each
            observe_step(ctl, "model", [0.95] * 3, drafted=(width - 1) // 3, accepted=(width - 1) // 3, draft_s=0.04 * (width - 1) // 3,
                        verify_s=seconds, positions=width, leaf_used=False)
        ctl.rows_changed()
        observe_step(ctl, "model", None, drafted=0, accepted=0, draft_s=0.0, verify_s=0.20)  # its first pass is plain
        for _ in range(10):  # short prompt: the controller drafted 2 each time
            observe_step(ctl, "model", [0.95] * 2, drafted=2, accepted=2, draft_s=0.08, verify_s=0.22, positions=7, leaf_used=False)
        plan = ctl.plan(8, leaves=2, remaining=100)
        drafted = 1 if plan.length else 0
        while drafted and drafted < 8 and plan.keep_going(drafted, 0.95):
            drafted += 1
        return drafted

    assert replay(AdaptiveK(max_k=8)) >= 5
    table_only = AdaptiveK(max_k=8)
    table_only.pass_line.time = lambda positions: None  # the width-keyed table alone (the old model)
    assert replay(table_only) <= 2


def test_the_marginal_rule_charges_offered_leaves_before_their_count_is_measured():
    """Until a pass with leaves has measured how many a token carries, the plan charges the offered count: each drafted
    token then widens the pass by 1 + leaves, and on a steep pass line drafting stops sooner than for a bare chain."""
    def drafted(offered: int) -> int:
        ctl = AdaptiveK(max_k=8, probe_every=1000)
        for width in (1, 4, 7, 10, 13, 16, 19, 22, 25) * 2:
            ctl.observe_pass(width, 1, 0.1 + 0.03 * width)
        ctl.costs.observe_draft("model", 1, 0.01)
        ctl._leaves_pay = lambda offered: True
        plan = ctl.plan(8, leaves=offered)
        assert plan.leaves and ctl.measured.leaves_per_token.value is None
        n = 1
        while n < 8 and plan.keep_going(n, 0.8):
            n += 1
        return n

    assert drafted(2) < drafted(0)
