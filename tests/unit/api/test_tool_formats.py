"""Tool-call formats (generation_service/assistant/formats.py): each family's grammar, compiled
by both of grammar_service's backends with that family's test tokenizer, accepts exactly the
calls it should; the parser reads calls back from any split of the text."""
import json

import pytest

from chat_checkpoints import write_checkpoint
from generation_service.assistant.formats import FORMATS, detect_format
from generation_service.assistant.parser import CallExtractor
from generation_service.assistant.tools import Tool, ToolCall, ToolChoice, validate_call
from generation_service.model.tokenizer import Tokenizer
from grammar_contract.spec import GrammarSpec
from grammar_service.backends.llguidance import LLGuidanceBackend
from grammar_service.backends.xgrammar import XGrammarBackend
from grammar_service.tokenizer import load_tokenizer

WEATHER = Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                   "required": ["city", "unit"], "additionalProperties": False})
CLOCK = Tool("get_time")  # no parameters: any object
TOOLS = (WEATHER, CLOCK)
FAMILY = {"hermes": "qwen3", "llama3_json": "llama3", "mistral": "mistral"}


def call_text(format_name: str, calls: list[tuple[str, dict]]) -> str:
    """Calls as the family's template writes them."""
    if format_name == "hermes":
        return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>' for n, a in calls)
    if format_name == "llama3_json":
        return "; ".join(f'{{"name": "{n}", "parameters": {json.dumps(a)}}}' for n, a in calls)
    return "[TOOL_CALLS][" + ", ".join(f'{{"name": "{n}", "arguments": {json.dumps(a)}}}' for n, a in calls) + "]"


PARIS = ("get_weather", {"city": "Paris", "unit": "c"})
NOON = ("get_time", {"zone": "utc"})


@pytest.fixture(scope="module", params=list(FAMILY))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    write_checkpoint(FAMILY[request.param], folder)
    tokenizer = Tokenizer(folder)
    return request.param, tokenizer, load_tokenizer(str(folder), tokenizer.num_tokens)[0]


@pytest.fixture(scope="module", params=[XGrammarBackend, LLGuidanceBackend], ids=["xgrammar", "llguidance"])
def family(request, checkpoint):
    name, tokenizer, data = checkpoint
    backend = request.param(data, num_compile_threads=1, num_fill_threads=1)
    format_ = FORMATS[name](lambda text: tokenizer.token_id(text) is not None)
    return name, tokenizer, backend, format_


def accepts(family, choice: ToolChoice, text: str, single: bool = False) -> bool:
    """The tokens of `text`, then the stop token, are a complete output of the grammar."""
    _, tokenizer, backend, format_ = family
    tag = json.dumps({"type": "structural_tag", "format": format_.grammar(TOOLS, choice, single, None)})
    matcher = backend.new_matcher(backend.compile(GrammarSpec("structural_tag", tag)))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept(i) for i in ids) and matcher.accept(tokenizer.eos_token_ids[0])


def test_templates_name_their_format(family):
    name, tokenizer, _, _ = family
    assert detect_format(tokenizer.chat_template) == name
    assert detect_format(None) == detect_format("{{ messages }}") == "hermes"


def test_required_accepts_only_valid_calls(family):
    name = family[0]
    required = ToolChoice("required")
    assert accepts(family, required, call_text(name, [PARIS]))
    assert accepts(family, required, call_text(name, [PARIS, NOON]))
    assert not accepts(family, required, "")
    assert not accepts(family, required, "Sure. " + call_text(name, [PARIS]))
    assert not accepts(family, required, call_text(name, [("get_weather", {"city": "Paris"})]))  # unit missing
    assert not accepts(family, required, call_text(name, [("get_weather", {"city": "Paris", "unit": "k"})]))
    assert not accepts(family, required, call_text(name, [("launch", {})]))  # not a listed tool


def test_the_turn_may_end_after_each_call(family):
    """Under required the end is allowed after every complete call: a Hermes (ChatML) model may
    write a newline after a call and then end its turn, which the separator alone forbade."""
    name = family[0]
    required = ToolChoice("required")
    for calls in ([PARIS], [PARIS, NOON]):
        assert accepts(family, required, call_text(name, calls))
        if name == "hermes":
            assert accepts(family, required, call_text(name, calls) + "\n")
            assert not accepts(family, required, call_text(name, calls) + "\n\n")


