"""Tool calls of the HTTP API (generation_service/openai_http/tools.py): the structural-tag
grammar, compiled by xgrammar as grammar_service compiles it, accepts exactly the calls it
should; the parser reads them back from any split of the streamed text."""
import json

import pytest
import xgrammar as xgr

from generation_service.engine.errors import InvalidRequestError
from generation_service.openai_http.schemas import ChatCompletionRequest
from generation_service.openai_http.tools import ToolCallParser, tools_grammar

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                    "tools": [WEATHER, CLOCK], **fields})


@pytest.fixture(scope="module")
def compiler():
    # one token per printable character and newline, token 0 the stop token
    vocab = ["</s>", "\n", *map(chr, range(32, 127))]
    return xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[0]))


def accepts(compiler, grammar: str, text: str) -> bool:
    """The whole of `text` is a complete output of the grammar."""
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(grammar))
    return matcher.accept_string(text) and matcher.accept_token(0)


PARIS = call("get_weather", {"city": "Paris", "unit": "c"})
NOON = call("get_time", {"zone": "utc"})


@pytest.mark.parametrize("text,expected", [
    (PARIS, True), (PARIS + "\n" + NOON, True), ("", False), ("Sure. " + PARIS, False),
    (call("get_weather", {"city": "Paris"}), False),          # a required argument missing
    (call("get_weather", {"city": "Paris", "unit": "k"}), False),  # not in the enum
    (call("launch", {}), False),                              # not a listed tool
])
def test_required_accepts_only_valid_calls(compiler, text, expected):
    assert accepts(compiler, tools_grammar(request(tool_choice="required")), text) is expected


def test_auto_allows_text_and_then_enforces_the_call(compiler):
    grammar = tools_grammar(request())
    assert accepts(compiler, grammar, "Just text.")
    assert accepts(compiler, grammar, "Let me look. " + PARIS + " Done.")
    assert not accepts(compiler, grammar, "Let me look. " + call("launch", {}))


def test_named_choice_and_single_call(compiler):
    named = tools_grammar(request(tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert accepts(compiler, named, NOON) and not accepts(compiler, named, PARIS)
    assert not accepts(compiler, named, NOON + "\n" + NOON)
    single = tools_grammar(request(tool_choice="required", parallel_tool_calls=False))
    assert accepts(compiler, single, PARIS) and not accepts(compiler, single, PARIS + "\n" + NOON)


def test_max_whitespace_caps_whitespace_inside_arguments(compiler):
    grammar = tools_grammar(request(tool_choice="required", structgen={"max_whitespace": 1}))
    assert accepts(compiler, grammar, PARIS)
    assert not accepts(compiler, grammar, PARIS.replace('{"city"', '{  "city"'))
    assert accepts(compiler, tools_grammar(request(tool_choice="required")), PARIS.replace('{"city"', '{  "city"'))


def test_no_grammar_without_tools_or_with_choice_none():
    assert tools_grammar(request(tool_choice="none")) is None
    assert tools_grammar(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])) is None


@pytest.mark.parametrize("fields,message", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "not among tools"),
    (dict(tools=[WEATHER, WEATHER]), "unique"),
    (dict(structgen={"compact": True}), "compact"),
    (dict(structgen={"max_whitespace": 0}), "max_whitespace"),
])
def test_bad_tool_choices_are_refused(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        tools_grammar(request(**fields))


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
def test_parser_finds_calls_and_text_whatever_the_split(split):
    text = "Checking. " + PARIS + " and " + NOON + " <tool"
    parser = ToolCallParser()
    content, calls = [], []
    for start in range(0, len(text), split):
        piece, found = parser.feed(text[start:start + split])
        content.append(piece)
        calls += found
    content.append(parser.finish())
    assert "".join(content) == "Checking.  and  <tool"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "utc"})]
    assert len({c.id for c in calls}) == 2


def test_parser_holds_back_a_possible_marker_and_returns_a_cut_call_as_text():
    parser = ToolCallParser()
    assert parser.feed("a <tool_") == ("a ", [])
    assert parser.feed('call>\n{"name": "get_time", "argu') == ("", [])
    assert parser.finish() == '<tool_call>\n{"name": "get_time", "argu'


def test_calls_only_parser_drops_the_separator():
    parser = ToolCallParser(only_calls=True)
    content, calls = parser.feed(PARIS + "\n" + NOON)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"] and parser.finish() == ""
