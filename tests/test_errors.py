"""Bad input gets a clear error that names the problem."""

import pytest
import torch

from specdecode import ModelDrafter, ModelError, SamplingParams, SpeculativeEngine, load_model
from specdecode.cli import main
from tiny import random_prompt, tiny_model


@pytest.fixture(scope="module")
def engine(target, weak_draft):
    return SpeculativeEngine(target, ModelDrafter(weak_draft))


def test_empty_prompt(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate(torch.empty(1, 0, dtype=torch.long), max_new_tokens=5)


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_max_new_tokens_must_be_positive(engine, bad):
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(random_prompt(0, 4), max_new_tokens=bad)


def test_negative_temperature():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.1)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.01])
def test_top_p_outside_unit_interval(bad):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=bad)


@pytest.mark.parametrize("bad", [0, -1])
def test_draft_length_below_one(engine, target, bad):
    with pytest.raises(ValueError, match="draft length k"):
        engine.generate(random_prompt(0, 4), max_new_tokens=5, k=bad)
    with pytest.raises(ValueError, match="draft length k"):
        SpeculativeEngine(target, None, k=bad)


def test_mismatched_vocabularies(target):
    with pytest.raises(ValueError, match="vocabulary of 16 tokens but the target has 96"):
        SpeculativeEngine(target, ModelDrafter(tiny_model(3, vocab=16)))


def test_unknown_model_name(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="no-such-model.*built-in"):
        load_model("no-such-model")


def test_missing_local_path():
    with pytest.raises(ModelError, match="not found"):
        load_model("./no/such/dir")


def test_cli_reports_bad_input_without_traceback(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["generate", "--target", "no-such-model", "--draft", "none", "hi"]) == 2
    err = capsys.readouterr().err
    assert "specdecode: error:" in err and "no-such-model" in err and "Traceback" not in err


def test_request_beyond_the_context_window(engine):
    with pytest.raises(ValueError, match="context window \\(512 tokens\\)"):
        engine.generate(random_prompt(0, 20), max_new_tokens=500)


@pytest.mark.parametrize("spec, message", [
    ("qwen2.5-coder-0.5b+int3", r"unknown draft option\(s\) \['int3'\].*\+int8 or \+int4, \+head, \+compile"),
    ("auto:qwen2.5-coder-0.5b+int8+int4", "both \\+int8 and \\+int4"),
])
def test_bad_draft_options_are_named_before_any_model_loads(spec, message):
    from specdecode.drafters.factory import make_drafter

    with pytest.raises(ValueError, match=message):
        make_drafter(spec)
