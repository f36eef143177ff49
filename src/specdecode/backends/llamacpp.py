"""The llama.cpp backend: a GGUF file run by llama.cpp's own (quantized) kernels, through llama-cpp-python's
low-level API.

Rows are sequence ids in one context with a unified KV cache. A pass is one `llama_batch` whose tokens carry
their row's sequence id and their own position, with logits asked for every real input; `keep` is
`llama_memory_seq_rm` past the kept prefix. A finished row's cells are copied out to host memory (the prefix cache,
as llama-server's `--cache-ram`): cells left in the cache would cost every later pass, whose attention walks the
cache's whole used range. A new row whose prompt shares a prefix with a saved one gets its cells back
(`llama_state_seq_set_data`, milliseconds against seconds of reading), or shares a running row's cells where that
row holds more of it (`llama_memory_seq_cp`, nothing copied), and reads only the rest. Chains only: a tree
leaf would need a sequence of its own sharing the chain's cells (`llama_memory_seq_cp`), which is not built (see
docs/results.md).
"""

from __future__ import annotations

import ctypes
import itertools
from pathlib import Path

import numpy as np
import torch

from .base import Backend, BackendError, RowReader, read_each
from .llamaguard import vet
from .llamaprobe import buffer_types
from .prefix import MIN_SHARED, PrefixCache

PINNED = "llama-cpp-python==0.3.36"
PREFIX_CACHE_TOKENS = 32768
PREFIX_CACHE_ENTRIES = 32
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

    def __init__(self, model: LlamaModel, threads: int | None, window: int, max_rows: int, max_pass: int,
                 room: int = 0):
        lib = model.lib
        params = lib.llama_context_default_params()
        params.n_ctx = window * max_rows + room
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
        # cells: the rows' windows and room to restore a cached prefix, as llama.cpp rounded them
        self.n_batch, self.cells = params.n_batch, lib.llama_n_ctx(self.ctx)
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self._views: dict[tuple[int, int], torch.Tensor] = {}

    def decode(self, tokens: list[int], positions: list[int], seqs: list[int], logits: list[bool]) -> torch.Tensor:
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
        if status == 1:  # llama.cpp found no free cells and left the cache as it was
            raise CacheFull("llama_decode failed (1: the KV cache is full)")
        if status != 0:
            raise BackendError(f"llama_decode failed ({status})")
        flagged = sum(logits)
        if not flagged:
            return torch.empty(0, self.model.vocab_size)
        return self._logits_view(flagged)

    def _logits_view(self, rows: int) -> torch.Tensor:
        """[rows, V] over llama.cpp's logits buffer. Views are kept by address: making one costs ~50-100 us."""
        address = ctypes.cast(self.lib.llama_get_logits(self.ctx), ctypes.c_void_p).value
        view = self._views.get((address, rows))
        if view is None:
            if len(self._views) > 64:  # the buffer moved (it grows with the widest pass)
                self._views.clear()
            array = np.ctypeslib.as_array((ctypes.c_float * (rows * self.model.vocab_size)).from_address(address))
            view = self._views[(address, rows)] = torch.from_numpy(array).view(rows, self.model.vocab_size)
        return view

    def forget(self, seq: int, start: int = -1) -> None:
        """Drop the sequence's cells from position `start` on (-1: all of them)."""
        self.lib.llama_memory_seq_rm(self.memory, seq, start, -1)

    def share(self, source: int, seq: int, length: int) -> None:
        """The sequence `seq` (empty) gets the source's cells at positions 0..length-1 (the cells are shared)."""
        self.lib.llama_memory_seq_cp(self.memory, source, seq, 0, length)

    def save(self, seq: int) -> np.ndarray:
        """The sequence's cells (positions, K and V) copied out to host memory."""
        size = self.lib.llama_state_seq_get_size(self.ctx, seq)
        # torch's allocator, not numpy's: numpy asks big arrays for huge pages, and their first touch compacted memory
        # on a busy host (AMD EPYC: 60-88 ms for a fresh 30 MiB against 13-16 ms in ordinary pages)
        state = torch.empty(size, dtype=torch.uint8).numpy()
        if self.lib.llama_state_seq_get_data(self.ctx, _bytes(state), size, seq) != size:
            raise BackendError(f"llama.cpp could not copy out sequence {seq}'s cells")
        return state

    def restore(self, state: np.ndarray, seq: int) -> bool:
        """Put saved cells back as the (empty) sequence `seq`; False when the cache has too few free cells (the
        sequence is left empty)."""
        if self.lib.llama_state_seq_set_data(self.ctx, _bytes(state), state.size, seq) == state.size:
            return True
        self.forget(seq)
        return False

    def __del__(self):
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self._batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None


