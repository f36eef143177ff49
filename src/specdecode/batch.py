"""Continuous batching with speculation per row: the one decoding step every path runs.

Each step admits waiting requests (prefill), lets every row propose a draft (under a load-aware cap),
verifies all rows' [last] + draft (+ tree leaves for a row alone) in one backend pass, judges each row by
the single-sequence rule (`Sequence.judge`), keeps the accepted K/V (`Backend.keep`), feeds the controller
and emits. The single-request engine (`engine.SpeculativeEngine`) is this engine with one row.
Greedy output per row equals the same request run alone; sampling stays lossless per row (each row
keeps its own draws).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .backends import Backend, as_backend
from .backends.base import RowReader
from .control import AdaptiveK, FixedK, calibrate
from .drafters.base import Draft, Drafter
from .sampling import SamplingParams
from .sequence import Sequence, validate_request
from .stats import count_positions
from .stopping import StopCondition
from .tree import TreeLayout, pack


# Prompt tokens read per step while other rows decode: their next token waits for at most this chunk's reading.
# llama.cpp reads prompts at full speed from chunks of 32-64 tokens on (docs/results.md): 64 halves the stall of 128.
DEFAULT_PREFILL_CHUNK = 64


@dataclass
class StepReport:
    """What one engine step did (for metrics)."""

    events: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # (row, tokens it emitted)
    finished: list[Sequence] = field(default_factory=list)
    rows: int = 0  # rows in the verify pass
    width: int = 0  # positions per row in the verify pass (widest draft + 1)
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    admitted: int = 0  # requests prefilled this step (joined, or finished at their first token)
    admit_s: float = 0.0  # time spent prefilling them
    prefill_tokens: int = 0  # prompt tokens read this step (at most one chunk while other rows run)
    cached_tokens: int = 0  # prompt tokens rows started with from the prefix cache this step (not read)
    step_s: float = 0.0  # the whole step
    speculative: bool = False  # some row drafted this step
    cap: int | None = None  # load-aware control's draft cap for the batch (None: not decided per batch)
    lookup_only: bool = False  # model drafting did not pay: only free lookup (n-gram) drafts were considered
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)


class BatchEngine:
    """Submit requests any time (thread-safe); a single thread calls `step()` repeatedly — best the thread
    that loaded the models (on the 2-core CPU stepping from another one ran target passes 17-20 % slower with
    a draft model loaded; see server.service.SchedulerThread). `adaptive` makes speculation load-aware (see
    control.BatchPolicy). `target`: a Backend, or a transformers model (run by the torch backend). prefix_cache=False:
    every prompt is read whole (no K/V of finished rows serve later prompts)."""

    def __init__(
        self,
        target,
        drafter: Drafter | None = None,
        tokenizer=None,
        k: int = 5,
        adaptive: bool = False,
        max_batch: int = 8,
        compact_above: float = 0.5,
        calibrate_costs: bool = True,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefix_cache: bool = True,
    ):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"the draft length k must be an integer >= 1, got {k!r}")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        self.backend: Backend = as_backend(target, compact_above=compact_above, prefix_cache=prefix_cache)
        if not prefix_cache and self.backend.prefix_cache is not None:  # a Backend given with one: every prompt read whole
            self.backend.drop_cached_prefixes()
            self.backend.prefix_cache = None
        if self.backend.max_rows is not None and max_batch > self.backend.max_rows:
            raise ValueError("batched decoding supports full-attention models only (this one has sliding-window layers)")
        self.drafter, self.tokenizer, self.k, self.max_batch = drafter, tokenizer, k, max_batch
        self.prefill_chunk = prefill_chunk
        self.controller = AdaptiveK(max_k=k) if adaptive else None
        if drafter is not None:
            drafter.check_vocab(self.backend.vocab_size, tokenizer)
        # What the controller needs measured (passes by width, a draft token), at load instead of on a request's time
        self.calibration = calibrate(self.controller, self.backend, drafter) if adaptive and calibrate_costs else None
        self.rows: list[Sequence] = []
        self._pending: deque[Sequence] = deque()
        self._reading: tuple[Sequence, RowReader] | None = None  # the request whose prompt is being read
        # Drafters of rows that left, for the next rows: at most max_batch are ever made (a llama.cpp draft is a
        # context of its own; one per queued request grew memory by GBs under a burst of requests).
        self._spare_drafters: list[Drafter] = []
        self.drafters_made = 0
        self._lock = threading.Lock()

    # --- requests -------------------------------------------------------------------------------

    @property
    def context_window(self) -> int | None:
        return self.backend.context_window

    def submit(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        k: int | None = None,
        sampling: SamplingParams = SamplingParams(),
        stop: StopCondition | None = None,
        speculate: bool = True,
        logprobs: int | None = None,
    ) -> Sequence:
        """Queue a request; it joins the batch at the next step with room. Raises ValueError on bad input."""
        k = self.k if k is None else k
        validate_request(input_ids, max_new_tokens, k, self.context_window)
        seq = Sequence(input_ids, max_new_tokens=max_new_tokens, k=k, sampling=sampling, stop=stop, logprobs=logprobs)
        seq.speculate = speculate and self.drafter is not None  # its drafter comes with its row (_admit)
        with self._lock:
            self._pending.append(seq)
        return seq

    @property
    def waiting(self) -> int:
        return len(self._pending)

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self._pending or self._reading)

    def generate_all(self, requests: list[dict]) -> list[Sequence]:
        """Run `submit(**request)` for each and step until all are done (for scripts and tests)."""
        seqs = [self.submit(**request) for request in requests]
        while self.has_work:
            self.step()
        return seqs

    def abort(self) -> list[Sequence]:
        """Drop every row and queued request (after a failed pass, or at shutdown); returns them."""
        with self._lock:
            dropped = self.rows + list(self._pending)
            self._pending.clear()
        if self._reading is not None:
            dropped.append(self._reading[0])
            self._reading[1].discard()
            self._reading = None
        for seq in self.rows:
            self._give_back_drafter(seq)
        self.rows = []
        self.backend.clear()
        for seq in dropped:
            if not seq.finished:
                seq.result.finish_reason = "error"
        return dropped

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> StepReport:
        start = time.perf_counter()
        report = StepReport()
        self._leave([s for s in self.rows if s.cancelled], report, reason="cancelled")
        self._admit(report)
        report.admit_s = time.perf_counter() - start
        if self.rows:
            drafts, draft_s = self._draft(report)
            if self.rows:
                self._verify(drafts, draft_s, report)
        report.step_s = time.perf_counter() - start
        return report

    def _draft(self, report: StepReport) -> tuple[list[Draft], list[float]]:
        """Every row's draft for this step (empty: a plain step for that row) and the seconds it took."""
        controller, B = self.controller, len(self.rows)
        trees = self._trees_on()
        # Load-aware control needs the cost of a plain pass at this batch size: measure it once.
        measure_plain = controller is not None and not controller.costs.measured(1, B)
        if controller is not None and not measure_plain:
            drafting = [seq for seq in self.rows if seq.drafter is not None]
            unread = sum(seq.prompt.shape[1] for seq in drafting if not seq.drafter_ready)
            report.cap = controller.batch.plan(B, unread, ready_rows=sum(seq.drafter_ready for seq in drafting))
            # Model drafting does not pay for this batch; drafts that cost no model pass still may.
            report.lookup_only = B > 1 and report.cap == 0
        drafts, draft_s, failed = [], [], []
        for seq in self.rows:
            t0 = time.perf_counter()
            if measure_plain and seq.drafter is not None:
                seq.stats.plain_steps += 1
                draft = Draft.empty()
            else:
                try:
                    offered = seq.drafter.alternatives if trees and seq.drafter is not None else 0
                    draft = seq.propose_free() if report.lookup_only else seq.propose(controller or FixedK(seq.k), offered)
                except Exception as error:  # one row's drafter failing must not take the others down
                    seq.fail(error)
                    failed.append(seq)
                    continue
            drafts.append(draft)
            draft_s.append(time.perf_counter() - t0 - seq.step_prefill_s)  # a deferred prompt reading is not drafting
            seq.stats.draft_time_s += draft_s[-1]
        report.draft_s = sum(draft_s)
        self._leave(failed, report)
        if report.lookup_only and self.rows:
            keep_len = controller.batch.plan_free(len(self.rows), drafts)
            for seq, draft in zip(self.rows, drafts):
                draft.truncate(keep_len)
                if seq.drafter is not None and not draft.length and seq.draft_budget > 0:
                    seq.stats.plain_steps += 1
        return drafts, draft_s

    def _trees_on(self) -> bool:
        """Tree leaves only for a row running alone (beside other rows a wider pass is not free), where the backend
        scores trees; the row's plan then says whether they pay (its draft keeps its alternatives or not)."""
        return len(self.rows) == 1 and self.backend.supports_tree

    def _verify(self, drafts: list[Draft], draft_s: list[float], report: StepReport) -> None:
        """One pass over every row's [last] + draft, then judge, keep the accepted K/V, learn and emit."""
        controller, B = self.controller, len(self.rows)
        leaves = self._trees_on()
        trees = [TreeLayout(seq.ids[:, -1:], d.tokens, d.alternatives if leaves else None) for seq, d in zip(self.rows, drafts)]
        t0 = time.perf_counter()
        tokens, widths, offsets, visibility = pack(trees)
        logits = self.backend.forward(tokens, widths, offsets, visibility)
        accepted, kept = [], []
        for i, (seq, draft, tree) in enumerate(zip(self.rows, drafts, trees)):
            accepted.append(seq.judge(draft, *tree.split_logits(logits[i : i + 1, : tree.width])))
            kept.append(tree.kept_inputs(accepted[-1], seq.leaf))
        self.backend.keep(kept)
        verify_s = time.perf_counter() - t0

        report.rows, report.width, report.verify_s = B, tokens.shape[1], verify_s
        if controller is not None:
            controller.observe_pass(tokens.shape[1], B, verify_s)
        for seq, draft, tree, n_acc, seconds in zip(self.rows, drafts, trees, accepted, draft_s):
            seq.stats.verify_time_s += verify_s
            if controller is not None:
                controller.observe_row(
                    draft.source, draft.confidence, draft.length, n_acc, seconds - draft.reading_s,
                    leaf_used=(seq.leaf is not None) if tree.leaves else None, positions=tree.width,
                    match_len=draft.match_len,
                )
            report.drafted += draft.length
            report.accepted += n_acc
            count_positions(report.drafted_per_position, draft.length)
            count_positions(report.accepted_per_position, n_acc)
            chunk = seq.emit()
            if chunk:
                report.events.append((seq, chunk))
        report.speculative = report.drafted > 0
        self._leave([s for s in self.rows if s.finished], report)

    # --- rows joining and leaving -----------------------------------------------------------------

    def _admit(self, report: StepReport) -> None:
        """Read waiting prompts into rows while there is room. While other rows run, at most `prefill_chunk` prompt
        tokens are read per step (a long prompt is read over several steps, the others decoding in between); with
        none running, whole prompts (nobody waits on them)."""
        budget = self.prefill_chunk if self.rows else None
        while budget is None or budget > 0:
            if self._reading is None and not self._open_next(report):
                return
            seq, reader = self._reading
            if seq.cancelled:
                self._drop_reading(report, "cancelled")
                continue
            done, left = seq.prompt_read, seq.prompt.shape[1] - seq.prompt_read
            take = left if budget is None else min(budget, left)
            try:
                logits = reader.read(seq.prompt[:, done : done + take])
            except Exception as error:  # e.g. out of memory on a long prompt: this request fails, not the batch
                seq.fail(error)
                self._drop_reading(report)
                continue
            seq.prompt_read += take
            report.prefill_tokens += take
            if budget is not None:
                budget -= take
            if seq.prompt_read == seq.prompt.shape[1]:
                reader.join()
                self._reading = None
                self._join(seq, logits, report)

    def _open_next(self, report: StepReport) -> bool:
        """Start reading the next waiting request if a row is free; False when there is none to read."""
        while len(self.rows) < self.max_batch:
            with self._lock:
                if not self._pending:
                    return False
                seq = self._pending.popleft()
            if seq.cancelled:
                seq.result.finish_reason = "cancelled"
                report.finished.append(seq)
                continue
            try:
                reader = self.backend.open_row(seq.prompt)
            except Exception as error:
                seq.fail(error)
                report.finished.append(seq)
                continue
            self._reading = (seq, reader)
            seq.prompt_read = seq.stats.cached_prompt_tokens = reader.cached  # a cached prefix is not read again
            report.cached_tokens += reader.cached
            return True
        return False

    def _drop_reading(self, report: StepReport, reason: str | None = None) -> None:
        seq, reader = self._reading
        self._reading = None
        reader.discard()
        if reason and not seq.finished:
            seq.result.finish_reason = reason
        report.finished.append(seq)

    def _join(self, seq: Sequence, logits: torch.Tensor, report: StepReport) -> None:
        """A request whose prompt is read joins the rows: its first token, its drafter."""
        if seq.speculate:
            seq.drafter = self._take_drafter()
        seq.start(logits)
        report.admitted += 1
        self.rows.append(seq)
        if self.controller is not None:
            self.controller.rows_changed()
        chunk = seq.emit()
        if chunk:
            report.events.append((seq, chunk))
        if seq.finished:
            self._leave([seq], report)

    def _take_drafter(self) -> Drafter:
        if self.max_batch == 1:  # one row at a time: the row takes the drafter itself
            return self.drafter
        if self._spare_drafters:
            return self._spare_drafters.pop()
        self.drafters_made += 1
        return self.drafter.spawn()

    def _give_back_drafter(self, seq: Sequence) -> None:
        if seq.drafter is not None and seq.drafter is not self.drafter:
            seq.drafter.reset()
            self._spare_drafters.append(seq.drafter)
        seq.drafter = None

    def _leave(self, leaving: list[Sequence], report: StepReport, reason: str | None = None) -> None:
        if not leaving:
            return
        for seq in leaving:
            if reason and not seq.finished:
                seq.result.finish_reason = reason
            report.finished.append(seq)
        self.backend.remove_rows([i for i, seq in enumerate(self.rows) if seq in leaving])
        for seq in leaving:
            if seq in self.rows:
                self._give_back_drafter(seq)
        self.rows = [seq for seq in self.rows if seq not in leaving]
        if self.controller is not None:
            self.controller.rows_changed()
