"""The reasoning span at the edge (generation_service/assistant/): markers and separator read
from Qwen3's template, the span of a request, the splitter over any split of the text, and
the turn plan that both API fronts share."""
import pytest

from chat_checkpoints import write_checkpoint
from generation_service.assistant.parser import ReasoningSplitter, TurnParser
from generation_service.assistant.reasoning import ReasoningMarkers, ReasoningRequest, model_markers, reasoning_span
from generation_service.assistant.tools import Tool, ToolChoice
from generation_service.assistant.turn import plan_turn
from generation_service.model.tokenizer import Tokenizer
from grammar_contract.spec import GrammarSpec, ReasoningSpan

QWEN_SPAN = ReasoningSpan("<think>", "</think>", "\n\n")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    result = {}
    for family in ("qwen3", "llama3", "mistral"):
        folder = tmp_path_factory.mktemp(family)
        write_checkpoint(family, folder)
        result[family] = Tokenizer(folder)
    return result


def test_markers_and_separator_come_from_the_model(tokenizers):
    assert model_markers(tokenizers["qwen3"]) == ReasoningMarkers("<think>", "</think>", "\n\n")
    assert model_markers(tokenizers["llama3"]) is None and model_markers(tokenizers["mistral"]) is None


def test_the_span_of_a_request():
    markers = ReasoningMarkers("<think>", "</think>", "\n\n")
    assert reasoning_span(ReasoningRequest(), markers, "x") is None
    assert reasoning_span(ReasoningRequest("enabled", 5), markers, "assistant\n") == ReasoningSpan(
        "<think>", "</think>", "\n\n", 5, starts_open=False)
    assert reasoning_span(ReasoningRequest("enabled"), markers, "assistant\n<think>\n").starts_open
    given = reasoning_span(ReasoningRequest("enabled", begin="[R]", end="[/R]"), markers, "")
    assert (given.begin, given.end, given.separator) == ("[R]", "[/R]", "")
    with pytest.raises(ValueError, match="no reasoning markers"):
        reasoning_span(ReasoningRequest("enabled"), None, "")


@pytest.mark.parametrize("fields,message", [
    (dict(mode="default", max_tokens=3), "need reasoning enabled"),
    (dict(mode="enabled", begin="<r>"), "pairs"),
    (dict(mode="maybe"), "mode"),
    (dict(mode="enabled", begin="x" * 65, end="y"), "at most 64"),
    (dict(mode="enabled", max_tokens=(1 << 32) - 1), "0 to 2147483647"),
    (dict(mode="enabled", max_tokens=-1), "0 to 2147483647"),
])
def test_bad_reasoning_requests(fields, message):
    with pytest.raises(ValueError, match=message):
        ReasoningRequest(**fields)


def _split(span: ReasoningSpan, text: str, size: int) -> tuple[str, str]:
    splitter, reasoning, content = ReasoningSplitter(span), [], []
    for start in range(0, len(text), size):
        r, c = splitter.feed(text[start:start + size])
        reasoning.append(r)
        content.append(c)
    r, c = splitter.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_splitter_keeps_markers_out_whatever_the_split(size):
    assert _split(QWEN_SPAN, '<think>\nHmm, 2 < 3.\n</think>\n\n{"a": 1}', size) == ('\nHmm, 2 < 3.\n', '{"a": 1}')
    opened = ReasoningSpan("<think>", "</think>", "", starts_open=True)
    assert _split(opened, "ok</think>yes", size) == ("ok", "yes")
    assert _split(QWEN_SPAN, "no span here", size) == ("", "no span here")  # (free text, no grammar)
    assert _split(QWEN_SPAN, "<think>cut off by max_tok", size) == ("cut off by max_tok", "")


def test_turn_parser_splits_reasoning_then_calls():
    from generation_service.assistant.formats import HermesFormat
    from generation_service.assistant.parser import CallExtractor

    parser = TurnParser(QWEN_SPAN, CallExtractor(HermesFormat(), only_calls=True))
    text = '<think>call it</think>\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    pieces = [parser.feed(text[i:i + 4]) for i in range(0, len(text), 4)] + [parser.feed("", final=True)]
    assert "".join(p.reasoning for p in pieces) == "call it" and "".join(p.content for p in pieces) == ""
    assert [(c.name, c.arguments) for p in pieces for c in p.calls] == [("f", '{"x": 1}')]


def test_requests_without_reasoning_or_tools_have_no_turn(tokenizers):
    qwen = tokenizers["qwen3"]
    prompt = tuple(qwen.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert plan_turn(qwen, prompt) is None
    assert plan_turn(qwen, prompt, reasoning=ReasoningRequest("disabled")) is None
    assert plan_turn(qwen, prompt, tools=(Tool("f"),), choice=ToolChoice("none")) is None


def test_turn_grammar_puts_the_span_before_the_constraint(tokenizers):
    qwen = tokenizers["qwen3"]
    prompt = tuple(qwen.apply_chat_template([{"role": "user", "content": "hi"}]))
    turn = plan_turn(qwen, prompt, reasoning=ReasoningRequest("enabled", 8))
    spec = turn.grammar(GrammarSpec("regex", "[0-9]+"))
    assert spec.kind == "regex" and spec.reasoning == ReasoningSpan("<think>", "</think>", "\n\n", 8)
    assert turn.grammar(None).kind == "structural_tag"  # a budget alone still needs a grammar
    assert plan_turn(qwen, prompt, reasoning=ReasoningRequest("enabled")).grammar(None) is None
    with pytest.raises(ValueError, match="together with tools"):
        plan_turn(qwen, prompt, tools=(Tool("f"),)).grammar(GrammarSpec("regex", "x"))


def test_special_markers_stay_in_the_text(tokenizers):
    mistral, qwen = tokenizers["mistral"], tokenizers["qwen3"]
    prompt = tuple(mistral.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert not plan_turn(mistral, prompt, tools=(Tool("f"),)).skip_special_tokens  # [TOOL_CALLS] is a control token
    assert plan_turn(qwen, (1,), tools=(Tool("f"),)).skip_special_tokens  # <tool_call> is plain text
