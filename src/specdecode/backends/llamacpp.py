"""The llama.cpp backend: a GGUF file run by llama.cpp's own (quantized) kernels, through llama-cpp-python's
low-level API.

Rows are sequence ids in one context with a unified KV cache. A pass is one `llama_batch` whose tokens carry
their row's sequence id and their own position, with logits asked for every real input; `keep` is
`llama_memory_seq_rm` past the kept prefix. Chains only: a tree leaf would need a sequence of its own sharing
the chain's cells (`llama_memory_seq_cp`), which is not built (see docs/results.md).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from .base import Backend, BackendError, RowReader, chain_offsets
from .llamaguard import vet
from .llamaprobe import buffer_types

PINNED = "llama-cpp-python==0.3.36"
INSTALL_HINT = (
    f"the llama.cpp backend needs llama-cpp-python: pip install {PINNED} (it compiles llama.cpp: about 6-10 "
    "minutes on 2 cores), or `pip install -e '.[llama]'`"
)


def load_library():
    try:
        import llama_cpp
    except ImportError as error:
        raise BackendError(INSTALL_HINT) from error
    return llama_cpp


def available() -> bool:
    try:
        load_library()
    except BackendError:
        return False
    return True


_log_callback = None  # must outlive every context
_log_lines: list[str] | None = None  # llama.cpp's log while a model loads (else dropped)


def _capture_log(lib) -> None:
    global _log_callback
    if _log_callback is None:
        def keep(level, text, data):
            if _log_lines is not None:
                _log_lines.append(text.decode(errors="replace"))

        _log_callback = lib.llama_log_callback(keep)
        lib.llama_log_set(_log_callback, ctypes.c_void_p())


def system_info() -> str:
    """llama.cpp's own line of what this build runs: "CPU : SSE3 = 1 | AVX2 = 1 | ... | AMX_INT8 = 1 | REPACK = 1"."""
    return load_library().llama_print_system_info().decode().strip()


class LlamaModel:
    """A GGUF file loaded once (weights shared by every context made from it), into llama.cpp's extra buffer types
    where a child-process probe found them safe here (llamaguard)."""

    def __init__(self, path: str | Path):
        global _log_lines
        lib = load_library()
        path = Path(path)
        if not path.is_file():
            raise BackendError(f"no GGUF file at {path}")
        self.verdict = vet(path)
        _capture_log(lib)
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.use_extra_bufts = self.verdict.extra_buffers
        _log_lines = []
        try:
            self.model = lib.llama_model_load_from_file(str(path).encode(), params)
            # the weights' buffer types (CPU_REPACK, AMX, CPU_Mapped, ...): which kernels every number ran on
            self.buffer_types = tuple(buffer_types(_log_lines))
        finally:
            _log_lines = None
        if not self.model:
            raise BackendError(f"llama.cpp could not load {path}")
        self.lib, self.path = lib, path
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.vocab_size = lib.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = lib.llama_model_n_ctx_train(self.model)
        self.eos_token_ids = frozenset(t for t in (lib.llama_vocab_eos(self.vocab), lib.llama_vocab_eot(self.vocab)) if t >= 0)

    def __del__(self):
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None


class Context:
    """A llama.cpp context over a model: up to `max_rows` sequences of up to `window` positions each."""

    def __init__(self, model: LlamaModel, threads: int | None, window: int, max_rows: int, max_pass: int):
        lib = model.lib
        params = lib.llama_context_default_params()
        params.n_ctx = window * max_rows
        params.n_batch = params.n_ubatch = max(max_pass, 32)
        params.n_seq_max = max_rows
        params.kv_unified = True  # rows share the whole cache (no fixed slice per sequence)
        params.no_perf = True
        if threads:
            params.n_threads = params.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(model.model, params)
        if not self.ctx:
            raise BackendError(f"llama.cpp could not make a context of {window * max_rows} positions for {model.path.name}")
        self.lib, self.model = lib, model
        self.memory = lib.llama_get_memory(self.ctx)
        self.n_batch = params.n_batch
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)

    def decode(self, tokens: list[int], positions: list[int], seqs: list[int], logits: list[bool]) -> np.ndarray:
        """One llama_decode over these tokens -> the logits of those flagged, in order [n_flagged, V] (a view
        into llama.cpp's buffer, valid until the next decode)."""
        n = len(tokens)
        if n > self.n_batch:
            raise BackendError(f"a pass of {n} tokens is wider than this context's batch ({self.n_batch})")
        batch = self._batch
        batch.n_tokens = n
        for i, (token, pos, seq, out) in enumerate(zip(tokens, positions, seqs, logits)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, out
            batch.seq_id[i][0] = seq
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise BackendError(f"llama_decode failed ({status}{': the KV cache is full' if status == 1 else ''})")
        flagged = sum(logits)
        if not flagged:
            return np.empty((0, self.model.vocab_size), dtype=np.float32)
        return np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(flagged, self.model.vocab_size))

    def forget(self, seq: int, start: int = -1) -> None:
        """Drop the sequence's cells from position `start` on (-1: all of them)."""
        self.lib.llama_memory_seq_rm(self.memory, seq, start, -1)

    def set_threads(self, threads: int) -> None:
        self.lib.llama_set_n_threads(self.ctx, threads, threads)

    def __del__(self):
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self._batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None


