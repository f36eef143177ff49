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
