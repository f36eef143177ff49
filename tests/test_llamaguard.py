"""The guard in front of llama.cpp's extra buffer types: a probe child that dies by a signal makes models load
without them, the verdict is cached, the override wins; on an AMX CPU the AMX kernels are as accurate as the plain
ones."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specdecode.backends import BackendError
from specdecode.backends import llamaguard
from specdecode.backends.llamacpp import Context, LlamaCppBackend, LlamaModel
from specdecode.engine import SpeculativeEngine
from specdecode.models import BUILTINS, builtin_gguf, load_model

SMOL = builtin_gguf(BUILTINS["smollm2-135m"])


def crashing_probe(marker: Path) -> list[str]:
    """A probe child that leaves a mark and kills itself with SIGSEGV, as the unpatched AMX kernels did."""
    code = f"import os, signal, pathlib; pathlib.Path({str(marker)!r}).touch(); os.kill(os.getpid(), signal.SIGSEGV)"
    return [sys.executable, "-c", code]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.delenv(llamaguard.ENV, raising=False)
    return tmp_path


def test_a_probe_killed_by_a_signal_turns_extra_buffers_off_and_is_cached(fresh_cache, capsys):
    marker = fresh_cache / "probed"
    verdict = llamaguard.vet(SMOL, probe=crashing_probe(marker))
    assert marker.exists() and not verdict.extra_buffers and "SIGSEGV" in verdict.why
    line = capsys.readouterr().err
    assert "crashed a test decode" in line and "SIGSEGV" in line and llamaguard.ENV in line
    marker.unlink()
    again = llamaguard.vet(SMOL, probe=crashing_probe(marker))
    assert not marker.exists(), "a cached verdict must not probe again"
    assert again == verdict
    # a model loaded now takes the verdict: extra buffer types off, and it still decodes
    model = LlamaModel(SMOL)
    assert not model.verdict.extra_buffers
    assert "CPU_REPACK" not in model.buffer_types and "AMX" not in model.buffer_types
    out = SpeculativeEngine(LlamaCppBackend(model, threads=2), None).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3)
    assert len(out.result().token_ids) == 3


def test_the_real_probe_passes_and_names_the_buffers(fresh_cache):
    verdict = llamaguard.vet(SMOL)
    assert verdict.extra_buffers and verdict.why == "probe passed"
    assert verdict.buffers, "the probe reads the weights' buffer types from llama.cpp's load log"
    assert llamaguard.known_verdict(SMOL) == verdict
    assert LlamaModel(SMOL).buffer_types  # the backend names them too (bench environment, `models`)


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True)])
def test_the_override_wins_over_probe_and_cache(fresh_cache, monkeypatch, value, expected):
    marker = fresh_cache / "probed"
    llamaguard.vet(SMOL, probe=crashing_probe(marker))  # cached: off
    marker.unlink()
    monkeypatch.setenv(llamaguard.ENV, value)
    verdict = llamaguard.vet(SMOL, probe=crashing_probe(marker))
    assert verdict.extra_buffers is expected and not marker.exists()


def test_a_bad_override_is_refused_by_name(fresh_cache, monkeypatch):
    monkeypatch.setenv(llamaguard.ENV, "yes")
    with pytest.raises(BackendError, match=llamaguard.ENV):
        llamaguard.vet(SMOL)


def test_an_ordinary_probe_failure_is_not_cached(fresh_cache):
    verdict = llamaguard.vet(SMOL, probe=[sys.executable, "-c", "raise SystemExit(3)"])
    assert verdict.extra_buffers and llamaguard.known_verdict(SMOL) is None


def test_the_format_key_reads_the_header_fast():
    import time

    start = time.perf_counter()
    fmt = llamaguard.gguf_format(SMOL)
    assert fmt == "llama:ftype=3"  # LLAMA_FTYPE_MOSTLY_Q4_1
    assert time.perf_counter() - start < 0.5  # a cached check reads the start of the metadata only


AMX = "amx_int8" in Path("/proc/cpuinfo").read_text()


@pytest.mark.skipif(not AMX, reason="needs a CPU with AMX (amx_int8 in /proc/cpuinfo): llama.cpp's AMX kernels only run there")
def test_amx_kernels_are_as_accurate_as_the_plain_ones(monkeypatch, fresh_cache):
    """The AMX kernels sum in another order, so a near tie may break the other way (greedy text can differ from the
    plain kernels' after a few tokens): what must hold is that they load, decode a verify pass as they decode one
    token at a time, and stay as close to the fp32 model as the plain kernels do. A wrong tile configuration gave
    garbage or a fault."""
    prompt = [1, 504, 3458, 314, 253, 1745, 28, 216]

    def logits(extra: str, tokens: list[int], one_by_one: bool = False) -> np.ndarray:
        monkeypatch.setenv(llamaguard.ENV, extra)
        model = LlamaModel(SMOL)
        assert ("AMX" in model.buffer_types) is (extra == "1")
        ctx = Context(model, threads=2, window=64, max_rows=1, max_pass=len(tokens))
        if one_by_one:
            return np.stack([ctx.decode([t], [i], [0], [True])[0].numpy().copy() for i, t in enumerate(tokens)])
        return ctx.decode(tokens, list(range(len(tokens))), [0] * len(tokens), [True] * len(tokens)).numpy().copy()

    plain_model = LlamaModel(SMOL)
    text = SpeculativeEngine(LlamaCppBackend(plain_model, threads=2), None).generate(torch.tensor([prompt]), max_new_tokens=24)
    tokens = prompt + text.result().token_ids
    hf, _ = load_model("smollm2-135m", dtype="fp32")
    with torch.no_grad():
        reference = hf(torch.tensor([tokens])).logits[0].numpy()
    amx, plain = logits("1", tokens), logits("0", tokens)
    np.testing.assert_allclose(logits("1", tokens, one_by_one=True), amx, atol=1e-3)

    def error(x):  # RMS distance from fp32 and top-1 agreement with it over the positions that predict text
        answer = slice(len(prompt) - 1, None)
        return np.sqrt(((x - reference) ** 2).mean()), (x.argmax(-1) == reference.argmax(-1))[answer].mean()

    (amx_rms, amx_top1), (plain_rms, plain_top1) = error(amx), error(plain)
    assert plain_rms < 1.0 and plain_top1 >= 0.8, "the plain kernels themselves are off: the reference is wrong"
    assert amx_rms <= 1.25 * plain_rms and amx_top1 >= plain_top1 - 0.1, (amx_rms, plain_rms, amx_top1, plain_top1)