class LlamaRowReader(RowReader):
    """A sequence id of the context, read before it joins the batch's rows."""

    def __init__(self, backend: "LlamaCppBackend", seq: int):
        self.backend, self.seq, self.length = backend, seq, 0

    def read(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.backend._read(self.seq, self.length, tokens[0].tolist())
        self.length += tokens.shape[1]
        return logits

    def join(self) -> None:
        self.backend._reading.discard(self.seq)
        self.backend._seqs.append(self.seq)
        self.backend._lengths.append(self.length)

    def discard(self) -> None:
        self.backend.context.forget(self.seq)
        self.backend._reading.discard(self.seq)


class LlamaCppBackend(Backend):
    name = "llama.cpp"
    supports_tree = False

    def __init__(self, gguf: str | Path | LlamaModel, threads: int | None = None, window: int = 4096, max_rows: int = 1,
                 max_pass: int = 512):
        self.model = gguf if isinstance(gguf, LlamaModel) else LlamaModel(gguf)
        self.vocab_size = self.model.vocab_size
        self.context_window = min(window, self.model.n_ctx_train) if self.model.n_ctx_train > 0 else window
        self.eos_token_ids = self.model.eos_token_ids
        self.max_rows, self.threads = max_rows, threads
        self.context = Context(self.model, threads, self.context_window, max_rows, max_pass)
        self._seqs: list[int] = []  # row -> sequence id
        self._reading: set[int] = set()  # sequence ids of rows being read (open_row), not yet joined
        self._lengths: list[int] = []  # row -> cached positions
        self._pending: list[int] | None = None  # widths of the pass not yet kept

    @property
    def near_tie_gap(self) -> float:
        # Quantized kernels compute a many-token pass (and a prompt's reading) otherwise than a one-token one: on the
        # Qwen 1.5B Q4_K_M the logits of passes of 2-8 positions differ from one-token logits by up to 0.67 at the
        # same prefix (docs/results.md), so a top-2 gap below that may flip with the pass width.
        return 0.7

    def describe(self) -> str:
        buffers = ", ".join(self.model.buffer_types) or "unknown"
        return f"llama.cpp, {self.model.path.name} (weights in {buffers})"

    @property
    def rows(self) -> int:
        return len(self._seqs)

    def length(self, row: int) -> int:
        return self._lengths[row]

    def open_row(self) -> "LlamaRowReader":
        free = set(range(self.max_rows)) - set(self._seqs) - self._reading
        if not free:
            raise BackendError(f"this llama.cpp context holds {self.max_rows} rows")
        seq = min(free)
        self._reading.add(seq)
        return LlamaRowReader(self, seq)

    def extend(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [1, n] to a row's cache -> the logits after the last [1, V] (only that position's output
        head is computed: a drafter catching up needs no other)."""
        logits = self._read(self._seqs[row], self._lengths[row], tokens[0].tolist())
        self._lengths[row] += tokens.shape[1]
        return logits

    def _read(self, seq: int, start: int, tokens: list[int]) -> torch.Tensor:
        """Decode tokens at positions start.. of a sequence in batches, logits at the last only; on failure the
        sequence is left as it was."""
        step = self.context.n_batch
        try:
            for offset in range(0, len(tokens), step):
                chunk = tokens[offset : offset + step]
                last = offset + len(chunk) == len(tokens)
                positions = list(range(start + offset, start + offset + len(chunk)))
                out = self.context.decode(chunk, positions, [seq] * len(chunk), [False] * (len(chunk) - 1) + [last])
        except Exception:
            self.context.forget(seq, start)
            raise
        return torch.from_numpy(out[-1:].copy())

    def forward(self, tokens, widths, offsets=None, visibility=None):
        self.check_visibility(visibility)
        B, W = tokens.shape
        offsets = chain_offsets(B, W) if offsets is None else offsets
        flat_tokens, positions, seqs = [], [], []
        for row in range(B):
            n = widths[row]
            flat_tokens += tokens[row, :n].tolist()
            positions += (self._lengths[row] + offsets[row, :n]).tolist()
            seqs += [self._seqs[row]] * n
        out = self.context.decode(flat_tokens, positions, seqs, [True] * len(flat_tokens))
        self._pending = list(widths)
        if B == 1 and widths[0] == W:  # no padding to fill: one copy out of llama.cpp's buffer
            return torch.from_numpy(out.copy()).view(1, W, self.vocab_size)
        logits = torch.zeros(B, W, self.vocab_size)
        start = 0
        for row in range(B):
            logits[row, : widths[row]] = torch.from_numpy(out[start : start + widths[row]])
            start += widths[row]
        return logits

    def keep(self, kept: list[list[int]]) -> None:
        for row, inputs in enumerate(kept):
            if inputs != list(range(len(inputs))):
                raise BackendError("the llama.cpp backend keeps a prefix of each row's pass (no tree leaves)")
            self._lengths[row] += len(inputs)
            if len(inputs) < self._pending[row]:
                self.context.forget(self._seqs[row], self._lengths[row])
        self._pending = None

    def truncate(self, row: int, length: int) -> None:
        if length < self._lengths[row]:
            self.context.forget(self._seqs[row], length)
            self._lengths[row] = length

    def remove_rows(self, rows: list[int]) -> None:
        for row in sorted(set(rows), reverse=True):
            self.context.forget(self._seqs[row])
            del self._seqs[row], self._lengths[row]

    def set_threads(self, threads: int) -> None:
        self.context.set_threads(threads)
