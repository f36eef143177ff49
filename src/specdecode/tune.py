"""`specdecode tune`: measure what each drafter and draft length buys on the user's prompts, within a
time budget, and write a config file (plus the equivalent settings for vLLM, llama.cpp, transformers).

Search: every candidate runs beside plain decoding on one prompt per task (interleaved, like the
bench); then the better half goes on to the next prompts, and so on (successive halving) while the
budget lasts. No new round starts that the measured run times say would overrun the budget.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from .bench.methods import build_methods, parse_spec_method
from .bench.runner import BenchConfig, run_bench
from .models import DEFAULT_DRAFT, ModelError
from .drafters.spec import parse_drafter_spec
from .drafters.factory import model_spec_of
from .prompts import Prompt

CONFIG_KEYS = ("target", "backend", "draft", "k", "adaptive", "dtype", "threads")  # what generate/bench/serve read from --config
HUB_IDS = {  # built-in names -> the Hugging Face repositories other engines load
    "qwen2.5-coder-1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
    "qwen2.5-coder-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}


def default_candidates(drafts: list[str]) -> list[str]:
    """Bench method names to try for these drafter specs: fixed draft lengths and adaptive."""
    out = []
    for draft in drafts:
        # Few per drafter: a 15-minute budget holds ~6 candidates x 6 prompts x 64 tokens on 2 cores.
        if draft == "ngram":
            out += ["spec:ngram:5", "spec:ngram:a8"]
        elif parse_drafter_spec(draft).kind == "auto":
            out += [f"spec:{draft}:a8", f"spec:{draft}:5"]
        else:
            out += [f"spec:{draft}:a8"]
    return list(dict.fromkeys(out))


@dataclass
class TuneResult:
    table: list[dict] = field(default_factory=list)  # one row per candidate: speedups over the prompts it ran
    rows: list[dict] = field(default_factory=list)  # raw bench rows
    rounds: int = 0
    elapsed_s: float = 0.0
    dropped: dict[str, str] = field(default_factory=dict)  # candidate -> why it could not run on this target

    @property
    def best(self) -> dict | None:
        return self.table[0] if self.table else None


def _speedups(rows: list[dict]) -> dict[str, list[tuple[str, float]]]:
    """method -> [(task, tokens/s ratio to plain on the same prompt)]."""
    plain = {r["prompt_id"]: r for r in rows if r["method"] == "plain"}
    out: dict[str, list[tuple[str, float]]] = {}
    for r in rows:
        base = plain.get(r["prompt_id"])
        if r["method"] != "plain" and base and base["tokens_per_s"] > 0:
            out.setdefault(r["method"], []).append((r["task"], r["tokens_per_s"] / base["tokens_per_s"]))
    return out


def _table(rows: list[dict]) -> list[dict]:
    table = []
    for method, pairs in _speedups(rows).items():
        ratios = [x for _, x in pairs]
        by_task: dict[str, list[float]] = {}
        for task, x in pairs:
            by_task.setdefault(task, []).append(x)
        mine = [r for r in rows if r["method"] == method]
        drafted = sum(r["stats"].get("drafted_tokens", 0) for r in mine)
        accepted = sum(r["stats"].get("accepted_tokens", 0) for r in mine)
        table.append(dict(
            method=method, prompts=len(ratios), speedup_mean=statistics.fmean(ratios), speedup_min=min(ratios),
            speedup_max=max(ratios), acceptance=accepted / drafted if drafted else 0.0,
            identical=sum(bool(r.get("identical_to_plain")) for r in mine),
            by_task={t: statistics.fmean(v) for t, v in sorted(by_task.items())},
        ))
    # Rank by mean speedup, but only against candidates measured on as many prompts (halving survivors first).
    table.sort(key=lambda t: (-t["prompts"], -t["speedup_mean"]))
    return table


def rounds_of(prompts: list[Prompt]) -> list[list[Prompt]]:
    """Round r holds the r-th prompt of each task (so every round covers every task)."""
    by_task: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_task.setdefault(p.task, []).append(p)
    depth = max(len(v) for v in by_task.values())
    return [[v[r] for v in by_task.values() if r < len(v)] for r in range(depth)]


def tune(target, tokenizer, eos, prompts: list[Prompt], candidates: list[str], *, budget_s: float, max_new_tokens: int,
         encode, dtype=None, threads: int | None = None, default_draft: str = "auto", progress=None, log=print) -> TuneResult:
    started = time.perf_counter()
    result = TuneResult()
    methods, alive, drafters = {}, [], {}
    for name in ["plain", *candidates]:
        try:
            (method,) = build_methods([name], target, tokenizer, eos, default_draft=default_draft, default_k=None, dtype=dtype,
                                      drafters=drafters, threads=threads)
        except (ValueError, ModelError) as error:  # e.g. a draft of another vocabulary: it cannot serve this target
            if name == "plain":
                raise
            result.dropped[name] = str(error)
            log(f"dropped candidate {name}: {error}")
            continue
        methods[name] = method
        alive += [name] if name != "plain" else []
    if not alive:
        raise ValueError("no candidate can serve this target: " + "; ".join(f"{n}: {why}" for n, why in result.dropped.items()))
    run_s: dict[str, list[float]] = {}
    config = BenchConfig(max_new_tokens=max_new_tokens, warmup=True)
    for r, prompts_r in enumerate(rounds_of(prompts)):
        chosen = [methods["plain"]] + [methods[name] for name in alive]
        expected = len(prompts_r) * sum(statistics.fmean(run_s.get(m.name, run_s.get("plain", [0.0]))) for m in chosen)
        remaining = budget_s - (time.perf_counter() - started)
        if r and expected > remaining:
            log(f"round {r + 1}: {len(alive)} candidates on {len(prompts_r)} prompts would take ~{expected:.0f} s, "
                f"{remaining:.0f} s left: stopping")
            break
        rows = run_bench(chosen, prompts_r, encode, config, progress=progress)
        config.warmup = False
        for row in rows:
            run_s.setdefault(row["method"], []).append(row["latency_s"])
        result.rows += rows
        result.rounds = r + 1
        result.table = _table(result.rows)
        ranked = [t["method"] for t in result.table if t["method"] in alive]
        log(f"round {r + 1}: " + ", ".join(f"{t['method']} {t['speedup_mean']:.2f}x" for t in result.table if t["method"] in alive))
        alive = ranked[: max(1, (len(ranked) + 1) // 2)]
    result.elapsed_s = time.perf_counter() - started
    return result


def exports(target: str, draft: str, k: int, adaptive: bool) -> dict:
    """The nearest equivalent settings in other engines, and what has none."""
    notes = []
    target_hub = HUB_IDS.get(target, target)
    parsed = parse_drafter_spec(draft)
    model = model_spec_of(parsed)
    model_hub = HUB_IDS.get(model, model) if model else None
    uses_ngram = parsed.uses_lookups
    if parsed.kind == "auto":
        notes.append("auto switches per step between n-gram lookup and the draft model; the engines below take one "
                     "method per server: the draft model is exported (n-gram settings are given where it pays to try both)")
    if parsed.kind == "self":
        notes.append("self-speculation (the target's first layers) has no equivalent in vLLM, llama.cpp or transformers")
    if adaptive:
        notes.append(f"adaptive draft length (up to {k}) has no exact equivalent: vLLM and llama.cpp draft a fixed maximum "
                     "(llama.cpp stops early below --draft-p-min); transformers' 'heuristic' schedule adapts k by acceptance")
    if model and (parsed.quant or "head" in parsed.options or parsed.kind == "auto"):
        notes.append("our int8/int4 draft weights and restricted draft head are specdecode's own; other engines use the draft as is")
    vllm = None
    if model_hub:
        vllm = {"model": model_hub, "num_speculative_tokens": k}
    elif uses_ngram:
        vllm = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    llama = None
    if model:
        # llama.cpp stops a draft when the draft's probability falls below --draft-p-min; ours stops from a
        # calibrated cost model, so for adaptive settings p-min 0.5 is a starting point, not an equivalent.
        # Flag names of the llama.cpp pinned with llama-cpp-python (older builds spell them --draft-max / --draft-min)
        llama = {"--spec-draft-model": "DRAFT.gguf", "--spec-type": "draft-simple", "--spec-draft-n-max": k,
                 "--spec-draft-n-min": 0 if adaptive else k, "--spec-draft-p-min": 0.5 if adaptive else 0.0}
    elif uses_ngram:
        llama = {"--spec-type": "ngram-mod", "--spec-ngram-mod-n-max": k}
    transformers = None
    if model_hub:
        transformers = {"assistant_model": model_hub, "num_assistant_tokens": k,
                        "num_assistant_tokens_schedule": "heuristic" if adaptive else "constant"}
    elif uses_ngram:
        transformers = {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": 4}
    out = {"target": target_hub, "vllm": None, "llama_cpp": None, "transformers": transformers, "notes": notes}
    if vllm:
        out["vllm"] = {"speculative_config": vllm,
                       "command": f"vllm serve {target_hub} --speculative-config '{json.dumps(vllm)}'"}
    if llama:
        out["llama_cpp"] = {"flags": llama, "command": "llama-server -m TARGET.gguf " + " ".join(f"{f} {v}" for f, v in llama.items())}
        if model:
            out["llama_cpp"]["draft_gguf"] = f"the GGUF of {model_hub} (for a built-in: `specdecode models pull {model}` fetches it)"
    if uses_ngram and model_hub:
        out["vllm_ngram_alternative"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    return out


def write_config(path: Path, result: TuneResult, *, target: str, dtype: str | None, threads: int | None,
                 max_new_tokens: int, command: str = "", default_draft: str = DEFAULT_DRAFT, backend: str | None = None) -> dict:
    best = result.best
    if best is None:
        raise ValueError("tune measured nothing: raise --budget or give fewer candidates")
    draft, k, adaptive = parse_spec_method(best["method"], default_draft, None)
    if best["speedup_mean"] < 1.0:  # nothing paid on these prompts: plain decoding is the honest setting
        draft, k, adaptive = "none", k, False
    config = dict(
        target=target, backend=backend, draft=draft, k=k, adaptive=adaptive, dtype=dtype, threads=threads,
        tuned=dict(method=best["method"], speedup_vs_plain=best["speedup_mean"], prompts=best["prompts"], dropped=result.dropped,
                   max_new_tokens=max_new_tokens, rounds=result.rounds, elapsed_s=round(result.elapsed_s, 1),
                   command=command, table=result.table),
        exports=exports(target, draft, k, adaptive),
    )
    path.write_text(json.dumps(config, indent=1))
    return config


def read_config(path: str) -> dict:
    """The settings of a tune config that commands take as defaults (explicit flags still win)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {path!r} not found") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"config file {path!r} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a JSON object")
    return {key: data[key] for key in CONFIG_KEYS if data.get(key) is not None}
