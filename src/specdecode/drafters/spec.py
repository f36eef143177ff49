"""Drafter specs, parsed in one place: what a user writes after --draft, as a typed object.

    none | ngram | suffix | lookup        no drafter; drafts that cost no model pass
    self[:L]                             the target's own first L layers (calibrated when L is not given)
    MODEL[+int8|+int4][+head][+compile][+altN]
    auto[:MODEL[+OPTIONS]]               a lookup where the context matches, else MODEL
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

LOOKUPS = ("ngram", "suffix", "lookup")
MODEL_OPTIONS = ("int8", "int4", "head", "compile")


@dataclass(frozen=True)
class DrafterSpec:
    text: str  # as written
    kind: str  # "none", "lookup", "self", "model" or "auto"
    lookup: str | None = None  # for kind "lookup": ngram, suffix or lookup
    layers: int | None = None  # for kind "self": None calibrates
    model: str | None = None  # the draft model (kind "model" or "auto"; None for plain `auto`: the default pair's)
    options: frozenset[str] = field(default_factory=frozenset)  # int8 / int4 / head / compile given
    alternatives: int = 0  # +altN
    explicit: bool = False  # options were written out (auto:MODEL+OPTIONS takes exactly those: an ablation)

    @property
    def quant(self) -> str | None:
        return next(iter(self.options & {"int8", "int4"}), None)

    @property
    def uses_lookups(self) -> bool:
        return self.kind in ("lookup", "auto")

    @property
    def has_model(self) -> bool:
        return self.kind in ("model", "auto")

    @property
    def adaptive_by_default(self) -> bool:
        """The controller is on by default for `auto` and for the lookups it prices by measured gain (suffix, lookup);
        `ngram` alone stays the classic fixed-k prompt lookup."""
        return self.kind == "auto" or (self.kind == "lookup" and self.lookup != "ngram")


def parse_drafter_spec(text: str | None) -> DrafterSpec:
    """Raises ValueError naming what is wrong."""
    if text in (None, "", "none"):
        return DrafterSpec(text or "none", "none")
    if text in LOOKUPS:
        return DrafterSpec(text, "lookup", lookup=text)
    if text == "self" or text.startswith("self:"):
        layers = text.partition(":")[2]
        if layers and not layers.isdigit():
            raise ValueError(f"'self:L' takes a number of layers, got {text!r}")
        return DrafterSpec(text, "self", layers=int(layers) if layers else None)
    auto = text == "auto" or text.startswith("auto:")
    body = text.removeprefix("auto").removeprefix(":") if auto else text
    model, *written = body.split("+") if body else [None]
    if not auto and not model:
        raise ValueError(f"no draft model named in {text!r}")
    options = set(written)
    alternatives = [o for o in options if re.fullmatch(r"alt[0-9]+", o)]
    unknown = options - set(MODEL_OPTIONS) - set(alternatives)
    if unknown:
        raise ValueError(f"unknown draft option(s) {sorted(unknown)} in {text!r}: use +int8 or +int4, +head, +compile, "
                         "+altN (any of them)")
    if len(alternatives) > 1:
        raise ValueError(f"{text!r} gives the number of alternatives twice ({sorted(alternatives)}): pick one")
    if {"int8", "int4"} <= options:
        raise ValueError(f"{text!r} asks for both +int8 and +int4: pick one")
    return DrafterSpec(text, "auto" if auto else "model", model=model or None,
                       options=frozenset(options - set(alternatives)),
                       alternatives=int(alternatives[0][3:]) if alternatives else 0, explicit=bool(written))
