"""The prompt-prefix cache's bookkeeping: which token prefixes a backend still holds K/V for, least recently used
first out. The backend owns the K/V (llama.cpp: the row's cells copied out to host memory; torch: the row's
tensors); this class only says what each entry holds, which entry serves a prompt best, and which to evict."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable

import numpy as np


@dataclass
class PrefixStats:
    lookups: int = 0  # rows opened with a prompt
    hits: int = 0  # of them, rows started from a cached prefix
    cached_tokens: int = 0  # prompt tokens those rows did not read
    evictions: int = 0  # entries evicted, least recently used first
    shared_running: int = 0  # rows started from the cells of a running row or one being read instead (llama.cpp)
    restore_failures: int = 0  # entries found with no free cells to go back into (llama.cpp): the prompt was read whole


def common_prefix(a, b) -> int:
    """Length of the shared prefix of two token sequences (arrays, CPU tensors or lists)."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


# Shorter shared prefixes are read again: they save next to nothing, and on llama.cpp a read of a few tokens runs other
# kernels than a long one (logits 0.58 apart on SmolLM2's GGUF after a 2-token split; none after a 70-token one).
MIN_SHARED = 16


def longest_shared(held: Iterable[tuple[Hashable, np.ndarray | list[int]]],
                   prompt: np.ndarray) -> tuple[Hashable | None, int]:
    """Of (key, tokens) pairs, the key whose tokens share the longest prefix with the prompt, and how many tokens, at
    most all but the prompt's last (whose logits the reader must compute). (None, 0) when none shares MIN_SHARED."""
    best, best_len = None, 0
    for key, tokens in held:
        n = common_prefix(tokens, prompt)
        if n > best_len:
            best, best_len = key, n
    best_len = min(best_len, len(prompt) - 1)
    if best is None or best_len < MIN_SHARED:
        return None, 0
    return best, best_len


class PrefixCache:
    """Entries key -> the tokens whose K/V the backend holds for it (positions 0..n-1). Bounded by `max_entries` and,
    where the backend cannot count its memory itself, by `max_tokens` in all."""

    def __init__(self, max_entries: int, max_tokens: int | None = None):
        if max_entries < 1:
            raise ValueError(f"a prefix cache holds at least one entry, got max_entries={max_entries}")
        self.max_entries, self.max_tokens = max_entries, max_tokens
        self.entries: OrderedDict[Hashable, np.ndarray] = OrderedDict()  # least recently used first
        self.stats = PrefixStats()

    @property
    def tokens(self) -> int:
        return sum(len(tokens) for tokens in self.entries.values())

    def find(self, prompt: list[int] | np.ndarray, at_least: int = 0) -> tuple[Hashable | None, int]:
        """The entry sharing the longest prefix with the prompt, and how many tokens it shares, at most all but the
        prompt's last (whose logits the reader must compute). (None, 0) when none shares MIN_SHARED tokens, or
        `at_least` (what the backend holds elsewhere)."""
        self.stats.lookups += 1
        best, best_len = self._longest(np.asarray(prompt))
        if best is None or best_len < at_least:
            return None, 0
        self.entries.move_to_end(best)
        self.stats.hits += 1
        self.stats.cached_tokens += best_len
        return best, best_len

    def unserved(self, shared: int) -> None:
        """The entry `find` chose could not be put back: the row reads its prompt whole."""
        self.stats.hits -= 1
        self.stats.cached_tokens -= shared
        self.stats.restore_failures += 1

    def shared(self, prompt: list[int] | np.ndarray) -> int:
        """The tokens `find` would serve the prompt now, without using the entry (for choosing whom to read next)."""
        return self._longest(np.asarray(prompt))[1]

    def _longest(self, prompt: np.ndarray) -> tuple[Hashable | None, int]:
        return longest_shared(self.entries.items(), prompt)

    def add(self, key: Hashable, tokens: list[int] | np.ndarray) -> list[Hashable]:
        """Hold `tokens` under `key` (the most recently used); returns the keys the backend must now free: entries
        evicted for room or made redundant (their tokens are a prefix of these), or `key` itself when an entry holds
        these tokens already or they alone exceed max_tokens."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if self.max_tokens is not None and len(tokens) > self.max_tokens:
            return [key]
        evicted = []
        for old, held in list(self.entries.items()):
            shared = common_prefix(held, tokens)
            if shared == len(tokens):  # an entry holds all of it already (the same prompt asked again)
                self.entries.move_to_end(old)
                return [key, *evicted]
            if shared == len(held):  # it extends an entry (the next turn of a conversation): the entry is redundant
                del self.entries[old]
                evicted.append(old)
        self.entries[key] = tokens
        while len(self.entries) > self.max_entries or (self.max_tokens is not None and self.tokens > self.max_tokens):
            evicted.append(self.pop_oldest())
        return evicted

    def pop_oldest(self) -> Hashable | None:
        """Evict the least recently used entry; returns its key (None: empty)."""
        if not self.entries:
            return None
        key, _ = self.entries.popitem(last=False)
        self.stats.evictions += 1
        return key
