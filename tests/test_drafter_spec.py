"""Drafter specs are parsed in one place (drafters/spec.py): every spelling a user may write, and the bad ones."""

import pytest

from specdecode.drafters.spec import parse_drafter_spec
from specdecode.drafters.factory import model_spec_of
from specdecode.models import DEFAULT_DRAFT


@pytest.mark.parametrize("text, kind, model, quant, options, alternatives, explicit", [
    (None, "none", None, None, set(), 0, False),
    ("none", "none", None, None, set(), 0, False),
    ("ngram", "lookup", None, None, set(), 0, False),
    ("suffix", "lookup", None, None, set(), 0, False),
    ("auto", "auto", None, None, set(), 0, False),
    ("auto:qwen2.5-coder-0.5b", "auto", "qwen2.5-coder-0.5b", None, set(), 0, False),
    ("auto:m+int4+head+alt3", "auto", "m", "int4", {"int4", "head"}, 3, True),
    ("m+int8+compile", "model", "m", "int8", {"int8", "compile"}, 0, True),
    ("/path/to/draft.gguf", "model", "/path/to/draft.gguf", None, set(), 0, False),
])
def test_specs_parse_to_what_they_say(text, kind, model, quant, options, alternatives, explicit):
    spec = parse_drafter_spec(text)
    assert (spec.kind, spec.model, spec.quant, set(spec.options), spec.alternatives, spec.explicit) == (
        kind, model, quant, options, alternatives, explicit)


def test_self_and_lookups_carry_their_own_fields():
    assert parse_drafter_spec("self").layers is None and parse_drafter_spec("self:3").layers == 3
    assert parse_drafter_spec("lookup").lookup == "lookup"


def test_which_specs_are_adaptive_by_default_and_which_draft_with_a_model():
    adaptive = {t: parse_drafter_spec(t).adaptive_by_default for t in ("auto", "auto:m", "suffix", "lookup", "ngram", "m", "self")}
    assert adaptive == {"auto": True, "auto:m": True, "suffix": True, "lookup": True, "ngram": False, "m": False, "self": False}
    assert model_spec_of("auto") == DEFAULT_DRAFT and model_spec_of("auto:m+int8") == "m" and model_spec_of("m+head") == "m"
    assert model_spec_of("suffix") is None and model_spec_of("self:2") is None and model_spec_of("none") is None


@pytest.mark.parametrize("text, message", [
    ("self:x", "takes a number of layers"),
    ("m+alt2+alt3", "alternatives twice"),
    ("m+int8+int4", "both \\+int8 and \\+int4"),
    ("m+fp8", r"unknown draft option\(s\) \['fp8'\]"),
    ("+int8", "no draft model named"),
])
def test_bad_specs_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        parse_drafter_spec(text)
