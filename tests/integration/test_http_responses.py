"""`POST /v1/responses` of the session's real `structgen serve`, driven by the official openai
SDK as its users call it: `client.responses.create` (whole and streamed), `.parse` and the
`.stream` helper, function tools and a tool round trip. Every structured output is validated
here against its schema."""
from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

WEATHER = {"type": "function", "name": "weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["rome", "oslo"]}}, "required": ["city"],
    "additionalProperties": False}}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(pattern=r"^[A-Z][a-z]{1,11}$")
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def api(live_server) -> openai.OpenAI:
    with openai.OpenAI(base_url=live_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(api) -> str:
    return api.models.list().data[0].id


def test_text_with_instructions_and_the_parameters_a_server_may_ignore(api, model):
    response = api.responses.create(model=model, instructions="Be brief.", input="Say hello.", max_output_tokens=8,
                                    store=False, metadata={"team": "a"}, service_tier="auto", user="u1",
                                    truncation="disabled")
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and response.output_text == message.content[0].text != ""
    assert response.usage.output_tokens == 8 and response.usage.total_tokens == response.usage.input_tokens + 8
    assert response.metadata == {"team": "a"} and response.instructions == "Be brief."


def test_parse_gives_a_valid_object_and_the_guarantee(api, model):
    response = api.responses.parse(model=model, input="Invent a person.", text_format=Person, max_output_tokens=64)
    assert response.status == "completed" and isinstance(response.output_parsed, Person)
    jsonschema.validate(json.loads(response.output_text), Person.model_json_schema())
    extension = response.model_extra["structgen"]
    assert extension["validation"]["status"] == "valid" and extension["guarantee"]["unenforced"] == []


def test_streamed_events_build_the_same_response(api, model):
    schema = {**Person.model_json_schema(), "additionalProperties": False}
    ask = dict(model=model, input="Invent a person.", max_output_tokens=64,
               text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
    whole = api.responses.create(**ask)
    events = list(api.responses.create(**ask, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == whole.output_text
    with api.responses.stream(model=model, input="Invent a person.", text_format=Person,
                              max_output_tokens=64) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == Person.model_validate_json(whole.output_text)


def test_function_call_and_its_output_sent_back(api, model):
    response = api.responses.create(model=model, input="What is the weather in Rome?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=64)
    [call] = response.output
    assert response.status == "completed" and call.type == "function_call" and call.name == "weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert call.call_id.startswith("call_") and response.output_text == ""
    answer = api.responses.create(model=model, tools=[WEATHER], max_output_tokens=16, input=[
        {"role": "user", "content": "What is the weather in Rome?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert answer.output[0].type == "message" and answer.output_text
    streamed = [e for e in api.responses.create(model=model, input="What is the weather in Rome?", tools=[WEATHER],
                                                tool_choice="required", parallel_tool_calls=False,
                                                max_output_tokens=64, stream=True)]
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [(i.type, i.name, i.arguments) for i in done] == [("function_call", call.name, call.arguments)]


@pytest.mark.parametrize("options, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"), ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"), ({"temperature": 3}, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
])
def test_what_it_cannot_do_is_a_400_naming_the_parameter(api, model, options, param):
    with pytest.raises(openai.BadRequestError) as raised:
        api.responses.create(model=model, input="Hi", max_output_tokens=4, **options)
    assert raised.value.body["param"].startswith(param), raised.value.body


def test_chat_completions_accept_store_metadata_and_service_tier(api, model):
    completion = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                             store=False, metadata={"team": "a"}, service_tier="auto")
    assert completion.usage.completion_tokens == 2