def _bytes(array: np.ndarray):
    return array.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


class CacheFull(BackendError):
    """A pass found no free cells in the KV cache."""


class LlamaRowReader(RowReader):
    """A sequence id of the context, read before it joins the batch's rows."""

    def __init__(self, backend: "LlamaCppBackend", seq: int, tokens: list[int] | None = None):
        self.backend, self.seq = backend, seq
        self.tokens = tokens or []  # what its cells hold
        self.cached = len(self.tokens)

    def read(self, tokens: torch.Tensor) -> torch.Tensor:
        new = tokens[0].tolist()
        logits = self.backend._read(self.seq, len(self.tokens), new)
        self.tokens += new
        return logits

    def join(self) -> None:
        del self.backend._readers[self.seq]
        self.backend._seqs.append(self.seq)
        self.backend._tokens.append(self.tokens)

    def discard(self) -> None:
        self.backend.context.forget(self.seq)
        del self.backend._readers[self.seq]


class LlamaCppBackend(Backend):
    name = "llama.cpp"
    supports_tree = False
    reads_in_pass = True
    pads_passes = True

    def __init__(self, gguf: str | Path | LlamaModel, threads: int | None = None, window: int = 4096, max_rows: int = 1,
                 max_pass: int = 512, prefix_cache: bool = True, prefix_tokens: int | None = None):
        """prefix_cache: keep finished rows' K/V in host memory for later prompts, up to `prefix_tokens` tokens in all
        (default 32,768: ~0.9 GiB for Qwen2.5 1.5B, 28 KiB a token) and PREFIX_CACHE_ENTRIES entries."""
        self.model = gguf if isinstance(gguf, LlamaModel) else LlamaModel(gguf)
        self.vocab_size = self.model.vocab_size
        self.context_window = min(window, self.model.n_ctx_train) if self.model.n_ctx_train > 0 else window
        self.eos_token_ids = self.model.eos_token_ids
        self.max_rows, self.threads = max_rows, threads
        tokens = PREFIX_CACHE_TOKENS if prefix_tokens is None else prefix_tokens
        self.prefix_cache = PrefixCache(PREFIX_CACHE_ENTRIES, tokens) if prefix_cache else None
        self._saved: dict[int, np.ndarray] = {}  # prefix cache entry -> its cells, copied out (Context.save)
        self._entry_ids = itertools.count()
        # one window of room beyond the rows' own: a saved entry is restored whole, then cut to the shared prefix
        room = self.context_window if prefix_cache else 0
        self.context = Context(self.model, threads, self.context_window, max_rows, max_pass, room)
        self._seqs: list[int] = []  # row -> sequence id
        self._readers: dict[int, LlamaRowReader] = {}  # sequence id -> a row being read (open_row), not yet joined
        self._tokens: list[list[int]] = []  # row -> the tokens its cells hold
        self._pending: list[list[int]] | None = None  # row -> its inputs in the pass not yet kept
        self._padded = False  # the pending pass ran padded: its extra cells go at `keep`

    @property
    def near_tie_gap(self) -> float:
        # Quantized kernels compute a many-token pass (and a prompt's reading) otherwise than a one-token one: on the
        # Qwen 1.5B Q4_K_M the logits of passes of 2-8 positions differ from one-token logits by up to 0.67 at the
        # same prefix (docs/results.md), so a top-2 gap below that may flip with the pass width.
        return 0.7

    @property
    def model_name(self) -> str:
        return self.model.path.stem

    @property
    def pass_tokens(self) -> int:
        return self.context.n_batch

    def twin(self) -> "LlamaCppBackend":
        """A context of its own on the same loaded weights, without a prefix cache (a draft model's row)."""
        return LlamaCppBackend(self.model, threads=self.threads, window=self.context_window, prefix_cache=False)

    def describe(self) -> str:
        buffers = ", ".join(self.model.buffer_types) or "unknown"
        return f"llama.cpp, {self.model.path.name} (weights in {buffers})"

    @property
    def gguf_path(self) -> Path:
        return self.model.path

    def build_info(self) -> str:
        return system_info()

    def make_drafter(self, spec, *, dtype=None, tokenizer=None, compile_draft=False, threads=None):
        from ..drafters.factory import make_llama_drafter

        return make_llama_drafter(spec, self, threads or self.threads)

    @property
    def rows(self) -> int:
        return len(self._seqs)

    def length(self, row: int) -> int:
        return len(self._tokens[row])

    @property
    def shares_rows(self) -> bool:  # part of the prefix cache: off with it
        return self.prefix_cache is not None

    def open_row(self, prompt: torch.Tensor | None = None) -> "LlamaRowReader":
        if len(self._seqs) + len(self._readers) >= self.max_rows:
            raise BackendError(f"this llama.cpp context holds {self.max_rows} rows")
        seq = min(set(range(self.max_rows)) - set(self._seqs) - set(self._readers))
        self._readers[seq] = reader = self._reader(seq, prompt)
        return reader

    def _reader(self, seq: int, prompt: torch.Tensor | None) -> "LlamaRowReader":
        """A reader for an empty sequence, started from the longest prefix of the prompt held: a cached entry's
        cells put back, or a running or reading row's cells shared."""
        if prompt is None or self.prefix_cache is None:
            return LlamaRowReader(self, seq)
        entry, shared, source, held = self._start_from(prompt[0].numpy())
        if entry is None:
            if held:  # a running row or one being read holds the most of it: its cells are shared, nothing copied
                self.context.share(source, seq, held)
                self.prefix_cache.stats.shared_running += 1
            return LlamaRowReader(self, seq, prompt[0, :held].tolist())
        if not self.context.restore(self._saved[entry], seq):
            self.prefix_cache.unserved(shared)
            return LlamaRowReader(self, seq)
        self.context.forget(seq, shared)
        return LlamaRowReader(self, seq, prompt[0, :shared].tolist())

    def _held(self):  # keyed by sequence id
        yield from zip(self._seqs, self._tokens)
        yield from ((seq, reader.tokens) for seq, reader in self._readers.items())

    def drop_cached_prefixes(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.entries.clear()
            self._saved.clear()

    def _retire(self, seq: int, tokens: list[int]) -> None:
        """A row's sequence left the batch: its cells are copied out for later prompts (when the cache keeps them),
        then freed."""
        if self.prefix_cache is not None and len(tokens) > MIN_SHARED:
            self.context.forget(seq, len(tokens))  # cells of a pass that failed before `keep` hold no token of it
            entry = next(self._entry_ids)
            freed = self.prefix_cache.add(entry, tokens)
            if entry in self.prefix_cache.entries:
                self._saved[entry] = self.context.save(seq)
            for old in freed:
                self._saved.pop(old, None)
        self.context.forget(seq)

    def extend(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [1, n] to a row's cache -> the logits after the last [1, V] (only that position's output
        head is computed: a drafter catching up needs no other)."""
        new = tokens[0].tolist()
        logits = self._read(self._seqs[row], len(self._tokens[row]), new)
        self._tokens[row] += new
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
        return out[-1:].clone()

    def forward(self, tokens, widths, offsets=None, visibility=None, pad_to: int = 0):
        self.check_visibility(visibility)
        flat, positions, seqs = self._pass_inputs(tokens, widths, offsets)
        logits = [True] * len(flat)
        extra = pad_to - len(flat)
        if extra > 0:  # after the last row's inputs, its last token again: cells `keep` drops, no logits asked
            if tokens.shape[0] != 1:
                raise BackendError("only a one-row pass is padded")
            self._padded = True
            flat, seqs, logits = flat + [flat[-1]] * extra, seqs + [seqs[-1]] * extra, logits + [False] * extra
            positions = positions + list(range(positions[-1] + 1, positions[-1] + 1 + extra))
        out = self.context.decode(flat, positions, seqs, logits)
        return self._rows_logits(out, tokens.shape, widths)

    def forward_reading(self, reads, tokens, widths, offsets=None, visibility=None):
        """One llama_decode over the rows' inputs and the readers' chunks (llama-server's way: the rows' tokens ride in
        the chunk's batch at about a prompt token's cost each, where a pass of their own beside each chunk cost 0.1-0.5
        s at 8 rows on 2 cores). What does not fit the context's batch is read first, alone. A fused decode that fails is undone and
        run again as separate reads and a pass, so a read that cannot be done fails only its own request."""
        self.check_visibility(visibility)
        flat, positions, seqs = self._pass_inputs(tokens, widths, offsets)
        rows_part = len(flat)
        room = self.context.n_batch - rows_part
        outcomes: list[torch.Tensor | Exception | None] = [None] * len(reads)
        fused: list[tuple[int, LlamaRowReader, list[int]]] = []
        for i, (reader, chunk) in enumerate(reads):
            new = chunk[0].tolist()
            head, tail = new[: max(0, len(new) - room)], new[max(0, len(new) - room) :]
            if head:
                try:
                    outcomes[i] = reader.read(torch.tensor([head]))
                except Exception as error:
                    outcomes[i] = error
                    continue
            if tail:
                fused.append((i, reader, tail))
                room -= len(tail)
        flags = [True] * rows_part
        for _, reader, new in fused:
            flat, flags = flat + new, flags + [False] * (len(new) - 1) + [True]
            positions = positions + list(range(len(reader.tokens), len(reader.tokens) + len(new)))
            seqs = seqs + [reader.seq] * len(new)
        try:
            out = self.context.decode(flat, positions, seqs, flags)
        except Exception:
            for _, reader, _ in fused:
                self.context.forget(reader.seq, len(reader.tokens))
            for row in range(tokens.shape[0]):
                self.context.forget(self._seqs[row], len(self._tokens[row]))
            for (i, _, _), outcome in zip(fused, read_each([(reader, torch.tensor([new])) for _, reader, new in fused])):
                outcomes[i] = outcome
            return self.forward(tokens, widths, offsets), outcomes
        for j, (i, reader, new) in enumerate(fused):
            reader.tokens += new
            outcomes[i] = out[rows_part + j : rows_part + j + 1].clone()
        return self._rows_logits(out[:rows_part], tokens.shape, widths), outcomes

    def _pass_inputs(self, tokens, widths, offsets) -> tuple[list[int], list[int], list[int]]:
        """The rows' inputs of a pass as a llama_batch takes them (tokens, positions, sequence ids); each row's
        inputs stay pending until `keep`."""
        flat_tokens, positions, seqs, pending = [], [], [], []
        for row, inputs in enumerate(tokens.tolist()):
            n, start = widths[row], len(self._tokens[row])
            pending.append(inputs[:n])
            flat_tokens += pending[-1]
            positions += range(start, start + n) if offsets is None else (start + offsets[row, :n]).tolist()
            seqs += [self._seqs[row]] * n
        self._pending = pending
        return flat_tokens, positions, seqs

    def _rows_logits(self, out: torch.Tensor, shape: torch.Size, widths: list[int]) -> torch.Tensor:
        B, W = shape
        if all(width == W for width in widths):  # no padding to fill: llama.cpp's buffer itself, valid until the next pass
            return out.view(B, W, self.vocab_size)
        logits = torch.empty(B, W, self.vocab_size)  # a row's positions past its width are never read (not zeroed)
        start = 0
        for row in range(B):
            logits[row, : widths[row]] = out[start : start + widths[row]]
            start += widths[row]
        return logits

    def keep(self, kept: list[list[int]]) -> None:
        for row, inputs in enumerate(kept):
            if inputs != list(range(len(inputs))):
                raise BackendError("the llama.cpp backend keeps a prefix of each row's pass (no tree leaves)")
            fed = self._pending[row]
            self._tokens[row] += fed[: len(inputs)]
            if len(inputs) < len(fed) or self._padded:
                self.context.forget(self._seqs[row], len(self._tokens[row]))
        self._pending, self._padded = None, False

    def truncate(self, row: int, length: int) -> None:
        if length < len(self._tokens[row]):
            self.context.forget(self._seqs[row], length)
            del self._tokens[row][length:]

    def remove_rows(self, rows: list[int]) -> None:
        for row in sorted(set(rows), reverse=True):
            self._retire(self._seqs[row], self._tokens[row])
            del self._seqs[row], self._tokens[row]
