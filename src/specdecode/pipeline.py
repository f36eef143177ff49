"""Text in, text out: model specs + a prompt -> streamed text and stats."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .drafters import ComboDrafter, Drafter, ModelDrafter, NgramDrafter, SelfDrafter, SuffixDrafter, suffix_available
from .drafters.quant import fastest_weight_format
from .drafters.spec import DrafterSpec, parse_drafter_spec
from .encoding import encode_prompt, eos_token_ids
from .engine import Generation, SpeculativeEngine
from .sequence import GenerationResult
from .models import DEFAULT_DRAFT, gguf_file, known_vocab_size, load_model, load_tokenizer
from .sampling import SamplingParams
from .stats import GenerationStats
from .stopping import StopCondition


DEFAULT_K = 5  # fixed draft length
DEFAULT_MAX_K = 8  # the most an adaptive controller may draft
# Copied text runs long and lookup drafts cost nothing to make: auto lets them run to twice the model's cap
# (the controller trims them by measured acceptance and verify cost).
AUTO_LOOKUP_STRETCH = 2
DRAFT_HEAD_TOKENS = 32768  # the restricted draft head: ~5x cheaper than Qwen's 151,936-token head
# Runner-up tokens `auto` offers per drafted position (tree leaves, tree.py): with the Qwen pair the target's
# correction is the draft's 2nd choice at ~42 % of rejections and its 3rd at ~8 % more.
AUTO_ALTERNATIVES = 2


def model_spec_of(drafter_spec: str | DrafterSpec) -> str | None:
    """The model a drafter spec drafts with ('auto' -> the default draft, 'auto:M+int8' -> M); None: it has none."""
    spec = parse_drafter_spec(drafter_spec) if isinstance(drafter_spec, str) else drafter_spec
    return (spec.model or DEFAULT_DRAFT) if spec.has_model else None


def adaptive_by_default(spec: str | None) -> bool:
    return parse_drafter_spec(spec).adaptive_by_default


def _shares_vocab(spec: DrafterSpec, model_spec: str, vocab_size: int) -> bool:
    """Whether a built-in draft can serve a target of `vocab_size` tokens, known before its weights load. Plain
    `auto` falls back to its lookup drafter (False); a draft named outright is refused."""
    known = known_vocab_size(model_spec)
    if known is None or known == vocab_size:
        return True
    if spec.kind == "auto" and spec.model is None:
        print(f"[specdecode] auto: {model_spec} does not share the target's vocabulary; drafting with lookups "
              "only (name a draft model with auto:MODEL)", file=sys.stderr)
        return False
    raise ValueError(f"draft model {model_spec!r} has a vocabulary of {known} tokens but the target has "
                     f"{vocab_size}: draft and target must share one tokenizer")


def lookup_drafter(name: str) -> Drafter:
    """'ngram' (prompt lookup), 'suffix' (suffix trees over the prompt, the output and earlier answers), 'lookup'
    (auto's: suffix where arctic-inference is installed, else n-gram)."""
    if name == "ngram" or (name == "lookup" and not suffix_available()):
        return NgramDrafter()
    return SuffixDrafter()


def _auto(spec: DrafterSpec, model: Drafter) -> Drafter:
    if spec.kind != "auto":
        return model
    return ComboDrafter(model, lookup_drafter("lookup"), lookup_stretch=AUTO_LOOKUP_STRETCH)


def make_drafter(spec: str | None, dtype=None, tokenizer=None, target=None, compile_draft: bool = False) -> Drafter | None:
    """A drafter from a spec (drafters/spec.py) for a transformers target:
    - 'MODEL[+int8|+int4][+head][+compile][+altN]': a draft model, optionally with packed weights, a restricted
      head, a compiled one-token step and N runner-up tokens per position verified as tree leaves;
    - 'auto[:MODEL]': a lookup where the context matches, else MODEL with the weight format (int4, int8 or its own)
      whose one-row step measures fastest here, a restricted head, 2 runner-ups per position, and with compile_draft
      a compiled step (it costs about a minute at start); 'auto:MODEL+OPTIONS' takes exactly those options.
    """
    parsed = parse_drafter_spec(spec)
    if parsed.kind == "none":
        return None
    if parsed.kind == "lookup":
        return lookup_drafter(parsed.lookup)
    if parsed.kind == "self":
        if target is None:
            raise ValueError("the 'self' drafter needs the target model")
        return SelfDrafter(target, parsed.layers, tokenizer)
    model_spec = model_spec_of(parsed)
    if target is not None and not _shares_vocab(parsed, model_spec, target.config.vocab_size):
        return lookup_drafter("lookup")
    options, alternatives = parsed.options, parsed.alternatives
    measure_format = parsed.kind == "auto" and not parsed.explicit
    if measure_format:
        options, alternatives = {"head"} | ({"compile"} if compile_draft else set()), AUTO_ALTERNATIVES
    model, draft_tokenizer = load_model(model_spec, dtype=dtype)
    quant = fastest_weight_format(model) if measure_format else parsed.quant  # the fastest one-row step here
    drafter = ModelDrafter(
        model,
        draft_tokenizer,
        name=model_spec if parsed.text == "auto" else parsed.text.removeprefix("auto:"),
        quant=quant,
        head_tokens=DRAFT_HEAD_TOKENS if "head" in options else None,
        compile="compile" in options,
        alternatives=alternatives,
    )
    return _auto(parsed, drafter)


def make_llama_drafter(spec: str | None, target, threads: int | None = None) -> Drafter | None:
    """A drafter for a llama.cpp target (a LlamaCppBackend): 'none', a lookup, 'MODEL' (its GGUF in a second
    llama.cpp context) or 'auto[:MODEL]' (a lookup where the context matches, else MODEL)."""
    from .backends.llamacpp import LlamaCppBackend
    from .drafters.llama import LlamaDrafter

    parsed = parse_drafter_spec(spec)
    if parsed.kind == "none":
        return None
    if parsed.kind == "lookup":
        return lookup_drafter(parsed.lookup)
    if parsed.kind == "self":
        raise ValueError("self-speculation (the target's first layers) runs on the torch backend only: use --backend torch")
    if parsed.explicit:
        raise ValueError(f"draft options in {spec!r} (+int8, +int4, +head, +compile, +altN) are the torch backend's: on "
                         "llama.cpp a draft model runs its GGUF as it is (use --backend torch for them)")
    model_spec = model_spec_of(parsed)
    if not _shares_vocab(parsed, model_spec, target.vocab_size):
        return lookup_drafter("lookup")
    path = gguf_file(model_spec)
    if path is None:
        raise ValueError(f"a draft model on llama.cpp is a GGUF file or a built-in name, not {model_spec!r}")
    return _auto(parsed, LlamaDrafter(LlamaCppBackend(path, threads=threads, prefix_cache=False), name=model_spec))


def load_components(target: str, draft: str | None, *, dtype=None, k: int | None = None, adaptive: bool | None = None,
                    threads: int | None = None, compile_draft: bool = False, backend: str = "auto", max_rows: int = 1,
                    prefix_cache: bool = True):
    """(target, tokenizer, drafter, k, adaptive) from specs. The target is a transformers model (torch backend) or
    a LlamaCppBackend holding up to `max_rows` rows; backend 'auto' picks (see backends.choose_backend).
    adaptive=None: see adaptive_by_default; k=None: 5 fixed, at most 8 adaptive."""
    from .backends import choose_backend

    adaptive = adaptive_by_default(draft) if adaptive is None else adaptive
    k = k or (DEFAULT_MAX_K if adaptive else DEFAULT_K)
    if choose_backend(backend, target) == "llama.cpp":
        from .backends.llamacpp import LlamaCppBackend

        # torch only samples and compares logits here: its idle worker threads would spin beside llama.cpp's.
        torch.set_num_threads(1)
        tokenizer = load_tokenizer(target)
        model = LlamaCppBackend(gguf_file(target), threads=threads, max_rows=max_rows, prefix_cache=prefix_cache)
        return model, tokenizer, make_llama_drafter(draft, model, threads), k, adaptive
    if threads:
        torch.set_num_threads(threads)
    model, tokenizer = load_model(target, dtype=dtype)
    drafter = make_drafter(draft, dtype=dtype, tokenizer=tokenizer, target=model, compile_draft=compile_draft)
    return model, tokenizer, drafter, k, adaptive


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats

    def to_dict(self) -> dict:
        return dict(text=self.text, token_ids=self.token_ids, finish_reason=self.finish_reason, stats=self.stats.to_dict())


class TextStream:
    """Token ids -> text pieces as a generation grows. Never shows text it would later take back: an
    incomplete UTF-8 character, or the start of what may turn into a stop string, is held until settled."""

    def __init__(self, tokenizer, stop: StopCondition, result: GenerationResult):
        self._tokenizer, self._stop, self._result = tokenizer, stop, result
        self._emitted = 0
        self._hold = max((len(s) for s in stop.stop_strings), default=1) - 1

    def text(self) -> str:
        return self._stop.trim_text(self._tokenizer.decode(self._result.token_ids, skip_special_tokens=True))

    def piece(self) -> str:
        """The text that became safe to show since the last call ('' if none); all of it once finished."""
        text = self.text()
        if self._result.finish_reason is None:
            text = text[: len(text) - self._hold] if self._hold else text
            if text.endswith("\ufffd"):
                return ""
        if len(text) <= self._emitted:
            return ""
        piece, self._emitted = text[self._emitted :], len(text)
        return piece


class TextGeneration:
    """Iterate for text pieces as tokens are accepted; `result()` for the whole completion."""

    def __init__(self, generation: Generation, tokenizer, stop: StopCondition):
        self._tokens, self._result = iter(generation), generation.partial
        self._stream = TextStream(tokenizer, stop, self._result)

    def __iter__(self) -> Iterator[str]:
        for _ in self._tokens:
            piece = self._stream.piece()
            if piece:
                yield piece
        piece = self._stream.piece()
        if piece:
            yield piece

    def result(self) -> Completion:
        for _ in self:
            pass
        return Completion(self._stream.text(), list(self._result.token_ids), self._result.finish_reason, self._result.stats)


class SpecDecoder:
    """The high-level object: `SpecDecoder.from_specs("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")`."""

    def __init__(self, target, tokenizer, drafter: Drafter | None = None, k: int = 5, adaptive: bool = False):
        self.target, self.tokenizer = target, tokenizer
        self.engine = SpeculativeEngine(target, drafter, tokenizer=tokenizer, k=k, adaptive=adaptive)
        self.eos = eos_token_ids(target, tokenizer)

    @classmethod
    def from_specs(
        cls, target: str, draft: str | None = None, *, dtype=None, k: int | None = None, adaptive: bool | None = None,
        threads: int | None = None, compile_draft: bool = False, backend: str = "auto",
    ):
        """adaptive=None: see adaptive_by_default; k=None: 5 fixed, at most 8 adaptive;
        compile_draft: `auto` compiles its draft model's step (see `make_drafter`); backend: auto, torch or
        llama.cpp (see backends.choose_backend)."""
        model, tokenizer, drafter, k, adaptive = load_components(
            target, draft, dtype=dtype, k=k, adaptive=adaptive, threads=threads, compile_draft=compile_draft,
            backend=backend)
        return cls(model, tokenizer, drafter, k=k, adaptive=adaptive)

    @property
    def drafter(self) -> Drafter | None:
        return self.engine.drafter

    def encode(self, prompt: str | list[dict], chat: bool = False) -> torch.Tensor:
        """A prompt string (or chat messages) -> input_ids [1, L]; chat applies the model's template."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def stream(
        self,
        prompt: str | list[dict],
        *,
        chat: bool = False,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: tuple[str, ...] | list[str] = (),
        k: int | None = None,
        speculate: bool = True,
    ) -> TextGeneration:
        """Start a generation; iterate the result for text pieces. speculate=False is plain decoding."""
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        stop_condition = StopCondition(self.eos, tuple(stop), self.tokenizer)
        input_ids = self.encode(prompt, chat=chat)
        generation = self.engine.generate(
            input_ids, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop_condition, k=k, speculate=speculate
        )
        return TextGeneration(generation, self.tokenizer, stop_condition)

    def generate(self, prompt: str | list[dict], **kwargs) -> Completion:
        return self.stream(prompt, **kwargs).result()
