"""Replay of the adaptive controller on measured machines: pass costs from cpu-profiles.json (two CPUs, torch fp32
and bf16, llama.cpp), acceptance by draft position from real runs (acceptance-traces.json). The controller decides
as in the engine (plan, its keep_going, observe_pass and observe_row); the simulated clock charges what the profile says those decisions
cost, with noise and the odd hiccup. No model runs: a test of decisions, not of numerics."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from specdecode.control import AdaptiveK

DATA = Path(__file__).parent / "data"
PROFILES = json.loads((DATA / "cpu-profiles.json").read_text())
TRACES = json.loads((DATA / "acceptance-traces.json").read_text())
LEAVES = 2  # as `auto` drafts
TARGETS = ("qwen2.5-coder-1.5b",)


@dataclass(frozen=True)
class Machine:
    name: str
    verify_ms: dict[int, float]  # one target pass by its width
    draft_ms: float  # one draft token

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


def observe_step(ctl: AdaptiveK, source, confidences, drafted, accepted, draft_s, verify_s, positions=None, leaf_used=None):
    """Feed one single-row step to the controller as the engine does (BatchEngine._verify)."""
    width = positions or drafted + 1
    ctl.observe_pass(width, 1, verify_s)
    ctl.observe_row(source, confidences, drafted, accepted, draft_s, leaf_used=leaf_used, positions=width)


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
                if name != TARGETS[0]:
                    out.append(Machine(f"{cpu}/{backend}/draft {name.split(' ')[0]}", target, curve["1"]))
    return out


def traces() -> list[tuple[str, list[float]]]:
    return [(f"{t['task']}-{t['prompt']}-{t['run'][-6:]}", t["accept_by_position"]) for t in TRACES["traces"]]


def replay(machine: Machine, accept_by_position: list[float], *, requests: int = 4, tokens: int = 128, seed: int = 0,
           controller: AdaptiveK | None = None) -> dict:
    """Simulated tokens/s of speculation over plain decoding, and how many steps drafted."""
    rng = random.Random(seed)
    ctl = controller or AdaptiveK(max_k=8)
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
            plan = ctl.plan(min(budget, 8), leaves=LEAVES, remaining=budget)
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
            leaves = LEAVES if plan.leaves else 0  # the engine verifies leaves only when the plan says so
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
