"""Replay of the adaptive controller on measured machines: pass costs from cpu-profiles.json (two CPUs, torch fp32
and bf16, llama.cpp), acceptance by draft position from real runs (acceptance-traces.json). The controller decides
as in the engine (plan, its keep_going, observe_pass and observe_row); the simulated clock charges what the profile says those decisions
cost, with noise and the odd hiccup. No model runs: a test of decisions, not of numerics."""

from __future__ import annotations

import json
import re
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.control import AdaptiveK
from specdecode.control.calibrate import TIMED_TWICE, observe_calibration_pass, too_wide, widths
from specdecode.control.hindsight import Verdict
from specdecode.drafters.base import Draft

DATA = Path(__file__).parent / "data"
PROFILES = json.loads((DATA / "cpu-profiles.json").read_text())
TRACES = json.loads((DATA / "acceptance-traces.json").read_text())
LEAVES = 2  # as `auto` drafts
# llama.cpp's Q4_K_M 1.5B on the AVX-512 EPYC at a 200-token context, logits at every position (ms by width,
# scripts/llama-pass-costs.py, session 24)
EPYC_LLAMA_PASS_MS = {1: 35, 2: 63, 4: 110, 8: 250, 12: 320, 16: 305, 20: 415, 24: 454, 32: 540, 48: 790, 64: 860}
TARGETS = ("qwen2.5-coder-1.5b",)


@dataclass(frozen=True)
class Machine:
    name: str
    verify_ms: dict[int, float]  # one target pass by its width
    draft_ms: float  # one draft token
    draft_read_ms: float  # the draft model reading one prompt token (in a long pass)
    leaves: int  # tree leaves a draft offers per token: as `auto` drafts on torch; llama.cpp verifies chains

    def verify_s(self, width: int) -> float:
        """Linear between measured widths, and past the widest along its last segment."""
        known = sorted(self.verify_ms.items())
        if width <= known[0][0]:
            return known[0][1] / 1000
        for (w0, t0), (w1, t1) in zip(known, known[1:]):
            if width <= w1:
                return (t0 + (t1 - t0) * (width - w0) / (w1 - w0)) / 1000
        (w0, t0), (w1, t1) = known[-2], known[-1]
        return (t1 + (t1 - t0) / (w1 - w0) * (width - w1)) / 1000


# A 2-wide pass costs 1.8 plain ones there, so a 1-token draft pays only if it is right ~90 % of the time, far above
# what short matches reach (0.24 on fresh code, 0.40-0.48 on code edits).
EPYC_LLAMA_200 = Machine("avx512_epyc/llama.cpp every position, 200-token context", EPYC_LLAMA_PASS_MS,
                         draft_ms=20.0, draft_read_ms=6.0, leaves=0)


def observe_step(ctl: AdaptiveK, source, confidences, drafted, accepted, draft_s, verify_s, positions=None, leaf_used=None):
    """Feed one single-row step to the controller as `AdaptiveK.observe` does."""
    width = positions or drafted + 1
    ctl.observe_pass(width, 1, verify_s)
    ctl.observe_row(source, confidences, drafted, accepted, draft_s, leaf_used=leaf_used, positions=width)


def calibrated_controller(pass_ms: dict[int, float]) -> AdaptiveK:
    """A controller whose load calibration timed these passes (ms by width)."""
    ctl = AdaptiveK()
    for width, ms in pass_ms.items():
        observe_calibration_pass(ctl, width, ms / 1e3)
    ctl.rows_changed()
    return ctl


def epyc_controller() -> AdaptiveK:
    """A controller whose load calibration timed the AVX-512 EPYC's llama.cpp passes (a 16-wide pass: 8.7 plain)."""
    return calibrated_controller(EPYC_LLAMA_PASS_MS)


def machines() -> list[Machine]:
    """Every (CPU, backend, target curve, draft variant) the profiles hold."""
    out = []
    for cpu, profile in PROFILES.items():
        if not isinstance(profile, dict):
            continue
        for backend, models in profile.items():
            if not isinstance(models, dict):
                continue
            target = {int(w): ms for w, ms in models[TARGETS[0]].items()}
            for name, curve in models.items():
                if name != TARGETS[0] and name.startswith("qwen"):  # a draft sharing the target's vocabulary
                    label = re.sub(r" \(.*\)", "", backend)
                    out.append(Machine(f"{cpu}/{label}/draft {name.split(' ')[0]}", target, curve["1"],
                                       _read_ms({int(w): ms for w, ms in curve.items()}, target),
                                       0 if backend.startswith("llama.cpp") else LEAVES))
    return out


