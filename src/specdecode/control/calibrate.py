"""Measure, at load, what the controller would otherwise learn on the first request's time: verify passes by width
and a draft token. On llama.cpp with 2 cores the first request paid ~1 s learning that speculation cannot pay there
(a one-off 96-token request ran at 0.75-0.83x plain); seeded, it starts from what this machine measured."""

from __future__ import annotations

import time

import torch

from ..sampling import SamplingParams
from ..verify import argmax
from .adaptive import AdaptiveK

# Lookups verify long drafts where wide passes are cheap, and a batch's pass scores rows x positions: passes are
# measured up to the widest the engine will run, not extrapolated (past the widest measured, CostModel guesses dear).
# A long exact copy drafts up to 64 tokens (drafters/suffix.py's chains).
WIDEST = 64
# The pass line (what one more token of a model draft costs) is drawn through passes up to this wide; wider ones price
# lookups by the table only: a 32 -> 64 slope sample moved model drafts' exploration in the replays (worst trace
# 0.91 -> 0.95x on one curve, median 0.99 -> 0.97x on another), which the long copies have nothing to do with.
LINE_WIDEST = 32
TIMED_TWICE = 8  # widths up to this are timed twice (the faster counts): model drafts live there
PROMPT_TOKENS = 32  # the drafter's reading is timed on this many
DRAFT_TOKENS = 4
# Wider passes are not measured once a pass of width w costs w plain passes: not even a draft accepted whole gains
# there (wider ones may still: llama.cpp on an AVX-512 EPYC measured 1.7x plain at width 2 and 2.9x at width 4).
STOP_SHARE = 1.0


def too_wide(passes: dict[int, float], width: int) -> bool:
    """Whether passes of `width` are past timing: a narrower one already cost its width in plain passes."""
    return any(seconds > STOP_SHARE * w * passes[1] for w, seconds in passes.items() if 1 < w < width)


def widths(widest: int = WIDEST) -> list[int]:
    """Powers of two up to `widest`, and `widest` itself."""
    out = [1]
    while out[-1] * 2 < widest:
        out.append(out[-1] * 2)
    return out + [widest] if widest > 1 else out


def observe_calibration_pass(controller: AdaptiveK, width: int, seconds: float) -> None:
    """A one-row pass of `width` positions timed at load: the table always, the pass line up to LINE_WIDEST."""
    if width <= LINE_WIDEST:
        controller.observe_pass(width, 1, seconds)
    else:
        controller.costs.observe_verify(width, seconds)


def calibrate(controller: AdaptiveK, backend, drafter=None, widest: int = WIDEST) -> dict:
    """Time the backend's passes up to `widest` positions (a scratch row, removed after) and the drafter's reading and
    drafting (reset after); feed the controller as the engine would. Returns what was measured, in seconds."""
    prompt = (torch.arange(max(widest, PROMPT_TOKENS)) * 7 + 100).remainder(backend.vocab_size)[None]
    measured: dict = {"verify_s": {}}
    backend.add_row(prompt)  # also brings the weights into memory (the first pass over a fresh mmap is slow)
    try:
        # The first pass as wide as any to come grows llama.cpp's buffers (a fresh process: 64 positions timed 1,074
        # against 742 ms after, AMD EPYC AVX-512); the widths timed once would keep that price, and it decided
        # whether a server drafted long copies at all (code edits through the server: 22.6-23.3 against 26.9-27.0
        # tok/s, by whichever price calibration read). Not timed.
        backend.forward(prompt[:, :widest], [widest])
        backend.keep([[0]])
        passes = measured["verify_s"]
        # The narrow widths twice, the faster counting (in the table and in the controller's prices), before any
        # wider one: a hiccup must not make a width look dear, nor stop the timing of the wider ones (one slow 2-wide
        # sample left a server's table at width 8, and its long copies undrafted: code edits 23.1 against 29.4 tok/s,
        # AMD EPYC)
        narrow = [w for w in widths(widest) if w <= TIMED_TWICE]
        for i, width in enumerate(narrow + narrow + [w for w in widths(widest) if w > TIMED_TWICE]):
            if width > TIMED_TWICE and too_wide(passes, width):
                break
            t0 = time.perf_counter()
            argmax(backend.forward(prompt[:, :width], [width])).tolist()  # as greedy judging reads a pass
            seconds = time.perf_counter() - t0
            backend.keep([[0]])
            passes[width] = min(seconds, passes.get(width, seconds))
            if i >= len(narrow):  # the width's last timing
                observe_calibration_pass(controller, width, passes[width])
    finally:
        backend.remove_rows([backend.rows - 1])
        backend.drop_cached_prefixes()  # the scratch row is no prompt anyone will send (it is read at load)
    controller.costs.keep_load_prices()
    controller.rows_changed()
    if drafter is not None:
        measured.update(_calibrate_drafter(controller, drafter, prompt[:, :PROMPT_TOKENS]))
    return measured


def _calibrate_drafter(controller: AdaptiveK, drafter, prompt: torch.Tensor) -> dict:
    drafter.reset()
    drafter.prefill(prompt)  # a first reading brings the draft's weights into memory: not timed
    drafter.reset()
    try:
        t0 = time.perf_counter()
        drafter.prefill(prompt)
        reading = time.perf_counter() - t0
        t0 = time.perf_counter()
        draft = drafter.propose(prompt, DRAFT_TOKENS, SamplingParams(), None)
        drafting = time.perf_counter() - t0
        model_passes = drafter.forward_passes
    finally:
        drafter.reset()
    if model_passes == 0:  # a lookup drafter: it costs no model pass, there is nothing to time
        return {}
    controller.observe_reading(prompt.shape[1], reading)
    controller.costs.observe_draft(draft.source, draft.length, drafting)
    return {"draft_read_token_s": reading / prompt.shape[1], "draft_token_s": drafting / max(draft.length, 1)}