def test_named_and_single_allow_one_call(family):
    name = family[0]
    named = ToolChoice("named", "get_time")
    assert accepts(family, named, call_text(name, [NOON])) and not accepts(family, named, call_text(name, [PARIS]))
    assert not accepts(family, named, call_text(name, [NOON, NOON]))
    assert not accepts(family, ToolChoice("required"), call_text(name, [PARIS, NOON]), single=True)


def test_auto_allows_text_and_enforces_a_triggered_call(family):
    name = family[0]
    auto = ToolChoice("auto")
    assert accepts(family, auto, "Just text.")
    assert accepts(family, auto, "Let me look. " + call_text(name, [PARIS]))
    assert not accepts(family, auto, "Let me look. " + call_text(name, [("launch", {})]))


def test_auto_starts_a_call_where_the_parser_does(family):
    """Under tool_choice auto a trigger that is one added token (Qwen's <tool_call>) starts a
    call as that token only, in both backends: free text may spell it in ordinary tokens, and the
    served parser (plan_turn's, following the token) reads no call there. A text trigger (Llama
    3's) starts one at its text, in both backends and in the parser."""
    from generation_service.assistant.turn import plan_turn

    name, tokenizer, backend, _ = family
    turn = plan_turn(tokenizer, (), tools=TOOLS)
    tag = json.dumps({"type": "structural_tag", "format": turn.tool_format.grammar(TOOLS, turn.choice, False, None)})
    compiled = backend.compile(GrammarSpec("structural_tag", tag))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731

    def run(ids: list[int]) -> tuple[bool, list]:
        """(the grammar accepts ids and the stop token, the calls the served parser reads)"""
        matcher = backend.new_matcher(compiled)
        accepted = all(matcher.accept(i) for i in ids) and matcher.accept(tokenizer.eos_token_ids[0])
        text = tokenizer.decode(ids, skip_special_tokens=turn.skip_special_tokens)  # as the engine's
        piece = turn.parser(tokenizer, ()).feed(text, True, tuple(ids))
        return accepted, [(c.name, json.loads(c.arguments)) for c in piece.calls]

    trigger_id = tokenizer.token_id(turn.tool_format.trigger)
    if turn.trigger_token_id is None:  # Llama 3's text trigger
        assert name == "llama3_json"
        assert run(encode("Hi. " + call_text(name, [PARIS]))) == (True, [PARIS])
        return
    assert turn.trigger_token_id == trigger_id  # Qwen's <tool_call>, Mistral's [TOOL_CALLS]
    trigger = turn.tool_format.trigger
    spelled = [tokenizer.token_id(c) for c in trigger]  # one ordinary token per character
    assert trigger_id not in spelled and tokenizer.decode(spelled) == trigger
    launch = call_text(name, [("launch", {})])
    assert run(encode("Hi ") + spelled + encode(launch.removeprefix(trigger))) == (True, [])  # free text
    assert trigger_id in encode("Hi " + launch) and not run(encode("Hi " + launch))[0]  # enforced
    assert run(encode("Hi " + call_text(name, [PARIS]))) == (True, [PARIS])
    assert not run(encode(f"Hi {trigger} no call"))[0]


def _extract(format_, text: str, split: int) -> tuple[list[str], list]:
    """The content pieces and calls a CallExtractor finds in `text` fed `split` characters at a time."""
    extractor = CallExtractor(format_, only_calls=False)
    content, calls = [], []
    for start in range(0, len(text), split):
        piece, found = extractor.feed(text[start:start + split])
        content.append(piece)
        calls += found
    rest, incomplete = extractor.finish()
    assert incomplete == ""
    content.append(rest)
    return content, calls


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
def test_parser_finds_calls_whatever_the_split(family, split):
    name, _, _, format_ = family
    text = "Checking. " + call_text(name, [PARIS, NOON])
    content, calls = _extract(format_, text, split)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [PARIS, NOON]
    assert "".join(content).strip(" ;\n") == "Checking." and len({c.id for c in calls}) == 2


TAGGED = ("get_time", {"q": "a</tool_call>]}; b"})  # a string argument holding each format's end text


