"""The engine behind the HTTP server: one scheduler thread steps the batched engine; each request
gets a handle whose asyncio queue receives its text pieces and its end."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass

import torch

from ..batch import BatchEngine, StepReport
from ..drafters.base import Drafter
from ..encoding import encode_prompt, eos_token_ids
from ..pipeline import TextStream, load_components
from ..sampling import SamplingParams
from ..sequence import Sequence
from ..stopping import StopCondition
from .metrics import Metrics

log = logging.getLogger("specdecode.server")


# Tokenizing a long text allocates per-token buffers in the worker thread's malloc arena, which glibc keeps after
# they are freed: ten 1.2 MB prompts (refused after tokenizing: past the context window) left the server 650 MB
# larger; malloc_trim gives it back.
TRIM_AFTER_CHARS = 1 << 16


def release_freed_memory() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


class QueueFull(Exception):
    """More requests are waiting than the server accepts (HTTP 429)."""


class Unavailable(Exception):
    """The server cannot take requests now (HTTP 503)."""


@dataclass
class Handle:
    """One request as the HTTP side sees it. Queue items: ("text", (piece, logprob entries of the tokens since the
    last piece)), ("done", finish_reason), ("error", (HTTP status, message))."""

    seq: Sequence
    stream: TextStream
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    logprobs_sent: int = 0  # entries of seq.result.logprobs already handed over

    def put(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the request's event loop is gone
            pass


class SchedulerThread:
    """One daemon thread that runs what it is given in order: the models' loading, then the scheduler loop.
    The thread that steps the engine should be the one that loaded the weights: with a draft model loaded,
    target passes stepped from another thread than the loading one ran 17-20 % slower on the 2-core CPU
    (8-row steps 285-297 vs 237 ms; loading and stepping in one thread: 248-252 ms). Cause not pinned down
    (not OpenMP spinning, not malloc arenas); scripts/batch-arrival.py and docs/results.md have the numbers.
    Not a ThreadPoolExecutor: its worker is joined at interpreter exit, so a server that never ran its
    shutdown would hang there; this thread is a daemon."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._serve, name="specdecode-scheduler", daemon=True)
        self.thread.start()

    def submit(self, fn, *args, **kwargs) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _serve(self) -> None:
        while True:
            future, fn, args, kwargs = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(error)


def finished_line(seq: Sequence) -> str:
    """One line for a finished request: what it read, what it made and what speculation did for it."""
    st = seq.stats
    drafted = (f"drafted {st.drafted_tokens}, accepted {st.accepted_tokens} ({st.acceptance_rate:.0%})"
               if st.drafted_tokens else "nothing drafted")
    sources = ", ".join(f"{source} {tally[2]}/{tally[1]}" for source, tally in sorted(st.by_source.items()))
    return (f"request done ({seq.result.finish_reason}): prompt {st.prompt_tokens} tokens ({st.cached_prompt_tokens} "
            f"cached), {st.new_tokens} new in {st.total_time_s:.2f} s (first after {st.time_to_first_token_s:.2f} s, "
            f"{st.steps} steps), {drafted}{f' [{sources}]' if sources else ''}")


def step_line(report: StepReport, rows: int, waiting: int) -> str:
    """One line for an engine step (debug log): who was in its pass, what it read and drafted, what it cost."""
    sources = ", ".join(f"{source} {accepted}/{drafted}" for source, (drafted, accepted) in sorted(report.by_source.items()))
    return (f"step: {report.rows} rows x {report.width} wide, read {report.prefill_tokens} ({report.read_in_pass} in the "
            f"pass, {report.cached_tokens} cached), joined {report.admitted}, drafted {report.drafted}, accepted "
            f"{report.accepted}{f' [{sources}]' if sources else ''}, cap {report.cap}; {report.step_s * 1000:.0f} ms "
            f"(draft {report.draft_s * 1000:.0f}, pass {report.verify_s * 1000:.0f}); {rows} rows, {waiting} waiting")


