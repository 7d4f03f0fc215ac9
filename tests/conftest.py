"""Shared fixtures: real tokenizers (converted once, cached in ~/.cache/structgen/tokenizers).

`mistral_32k_dir` / `tekken_131k_dir`: folders with tokenizer.json; `mistral_32k`: the
loaded `tokenizers.Tokenizer`. Helpers live in tests/real_tokenizers.py (importable as
`real_tokenizers`) and tests/channel_driver.py (the engine side of a step channel).
"""
from __future__ import annotations

import pytest

from real_tokenizers import tokenizer_dir
from structgen.cli import disable_grpc_fork_handlers

# NOTE: before grpc is imported, as the product's processes do: the in-process grammar services
# of the unit tests fork their worker forker from this process, which has gRPC threads by then
disable_grpc_fork_handlers()


@pytest.fixture(scope="session")
def mistral_32k_dir() -> str:
    return str(tokenizer_dir("mistral_32k"))


@pytest.fixture(scope="session")
def tekken_131k_dir() -> str:
    return str(tokenizer_dir("tekken_131k"))


@pytest.fixture(scope="session")
def mistral_32k(mistral_32k_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{mistral_32k_dir}/tokenizer.json")
