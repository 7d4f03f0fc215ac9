"""A reasoning span before the constraint (GrammarSpec.reasoning), compiled by both backends
with Qwen3's test tokenizer: free text up to the end marker, the separator, then the
constraint from its first token; xgrammar's token budget forces the end marker's token."""
import dataclasses
import json

import numpy as np
import pytest

from chat_checkpoints import write_checkpoint
from generation_service.model.tokenizer import Tokenizer
from grammar_contract.spec import GrammarSpec, ReasoningSpan
from grammar_service.backends.base import GrammarCompileError
from grammar_service.backends.llguidance import LLGuidanceBackend
from grammar_service.backends.xgrammar import XGrammarBackend
from grammar_service.compiler import spec_key
from grammar_service.tokenizer import load_tokenizer

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
CONSTRAINTS = {"json_schema": (SCHEMA, '{"a":1}', '{"b":1}'), "regex": ("[0-9]+", "42", "x"),
               "lark": ('start: "x" /[0-9]+/', "x7", "y7")}
QWEN = ReasoningSpan("<think>", "</think>", "\n\n")
TEXT_MARKERS = ReasoningSpan("[R]", "[/R]")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    write_checkpoint("qwen3", folder)
    tokenizer = Tokenizer(folder)
    data, _ = load_tokenizer(str(folder), tokenizer.num_tokens)
    return tokenizer, data


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request, qwen):
    cls = {"xgrammar": XGrammarBackend, "llguidance": LLGuidanceBackend}[request.param]
    return cls(qwen[1], num_compile_threads=1, num_fill_threads=1)


def run(qwen, backend, spec: GrammarSpec, text: str) -> bool:
    """Every token of `text` and then the stop token accepted."""
    tokenizer = qwen[0]
    matcher = backend.new_matcher(backend.compile(spec))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept(i) for i in ids) and matcher.accept(tokenizer.eos_token_ids[0])


def opening(span: ReasoningSpan, thoughts: str) -> str:
    return ("" if span.starts_open else span.begin) + thoughts + span.end + span.separator


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("span", [QWEN, ReasoningSpan("", "</think>", "\n\n", starts_open=True), TEXT_MARKERS])
def test_span_then_the_constraint(qwen, backend, kind, span):
    text, good, bad = CONSTRAINTS[kind]
    spec = GrammarSpec(kind, text, any_whitespace=False, reasoning=span)
    assert run(qwen, backend, spec, opening(span, "hello, 2 < 3 world") + good)
    assert run(qwen, backend, spec, opening(span, "") + good)
    assert not run(qwen, backend, spec, opening(span, "hello") + bad)  # the constraint holds after the span
    assert not run(qwen, backend, spec, good)  # the span is required
    if span.separator:
        assert not run(qwen, backend, spec, opening(span, "hi").removesuffix(span.separator) + good)


def _accepts(backend, spec: GrammarSpec, ids: list[int], stop_id: int) -> bool:
    matcher = backend.new_matcher(backend.compile(spec))
    return all(matcher.accept(i) for i in ids) and matcher.accept(stop_id)


def _parser_split(tokenizer, span: ReasoningSpan, ids: list[int]) -> tuple[str, str]:
    """The server's split of output `ids` (generation_service/assistant/parser.py), the end
    marker's token placed as plan_turn places it."""
    from generation_service.assistant.parser import EndToken, TurnParser

    end_id = tokenizer.token_id(span.end)
    end_token = EndToken(end_id, tokenizer, (), True) if end_id in tokenizer.added_token_ids else None
    piece = TurnParser(span, None, end_token).feed(tokenizer.decode(ids), True, tuple(ids))
    return piece.reasoning, piece.content


@pytest.mark.parametrize("separator", ["", "\n\n"])
def test_the_span_ends_where_the_server_splits_it(qwen, backend, separator):
    """Where each grammar ends the span is where the server's parser splits reasoning from the
    content it validates: at the end marker's token when the marker is one added token (ordinary
    tokens inside the span may spell its text), at the marker's first text when it is text."""
    tokenizer, _ = qwen
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    stop = tokenizer.eos_token_ids[0]
    spelled = [i for c in "</think>" for i in encode(c)]
    span = dataclasses.replace(QWEN, separator=separator)
    ids = [tokenizer.token_id("<think>"), *encode("a"), *spelled, *encode("b"), tokenizer.token_id("</think>"),
           *encode(separator + "42")]
    assert _accepts(backend, GrammarSpec("regex", "[0-9]+", reasoning=span), ids, stop)
    assert _parser_split(tokenizer, span, ids) == ("a</think>b", "42")

    span = dataclasses.replace(TEXT_MARKERS, separator=separator)
    ids = encode(f"[R]a[/R]{separator}b[/R]42")
    assert not _accepts(backend, GrammarSpec("regex", "[0-9]+", reasoning=span), ids, stop)
    assert _accepts(backend, GrammarSpec("regex", r"b\[/R\]42", reasoning=span), ids, stop)
    assert _parser_split(tokenizer, span, ids) == ("a", "b[/R]42")

    span = ReasoningSpan("[R]", "nk", separator)  # one token, but an ordinary one: text to both
    assert len(encode("nk")) == 1 and tokenizer.token_id("nk") not in tokenizer.added_token_ids
    ids = [*encode("[R]a"), *encode("n"), *encode("k"), *encode(separator + "42")]
    assert _accepts(backend, GrammarSpec("regex", "[0-9]+", reasoning=span), ids, stop)
    assert _parser_split(tokenizer, span, ids) == ("a", "42")


