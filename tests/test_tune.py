"""`specdecode tune`: successive halving within a budget, the config file, and the exports."""

import json

import pytest

from specdecode.cli import build_parser, main
from specdecode.prompts import Prompt
from specdecode.tune import exports, read_config, rounds_of, tune, write_config

CANDIDATES = ["spec:ngram:2", "spec:ngram:a6", "spec:self:1:3", "spec:self:1:a4"]


def prompts(per_task: int):
    words = lambda i: " ".join(f"w{2 + (i * 5 + j * 3) % 40}" for j in range(12))  # repetitive: n-gram drafts hit
    return [Prompt(f"{task}-{i}", task, words(i + 10 * t)) for t, task in enumerate(("qa", "summarization")) for i in range(per_task)]


def run_tune(target, tokenizer, budget, per_task=3):
    encode = lambda text: tokenizer(text, return_tensors="pt").input_ids
    return tune(target, tokenizer, frozenset({1}), prompts(per_task), CANDIDATES, budget_s=budget, max_new_tokens=8,
                encode=encode, log=lambda msg: None)


def test_rounds_cover_every_task():
    assert [[p.id for p in r] for r in rounds_of(prompts(2))] == [["qa-0", "summarization-0"], ["qa-1", "summarization-1"]]


def test_successive_halving_keeps_the_better_half(target, tokenizer):
    result = run_tune(target, tokenizer, budget=600)
    assert result.rounds == 3
    measured = {row["method"]: row["prompts"] for row in result.table}
    assert sorted(measured.values()) == [2, 2, 4, 6]  # 4 candidates on round 1, 2 on round 2, 1 on round 3
    best = result.best
    assert best["prompts"] == 6 and best["method"] in CANDIDATES
    assert result.table == sorted(result.table, key=lambda t: (-t["prompts"], -t["speedup_mean"]))  # best first
    for row in result.table:
        assert row["identical"] == row["prompts"]  # fp32 tiny model: speculation changed nothing
    # the survivors of round 1 were its best two
    first = {r["prompt_id"] for r in result.rows if r["prompt_id"].endswith("-0")}
    assert first == {"qa-0", "summarization-0"}


def test_budget_stops_new_rounds(target, tokenizer):
    result = run_tune(target, tokenizer, budget=0.001)
    assert result.rounds == 1  # the first round always runs; nothing more fits


def test_config_round_trip_and_cli_defaults(target, tokenizer, tmp_path):
    result = run_tune(target, tokenizer, budget=600, per_task=1)
    path = tmp_path / "tuned.json"
    config = write_config(path, result, target="tiny-target", dtype="fp32", threads=2, max_new_tokens=8, command="test")
    on_disk = json.loads(path.read_text())
    assert on_disk["tuned"]["method"] == result.best["method"] and on_disk["exports"]["notes"] is not None
    settings = read_config(str(path))
    assert settings["target"] == "tiny-target" and settings["draft"] == config["draft"] and settings["dtype"] == "fp32"
    args = build_parser(settings).parse_args(["serve"])
    assert (args.target, args.draft, args.k, args.adaptive) == (settings["target"], settings["draft"], settings["k"], settings["adaptive"])
    args = build_parser(settings).parse_args(["bench", "--draft", "ngram"])
    assert args.draft == "ngram" and args.target == "tiny-target"  # an explicit flag wins over the file


def test_bad_config_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["generate", "--config", str(bad), "hi"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.json")]) == 2
    assert "not found" in capsys.readouterr().err


def test_exports_name_their_equivalents_and_what_has_none():
    model = exports("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b+int8+head", 5, False)
    assert model["vllm"]["speculative_config"] == {"model": "Qwen/Qwen2.5-Coder-0.5B-Instruct", "num_speculative_tokens": 5}
    assert "--speculative-config" in model["vllm"]["command"] and "Qwen/Qwen2.5-Coder-1.5B-Instruct" in model["vllm"]["command"]
    assert model["llama_cpp"]["flags"]["--spec-draft-n-max"] == 5 and model["llama_cpp"]["flags"]["--spec-draft-n-min"] == 5
    assert model["transformers"] == {"assistant_model": "Qwen/Qwen2.5-Coder-0.5B-Instruct", "num_assistant_tokens": 5,
                                     "num_assistant_tokens_schedule": "constant"}
    assert any("int8" in n for n in model["notes"])
    ngram = exports("qwen2.5-coder-1.5b", "ngram", 6, False)
    assert ngram["vllm"]["speculative_config"]["method"] == "ngram" and ngram["transformers"]["prompt_lookup_num_tokens"] == 6
    auto = exports("qwen2.5-coder-1.5b", "auto", 8, True)
    assert auto["transformers"]["num_assistant_tokens_schedule"] == "heuristic" and "vllm_ngram_alternative" in auto
    assert any("adaptive" in n for n in auto["notes"]) and any("auto switches" in n for n in auto["notes"])
    own = exports("qwen2.5-coder-1.5b", "self", 8, True)
    assert own["vllm"] is None and own["llama_cpp"] is None and own["transformers"] is None
    assert any("no equivalent" in n for n in own["notes"])


def test_a_draft_that_cannot_serve_the_target_is_dropped_with_its_reason(target, tokenizer):
    """The Qwen draft (151,936 tokens) against a 96-token target: dropped before its weights load, others still run."""
    logged = []
    encode = lambda text: tokenizer(text, return_tensors="pt").input_ids
    result = tune(target, tokenizer, frozenset({1}), prompts(1), ["spec:qwen2.5-coder-0.5b+int4+head:a8", "spec:ngram:2"],
                  budget_s=600, max_new_tokens=8, encode=encode, log=logged.append)
    assert list(result.dropped) == ["spec:qwen2.5-coder-0.5b+int4+head:a8"]
    assert "151936" in result.dropped["spec:qwen2.5-coder-0.5b+int4+head:a8"]
    assert any("dropped candidate" in line for line in logged)
    assert [row["method"] for row in result.table] == ["spec:ngram:2"]
