"""OpenAI bodies -> domain requests (generation_service/openai_http/convert.py) and the error
mapping of the HTTP edge (errors.py), without a server."""
from types import SimpleNamespace

import jinja2
import pytest

from generation_service.config import ServeConfig
from generation_service.engine import errors as engine_errors
from generation_service.openai_http import convert
from generation_service.openai_http.errors import ApiError
from generation_service.openai_http.schemas import ChatCompletionRequest, CompletionRequest

CONFIG = ServeConfig(default_max_tokens=7, default_temperature=0.5, default_top_k=3, max_grammar_bytes=1000)


class FakeTokenizer:
    vocab_size = 100
    chat_template = "<|im_start|>{{ messages }}"  # a ChatML template naming no tool format: Hermes
    special_token_ids = frozenset()

    def token_id(self, text):
        return None

    def __init__(self):
        self.rendered = None

    def encode(self, text):
        return [ord(c) % 100 for c in text]

    def apply_chat_template(self, messages, tools=None, template_kwargs=None):
        if any(m["role"] == "tool" for m in messages):
            raise jinja2.exceptions.TemplateError("roles must be system, user or assistant")
        self.rendered = (messages, tools)
        return [1] + [len(m["content"]) for m in messages]


def engine():
    return SimpleNamespace(config=SimpleNamespace(max_new_tokens_limit=64), tokenizer=FakeTokenizer(), model_name="m")


def chat(**fields):
    return ChatCompletionRequest(**{"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def chat_specs(body, eng=None):
    return convert.chat_requests(body, "chatcmpl-x", eng or engine(), CONFIG)[0]


def test_unset_sampling_takes_the_server_defaults_and_set_fields_win():
    [spec] = chat_specs(chat())
    sampling = spec.sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.max_new_tokens) == (0.5, 3, 1.0, 7)
    assert sampling.seed is None and spec.grammar is None and spec.request_id == "chatcmpl-x-0"
    [spec] = chat_specs(chat(temperature=0, top_p=0.5, top_k=-1, max_tokens=9, max_completion_tokens=11,
                             stop="END", logprobs=True, top_logprobs=0, structgen={"ignore_eos": True}))
    sampling = spec.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_new_tokens) == (0, 0.5, 0, 11)
    assert sampling.stop_strings == ("END",) and sampling.ignore_eos and sampling.num_logprobs == 1


def test_each_choice_is_a_request_with_its_own_seed_in_openai_order():
    body = CompletionRequest(model="m", prompt=["ab", "cd"], n=2, seed=10)
    specs = convert.completion_requests(body, "cmpl-x", engine(), CONFIG)
    assert [s.request_id for s in specs] == [f"cmpl-x-{i}" for i in range(4)]
    assert [s.sampling.seed for s in specs] == [10, 11, 12, 13]
    assert [s.prompt_ids for s in specs] == [(97, 98)] * 2 + [(99, 0)] * 2
    [ids] = convert.completion_requests(CompletionRequest(model="m", prompt=[5, 6]), "c", engine(), CONFIG)
    assert ids.prompt_ids == (5, 6)


@pytest.mark.parametrize("fields,name", [({"max_tokens": 65}, "max_tokens"),
                                         ({"max_completion_tokens": 100}, "max_completion_tokens")])
def test_max_tokens_beyond_the_limit_names_the_field(fields, name):
    with pytest.raises(engine_errors.LimitExceededError, match=f"^{name} .* max_new_tokens_limit 64"):
        chat_specs(chat(**fields))


def test_response_formats_become_constraints():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    [spec] = chat_specs(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": schema, "strict": True}}, structgen={"max_whitespace": 2, "backend": "xgrammar"}))
    grammar = spec.grammar
    assert grammar.kind == "json_schema" and grammar.strict and grammar.max_whitespace == 2
    assert grammar.backend == "xgrammar" and grammar.any_whitespace
    [spec] = chat_specs(chat(response_format={"type": "json_object"}, structgen={"compact": True}))
    assert spec.grammar.kind == "json_object" and not spec.grammar.any_whitespace and not spec.grammar.strict
    assert chat_specs(chat(response_format={"type": "text"}))[0].grammar is None
    with pytest.raises(engine_errors.LimitExceededError, match="max_grammar_bytes"):
        chat_specs(chat(response_format={"type": "json_schema", "json_schema": {
            "name": "a", "schema": {"enum": ["x" * 1100]}}}))


def test_tools_become_a_structural_tag_and_reach_the_template():
    eng = engine()
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    [spec] = chat_specs(chat(tools=[tool]), eng)
    assert spec.grammar.kind == "structural_tag"
    assert eng.tokenizer.rendered[1] == [tool]
    [spec] = chat_specs(chat(tools=[tool], tool_choice="none"), eng)
    assert spec.grammar is None
    with pytest.raises(ApiError, match="together with tools") as raised:
        chat_specs(chat(tools=[tool], response_format={"type": "json_object"}))
    assert raised.value.param == "response_format"


@pytest.mark.parametrize("reasoning, match", [
    ({"enabled": True, "max_tokens": 1 << 32, "begin_marker": "<r>", "end_marker": "</r>"}, "0 to 2147483647"),
    ({"enabled": True, "begin_marker": "x" * 65, "end_marker": "y"}, "at most 64"),
    ({"enabled": False, "max_tokens": 3}, "need reasoning enabled"),
])
def test_bad_reasoning_options_name_structgen_reasoning(reasoning, match):
    with pytest.raises(ApiError, match=f"^structgen.reasoning: .*{match}") as raised:
        chat_specs(chat(structgen={"reasoning": reasoning}))
    assert raised.value.status == 400 and raised.value.param == "structgen.reasoning"


def test_messages_as_templates_read_them():
    eng = engine()
    chat_specs(chat(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]), eng)
    messages, tools = eng.tokenizer.rendered
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[1]["content"] == "ab" and messages[2]["content"] == ""
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1} and tools is None


