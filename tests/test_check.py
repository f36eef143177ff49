"""`specdecode check` passes when speculation preserves the output and fails when it does not."""

import pytest

import specdecode.sampling as sampling_module
from specdecode import SpecDecoder
from tiny import keep_one_stale_entry
from specdecode.check import check_greedy, first_difference, summarize_greedy
from specdecode.drafters import ModelDrafter, NgramDrafter
from specdecode.prompts import Prompt

PROMPTS = [Prompt("a", "qa", "What is the capital of France?"), Prompt("b", "code", "Write a Python function that adds two numbers.")]


@pytest.fixture(scope="module")
def smol():
    decoder = SpecDecoder.from_specs("smollm2-135m", None, dtype="fp32", k=4, backend="torch")
    decoder.engine.drafter = NgramDrafter()  # often rejected: a wrong rollback shows
    return decoder


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_check_passes_on_a_correct_engine(smol):
    summary = summarize_greedy(check_greedy(smol, PROMPTS, max_new_tokens=24))
    assert summary["identical"] == 2 and summary["divergences"] == 0


def test_check_reports_an_off_by_one_rollback_as_divergence(smol, monkeypatch):
    keep_one_stale_entry(monkeypatch)
    summary = summarize_greedy(check_greedy(smol, PROMPTS, max_new_tokens=24))
    assert summary["divergences"] >= 1, summary
    bad = [c for c in summary["cases"] if c["verdict"] == "DIVERGENCE"]
    # the first token comes from the prefill, which a rollback cannot touch: a divergence starts after it
    assert bad and all(1 <= c["first_difference"] <= c["new_tokens"] for c in bad), bad


def test_two_sample_test_tells_equal_from_different_distributions():
    import random

    from specdecode.check import two_sample_test

    rng = random.Random(0)
    a = rng.choices(range(6), weights=[5, 4, 3, 2, 1, 1], k=3000)
    b = rng.choices(range(6), weights=[5, 4, 3, 2, 1, 1], k=3000)
    c = rng.choices(range(6), weights=[4, 4, 3, 2, 2, 1], k=3000)
    assert two_sample_test(a, b)[0] > 1e-3
    assert two_sample_test(a, c)[0] < 1e-3
    pvalue, _, pooled = two_sample_test(list(range(40)), list(range(40, 80)))  # every token seen once
    assert pooled == 1.0  # nothing testable: the caller must call it inconclusive, not a pass


def test_sampling_check_passes_and_catches_a_wrong_rule(monkeypatch):
    from specdecode.check import check_sampling
    from test_sampling import wrong_rule_resample_from_p
    from tiny import tiny_model

    class Digits:  # a 16-token vocabulary written as hex digits
        eos_token_id = None

        def __call__(self, text):
            return {"input_ids": [int(ch, 16) for ch in text]}

        def decode(self, ids, skip_special_tokens=False):
            return "".join(f"{t:x}" for t in ids)

    target, draft = tiny_model(11, vocab=16, sharpness=6.0), tiny_model(12, vocab=16, sharpness=6.0)
    decoder = SpecDecoder(target, Digits(), ModelDrafter(draft), k=2)
    prompts = [Prompt("p", "t", "3a7c91")]
    ok = check_sampling(decoder, prompts, samples=1500, positions=2, temperature=1.0, chat=False)
    assert len(ok) == 2 and all(c.passed for c in ok), ok
    monkeypatch.setattr(sampling_module, "speculative_accept", wrong_rule_resample_from_p)
    # twice the samples: at 1500 the wrong rule's bias (TVD ~0.08 against ~0.05 of noise) is found only for some seeds
    bad = check_sampling(decoder, prompts, samples=3000, positions=2, temperature=1.0, chat=False)
    assert any(c.verdict == "FAIL" for c in bad), bad
    monkeypatch.setattr(decoder.engine.backend, "max_rows", 1)  # a backend of one row: samples drawn one at a time
    few = check_sampling(decoder, prompts, samples=3, positions=1, temperature=1.0, chat=False)
    assert [c.verdict for c in few] == ["INCONCLUSIVE"]
