"""Continuous batching with speculation per row: the one decoding step every path runs.

Each step admits waiting requests (prefill), asks the controller for every row's draft plan, runs the rows'
drafters, verifies all rows' [last] + draft (+ tree leaves for a row alone) in one backend pass (where the backend
can, the same pass reads the next chunk of a waiting prompt), judges each row (`Sequence.judge`), keeps the accepted
K/V (`Backend.keep`), tells the controller what the step measured and emits. The single-request engine
(`engine.SpeculativeEngine`) is this engine with one row.
Greedy output per row equals the same request run alone; sampling stays lossless per row (each row
keeps its own draws).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from itertools import islice
from dataclasses import dataclass, field

import torch

from .backends import Backend, as_backend
from .backends.base import RowReader, read_each
from .backends.prefix import MIN_SHARED, common_prefix
from .control import AdaptiveK, calibrate
from .control.calibrate import WIDEST
from .control.costs import Ema
from .control.step import LOOKUP, PLAIN, Controller, FixedK, RowOutcome, RowPlan, StepOutcome, StepPlan
from .drafters.base import Draft, Drafter
from .sampling import SamplingParams
from .sequence import Sequence, check_draft_length, validate_request
from .stats import count_positions
from .stopping import StopCondition
from .tree import TreeLayout, pack
from .verify import greedy_verdicts


# Prompt tokens read per step while other rows decode: their next token waits for this chunk's reading. The least
# is 64 (llama.cpp reads prompts at full speed from chunks of 32-64 tokens on, docs/results.md); more when the rows'
# own part of a step is dear, so that a step reads at least READ_PER_ROWS_PART times as long as the rows take (at 8
# rows on a 2-core CPU a ~0.4 s pass beside each 64-token chunk made reading a burst ~30 % slower). While a burst
# waits (MAX_PREFILL_CHUNK tokens or more), the most: reading is then everyone's wait, and a burst ends when its last
# prompt is read and answered (8 Spec-Bench prompts, 3,287 tokens, 2-core Xeon: 68.5 s against 75.7 s in
# 64-157-token chunks, first tokens as soon).
DEFAULT_PREFILL_CHUNK = 64
READ_PER_ROWS_PART = 8
MAX_PREFILL_CHUNK = 512
# The next prompt read is the one with the fewest tokens to read among this many waiting (the oldest first): a bound on
# the work per admission (each is a prefix-cache lookup) under a long queue (1,500 queued requests made it quadratic).
SHORTEST_AMONG = 16


class ChunkSizer:
    """Prompt tokens to read beside running rows this step: `fixed`, or measured (from the rows' part of recent
    steps and the reading's time a token)."""

    def __init__(self, fixed: int | None):
        self.fixed = fixed
        self.read_s_per_token = Ema(0.3)
        self.rows_part_s = Ema(0.3)

    def chunk(self, waiting: int = 0) -> int:
        """waiting: prompt tokens left to read (the queue's and those being read)."""
        if self.fixed is not None:
            return self.fixed
        if waiting >= MAX_PREFILL_CHUNK:
            return MAX_PREFILL_CHUNK
        if self.read_s_per_token.value is None or self.rows_part_s.value is None:
            return DEFAULT_PREFILL_CHUNK
        wanted = READ_PER_ROWS_PART * self.rows_part_s.value / max(self.read_s_per_token.value, 1e-9)
        return int(min(MAX_PREFILL_CHUNK, max(DEFAULT_PREFILL_CHUNK, wanted)))

    def observe_read(self, tokens: int, seconds: float) -> None:
        if tokens >= DEFAULT_PREFILL_CHUNK // 2:  # a short read is mostly a pass's fixed cost, not a rate
            self.read_s_per_token.update(seconds / tokens)

    def observe_rows(self, seconds: float, read_in_pass: int = 0) -> None:
        """A step's time past admission, prompt reads done alone left out; read_in_pass: prompt tokens its pass read
        beside the rows (their reading, at the measured rate, is not the rows' part)."""
        if read_in_pass and self.read_s_per_token.value is None:
            return
        self.rows_part_s.update(max(seconds - read_in_pass * (self.read_s_per_token.value or 0.0), 0.0))


@dataclass
class PromptRead:
    """A chunk of a waiting prompt read this step."""

    seq: Sequence
    reader: RowReader
    tokens: torch.Tensor  # [1, n]


def fit_reads(reads: list[PromptRead], room: int) -> list[PromptRead]:
    """The reads cut to `room` tokens in all, in order; the rest is read next step (`forward_reading` would read what
    does not fit in a decode of its own, and a decode of a few tokens costs about a one-token pass)."""
    fitted = []
    for read in reads:
        if room <= 0:
            break
        fitted.append(PromptRead(read.seq, read.reader, read.tokens[:, :room]))
        room -= fitted[-1].tokens.shape[1]
    return fitted


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
    read_in_pass: int = 0  # of those, read in the rows' pass (verify_s then includes their reading)
    cached_tokens: int = 0  # prompt tokens rows started with from the prefix cache this step (not read)
    step_s: float = 0.0  # the whole step
    speculative: bool = False  # some row drafted this step
    cap: int | None = None  # load-aware control's draft cap for the batch (None: not decided per batch)
    lookup_only: bool = False  # model drafting did not pay: only free lookup (n-gram) drafts were considered
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    by_source: dict[str, list[int]] = field(default_factory=dict)  # drafter source -> [drafted, accepted]


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
        prefill_chunk: int | None = None,
        prefix_cache: bool = True,
    ):
        check_draft_length(k)
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be an integer >= 1 (None: measured), got {prefill_chunk!r}")
        self.backend: Backend = as_backend(target, compact_above=compact_above, prefix_cache=prefix_cache)
        if not prefix_cache and self.backend.prefix_cache is not None:  # a Backend given with one: every prompt read whole
            self.backend.drop_cached_prefixes()
            self.backend.prefix_cache = None
        if self.backend.max_rows is not None and max_batch > self.backend.max_rows:
            raise ValueError("batched decoding supports full-attention models only (this one has sliding-window layers)")
        self.drafter, self.tokenizer, self.k, self.max_batch = drafter, tokenizer, k, max_batch
        self.chunks = ChunkSizer(prefill_chunk)
        self.adaptive = adaptive
        self.controller: Controller = AdaptiveK(max_k=k) if adaptive else FixedK()
        if adaptive:
            self.controller.pads = self.backend.pads_passes
            if tokenizer is not None and drafter is not None:
                self.controller.read_vocabulary(tokenizer)
        if drafter is not None:
            drafter.check_vocab(self.backend.vocab_size, tokenizer)
        # What the controller needs measured (passes by width, a draft token), at load instead of on a request's time
        # A batch's pass scores rows x positions: measured up to the widest this engine runs
        widest = max(WIDEST, max_batch * (k + 1))
        self.calibration = calibrate(self.controller, self.backend, drafter, widest) if adaptive and calibrate_costs else None
        self.rows: list[Sequence] = []
        self._pending: deque[Sequence] = deque()
        # Requests whose prompts are being read, in the order opened: at most one is left part-read between steps
        self._reading: list[tuple[Sequence, RowReader]] = []
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
        for seq, reader in self._reading:
            dropped.append(seq)
            reader.discard()
        self._reading = []
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
        """admit -> plan -> draft -> fit -> pass (+ a prompt chunk), judge, keep -> observe -> emit -> join. On an idle
        engine a step that admits ends at the first tokens, so they reach the caller without waiting for a pass
        (running rows never wait)."""
        start = time.perf_counter()
        report = StepReport()
        self._leave([s for s in self.rows if s.cancelled], report, reason="cancelled")
        idle = not self.rows
        reads = self._admit(report)
        if reads and not self.backend.reads_in_pass:  # read before the rows' pass; the rows joining are in it
            self._finish_reads(reads, self._read_alone(reads), report)
            reads = []
        report.admit_s = time.perf_counter() - start
        outcomes = None
        if self.rows and not (idle and report.admitted):
            trees = self._trees_on()
            plan = self.controller.plan_step(self.rows, trees, sum(r.tokens.shape[1] for r in reads))
            report.cap, report.lookup_only = plan.cap, plan.lookup_only
            drafts, timings = self._draft(plan, report)
            if self.rows:
                self.controller.fit(self.rows, plan, drafts)
                layouts = [TreeLayout(seq.ids[:, -1:], d.tokens, d.alternatives if trees else None)
                           for seq, d in zip(self.rows, drafts)]
                accepted, outcomes, reads = self._verify(layouts, drafts, report, reads)
                self.controller.observe(self._outcome(layouts, drafts, accepted, timings, report))
                self._emit(drafts, accepted, report)
            self.chunks.observe_rows(time.perf_counter() - start - report.admit_s, report.read_in_pass)
        if reads:  # the rows that read beside the pass join after it (or, with no pass, read now)
            self._finish_reads(reads, self._read_alone(reads) if outcomes is None else outcomes, report)
        report.step_s = time.perf_counter() - start
        return report

    def _trees_on(self) -> bool:
        """Tree leaves only for a row running alone (beside other rows a wider pass is not free), where the backend
        scores trees; the row's plan then says whether they pay."""
        return len(self.rows) == 1 and self.backend.supports_tree

    def _draft(self, plan: StepPlan, report: StepReport) -> tuple[list[Draft], list[tuple[float, list]]]:
        """Every row's draft as planned (empty: a plain step for that row), with the seconds it took and what the
        drafter read on the way. A row whose drafter fails fails alone."""
        drafts, timings, failed = [], [], []
        for seq, row in zip(self.rows, plan.rows):
            try:
                draft, seconds, readings = self._propose(seq, row)
            except Exception as error:
                seq.fail(error)
                failed.append(seq)
                continue
            drafts.append(draft)
            timings.append((seconds, readings))
            seq.stats.draft_time_s += seconds
            if seq.drafter is not None:
                seq.stats.note = seq.stats.note or self.controller.model_off or ""
        report.draft_s = sum(seconds for seconds, _ in timings)
        if failed:
            plan.rows = [row for seq, row in zip(self.rows, plan.rows) if seq not in failed]
            self._leave(failed, report)
        return drafts, timings

    def _propose(self, seq: Sequence, row: RowPlan) -> tuple[Draft, float, list[tuple[int, float]]]:
        """Run one row's drafter as planned. Returns the draft, the seconds it took (a prompt reading left out: it is
        no draft step's cost) and (tokens, seconds) of the committed text the drafter read."""
        readings: list[tuple[int, float]] = []
        if row.kind == PLAIN:
            return Draft.empty(), 0.0, readings
        if row.read_prompt:  # deferred to the first step that drafts with a model: a request that never does never pays
            t0 = time.perf_counter()
            seq.drafter.prefill(seq.prompt)
            seq.drafter_ready = True
            readings.append((seq.prompt.shape[1], time.perf_counter() - t0))
            seq.stats.draft_prefill_s += readings[-1][1]
        t0 = time.perf_counter()
        if row.kind == LOOKUP:
            draft = seq.drafter.propose_free(seq.ids, row.length)
        else:
            unread, passes = seq.drafter.unread(seq.ids), seq.drafter.forward_passes
            draft = seq.drafter.propose(seq.ids, row.length, seq.sampling, seq.draws, row.keep_going)
            seq.stats.draft_passes += seq.drafter.forward_passes - passes
            if draft.reading_s:  # a catch-up pass over all but the last unread token
                readings.append((unread - 1, draft.reading_s))
        seconds = time.perf_counter() - t0
        draft.truncate(seq.draft_budget)  # a drafter may offer more than asked (n-gram runs)
        draft.end_at(seq.stop.eos_token_ids)  # a copy runs on past the end of what it copies (a turn's end)
        if not row.leaves:
            draft.drop_leaves()
        return draft, seconds, readings

    def _verify(self, layouts: list[TreeLayout], drafts: list[Draft], report: StepReport,
                reads: list[PromptRead]) -> tuple[list[int], list, list[PromptRead]]:
        """One pass over every row's [last] + draft (+ leaves) and the prompt chunks to read beside them, each row
        judged, the accepted K/V kept. Returns how many draft tokens each row accepted, and the reads the pass had
        room for (the last chunks cut to fit; the rest is read next step) with each one's outcome."""
        t0 = time.perf_counter()
        tokens, widths, offsets, visibility = pack(layouts)
        if reads and self.backend.pass_tokens is not None:
            reads = fit_reads(reads, self.backend.pass_tokens - sum(widths))
        padded: dict[str, int] = {}
        if reads:
            logits, outcomes = self.backend.forward_reading([(r.reader, r.tokens) for r in reads], tokens, widths,
                                                            offsets, visibility)
            report.read_in_pass = sum(r.tokens.shape[1] for r in reads)
        else:
            width = self.controller.pass_width(sum(widths)) if len(self.rows) == 1 and self.backend.pads_passes else 0
            padded = {"pad_to": width} if width > sum(widths) else {}
            logits, outcomes = self.backend.forward(tokens, widths, offsets, visibility, **padded), []
        accepted = self._judge(layouts, drafts, logits)
        self.backend.keep([layout.kept_inputs(n, seq.leaf) for seq, layout, n in zip(self.rows, layouts, accepted)])
        report.rows, report.verify_s = len(self.rows), time.perf_counter() - t0
        report.width = padded.get("pad_to", tokens.shape[1])  # a padded pass's time is its real width's
        return accepted, outcomes, reads

    def _judge(self, layouts: list[TreeLayout], drafts: list[Draft], logits: torch.Tensor) -> list[int]:
        """Each row's draft judged from the pass's logits [B, W, V] (where the model runs): greedy chains all at once
        (one argmax there, [B] verdicts moved), sampled rows, tree leaves and log-probabilities row by row (their
        [W, V] moved to the CPU)."""
        together = [i for i, (seq, layout) in enumerate(zip(self.rows, layouts))
                    if seq.sampling.greedy and not layout.leaves and seq.top_logprobs is None]
        accepted = [0] * len(self.rows)
        if together:
            k = max(drafts[i].length for i in together)
            rows = logits[:, : k + 1] if len(together) == len(self.rows) else logits[together, : k + 1]
            lens, nexts = greedy_verdicts([drafts[i].tokens for i in together], rows)
            for i, n, token in zip(together, lens, nexts):
                accepted[i] = self.rows[i].commit(drafts[i], n, token)
        for i in sorted(set(range(len(self.rows))) - set(together)):  # draws and log-probabilities are made on the CPU
            layout = layouts[i]
            accepted[i] = self.rows[i].judge(drafts[i], *layout.split_logits(logits[i : i + 1, : layout.width].cpu()))
        return accepted

    def _outcome(self, layouts: list[TreeLayout], drafts: list[Draft], accepted: list[int],
                 timings: list[tuple[float, list]], report: StepReport) -> StepOutcome:
        rows = [RowOutcome(d.source, d.confidence, d.length, n, seconds - d.reading_s, d.match_len,
                           (seq.leaf is not None) if layout.leaves else None, layout.width, readings)
                for seq, layout, d, n, (seconds, readings) in zip(self.rows, layouts, drafts, accepted, timings)]
        # a pass that also read a prompt chunk says nothing of what a pass of these rows costs
        verify_s = None if report.read_in_pass else report.verify_s
        return StepOutcome(tuple(seq.serial for seq in self.rows), report.width, verify_s, rows)

    def _emit(self, drafts: list[Draft], accepted: list[int], report: StepReport) -> None:
        for seq, draft, n in zip(self.rows, drafts, accepted):
            if seq.drafter is not None and not draft.length and seq.draft_budget > 0:
                seq.stats.plain_steps += 1  # it could have drafted: speculation was off for it this step
            seq.stats.verify_time_s += report.verify_s
            report.drafted += draft.length
            report.accepted += n
            count_positions(report.drafted_per_position, draft.length)
            count_positions(report.accepted_per_position, n)
            if draft.length:
                tally = report.by_source.setdefault(draft.source or "draft", [0, 0])
                tally[0], tally[1] = tally[0] + draft.length, tally[1] + n
            chunk = seq.emit()
            if chunk:
                report.events.append((seq, chunk))
        report.speculative = report.drafted > 0
        self._leave([s for s in self.rows if s.finished], report)

    # --- rows joining and leaving -----------------------------------------------------------------

    def _admit(self, report: StepReport) -> list[PromptRead]:
        """Read waiting prompts into rows while there is room. With none running, the prompt with the least left to
        read, whole if short (`_read_first`): its first token goes out at once and the next prompts are read beside its
        row (reading all of a burst first held every first token until the last prompt was read). While rows run,
        returns this step's reads: one chunk (ChunkSizer) over the prompts being read, then the next waiting ones; a
        long prompt is read over several steps."""
        if not self.rows:
            self._read_first(report)
            return []
        if not self._reading and self._an_ending_row_goes_first():
            return []
        budget, reads, i = self.chunks.chunk(self._prompt_tokens_waiting()), [], 0
        while budget > 0:
            if i == len(self._reading) and not self._open_next(report):
                break
            seq, reader = self._reading[i]
            if seq.cancelled:
                self._drop_reading(i, report, "cancelled")
                continue
            take = min(budget, seq.prompt_left)
            reads.append(PromptRead(seq, reader, seq.prompt[:, seq.prompt_read : seq.prompt_read + take]))
            budget -= take
            i += 1
        return reads

    def _an_ending_row_goes_first(self) -> bool:
        """Whether the waiting prompts wait for a running row in its last steps: one that ends, its token budget spent,
        within S at the rows' measured step time (S: the time reading the shortest waiting prompt beside it would
        stall it, its tokens to read at the measured rate) and was sent S or more before any waiting request. That
        row is spared a stall of S for a wait of less than S, and rows that end one after another hold the newcomers
        together, as llama-server's lockstep does: the slowest answers at 4 concurrent requests and 4 conversations
        were rows read early that decoded through later arrivals' readings (scripts/level-sim.py replays it). A
        burst's requests, sent together, never wait for each other (holding them cost level 8 ~3 % of its tok/s).
        The wait is bounded: no row is admitted meanwhile, and every running row ends within its budget."""
        per_token, rows_s = self.chunks.read_s_per_token.value, self.chunks.rows_part_s.value
        if per_token is None or rows_s is None or self.chunks.fixed is not None or len(self.rows) >= self.max_batch:
            return False
        with self._lock:
            waiting = list(islice(self._pending, SHORTEST_AMONG))
        if not waiting:
            return False
        stall = per_token * min(self.backend.to_read(seq.prompt) for seq in waiting)
        first_sent = waiting[0].started  # the queue's oldest
        return any(first_sent - seq.started >= stall and (seq.max_new_tokens - seq.generated) * rows_s <= stall
                   for seq in self.rows)

    def _prompt_tokens_waiting(self) -> int:
        """Prompt tokens of the queue and those being read, counted whole: a chat turn re-sending a cached history
        then reads 512 tokens a step, which measured better than rows-sized chunks (docs/results.md)."""
        with self._lock:
            queued = sum(seq.prompt.shape[1] for seq in self._pending)
        return queued + sum(seq.prompt_left for seq, _ in self._reading)

    def _read_first(self, report: StepReport) -> None:
        """With no rows: of the prompts being read and the next waiting one, the one with the fewest tokens left,
        read whole where that is at most MAX_PREFILL_CHUNK tokens (it joins), else one such chunk of it, and the step
        ends: a burst whose long prompt reached the engine first lets its short ones in after one chunk instead of
        after that whole reading (on 2 cores a 765-token first prompt held seven short ones' first tokens ~8 s).
        A prompt that fails to read fails alone."""
        least_left = lambda: min(range(len(self._reading)), key=lambda j: self._reading[j][0].prompt_left)  # noqa: E731
        while self._reading or self._open_next(report):
            i = least_left()  # the first of equals
            seq = self._reading[i][0]
            long = seq.prompt_left > MAX_PREFILL_CHUNK or seq.prompt_read > seq.stats.cached_prompt_tokens
            if long and self._open_next(report):  # a long one is being read: the next waiting one may have less left
                i = least_left()
            seq, reader = self._reading[i]
            if seq.cancelled:
                self._drop_reading(i, report, "cancelled")
                continue
            take = min(seq.prompt_left, MAX_PREFILL_CHUNK)
            read = PromptRead(seq, reader, seq.prompt[:, seq.prompt_read : seq.prompt_read + take])
            self._finish_reads([read], self._read_alone([read]), report)
            if seq.exception is None:
                return  # a chunk read, or the whole prompt (it joined); a failed read gives the next one its turn

    def _read_alone(self, reads: list[PromptRead]) -> list:
        """Each read on its own (not in a pass), timed for the chunk size: its logits or the exception that failed it."""
        t0 = time.perf_counter()
        outcomes = read_each([(r.reader, r.tokens) for r in reads])
        tokens = sum(r.tokens.shape[1] for r in reads)
        self.chunks.observe_read(tokens, time.perf_counter() - t0)
        return outcomes

    def _finish_reads(self, reads: list[PromptRead], outcomes: list, report: StepReport) -> None:
        """What each read did: a failed read fails its request (e.g. out of memory on a long prompt), not the batch;
        a prompt read to its end joins the rows, in the order read."""
        for read, outcome in zip(reads, outcomes):
            seq = read.seq
            i = next(i for i, (s, _) in enumerate(self._reading) if s is seq)
            if isinstance(outcome, Exception):
                seq.fail(outcome)
                self._drop_reading(i, report)
                continue
            seq.prompt_read += read.tokens.shape[1]
            report.prefill_tokens += read.tokens.shape[1]
            if not seq.prompt_left:
                read.reader.join()
                del self._reading[i]
                self._join(seq, outcome, report)

    def _open_next(self, report: StepReport) -> bool:
        """Start reading the next waiting request if a row is free; False when there is none to read."""
        while len(self.rows) + len(self._reading) < self.max_batch:
            seq = self._next_waiting()
            if seq is None:
                return False
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
            self._reading.append((seq, reader))
            seq.prompt_read = seq.stats.cached_prompt_tokens = reader.cached  # a cached prefix is not read again
            report.cached_tokens += reader.cached
            return True
        return False

    def _next_waiting(self) -> Sequence | None:
        """The waiting request with the fewest prompt tokens to read, of the first SHORTEST_AMONG (a short prompt's
        first token does not wait for a long one's reading, and its row decodes cheaply beside that reading), the
        oldest first among equals; a request passed over max_batch times goes next (no prompt starves behind a stream
        of short ones). One that waits for a reading (`_waits_for_reading`) is not opened yet."""
        with self._lock:
            ready = []
            for seq in islice(self._pending, SHORTEST_AMONG):
                to_read = self.backend.to_read(seq.prompt)
                if not self._waits_for_reading(seq, to_read):
                    ready.append((to_read, seq))
            if not ready:
                return None
            oldest = self._pending[0]
            if oldest.overtaken >= self.max_batch and ready[0][1] is oldest:
                chosen = oldest
            else:  # min keeps the first of equals
                chosen = min(ready, key=lambda pair: pair[0])[1]
            for seq in self._pending:
                if seq is chosen:
                    break
                seq.overtaken += 1
            self._pending.remove(chosen)
        return chosen

    def _waits_for_reading(self, seq: Sequence, to_read: int) -> bool:
        """Whether a row being read will hold MIN_SHARED more of this prompt than anything holds now, on a backend
        whose new rows share those cells: opened once that reading is done, the prompt reads only the rest (a burst
        of requests with one long system prompt, or one file, arriving beside running rows reads it once)."""
        if not self.backend.shares_rows:
            return False
        length = seq.prompt.shape[1]
        held = length - to_read
        return any(min(common_prefix(seq.prompt[0], other.prompt[0]), length - 1) - held >= MIN_SHARED
                   for other, _ in self._reading)

    def _drop_reading(self, i: int, report: StepReport, reason: str | None = None) -> None:
        seq, reader = self._reading.pop(i)
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
