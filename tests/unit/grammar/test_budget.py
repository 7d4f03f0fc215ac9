"""Close on budget through a real step channel (32k Mistral tokenizer), both backends.

An adversarial "model" samples uniformly from each mask (long random strings, any structure
the grammar offers) and, with drafts, has them verified as the engine does; every output must
end with the stop token within max_tokens and be valid against its schema.
"""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from channel_driver import Row, allowed_tokens, is_allowed
from generation_service.assistant.formats import FORMATS
from generation_service.assistant.tools import Tool, ToolChoice
from grammar_contract.spec import GrammarSpec
from grammar_service.compiler import CompileError
from step_channel import ERR_MASK, ERR_NONE, NOTE_BUDGET_CLOSED

EOS = 2
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"]}},
    "required": ["name", "age", "address"]}
LIST = {"type": "array", "minItems": 2, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "labels": {"type": "array", "items": {"enum": ["red", "green"]}}},
    "required": ["id", "labels"]}}
OPEN = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}  # the schema


def _shortest(service, schema: dict, backend: str, **options) -> int:
    """The shortest output, as the refusal of max_tokens 1 names it."""
    spec = GrammarSpec("json_schema", json.dumps(schema), backend=backend, max_tokens=1, **options)
    with pytest.raises(CompileError) as refused:
        service.compile(spec).result(60)
    assert refused.value.status == "INVALID_ARGUMENT"
    return int(re.search(r"at least (\d+)", refused.value.message).group(1))


def _walk(driver, grammar_id: int, max_tokens: int, rng: random.Random, num_drafts: int = 0,
          pool: list[int] = ()) -> tuple[list[int], bool]:
    """One output sampled uniformly under the masks; returns (tokens, whether a note came)."""
    tokens: list[int] = []
    noted, fresh = False, True
    while True:
        k = min(num_drafts, max_tokens - len(tokens) - 1)  # the engine never drafts past the budget
        drafts = [rng.choice(pool) for _ in range(k)]
        row = Row.fresh(0, grammar_id, drafts) if fresh else Row(0, 1 + k, grammar_id=grammar_id, drafts=drafts)
        fresh = False
        view = driver.step([row])
        for _, word in view.results:
            assert word & ERR_MASK == ERR_NONE
            noted |= bool(word & NOTE_BUDGET_CLOSED)
        out = []
        for p in range(int(view.valid_positions[0])):
            mask = view.masks[0, p]
            if p < k and is_allowed(mask, drafts[p]) and rng.random() < 0.8:
                out.append(drafts[p])  # the verifier's sample equals the draft: accepted
                continue
            out.append(int(rng.choice(allowed_tokens(mask))))
            break
        if EOS in out:
            out = out[:out.index(EOS) + 1]
        tokens += out
        driver.finish([out])
        if tokens[-1] == EOS or len(tokens) >= max_tokens:
            return tokens, noted


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("schema", [PERSON, LIST, OPEN], ids=["person", "list", "open"])
def test_random_outputs_close_within_small_budgets(service, driver, mistral_32k, backend, schema):
    shortest = _shortest(service, schema, backend)
    rng = random.Random(7)
    for max_tokens in (shortest, shortest + 2, 2 * shortest, 4 * shortest):
        grammar_id = service.compile(GrammarSpec("json_schema", json.dumps(schema), backend=backend,
                                                 max_tokens=max_tokens)).result(60).entry.grammar_id
        tokens, noted = _walk(driver, grammar_id, max_tokens, rng)
        text = mistral_32k.decode(tokens[:-1])
        assert tokens[-1] == EOS, f"cut at max_tokens {max_tokens}: {text!r}"
        assert len(tokens) <= max_tokens
        jsonschema.validate(json.loads(text), schema)
        assert noted, "the masks were narrowed, and the results said so"


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_drafts_walk_only_what_the_narrowed_masks_allow(service, driver, mistral_32k, backend):
    shortest = _shortest(service, PERSON, backend)
    pool = [mistral_32k.token_to_id(t) for t in ('"', "}", ",", "▁the", "a", "0", "1", "{", "]")]
    rng = random.Random(3)
    for max_tokens in (shortest + 1, 2 * shortest):
        grammar_id = service.compile(GrammarSpec("json_schema", json.dumps(PERSON), backend=backend,
                                                 max_tokens=max_tokens)).result(60).entry.grammar_id
        tokens, _ = _walk(driver, grammar_id, max_tokens, rng, num_drafts=3, pool=pool)
        text = mistral_32k.decode(tokens[:-1])
        assert tokens[-1] == EOS and len(tokens) <= max_tokens, f"cut: {text!r}"
        jsonschema.validate(json.loads(text), PERSON)


def test_a_budget_below_the_shortest_output_is_refused_naming_it(service):
    shortest = _shortest(service, PERSON, "llguidance")
    assert shortest > 10  # {"name":"","age":0,"address":{"zip":"00000"}} and the stop token
    ok = GrammarSpec("json_schema", json.dumps(PERSON), backend="llguidance", max_tokens=shortest)
    assert service.compile(ok).result(60).entry.grammar_id > 0
    below = GrammarSpec("json_schema", json.dumps(PERSON), backend="llguidance", max_tokens=shortest - 1)
    with pytest.raises(CompileError, match=f"max_tokens {shortest - 1} is below .* at least {shortest}"):
        service.compile(below).result(60)


def test_rows_far_from_their_budget_keep_the_grammars_masks(service, driver, compile_id):
    """A budget far away changes nothing: the same masks as without one."""
    schema = json.dumps(PERSON)
    bare = compile_id("json_schema", schema, backend="xgrammar")
    budgeted = service.compile(GrammarSpec("json_schema", schema, backend="xgrammar",
                                           max_tokens=2000)).result(60).entry.grammar_id
    assert budgeted != bare
    view = driver.step([Row.fresh(0, bare), Row.fresh(1, budgeted)])
    assert (view.masks[0, 0] == view.masks[1, 0]).all()


WEATHER = Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                   "required": ["city", "unit"], "additionalProperties": False})


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("format_name", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_tool_calls_close_within_small_budgets(service, driver, mistral_32k, backend, format_name, choice):
    """A trigger or separator opens a whole new call: near the budget a row opens none it cannot
    finish (they were cut: a second call begun a few tokens before max_tokens)."""
    format_ = FORMATS[format_name](lambda text: text == "[TOOL_CALLS]" and mistral_32k.token_to_id(text) is not None)
    tag = json.dumps({"type": "structural_tag", "format": format_.grammar((WEATHER, Tool("get_time")),
                                                                           ToolChoice(choice), False, None)})
    spec = lambda max_tokens: GrammarSpec("structural_tag", tag, backend=backend, max_tokens=max_tokens)  # noqa: E731
    try:
        service.compile(spec(1)).result(60)
        shortest = 20  # auto: the turn may end at once; budgets around a call's length
    except CompileError as refused:
        shortest = int(re.search(r"at least (\d+)", refused.message).group(1))
    rng = random.Random(5)
    for _ in range(6):
        for max_tokens in (shortest + 3, 2 * shortest, 3 * shortest):
            tokens, _ = _walk(driver, service.compile(spec(max_tokens)).result(60).entry.grammar_id, max_tokens, rng)
            assert tokens[-1] == EOS and len(tokens) <= max_tokens, f"cut: {mistral_32k.decode(tokens)!r}"
