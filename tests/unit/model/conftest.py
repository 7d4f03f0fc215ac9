"""Fixtures for the model tests; transformers helpers are in hf_reference.py."""

from __future__ import annotations

import pathlib

import pytest

from generation_service.model.tiny_random_model import ensure_tiny_random_model


@pytest.fixture(scope="session")
def tiny_random_path(tmp_path_factory) -> pathlib.Path:
    """The built-in tiny-random model, built into a temporary cache (never the user's ~/.cache)."""
    return ensure_tiny_random_model(tmp_path_factory.mktemp("cache") / "tiny-random-v2")


@pytest.fixture(scope="session")
def mistral_tokenizer(tiny_random_path):
    from generation_service.model.tokenizer import Tokenizer

    return Tokenizer(tiny_random_path)


@pytest.fixture(scope="session")
def smollm2_gguf() -> pathlib.Path:
    """The built-in default model's GGUF file, in the cache `make setup` fills (fetched if absent)."""
    from generation_service.model.default_model import ensure_default_model

    return ensure_default_model()
