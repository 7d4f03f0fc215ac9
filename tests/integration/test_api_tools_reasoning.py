"""Tool calls and the reasoning span end to end: one real `structgen serve` per chat family
(tests/chat_checkpoints.py: a random-weight checkpoint carrying the family's chat template
and special tokens), driven over gRPC by the Python client, the CLI and the Node example,
and over the OpenAI-compatible HTTP API by the openai SDK.

The weights are random, so what the model says is noise; the grammar makes it a call to a
listed tool with arguments valid for that tool's schema, or (Qwen3) a reasoning span and then
the constrained answer. Every call is checked here with jsonschema, beside the server's own
validation.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jsonschema
import pytest

from chat_checkpoints import write_checkpoint
from live_server import start_serve, stop_serve
from ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
# city: a pattern, not maxLength: random byte-level tokens can close a string on bytes that are
# no valid UTF-8, which decode to more characters than the grammar counted (the call's
# validation then says so; these tests want calls that validate)
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
CLOCK = {"name": "get_time", "description": "Time in a zone", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Weather in Paris?"}]
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer"}},
          "required": ["answer", "score"], "additionalProperties": False}
FORMATS = {"qwen3": "hermes", "llama3": "llama3_json", "mistral": "mistral"}
# whitespace runs capped: a random model would otherwise spend its tokens on them
CALLS = dict(tools=TOOLS, max_whitespace=1, max_tokens=160, temperature=1.0)


def _check_calls(calls, tools=TOOLS):
    schemas = {tool["name"]: tool["parameters"] for tool in tools}
    assert calls
    for call in calls:
        jsonschema.validate(call.parsed_arguments, schemas[call.name])
        assert call.validation.status == "valid" and call.id.startswith("call_")
    assert len({call.id for call in calls}) == len(calls)


@pytest.fixture(scope="module", params=list(FORMATS))
def family_server(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = write_checkpoint(request.param, folder / "model")
    server = start_serve(["--model", model, f"--http-port={free_port()}", "--max-new-tokens-limit=400"],
                         folder / "serve.log")
    server.family, server.folder = request.param, folder / "model"
    yield server
    assert stop_serve(server) == 0, server.log_text()[-3000:]


@pytest.fixture(scope="module")
def family_client(family_server):
    from structgen_client import Client
    with Client(family_server.address, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-reasoning")
    server = start_serve(["--model", write_checkpoint("qwen3", folder / "model"), f"--http-port={free_port()}",
                          "--max-new-tokens-limit=400"], folder / "serve.log")
    server.folder = folder / "model"
    yield server
    assert stop_serve(server) == 0, server.log_text()[-3000:]


@pytest.fixture(scope="module")
def qwen3(qwen3_server):
    from structgen_client import Client
    with Client(qwen3_server.address, timeout=120) as client:
        yield client


# ---- tools, per family ----------------------------------------------------------------------
def test_model_info_names_the_template_format(family_server, family_client):
    info = family_client.model_info()
    assert info.tool_call_format == FORMATS[family_server.family]
    assert (info.reasoning_begin, info.reasoning_end) == (
        ("<think>", "</think>") if family_server.family == "qwen3" else ("", ""))


@pytest.mark.parametrize("seed", [1, 2])
def test_required_calls_are_parsed_and_valid(family_client, seed):
    completion = family_client.generate_text(messages=ASK, tool_choice="required", seed=seed, **CALLS)
    _check_calls(completion.tool_calls)
    # never cut by max_tokens: near its budget the turn begins no call it cannot finish
    assert completion.finish_reason in ("grammar_complete", "budget_closed") and completion.validation is None
    assert completion.text == "" and completion.incomplete_tool_call == ""  # calls only, every one parsed


def test_a_call_that_cannot_fit_max_tokens_is_refused_naming_the_minimum(family_server, family_client):
    """max_tokens below the shortest call tool_choice required allows: INVALID_ARGUMENT over gRPC and a
    400 over HTTP, each naming the max_tokens that fits (the grammar closes a turn within its budget,
    so a call is never cut short)."""
    from openai import BadRequestError, OpenAI
    from structgen_client.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"set max_tokens to at least \d+"):
        family_client.generate_text(messages=ASK, tool_choice="required", seed=1, **{**CALLS, "max_tokens": 6})
    api = OpenAI(base_url=f"{family_server.http_url}/v1", api_key="none", max_retries=0)
    with pytest.raises(BadRequestError, match=r"set max_tokens to at least \d+"):
        api.chat.completions.create(
            model="model", messages=ASK, tools=[{"type": "function", "function": tool} for tool in TOOLS],
            tool_choice="required", max_tokens=6, temperature=1.0, seed=1,
            extra_body={"structgen": {"max_whitespace": 1}})


def test_named_single_call_stops_after_the_call(family_client):
    completion = family_client.generate_text(messages=ASK, tool_choice="get_time", seed=3, **CALLS)
    [call] = completion.tool_calls
    assert call.name == "get_time" and completion.finish_reason == "grammar_complete"
    _check_calls([call])


def test_llguidance_enforces_the_calls_too(family_client):
    """(llguidance takes no max_whitespace: its masks admit whitespace its matcher refuses)"""
    completion = family_client.generate_text(messages=ASK, tools=TOOLS, tool_choice="get_time", backend="llguidance",
                                             max_tokens=300, temperature=1.0, seed=3)
    assert completion.guarantee.backend == "llguidance" and completion.finish_reason == "grammar_complete"
    [call] = completion.tool_calls
    _check_calls([call])


def test_auto_answers_with_text_or_valid_calls(family_client):
    for seed in range(3):
        completion = family_client.generate_text(messages=ASK, seed=seed, single_tool_call=True, **CALLS)
        if completion.tool_calls:
            _check_calls(completion.tool_calls)
        assert completion.finish_reason in ("grammar_complete", "budget_closed", "max_tokens", "stop_token")


def test_streamed_calls_arrive_in_their_own_field(family_client):
    chunks = list(family_client.generate(messages=ASK, tool_choice="required", seed=4, **CALLS))
    calls = [call for chunk in chunks for call in chunk.tool_calls]
    _check_calls(calls)
    assert all(call.name not in chunk.text for chunk in chunks for call in calls)


def test_a_tool_conversation_renders_as_generate_renders_it(family_server, family_client):
    from generation_service.model.tokenizer import Tokenizer

    turns = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "user", "content": "And now?"}]
    ids = family_client.tokenize(messages=turns, tools=TOOLS)
    expected = [{**m, "tool_calls": [{"id": c["id"], "type": "function", "function": {
        "name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]} if "tool_calls" in m else m
        for m in turns]
    entries = [{"type": "function", "function": tool} for tool in TOOLS]
    assert ids == Tokenizer(family_server.folder).apply_chat_template(expected, tools=entries)
    completion = family_client.generate_text(messages=turns, tool_choice="required", seed=5, **CALLS)
    _check_calls(completion.tool_calls)


def test_bad_tool_requests_are_refused_with_the_field_named(family_client):
    from structgen_client import InvalidArgumentError

    cases = [(dict(prompt="x", tools=TOOLS), "chat input"),
             (dict(messages=ASK, tools=TOOLS, tool_choice="launch"), "not among the tools"),
             (dict(messages=ASK, tool_choice="required"), "needs tools"),
             (dict(messages=ASK, tools=TOOLS, json_schema=ANSWER), "together with tools"),
             (dict(messages=ASK, tools=[WEATHER, WEATHER]), "unique"),
             (dict(messages=ASK, tools=[{"name": "bad name"}]), r"tools\[0\]"),
             (dict(messages=ASK, tools=TOOLS, compact=True), "compact")]
    for options, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            family_client.generate_text(**options)


def test_openai_sdk_gets_parsed_tool_calls(family_server):
    from openai import OpenAI

    api = OpenAI(base_url=f"{family_server.http_url}/v1", api_key="none", max_retries=0)
    openai_tools = [{"type": "function", "function": tool} for tool in TOOLS]
    completion = api.chat.completions.create(
        model="model", messages=ASK, tools=openai_tools, tool_choice="required", parallel_tool_calls=False,
        max_tokens=160, temperature=1.0, seed=6, extra_body={"structgen": {"max_whitespace": 1}})
    choice = completion.choices[0]
    [call] = choice.message.tool_calls
    schema = next(t["parameters"] for t in TOOLS if t["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [v["status"] for v in choice.model_extra["structgen"]["tool_call_validations"]] == ["valid"]


# ---- the reasoning span (Qwen3's template) ----------------------------------------------------
def _span_tokens(client, qwen3_server, completion) -> list[int]:
    """Token ids between <think> and </think> in a completion."""
    from generation_service.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(qwen3_server.folder)
    ids = list(completion.token_ids)
    begin, end = tokenizer.token_id("<think>"), tokenizer.token_id("</think>")
    assert ids[0] == begin and end in ids, ids
    return ids[1:ids.index(end)]


@pytest.mark.parametrize("budget", [0, 6, 40])
def test_reasoning_then_a_json_schema_answer_within_the_budget(qwen3, qwen3_server, budget):
    completion = qwen3.generate_text(messages=ASK, json_schema=ANSWER, reasoning=True, reasoning_max_tokens=budget,
                                     max_whitespace=1, max_tokens=300, temperature=1.0, seed=budget)
    assert len(_span_tokens(qwen3, qwen3_server, completion)) <= budget
    assert "<think>" not in completion.reasoning and "</think>" not in completion.reasoning
    assert completion.finish_reason == "grammar_complete"
    jsonschema.validate(json.loads(completion.text), ANSWER)  # the content alone, reasoning apart
    assert completion.validation.status == "valid"
    if budget == 0:
        assert completion.reasoning == ""


def test_reasoning_budget_holds_under_speculative_decoding(qwen3, qwen3_server):
    """Drafts are verified with one mask row per position and rolled back through the span."""
    completion = qwen3.generate_text(messages=ASK, json_schema=ANSWER, reasoning=True, reasoning_max_tokens=9,
                                     max_whitespace=1, max_tokens=300, temperature=1.0, seed=20,
                                     num_draft_tokens=3, proposer="ngram")
    assert completion.usage.draft_tokens_proposed > 0
    assert len(_span_tokens(qwen3, qwen3_server, completion)) <= 9
    assert completion.finish_reason == "grammar_complete" and completion.validation.status == "valid"
    jsonschema.validate(json.loads(completion.text), ANSWER)


def test_reasoning_streams_apart_from_the_content(qwen3):
    chunks = list(qwen3.generate(messages=ASK, regex="(yes|no)", reasoning=True, reasoning_max_tokens=20,
                                 max_tokens=100, temperature=1.0, seed=7))
    reasoning = "".join(chunk.reasoning_text for chunk in chunks)
    content = "".join(chunk.text for chunk in chunks)
    assert content in ("yes", "no") and chunks[-1].finish_reason == "grammar_complete"
    assert "</think>" not in reasoning and reasoning == qwen3.generate_text(
        messages=ASK, regex="(yes|no)", reasoning=True, reasoning_max_tokens=20, max_tokens=100,
        temperature=1.0, seed=7).reasoning


def test_reasoning_on_llguidance_and_its_budget_refusal(qwen3):
    from structgen_client import InvalidArgumentError

    completion = qwen3.generate_text(messages=ASK, json_schema=ANSWER, reasoning=True, backend="llguidance",
                                     compact=True, max_tokens=300, temperature=1.0, seed=8)
    assert completion.guarantee.backend == "llguidance" and completion.validation.status == "valid"
    assert completion.finish_reason in ("grammar_complete", "budget_closed", "max_tokens")
    with pytest.raises(InvalidArgumentError, match="xgrammar"):
        qwen3.generate_text(messages=ASK, json_schema=ANSWER, reasoning=True, reasoning_max_tokens=5,
                            backend="llguidance", compact=True)


def test_reasoning_then_tool_calls(qwen3):
    completion = qwen3.generate_text(messages=ASK, tool_choice="required", reasoning=True, reasoning_max_tokens=10,
                                     seed=9, **CALLS)
    _check_calls(completion.tool_calls)
    assert "<tool_call>" not in completion.reasoning


def test_enable_thinking_reaches_the_template(qwen3):
    from structgen_client import Client  # noqa: F401  (the fixture's client)

    off = qwen3.tokenize(messages=ASK, reasoning=False)
    default = qwen3.tokenize(messages=ASK)
    assert off[:len(default)] == default and len(off) > len(default)  # the empty span of Qwen3's template
    completion = qwen3.generate_text(messages=ASK, json_schema=ANSWER, reasoning=False, max_whitespace=1,
                                     max_tokens=200, temperature=1.0, seed=10)
    assert completion.reasoning == "" and completion.validation.status == "valid"


def test_markers_given_in_the_request(qwen3):
    completion = qwen3.generate_text(prompt="Think, then answer: ", regex="(yes|no)", reasoning=True,
                                     reasoning_markers=("[R]", "[/R]"), reasoning_max_tokens=8, max_tokens=100,
                                     temperature=1.0, seed=11)
    assert completion.text in ("yes", "no") and "[/R]" not in completion.reasoning


def test_special_tokens_are_no_text_in_a_budgeted_span_and_its_answer(client):
    """A budget takes xgrammar, which matched a special token as the text it spells; the served
    text leaves special tokens out, so the span lost them and a string holding one validated
    shorter than its minLength (benchmarks/serve.py --plan features saw an invalid answer).
    Biased to the session model's <|im_start|> (special, 12 characters), then to a letter."""
    special, [letter] = 1, client.tokenize("a")
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 13, "maxLength": 16}},
              "required": ["name"], "additionalProperties": False}
    completion = client.generate_text("x", json_schema=schema, compact=True, reasoning=True, reasoning_max_tokens=4,
                                      reasoning_markers=("<think>", "</think>"), max_tokens=64,
                                      logit_bias={special: 100.0, letter: 50.0})
    assert completion.guarantee.backend == "xgrammar" and completion.finish_reason == "grammar_complete"
    assert completion.validation.status == "valid", (completion.text, completion.validation)
    assert json.loads(completion.text)["name"] == "a" * 16 and completion.reasoning == "a" * 4


