"""`specdecode generate | check | bench | serve | models`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .backends import BackendError
from .models import BUILTINS, DEFAULT_DRAFT, DEFAULT_TARGET, ModelError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="settings file written by `specdecode tune` (flags given here win)")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model spec (default {DEFAULT_TARGET})")
    p.add_argument(
        "--draft",
        default="auto",
        help=f"drafter: a model spec (with +int8 or +int4, +head, +compile, +altN options), 'ngram' (prompt lookup), 'self[:L]' (the "
        f"target's first L layers), 'auto[:MODEL]' "
        f"(n-gram where the context matches, else the int4 + restricted-head {DEFAULT_DRAFT}; adaptive; the default) or 'none'",
    )
    p.add_argument(
        "--compile-draft", action=argparse.BooleanOptionalAction, default=None,
        help="auto compiles its draft model's one-token step with torch.compile: draft steps ~20%% cheaper, about a minute "
        "more at start (default: on for serve and bench, off for one-off commands)",
    )
    p.add_argument(
        "--backend", choices=["auto", "torch", "llama.cpp"], default="auto",
        help="what runs the models: llama.cpp (GGUF files and built-ins, its quantized CPU kernels), torch (transformers; "
        "Hugging Face directories, hub ids, GPUs, fp32 exactness) or auto (llama.cpp for GGUF on a CPU when installed)",
    )
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None, help="torch backend: default bf16 where the CPU has it")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: the backend's choice)")
    p.add_argument("--k", type=int, default=None, help="draft length (default 5), or its maximum when adaptive (default 8)")
    p.add_argument(
        "--adaptive", action=argparse.BooleanOptionalAction, default=None,
        help="choose the draft length (and plain decoding) per step from measured costs (default: on for auto)",
    )


def _compile_draft(args, long_running: bool) -> bool:
    """--compile-draft as given, else on for long-running commands (serve, bench): compiling costs ~1 min at load."""
    return long_running if args.compile_draft is None else args.compile_draft


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


STAT_ROWS = (
    ("new tokens", "new_tokens", "{}"),
    ("tokens/s", "tokens_per_s", "{:.2f}"),
    ("time to first token s", "time_to_first_token_s", "{:.3f}"),
    ("total s", "total_time_s", "{:.2f}"),
    ("target passes", "target_passes", "{}"),
    ("draft passes", "draft_passes", "{}"),
    ("drafted tokens", "drafted_tokens", "{}"),
    ("accepted tokens", "accepted_tokens", "{}"),
    ("acceptance rate", "acceptance_rate", "{:.1%}"),
    ("accepted per step", "mean_accepted_len", "{:.2f}"),
    ("draft s", "draft_time_s", "{:.2f}"),
    ("verify s", "verify_time_s", "{:.2f}"),
)


def _stats_table(runs: list[tuple[str, dict]]):
    """One column per run, one row per statistic (fits a narrow terminal)."""
    from rich.table import Table

    table = Table(title="generation stats")
    table.add_column("")
    for name, _ in runs:
        table.add_column(name, justify="right")
    for label, key, fmt in STAT_ROWS:
        table.add_row(label, *(fmt.format(stats[key]) for _, stats in runs))
    per_pos = [", ".join(f"{a:.2f}" for a in stats["acceptance_per_position"]) or "-" for _, stats in runs]
    table.add_row("acceptance by position", *per_pos)
    return table


def cmd_generate(args) -> int:
    from rich.console import Console

    from .pipeline import SpecDecoder

    err = Console(stderr=True)
    decoder = SpecDecoder.from_specs(
        args.target, None if args.plain else args.draft, dtype=args.dtype, k=args.k, adaptive=args.adaptive, threads=args.threads,
        compile_draft=_compile_draft(args, long_running=False), backend=args.backend,
    )
    options = dict(
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    if args.compare:  # first passes pay one-time costs; keep them out of both timings
        decoder.generate(args.prompt, **{**options, "max_new_tokens": 2})
    generation = decoder.stream(args.prompt, **options)
    if args.json:
        completion = generation.result()
        out = completion.to_dict()
        if args.compare:
            out["plain"] = decoder.generate(args.prompt, speculate=False, **options).to_dict()
        print(json.dumps(out))
        return 0
    for piece in generation:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    completion = generation.result()
    engine = decoder.engine
    label = "plain" if decoder.drafter is None else f"speculative ({decoder.drafter.name}, {'adaptive k≤' if engine.controller else 'k='}{engine.k})"
    rows = [(label, completion.stats.to_dict())]
    if args.compare and decoder.drafter is not None:
        err.print("[dim]running plain decoding for comparison ...[/dim]")
        plain = decoder.generate(args.prompt, speculate=False, **options)
        rows.append(("plain", plain.stats.to_dict()))
    err.print(_stats_table(rows))
    if len(rows) == 2:
        spec_s, plain_s = rows[0][1], rows[1][1]
        same = completion.token_ids == plain.token_ids
        err.print(
            f"speedup {spec_s['tokens_per_s'] / max(plain_s['tokens_per_s'], 1e-9):.2f}x plain; "
            f"output {'identical to' if same else 'DIFFERENT from'} plain decoding"
            + ("" if same or args.temperature > 0 else " (bf16 near-ties can do this; fp32 must not)")
        )
    return 0


def cmd_models(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .models import describe_builtins, prepare

    action, *names = args.words or ["list"]
    if action not in ("list", "pull") or (action == "list" and names):
        raise ValueError(f"models takes `list` or `pull [NAME ...]`, not {' '.join(args.words)!r}")
    if action == "pull":
        from .backends import choose_backend
        from .models import gguf_file

        for name in names or list(BUILTINS):
            # llama.cpp reads the GGUF itself; torch needs the one-off conversion (~10 GB in fp32 for the Qwen pair)
            path = gguf_file(name) if choose_backend(args.backend, name) == "llama.cpp" else prepare(name)
            print(f"{name}: {path}")
        return 0
    table = Table(title="built-in models (install offline from PyPI)")
    for col in ("name", "description", "installed", "converted", "size MB", "path"):
        table.add_column(col)
    for row in describe_builtins():
        table.add_row(
            row["name"], row["description"], "yes" if row["installed"] else "no", "yes" if row["converted"] else "no",
            str(row["size_mb"]) if row["converted"] else "-", row["path"] if row["converted"] else "-",
        )
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    return 0


def _add_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default=None, help="JSONL (id, task, turns) or text file; default: the Spec-Bench dev set")
    p.add_argument("--tasks", default=None, help="comma-separated tasks to keep")
    p.add_argument("--per-task", type=int, default=None, help="first N prompts of each task")
    p.add_argument("--limit", type=int, default=None, help="first N prompts overall")


def _load_prompts(args):
    from .prompts import load_prompts

    return load_prompts(args.prompts, tasks=args.tasks.split(",") if args.tasks else None, per_task=args.per_task, limit=args.limit)


def cmd_check(args) -> int:
    from rich.console import Console

    from dataclasses import asdict

    from .check import check_greedy, check_sampling, summarize_greedy
    from .pipeline import SpecDecoder

    console = Console(stderr=True)
    prompts = _load_prompts(args)
    decoder = SpecDecoder.from_specs(args.target, args.draft, dtype=args.dtype, k=args.k, adaptive=args.adaptive, threads=args.threads,
                                     compile_draft=_compile_draft(args, long_running=False), backend=args.backend)

    def show(case):
        detail = "" if case.identical else f" first difference at token {case.first_difference}, top-2 gap {case.top2_gap:.4g}"
        console.print(f"  {case.task}/{case.id}: {case.verdict}{detail}")

    console.print(f"greedy check: {len(prompts)} prompts, {args.max_new_tokens} new tokens, {decoder.engine.backend.describe()}")
    summary = summarize_greedy(check_greedy(decoder, prompts, args.max_new_tokens, progress=None if args.json else show))
    passed = summary["divergences"] == 0
    report = dict(greedy=summary)
    if not args.json:
        console.print(
            f"greedy: {summary['identical']} of {summary['total']} identical, {summary['near_ties']} numeric near-tie(s), "
            f"{summary['divergences']} divergence(s): {'PASS' if passed else 'FAIL'}"
        )
    if args.temperature > 0:
        chosen = prompts[: args.sampling_prompts]
        console.print(
            f"sampling check: {len(chosen)} prompt(s), {args.samples} samples each way, positions 1..{args.positions}, "
            f"temperature {args.temperature}, top-p {args.top_p}, top-k {args.top_k}"
        )

        def show_sampling(case):
            hint = " (raise --samples)" if case.verdict == "INCONCLUSIVE" else ""
            console.print(f"  {case.id} position {case.position}: p = {case.pvalue:.3g}, TVD = {case.tvd:.3f}: {case.verdict}{hint}")

        cases = check_sampling(
            decoder, chosen, samples=args.samples, positions=args.positions, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, progress=None if args.json else show_sampling,
        )
        report["sampling"] = [dict(asdict(c), passed=c.passed) for c in cases]
        passed = passed and all(c.passed for c in cases)
    report["passed"] = passed
    if args.json:
        print(json.dumps(report))
    else:
        console.print("PASS" if passed else "FAIL")
    return 0 if passed else 1


def cmd_load_bench(args) -> int:
    """`bench --endpoint URL ...`: drive running OpenAI-compatible servers instead of loading models."""
    from tqdm import tqdm

    from .bench.load import run_load

    endpoints = {}
    for i, spec in enumerate(args.endpoint):
        label, sep, url = spec.partition("=")
        endpoints[label if sep else (spec if len(args.endpoint) == 1 else f"endpoint{i + 1}")] = url if sep else spec
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(c < 1 for c in levels) or args.requests < 1:
        raise ValueError("--concurrency levels and --requests must be >= 1")
    prompts = [[{"role": "user", "content": p.text}] for p in _load_prompts(args)]
    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    with tqdm(total=len(levels) * len(endpoints) * args.requests * args.rounds, desc="load", unit="req") as bar:
        rows = run_load(endpoints, prompts, levels, args.requests, args.max_new_tokens, args.temperature,
                        args.time_limit, args.model, progress=bar.update, rounds=args.rounds)
    return _write_load_report(rows, endpoints, Path(args.out))


def cmd_pool_load(args) -> int:
    """`bench --pool RUN_DIR ...`: one report from several load runs (e.g. servers measured one at a time)."""
    from .bench.load import pool_runs

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

    from .bench.load import load_markdown, load_plot

    out.mkdir(parents=True, exist_ok=True)
    command = "specdecode " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    (out / "load.json").write_text(json.dumps(dict(command=command, endpoints=endpoints, rows=rows), indent=1))
    markdown = load_markdown(rows, command)
    (out / "load.md").write_text(markdown)
    load_plot(rows, out / "load.png")
    print(markdown)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


def cmd_serve(args) -> int:
    import uvicorn

    from .server import Service, create_app

    service = Service.from_specs(  # a server speculates load-aware unless told otherwise
        args.target, args.draft, dtype=args.dtype, threads=args.threads, k=args.k,
        adaptive=True if args.adaptive is None else args.adaptive,
        model_name=args.served_model_name, max_batch=args.max_batch, max_queue=args.max_queue,
        default_max_tokens=args.default_max_tokens, compile_draft=_compile_draft(args, long_running=True), backend=args.backend,
    )
    print(f"[specdecode] serving {service.model_name} on http://{args.host}:{args.port}/v1 — speculation: {service.speculation}, "
          f"max batch {args.max_batch}, max queue {args.max_queue}", file=sys.stderr)
    uvicorn.run(create_app(service, max_body_bytes=args.max_body_bytes), host=args.host, port=args.port, log_level=args.log_level)
    return 0


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

    from .bench.methods import build_methods
    from .bench.report import write_report
    from .bench.runner import BenchConfig, environment, run_bench
    from .pipeline import SpecDecoder, load_components
    from .sampling import SamplingParams

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

    from .models import load_model
    from .pipeline import SpecDecoder
    from .tune import default_candidates, rounds_of, tune, write_config

    if args.threads:
        torch_threads(args.threads)
    console = Console(stderr=True)
    prompts = _load_prompts(args)
    drafts = [d for spec in (args.draft or ["auto", "ngram", f"{DEFAULT_DRAFT}+int4+head", "self"]) for d in spec.split(",")]
    candidates = [c for spec in args.candidates for c in spec.split(",")] if args.candidates else default_candidates(drafts)
    target, tokenizer = load_model(args.target, dtype=args.dtype)
    decoder = SpecDecoder(target, tokenizer)
    rounds = rounds_of(prompts)
    console.print(f"tune: {len(candidates)} candidates ({', '.join(candidates)}) on up to {len(prompts)} prompts in "
                  f"{len(rounds)} round(s), {args.max_new_tokens} new tokens, budget {args.budget:.0f} s")
    with tqdm(desc="tune", unit="run") as bar:
        result = tune(target, tokenizer, decoder.eos, prompts, candidates, budget_s=args.budget, max_new_tokens=args.max_new_tokens,
                      encode=lambda text: decoder.encode(text, chat=True), dtype=args.dtype, progress=bar.update,
                      log=lambda msg: bar.write(msg))
    table = Table(title=f"tune: {result.rounds} round(s), {result.elapsed_s:.0f} s (speedup = tokens/s vs plain, same prompts)")
    tasks = sorted({t for row in result.table for t in row["by_task"]})
    for col in ("method", "prompts", "mean", "min", "acceptance", *tasks):
        table.add_column(col, justify="right")
    for row in result.table:
        table.add_row(row["method"], str(row["prompts"]), f"{row['speedup_mean']:.2f}x", f"{row['speedup_min']:.2f}x",
                      f"{row['acceptance']:.0%}", *(f"{row['by_task'][t]:.2f}x" if t in row["by_task"] else "-" for t in tasks))
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    from .models import DTYPES

    dtype = args.dtype or {v: k for k, v in DTYPES.items()}.get(target.dtype)
    config = write_config(Path(args.out), result, target=args.target, dtype=dtype, threads=args.threads,
                          max_new_tokens=args.max_new_tokens, command="specdecode " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    console.print(f"best: {config['tuned']['method']} ({config['tuned']['speedup_vs_plain']:.2f}x plain) -> {args.out}: "
                  f"draft={config['draft']} k={config['k']} adaptive={config['adaptive']}")
    for engine in ("vllm", "llama_cpp", "transformers"):
        exported = config["exports"].get(engine)
        console.print(f"  {engine}: " + (exported.get("command", json.dumps(exported)) if exported else "no equivalent"))
    for note in config["exports"]["notes"]:
        console.print(f"  note: {note}")
    return 0


def torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def build_parser(config: dict | None = None) -> argparse.ArgumentParser:
    """config: settings from a tune file, the defaults of every command that takes --config."""
    parser = argparse.ArgumentParser(prog="specdecode", description="Speculative decoding: the target's answers, faster.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streamed, then print the stats")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    g.add_argument("--plain", action="store_true", help="plain decoding (no drafter): the baseline")
    g.add_argument("--compare", action="store_true", help="also run plain decoding and print the speedup")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    g.add_argument("prompt")
    g.set_defaults(func=cmd_generate, **(config or {}))

    c = sub.add_parser("check", help="prove on your prompts that speculation preserves the output (exit 0 = pass)")
    _add_model_args(c)
    _add_prompt_args(c)
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--temperature", type=float, default=0.0, help="> 0 adds the sampling check at this temperature")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--top-k", type=int, default=0)
    c.add_argument("--samples", type=int, default=200, help="sampling check: completions per method and prompt")
    c.add_argument("--positions", type=int, default=2, help="sampling check: generated positions tested (after the first)")
    c.add_argument("--sampling-prompts", type=int, default=1, help="sampling check: how many of the prompts")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check, **(config or {}))

    b = sub.add_parser("bench", help="benchmark methods side by side on a prompt set; writes report.md, results.json, plots")
    _add_model_args(b)
    _add_sampling_args(b)
    _add_prompt_args(b)
    b.add_argument(
        "--methods",
        default="plain,spec,hf-greedy,hf-assisted,hf-pld",
        help="comma-separated: plain, spec[:DRAFTER[:K|aK]], hf-greedy, hf-assisted, hf-pld (see specdecode.bench.methods); "
        "plain `spec` is the --draft/--k/--adaptive setting (or the --config file's)",
    )
    b.add_argument("--repeat", type=int, default=1, help="runs per prompt and method; the median is kept")
    b.add_argument("--out", default="bench-out", help="output directory")
    b.add_argument("--no-chat", action="store_true", help="feed prompts as raw text instead of through the chat template")
    b.add_argument("--endpoint", action="append", default=[], metavar="[LABEL=]URL",
                   help="load-benchmark a running OpenAI-compatible server instead (repeatable: measured level by level)")
    b.add_argument("--concurrency", default="1,4,8", help="with --endpoint: concurrent clients per level")
    b.add_argument("--requests", type=int, default=8, help="with --endpoint: requests per level and round")
    b.add_argument("--rounds", type=int, default=2,
                   help="with --endpoint: rounds per level, endpoint order reversed every other round (pooled)")
    b.add_argument("--time-limit", type=float, default=600.0, help="with --endpoint: no new request after this many seconds per level")
    b.add_argument("--model", default=None, help="with --endpoint: model name to request (default: the server's first)")
    b.add_argument("--pool", nargs="+", default=[], metavar="RUN_DIR",
                   help="pool earlier `bench --endpoint` runs (their load.json) into one report in --out, per label and level")
    b.set_defaults(func=cmd_bench, max_new_tokens=128, **(config or {}))

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with batched, load-aware speculative decoding")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-batch", type=int, default=8, help="rows decoded together at most")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting at most; more get HTTP 429")
    s.add_argument("--default-max-tokens", type=int, default=256, help="chat requests without max_tokens")
    s.add_argument("--max-body-bytes", type=int, default=None,
                   help="larger request bodies get HTTP 413 before they are read (default 8 MiB)")
    s.add_argument("--served-model-name", default=None, help="the model name clients use (default: the target spec)")
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=cmd_serve, **(config or {}))

    t = sub.add_parser("tune", help="measure drafters and draft lengths on your prompts; write a config for generate/bench/serve")
    t.add_argument("--target", default=DEFAULT_TARGET)
    t.add_argument("--draft", action="append", default=None,
                   help="drafter spec(s) to consider (repeatable or comma-separated; default: auto, ngram, the int4+head model, self)")
    t.add_argument("--candidates", action="append", default=None,
                   help="exact bench methods to try instead (spec:DRAFTER:K or :aK), comma-separated")
    t.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None)
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--budget", type=float, default=900.0, help="seconds; no round starts that would overrun it")
    t.add_argument("--max-new-tokens", type=int, default=64)
    t.add_argument("--out", default="specdecode-config.json")
    _add_prompt_args(t)
    t.set_defaults(func=cmd_tune)

    m = sub.add_parser("models", help="list the built-in models, or `models pull [NAME...]` to install and convert")
    m.add_argument("words", nargs="*", metavar="list | pull [NAME ...]")
    m.add_argument("--backend", choices=["auto", "torch", "llama.cpp"], default="auto",
                   help="pull for this backend: llama.cpp keeps the GGUF as is, torch converts it once (default: auto)")
    m.set_defaults(func=cmd_models)
    return parser


def _config_defaults(argv: list[str]) -> dict:
    """Settings from `--config FILE`, if given: they become the defaults, so explicit flags still win."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return {}
    from .tune import read_config

    return read_config(known.config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        defaults = _config_defaults(argv)
    except ValueError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return 2
    if defaults:
        parser = build_parser(defaults)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "models" and not any(e.startswith("-") for e in extra):
        args.words += extra  # names after an option (`models pull --backend X NAME ...`)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except (ValueError, ModelError, BackendError) as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
