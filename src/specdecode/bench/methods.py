"""What a benchmark can run: our plain and speculative decoding, and transformers' own baselines.

Method names on the command line:
  plain                      ours, no drafter (the baseline every ratio is against)
  spec[:DRAFTER[:K]]         ours with a drafter (see `make_drafter`: MODEL[+int8][+head], ngram,
                             auto[:MODEL]) and draft length K; `aK` = adaptive with at most K
  hf-greedy                  transformers `generate`
  hf-assisted                transformers `generate(assistant_model=draft)` with its own defaults
  hf-pld                     transformers `generate(prompt_lookup_num_tokens=10)`
  llama-cpp                  llama.cpp's own plain decoding (llama-cpp-python's high-level `Llama`) on the target's GGUF
  llama-cpp-pld              the same with its `LlamaPromptLookupDecoding` (10 tokens)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..backends.llamaguard import default_params_for
from ..drafters import Drafter
from ..engine import SpeculativeEngine
from ..drafters.factory import adaptive_by_default, model_spec_of
from ..pipeline import DEFAULT_K, DEFAULT_MAX_K
from ..sampling import SamplingParams
from ..stopping import StopCondition

HF_PLD_TOKENS = 10


@dataclass
class Run:
    """One request served by one method."""

    token_ids: list[int]
    ttft_s: float
    latency_s: float
    stats: dict = field(default_factory=dict)  # engine stats (ours only)


class Method:
    name: str
    kind: str  # "ours" or "baseline"

    def run(self, input_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingParams) -> Run:
        raise NotImplementedError

    def forget_last_run(self) -> None:
        """Before a repeat of the same prompt (and after the warm-up): nothing the last run taught carries over."""


class OursMethod(Method):
    kind = "ours"

    def __init__(self, name: str, target, tokenizer, eos: frozenset[int], drafter: Drafter | None, k: int, adaptive: bool = False):
        self.name, self.eos = name, eos
        self.engine = SpeculativeEngine(target, drafter, tokenizer=tokenizer, k=k, adaptive=adaptive)
        self.settings = dict(drafter=drafter.name if drafter else None, k=k if drafter else None, adaptive=adaptive)

    def forget_last_run(self) -> None:
        if self.engine.drafter is not None:  # a lookup drafter would copy the earlier run's answer
            self.engine.drafter.forget_last_request()

    def run(self, input_ids, max_new_tokens, sampling):
        self.engine.backend.drop_cached_prefixes()  # every method starts each prompt cold
        result = self.engine.generate(
            input_ids, max_new_tokens=max_new_tokens, sampling=sampling, stop=StopCondition(self.eos)
        ).result()
        s = result.stats
        return Run(result.token_ids, s.time_to_first_token_s, s.total_time_s, s.to_dict())


class _FirstTokenTimer:
    """A transformers streamer that notes when the first generated tokens arrive (the first put is the prompt)."""

    def __init__(self):
        self.calls, self.first_token_at = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first_token_at = time.perf_counter()

    def end(self):
        pass


class HFMethod(Method):
    kind = "baseline"

    def __init__(self, name: str, target, eos: frozenset[int], pad_token_id: int, **generate_kwargs):
        self.name, self.target, self.eos, self.pad = name, target, eos, pad_token_id
        self.generate_kwargs = generate_kwargs
        self.settings = {k: (v if isinstance(v, (int, float, str)) else type(v).__name__) for k, v in generate_kwargs.items()}

    @torch.inference_mode()
    def run(self, input_ids, max_new_tokens, sampling):
        sample_kwargs = (
            dict(do_sample=False, temperature=None, top_p=None, top_k=None)
            if sampling.greedy
            else dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
        )
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        timer = _FirstTokenTimer()
        start = time.perf_counter()
        out = self.target.generate(
            input_ids.to(self.target.device),
            attention_mask=torch.ones_like(input_ids).to(self.target.device),
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(self.eos),
            pad_token_id=self.pad,
            streamer=timer,
            **sample_kwargs,
            **self.generate_kwargs,
        )
        latency = time.perf_counter() - start
        tokens = out[0, input_ids.shape[1] :].tolist()
        return Run(tokens, (timer.first_token_at or start + latency) - start, latency, {"new_tokens": len(tokens)})


class LlamaCppMethod(Method):
    """llama.cpp decoding the same GGUF through llama-cpp-python's high-level API: the tool a CPU user would run."""

    kind = "baseline"

    def __init__(self, name: str, gguf: str, eos: frozenset[int], threads: int | None, window: int, prompt_lookup: bool = False):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.name, self.eos = name, eos
        draft = LlamaPromptLookupDecoding(num_pred_tokens=HF_PLD_TOKENS) if prompt_lookup else None
        # flash attention as llama.cpp's default context (auto: on for a CPU) and ours have it: the same kernels, so
        # the same greedy tokens; `Llama` alone would turn it off
        import llama_cpp

        with default_params_for(llama_cpp, gguf):  # the weight layouts our backend loads this file with
            self.llm = Llama(model_path=str(gguf), n_ctx=window + 512, n_threads=threads, n_threads_batch=threads,
                             verbose=False, draft_model=draft, flash_attn=True)
        self.settings = dict(engine="llama-cpp-python Llama", prompt_lookup=HF_PLD_TOKENS if prompt_lookup else None)

    def run(self, input_ids, max_new_tokens, sampling):
        greedy = sampling.greedy
        options = dict(temp=0.0) if greedy else dict(temp=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        tokens, first = [], None
        self.llm.reset()  # no prefix reuse from the last prompt: every method starts each prompt cold
        start = time.perf_counter()
        for token in self.llm.generate(input_ids[0].tolist(), min_p=0.0, reset=True, **{"top_k": 0, "top_p": 1.0, **options}):
            first = first or time.perf_counter()
            tokens.append(token)  # the end token too, as every other method counts it (a pass was spent on it)
            if token in self.eos or len(tokens) >= max_new_tokens:
                break
        latency = time.perf_counter() - start
        return Run(tokens, (first or start + latency) - start, latency, {"new_tokens": len(tokens)})


def parse_spec_method(name: str, default_draft: str, default_k: int | None, default_adaptive: bool | None = None) -> tuple[str, int, bool]:
    """'spec[:DRAFTER[:K]]' -> (drafter spec, k, adaptive). K is a number (fixed) or aN (adaptive, at
    most N); without K, default_adaptive decides, else the `auto` drafters are adaptive (k ≤ 8) and the
    others fixed (k = 5)."""
    parts = name.split(":", 1)[1].rsplit(":", 1) if ":" in name else [default_draft]
    if len(parts) == 2 and not parts[1].lstrip("a").isdigit():  # 'auto:MODEL' carries no K
        parts = [":".join(parts)]
    spec = parts[0] or default_draft
    if len(parts) == 1:
        adaptive = adaptive_by_default(spec) if default_adaptive is None else default_adaptive
        return spec, default_k or (DEFAULT_MAX_K if adaptive else DEFAULT_K), adaptive
    return spec, int(parts[1].lstrip("a")), parts[1].startswith("a")


def build_methods(names: list[str], target, tokenizer, eos, *, default_draft: str, default_k: int | None, dtype,
                  default_adaptive: bool | None = None, compile_draft: bool = False,
                  drafters: dict[str, Drafter | None] | None = None, threads: int | None = None) -> list[Method]:
    """Parse method names; draft models are loaded once and shared between methods (and between calls that
    pass the same `drafters` dict). compile_draft: `auto` compiles its draft step (paid at load, not in any timing).
    `target`: a transformers model (torch backend) or a LlamaCppBackend."""
    from ..backends import as_backend

    drafters = {} if drafters is None else drafters
    target = as_backend(target)  # one backend for every method of ours (each run starts cold: OursMethod.run)
    hf_model = target.hf_model

    def drafter_for(spec: str) -> Drafter | None:
        if spec not in drafters:
            drafters[spec] = target.make_drafter(spec, dtype=dtype, tokenizer=tokenizer, compile_draft=compile_draft,
                                                 threads=threads)
        return drafters[spec]

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    methods: list[Method] = []
    for name in names:
        if name == "plain":
            methods.append(OursMethod(name, target, tokenizer, eos, None, DEFAULT_K))
        elif name == "spec" or name.startswith("spec:"):
            spec, k, adaptive = parse_spec_method(name, default_draft, default_k, default_adaptive)
            methods.append(OursMethod(name, target, tokenizer, eos, drafter_for(spec), k, adaptive))
        elif name in ("llama-cpp", "llama-cpp-pld"):
            if target.gguf_path is None:
                raise ValueError(f"{name} runs the target's GGUF with llama.cpp: use --backend llama.cpp (or auto) and a GGUF target")
            methods.append(LlamaCppMethod(name, target.gguf_path, eos, threads, target.context_window, name.endswith("pld")))
        elif name.startswith("hf-") and hf_model is None:
            raise ValueError(f"{name} runs transformers: use --backend torch for it")
        elif name == "hf-greedy":
            methods.append(HFMethod(name, hf_model, eos, pad))
        elif name == "hf-assisted":
            model_spec = model_spec_of(default_draft)  # transformers gets the plain model, never our int8 one
            if model_spec is None:
                raise ValueError(f"hf-assisted needs a draft model, but --draft is {default_draft!r}")
            methods.append(HFMethod(name, hf_model, eos, pad, assistant_model=drafter_for(model_spec).model))
            methods[-1].settings["assistant_model"] = model_spec
        elif name == "hf-pld":
            methods.append(HFMethod(name, hf_model, eos, pad, prompt_lookup_num_tokens=HF_PLD_TOKENS))
        else:
            raise ValueError(f"unknown method {name!r}: use plain, spec[:DRAFTER[:K]], hf-greedy, hf-assisted, hf-pld, "
                             "llama-cpp or llama-cpp-pld")
    if len({m.name for m in methods}) != len(methods):
        raise ValueError("each method may be named once")
    return methods
