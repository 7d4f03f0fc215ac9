"""Both grammar backends on the real 32k Mistral tokenizer, and real-world schemas."""
from __future__ import annotations

import pytest

from grammar_service.backends import available_backends, load_backend_class
from grammar_service.tokenizer import load_tokenizer

from backend_vocab import EOS, VOCAB  # noqa: F401  (re-exported for fixtures)


@pytest.fixture(scope="session")
def tokenizer_data(mistral_32k_dir):
    return load_tokenizer(mistral_32k_dir, VOCAB)[0]


@pytest.fixture(scope="session")
def make_backend(tokenizer_data):
    built = {}

    def make(name: str):
        if name not in built:
            # llguidance on 2 lanes: the slot contract holds across lanes (test_llguidance_lanes.py)
            built[name] = load_backend_class(name)(tokenizer_data, num_compile_threads=1, num_fill_threads=2,
                                                    num_llguidance_lanes=2)
        return built[name]
    return make


@pytest.fixture(params=available_backends())
def backend(request, make_backend):
    """Each registered backend in turn: the slot tests run on all of them."""
    return make_backend(request.param)


@pytest.fixture(scope="session")
def tokenize(make_backend):
    """Text -> token ids as llguidance's tokenizer splits it (the canonical tokenization)."""
    return make_backend("llguidance").lltokenizer.tokenize_str
