"""Text in, text out: model specs + a prompt -> streamed text and stats."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .drafters import Drafter
from .drafters.factory import adaptive_by_default
from .encoding import encode_prompt, eos_token_ids
from .engine import Generation, SpeculativeEngine
from .sequence import GenerationResult
from .sampling import SamplingParams
from .stats import GenerationStats
from .stopping import StopCondition


DEFAULT_K = 5  # fixed draft length
DEFAULT_MAX_K = 8  # the most an adaptive controller may draft
def load_components(target: str, draft: str | None, *, dtype=None, k: int | None = None, adaptive: bool | None = None,
                    threads: int | None = None, compile_draft: bool = False, backend: str = "auto", max_rows: int = 1,
                    prefix_cache: bool = True, prefix_cache_tokens: int | None = None):
    """(target Backend, tokenizer, drafter, k, adaptive) from specs; backend 'auto' picks (backends.choose_backend)
    and the backend builds the drafter for itself. adaptive=None: see adaptive_by_default; k=None: 5 fixed, at most 8
    adaptive."""
    from .backends import load_target

    adaptive = adaptive_by_default(draft) if adaptive is None else adaptive
    k = k or (DEFAULT_MAX_K if adaptive else DEFAULT_K)
    model, tokenizer = load_target(target, backend, dtype=dtype, threads=threads, max_rows=max_rows,
                                   prefix_cache=prefix_cache, prefix_cache_tokens=prefix_cache_tokens)
    drafter = model.make_drafter(draft, dtype=dtype, tokenizer=tokenizer, compile_draft=compile_draft, threads=threads)
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
    incomplete UTF-8 character, or the start of what may turn into a stop string, is held until settled.

    Decodes incrementally (as vLLM and TGI do): each call decodes only the tokens since the last settled point, with
    the tokens before it as context, so a step costs the same at token 10 and token 10,000."""

    def __init__(self, tokenizer, stop: StopCondition, result: GenerationResult):
        self._tokenizer, self._stop, self._result = tokenizer, stop, result
        self._emitted = 0  # characters of the settled text already shown
        self._hold = max((len(s) for s in stop.stop_strings), default=1) - 1
        self._settled = ""  # the decoded text of token_ids[:self._read_at]
        self._context_at = self._read_at = 0  # token_ids[context_at:read_at] decode to the end of `_settled`

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _settle(self) -> None:
        """Append the text of the new tokens, unless it ends inside a character (then wait for more, or the end)."""
        ids = self._result.token_ids
        if len(ids) <= self._read_at:
            return
        context = self._decode(ids[self._context_at : self._read_at])
        grown = self._decode(ids[self._context_at :])
        if len(grown) > len(context) and (not grown.endswith("\ufffd") or self._result.finish_reason is not None):
            self._settled += grown[len(context) :]
            self._context_at, self._read_at = self._read_at, len(ids)

    def text(self) -> str:
        self._settle()
        return self._stop.trim_text(self._settled)

    def piece(self) -> str:
        """The text that became safe to show since the last call ('' if none); all of it once finished."""
        text = self.text()
        if self._result.finish_reason is None and self._hold:
            text = text[: len(text) - self._hold]
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
    """The high-level object: `SpecDecoder.from_specs("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")`. target: a Backend
    or a transformers model."""

    def __init__(self, target, tokenizer, drafter: Drafter | None = None, k: int = 5, adaptive: bool = False):
        self.tokenizer = tokenizer
        self.engine = SpeculativeEngine(target, drafter, tokenizer=tokenizer, k=k, adaptive=adaptive)
        self.eos = eos_token_ids(self.engine.backend, tokenizer)

    @classmethod
    def from_specs(
        cls, target: str, draft: str | None = None, *, dtype=None, k: int | None = None, adaptive: bool | None = None,
        threads: int | None = None, compile_draft: bool = False, backend: str = "auto", max_rows: int = 1,
    ):
        """adaptive=None: see adaptive_by_default; k=None: 5 fixed, at most 8 adaptive;
        compile_draft: `auto` compiles its draft model's step (see `make_drafter`); backend: auto, torch or
        llama.cpp (see backends.choose_backend); max_rows: rows the target holds side by side (a llama.cpp context
        sized for them; torch holds as many as memory allows), for batches run on `engine.backend`."""
        model, tokenizer, drafter, k, adaptive = load_components(
            target, draft, dtype=dtype, k=k, adaptive=adaptive, threads=threads, compile_draft=compile_draft,
            backend=backend, max_rows=max_rows)
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
