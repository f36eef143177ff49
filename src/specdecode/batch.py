"""Several sequences in one target pass, each with its own draft and accepted length (ragged rows).

transformers' DynamicCache keeps one length for the whole batch, so rows share the cache's slot
axis and differ in which slots are live:
- every row feeds [last token] + its draft, padded to the batch's widest draft; `position_ids` are
  the row's own positions and a 2-D attention mask marks its live slots (padding and rejected draft
  slots are holes);
- after verification the shared tail is cropped to the longest accepted row, so holes remain only in
  rows that accepted less; when gathering each row's live slots to the right would free enough of the
  cache, rows are compacted;
- a new row is prefilled alone and joins by left-padding (its cache or the batch's) to a common
  length; finished rows leave with `batch_select_indices`.
Greedy output per row equals the same request run alone; sampling stays lossless per row (each row
keeps its own generator and is judged by the single-sequence rule).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .control import AdaptiveK, FixedK
from .drafters.base import Draft, Drafter
from .engine import target_logits
from .sampling import SamplingParams
from .sequence import Sequence, context_window, validate_request
from .stats import count_positions
from .stopping import StopCondition
from .tree import TreeLayout, additive_mask, keep_leaf


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
    step_s: float = 0.0  # the whole step
    speculative: bool = False  # some row drafted this step
    cap: int | None = None  # load-aware control's draft cap for the batch (None: not decided per batch)
    lookup_only: bool = False  # model drafting did not pay: only free lookup (n-gram) drafts were considered
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)


def live_slots(kept: list[int], keep: int) -> torch.Tensor:
    """[B, keep] mask of the slots each row keeps from a verify pass: its [last] + `kept` more (accepted draft
    tokens, and a correction whose K/V came from a tree leaf)."""
    return torch.arange(keep)[None, :] < (1 + torch.tensor(kept))[:, None]


def _left_pad(x: torch.Tensor, n: int) -> torch.Tensor:
    """Pad a [B, H, T, D] cache tensor with n empty slots on the left of T."""
    if n == 0:
        return x
    return torch.cat([x.new_zeros(*x.shape[:2], n, x.shape[3]), x], dim=2)


class BatchEngine:
    """Continuous batching with speculation per row. Submit requests any time (thread-safe); a
    single thread calls `step()` repeatedly — best the thread that loaded the models (on the 2-core CPU
    stepping from another one ran target passes 17-20 % slower with a draft model loaded; see
    server.service.SchedulerThread). `adaptive` makes speculation load-aware (see control.AdaptiveK)."""

    def __init__(
        self,
        target,
        drafter: Drafter | None = None,
        tokenizer=None,
        k: int = 5,
        adaptive: bool = False,
        max_batch: int = 8,
        compact_above: float = 0.5,
    ):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"the draft length k must be an integer >= 1, got {k!r}")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        layers = DynamicCache(config=target.config).layers
        if any(type(layer) is not DynamicLayer for layer in layers):
            raise ValueError("batched decoding supports full-attention models only (this one has sliding-window layers)")
        self.target, self.drafter, self.tokenizer, self.k = target, drafter, tokenizer, k
        self.max_batch, self.compact_above = max_batch, compact_above
        self.controller = AdaptiveK(max_k=k) if adaptive else None
        if drafter is not None:
            drafter.check_vocab(target.get_output_embeddings().weight.shape[0], tokenizer)
        self.rows: list[Sequence] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, T] bool: which cache slots each row attends
        self._pending: deque[Sequence] = deque()
        self._lock = threading.Lock()

    # --- requests -------------------------------------------------------------------------------

    @property
    def context_window(self) -> int | None:
        return context_window(self.target)

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
        drafter = self.drafter.spawn() if speculate and self.drafter is not None else None
        seq = Sequence(input_ids, max_new_tokens=max_new_tokens, k=k, sampling=sampling, stop=stop, drafter=drafter,
                       logprobs=logprobs)
        with self._lock:
            self._pending.append(seq)
        return seq

    @property
    def waiting(self) -> int:
        return len(self._pending)

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self._pending)

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
        self.rows, self.cache, self.mask = [], None, None
        for seq in dropped:
            if not seq.finished:
                seq.result.finish_reason = "error"
        return dropped

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> StepReport:
        start = time.perf_counter()
        report = self._step()
        report.step_s = time.perf_counter() - start
        return report

    def _step(self) -> StepReport:
        report = StepReport()
        self._leave([s for s in self.rows if s.cancelled], report, reason="cancelled")
        t0 = time.perf_counter()
        self._admit(report)
        report.admit_s = time.perf_counter() - t0
        if not self.rows:
            return report
        B = len(self.rows)
        controller = self.controller
        if controller is not None:  # a row running alone verifies its draft's leaves; beside others it does not
            controller.leaves = getattr(self.rows[0].drafter, "alternatives", 0) if B == 1 else 0
        # Load-aware control needs the cost of a plain pass at this batch size: measure it once.
        calibrate = controller is not None and not controller.costs.measured(1, B)
        if controller is not None and not calibrate:
            drafting = [seq for seq in self.rows if seq.drafter is not None]
            unread = sum(seq.prompt.shape[1] for seq in drafting if not seq.drafter_ready)
            report.cap = controller.plan_batch(B, unread, ready_rows=sum(seq.drafter_ready for seq in drafting))
            # Model drafting does not pay for this batch; drafts that cost no model pass still may.
            report.lookup_only = B > 1 and report.cap == 0

        drafts: list[Draft] = []
        draft_s: list[float] = []
        failed: list[Sequence] = []
        for seq in self.rows:
            t0 = time.perf_counter()
            if calibrate and seq.drafter is not None:
                seq.stats.plain_steps += 1
                draft = Draft.empty()
            else:
                try:
                    draft = seq.propose_free() if report.lookup_only else seq.propose(controller or FixedK(seq.k))
                except Exception as error:  # one row's drafter failing must not take the others down
                    seq.fail(error)
                    failed.append(seq)
                    continue
            drafts.append(draft)
            draft_s.append(time.perf_counter() - t0 - seq.step_prefill_s)  # a deferred prompt reading is not drafting
            if seq.step_prefill_s and controller is not None:
                controller.costs.observe_draft_prefill(seq.prompt.shape[1], seq.step_prefill_s)
            seq.stats.draft_time_s += draft_s[-1]
        report.draft_s = sum(draft_s)
        if failed:
            self._leave(failed, report)
            if not self.rows:
                return report
            B = len(self.rows)
        if report.lookup_only:
            keep_len = controller.plan_free(B, drafts)
            for seq, draft in zip(self.rows, drafts):
                draft.truncate(keep_len)
                if seq.drafter is not None and not draft.length and seq.draft_budget > 0:
                    seq.stats.plain_steps += 1

        # Tree leaves (tree.py) only for a row running alone: beside other rows a wider pass is not free.
        trees = [TreeLayout(seq.ids[:, -1:], d.tokens, d.alternatives if B == 1 else None) for seq, d in zip(self.rows, drafts)]
        width = max(tree.width for tree in trees)
        T = self.mask.shape[1]
        tokens = torch.zeros(B, width, dtype=torch.long)
        fed = torch.zeros(B, width, width, dtype=torch.bool)  # [row, query, key] among this pass's inputs
        offsets = torch.arange(width).repeat(B, 1)
        for i, tree in enumerate(trees):
            n = tree.width
            tokens[i, :n] = tree.tokens[0]
            tokens[i, n:] = tokens[i, 0]  # padding: any token, masked out
            fed[i, :n, :n] = tree.visibility
            offsets[i, :n] = tree.offsets
        first_pos = torch.tensor([seq.ids.shape[1] - 1 for seq in self.rows])
        position_ids = first_pos[:, None] + offsets
        if any(tree.leaves for tree in trees):
            allowed = torch.cat([self.mask[:, None, :].expand(B, width, T), fed], dim=2)[:, None]
            attention_mask = additive_mask(allowed, self.target.dtype)
        else:  # chains: a 2-D mask of live slots (the model makes it causal)
            attention_mask = torch.cat([self.mask, fed.diagonal(dim1=1, dim2=2)], dim=1)

        t0 = time.perf_counter()
        logits = target_logits(
            self.target, tokens, self.cache,
            attention_mask=attention_mask.to(self.target.device), position_ids=position_ids.to(self.target.device),
        )
        accepted, kept = [], []  # draft tokens accepted; slots each row keeps after its [last]
        for i, (seq, draft, tree) in enumerate(zip(self.rows, drafts, trees)):
            accepted.append(seq.judge(draft, *tree.split_logits(logits[i : i + 1, : tree.width])))
            kept.append(accepted[-1])
            if seq.leaf is not None:  # the correction's K/V, computed at its leaf, moves to its slot
                keep_leaf(self.cache, T, tree, *seq.leaf, row=i)
                kept[-1] += 1
        keep = 1 + max(kept)
        if width > keep:
            self.cache.crop(-(width - keep))
        self.mask = torch.cat([self.mask, live_slots(kept, keep)], dim=1)
        verify_s = time.perf_counter() - t0
        assert self.mask.shape[1] == T + keep == self.cache.get_seq_length()

        report.rows, report.width, report.verify_s = B, width, verify_s
        if controller is not None:
            controller.observe_pass(width, B, verify_s)
        for seq, draft, tree, n_acc, seconds in zip(self.rows, drafts, trees, accepted, draft_s):
            seq.stats.verify_time_s += verify_s
            if controller is not None:
                controller.observe_row(
                    draft.source, draft.confidence, draft.length, n_acc, seconds - draft.reading_s,
                    leaf_used=(seq.leaf is not None) if tree.leaves else None,
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
        self._compact_if_sparse()
        return report

    # --- rows joining and leaving -----------------------------------------------------------------

    def _admit(self, report: StepReport) -> None:
        while len(self.rows) < self.max_batch:
            with self._lock:
                if not self._pending:
                    return
                seq = self._pending.popleft()
            if seq.cancelled:
                seq.result.finish_reason = "cancelled"
                report.finished.append(seq)
                continue
            cache = DynamicCache(config=self.target.config)
            try:
                seq.start(target_logits(self.target, seq.prompt, cache, last_only=True)[:, -1], prefill_drafter=False)
            except Exception as error:  # e.g. out of memory on a long prompt: this request fails, not the batch
                seq.fail(error)
                report.finished.append(seq)
                continue
            report.admitted += 1
            chunk = seq.emit()
            if chunk:
                report.events.append((seq, chunk))
            if seq.finished:
                report.finished.append(seq)
                continue
            self._join(seq, cache)

    def _join(self, seq: Sequence, cache: DynamicCache) -> None:
        length = cache.get_seq_length()
        if self.cache is None:
            self.cache, self.mask, self.rows = cache, torch.ones(1, length, dtype=torch.bool), [seq]
            return
        T = self.mask.shape[1]
        common = max(T, length)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, common - T), _left_pad(theirs.keys, common - length)])
            mine.values = torch.cat([_left_pad(mine.values, common - T), _left_pad(theirs.values, common - length)])
        own = torch.zeros(1, common, dtype=torch.bool)
        own[:, common - length :] = True
        self.mask = torch.cat([torch.nn.functional.pad(self.mask, (common - T, 0)), own])
        self.rows.append(seq)

    def _leave(self, leaving: list[Sequence], report: StepReport, reason: str | None = None) -> None:
        if not leaving:
            return
        for seq in leaving:
            if reason and not seq.finished:
                seq.result.finish_reason = reason
            report.finished.append(seq)
        stay = [i for i, seq in enumerate(self.rows) if seq not in leaving]
        self.rows = [self.rows[i] for i in stay]
        if not stay:
            self.cache = self.mask = None
            return
        self.cache.batch_select_indices(torch.tensor(stay, device=self.target.device))
        self.mask = self.mask[stay]
        # Slots no remaining row attends at the left (padding for rows that left) can go.
        first_live = int(self.mask.any(0).long().argmax())
        if first_live:
            self._keep_slots(torch.arange(first_live, self.mask.shape[1]).expand(len(stay), -1))

    def _compact_if_sparse(self) -> None:
        """Gather each row's live slots to the right when that frees more than `compact_above` of the cache.
        Holes alone are no reason: a short prompt's left padding beside a long one cannot be freed, and
        gathering the whole cache every step for nothing cost ~50 ms a step at 4 rows on the Qwen pair."""
        if self.mask is None:
            return
        live = self.mask.sum(1)
        common = int(live.max())
        if self.mask.shape[1] - common <= self.compact_above * self.mask.shape[1]:
            return
        index = torch.zeros(len(self.rows), common, dtype=torch.long)
        for i, row in enumerate(self.mask):
            slots = row.nonzero().flatten()
            index[i, common - len(slots) :] = slots
        self._keep_slots(index)
        self.mask = torch.arange(common)[None, :] >= (common - live)[:, None]

    def _keep_slots(self, index: torch.Tensor) -> None:
        """Keep cache slots index[b] (a [B, T'] slot index) of each row b, in that order."""
        self.mask = self.mask.gather(1, index)
        for layer in self.cache.layers:
            B, H, _, D = layer.keys.shape
            gather = index.to(layer.keys.device)[:, None, :, None].expand(B, H, index.shape[1], D)
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
