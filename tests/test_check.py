"""`specdecode check` passes when speculation preserves the output and fails when it does not."""

import pytest

import specdecode.engine as engine_module
from specdecode import SpecDecoder
from specdecode.check import check_greedy, first_difference, summarize_greedy
from specdecode.drafters import NgramDrafter
from specdecode.prompts import Prompt

PROMPTS = [Prompt("a", "qa", "What is the capital of France?"), Prompt("b", "code", "Write a Python function that adds two numbers.")]


@pytest.fixture(scope="module")
def smol():
    decoder = SpecDecoder.from_specs("smollm2-135m", None, dtype="fp32", k=4)
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
    real_rollback = engine_module.rollback
    monkeypatch.setattr(engine_module, "rollback", lambda cache, keep: real_rollback(cache, keep + 1))
    summary = summarize_greedy(check_greedy(smol, PROMPTS, max_new_tokens=24))
    assert summary["divergences"] >= 1, summary
    bad = [c for c in summary["cases"] if c["verdict"] == "DIVERGENCE"]
    assert all(c["first_difference"] is not None and c["top2_gap"] >= 1e-3 for c in bad)
