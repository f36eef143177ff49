"""Options and helpers every command shares."""

from __future__ import annotations

import argparse

from ..models import DEFAULT_DRAFT, DEFAULT_TARGET


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="settings file written by `specdecode tune` (flags given here win)")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model spec (default {DEFAULT_TARGET})")
    p.add_argument(
        "--draft",
        default="auto",
        help=f"drafter: a model spec (with +int8 or +int4, +head, +compile, +altN options), 'suffix' (suffix trees over the "
        "prompt, the answer and earlier answers), 'ngram' (prompt lookup), 'self[:L]' (the target's first L layers), "
        f"'auto[:MODEL]' (lookups wherever they pay, else {DEFAULT_DRAFT} where it can; adaptive; the default) or 'none'",
    )
    p.add_argument(
        "--compile-draft", action=argparse.BooleanOptionalAction, default=None,
        help="auto compiles its draft model's one-token step with torch.compile: draft steps ~20%% cheaper, about a minute "
        "more at start (default: on for serve and bench, off for one-off commands)",
    )
    add_backend_arg(p)
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None, help="torch backend: default bf16 where the CPU has it")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: the backend's choice)")
    p.add_argument("--k", type=int, default=None, help="draft length (default 5), or its maximum when adaptive (default 8)")
    p.add_argument(
        "--adaptive", action=argparse.BooleanOptionalAction, default=None,
        help="choose the draft length (and plain decoding) per step from measured costs (default: on for auto and suffix)",
    )


def at_least(low: int):
    """An argparse type: an integer >= low (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def port_number(text: str) -> int:
    value = at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0-65535, got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def add_backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend", choices=["auto", "torch", "llama.cpp"], default="auto",
        help="what runs the models: llama.cpp (GGUF files and built-ins, its quantized CPU kernels), torch (transformers; "
        "Hugging Face directories, hub ids, GPUs, fp32 exactness) or auto (llama.cpp for GGUF on a CPU when installed)",
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


def _add_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default=None, help="JSONL (id, task, turns) or text file, or a shipped set: "
                   "specbench (the default: Spec-Bench's dev half) or edits (code edits)")
    p.add_argument("--tasks", default=None, help="comma-separated tasks to keep")
    p.add_argument("--per-task", type=int, default=None, help="first N prompts of each task")
    p.add_argument("--limit", type=int, default=None, help="first N prompts overall")


def _load_prompts(args):
    from ..prompts import load_prompts

    return load_prompts(args.prompts, tasks=args.tasks.split(",") if args.tasks else None, per_task=args.per_task, limit=args.limit)
