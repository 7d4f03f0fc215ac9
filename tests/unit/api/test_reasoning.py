"""The reasoning span at the edge (generation_service/assistant/): markers and separator read
from Qwen3's template, the span of a request, the splitter over any split of the text, and
the turn plan that both API fronts share."""
import asyncio

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


# ---- where the span ends: the end marker's token, or its first text ---------------------------
def _events(tokenizer, prompt, ids, size: int, lag: int = 0):
    """The engine's events for output `ids`: `size` tokens each, text from a detokenizer fed one
    token at a time (as OutputProcessor feeds it), `lag` characters of it held back until the
    next event (as a stop string's possible start is); the last event finishes the request."""
    from generation_service.engine.events import FinishReason, OutputEvent
    from generation_service.model.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, list(prompt))
    chunks = [ids[start:start + size] for start in range(0, len(ids), size)]
    texts = ["".join(detok.push([i]) for i in chunk) for chunk in chunks]
    texts[-1] += detok.flush()
    text, events, sent = "".join(texts), [], 0
    for n, chunk in enumerate(chunks):
        upto = len(text) if n == len(chunks) - 1 else max(sent, len("".join(texts[:n + 1])) - lag)
        final = n == len(chunks) - 1
        events.append(OutputEvent(tuple(chunk), text[sent:upto],
                                  finish_reason=FinishReason.GRAMMAR_COMPLETE if final else None))
        sent = upto
    return events


def _parse(parser, events) -> tuple[str, str]:
    pieces = [parser.feed(event.text, event.is_final, event.token_ids) for event in events]
    return "".join(p.reasoning for p in pieces), "".join(p.content for p in pieces)


def _grpc_responses(engine, domain, turn) -> list:
    """What the gRPC servicer's stream writes for `domain` on `engine`."""
    from generation_service.config import ServeConfig
    from generation_service.server import GenerationServicer

    class Context:
        def __init__(self) -> None:
            self.responses: list = []

        async def write(self, response) -> None:
            self.responses.append(response)

    context = Context()
    asyncio.run(GenerationServicer(engine, ServeConfig(), None)._stream(domain, turn, context))
    return context.responses


def _http_items(engine, domain, turn) -> list:
    """The HTTP front's choice events for `domain` on `engine`."""
    from generation_service.openai_http.choices import ChoiceStreams

    async def events():
        return [item async for item in ChoiceStreams(engine, [domain], turn).events()]
    return asyncio.run(events())


def _spelled(tokenizer, text: str) -> list[int]:
    """`text` in one ordinary token per character: never the added token that spells it whole."""
    return [i for c in text for i in tokenizer.encode(c, add_special_tokens=False)]


@pytest.mark.parametrize("size", [1, 2, 3, 100])
@pytest.mark.parametrize("lag", [0, 3])
def test_the_span_ends_at_the_end_marker_token_not_at_its_text(tokenizers, size, lag):
    """Qwen3's </think> is one added token: both grammars end the span at that token only, so
    ordinary tokens inside may spell `<`, `/`, `t`...`>`; the text split ended the span there and
    the content (what the final validation covers) was not what the grammar constrained."""
    qwen = tokenizers["qwen3"]
    prompt = tuple(qwen.apply_chat_template([{"role": "user", "content": "hi"}]))
    turn = plan_turn(qwen, prompt, reasoning=ReasoningRequest("enabled"))
    begin, end = qwen.token_id("<think>"), qwen.token_id("</think>")
    assert turn.end_token_id == end
    encode = lambda text: qwen.encode(text, add_special_tokens=False)  # noqa: E731
    ids = [begin, *encode("a"), *_spelled(qwen, "</think>"), *encode("b"), end, *encode('\n\n{"a": "</think>"}')]
    assert qwen.decode(ids) == '<think>a</think>b</think>\n\n{"a": "</think>"}'
    assert _parse(turn.parser(qwen, prompt), _events(qwen, prompt, ids, size, lag)) == (
        "a</think>b", '{"a": "</think>"}')