def test_xgrammar_budget_forces_the_end_token(qwen):
    tokenizer, data = qwen
    backend = XGrammarBackend(data, num_compile_threads=1, num_fill_threads=1)
    spec = GrammarSpec("regex", "[0-9]+", reasoning=dataclasses.replace(QWEN, max_tokens=3))
    matcher = backend.new_matcher(backend.compile(spec))
    masks = np.zeros((1, data.mask_words), dtype=np.int32)

    def allowed() -> list[int]:
        backend.batch_fill([matcher], masks, [0])
        bits = np.unpackbits(masks.view(np.uint8), bitorder="little")[:data.vocab_size]
        return list(np.flatnonzero(bits))

    assert allowed() == [tokenizer.token_id("<think>")]
    assert matcher.accept(tokenizer.token_id("<think>"))
    for piece in ("h", "e", "l"):
        assert len(allowed()) > 100  # free text: most of the vocabulary
        assert matcher.accept(tokenizer.token_id(piece))
    assert allowed() == [tokenizer.token_id("</think>")]  # the budget is spent
    assert not matcher.accept(tokenizer.token_id("l"))
    matcher.rollback(2)  # drafts roll back through the span
    assert len(allowed()) > 100


def test_llguidance_refuses_a_budget_and_auto_leaves_it_to_xgrammar(qwen):
    from grammar_service.backends.llguidance import unsupported

    spec = GrammarSpec("json_schema", SCHEMA, any_whitespace=False,
                       reasoning=ReasoningSpan("<think>", "</think>", max_tokens=4))
    assert "xgrammar" in unsupported(spec)
    with pytest.raises(GrammarCompileError, match="max_tokens"):
        LLGuidanceBackend(qwen[1], num_compile_threads=1, num_fill_threads=1).compile(spec)


def test_the_span_is_part_of_the_cache_key():
    plain = GrammarSpec("regex", "x")
    with_span = GrammarSpec("regex", "x", reasoning=QWEN)
    assert len({spec_key(plain, "auto"), spec_key(with_span, "auto"),
                spec_key(GrammarSpec("regex", "x", reasoning=ReasoningSpan(max_tokens=2)), "auto")}) == 3


def test_llguidance_takes_structural_tags_with_special_tokens(qwen):
    """A literal holding a special token's text (llguidance lexes added tokens apart from text)
    matches that token; a text trigger is a lazy lexeme; a token budget is refused."""
    tokenizer, data = qwen
    backend = LLGuidanceBackend(data, num_compile_threads=1, num_fill_threads=1)
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [
        {"type": "tag", "begin": "<tool_call>x=", "content": {"type": "regex", "pattern": "[0-9]+"},
         "end": "</tool_call>"}], "at_least_one": False, "stop_after_first": False}}
    spec = GrammarSpec("structural_tag", json.dumps(tag))
    assert run(qwen, backend, spec, "free text <tool_call>x=12</tool_call> more <tool_call>x=3</tool_call>")
    assert not run(qwen, backend, spec, "free text <tool_call>y=12</tool_call>")
    assert run(qwen, backend, dataclasses.replace(spec, reasoning=QWEN), "<think>hm</think>\n\n<tool_call>x=1</tool_call>")
    budget = {"type": "structural_tag", "format": {"type": "any_text", "max_tokens": 3}}
    with pytest.raises(GrammarCompileError, match="roll back"):
        backend.compile(GrammarSpec("structural_tag", json.dumps(budget)))
    with pytest.raises(GrammarCompileError, match="legacy"):
        backend.compile(GrammarSpec("structural_tag", json.dumps({"structures": [], "triggers": []})))


def test_a_budgeted_span_is_not_read_as_an_empty_language():
    """xgrammar prints a token budget as a rule attribute (`any_tokens[max_tokens=3] ::=`),
    which the emptiness check reads as the rule it names."""
    import xgrammar as xgr

    from grammar_service.backends.xgrammar import reasoning_format
    from grammar_service.emptiness import unproductive_rules

    for ids in ({"<think>": 1, "</think>": 2}, {}):
        elements = reasoning_format(ReasoningSpan(max_tokens=3), ids.get)
        tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}
        found = unproductive_rules(str(xgr.Grammar.from_structural_tag(json.dumps(tag))))
        assert not found  # [] (read, all productive) or None (a form it cannot read: no claim)
    token_level = reasoning_format(ReasoningSpan(max_tokens=3), {"<think>": 1, "</think>": 2}.get)
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": token_level}}
    assert unproductive_rules(str(xgr.Grammar.from_structural_tag(json.dumps(tag)))) == []