def test_openai_sdk_reasoning_content(qwen3_server):
    from openai import OpenAI

    api = OpenAI(base_url=f"{qwen3_server.http_url}/v1", api_key="none", max_retries=0)
    ask = dict(model="model", messages=ASK, max_tokens=300, temperature=1.0, seed=12,
               response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
               extra_body={"structgen": {"reasoning": {"enabled": True, "max_tokens": 16}, "max_whitespace": 1}})
    message = api.chat.completions.create(**ask).choices[0].message
    jsonschema.validate(json.loads(message.content), ANSWER)
    streamed = list(api.chat.completions.create(**ask, stream=True))
    deltas = [chunk.choices[0].delta for chunk in streamed if chunk.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == message.model_extra["reasoning_content"]
    assert "".join(d.content or "" for d in deltas) == message.content


# ---- the CLI and the Node example -----------------------------------------------------------
def _tools_file(tmp_path) -> str:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS))
    return str(path)


def test_cli_prints_calls_as_json_lines(family_server, tmp_path):
    result = subprocess.run([sys.executable, "-m", "structgen.cli", "generate", "--server", family_server.address,
                             "--tools", _tools_file(tmp_path), "--tool-choice", "get_weather", "--max-whitespace", "1",
                             "--max-tokens", "160", "--temperature", "1", "--seed", "13", "Weather?"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    [call] = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    jsonschema.validate(call["arguments"], next(t["parameters"] for t in TOOLS if t["name"] == call["name"]))


def test_cli_reasoning_goes_to_stderr_and_the_answer_to_stdout(qwen3_server, tmp_path):
    schema = tmp_path / "answer.json"
    schema.write_text(json.dumps(ANSWER))
    result = subprocess.run([sys.executable, "-m", "structgen.cli", "generate", "--server", qwen3_server.address,
                             "--chat", "--reasoning", "--reasoning-max-tokens", "8", "--json-schema", str(schema),
                             "--max-whitespace", "1", "--max-tokens", "200", "--temperature", "1", "--seed", "14",
                             "Answer."], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), ANSWER)


def test_node_example_with_tools_and_reasoning(qwen3_server, tmp_path):
    from test_clients_node import CLIENT, _node

    result = subprocess.run([_node(), str(CLIENT), "--server", qwen3_server.address, "--tools", _tools_file(tmp_path),
                             "--tool-choice", "get_time", "--reasoning", "--reasoning-max-tokens", "6",
                             "--max-whitespace", "1", "--max-tokens", "160", "--temperature", "1", "--seed", "15",
                             "Weather?"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "NODE_NO_WARNINGS": "1"})
    assert result.returncode == 0, result.stderr
    [call] = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    jsonschema.validate(call["arguments"], next(t["parameters"] for t in TOOLS if t["name"] == call["name"]))
