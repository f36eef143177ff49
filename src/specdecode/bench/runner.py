"""Run every method on every prompt back to back, so each ratio compares runs made seconds apart."""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import dataclass

import torch

from ..check import first_difference
from ..prompts import Prompt
from ..sampling import SamplingParams
from .methods import Method


@dataclass
class BenchConfig:
    max_new_tokens: int = 128
    repeat: int = 1
    sampling: SamplingParams = SamplingParams()
    chat: bool = True
    warmup: bool = True


def cpu_features() -> dict:
    """The CPU's model name and the flags that decide what wins on it (a result names both)."""
    name, flags = platform.processor(), set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not flags:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_int8", "amx_bf16")
    return dict(cpu=name, **{flag: flag in flags for flag in wanted})


def environment(target, threads: int | None = None) -> dict:
    """Versions, backend and CPU of a run; `target` is a Backend or a transformers model."""
    import transformers

    from ..backends import as_backend

    target = as_backend(target)
    backend, device, llama_cpp = target.describe(), target.device, target.build_info()
    return dict(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        backend=backend,
        threads=threads or torch.get_num_threads(),
        **cpu_features(),
        cores=os.cpu_count(),
        device=device,
        cuda=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        llama_cpp=llama_cpp,  # the build's own line of the CPU features its kernels use
    )


def _row(prompt: Prompt, method: Method, run, repeat_index: int) -> dict:
    new_tokens = len(run.token_ids)
    return dict(
        prompt_id=prompt.id,
        task=prompt.task,
        method=method.name,
        kind=method.kind,
        repeat=repeat_index,
        ttft_s=run.ttft_s,
        latency_s=run.latency_s,
        new_tokens=new_tokens,
        tokens_per_s=new_tokens / run.latency_s if run.latency_s > 0 else 0.0,
        token_ids=run.token_ids,
        stats=run.stats,
    )


def run_bench(methods: list[Method], prompts: list[Prompt], encode, config: BenchConfig, progress=None) -> list[dict]:
    """One row per (prompt, method): the median-latency repeat, with identity to `plain` marked."""
    if config.warmup:  # first passes pay one-time allocation costs; keep them out of every timing
        warm = encode(prompts[0].text)
        for method in methods:
            method.run(warm, 4, config.sampling)
            method.forget_last_run()
    rows = []
    for i, prompt in enumerate(prompts):
        input_ids = encode(prompt.text)
        per_method: dict[str, list[dict]] = {m.name: [] for m in methods}
        for r in range(config.repeat):
            # interleaved, every other round in reverse order: every method sees the same machine state, and none
            # is always the first after a change of prompt
            for method in (methods if (i + r) % 2 == 0 else methods[::-1]):
                if r:
                    method.forget_last_run()
                per_method[method.name].append(_row(prompt, method, method.run(input_ids, config.max_new_tokens, config.sampling), r))
                if progress:
                    progress()
        chosen = {}
        for name, runs in per_method.items():
            median = statistics.median_low([x["latency_s"] for x in runs])
            chosen[name] = next(x for x in runs if x["latency_s"] == median)
        plain = chosen.get("plain")
        for row in chosen.values():
            row["prompt_tokens"] = input_ids.shape[1]
            if plain is not None:
                diff = first_difference(plain["token_ids"], row["token_ids"])
                row["identical_to_plain"] = diff is None
                row["first_difference"] = diff
            rows.append(row)
    return rows