def test_grammar_accepts_an_end_text_inside_a_string_argument(family):
    """In ordinary tokens (llguidance lexes an added token apart: never inside a string)."""
    name, tokenizer, backend, format_ = family
    tag = json.dumps({"type": "structural_tag", "format": format_.grammar(TOOLS, ToolChoice("required"), False, None)})
    matcher = backend.new_matcher(backend.compile(GrammarSpec("structural_tag", tag)))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    before, after = call_text(name, [TAGGED, NOON]).split("</tool_call>", 1)
    ids = [*encode(before), *(i for c in "</tool_call>" for i in encode(c)), *encode(after)]
    assert all(matcher.accept(i) for i in ids) and matcher.accept(tokenizer.eos_token_ids[0])


@pytest.mark.parametrize("split", [1, 2, 5, 100])
def test_an_end_text_inside_a_string_argument_does_not_end_the_call(family, split):
    """The grammar constrains a call's JSON, then its end: a string argument may hold the end
    tag's text. Hermes's parser ended the call at the first '</tool_call>' (inside the string):
    no call, the text as content."""
    name, _, _, format_ = family
    text = "Checking. " + call_text(name, [TAGGED, NOON])
    content, calls = _extract(format_, text, split)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [TAGGED, NOON]
    assert "".join(content).strip(" ;\n") == "Checking."


def test_a_call_cut_off_is_no_content_and_calls_only_drop_separators(family):
    """A call that max_tokens cut short is neither a call nor content: the turn's incomplete call."""
    name, _, _, format_ = family
    whole = call_text(name, [PARIS])
    extractor = CallExtractor(format_, only_calls=False)
    assert extractor.feed("Sure. " + whole[:-3]) == ("Sure. ", [])
    assert extractor.finish() == ("", whole[:-3])
    only = CallExtractor(format_, only_calls=True)
    content, calls = only.feed(call_text(name, [PARIS, NOON]))
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"] and only.finish() == ("", "")


def test_parser_holds_back_a_partial_trigger():
    extractor = CallExtractor(FORMATS["hermes"](), only_calls=False)
    assert extractor.feed("a <tool_") == ("a ", [])
    assert extractor.feed('call>\n{"name": "get_time", "argu') == ("", [])
    assert extractor.finish() == ("", '<tool_call>\n{"name": "get_time", "argu')
    held = CallExtractor(FORMATS["hermes"](), only_calls=False)
    assert held.feed("a <tool_") == ("a ", []) and held.finish() == ("<tool_", "")  # no call began
    only = CallExtractor(FORMATS["hermes"](), only_calls=True)  # calls only: nothing else could begin
    assert only.feed("\n<tool_") == ("", []) and only.finish() == ("", "<tool_")


def test_mistral_marks_its_trigger_as_the_control_token(family):
    name, tokenizer, _, format_ = family
    if name != "mistral":
        pytest.skip("the [TOOL_CALLS] control token is Mistral's")
    tag = format_.grammar(TOOLS, ToolChoice("required"), False, None)
    assert tag["begin"] == {"type": "token", "token": "[TOOL_CALLS]"}
    assert tokenizer.token_id("[TOOL_CALLS]") in tokenizer.special_token_ids


@pytest.mark.parametrize("name, arguments, path, message", [
    ("get_weather", '{"city": "Paris", "unit": "k"}', "/unit", "is not one of"),
    ("get_weather", '{"city": "Paris"}', "", "'unit' is a required property"),
    ("get_weather", '{"city": "Par', "", "not valid JSON"),
    ("get_news", "{}", "", "not one of the request's tools"),
])
def test_a_call_that_does_not_validate_says_why(name, arguments, path, message):
    result = validate_call(ToolCall("call_1", name, arguments), {tool.name: tool for tool in TOOLS})
    assert not result.valid and result.num_errors >= 1
    issue = result.issues[0]
    assert issue.path == path and message in issue.message


def test_a_call_that_validates():
    tools = {tool.name: tool for tool in TOOLS}
    assert validate_call(ToolCall("c", "get_weather", '{"city": "Paris", "unit": "c"}'), tools).valid
    assert validate_call(ToolCall("c", "get_time", '{"anything": [1]}'), tools).valid
