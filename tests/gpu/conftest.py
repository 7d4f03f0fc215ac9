"""GPU tests: marker `gpu`, skipped without CUDA. Small random Llama shapes, Tekken-131k vocab."""
from __future__ import annotations

import pathlib

import pytest

torch = pytest.importorskip("torch")

from gpu_helpers import small_config, write_random_checkpoint  # noqa: E402  (after the torch import guard)


def pytest_collection_modifyitems(config, items):
    here = pathlib.Path(__file__).parent
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if here in pathlib.Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="session")
def model():
    from generation_service.model.random_init import build_random_model
    return build_random_model(small_config(), torch.device("cuda"), torch.bfloat16, seed=0)


@pytest.fixture(scope="session")
def model_spec(tmp_path_factory) -> str:
    """A 2-layer random Llama (bf16, untied) with the Tekken-131k tokenizer beside it."""
    return write_random_checkpoint(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def grammar_service(tmp_path_factory):
    """`python -m grammar_service` in its own process."""
    from tests.integration.test_engine_support import start_grammar_service
    service = start_grammar_service(tmp_path_factory.mktemp("grammar"))
    yield service
    service.stop()
