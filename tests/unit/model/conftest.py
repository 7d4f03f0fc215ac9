"""Fixtures for the model tests; transformers helpers are in hf_reference.py."""

from __future__ import annotations

import pathlib

import pytest

from generation_service.model.default_model import ensure_default_model


@pytest.fixture(scope="session")
def default_model_path(tmp_path_factory) -> pathlib.Path:
    """The built-in default model, built into a temporary cache (never the user's ~/.cache)."""
    return ensure_default_model(tmp_path_factory.mktemp("cache") / "default-model-v2")


@pytest.fixture(scope="session")
def mistral_tokenizer(default_model_path):
    from generation_service.model.tokenizer import Tokenizer

    return Tokenizer(default_model_path)
