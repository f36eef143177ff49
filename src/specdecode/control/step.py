"""What the engine and a controller say to each other, once per step: the controller plans every row's draft
(`plan_step`), cuts the drafts it priced after seeing them (`fit`), and learns from what the step measured
(`observe`). The engine alone runs drafters, passes and judging; the controller alone decides."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..drafters.base import Draft
    from ..sequence import Sequence

PLAIN, LOOKUP, MODEL = "plain", "lookup", "model"


@dataclass
class RowPlan:
    """One row's draft for one step. kind: PLAIN (none), LOOKUP (the drafter's free lookup, up to `length` tokens)
    or MODEL (the drafter's model, up to `length` tokens, asking `keep_going` between tokens). leaves: keep the tree
    leaves the draft offers. read_prompt: the drafter reads the prompt first (a deferred, one-off cost)."""

    kind: str = PLAIN
    length: int = 0
    leaves: bool = False
    keep_going: Callable[[int, float], bool] | None = None
    read_prompt: bool = False


@dataclass
class StepPlan:
    rows: list[RowPlan]
    cap: int | None = None  # the batch's draft cap (None: not decided per batch)
    lookup_only: bool = False  # model drafting did not pay for this batch: only free lookups were considered


@dataclass
class RowOutcome:
    """What one row's draft cost and how the target judged it."""

    source: str
    confidence: list[float] | None
    drafted: int
    accepted: int
    draft_s: float  # drafting alone: prompt reading and catch-up are in `readings`
    match_len: int = 0
    leaf_used: bool | None = None  # a tree leaf held the correction (None: the draft had no leaves)
    positions: int = 1  # what the row's pass scored (more than drafted + 1 with leaves)
    readings: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) the drafter read committed text


@dataclass
class StepOutcome:
    """What one step's pass measured: `rows` rows of `positions` positions in `verify_s` (None: the pass also read a
    prompt chunk, its time says nothing of the rows'), the rows by identity (a pass over other rows is not comparable
    with the last one), and each row's outcome."""

    row_ids: tuple[int, ...]
    positions: int
    verify_s: float | None
    rows: list[RowOutcome]


class Controller(Protocol):
    model_off: str | None  # why model drafts are off on this machine, said once in each request's stats

    def plan_step(self, rows: list[Sequence], trees: bool, reading: int = 0) -> StepPlan:
        """Every row's draft for this step. trees: the engine can verify tree leaves this step; reading: prompt
        tokens the step's pass reads beside the rows (drafted positions then cost what they add to that pass)."""

    def fit(self, rows: list[Sequence], plan: StepPlan, drafts: list[Draft]) -> None:
        """Cut the drafts (in place) to what the plan's pricing says pays, now that their lengths are known."""

    def pass_width(self, positions: int) -> int:
        """The width to run a one-row pass of `positions` at, where the backend pads passes (wider: measured cheaper)."""

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from one step."""


class FixedK:
    """Always draft each request's k tokens (the classic setting), with whatever leaves the drafter offers."""

    model_off = None

    def plan_step(self, rows: list[Sequence], trees: bool, reading: int = 0) -> StepPlan:
        return StepPlan([self._row(seq, trees) for seq in rows])

    @staticmethod
    def _row(seq: Sequence, trees: bool) -> RowPlan:
        if seq.drafter is None or seq.draft_budget <= 0:
            return RowPlan()
        leaves = trees and bool(seq.drafter.alternatives)
        if seq.drafter.free:
            return RowPlan(LOOKUP, seq.k, leaves)
        return RowPlan(MODEL, min(seq.k, seq.draft_budget), leaves, read_prompt=not seq.drafter_ready)

    def fit(self, rows: list[Sequence], plan: StepPlan, drafts: list[Draft]) -> None:
        pass

    def pass_width(self, positions: int) -> int:
        return positions

    def observe(self, outcome: StepOutcome) -> None:
        pass
