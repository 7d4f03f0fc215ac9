"""JSON whitespace as both API fronts resolve it (grammar_contract.spec.json_layout) and as both
grammar backends enforce it: single-line JSON by default (", " and ": ", nothing else), compact,
capped runs, or any whitespace on request."""
import json

import pytest

from chat_checkpoints import write_checkpoint
from generation_service.model.tokenizer import Tokenizer
from generation_service.openai_http.errors import ApiError
from generation_service.proto_convert import grammar_spec
from generation_service.config import ServeConfig
from grammar_contract.spec import GrammarSpec, json_layout
from grammar_service.backends.llguidance import LLGuidanceBackend
from grammar_service.backends.xgrammar import XGrammarBackend
from grammar_service.tokenizer import load_tokenizer
from structgen.v1 import generation_pb2 as pb

PERSON = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"], "additionalProperties": False})
SINGLE_LINE = '{"name": "Ava", "age": 20}'
COMPACT = '{"name":"Ava","age":20}'
PRETTY = '{\n  "name": "Ava",\n  "age": 20\n}'
ODD = '{\n  "name": "Ava"\n \n,\n"age": 20\n}'


def test_the_default_is_single_line_and_each_option_changes_it():
    assert json_layout() == {"any_whitespace": False, "max_whitespace": None, "single_line": True}
    assert json_layout(compact=True) == {"any_whitespace": False, "max_whitespace": None, "single_line": False}
    assert json_layout(max_whitespace=0)["any_whitespace"] is False
    assert json_layout(max_whitespace=4) == {"any_whitespace": True, "max_whitespace": 4, "single_line": False}
    assert json_layout(any_whitespace=True) == {"any_whitespace": True, "max_whitespace": None, "single_line": False}
    with pytest.raises(ValueError, match="compact excludes"):
        json_layout(compact=True, any_whitespace=True)


def test_grpc_requests_get_the_default_and_contradictions_are_refused():
    config = ServeConfig()
    spec = grammar_spec(pb.GenerateRequest(prompt="x", json_schema=PERSON), config)
    assert spec.single_line and not spec.any_whitespace
    spec = grammar_spec(pb.GenerateRequest(prompt="x", json_schema=PERSON, constraint_options=pb.ConstraintOptions(
        any_whitespace=True)), config)
    assert spec.any_whitespace and spec.max_whitespace is None
    from generation_service.engine.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="constraint_options: compact excludes"):
        grammar_spec(pb.GenerateRequest(prompt="x", json_schema=PERSON, constraint_options=pb.ConstraintOptions(
            compact=True, any_whitespace=True)), config)


def test_http_requests_get_the_default():
    from generation_service.openai_http.convert import grammar_spec as http_grammar_spec
    from generation_service.openai_http.schemas import ChatCompletionRequest
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "response_format": {"type": "json_object"}})
    spec = http_grammar_spec(body, ServeConfig())
    assert spec.single_line and not spec.any_whitespace
    body.structgen.compact, body.structgen.any_whitespace = True, True
    with pytest.raises(ApiError, match="compact excludes"):
        http_grammar_spec(body, ServeConfig())


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama3")
    write_checkpoint("llama3", folder)
    tokenizer = Tokenizer(folder)
    return tokenizer, load_tokenizer(str(folder), tokenizer.num_tokens)[0]


@pytest.fixture(scope="module", params=[XGrammarBackend, LLGuidanceBackend], ids=["xgrammar", "llguidance"])
def backend(request, tokenizer):
    return request.param(tokenizer[1], num_compile_threads=1, num_fill_threads=1)


def _accepts(backend, tokenizer, spec: GrammarSpec, text: str) -> bool:
    matcher = backend.new_matcher(backend.compile(spec))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept(i) for i in ids) and matcher.accept(tokenizer.eos_token_ids[0])


@pytest.mark.parametrize("layout, accepted", [
    (json_layout(), {SINGLE_LINE}),
    (json_layout(compact=True), {COMPACT}),
    (json_layout(any_whitespace=True), {SINGLE_LINE, COMPACT, PRETTY, ODD}),
])
def test_each_backend_enforces_the_layout(backend, tokenizer, layout, accepted):
    spec = GrammarSpec("json_schema", PERSON, **layout)
    for text in (SINGLE_LINE, COMPACT, PRETTY, ODD):
        assert _accepts(backend, tokenizer[0], spec, text) == (text in accepted), (layout, text)
