"""The model-backend protocol: everything the engine needs from a target model, and nothing more.

A backend holds the K/V cache of every row (a sequence decoded in the batch). Rows are numbered
0..rows-1 in the order they joined; removing rows renumbers the rest in order. The engine keeps the
invariant that a row's cache holds every committed token but the last, which it feeds at the next pass.

A pass feeds each row a few inputs: [last committed token] + its draft (+ tree leaves). Input j of row b
stands at position `length(b) + offsets[b, j]` and attends the row's cache and the inputs of this pass
that `visibility[b, j]` marks (default: a causal chain). After the pass `keep` says, per row, which of
its inputs stay in its cache, in order, as its next positions: a prefix for a chain (a rollback of the
rejected tokens), a prefix plus a leaf for a tree (the leaf's K/V move to the slot it stood for).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Hashable, Iterator, Protocol

import torch

from .prefix import PrefixCache, longest_shared

if TYPE_CHECKING:
    from ..drafters.base import Drafter


class BackendError(RuntimeError):
    """A backend cannot do what was asked (missing dependency, unsupported model or feature)."""


class DraftModel(Protocol):
    """A model run as one row: what a draft model needs of a backend (drafters.model.ModelDrafter). A Backend holding
    one row is one; `twin` gives another row on the same weights (a batch's rows draft side by side)."""

    vocab_size: int
    model_name: str

    @property
    def rows(self) -> int: ...

    def add_row(self, prompt: torch.Tensor) -> torch.Tensor: ...

    def extend(self, row: int, tokens: torch.Tensor) -> torch.Tensor: ...

    def truncate(self, row: int, length: int) -> None: ...

    def clear(self) -> None: ...

    def twin(self) -> "DraftModel": ...


class Backend(ABC):
    name: str = "backend"
    vocab_size: int
    context_window: int | None = None  # the most positions a row may hold (None: the model does not say)
    eos_token_ids: frozenset[int] = frozenset()
    # Scores passes whose inputs attend by an explicit visibility (tree leaves); False: chains only.
    supports_tree: bool = False
    max_rows: int | None = None  # rows it can hold side by side (None: as many as memory allows)
    prefix_cache: PrefixCache | None = None  # K/V of finished rows kept for later prompts (None: none kept)
    # Its pass can also read prompt chunks of rows being read (forward_reading); False: the engine reads them alone.
    reads_in_pass: bool = False
    pass_tokens: int | None = None  # the most tokens one pass takes, rows' inputs and chunks together (None: no bound)
    # `forward(..., pad_to=n)` runs a one-row pass at n positions, the extra ones asking for no logits and dropped at
    # `keep`: where a wider pass measures cheaper (llama.cpp's matmuls run whole tiles of positions)
    pads_passes: bool = False
    # A row opened now starts from the K/V of a running row, or of one being read, that hold a prefix of its prompt:
    # a prompt that shares a prefix with one being read reads less if opened after that reading.
    shares_rows: bool = False

    @property
    def near_tie_gap(self) -> float:
        """Below this top-2 logit gap, a wide pass and a one-token pass may pick different tokens by rounding alone."""
        return 1e-3

    def describe(self) -> str:
        return self.name

    @property
    def model_name(self) -> str:
        """The model it runs, for drafters and reports."""
        return self.name

    def twin(self) -> "Backend":
        """A backend of its own on the same weights, empty (a draft model's second row: see DraftModel)."""
        raise BackendError(f"the {self.name} backend cannot run a second context on its weights")

    @property
    def device(self) -> str:
        """Where its passes run."""
        return "cpu"

    @property
    def hf_model(self):
        """The transformers model it runs (None: it runs none): transformers' own baselines and self-drafting need it."""
        return None

    @property
    def gguf_path(self) -> Path | None:
        """The GGUF file it runs (None: none): llama.cpp's own baselines need it."""
        return None

    def build_info(self) -> str | None:
        """What its kernels were built for (for benchmark reports; None: nothing to add)."""
        return None

    @abstractmethod
    def make_drafter(self, spec: str | None, *, dtype=None, tokenizer=None, compile_draft: bool = False,
                     threads: int | None = None) -> Drafter | None:
        """A drafter for this target from a drafter spec (drafters/spec.py): draft models run as this backend runs."""

    @property
    @abstractmethod
    def rows(self) -> int:
        """Rows in the batch now."""

    @abstractmethod
    def length(self, row: int) -> int:
        """Positions the row's cache holds."""

    @abstractmethod
    def open_row(self, prompt: torch.Tensor | None = None) -> "RowReader":
        """A new row, read chunk by chunk between passes (a long prompt then never stalls the other rows for its
        whole reading); it joins the batch as the last row when `join`ed. Passes do not see it before.
        prompt [1, L]: what the row will read; with a prefix cache the row starts from the longest prefix of it held
        (`reader.cached` positions are in place: read prompt[:, reader.cached:])."""

    def to_read(self, prompt: torch.Tensor) -> int:
        """Tokens of a prompt [1, L] a row opened now would read (what the prefix cache, or where `shares_rows` a row,
        holds of it is not read)."""
        if self.prefix_cache is None:
            return prompt.shape[1]
        tokens = prompt[0].numpy()
        held = longest_shared(self._held(), tokens)[1] if self.shares_rows else 0
        return prompt.shape[1] - max(self.prefix_cache.shared(tokens), held)

    def _start_from(self, tokens) -> tuple[int | None, int, Hashable, int]:
        """Where a new row for a prompt's tokens starts (a prefix cache on): (the cache entry holding more of it than any
        row, and how much; else None) and (the row or reader holding the most of it, and how much)."""
        source, held = longest_shared(self._held(), tokens)
        entry, shared = self.prefix_cache.find(tokens, at_least=held)
        return entry, shared, source, held

    def _held(self) -> Iterator[tuple[Hashable, list[int]]]:
        """(key, the tokens it holds) of each row and row being read whose K/V a new row can start from."""
        return iter(())

    def drop_cached_prefixes(self) -> None:
        """Forget every cached prefix (a benchmark starts each prompt cold)."""

    def add_row(self, prompt: torch.Tensor) -> torch.Tensor:
        """Read a prompt [1, L] into a new last row; returns the logits after its last token [1, V] (fp32, CPU).
        On failure (out of memory, say) no row is added and the others are untouched."""
        reader = self.open_row(prompt)
        try:
            logits = reader.read(prompt[:, reader.cached :])
        except BaseException:
            reader.discard()
            raise
        reader.join()
        return logits

    @abstractmethod
    def forward(
        self, tokens: torch.Tensor, widths: list[int], offsets: torch.Tensor | None = None,
        visibility: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One pass over all rows. tokens [B, W] (row b's inputs are its first widths[b]; the rest is padding),
        offsets [B, W] (default: 0..W-1), visibility [B, W, W] bool (default: causal). Returns fp32 logits [B, W, V]
        where the model runs (`device`): the engine judges greedy rows there and moves only their [B] verdicts. They may
        be the backend's own buffer, valid until its next pass (llama.cpp's). The pass's K/V stay pending until `keep`."""

    def forward_reading(
        self, reads: list[tuple["RowReader", torch.Tensor]], tokens: torch.Tensor, widths: list[int],
        offsets: torch.Tensor | None = None, visibility: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list["torch.Tensor | Exception"]]:
        """`forward` whose pass also reads each (reader, chunk [1, n]) (where `reads_in_pass`: one pass instead of a
        pass per chunk beside the rows'). Returns the rows' logits as `forward` does and each read's outcome: the
        logits after its last token [1, V], or the exception that failed it; a failed read leaves its reader as it
        was and fails nothing else."""
        raise BackendError(f"the {self.name} backend reads prompts apart from its passes")

    @abstractmethod
    def keep(self, kept: list[list[int]]) -> None:
        """After `forward`: row b keeps its inputs kept[b] (indices into the pass, increasing, starting with 0) as
        its next len(kept[b]) positions; every other input of the pass is forgotten."""

    def extend(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [1, n] to a row's cache (no pass pending) -> the logits after the last [1, V] (fp32, CPU).
        This default serves a backend holding that one row (a draft model's)."""
        if self.rows != 1 or row != 0:
            raise BackendError(f"{self.name} extends a row only where it holds that one row")
        logits = self.forward(tokens, [tokens.shape[1]])
        self.keep([list(range(tokens.shape[1]))])
        return logits[:, -1].cpu()

    @abstractmethod
    def truncate(self, row: int, length: int) -> None:
        """Forget the row's positions from `length` on (no pass pending)."""

    @abstractmethod
    def remove_rows(self, rows: list[int]) -> None:
        """Drop these rows (their cache is freed); the others keep their order."""

    def clear(self) -> None:
        """Drop every row."""
        self.remove_rows(list(range(self.rows)))

    def check_visibility(self, visibility: torch.Tensor | None) -> None:
        if visibility is not None and not self.supports_tree:
            raise BackendError(f"the {self.name} backend verifies chains only (no tree leaves)")


class RowReader(ABC):
    """A row being read before it joins the batch (Backend.open_row)."""

    cached: int = 0  # prompt positions it started with, from the prefix cache

    @abstractmethod
    def read(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [1, n] to the row -> the logits after the last [1, V] (fp32, CPU). On failure the row is
        as it was before this call."""

    @abstractmethod
    def join(self) -> None:
        """The row joins the batch as its last row (what it read is its cache)."""

    @abstractmethod
    def discard(self) -> None:
        """Forget the row (its request was cancelled or failed)."""


def read_each(reads: list[tuple[RowReader, torch.Tensor]]) -> list["torch.Tensor | Exception"]:
    """Each (reader, chunk) read on its own: the logits after its last token, or the exception that failed it."""
    outcomes: list[torch.Tensor | Exception] = []
    for reader, chunk in reads:
        try:
            outcomes.append(reader.read(chunk))
        except Exception as error:
            outcomes.append(error)
    return outcomes


def chain_offsets(batch: int, width: int) -> torch.Tensor:
    return torch.arange(width).repeat(batch, 1)
