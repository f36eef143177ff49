"""A small llama.cpp decode of a GGUF file, meant to run in a child process: `python llamaprobe.py FILE`.

It loads the file with llama.cpp's default model parameters (extra buffer types on), decodes a 16-token pass and
a one-token pass, and prints {"buffers": [...]} (the buffer types the weights were loaded into) on stdout. A kernel
that kills the process takes only this child with it. Standard library and llama_cpp only (no torch, no package
imports): it must start fast and be runnable as a file.
"""

from __future__ import annotations

import ctypes
import json
import re
import sys

BUFFER_LINE = re.compile(r"(\S+) model buffer size")


def buffer_types(log_lines: list[str]) -> list[str]:
    """The buffer types named in llama.cpp's load log ("CPU_REPACK model buffer size = ..."), in order, once each."""
    found: list[str] = []
    for line in log_lines:
        match = BUFFER_LINE.search(line)
        if match and match.group(1) not in found:
            found.append(match.group(1))
    return found


def probe(path: str, threads: int = 2) -> dict:
    import llama_cpp as lib

    lines: list[str] = []
    callback = lib.llama_log_callback(lambda level, text, data: lines.append(text.decode(errors="replace")))
    lib.llama_log_set(callback, ctypes.c_void_p())
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(path.encode(), lib.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    params = lib.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 128, 32, 32
    params.n_threads = params.n_threads_batch = threads  # the kernels of every worker thread run
    ctx = lib.llama_init_from_model(model, params)
    if not ctx:
        raise SystemExit(f"llama.cpp could not make a context for {path}")
    vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    batch = lib.llama_batch_init(32, 0, 1)
    for tokens, start in (([(7 * i + 11) % vocab for i in range(16)], 0), ([5 % vocab], 16)):
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, start + i, 1, True
            batch.seq_id[i][0] = 0
        status = lib.llama_decode(ctx, batch)
        if status != 0:
            raise SystemExit(f"llama_decode failed ({status})")
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)
    return {"buffers": buffer_types(lines)}


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1])))
