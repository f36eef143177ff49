"""Suffix decoding: drafts from suffix trees over the prompt, the text so far and (shared) earlier answers.

Arctic Inference's `SuffixDecodingCache` keeps one tree per running request (its prompt and output) and one over
earlier responses; a draft follows the longest match of the text's suffix, frequency-weighted, and stops where a
branch's estimated probability falls under a floor, so a weak match drafts little. Costs no model pass.
Its tree becomes a chain (the most frequent path) and, at each position, the other branches as one-token leaves
(tree.py's layout; a backend that scores no trees verifies the chain alone).

Long exact copies draft by llama-server's `ngram-mod` rule first (`ContextChains`): where the text's last 24 tokens
occurred before, the token that followed them, chained, up to 64 tokens, offered only when it chains 48. That evidence
is stronger than a suffix match of the same length (the copy runs on for 48 more tokens), so such a draft has its own
source, `suffix/chain`, which the controller prices apart (control/measurements.py).

An answer that rewrites its input (a function edited) copies it in order, leaving it at each edit and coming back a
little further on: `CopyPointer` follows where the copy is, finds it again after an edit on a short match near where it
left, and writes what an edit replaced (a renamed variable) into later drafts from it. Where it runs further than the
tree's match vouches for, its draft goes out as `suffix/copy`, priced apart.

A short match after which the text went on in more than one way ("contested") drafts as `suffix/contested`: its first
token is right far less often than a short match's that went on one way, and the controller prices it apart.

Drafts from answers and earlier requests have sources of their own: `answers` (the tree over answers, earlier ones
and this one so far, scored higher than this request's tree of prompt and answer) and `earlier/chain` (a chain whose
first context another request recorded). A copy of what was answered before is other evidence than a match in this
request's prompt (a question quoted, then left); priced together, a request asked again drafted one token a step after
its first run's prompt copies had failed.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict

import numpy as np
import torch

from .base import CONTESTED, Draft, Drafter

try:
    from arctic_inference.suffix_decoding import SuffixDecodingCache
    from arctic_inference.suffix_decoding._C import SuffixTree
except ImportError:  # the optional `suffix` extra (scripts/build-arctic-inference.sh)
    SuffixDecodingCache = SuffixTree = None

# The longest match plus draft the trees hold: a match of m tokens continues at most MAX_TREE_DEPTH - m, so at 64 a
# copy drafted at most 32 (replayed with measurements.CopyRate: 128 gains 1 % on code edits, 4-5 % on agent traffic;
# a draft costs ~40 us more)
MAX_TREE_DEPTH = 128
MIN_TOKEN_PROB = 0.1  # a branch whose estimated probability falls below this ends the draft
# A match of at most CONTESTED_MATCH tokens after which the text went on differently before (its likeliest next token
# under CONTESTED_PROB; a match seen once scores 0.5, its own occurrence counted) is other evidence than a short match
# that went on one way: its draft's source is refined (base.CONTESTED: "suffix/contested"), priced from a low prior
# (control/priors.py: CONTESTED_ACCEPT) and learned apart
CONTESTED_MATCH, CONTESTED_PROB = 3, 0.5
MAX_SPEC_FACTOR = 1.0  # a match of n tokens drafts at most n tokens (+ MAX_SPEC_OFFSET): a short match is weak
MAX_SPEC_OFFSET = 0.0
CACHED_RESPONSES = 256  # earlier answers kept for drafting across requests (first in, first out)
# Chains (llama-server's `ngram-mod` defaults): a context of 24 tokens; offered at 48 chained, up to 64. Replayed on the
# AMD EPYC AVX-512 pass table, agent traffic decodes 1.44x -> 1.56-1.60x plain with them, code edits 1.38x -> 1.43-1.45x
# (docs/results.md, session 24)
CHAIN_CONTEXT, CHAIN_SHORTEST, CHAIN_LONGEST = 24, 48, 64
CHAIN_CONTEXTS = 1 << 18  # contexts kept across requests (oldest out first): ~50 MB
CHAIN_SOURCE = "suffix/chain"
# The copy an answer makes of its input, followed (`CopyPointer`): found again after an edit on 3 tokens within 96
# ahead of where it left (16 behind), or anywhere on 8; a replacement of up to 8 source tokens by up to 12 is
# remembered. Replayed on the AMD EPYC curve it gains code edits ~4 % and costs fresh text ~2 % (48 Spec-Bench answers;
# docs/results.md, sessions 34-35)
RESYNC, RESYNC_WINDOW, RESYNC_BEHIND, JUMP_MATCH = 3, 96, 16, 8
REPLACED_SOURCE, REPLACED_ANSWER = 8, 12
COPY_SOURCE = "suffix/copy"
# Drafts from the tree over answers, and chains whose first link another request recorded: not refinements of
# "suffix", priced apart from matches in this request's own text
ANSWERS_SOURCE, EARLIER_CHAIN_SOURCE = "answers", "earlier/chain"

_request_ids = itertools.count(1)  # 0: a chain context recorded by no request (ContextChains.add)


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


class ContextChains:
    """The token that followed each `context`-token context seen (the latest occurrence wins) and which request saw it
    there, over every request of the drafters that share it, the oldest contexts dropped past `capacity`; `follow`
    chains them into a draft."""

    def __init__(self, context: int = CHAIN_CONTEXT, shortest: int = CHAIN_SHORTEST, longest: int = CHAIN_LONGEST,
                 capacity: int = CHAIN_CONTEXTS):
        if not (context >= 1 and 1 <= shortest <= longest):
            raise ValueError(f"need context >= 1 and 1 <= shortest <= longest, got {context}, {shortest}, {longest}")
        self.context, self.shortest, self.longest, self.capacity = context, shortest, longest, capacity
        self.next: OrderedDict[bytes, int] = OrderedDict()  # context -> request << 32 | the token after it

    def add(self, tokens: np.ndarray, first: int, undo: list | None = None, request: int = 0) -> None:
        """Record the context before each of tokens[first:] with the token that followed it, seen by `request`;
        `undo` collects (context, what it held before) for `forget`."""
        n, tokens = self.context, np.asarray(tokens, dtype=np.int32)
        for end in range(max(first, n), len(tokens)):
            key = tokens[end - n : end].tobytes()
            before = self.next.pop(key, None)  # re-inserted: the newest, last to be dropped
            self.next[key] = request << 32 | int(tokens[end])
            if undo is not None:
                undo.append((key, before))
        while len(self.next) > self.capacity:
            self.next.popitem(last=False)

    def forget(self, undo: list) -> None:
        """Take back the contexts `add` recorded into `undo` (latest first)."""
        for key, before in reversed(undo):
            if before is None:
                self.next.pop(key, None)
            else:
                self.next[key] = before
        undo.clear()

    def follow(self, tail: np.ndarray, k: int) -> tuple[list[int], int]:
        """The chain after the text's last `context` tokens (`tail`), at most min(k, longest) tokens, and the request
        that saw its first link; ([], -1) where it falls short of `shortest`."""
        n, longest = self.context, min(k, self.longest)
        if len(tail) < n or longest < self.shortest:
            return [], -1
        window = np.empty(n + longest, dtype=np.int32)
        window[:n] = tail[-n:]
        seen_by = -1
        for i in range(longest):
            link = self.next.get(window[i : i + n].tobytes())
            if link is None:
                break
            window[n + i] = link & 0xFFFFFFFF
            if i == 0:
                seen_by = link >> 32
        else:
            i = longest
        return (window[n : n + i].tolist(), seen_by) if i >= self.shortest else ([], -1)


class SuffixDrafter(Drafter):
    name = "suffix"
    free = True

    def __init__(self, cache=None, alternatives: int = 2, min_token_prob: float = MIN_TOKEN_PROB,
                 chains: ContextChains | None = None):
        if not isinstance(alternatives, int) or alternatives < 0:
            raise ValueError(f"alternatives must be an integer >= 0, got {alternatives!r}")
        self.cache = cache if cache is not None else shared_cache()
        self.chains = chains if chains is not None else ContextChains()
        self.alternatives, self.min_token_prob = alternatives, min_token_prob
        self.request = None  # this drafter's request id in the cache (None: no sequence started)
        self.seen = 0  # committed tokens the cache holds for it
        self.text = np.empty(0, dtype=np.int32)  # those tokens (text[:seen]) and room to grow: one conversion a step
        self.last_request = None  # the request it drafted last, and the chain contexts that request recorded
        self.recorded: list = []
        self.copy = CopyPointer()

    def spawn(self) -> "SuffixDrafter":
        return SuffixDrafter(self.cache, self.alternatives, self.min_token_prob, self.chains)

    def reset(self) -> None:
        if self.request is not None:
            self.cache.stop_request(self.request)  # its answer stays in the shared tree for later requests
        self.request, self.seen = None, 0

    def begin(self, prompt_ids: torch.Tensor) -> None:
        self.reset()
        self.request = self.last_request = next(_request_ids)
        self.recorded = []
        self.seen = 0
        prompt = self._append(prompt_ids[0])
        self.copy = CopyPointer(start=len(prompt))
        self.cache.start_request(self.request, prompt)
        self.chains.add(prompt, 0, self.recorded, self.request)

    def forget_last_request(self) -> None:
        self.reset()
        if self.last_request in self.cache.cached_requests:
            self.cache.evict_cached_response(self.last_request)
        self.chains.forget(self.recorded)
        self.last_request = None

    def commit(self, input_ids: torch.Tensor) -> None:
        if self.request is None:
            self.begin(input_ids)
        elif input_ids.shape[1] > self.seen:
            start = max(0, self.seen - self.chains.context)  # the new tokens with the context before them
            first = self.seen - start
            self.cache.add_active_response(self.request, self._append(input_ids[0, self.seen :]))
            self.chains.add(self.text[start : self.seen], first, self.recorded, self.request)

    def _append(self, tokens: torch.Tensor) -> np.ndarray:
        """Add committed tokens to `text` -> their int32 view there."""
        n, m = self.seen, tokens.shape[0]
        if n + m > len(self.text):
            grown = np.empty(max(2 * len(self.text), n + m, 1024), dtype=np.int32)
            grown[:n] = self.text[:n]
            self.text = grown
        self.text[n : n + m] = tokens.numpy()
        self.seen = n + m
        return self.text[n : n + m]

    def propose(self, input_ids, k, sampling, draws, keep_going=None) -> Draft:
        self.commit(input_ids)  # a sequence the engine did not begin (its first propose) starts here
        text = self.text[: self.seen]
        chain, seen_by = self.chains.follow(text[-self.chains.context :], k)
        if chain:
            source = CHAIN_SOURCE if seen_by == self.request else EARLIER_CHAIN_SOURCE
            return Draft(torch.tensor([chain]), source=source, match_len=self.chains.context)
        # The tree grows best-first by estimated probability: room for the chain's branches as well as the chain.
        room = 1 + self.alternatives
        found, source = self._speculate(text[-MAX_TREE_DEPTH:], k * room, room)
        chain, siblings = best_chain(found.token_ids, found.parents, found.probs) if found.token_ids else ([], [])
        keep = min(k, int(found.match_len * MAX_SPEC_FACTOR + MAX_SPEC_OFFSET)) or 1
        if chain and found.match_len <= CONTESTED_MATCH and first_token_prob(found) < CONTESTED_PROB:
            source += CONTESTED
        chain, siblings = chain[:keep], siblings[:keep]
        draft = Draft(torch.tensor([chain]), source=source, match_len=found.match_len) if chain else None
        if draft is not None and self.alternatives and any(siblings):
            rows = [(s[: self.alternatives] + [-1] * self.alternatives)[: self.alternatives] for s in siblings]
            draft.alternatives = torch.tensor([rows])
        self.copy.follow(text)
        copied = self.copy.draft(text, k)
        if len(copied) > len(chain):  # the copy runs further than the tree's match vouches for (the tree's: a fallback)
            return Draft(torch.tensor([copied]), source=COPY_SOURCE, match_len=self.copy.run, instead=draft)
        return draft if draft is not None else Draft.empty(1, input_ids.device)

    def _speculate(self, context: np.ndarray, most: int, room: int):
        """The better-scoring draft of this request's tree (prompt and answer so far) and the tree over answers (earlier
        ones and this one so far) -> (draft, its source). `SuffixDecodingCache.speculate` makes the same choice without
        saying which tree answered, so the two are called apart here (its trees are attributes of the pinned
        arctic-inference 0.3.0); a tie goes to the request's tree, which also holds this answer."""
        args = (context, most, MAX_SPEC_FACTOR * room, MAX_SPEC_OFFSET * room, self.min_token_prob,
                bool(self.alternatives))
        own = SuffixTree.speculate_ndarray(self.cache._local_trees[self.request], *args)
        answers = SuffixTree.speculate_ndarray(self.cache._global_tree, *args)
        return (own, self.name) if own.score >= answers.score else (answers, ANSWERS_SOURCE)

    def propose_free(self, input_ids, k) -> Draft:
        return self.propose(input_ids, k, None, None)