def _read_ms(draft: dict[int, float], target: dict[int, float]) -> float:
    """A prompt token read by the draft: its one-token pass scaled as the target's widest pass per token is to its
    one-token pass, or its own widest pass per token if that is cheaper."""
    scaled = draft[1] * target[max(target)] / max(target) / target[1]
    return min(scaled, draft[max(draft)] / max(draft))


def seed_as_at_load(ctl: AdaptiveK, machine: Machine) -> None:
    """What `control.calibrate` measures at load, from the profile: passes by width (as far as it times them), a
    4-token draft and a 32-token reading."""
    passes: dict[int, float] = {}
    for width in widths():
        if width > TIMED_TWICE and too_wide(passes, width):  # narrow widths are always timed
            break
        passes[width] = machine.verify_s(width)
        observe_calibration_pass(ctl, width, passes[width])
    ctl.rows_changed()
    ctl.observe_reading(32, 32 * machine.draft_read_ms / 1000)
    ctl.costs.observe_draft("model", 4, 4 * machine.draft_ms / 1000)


# A machine where speculation pays even at low acceptance: passes nearly flat in width, draft tokens almost free.
DRAFTING_PAYS = Machine("drafting pays", {1: 10.0, 2: 10.05, 4: 10.1, 8: 10.2, 16: 10.4, 32: 10.8, 256: 20.0},
                        draft_ms=0.05, draft_read_ms=0.01, leaves=LEAVES)


def simulate_costs(engine, machine: Machine = DRAFTING_PAYS, seeded: bool = True):
    """Give an engine (batched or single) a fresh adaptive controller that sees `machine`'s costs instead of the wall
    clock, seeded as at load (unless not `seeded`): its decisions then follow the test's numbers, not the test
    machine's load. Every measurement reaches the controller through `observe`, so that is the one place to rewrite."""
    batch = getattr(engine, "_engine", engine)
    batch.controller = ctl = AdaptiveK(max_k=batch.k)
    if seeded:
        seed_as_at_load(ctl, machine)
    observe = ctl.observe

    def simulated(outcome):
        outcome.verify_s = machine.verify_s(len(outcome.row_ids) * outcome.positions)
        for row in outcome.rows:
            row.draft_s = machine.draft_ms / 1000 * row.drafted if row.confidence is not None else 0.0
            row.readings = [(tokens, tokens * machine.draft_read_ms / 1000) for tokens, _ in row.readings]
        observe(outcome)

    ctl.observe = simulated
    return engine


def replay_request(machine: Machine, accept_by_position: list[float], *, prompt: int, answer: int, max_new_tokens: int,
                   seed: int = 0) -> dict:
    """One request from a fresh drafter that has not read its prompt, on a controller seeded as at load: it ends after
    `answer` tokens (an end of text the controller cannot foresee), under a budget of `max_new_tokens`. The clock
    charges the draft's prompt reading (and its catch-up after plain steps) where the controller chose to draft."""
    rng = random.Random(seed)
    ctl = AdaptiveK(max_k=8)
    seed_as_at_load(ctl, machine)
    clock, read_upto, done, drafting_steps = 0.0, None, 0, 0
    while done < answer:
        budget = max_new_tokens - done - 1
        unread = prompt + done if read_upto is None else prompt + done - read_upto
        plan = ctl.plan(min(budget, 8), ready=read_upto is not None, unread=unread, leaves=0, remaining=budget,
                        generated=done)
        drafted = accepted = 0
        confidences = []
        if plan.length:
            reading = unread * machine.draft_read_ms / 1000
            clock += reading
            if read_upto is None:
                ctl.observe_reading(unread, reading)
            read_upto = prompt + done
            for i in range(plan.length):
                if i and not plan.keep_going(i, confidences[-1]):
                    break
                p = accept_by_position[min(i, len(accept_by_position) - 1)]
                confidences.append(min(max(rng.betavariate(4 * p + 0.1, 4 * (1 - p) + 0.1), 0.0), 1.0))
            for c in confidences:
                if rng.random() >= c:
                    break
                accepted += 1
            drafted = len(confidences)
        draft_s = drafted * machine.draft_ms / 1000
        verify_s = machine.verify_s(1 + drafted)
        observe_step(ctl, "model", confidences or None, drafted, accepted, draft_s, verify_s)
        clock += draft_s + verify_s
        done += accepted + 1
        drafting_steps += drafted > 0
        if read_upto is not None and drafted:
            read_upto += accepted + 1
    return {"speedup": answer * machine.verify_s(1) / clock, "drafting_steps": drafting_steps}


