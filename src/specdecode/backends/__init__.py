"""Model backends: the torch backend (transformers models) and the llama.cpp backend (GGUF files)."""

from __future__ import annotations

import sys

from .base import Backend, BackendError

__all__ = ["BACKENDS", "Backend", "BackendError", "as_backend", "choose_backend", "load_target", "weights_for"]

BACKENDS = ("auto", "torch", "llama.cpp")


def as_backend(target, **torch_options) -> Backend:
    """A Backend as is; a transformers model wrapped in the torch backend."""
    if isinstance(target, Backend):
        return target
    from .torchmodel import TorchBackend

    return TorchBackend(target, **torch_options)


def choose_backend(name: str, spec: str) -> str:
    """'auto' -> llama.cpp for a GGUF file or a built-in on a CPU (its quantized kernels are the fastest pass
    there), torch otherwise (Hugging Face directories, hub ids, GPUs). An explicit choice is checked."""
    import torch

    from ..models import is_gguf_spec
    from .llamacpp import INSTALL_HINT, available

    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: use one of {', '.join(BACKENDS)}")
    if name == "torch":
        return name
    if name == "llama.cpp":
        if not is_gguf_spec(spec):
            raise ValueError(f"the llama.cpp backend runs GGUF files: {spec!r} is neither a built-in name nor a .gguf path")
        if not available():
            raise BackendError(INSTALL_HINT)
        return name
    if torch.cuda.is_available() or not is_gguf_spec(spec):
        return "torch"
    if not available():
        print(f"[specdecode] llama-cpp-python is not installed: running {spec} on the torch backend (slower on a CPU; "
              "pip install llama-cpp-python==0.3.36 for llama.cpp)", file=sys.stderr)
        return "torch"
    return "llama.cpp"


def load_target(spec: str, backend: str = "auto", *, dtype=None, threads: int | None = None, max_rows: int = 1,
                prefix_cache: bool = True, prefix_cache_tokens: int | None = None) -> tuple[Backend, object]:
    """(the target as a Backend, its tokenizer) from a model spec; backend as in `choose_backend`. llama.cpp holds up to
    `max_rows` rows side by side (torch holds as many as memory allows). prefix_cache_tokens: how many tokens of
    finished rows' K/V the prefix cache may keep (None: the backend's default; 0: no prefix cache)."""
    prefix_cache = prefix_cache and prefix_cache_tokens != 0
    import torch

    from ..models import gguf_file, load_model, load_tokenizer

    if choose_backend(backend, spec) == "llama.cpp":
        from .llamacpp import LlamaCppBackend

        # torch only samples and compares logits here: its idle worker threads would spin beside llama.cpp's.
        torch.set_num_threads(1)
        target = LlamaCppBackend(gguf_file(spec), threads=threads, max_rows=max_rows, prefix_cache=prefix_cache,
                                 prefix_tokens=prefix_cache_tokens)
        return target, load_tokenizer(spec)
    if threads:
        torch.set_num_threads(threads)
    from .torchmodel import TorchBackend

    model, tokenizer = load_model(spec, dtype=dtype)
    return TorchBackend(model, prefix_cache=prefix_cache, prefix_tokens=prefix_cache_tokens), tokenizer


def weights_for(spec: str, backend: str = "auto"):
    """Where the backend that would run `spec` reads its weights, fetching them first: llama.cpp reads the GGUF itself;
    torch needs a one-off conversion (~10 GB in fp32 for the Qwen pair)."""
    from ..models import gguf_file, prepare

    return gguf_file(spec) if choose_backend(backend, spec) == "llama.cpp" else prepare(spec)