def first_token_prob(found) -> float:
    """A draft tree's estimate that its likeliest first token comes next (the share of the match's earlier occurrences
    that it followed)."""
    return max(p for p, parent in zip(found.probs, found.parents) if parent == -1)


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


class CopyPointer:
    """Where in the request's text the answer is copying from, followed token by token: an answer that rewrites its
    input (an edited function) copies it in order, leaving it for an edit and coming back a little further on. After
    each edit the copy is found again near where it left (RESYNC tokens, within RESYNC_WINDOW ahead), or anywhere in
    the text on a longer match (JUMP_MATCH tokens); what the edit replaced is remembered (a renamed variable: the
    source's tokens and the answer's) and written into later drafts from the copy. `run`: how many tokens the text's
    tail matches at the copy (up to 64; a draft's match length), 0 while the answer is away from it. A suffix match
    finds short matches too, but where the copy is, not how far it runs: the tree's most frequent continuation of a
    1-3 token match is as often elsewhere in the text."""

    def __init__(self, start: int = 0):
        self.pointer: int | None = None  # text position of the token the copy would write next
        self.run = 0
        self.seen = start  # text positions followed so far (a prompt is not followed: it copies nothing yet)
        self.left_at: tuple[int, int] | None = None  # (source, answer) positions where the copy broke
        self.replaced: dict[int, list[tuple[list[int], list[int]]]] = {}  # source span -> answer span, by first token
        self._grams = {m: GramIndex(m) for m in (RESYNC, JUMP_MATCH)}

    def follow(self, text: np.ndarray) -> None:
        """Fold in the text's new tokens (the committed text, all of it)."""
        for i in range(self.seen, len(text)):
            if self.pointer is not None and self.pointer < i and text[self.pointer] == text[i]:
                self.pointer += 1
                self.run += 1
            elif self.run:
                self.left_at, self.run = (self.pointer, i), 0
        self.seen = len(text)
        if not self.run:
            self._find(text)

    def draft(self, text: np.ndarray, k: int) -> list[int]:
        """Up to k tokens: the source from the pointer on, with the replacements learned so far written in."""
        if not self.run:
            return []
        out, q, end = [], self.pointer, len(text)
        while len(out) < k and q < end:
            for source, answer in self.replaced.get(int(text[q]), ()):
                if q + len(source) <= end and text[q : q + len(source)].tolist() == source:
                    out.extend(answer)
                    q += len(source)
                    break
            else:
                out.append(int(text[q]))
                q += 1
        return out[:k]

    def _find(self, text: np.ndarray) -> None:
        n = len(text)
        if self.pointer is not None:
            lo, hi = max(0, self.pointer - RESYNC_BEHIND), min(n - RESYNC, self.pointer + RESYNC_WINDOW)
            end = self._grams[RESYNC].last_match(text, lo, hi, near=self.pointer)
            if end is not None:
                self._learn(text, end, RESYNC)
                self.pointer, self.run = end, _matched(text, end, RESYNC)
                return
        end = self._grams[JUMP_MATCH].last_match(text, 0, n - JUMP_MATCH)
        if end is not None:
            self.pointer, self.run, self.left_at = end, _matched(text, end, JUMP_MATCH), None

    def _learn(self, text: np.ndarray, end: int, matched: int) -> None:
        """The copy found again at `end` after `matched` tokens: what the source had there and the answer wrote."""
        if self.left_at is None:
            return
        source = text[self.left_at[0] : end - matched].tolist()
        answer = text[self.left_at[1] : len(text) - matched].tolist()
        self.left_at = None
        if 0 < len(source) <= REPLACED_SOURCE and 0 < len(answer) <= REPLACED_ANSWER and source != answer:
            spans = self.replaced.setdefault(source[0], [])
            spans[:] = [(s, a) for s, a in spans if s != source] + [(source, answer)]
            spans.sort(key=lambda span: -len(span[0]))  # the longest source span that fits first