def replay_lookups(machine: Machine, *, answer: int, match_len, accept, seed: int = 0, length: int = 8) -> dict:
    """One request whose every step offers a `length`-token lookup draft (a suffix match of `match_len(tokens so far)`
    tokens), each token right with probability `accept` (or `accept(tokens so far)`), on a controller seeded as at
    load; the controller trims it (AdaptiveK.trim), the clock charges the pass it chose, and the whole draft is judged
    in hindsight as the engine's `Hindsight` judges it. `verified_from`: the tokens done when the first draft was
    verified, None if none was."""
    rng = random.Random(seed)
    ctl = AdaptiveK(max_k=8)
    seed_as_at_load(ctl, machine)
    clock, done, verified, verified_from = 0.0, 0, 0, None
    verdicts: list[tuple[int, Verdict]] = []  # with the tokens done when the answer gives it
    while done < answer:
        for _, verdict in [v for v in verdicts if v[0] <= done]:
            ctl.measured.observe_hindsight(verdict)
        verdicts = [v for v in verdicts if v[0] > done]
        match, right = match_len(done), accept(done) if callable(accept) else accept
        draft = ctl.trim(Draft(torch.arange(length)[None], source="suffix", match_len=match))
        if draft.length and verified_from is None:
            verified_from = done
        right_run = 0  # leading tokens of the offered draft the target would take
        while right_run < length and rng.random() < right:
            right_run += 1
        accepted = min(right_run, draft.length)
        seconds = machine.verify_s(1 + draft.length)
        ctl.observe_pass(1 + draft.length, 1, seconds)
        ctl.observe_row("suffix", None, draft.length, accepted, 0.0, match_len=match)
        judged = min(right_run + 1, length)
        verdicts.append((done + judged, Verdict("suffix", match, draft.length, judged, right_run)))
        clock += seconds
        done += accepted + 1
        verified += draft.length
    return {"speedup": done * machine.verify_s(1) / clock, "verified": verified, "verified_from": verified_from}


def traces() -> list[tuple[str, list[float]]]:
    return [(f"{t['task']}-{t['prompt']}-{t['run'][-6:]}", t["accept_by_position"]) for t in TRACES["traces"]]


def replay(machine: Machine, accept_by_position: list[float], *, requests: int = 4, tokens: int = 128, seed: int = 0,
           controller: AdaptiveK | None = None) -> dict:
    """Simulated tokens/s of speculation over plain decoding, and how many steps drafted."""
    rng = random.Random(seed)
    ctl = controller or AdaptiveK(max_k=8)
    if controller is None:
        seed_as_at_load(ctl, machine)
    hit = TRACES["leaf_hit_at_rejection"]
    clock = plain_clock = 0.0
    drafting_steps = steps = 0

    def noisy(seconds: float) -> float:
        hiccup = 3.0 if rng.random() < 0.01 else 1.0  # now and then the machine is busy
        return seconds * rng.uniform(0.9, 1.1) * hiccup / 1.02  # mean 1

    for _ in range(requests):
        ctl.rows_changed()
        done = 0
        while done < tokens:
            budget = tokens - done - 1
            plan = ctl.plan(min(budget, 8), leaves=machine.leaves, remaining=budget)
            confidences = []
            for i in range(plan.length):
                if i and not plan.keep_going(i, confidences[-1]):
                    break
                p = accept_by_position[min(i, len(accept_by_position) - 1)]
                confidences.append(min(max(rng.betavariate(4 * p + 0.1, 4 * (1 - p) + 0.1), 0.0), 1.0))
            accepted = 0
            for c in confidences:  # the draft is calibrated: a token of confidence c is accepted with probability c
                if rng.random() >= c:
                    break
                accepted += 1
            drafted = len(confidences)
            leaves = machine.leaves if plan.leaves else 0  # the engine verifies leaves only when the plan says so
            width = 1 + drafted * (1 + leaves)
            leaf_used = (accepted < drafted and rng.random() < hit) if drafted and leaves else None
            draft_s = noisy(drafted * machine.draft_ms / 1000)
            verify_s = noisy(machine.verify_s(width))
            observe_step(ctl, "model", confidences or None, drafted, accepted, draft_s, verify_s, positions=width, leaf_used=leaf_used)
            clock += draft_s + verify_s
            gained = min(accepted + 1 + bool(leaf_used), tokens - done)
            done += gained
            plain_clock += gained * machine.verify_s(1)
            steps += 1
            drafting_steps += drafted > 0
    return {"speedup": plain_clock / clock, "drafting_steps": drafting_steps, "steps": steps}
