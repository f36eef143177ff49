"""Suffix decoding: drafts from suffix trees over the prompt, the text so far and (shared) earlier answers.

Arctic Inference's `SuffixDecodingCache` keeps one tree per running request (its prompt and output) and one over
earlier responses; a draft follows the longest match of the text's suffix, frequency-weighted, and stops where a
branch's estimated probability falls under a floor, so a weak match drafts little. Costs no model pass.
Its tree becomes a chain (the most frequent path) and, at each position, the other branches as one-token leaves
(tree.py's layout; a backend that scores no trees verifies the chain alone).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from .base import Draft, Drafter

try:
    from arctic_inference.suffix_decoding import SuffixDecodingCache
except ImportError:  # the optional `suffix` extra (scripts/build-arctic-inference.sh)
    SuffixDecodingCache = None

# The longest match plus draft the trees hold: a match of m tokens continues at most MAX_TREE_DEPTH - m, so at 64 a
# copy drafted at most 32 (replayed with measurements.CopyRate: 128 gains 1 % on code edits, 4-5 % on agent traffic;
# a draft costs ~40 us more)
MAX_TREE_DEPTH = 128
MIN_TOKEN_PROB = 0.1  # a branch whose estimated probability falls below this ends the draft
MAX_SPEC_FACTOR = 1.0  # a match of n tokens drafts at most n tokens (+ MAX_SPEC_OFFSET): a short match is weak
MAX_SPEC_OFFSET = 0.0
CACHED_RESPONSES = 256  # earlier answers kept for drafting across requests (first in, first out)

_request_ids = itertools.count()


def suffix_available() -> bool:
    return SuffixDecodingCache is not None


def shared_cache(max_cached_requests: int = CACHED_RESPONSES):
    """One cache for every drafter spawned from the same root: rows of a server draft from each other's answers."""
    if SuffixDecodingCache is None:
        raise ValueError(
            "the suffix drafter needs arctic-inference (its suffix trees are compiled): run `make setup`, or "
            "scripts/build-arctic-inference.sh, which builds it from its sdist"
        )
    return SuffixDecodingCache(max_tree_depth=MAX_TREE_DEPTH, max_cached_requests=max_cached_requests)


class SuffixDrafter(Drafter):
    name = "suffix"
    free = True

    def __init__(self, cache=None, alternatives: int = 2, min_token_prob: float = MIN_TOKEN_PROB):
        if not isinstance(alternatives, int) or alternatives < 0:
            raise ValueError(f"alternatives must be an integer >= 0, got {alternatives!r}")
        self.cache = cache if cache is not None else shared_cache()
        self.alternatives, self.min_token_prob = alternatives, min_token_prob
        self.request = None  # this drafter's request id in the cache (None: no sequence started)
        self.seen = 0  # committed tokens the cache holds for it

    def spawn(self) -> "SuffixDrafter":
        return SuffixDrafter(self.cache, self.alternatives, self.min_token_prob)

    def reset(self) -> None:
        if self.request is not None:
            self.cache.stop_request(self.request)  # its answer stays in the shared tree for later requests
        self.request, self.seen = None, 0

    def begin(self, prompt_ids: torch.Tensor) -> None:
        self.reset()
        self.request = next(_request_ids)
        self.cache.start_request(self.request, _int32(prompt_ids[0]))
        self.seen = prompt_ids.shape[1]

    def commit(self, input_ids: torch.Tensor) -> None:
        if self.request is None:
            self.begin(input_ids)
        elif input_ids.shape[1] > self.seen:
            self.cache.add_active_response(self.request, _int32(input_ids[0, self.seen :]))
            self.seen = input_ids.shape[1]

    def propose(self, input_ids, k, sampling, draws, keep_going=None) -> Draft:
        self.commit(input_ids)  # a sequence the engine did not begin (its first propose) starts here
        # The tree grows best-first by estimated probability: room for the chain's branches as well as the chain.
        room = 1 + self.alternatives
        found = self.cache.speculate(
            self.request, _int32(input_ids[0, -MAX_TREE_DEPTH:]), max_spec_tokens=k * room,
            max_spec_factor=MAX_SPEC_FACTOR * room, max_spec_offset=MAX_SPEC_OFFSET * room,
            min_token_prob=self.min_token_prob, use_tree_spec=bool(self.alternatives),
        )
        if not found.token_ids:
            return Draft.empty(1, input_ids.device)
        chain, siblings = best_chain(found.token_ids, found.parents, found.probs)
        keep = min(k, int(found.match_len * MAX_SPEC_FACTOR + MAX_SPEC_OFFSET)) or 1
        chain, siblings = chain[:keep], siblings[:keep]
        draft = Draft(torch.tensor([chain]), source=self.name, match_len=found.match_len)
        if self.alternatives and any(siblings):
            rows = [(s[: self.alternatives] + [-1] * self.alternatives)[: self.alternatives] for s in siblings]
            draft.alternatives = torch.tensor([rows])
        return draft

    def propose_free(self, input_ids, k) -> Draft:
        return self.propose(input_ids, k, None, None)


def best_chain(tokens: list[int], parents: list[int], probs: list[float]) -> tuple[list[int], list[list[int]]]:
    """A draft tree (node i: tokens[i], child of node parents[i], -1: the root) -> its most probable path from the
    root, and at each of its positions the other children of the same parent, most probable first."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    chain, siblings, parent = [], [], -1
    while parent in children:
        ranked = sorted(children[parent], key=lambda node: -probs[node])
        chain.append(tokens[ranked[0]])
        siblings.append([tokens[node] for node in ranked[1:]])
        parent = ranked[0]
    return chain, siblings


def _int32(ids: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(ids.numpy().astype(np.int32))