def _matched(text: np.ndarray, end: int, m: int, most: int = 64) -> int:
    """How many tokens the text's tail matches the text ending at `end` (m known to), up to `most`."""
    n = m
    while n < most and end - n - 1 >= 0 and text[end - n - 1] == text[len(text) - n - 1]:
        n += 1
    return n


class GramIndex:
    """Where each run of m tokens of an append-only text ends, by its tokens: an earlier occurrence of the text's last
    m tokens is a dict lookup, where a search of the whole text cost ~0.1 ms a step on a 300-token text (the copy
    pointer searches at every step its copy is lost: most steps of fresh text)."""

    def __init__(self, m: int):
        self.m = m
        self.ends: dict[bytes, list[int]] = {}  # the tokens of a run -> the ends (exclusive) of its occurrences, in order
        self.indexed = m - 1  # ends indexed so far: m..indexed

    def last_match(self, text: np.ndarray, lo: int, hi: int, near: int | None = None) -> int | None:
        """The end (exclusive) of an earlier occurrence of the text's last m tokens that starts at lo..hi - 1 (hi at
        most len(text) - m: a token follows it, and it is not the tail itself): the one nearest `near` (the earlier
        of two as near), else the latest."""
        m = self.m
        if hi <= lo or len(text) < m + 1:
            return None
        for end in range(self.indexed + 1, len(text) + 1):
            self.ends.setdefault(text[end - m : end].tobytes(), []).append(end)
        self.indexed = len(text)
        ends = self.ends[text[-m:].tobytes()]
        first, past = bisect.bisect_left(ends, lo + m), bisect.bisect_left(ends, hi + m)
        if first == past:
            return None
        if near is None:
            return ends[past - 1]
        i = min(max(bisect.bisect_left(ends, near, first, past), first + 1), past - 1)  # ends[i - 1] < near <= ends[i]
        return ends[i - 1] if first < i and near - ends[i - 1] <= abs(ends[i] - near) else ends[i]