@pytest.mark.parametrize("messages,param,match", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
     "messages.0.content.0.type", "image_url"),
    ([{"role": "tool", "content": "42", "tool_call_id": "call_1"}], "messages", "template refused"),
])
def test_messages_the_model_cannot_read_are_refused(messages, param, match):
    with pytest.raises(ApiError, match=match) as raised:
        chat_specs(chat(messages=messages))
    assert raised.value.status == 400 and raised.value.param == param


def test_logits_processing_parameters_reach_the_engine_with_openai_keys():
    sampling = chat_specs(chat(frequency_penalty=0.25, presence_penalty=-1.0, logit_bias={"9": -100, "3": 4},
                               min_p=0.05, repetition_penalty=1.1, min_tokens=2))[0].sampling
    assert (sampling.frequency_penalty, sampling.presence_penalty, sampling.min_tokens) == (0.25, -1.0, 2)
    assert (sampling.min_p, sampling.repetition_penalty) == (0.05, 1.1)
    assert sampling.logit_bias == ((3, 4.0), (9, -100.0))
    assert not chat_specs(chat())[0].sampling.uses_logit_processing


@pytest.mark.parametrize("fields,param,match", [
    ({"frequency_penalty": 2.5}, "frequency_penalty", r"frequency_penalty must be in \[-2, 2\]"),
    ({"presence_penalty": -9}, "presence_penalty", r"presence_penalty must be in \[-2, 2\]"),
    ({"repetition_penalty": 0}, "repetition_penalty", r"repetition_penalty must be in \(0, 10\]"),
    ({"min_p": 2}, "min_p", r"min_p must be in \[0, 1\]"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"5": 101}}, "logit_bias", r"a bias in \[-100, 100\]"),
    ({"min_tokens": 8}, "min_tokens", r"min_tokens 8 exceeds the max_tokens in effect \(7\)"),
])
def test_out_of_range_logits_processing_is_a_400_naming_the_parameter(fields, param, match):
    with pytest.raises((ApiError, ValueError), match=match) as raised:
        chat_specs(chat(**fields))
    error = ApiError.of(raised.value)
    assert error.status == 400 and error.param == param


def test_unknown_model_is_404():
    with pytest.raises(ApiError) as raised:
        convert.check_model(chat(model="other"), "m")
    assert (raised.value.status, raised.value.code, raised.value.param) == (404, "model_not_found", "model")


@pytest.mark.parametrize("error,status,kind", [
    (engine_errors.InvalidRequestError("x"), 400, "invalid_request_error"),
    (engine_errors.LimitExceededError("x"), 400, "invalid_request_error"),
    (engine_errors.GrammarError("x"), 400, "invalid_request_error"),
    (engine_errors.QueueFullError("x"), 429, "rate_limit_error"),
    (engine_errors.GrammarUnavailableError("x"), 503, "service_unavailable"),
    (engine_errors.ShuttingDownError("x"), 503, "service_unavailable"),
    (engine_errors.DeadlineExceededError("x"), 504, "timeout"),
    (engine_errors.EngineError("x"), 500, "server_error"),
    (ValueError("top_p must be in (0, 1], got 0"), 400, "invalid_request_error"),
    (RuntimeError("a bug"), 500, "server_error"),
])
def test_errors_take_the_http_status_of_their_grpc_status(error, status, kind):
    api_error = ApiError.of(error)
    assert (api_error.status, api_error.type) == (status, kind)
    assert set(api_error.body()["error"]) == {"message", "type", "param", "code"}


def test_error_param_is_the_request_field_a_domain_message_names():
    assert ApiError.of(ValueError("top_p must be in (0, 1], got 0")).param == "top_p"
    assert ApiError.of(ValueError("stop_strings must not contain an empty string")).param == "stop"
    assert ApiError.of(engine_errors.LimitExceededError("the prompt has 9 tokens")).param is None
    assert "a bug" not in ApiError.of(RuntimeError("a bug")).message  # internals stay in the log
