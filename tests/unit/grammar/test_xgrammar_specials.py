"""Special tokens are no text to xgrammar (backends/xgrammar_specials.py), on the real 131k
Tekken vocabulary (1000 special tokens: [INST], <SPECIAL_12>...), with reasoning markers that
are text, as `benchmarks/serve.py --plan features` asks: a special token is dropped from the
served text, so a grammar that matched it as text let the client see another document."""
import json

import numpy as np
import pytest

from generation_service.assistant.parser import TurnParser
from generation_service.model.tokenizer import Tokenizer
from grammar_contract.spec import GrammarSpec, ReasoningSpan
from grammar_service.backends.xgrammar import XGrammarBackend
from grammar_service.backends.xgrammar_specials import SpecialTokenFilter
from grammar_service.tokenizer import load_tokenizer
from structgen.schema_validation import validate_output

VOCAB = 131072
INST, END_INST, TOOL_CALLS = 3, 4, 9   # Tekken's [INST], [/INST], [TOOL_CALLS]
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "minLength": 3}},
                     "required": ["name"], "additionalProperties": False})
THINK = ReasoningSpan("<think>", "</think>", max_tokens=32)


@pytest.fixture(scope="module")
def tekken(tekken_131k_dir):
    data, _ = load_tokenizer(tekken_131k_dir, VOCAB)
    return Tokenizer(tekken_131k_dir), data, XGrammarBackend(data, num_compile_threads=1, num_fill_threads=1)


def allowed(backend, matcher) -> set[int]:
    masks = np.zeros((2, backend.tokenizer.mask_words), dtype=np.int32)
    backend.batch_fill([matcher], masks, [1])
    return set(np.flatnonzero(np.unpackbits(masks[1].view(np.uint8), bitorder="little")[:VOCAB]).tolist())


def walk(tekken, spec: GrammarSpec, pieces) -> tuple[object, list[int]]:
    """A matcher fed `pieces` (text, or token ids), and the ids; fails on a refused token."""
    tokenizer, _, backend = tekken
    matcher, ids = backend.new_matcher(backend.compile(spec)), []
    for piece in pieces:
        for token_id in piece if isinstance(piece, list) else tokenizer.encode(piece, add_special_tokens=False):
            assert backend.batch_accept([matcher], [token_id]) == [True], (piece, token_id)
            ids.append(token_id)
    return matcher, ids


def test_the_served_text_is_the_document_the_grammar_matched(tekken):
    """Before: [INST] inside the string counted 6 characters of a minLength 3, and `</` [INST]
    `think>` was no end marker to the grammar but one to the parser of the served text."""
    tokenizer, _, backend = tekken
    specials = set(tokenizer.special_token_ids) - {tokenizer.eos_token_ids[0]}  # what the served text drops
    assert len(specials) == 999
    spec = GrammarSpec("json_schema", SCHEMA, any_whitespace=False, reasoning=THINK)
    for before in (["<think>a</"], ["<think>a</think>", '{"name":"ab']):
        matcher, _ = walk(tekken, spec, before)
        assert not allowed(backend, matcher) & specials
        assert backend.batch_accept([matcher], [INST]) == [False] and not matcher.accept(INST)
    matcher, ids = walk(tekken, spec, ["<think>a</th", "b</think>", '{"name":"abc"}'])
    assert allowed(backend, matcher) == {tokenizer.eos_token_ids[0]}  # a stop token is special too
    piece = TurnParser(THINK, None).feed(tokenizer.decode(ids), final=True)
    assert piece.reasoning == "a</thb" and validate_output(SCHEMA, piece.content).valid


def test_special_tokens_the_grammar_names_stay_allowed(tekken):
    tokenizer, _, backend = tekken
    markers = ReasoningSpan("[INST]", "[/INST]", max_tokens=2)
    matcher, _ = walk(tekken, GrammarSpec("regex", "[0-9]+", reasoning=markers), [[INST], "a"])
    assert END_INST in allowed(backend, matcher) and TOOL_CALLS not in allowed(backend, matcher)
    tag = {"type": "structural_tag", "format": {
        "type": "token_triggered_tags", "trigger_tokens": ["[TOOL_CALLS]"], "at_least_one": False,
        "stop_after_first": True, "tags": [{"type": "tag", "begin": {"type": "token", "token": "[TOOL_CALLS]"},
                                            "content": {"type": "const_string", "value": "[1]"}, "end": "]"}]}}
    matcher, _ = walk(tekken, GrammarSpec("structural_tag", json.dumps(tag)), ["hello "])
    assert TOOL_CALLS in allowed(backend, matcher) and INST not in allowed(backend, matcher)
    walk(tekken, GrammarSpec("structural_tag", json.dumps(tag)), ["hello ", [TOOL_CALLS], "[1]]"])


def test_the_filter_touches_only_special_bits_of_the_rows_given():
    specials = SpecialTokenFilter([1, 33, 40, 95], always_allowed=[95], vocab_size=100)
    masks = np.full((3, 4), -1, dtype=np.int32)
    specials.apply(masks, [0, 2], [specials.keep, specials.keep_for([40])])
    bits = np.unpackbits(masks.view(np.uint8), bitorder="little").reshape(3, 128)
    assert set(np.flatnonzero(bits[0] == 0)) == {1, 33, 40}
    assert bits[1].all()  # a row not given
    assert set(np.flatnonzero(bits[2] == 0)) == {1, 33}
    assert specials.allows(specials.keep, 2) and not specials.allows(specials.keep, 33)
