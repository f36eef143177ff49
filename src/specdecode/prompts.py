"""Prompt sets: Spec-Bench-style JSONL (`id`, `task`, `turns`) or plain text, one prompt a line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    task: str
    text: str  # the first user turn: the user message of a chat template


# Prompt sets shipped with the package (data/NOTICE.md), by the name `--prompts` takes: Spec-Bench's dev half (the
# general benchmark) and code edits (the answer copies most of the input: where lookup drafts pay most).
SHIPPED = {"specbench": "specbench-dev.jsonl", "edits": "edit-dev.jsonl"}


def shipped_prompt_file(name: str = "specbench") -> Path:
    return Path(str(resources.files("specdecode") / "data" / SHIPPED[name]))


def load_prompts(
    path: str | Path | None = None, *, tasks: list[str] | None = None, per_task: int | None = None, limit: int | None = None
) -> list[Prompt]:
    """Read prompts (a file, or a shipped set's name: specbench, edits); keep the named tasks, the first `per_task`
    of each task, then the first `limit`."""
    path = shipped_prompt_file(path or "specbench") if path is None or str(path) in SHIPPED else Path(path)
    if not path.exists():
        raise ValueError(f"prompt file not found: {path}")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
                text = row["turns"][0] if "turns" in row else row["prompt"]
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with 'turns' (or 'prompt'): {e}") from e
            prompts.append(Prompt(str(row.get("id", n)), row.get("task", "default"), text))
        else:
            prompts.append(Prompt(str(n), "default", line))
    if tasks:
        unknown = set(tasks) - {p.task for p in prompts}
        if unknown:
            raise ValueError(f"no prompts of task(s) {sorted(unknown)} in {path}; tasks there: {sorted({p.task for p in prompts})}")
        prompts = [p for p in prompts if p.task in tasks]
    if per_task:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.task] = seen.get(p.task, 0) + 1
            if seen[p.task] <= per_task:
                kept.append(p)
        prompts = kept
    if limit:
        prompts = prompts[:limit]
    if not prompts:
        raise ValueError(f"no prompts selected from {path}")
    return prompts
