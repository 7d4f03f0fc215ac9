"""The OpenAI-compatible HTTP API of the session's real `structgen serve` (--http-port), driven
by the official `openai` SDK (sync, async, streaming, parse, tools) and curl. Every
constrained output is validated against its schema here, not only by the server."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from urllib.parse import urlsplit

import jsonschema
import openai
import pydantic
import pytest

# strict (our strict mode) refuses keywords a backend does not enforce: only such keywords here
PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
# Short names and enums: a forced call costs the model more tokens than its characters, and
# the session server's max_new_tokens_limit is 64.
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["rome", "oslo"]}},
                                                "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
FULL = {"structgen": {"ignore_eos": True}}  # every max_tokens token: the finish reason is "length"
TIGHT = {"structgen": {"max_whitespace": 1}}  # random weights: whitespace runs would fill max_tokens


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(pattern=r"^[a-z]{1,8}$")
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def api(live_server) -> openai.OpenAI:
    assert live_server.http_url, "the session server was started without --http-port"
    with openai.OpenAI(base_url=live_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(api) -> str:
    return api.models.list().data[0].id


def test_models_and_health(api, live_server, client):
    models = api.models.list().data
    assert [m.id for m in models] == [client.model_info().model_name]
    assert api.models.retrieve(models[0].id).id == models[0].id
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("no-such-model")
    health = subprocess.run(["curl", "-sS", "-w", " %{http_code}", live_server.http_url + "/health"],
                            capture_output=True, text=True, timeout=30)
    assert health.stdout == '{"status":"ok"} 200'


def test_chat_is_the_same_engine_as_grpc(api, model, client):
    completion = api.chat.completions.create(model=model, messages=CHAT, max_tokens=12, extra_body=FULL)
    grpc_text = client.generate_text(messages=CHAT, max_tokens=12, ignore_eos=True).text
    choice = completion.choices[0]
    assert choice.message.content == grpc_text and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and completion.object == "chat.completion"
    usage = completion.usage
    assert usage.completion_tokens == 12 and usage.prompt_tokens == len(client.tokenize(messages=CHAT))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(api, model):
    import secrets
    system = f"[{secrets.token_hex(4)}] Answer in one short sentence and stay polite. " * 6  # no earlier prompt's
    ask = lambda question: api.chat.completions.create(  # noqa: E731
        model=model, max_tokens=4, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    first, second = ask("What is a cat?"), ask("What is a dog?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_stream_with_usage_adds_up_to_the_whole_answer(api, model):
    whole = api.chat.completions.create(model=model, messages=CHAT, max_tokens=10, extra_body=FULL)
    chunks = list(api.chat.completions.create(model=model, messages=CHAT, max_tokens=10, stream=True,
                                              stream_options={"include_usage": True}, extra_body=FULL))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason] == ["length"]


def test_stream_without_usage_has_no_usage_chunk(api, model):
    chunks = list(api.chat.completions.create(model=model, messages=CHAT, max_tokens=4, stream=True,
                                              extra_body=FULL))
    assert all(c.choices and c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_client_serves_concurrent_requests(live_server, model):
    async def main():
        async with openai.AsyncOpenAI(base_url=live_server.http_url + "/v1", api_key="unused",
                                      max_retries=0, timeout=120) as aapi:
            answers = await asyncio.gather(*[aapi.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=6,
                temperature=1.0, seed=i, extra_body=FULL) for i in range(6)])
            stream = await aapi.chat.completions.create(model=model, messages=CHAT, max_tokens=5, stream=True,
                                                        extra_body=FULL)
            streamed = [chunk async for chunk in stream]
        return answers, streamed

    answers, streamed = asyncio.run(main())
    assert [a.usage.completion_tokens for a in answers] == [6] * 6
    assert streamed[-1].choices[0].finish_reason == "length"


def test_seed_reproduces_and_n_gives_each_choice_its_own_seed(api, model):
    ask = dict(model=model, messages=CHAT, max_tokens=8, temperature=1.0, seed=42, n=3)
    first, second = api.chat.completions.create(**ask), api.chat.completions.create(**ask)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    single = api.chat.completions.create(**{**ask, "n": 1, "seed": 43})
    assert single.choices[0].message.content == texts[1]  # choice i draws with seed + i


def test_parse_with_a_pydantic_model_is_valid_and_reports_its_guarantee(api, model):
    completion = api.chat.completions.parse(model=model, messages=CHAT, response_format=Person, max_tokens=48,
                                            extra_body=TIGHT)
    choice = completion.choices[0]
    assert isinstance(choice.message.parsed, Person)
    jsonschema.validate(json.loads(choice.message.content), Person.model_json_schema())
    extension = choice.model_extra["structgen"]
    assert extension["validation"]["status"] == "valid" and extension["finish_reason"] == "grammar_complete"
    assert extension["guarantee"]["unenforced"] == [] and extension["guarantee"]["backend"]


def test_json_schema_stream_carries_guarantee_first_and_validation_last(api, model):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chunks = list(api.chat.completions.create(model=model, messages=CHAT, max_tokens=48, stream=True,
                                              response_format=response_format, extra_body=TIGHT))
    extensions = [c.choices[0].model_extra.get("structgen") for c in chunks]
    first = next(e for e in extensions if e)
    assert "guarantee" in first and "validation" not in first
    assert extensions[-1]["validation"]["status"] == "valid"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_mode_gives_an_object(api, model):
    completion = api.chat.completions.create(model=model, messages=CHAT, max_tokens=48, temperature=1.0, seed=3,
                                             response_format={"type": "json_object"},
                                             extra_body={"structgen": {"compact": True}})
    text = completion.choices[0].message.content
    assert text.startswith("{")
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # random weights may ramble inside a string: still a JSON object prefix
        assert completion.choices[0].finish_reason == "length"


def test_text_response_format_is_free_text(api, model):
    free = api.chat.completions.create(model=model, messages=CHAT, max_tokens=6)
    text = api.chat.completions.create(model=model, messages=CHAT, max_tokens=6, response_format={"type": "text"})
    assert text.choices[0].message.content == free.choices[0].message.content
    assert "structgen" not in (text.choices[0].model_extra or {})


def test_strict_refuses_a_schema_the_grammar_cannot_enforce(api, model):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    response_format = {"type": "json_schema", "json_schema": {"name": "ids", "schema": schema, "strict": True}}
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        api.chat.completions.create(model=model, messages=CHAT, max_tokens=8, response_format=response_format)
    lenient = {"type": "json_schema", "json_schema": {"name": "ids", "schema": schema}}
    completion = api.chat.completions.create(model=model, messages=CHAT, max_tokens=8, response_format=lenient)
    unenforced = completion.choices[0].model_extra["structgen"]["guarantee"]["unenforced"]
    assert [k["keyword"] for k in unenforced] == ["uniqueItems"]


def _arguments_valid(call, tools) -> dict:
    tool = next(t for t in tools if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "clock"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_are_valid_calls(api, model, tool_choice):
    tools = [WEATHER, CLOCK]
    completion = api.chat.completions.create(model=model, messages=CHAT, max_tokens=64, tools=tools,
                                             tool_choice=tool_choice, parallel_tool_calls=False, extra_body=TIGHT)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert call.function.name == "clock"
    _arguments_valid(call, tools)
    assert [v["status"] for v in choice.model_extra["structgen"]["tool_call_validations"]] == ["valid"]


def test_streamed_tool_call_matches_the_whole_answer(api, model):
    ask = dict(model=model, messages=CHAT, max_tokens=64, tools=[WEATHER], tool_choice="required",
               parallel_tool_calls=False, extra_body=TIGHT)
    whole = api.chat.completions.create(**ask).choices[0].message.tool_calls[0]
    deltas = [d for chunk in api.chat.completions.create(**ask, stream=True)
              for d in (chunk.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "weather", whole.function.arguments)]


def test_calls_within_max_tokens_never_leak_into_content(api, model):
    """tool_choice required: max_tokens below the shortest call is a 400 naming the minimum. With room
    for calls, the built-in model (greedy, it prefers a newline and a new call to the end of its turn)
    writes one call after another; the complete ones are calls, and a call max_tokens cuts short is
    `structgen.incomplete_tool_call` with finish_reason length, never content."""
    ask = [{"role": "user", "content": "What is the weather in Rome?"}]
    with pytest.raises(openai.BadRequestError, match=r"set max_tokens to at least \d+"):
        api.chat.completions.create(model=model, messages=ask, max_tokens=12, tools=[WEATHER], tool_choice="required")
    choice = api.chat.completions.create(model=model, messages=ask, max_tokens=64, tools=[WEATHER],
                                         tool_choice="required").choices[0]
    assert choice.message.content is None and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        _arguments_valid(call, [WEATHER])
    cut = (choice.model_extra.get("structgen") or {}).get("incomplete_tool_call")
    assert (choice.finish_reason == "length") == bool(cut), choice
    assert not cut or cut.startswith("<tool_call>\n{"), cut


def test_auto_tool_choice_answers_with_text_or_valid_calls(api, model):
    completion = api.chat.completions.create(model=model, messages=CHAT, max_tokens=24, tools=[WEATHER, CLOCK],
                                             extra_body=TIGHT)
    choice = completion.choices[0]
    for call in choice.message.tool_calls or []:
        _arguments_valid(call, [WEATHER, CLOCK])
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert "<tool_call>" not in (choice.message.content or "")


def test_text_completions_batch_prompts_with_logprobs(api, model, client):
    completion = api.completions.create(model=model, prompt=["Once upon", "The answer is"], n=2, max_tokens=5,
                                        logprobs=2, extra_body=FULL)
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert completion.choices[2].text == client.generate_text("The answer is", max_tokens=5, ignore_eos=True).text
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == 5 and all(len(top) == 2 for top in logprobs.top_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.token_logprobs[0] == pytest.approx(max(logprobs.top_logprobs[0].values()))  # greedy
    assert completion.usage.prompt_tokens == (len(client.tokenize("Once upon")) + len(client.tokenize("The answer is")))


def test_text_completion_stream_and_token_prompt(api, model, client):
    ids = client.tokenize("Hello")
    chunks = list(api.completions.create(model=model, prompt=ids, max_tokens=6, stream=True,
                                         stream_options={"include_usage": True}, extra_body=FULL))
    grpc_text = client.generate_text(token_ids=ids, max_tokens=6, ignore_eos=True).text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == grpc_text
    assert chunks[-1].usage.completion_tokens == 6


def test_chat_logprobs(api, model):
    completion = api.chat.completions.create(model=model, messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=3,
                                             extra_body=FULL)
    content = completion.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == completion.choices[0].message.content
    assert all(bytes(t.bytes).decode() == t.token for t in content)


def test_stop_string_is_not_returned(api, model):
    ask = dict(model=model, messages=CHAT, max_tokens=12, extra_body=FULL)
    free = api.chat.completions.create(**ask).choices[0].message.content
    stop = free[len(free) // 2:len(free) // 2 + 3]
    stopped = api.chat.completions.create(**ask, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.message.content == free[:free.index(stop)]


BAD_REQUESTS = [
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"presence_penalty": -3.0}, "presence_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"extra_body": {"min_p": 1.5}}, "min_p"), ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_tokens": 5}}, "min_tokens"), ({"extra_body": {"bogus": 1}}, "bogus"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"), ({"max_tokens": 65}, "max_tokens"),
    ({"max_completion_tokens": 1000}, "max_completion_tokens"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"top_p": 0.0}, "top_p"), ({"temperature": -1}, "temperature"), ({"temperature": 5}, "temperature"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, None),
]


@pytest.mark.parametrize("options,param", BAD_REQUESTS, ids=[str(p) for _, p in BAD_REQUESTS])
def test_bad_requests_are_400_naming_the_parameter(api, model, options, param, client):
    ask = dict(model=model, messages=CHAT, max_tokens=4) | options
    with pytest.raises(openai.BadRequestError) as raised:
        api.chat.completions.create(**ask)
    error = raised.value.body
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param and param.split(".")[0] in error["message"]
    assert client.model_info().model_name == model  # the server keeps serving


def test_completions_refuse_echo_best_of_and_suffix(api, model):
    for options in ({"echo": True}, {"best_of": 2}, {"suffix": "end"}):
        with pytest.raises(openai.BadRequestError, match=next(iter(options))):
            api.completions.create(model=model, prompt="Hi", max_tokens=2, **options)


def test_unknown_model_is_404(api):
    with pytest.raises(openai.NotFoundError) as raised:
        api.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert raised.value.body["code"] == "model_not_found"


def _curl(url: str, *args: str) -> tuple[str, int]:
    result = subprocess.run(["curl", "-sS", "-N", "-w", "\n%{http_code}", *args, url], capture_output=True,
                            text=True, timeout=60)
    body, _, code = result.stdout.rpartition("\n")
    return body, int(code)


def test_curl_sse_stream_and_errors(live_server, model):
    url = live_server.http_url
    body = json.dumps({"model": model, "messages": CHAT, "max_tokens": 5, "stream": True,
                       "stream_options": {"include_usage": True}})
    text, code = _curl(url + "/v1/chat/completions", "-H", "content-type: application/json", "-d", body)
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert code == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and chunks[-1]["usage"]["completion_tokens"] == 5
    text, code = _curl(url + "/v1/chat/completions", "-H", "content-type: application/json", "-d", "{not json")
    assert code == 400 and set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    text, code = _curl(url + "/v1/nothing-here")
    assert code == 404 and json.loads(text)["error"]["type"] == "not_found_error"


def test_curl_without_a_content_type_and_a_malformed_body(live_server, model):
    """`curl -d` sends application/x-www-form-urlencoded: the body is JSON all the same. A body
    that is not JSON is a 400 that says where, with no parameter named."""
    url = live_server.http_url + "/v1/chat/completions"
    body = json.dumps({"model": model, "messages": CHAT, "max_tokens": 2})
    text, code = _curl(url, "-d", body)
    assert code == 200 and json.loads(text)["usage"]["completion_tokens"] == 2, text
    text, code = _curl(url, "-H", "content-type: application/json", "-d", body[:-1] + ",}")
    error = json.loads(text)["error"]
    assert code == 400 and error["param"] is None, error
    assert error["message"].startswith(f"the request body is not valid JSON (character {len(body)}): "), error


def _raw_request(url: str, body: dict) -> socket.socket:
    """An HTTP request on a plain socket, to hang up on it mid-answer."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_cancels_the_requests(live_server, model, client, wait_idle, stream):
    before = client.engine_stats().num_tokens_generated
    ask = {"model": model, "messages": CHAT, "max_tokens": 64, "n": 4, "stream": stream,
           "structgen": {"ignore_eos": True}}
    sock = _raw_request(live_server.http_url, ask)
    deadline = time.monotonic() + 30
    while client.engine_stats().num_running < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    wait_idle()
    generated = client.engine_stats().num_tokens_generated - before
    assert generated < 4 * 64, "the requests ran to the end after the client had gone"


def test_return_token_ids_gives_the_engine_tokens(api, model, client):
    ids = client.tokenize("Hello")
    chunks = list(api.completions.create(model=model, prompt=ids, max_tokens=6, stream=True,
                                         extra_body={"structgen": {"return_token_ids": True}}))
    streamed = [t for c in chunks for t in (c.choices[0].model_extra.get("structgen") or {}).get("token_ids", [])]
    whole = api.completions.create(model=model, prompt=ids, max_tokens=6,
                                   extra_body={"structgen": {"return_token_ids": True}})
    grpc_ids = [t for chunk in client.generate(token_ids=ids, max_tokens=6) for t in chunk.token_ids]
    assert streamed == whole.choices[0].model_extra["structgen"]["token_ids"] == grpc_ids
