"""Bench rows -> summary (per task and overall), report.md, results.json and plots."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

BASELINES = ("hf-greedy", "hf-assisted", "hf-pld", "llama-cpp", "llama-cpp-pld")


LOWEST_SHOWN = 8  # prompts listed under "Lowest prompts" per method


def _pairs(rows: list[dict], method: str, reference: str) -> list[tuple[dict, dict]]:
    """Per prompt: (the method's row, the reference's row), where both ran it."""
    by_prompt = defaultdict(dict)
    for r in rows:
        by_prompt[r["prompt_id"]][r["method"]] = r
    return [(pair[method], pair[reference]) for pair in by_prompt.values()
            if method in pair and reference in pair and pair[reference]["tokens_per_s"] > 0]


def _ratios(rows: list[dict], method: str, reference: str) -> list[float]:
    """Per prompt: tokens/s of `method` over tokens/s of `reference` (= time ratio for equal outputs)."""
    return [mine["tokens_per_s"] / theirs["tokens_per_s"] for mine, theirs in _pairs(rows, method, reference)]


def _decode_s_per_token(row: dict) -> float | None:
    """Seconds a token after the first: the prompt's reading left out, so answers of different lengths compare (a
    near-tie can end one answer at 63 tokens and the other at 111, and a long prompt's reading then decides tok/s)."""
    n, decoding = row["new_tokens"], row["latency_s"] - row["ttft_s"]
    return decoding / (n - 1) if n > 1 and decoding > 0 else None


def lowest_prompts(rows: list[dict], method: str, reference: str, shown: int = LOWEST_SHOWN) -> list[dict]:
    """The prompts where `method` did worst against `reference` (tokens/s ratio), each with what explains it: answer
    lengths, first-token times, the decode-only ratio, what was drafted and accepted."""
    out = []
    for mine, theirs in _pairs(rows, method, reference):
        d_mine, d_theirs = _decode_s_per_token(mine), _decode_s_per_token(theirs)
        out.append(dict(
            prompt_id=mine["prompt_id"], task=mine["task"], prompt_tokens=mine.get("prompt_tokens"),
            new_tokens=[mine["new_tokens"], theirs["new_tokens"]], ttft_s=[mine["ttft_s"], theirs["ttft_s"]],
            speedup=mine["tokens_per_s"] / theirs["tokens_per_s"],
            decode_speedup=d_theirs / d_mine if d_mine and d_theirs else None,
            drafted=mine["stats"].get("drafted_tokens"), accepted=mine["stats"].get("accepted_tokens")))
    return sorted(out, key=lambda p: p["speedup"])[:shown]


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
    ran = {r["method"] for r in rows}
    # lowest prompts against plain where it ran, else against the first baseline that did
    reference = next((b for b in ("plain", *BASELINES) if b in ran), None)
    lowest = {m: dict(reference=reference, prompts=lowest_prompts(rows, m, reference))
              for m in methods if reference and m != reference and m not in BASELINES and m in ran}
    return dict(overall=summarize_group(rows, methods), lowest=lowest,
                tasks={t: summarize_group([r for r in rows if r["task"] == t], methods) for t in tasks})


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
    for method, lowest in summary.get("lowest", {}).items():
        lines += ["", f"## Lowest prompts: {method} against {lowest['reference']}", "",
                  "tok/s counts the prompt's reading; `decode` leaves it out (a token after the first), so it compares "
                  "answers of different lengths.", "",
                  "| prompt | task | prompt tokens | new tokens (ours / theirs) | TTFT s (ours / theirs) | tok/s ratio "
                  "| decode ratio | drafted / accepted |", "|" + "---|" * 8]
        for p in lowest["prompts"]:
            lines.append(f"| {p['prompt_id']} | {p['task']} | {_fmt(p['prompt_tokens'], 'd')} | {p['new_tokens'][0]} / "
                         f"{p['new_tokens'][1]} | {p['ttft_s'][0]:.2f} / {p['ttft_s'][1]:.2f} | "
                         f"{_fmt(p['speedup'], suffix='×')} | {_fmt(p['decode_speedup'], suffix='×')} | "
                         f"{_fmt(p['drafted'], 'd')} / {_fmt(p['accepted'], 'd')} |")
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