class Service:
    def __init__(
        self,
        target,
        tokenizer,
        drafter: Drafter | None = None,
        *,
        model_name: str = "specdecode",
        k: int = 5,
        adaptive: bool = True,
        max_batch: int = 8,
        max_queue: int = 64,
        default_max_tokens: int = 256,
        scheduler: SchedulerThread | None = None,
        prefix_cache: bool = True,
    ):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.tokenizer, self.model_name = tokenizer, model_name
        self._scheduler = scheduler or SchedulerThread()
        # Built where it will step: the engine times passes at construction (control.calibrate)
        self.engine = self._scheduler.submit(
            BatchEngine, target, drafter, tokenizer, k=k, adaptive=adaptive, max_batch=max_batch,
            prefix_cache=prefix_cache).result()
        self.eos = eos_token_ids(self.engine.backend, tokenizer)
        # No token covers more characters than the vocabulary's longest entry; 2x for normalizers that drop some.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
        self._max_prompt_chars = 2 * self.context_window * longest if self.context_window and longest else None
        self.max_queue, self.default_max_tokens = max_queue, default_max_tokens
        self.speculation = "off" if drafter is None else ("load-aware" if adaptive else f"always (k={k})")
        self.metrics = Metrics()
        self.metrics.record_calibration(self.engine.calibration)
        passes = (self.engine.calibration or {}).get("verify_s", {})
        if passes:
            log.info("target passes timed at load, ms by positions scored: %s",
                     ", ".join(f"{width}: {seconds * 1e3:.1f}" for width, seconds in sorted(passes.items())))
        self._handles: dict[Sequence, Handle] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._loop: Future | None = None  # the scheduler loop, running on the scheduler thread
        self._stopping = False
        self._drain_deadline: float | None = None  # set at shutdown: no new requests; open ones are cut then

    @classmethod
    def from_specs(cls, target: str, draft: str | None, *, dtype=None, threads: int | None = None,
                   k: int | None = None, adaptive: bool | None = None, compile_draft: bool = False, backend: str = "auto",
                   **kwargs) -> "Service":
        scheduler = SchedulerThread()  # loads the models: the thread that will step them (see SchedulerThread)
        cache_tokens = kwargs.pop("prefix_cache_tokens", None)
        model, tokenizer, drafter, k, adaptive = scheduler.submit(
            load_components, target, draft, dtype=dtype, k=k, adaptive=adaptive, threads=threads, compile_draft=compile_draft,
            backend=backend, max_rows=kwargs.get("max_batch", 8), prefix_cache=kwargs.get("prefix_cache", True),
            prefix_cache_tokens=cache_tokens,
        ).result()
        return cls(model, tokenizer, drafter, model_name=kwargs.pop("model_name", None) or target,
                   k=k, adaptive=adaptive, scheduler=scheduler, **kwargs)

    @property
    def context_window(self) -> int | None:
        return self.engine.context_window

    @property
    def alive(self) -> bool:
        return self._loop is not None and not self._loop.done() and not self._stopping and self._drain_deadline is None

    @property
    def open_requests(self) -> int:
        with self._lock:
            return len(self._handles)

    def drain(self, timeout: float) -> None:
        """Shutting down: refuse new requests (503) and cut the open ones after `timeout` seconds."""
        self._drain_deadline = time.monotonic() + timeout
        self._wake.set()

    def start(self) -> None:
        if self._loop is None:
            self._stopping = False
            self._loop = self._scheduler.submit(self._run)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._loop is not None:
            wait_for([self._loop], timeout=30)
            self._loop = None
        for seq in self.engine.abort():
            self._fail(seq, "the server is shutting down", 503)

    # --- requests (called from the event loop) --------------------------------------------------

    def encode(self, prompt: str | list[dict]) -> torch.Tensor:
        """A completion prompt or chat messages -> input_ids [1, L] (safe to call from any thread). A text that
        cannot fit the context window is refused before it is tokenized: encoding a 5 MB prompt took seconds and
        grew the process by ~230 MB each time."""
        chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        if self._max_prompt_chars is not None and chars > self._max_prompt_chars:
            raise ValueError(
                f"the prompt has {chars} characters: more tokens than the model's context window of "
                f"{self.context_window} tokens holds")
        try:
            return encode_prompt(self.tokenizer, prompt, chat=isinstance(prompt, list))
        finally:
            if chars > TRIM_AFTER_CHARS:
                release_freed_memory()

    def submit(self, input_ids: torch.Tensor, *, max_tokens: int, sampling: SamplingParams, stop: tuple[str, ...] = (),
               logprobs: int | None = None) -> Handle:
        """Queue a request. ValueError: bad request; QueueFull / Unavailable: come back later."""
        if self._drain_deadline is not None:
            raise Unavailable("the server is shutting down")
        if not self.alive:
            raise Unavailable("the server is not running (starting up, shutting down, or its scheduler failed)")
        if self.engine.waiting >= self.max_queue:
            raise QueueFull(f"server busy: {self.engine.waiting} requests already waiting (max_queue={self.max_queue}); retry later")
        stop_condition = StopCondition(self.eos, tuple(stop), self.tokenizer)
        with self._lock:  # registered before the scheduler can see the sequence
            seq = self.engine.submit(input_ids, max_new_tokens=max_tokens, sampling=sampling, stop=stop_condition,
                                     logprobs=logprobs)
            handle = Handle(seq, TextStream(self.tokenizer, stop_condition, seq.result), asyncio.Queue(), asyncio.get_running_loop())
            self._handles[seq] = handle
        self.metrics.prompt_tokens.inc(input_ids.shape[1])
        self.metrics.queue_length.set(self.engine.waiting)
        self._wake.set()
        return handle

    def cancel(self, handle: Handle) -> None:
        """The client went away: free the row at the next step."""
        handle.seq.cancel()
        self._wake.set()

    # --- the scheduler thread -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline and self.engine.has_work:
                for seq in self.engine.abort():
                    self._fail(seq, "the server is shutting down: the request was cut at the shutdown deadline", 503)
                continue
            if not self.engine.has_work:
                self._wake.wait(0.5)
                continue
            try:
                report = self.engine.step()
            except Exception as error:  # a failed pass fails its rows; the server keeps serving
                log.error("engine step failed:\n%s", traceback.format_exc())
                for seq in self.engine.abort():
                    self._fail(seq, f"generation failed: {type(error).__name__}: {error}", 500)
                continue
            handed = time.perf_counter()
            for seq, _ in report.events:
                self._deliver(seq)
            for seq in report.finished:
                self._deliver(seq)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s", step_line(report, len(self.engine.rows), self.engine.waiting))
            self.metrics.record_step(report, len(self.engine.rows), self.engine.waiting)
            self.metrics.record_prefix_cache(self.engine.backend.prefix_cache)
            self.metrics.between_steps.inc(time.perf_counter() - handed)

    def _deliver(self, seq: Sequence) -> None:
        with self._lock:
            handle = self._handles.get(seq)
            if handle is None:
                return
            if seq.finished:
                del self._handles[seq]
        if seq.result.finish_reason == "error":
            handle.put("error", (500, f"generation failed: {seq.result.error or 'unknown error'}"))
            return
        piece = handle.stream.piece()
        logprobs = seq.result.logprobs or []
        if piece or (seq.finished and handle.logprobs_sent < len(logprobs)):
            handle.put("text", (piece, logprobs[handle.logprobs_sent :]))
            handle.logprobs_sent = len(logprobs)
        if seq.finished:
            if log.isEnabledFor(logging.INFO):
                log.info("%s", finished_line(seq))
            handle.put("done", seq.result.finish_reason)

    def _fail(self, seq: Sequence, message: str, status: int) -> None:
        with self._lock:
            handle = self._handles.pop(seq, None)
        if handle is not None:
            handle.put("error", (status, message))