@pytest.mark.parametrize("size", [1, 3, 100])
def test_a_text_marker_ends_the_span_at_its_first_text(tokenizers, size):
    """Markers given in the request are text to the grammar: the span ends at their first text."""
    qwen = tokenizers["qwen3"]
    prompt = tuple(qwen.encode("Think, then answer: "))
    turn = plan_turn(qwen, prompt, reasoning=ReasoningRequest("enabled", begin="[R]", end="[/R]"))
    assert turn.end_token_id is None
    ids = qwen.encode("[R]a[/R]b[/R]42", add_special_tokens=False)
    assert _parse(turn.parser(qwen, prompt), _events(qwen, prompt, ids, size)) == ("a", "b[/R]42")


class _ScriptedEngine:
    """An engine whose every request streams the same events (the API fronts' side alone)."""

    def __init__(self, tokenizer, events) -> None:
        self.tokenizer, self._events = tokenizer, events

    def submit(self, request):
        events = self._events

        class Stream:
            is_finished = True

            async def acoalesced(self):
                for event in events:
                    yield event

            def cancel(self) -> None:
                pass
        return Stream()


def test_both_fronts_split_at_the_end_token_and_validate_the_content_alone(tokenizers):
    """The gRPC stream and the HTTP front's choices: the content after the end marker's token,
    validated against the schema (the text split validated 'b</think>\\n\\n{"a":1}': invalid)."""
    from generation_service import proto_convert
    from generation_service.config import ServeConfig
    from structgen.v1 import generation_pb2 as pb

    qwen = tokenizers["qwen3"]
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
                                 json_schema=schema, reasoning=pb.ReasoningOptions(mode=pb.REASONING_MODE_ENABLED))
    domain, turn = proto_convert.convert_generate(request, qwen, ServeConfig(), None)
    encode = lambda text: qwen.encode(text, add_special_tokens=False)  # noqa: E731
    ids = [qwen.token_id("<think>"), *encode("a"), *_spelled(qwen, "</think>"), *encode("b"), qwen.token_id("</think>"),
           *encode('\n\n{"a":1}'), qwen.eos_token_ids[0]]
    engine = _ScriptedEngine(qwen, _events(qwen, domain.prompt_ids, ids, size=4))

    responses = _grpc_responses(engine, domain, turn)
    assert "".join(r.reasoning_text for r in responses) == "a</think>b"
    assert "".join(r.text for r in responses) == '{"a":1}'
    assert responses[-1].validation.status == pb.VALIDATION_STATUS_VALID

    items = _http_items(engine, domain, turn)
    assert "".join(item.piece.reasoning for item in items) == "a</think>b"
    assert "".join(item.piece.content for item in items) == '{"a":1}' and items[-1].validation.is_valid


# ---- where a call starts: the trigger's token, or its text ---------------------------------------
@pytest.mark.parametrize("size", [1, 2, 5, 100])
@pytest.mark.parametrize("lag", [0, 4])
@pytest.mark.parametrize("thinking", [False, True])
def test_a_call_starts_at_the_trigger_token_not_at_its_text(tokenizers, size, lag, thinking):
    """Qwen's <tool_call> is one added token: under tool_choice auto both grammars start a call
    at that token only (test_tool_formats.py), so free text may spell `<`, `tool`, `_call`, `>`
    in ordinary tokens; the text rule read an unenforced call out of that free text."""
    qwen = tokenizers["qwen3"]
    prompt = tuple(qwen.apply_chat_template([{"role": "user", "content": "hi"}]))
    turn = plan_turn(qwen, prompt, tools=(Tool("get_time"),),
                     reasoning=ReasoningRequest("enabled") if thinking else None)
    trigger, end = qwen.token_id("<tool_call>"), qwen.token_id("</tool_call>")
    assert turn.trigger_token_id == trigger
    encode = lambda text: qwen.encode(text, add_special_tokens=False)  # noqa: E731
    spelled_call = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    ids = [*_spelled(qwen, spelled_call), *encode(" then "), trigger,
           *encode('\n{"name": "get_time", "arguments": {"zone": "utc"}}\n'), end, *encode(" done")]
    if thinking:  # a trigger token inside the span is reasoning
        ids = [qwen.token_id("<think>"), *encode("a"), trigger, *encode("b"), qwen.token_id("</think>"),
               *encode("\n\n"), *ids]
    parser = turn.parser(qwen, prompt)
    pieces = [parser.feed(e.text, e.is_final, e.token_ids) for e in _events(qwen, prompt, ids, size, lag)]
    assert "".join(p.reasoning for p in pieces) == ("a<tool_call>b" if thinking else "")
    assert "".join(p.content for p in pieces) == spelled_call + " then  done"
    calls = [call for p in pieces for call in p.calls]
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "utc"}')]


