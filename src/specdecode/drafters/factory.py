"""Drafters from specs (drafters/spec.py), for a transformers target (`make_drafter`) or a llama.cpp one
(`make_llama_drafter`); a backend picks its own (`Backend.make_drafter`)."""

from __future__ import annotations

import sys

from ..backends.quant import fastest_weight_format
from ..models import DEFAULT_DRAFT, gguf_file, known_vocab_size, load_model
from .base import Drafter
from .combo import ComboDrafter
from .early_exit import SelfDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter
from .spec import DrafterSpec, parse_drafter_spec
from .suffix import SuffixDrafter, suffix_available

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


def _without_model(spec: DrafterSpec) -> Drafter | None:
    """What 'none' and the lookups are on any backend: no drafter, or a drafter that runs no model."""
    return lookup_drafter(spec.lookup) if spec.kind == "lookup" else None


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
    if parsed.kind in ("none", "lookup"):
        return _without_model(parsed)
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
    from ..backends.llamacpp import LlamaCppBackend

    parsed = parse_drafter_spec(spec)
    if parsed.kind in ("none", "lookup"):
        return _without_model(parsed)
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
    return _auto(parsed, ModelDrafter(LlamaCppBackend(path, threads=threads, prefix_cache=False), name=model_spec))


