"""An in-process grammar service on the real 32k Mistral tokenizer, and open channels on it."""
from __future__ import annotations

import json

import pytest

from channel_driver import ChannelDriver
from grammar_contract.spec import GrammarSpec
from grammar_service.config import GrammarServiceConfig
from grammar_service.service import GrammarService
from step_channel import Geometry, StepChannel
from structgen.tokenizer_identity import fingerprint_tokenizer_json

VOCAB = 32768
GEOMETRY = Geometry(max_batch=8, max_positions=4, vocab_size=VOCAB)
EOS = 2


@pytest.fixture(scope="module")
def service(mistral_32k_dir):
    svc = GrammarService(GrammarServiceConfig(tokenizer_dir=mistral_32k_dir, vocab_size=VOCAB))
    yield svc
    svc.close()


@pytest.fixture(scope="session")
def mistral_32k_fingerprint(mistral_32k_dir) -> str:
    return fingerprint_tokenizer_json(mistral_32k_dir, VOCAB)


@pytest.fixture
def driver(service, mistral_32k_dir, mistral_32k_fingerprint):
    """A fresh channel opened on the service, driven from the test (the engine side)."""
    chan = StepChannel.create(GEOMETRY)
    service.open_channel(chan.name, GEOMETRY, max_slots=16, first_step=1, tokenizer_dir=mistral_32k_dir,
                         tokenizer_fingerprint=mistral_32k_fingerprint)
    yield ChannelDriver(chan)
    service.close_channel(chan.name)
    chan.close()


@pytest.fixture
def compile_id(service):
    def compile_id(kind: str = "json_schema", text="", **options) -> int:
        if isinstance(text, dict):
            text = json.dumps(text)
        return service.compile(GrammarSpec(kind=kind, text=text, **options)).result(30).entry.grammar_id
    return compile_id
