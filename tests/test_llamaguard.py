"""The guard in front of llama.cpp's extra buffer types: a probe child that dies by a signal makes models load
without them, the verdict is cached, the override wins; on an AMX CPU the AMX kernels decode as the plain ones."""

import sys
from pathlib import Path

import pytest
import torch

from specdecode.backends import BackendError
from specdecode.backends import llamaguard
from specdecode.backends.llamacpp import LlamaCppBackend, LlamaModel
from specdecode.engine import SpeculativeEngine
from specdecode.models import BUILTINS, builtin_gguf

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
def test_amx_kernels_decode_as_the_plain_ones(monkeypatch, fresh_cache):
    prompt = torch.tensor([[1, 504, 3458, 314, 253, 1745, 28, 216]])

    def greedy(extra: str) -> list[int]:
        monkeypatch.setenv(llamaguard.ENV, extra)
        model = LlamaModel(SMOL)
        assert ("AMX" in model.buffer_types) is (extra == "1")
        return SpeculativeEngine(LlamaCppBackend(model, threads=2), None).generate(prompt, max_new_tokens=24).result().token_ids

    assert greedy("1") == greedy("0")
