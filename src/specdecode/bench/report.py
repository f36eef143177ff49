"""Bench rows -> summary (per task and overall), report.md, results.json and plots."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

BASELINES = ("hf-greedy", "hf-assisted", "hf-pld", "llama-cpp", "llama-cpp-pld")


def _ratios(rows: list[dict], method: str, reference: str) -> list[float]:
    """Per prompt: tokens/s of `method` over tokens/s of `reference` (= time ratio for equal outputs)."""
    by_prompt = defaultdict(dict)
    for r in rows:
        by_prompt[r["prompt_id"]][r["method"]] = r
    return [
        pair[method]["tokens_per_s"] / pair[reference]["tokens_per_s"]
        for pair in by_prompt.values()
        if method in pair and reference in pair and pair[reference]["tokens_per_s"] > 0
    ]


def _describe(values: list[float]) -> dict | None:
    if not values:
        return None
    return dict(mean=float(np.mean(values)), median=float(np.median(values)), min=float(min(values)), max=float(max(values)))


def summarize_group(rows: list[dict], methods: list[str]) -> dict:
    out = {}
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        latencies = [r["latency_s"] for r in mine]
        accepted = [r["stats"]["mean_accepted_len"] for r in mine if r["stats"].get("drafted_tokens")]
        out[method] = dict(
            n=len(mine),
            tokens_per_s=float(np.mean([r["tokens_per_s"] for r in mine])),
            speedup_vs_plain=_describe(_ratios(rows, method, "plain")),
            speedup_vs={b: _describe(_ratios(rows, method, b)) for b in BASELINES if b != method and any(r["method"] == b for r in rows)},
            mean_accepted_len=float(np.mean(accepted)) if accepted else None,
            identical=sum(bool(r.get("identical_to_plain")) for r in mine),
            latency_p50=float(np.percentile(latencies, 50)),
            latency_p90=float(np.percentile(latencies, 90)),
            latency_p99=float(np.percentile(latencies, 99)),
            ttft_p50=float(np.percentile([r["ttft_s"] for r in mine], 50)),
        )
    return out


def summarize(rows: list[dict], methods: list[str]) -> dict:
    tasks = sorted({r["task"] for r in rows})
    return dict(overall=summarize_group(rows, methods), tasks={t: summarize_group([r for r in rows if r["task"] == t], methods) for t in tasks})


def _fmt(x, spec=".2f", suffix=""):
    return "–" if x is None else f"{x:{spec}}{suffix}"


def _table(group: dict) -> list[str]:
    baselines = sorted({b for m in group.values() for b in m["speedup_vs"]})
    head = ["method", "tok/s", "vs plain mean", "median", "min", "max", *[f"vs {b}" for b in baselines], "accepted/step", "identical", "p50 s", "p90 s", "p99 s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, m in group.items():
        sp = m["speedup_vs_plain"] or {}
        cells = [
            method,
            _fmt(m["tokens_per_s"]),
            _fmt(sp.get("mean"), suffix="×"),
            _fmt(sp.get("median"), suffix="×"),
            _fmt(sp.get("min"), suffix="×"),
            _fmt(sp.get("max"), suffix="×"),
            *[_fmt((m["speedup_vs"].get(b) or {}).get("mean"), suffix="×") for b in baselines],
            _fmt(m["mean_accepted_len"]),
            f"{m['identical']}/{m['n']}",
            _fmt(m["latency_p50"]),
            _fmt(m["latency_p90"]),
            _fmt(m["latency_p99"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_markdown(summary: dict, env: dict, command: str, config: dict) -> str:
    lines = ["# specdecode bench", "", f"Command: `{command}`", ""]
    lines.append("Environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if v is not None))
    lines.append("")
    lines.append("Settings: " + ", ".join(f"{k} {v}" for k, v in config.items()))
    lines += [
        "",
        "Speedups are per-prompt ratios of tokens/s against the method named, measured back to back on the same "
        "prompt (so equal outputs give the ratio of the times); `identical` counts outputs equal token for token "
        "to `plain`. Latency is per request (all new tokens).",
        "",
        "## Overall",
        "",
        *_table(summary["overall"]),
    ]
    for task, group in summary["tasks"].items():
        lines += ["", f"## {task}", "", *_table(group)]
    lines += ["", "![speedup per task](speedup_by_task.png)", "![latency CDF](latency_cdf.png)"]
    lines += ["![acceptance by draft position](acceptance_by_position.png)", "![accepted length histogram](accepted_length_hist.png)", ""]
    return "\n".join(lines)


def plot(rows: list[dict], summary: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(summary["overall"])
    tasks = list(summary["tasks"])
    ours = [m for m in methods if any(r["method"] == m and r["stats"].get("drafted_tokens") for r in rows)]
    paths = []

    def save(fig, ax, name: str, title: str, xlabel: str, ylabel: str) -> None:
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(tasks) + 2), 4))
    shown = [m for m in methods if m != "plain"]
    width = 0.8 / max(1, len(shown))
    for i, method in enumerate(shown):
        values = [((summary["tasks"][t].get(method) or {}).get("speedup_vs_plain") or {}).get("median", 0) for t in tasks]
        ax.bar(np.arange(len(tasks)) + i * width, values, width, label=method)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(np.arange(len(tasks)) + width * (len(shown) - 1) / 2, tasks, rotation=20)
    save(fig, ax, "speedup_by_task.png", "Speedup by task", "", "median speedup vs plain (×)")

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in methods:
        lat = np.sort([r["latency_s"] for r in rows if r["method"] == method])
        ax.step(lat, np.arange(1, len(lat) + 1) / len(lat), where="post", label=method)
    save(fig, ax, "latency_cdf.png", "Latency CDF", "request latency (s)", "fraction of requests")

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in ours:
        drafted = _sum_lists([r["stats"]["drafted_per_position"] for r in rows if r["method"] == method])
        accepted = _sum_lists([r["stats"]["accepted_per_position"] for r in rows if r["method"] == method], len(drafted))
        ax.plot(range(1, len(drafted) + 1), [a / d if d else 0 for a, d in zip(accepted, drafted)], marker="o", label=method)
    ax.set_ylim(0, 1.05)
    save(fig, ax, "acceptance_by_position.png", "Acceptance by draft position", "draft position", "acceptance rate (of drafts reaching it)")

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(1, len(ours))
    for i, method in enumerate(ours):
        hist = np.array(_sum_lists([r["stats"]["accepted_len_histogram"] for r in rows if r["method"] == method]), float)
        ax.bar(np.arange(len(hist)) + i * width, hist / max(hist.sum(), 1), width, label=method)
    save(fig, ax, "accepted_length_hist.png", "Accepted length per step", "draft tokens accepted in a step", "fraction of steps")
    return paths


def _sum_lists(lists: list[list[int]], length: int = 0) -> list[int]:
    total = [0] * max([length, *map(len, lists)])
    for values in lists:
        for i, v in enumerate(values):
            total[i] += v
    return total


def write_report(rows: list[dict], methods: list[str], env: dict, command: str, config: dict, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows, methods)
    (out / "results.json").write_text(json.dumps(dict(command=command, environment=env, config=config, summary=summary, rows=rows), indent=1))
    (out / "report.md").write_text(render_markdown(summary, env, command, config))
    plot(rows, summary, out)
    return summary