@pytest.mark.parametrize("size", [1, 2, 5, 100])
@pytest.mark.parametrize("lag", [0, 4])
def test_a_call_ends_after_its_json_not_at_an_end_tag_inside_a_string(tokenizers, size, lag):
    """The grammar constrains the call's JSON, then </tool_call>: a string argument may spell
    the tag; the parser ended the call there (no call, the text as content)."""
    qwen = tokenizers["qwen3"]
    prompt = tuple(qwen.apply_chat_template([{"role": "user", "content": "hi"}]))
    turn = plan_turn(qwen, prompt, tools=(Tool("search"),))
    encode = lambda text: qwen.encode(text, add_special_tokens=False)  # noqa: E731
    ids = [*encode("Looking. "), qwen.token_id("<tool_call>"),
           *encode('\n{"name": "search", "arguments": {"q": "a'), qwen.token_id("</tool_call>"),
           *encode('b"}}\n'), qwen.token_id("</tool_call>"), *encode(" done")]
    parser = turn.parser(qwen, prompt)
    pieces = [parser.feed(e.text, e.is_final, e.token_ids) for e in _events(qwen, prompt, ids, size, lag)]
    assert "".join(p.content for p in pieces) == "Looking.  done"
    calls = [call for p in pieces for call in p.calls]
    assert [(c.name, c.arguments) for c in calls] == [("search", '{"q": "a</tool_call>b"}')]


def test_a_text_trigger_and_forced_calls_keep_the_text_rule(tokenizers):
    """Llama 3's trigger is text, and required/named calls are calls only: no trigger token."""
    qwen, llama = tokenizers["qwen3"], tokenizers["llama3"]
    assert plan_turn(qwen, (1,), tools=(Tool("f"),), choice=ToolChoice("required")).trigger_token_id is None
    assert plan_turn(llama, (1,), tools=(Tool("f"),)).trigger_token_id is None
    assert plan_turn(qwen, (1,), reasoning=ReasoningRequest("enabled")).trigger_token_id is None


def test_both_fronts_start_calls_at_the_trigger_token(tokenizers):
    """The gRPC stream and the HTTP front's choices: a <tool_call> spelled in ordinary tokens
    stays content; the call begun by the trigger's token is the one call (the text rule also
    read the spelled one, a call to a tool the request does not list)."""
    from generation_service import proto_convert
    from generation_service.config import ServeConfig
    from structgen.v1 import generation_pb2 as pb

    qwen = tokenizers["qwen3"]
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
                                 tools=[pb.Tool(name="get_time")])
    domain, turn = proto_convert.convert_generate(request, qwen, ServeConfig(), None)
    encode = lambda text: qwen.encode(text, add_special_tokens=False)  # noqa: E731
    spelled_call = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    ids = [*_spelled(qwen, spelled_call), *encode(" so "), qwen.token_id("<tool_call>"),
           *encode('\n{"name": "get_time", "arguments": {}}\n'), qwen.token_id("</tool_call>"), qwen.eos_token_ids[0]]
    engine = _ScriptedEngine(qwen, _events(qwen, domain.prompt_ids, ids, size=3))

    responses = _grpc_responses(engine, domain, turn)
    assert "".join(r.text for r in responses) == spelled_call + " so "
    assert [(c.name, c.validation.status) for r in responses for c in r.tool_calls] == [
        ("get_time", pb.VALIDATION_STATUS_VALID)]

    items = _http_items(engine, domain, turn)
    assert "".join(item.piece.content for item in items) == spelled_call + " so "
    assert [c.name for item in items for c in item.piece.calls] == ["get_time"]
