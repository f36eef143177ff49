"""`specdecode generate | check | bench | serve | tune | models`."""

from __future__ import annotations

import argparse
import sys

from ..backends import BackendError
from ..models import DEFAULT_TARGET, ModelError
from .commands import cmd_check, cmd_generate, cmd_models, cmd_serve
from .common import (
    _add_model_args, _add_prompt_args, _add_sampling_args, add_backend_arg, at_least, port_number, seconds,
)
from .measure import cmd_bench, cmd_tune

__all__ = ["build_parser", "main"]


def build_parser(config: dict | None = None) -> argparse.ArgumentParser:
    """config: settings from a tune file, the defaults of every command that takes --config."""
    parser = argparse.ArgumentParser(prog="specdecode", description="Speculative decoding: the target's answers, faster.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streamed, then print the stats")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    g.add_argument("--plain", action="store_true", help="plain decoding (no drafter): the baseline")
    g.add_argument("--compare", action="store_true",
                   help="also time plain decoding (alternating pairs) and print the median speedup")
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
    b.add_argument("--repeat", type=int, default=1,
                   help="runs per prompt and method; the median is kept (a rerun's drafter forgets the earlier runs)")
    b.add_argument("--out", default="bench-out", help="output directory")
    b.add_argument("--no-chat", action="store_true", help="feed prompts as raw text instead of through the chat template")
    b.add_argument("--endpoint", action="append", default=[], metavar="[LABEL=]URL",
                   help="load-benchmark a running OpenAI-compatible server instead (repeatable: measured level by level)")
    b.add_argument("--concurrency", default="1,4,8", help="with --endpoint: concurrent clients per level")
    b.add_argument("--requests", type=int, default=8, help="with --endpoint: requests (chat: conversations) per level and round")
    b.add_argument("--traffic", choices=("fresh", "chat", "agent", "repeat"), default="fresh",
                   help="with --endpoint: fresh prompts; chat: conversations of --turns turns, each re-sending the "
                        "history; agent: requests sharing one long prefix (the prompts' code as one file); repeat: "
                        "each prompt asked twice (the level's first half of requests, then the same again)")
    b.add_argument("--turns", type=int, default=4, help="with --traffic chat: turns per conversation")
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
    s.add_argument("--port", type=port_number, default=8000)
    s.add_argument("--max-batch", type=at_least(1), default=8, help="rows decoded together at most")
    s.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="read every prompt whole (default: finished requests' K/V serve the prompts that share a prefix)")
    s.add_argument("--prefix-cache-tokens", type=at_least(0), default=None, metavar="N",
                   help="finished requests' K/V kept for later prompts that share a prefix, in tokens, least recently "
                        "used evicted first (in host memory; llama.cpp default 32768, torch 8192); 0: no prefix cache")
    s.add_argument("--max-queue", type=at_least(0), default=64, help="requests waiting at most; more get HTTP 429")
    s.add_argument("--default-max-tokens", type=at_least(1), default=256, help="chat requests without max_tokens")
    s.add_argument("--max-body-bytes", type=at_least(1), default=None,
                   help="larger request bodies get HTTP 413 before they are read (default 8 MiB)")
    s.add_argument("--shutdown-timeout", type=seconds, default=30.0,
                   help="at SIGTERM/SIGINT, seconds the open requests get to finish before they are cut (default 30)")
    s.add_argument("--served-model-name", default=None, help="the model name clients use (default: the target spec)")
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=cmd_serve, **(config or {}))

    t = sub.add_parser("tune", help="measure drafters and draft lengths on your prompts; write a config for generate/bench/serve")
    t.add_argument("--target", default=DEFAULT_TARGET)
    t.add_argument("--draft", action="append", default=None,
                   help="drafter spec(s) to consider (repeatable or comma-separated; default: auto, ngram, the int4+head model, self)")
    t.add_argument("--candidates", action="append", default=None,
                   help="exact bench methods to try instead (spec:DRAFTER:K or :aK), comma-separated")
    add_backend_arg(t)
    t.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None, help="torch backend")
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
    from ..tune import read_config

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

