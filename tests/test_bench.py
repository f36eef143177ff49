"""The bench report must be consistent with what was measured."""

import pytest
import torch

from specdecode.bench.methods import HFMethod, Method, OursMethod, Run
from specdecode.bench.report import summarize, write_report
from specdecode.bench.runner import BenchConfig, run_bench
from specdecode.drafters import ModelDrafter, NgramDrafter
from specdecode.prompts import Prompt
from tiny import random_prompt

PROMPTS = [Prompt(str(i), "task-a" if i < 2 else "task-b", f"prompt {i}") for i in range(4)]


def encode(text):
    return random_prompt(int(text.split()[-1]), 6)


class Scripted(Method):
    """Returns fixed tokens and latencies: the report's arithmetic can be checked exactly."""

    kind = "ours"

    def __init__(self, name, latency, tokens, change_token_at=None):
        self.name, self.latency, self.tokens, self.change_at = name, latency, tokens, change_token_at
        self.settings = {}

    def run(self, input_ids, max_new_tokens, sampling):
        tokens = list(self.tokens)
        if self.change_at is not None:
            tokens[self.change_at] += 1
        return Run(tokens, 0.1, self.latency, {"drafted_tokens": 0})


def test_speedup_is_ratio_of_measured_times_and_identity_is_flagged():
    methods = [Scripted("plain", 2.0, [5] * 10), Scripted("fast", 0.5, [5] * 10), Scripted("wrong", 1.0, [5] * 10, change_token_at=3)]
    rows = run_bench(methods, PROMPTS, encode, BenchConfig(max_new_tokens=10, warmup=False))
    summary = summarize(rows, ["plain", "fast", "wrong"])["overall"]
    assert summary["fast"]["speedup_vs_plain"] == {"mean": 4.0, "median": 4.0, "min": 4.0, "max": 4.0}
    assert summary["wrong"]["speedup_vs_plain"]["mean"] == pytest.approx(2.0)
    assert summary["fast"]["identical"] == 4 and summary["wrong"]["identical"] == 0
    assert {r["first_difference"] for r in rows if r["method"] == "wrong"} == {3}
    assert summary["plain"]["latency_p50"] == 2.0 and summary["fast"]["tokens_per_s"] == pytest.approx(20.0)


def test_lowest_prompts_tell_a_longer_answer_from_a_slower_decode(tmp_path):
    """tok/s counts the prompt's reading, so an answer that ended sooner (a near-tie) looks slower on a long prompt:
    the lowest-prompts section gives each prompt's decode-only ratio beside it, and lengths and first-token times."""
    class Timed(Scripted):
        def __init__(self, name, ttft, per_token, length):
            super().__init__(name, ttft + per_token * (length - 1), [5] * length)
            self.ttft = ttft

        def run(self, input_ids, max_new_tokens, sampling):
            return Run(list(self.tokens), self.ttft, self.latency, dict(
                drafted_tokens=3, accepted_tokens=1, mean_accepted_len=1.0, drafted_per_position=[1, 1, 1],
                accepted_per_position=[1, 0, 0], accepted_len_histogram=[0, 1]))

    # ours: the same reading, each token 0.8x the time, but the answer ends at 4 tokens against 10
    methods = [Timed("llama-cpp", 2.0, 0.10, 10), Timed("spec", 2.0, 0.08, 4)]
    rows = run_bench(methods, PROMPTS, encode, BenchConfig(max_new_tokens=10, warmup=False))
    summary = write_report(rows, ["llama-cpp", "spec"], {}, "specdecode bench ...", {}, tmp_path)
    lowest = summary["lowest"]["spec"]
    assert lowest["reference"] == "llama-cpp" and len(lowest["prompts"]) == len(PROMPTS)
    first = lowest["prompts"][0]
    assert first["speedup"] == pytest.approx((4 / 2.24) / (10 / 2.9))  # 0.52x in tok/s
    assert first["decode_speedup"] == pytest.approx(0.10 / 0.08)  # 1.25x a token decoded
    assert first["new_tokens"] == [4, 10] and (first["drafted"], first["accepted"]) == (3, 1)
    assert "## Lowest prompts: spec against llama-cpp" in (tmp_path / "report.md").read_text()
    assert "llama-cpp" not in summary["lowest"]


def test_bench_on_tiny_models_writes_report_and_plots(tmp_path, target, near_draft):
    eos = frozenset({1})
    methods = [
        OursMethod("plain", target, None, eos, None, 4),
        OursMethod("spec", target, None, eos, ModelDrafter(near_draft), 4),
        OursMethod("spec:ngram", target, None, eos, NgramDrafter(), 4),
        HFMethod("hf-greedy", target, eos, pad_token_id=0),
        HFMethod("hf-assisted", target, eos, pad_token_id=0, assistant_model=near_draft),
    ]
    names = [m.name for m in methods]
    rows = run_bench(methods, PROMPTS, encode, BenchConfig(max_new_tokens=16, repeat=2))
    assert len(rows) == len(PROMPTS) * len(methods)
    # Every method is greedy on the same target: all outputs equal ours, transformers' included.
    assert all(r["identical_to_plain"] for r in rows), [(r["method"], r["first_difference"]) for r in rows]
    summary = write_report(rows, names, {"dtype": "float32"}, "specdecode bench ...", {"k": 4}, tmp_path)
    assert set(summary["tasks"]) == {"task-a", "task-b"}
    spec = summary["overall"]["spec"]
    assert spec["identical"] == len(PROMPTS) and spec["mean_accepted_len"] > 0
    assert summary["overall"]["plain"]["mean_accepted_len"] is None
    report = (tmp_path / "report.md").read_text()
    assert "## task-a" in report and "| spec |" in report and "vs hf-assisted" in report
    for png in ("speedup_by_task", "latency_cdf", "acceptance_by_position", "accepted_length_hist"):
        assert (tmp_path / f"{png}.png").stat().st_size > 1000
