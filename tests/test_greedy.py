"""Greedy speculative decoding must give token for token the target's own greedy output."""

import math

import pytest
import torch

from specdecode import ModelDrafter, NgramDrafter, SpeculativeEngine, SuffixDrafter
from specdecode.drafters.suffix import ContextChains
from specdecode.stopping import StopCondition
from tiny import keep_one_stale_entry, random_prompt, reference_greedy

PROMPTS = [(seed, 3 + seed % 11) for seed in range(10)]  # (seed, prompt length)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def references(target):
    return {seed: reference_greedy(target, random_prompt(seed, n), NEW_TOKENS) for seed, n in PROMPTS}


def drafters(target, weak_draft, near_draft):
    return {
        "weak": ModelDrafter(weak_draft),
        "near": ModelDrafter(near_draft),
        "self": ModelDrafter(target),
        "ngram": NgramDrafter(),
        "suffix": SuffixDrafter(),  # its trees verified as chain + leaves (tree.py; leaves used: test_tree.py)
        "chain": SuffixDrafter(chains=ContextChains(context=2, shortest=2, longest=8)),  # short copies chained
    }


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("which", ["weak", "near", "self", "ngram", "suffix", "chain"])
def test_greedy_output_equals_target_greedy(target, weak_draft, near_draft, references, which, k):
    engine = SpeculativeEngine(target, drafters(target, weak_draft, near_draft)[which], k=k)
    results = []
    for seed, n in PROMPTS:
        results.append(result := engine.generate(random_prompt(seed, n), max_new_tokens=NEW_TOKENS).result())
        assert result.token_ids == references[seed], f"prompt {seed}, drafter {which}, k={k}"
        assert result.finish_reason == "length"
    drafted = sum(r.stats.drafted_tokens for r in results)
    assert drafted > 0
    if which in ("ngram", "suffix", "chain") and k > 1:  # lookups: drafts of 2+ tokens, some rejected (rollback exercised)
        assert sum(r.stats.drafted_per_position[1] for r in results if len(r.stats.drafted_per_position) > 1) > 0
        assert sum(r.stats.accepted_tokens for r in results) < drafted
    if which == "chain" and k > 1:  # chained copies drafted, and some rejected
        chained = [sum(tally[i] for r in results for source, tally in r.stats.by_source.items()
                       if source.endswith("/chain")) for i in (1, 2)]  # this request's or an earlier one's
        assert chained[0] > chained[1] > 0, chained


def test_plain_decoding_equals_uncached_reference(target, references):
    engine = SpeculativeEngine(target, None)
    for seed, n in PROMPTS:
        assert engine.generate(random_prompt(seed, n), max_new_tokens=NEW_TOKENS).result().token_ids == references[seed]


def test_near_draft_exercises_partial_acceptance(target, near_draft):
    """The rollback tests above only mean something if drafts are partly rejected."""
    engine = SpeculativeEngine(target, ModelDrafter(near_draft), k=4)
    stats = engine.generate(random_prompt(2, 8), max_new_tokens=60).result().stats
    partial = sum(stats.accepted_len_histogram[1:4])
    assert 0.1 < stats.acceptance_rate < 0.95 and partial > 0, stats.accepted_len_histogram


@pytest.mark.parametrize("k", [1, 3, 8])
def test_self_draft_accepts_everything(target, k):
    engine = SpeculativeEngine(target, ModelDrafter(target), k=k)
    stats = engine.generate(random_prompt(3, 6), max_new_tokens=NEW_TOKENS).result().stats
    assert stats.acceptance_rate == 1.0
    # 1 prefill pass gives the first token; each verify pass then adds k+1 tokens.
    assert stats.target_passes == 1 + math.ceil((NEW_TOKENS - 1) / (k + 1))
    assert stats.new_tokens == NEW_TOKENS


def test_off_by_one_rollback_is_caught(target, near_draft, references, monkeypatch):
    """A rollback that keeps one stale cache entry must break greedy identity (so the tests above can fail)."""
    keep_one_stale_entry(monkeypatch)
    engine = SpeculativeEngine(target, ModelDrafter(near_draft), k=4)
    outputs = [engine.generate(random_prompt(s, n), max_new_tokens=NEW_TOKENS).result().token_ids for s, n in PROMPTS]
    assert any(out != references[s] for out, (s, _) in zip(outputs, PROMPTS))


def test_draft_cache_matches_committed_tokens(target, near_draft):
    drafter = ModelDrafter(near_draft)
    engine = SpeculativeEngine(target, drafter, k=4)
    prompt = random_prompt(5, 7)
    result = engine.generate(prompt, max_new_tokens=30).result()
    committed = torch.cat([prompt, torch.tensor([result.token_ids])], dim=1)
    held = drafter.cached_ids.shape[1]
    assert drafter.model.length(0) == held
    assert torch.equal(drafter.cached_ids[0], committed[0, :held])


@pytest.mark.parametrize("k", [2, 8])
def test_eos_inside_a_draft_ends_generation_there(target, k):
    prompt = random_prompt(4, 9)
    full = reference_greedy(target, prompt, NEW_TOKENS)
    eos_at = 5
    eos = full[eos_at]
    expected = full[: full.index(eos) + 1]  # up to and including the first EOS
    engine = SpeculativeEngine(target, ModelDrafter(target), k=k)  # drafts run straight past EOS
    result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop=StopCondition(frozenset({eos}))).result()
    assert result.token_ids == expected
    assert result.finish_reason == "stop"
    assert result.stats.drafted_tokens <= len(expected) - 1  # drafts end at the EOS: nothing after it is verified


@pytest.mark.parametrize("max_new_tokens", range(1, 12))
@pytest.mark.parametrize("which", ["self", "near"])
def test_max_new_tokens_is_exact(target, near_draft, which, max_new_tokens):
    draft = target if which == "self" else near_draft
    prompt = random_prompt(6, 5)
    engine = SpeculativeEngine(target, ModelDrafter(draft), k=4)
    result = engine.generate(prompt, max_new_tokens=max_new_tokens).result()
    assert result.token_ids == reference_greedy(target, prompt, max_new_tokens)
    assert result.stats.new_tokens == max_new_tokens and result.finish_reason == "length"


class CharTokenizer:
    """Token t decodes to one letter: enough to test stop strings."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_string_inside_a_draft(target):
    prompt = random_prompt(8, 6)
    full = reference_greedy(target, prompt, NEW_TOKENS)
    tok = CharTokenizer()
    text = tok.decode(full)
    stop_string = text[6:8]
    first = text.find(stop_string)
    engine = SpeculativeEngine(target, ModelDrafter(target), k=8)
    stop = StopCondition(frozenset(), (stop_string,), tok)
    result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop=stop).result()
    assert result.token_ids == full[: first + len(stop_string)]  # the tokens that complete the stop string
    assert stop.trim_text(tok.decode(result.token_ids)) == text[:first]
    assert result.finish_reason == "stop"
