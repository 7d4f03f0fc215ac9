"""Close on budget through the real server: outputs end valid before max_tokens, or are refused.

The session server's model (SmolLM2) samples at temperature 1.0, so left alone it keeps
writing; every output below is validated here with jsonschema, not only by the server.
"""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest
from structgen_client.errors import InvalidArgumentError

OPEN = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}  # the schema
TAGS = {"type": "object", "properties": {"title": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "string"}}}, "required": ["title", "tags"]}
NESTED = {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                           "lines": {"type": "array", "minItems": 2, "items": {
                                               "type": "object", "properties": {"qty": {"type": "integer"}},
                                               "required": ["qty"]}}},
          "required": ["id", "lines"]}


def _shortest(client, schema: dict, **options) -> int:
    with pytest.raises(InvalidArgumentError) as refused:
        client.generate_text("x", json_schema=schema, max_tokens=1, **options)
    return int(re.search(r"set max_tokens to at least (\d+)", str(refused.value)).group(1))


@pytest.mark.parametrize("schema", [OPEN, TAGS, NESTED], ids=["open", "tags", "nested"])
@pytest.mark.parametrize("compact", [True, False], ids=["compact", "whitespace"])
def test_outputs_at_small_budgets_close_valid(client, schema, compact):
    shortest = _shortest(client, schema, compact=compact)
    for max_tokens in (shortest, shortest + 3, 2 * shortest):
        for seed in range(2):
            done = client.generate_text("Write it:", json_schema=schema, compact=compact, max_tokens=max_tokens,
                                        temperature=1.0, seed=seed)
            assert done.finish_reason in ("budget_closed", "grammar_complete"), (max_tokens, done.text)
            assert len(done.token_ids) <= max_tokens
            jsonschema.validate(json.loads(done.text), schema)
            assert done.validation.valid


def test_the_finish_reason_says_when_closing_acted(client):
    """At the shortest output's budget the masks must steer; far from it they need not."""
    shortest = _shortest(client, TAGS, compact=True)
    steered = client.generate_text("Tags:", json_schema=TAGS, compact=True, max_tokens=shortest,
                                   temperature=1.0, seed=5)
    assert steered.finish_reason == "budget_closed" and len(steered.token_ids) == shortest
    free = client.generate_text("Tags:", json_schema={"enum": ["yes", "no"]}, max_tokens=64)
    assert free.finish_reason == "grammar_complete"


def test_a_budget_below_the_shortest_output_is_refused_naming_it(client):
    shortest = _shortest(client, NESTED, compact=True)
    with pytest.raises(InvalidArgumentError, match=f"max_tokens {shortest - 1} is below the shortest output .*"
                                                   f"at least {shortest}"):
        client.generate_text("x", json_schema=NESTED, compact=True, max_tokens=shortest - 1)
    ok = client.generate_text("x", json_schema=NESTED, compact=True, max_tokens=shortest)
    jsonschema.validate(json.loads(ok.text), NESTED)


class Post(pydantic.BaseModel):
    title: str
    tags: list[str]


def test_openai_parse_at_a_small_max_tokens_returns_the_parsed_model(live_server):
    """Before: LengthFinishReasonError (the document was cut)."""
    api = openai.OpenAI(base_url=live_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = api.models.list().data[0].id
    completion = api.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "A blog post with many tags"}], response_format=Post,
        max_tokens=16, temperature=1.0, seed=3)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Post)
    assert choice.model_extra["structgen"]["finish_reason"] in ("budget_closed", "grammar_complete")


@pytest.mark.parametrize("proposer", ["grammar", "ngram"])
def test_drafts_close_on_budget_too(client, proposer):
    """Drafts (the grammar's forced runs, n-gram guesses) are walked under the narrowed masks."""
    shortest = _shortest(client, NESTED, compact=True)
    for seed in range(2):
        done = client.generate_text("Order:", json_schema=NESTED, compact=True, max_tokens=shortest + 2,
                                    temperature=1.0, seed=seed, proposer=proposer, num_draft_tokens=4)
        assert done.finish_reason in ("budget_closed", "grammar_complete"), done.text
        assert len(done.token_ids) <= shortest + 2
        jsonschema.validate(json.loads(done.text), NESTED)


def test_xgrammar_closes_on_budget_too(client):
    shortest = _shortest(client, TAGS, compact=True, backend="xgrammar")
    done = client.generate_text("Tags:", json_schema=TAGS, compact=True, backend="xgrammar", max_tokens=shortest + 1,
                                temperature=1.0, seed=2)
    assert done.guarantee.backend == "xgrammar" and done.finish_reason in ("budget_closed", "grammar_complete")
    jsonschema.validate(json.loads(done.text), TAGS)
