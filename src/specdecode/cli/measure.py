"""`bench` (methods side by side, or servers under load) and `tune`: measuring."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..models import DEFAULT_DRAFT
from .common import _compile_draft, _load_prompts


def cmd_load_bench(args) -> int:
    """`bench --endpoint URL ...`: drive running OpenAI-compatible servers instead of loading models."""
    from tqdm import tqdm

    from ..bench.load import agent_requests, repeat_requests, run_load, tasks_in_turn

    endpoints = {}
    for i, spec in enumerate(args.endpoint):
        label, sep, url = spec.partition("=")
        endpoints[label if sep else (spec if len(args.endpoint) == 1 else f"endpoint{i + 1}")] = url if sep else spec
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(c < 1 for c in levels) or args.requests < 1:
        raise ValueError("--concurrency levels and --requests must be >= 1")
    texts = [p.text for p in tasks_in_turn(_load_prompts(args))]
    prompts = agent_requests(texts) if args.traffic == "agent" else [[{"role": "user", "content": t}] for t in texts]
    if args.traffic == "repeat":
        prompts = repeat_requests(prompts, args.requests)
    if args.rounds < 1 or args.turns < 1:
        raise ValueError("--rounds and --turns must be >= 1")
    turns = args.turns if args.traffic == "chat" else 1
    with tqdm(total=len(levels) * len(endpoints) * args.requests * args.rounds * turns, desc="load", unit="req") as bar:
        rows = run_load(endpoints, prompts, levels, args.requests, args.max_new_tokens, args.temperature,
                        args.time_limit, args.model, progress=bar.update, rounds=args.rounds, turns=turns)
    return _write_load_report(rows, endpoints, Path(args.out))


def cmd_pool_load(args) -> int:
    """`bench --pool RUN_DIR ...`: one report from several load runs (e.g. servers measured one at a time)."""
    from ..bench.load import pool_runs

    runs = []
    for run_dir in args.pool:
        path = Path(run_dir) / "load.json"
        if not path.exists():
            raise ValueError(f"--pool: no load.json in {run_dir} (give directories written by `bench --endpoint`)")
        runs.append(json.loads(path.read_text()))
    endpoints = {label: url for run in runs for label, url in run["endpoints"].items()}
    return _write_load_report(pool_runs(runs), endpoints, Path(args.out))


def _write_load_report(rows: list[dict], endpoints: dict[str, str], out: Path) -> int:
    import shlex

    from ..bench.load import add_round_ratios, load_markdown, load_plot

    rows = add_round_ratios(rows)
    out.mkdir(parents=True, exist_ok=True)
    command = "specdecode " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    (out / "load.json").write_text(json.dumps(dict(command=command, endpoints=endpoints, rows=rows), indent=1))
    markdown = load_markdown(rows, command)
    (out / "load.md").write_text(markdown)
    load_plot(rows, out / "load.png")
    print(markdown)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


def cmd_bench(args) -> int:
    import shlex

    if args.endpoint and args.pool:
        raise ValueError("give --endpoint (measure servers) or --pool (merge earlier runs), not both")
    if args.endpoint:
        return cmd_load_bench(args)
    if args.pool:
        return cmd_pool_load(args)

    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    from ..bench.methods import build_methods
    from ..bench.report import write_report
    from ..bench.runner import BenchConfig, environment, run_bench
    from ..pipeline import SpecDecoder, load_components
    from ..sampling import SamplingParams

    prompts = _load_prompts(args)
    target, tokenizer, _, _, _ = load_components(args.target, None, dtype=args.dtype, threads=args.threads, backend=args.backend)
    decoder = SpecDecoder(target, tokenizer)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    methods = build_methods(names, target, tokenizer, decoder.eos, default_draft=args.draft, default_k=args.k, dtype=args.dtype,
                            default_adaptive=args.adaptive, compile_draft=_compile_draft(args, long_running=True),
                            threads=args.threads)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    config = BenchConfig(max_new_tokens=args.max_new_tokens, repeat=args.repeat, sampling=sampling, chat=not args.no_chat)
    with tqdm(total=len(prompts) * len(methods) * args.repeat, desc="bench", unit="run") as bar:
        rows = run_bench(methods, prompts, lambda text: decoder.encode(text, chat=config.chat), config, progress=bar.update)
    command = "specdecode " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    settings = dict(
        target=args.target, draft=args.draft, k=args.k, max_new_tokens=args.max_new_tokens, repeat=args.repeat,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, prompts=len(prompts),
        methods={m.name: m.settings for m in methods},
    )
    summary = write_report(rows, names, environment(target, args.threads), command, settings, Path(args.out))
    table = Table(title=f"overall ({len(prompts)} prompts, {args.max_new_tokens} new tokens) — {args.out}/report.md")
    for col in ("method", "tok/s", "vs plain (mean)", "min", "max", "accepted/step", "identical", "p50 s", "p99 s"):
        table.add_column(col, justify="right")
    for name, m in summary["overall"].items():
        sp = m["speedup_vs_plain"] or {}
        table.add_row(
            name, f"{m['tokens_per_s']:.2f}", f"{sp.get('mean', 0):.2f}x", f"{sp.get('min', 0):.2f}x", f"{sp.get('max', 0):.2f}x",
            "-" if m["mean_accepted_len"] is None else f"{m['mean_accepted_len']:.2f}", f"{m['identical']}/{m['n']}",
            f"{m['latency_p50']:.2f}", f"{m['latency_p99']:.2f}",
        )
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


def cmd_tune(args) -> int:
    import shlex

    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    from ..pipeline import SpecDecoder, load_components
    from ..tune import default_candidates, rounds_of, tune, write_config

    console = Console(stderr=True)
    prompts = _load_prompts(args)
    target, tokenizer, _, _, _ = load_components(args.target, None, dtype=args.dtype, threads=args.threads, backend=args.backend)
    # Packed weights, a restricted head and self-drafting are transformers models' (a GGUF drafts as it is)
    torch_drafts = target.hf_model is not None
    default_drafts = ["auto", "ngram", f"{DEFAULT_DRAFT}+int4+head", "self"] if torch_drafts else ["auto", "ngram", DEFAULT_DRAFT]
    drafts = [d for spec in (args.draft or default_drafts) for d in spec.split(",")]
    candidates = [c for spec in args.candidates for c in spec.split(",")] if args.candidates else default_candidates(drafts)
    decoder = SpecDecoder(target, tokenizer)
    rounds = rounds_of(prompts)
    console.print(f"tune: {len(candidates)} candidates ({', '.join(candidates)}) on up to {len(prompts)} prompts in "
                  f"{len(rounds)} round(s), {args.max_new_tokens} new tokens, budget {args.budget:.0f} s")
    with tqdm(desc="tune", unit="run") as bar:
        result = tune(target, tokenizer, decoder.eos, prompts, candidates, budget_s=args.budget, max_new_tokens=args.max_new_tokens,
                      encode=lambda text: decoder.encode(text, chat=True), dtype=args.dtype, threads=args.threads, progress=bar.update,
                      log=lambda msg: bar.write(msg))
    table = Table(title=f"tune: {result.rounds} round(s), {result.elapsed_s:.0f} s (speedup = tokens/s vs plain, same prompts)")
    tasks = sorted({t for row in result.table for t in row["by_task"]})
    for col in ("method", "prompts", "mean", "min", "acceptance", *tasks):
        table.add_column(col, justify="right")
    for row in result.table:
        table.add_row(row["method"], str(row["prompts"]), f"{row['speedup_mean']:.2f}x", f"{row['speedup_min']:.2f}x",
                      f"{row['acceptance']:.0%}", *(f"{row['by_task'][t]:.2f}x" if t in row["by_task"] else "-" for t in tasks))
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    from ..models import DTYPES

    dtype = args.dtype or {v: k for k, v in DTYPES.items()}.get(target.hf_model.dtype) if torch_drafts else None
    config = write_config(Path(args.out), result, target=args.target, dtype=dtype, threads=args.threads,
                          backend=target.name,
                          max_new_tokens=args.max_new_tokens, command="specdecode " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    console.print(f"best: {config['tuned']['method']} ({config['tuned']['speedup_vs_plain']:.2f}x plain) -> {args.out}: "
                  f"draft={config['draft']} k={config['k']} adaptive={config['adaptive']}")
    for engine in ("vllm", "llama_cpp", "transformers"):
        exported = config["exports"].get(engine)
        console.print(f"  {engine}: " + (exported.get("command", json.dumps(exported)) if exported else "no equivalent"))
    for note in config["exports"]["notes"]:
        console.print(f"  note: {note}")
    return 0
