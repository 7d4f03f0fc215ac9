"""The matcher-slot contract of backends/base.py, on every registered backend (xgrammar and
llguidance): masks along valid documents, draft walk with rollback, refusals, stop tokens,
fast-forward tokens, and release/reuse of channel slots through the real step loop."""
from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.corpus import get_schema
from channel_driver import ChannelDriver, Row, allowed_tokens, is_allowed
from grammar_contract.spec import GrammarSpec
from grammar_service.backends import available_backends
from grammar_service.config import GrammarServiceConfig
from grammar_service.service import GrammarService
from real_tokenizers import continuation_ids
from step_channel import ERR_NONE, FLAG_CONSTRAINED, FLAG_RELEASE, MASK_OK, Geometry, StepChannel
from structgen.tokenizer_identity import fingerprint_tokenizer_json

EOS, VOCAB = 2, 32768  # "</s>" and the size of the Mistral v3 vocabulary (conftest.py)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age"]}
# Real-world schemas (benchmarks/corpus.py) with documents valid under them.
DOCS = [
    (PERSON, {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"]}),
    # xgrammar anchors `pattern` ("^https?://" admits only the prefix); llguidance searches.
    ("github-issue-config", {"blank_issues_enabled": False, "contact_links": [
        {"name": "Ask", "url": "https://", "about": "Questions go here"}]}),
    ("pyproject-distutils", {"global": {"verbose": True}}),
    # xgrammar closes objects without additionalProperties (strict_mode): only listed keys here.
    ("github-discussion", {"title": "[Idea] ", "labels": ["x"], "body": [
        {"type": "markdown", "attributes": {"label": "Thanks!"}}]}),
]


def _schema_text(schema) -> str:
    return get_schema(schema).text if isinstance(schema, str) else json.dumps(schema)


def _mask(backend, matcher) -> np.ndarray:
    masks = np.zeros((3, backend.tokenizer.mask_words), np.int32)
    backend.batch_fill([matcher], masks, [1])
    assert (masks[0] == 0).all() and (masks[2] == 0).all()  # rows it was not given stay untouched
    return masks[1].copy()


@pytest.mark.parametrize("schema,doc", DOCS, ids=lambda x: x if isinstance(x, str) else None)
def test_masks_allow_each_next_token_of_valid_documents(backend, mistral_32k, schema, doc):
    compiled = backend.compile(GrammarSpec("json_schema", _schema_text(schema)))
    matcher = backend.new_matcher(compiled)
    for token in continuation_ids(mistral_32k, json.dumps(doc)):
        assert is_allowed(_mask(backend, matcher), token)
        assert backend.batch_accept([matcher], [token]) == [True]
    assert list(allowed_tokens(_mask(backend, matcher))) == [EOS]
    assert backend.batch_accept([matcher], [EOS]) == [True] and matcher.is_terminated()


def test_draft_walk_gives_the_masks_of_one_token_at_a_time(backend, mistral_32k):
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(PERSON)))
    ids = continuation_ids(mistral_32k, json.dumps(DOCS[0][1]))
    sequential = backend.new_matcher(compiled)
    one_at_a_time = []
    for token in ids:
        one_at_a_time.append(_mask(backend, sequential))
        sequential.accept(token)
    # Walk 4 drafts per step as the loop does: fill, accept the draft, ...; the verifier keeps
    # 1 + 2 of them, so the matcher rolls back the other 2 it walked.
    walker, pos = backend.new_matcher(compiled), 0
    while pos + 4 <= len(ids):
        for p in range(4):
            np.testing.assert_array_equal(_mask(backend, walker), one_at_a_time[pos + p], f"position {pos + p}")
            assert backend.batch_accept([walker], [ids[pos + p]]) == [True]
        backend.batch_rollback([walker], [2])
        pos += 2
    np.testing.assert_array_equal(_mask(backend, walker), one_at_a_time[pos])


def test_rollback_restores_state_including_the_stop_token(backend, mistral_32k):
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(PERSON)))
    ids = continuation_ids(mistral_32k, '{"name": "Ada", "age": 3}')
    matcher = backend.new_matcher(compiled)
    masks_before = []
    for token in ids:
        masks_before.append(_mask(backend, matcher))
        assert matcher.accept(token)
    assert matcher.accept(EOS) and matcher.is_terminated()
    assert not matcher.accept(ids[0])  # a terminated matcher accepts nothing more
    backend.batch_rollback([matcher], [3])  # EOS + the last two tokens
    assert not matcher.is_terminated()
    np.testing.assert_array_equal(_mask(backend, matcher), masks_before[-2])
    assert matcher.accept(ids[-2]) and matcher.accept(ids[-1]) and matcher.accept(EOS)


def test_a_refused_token_leaves_the_matcher_where_it_was(backend, mistral_32k):
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(PERSON)))
    matcher = backend.new_matcher(compiled)
    ids = continuation_ids(mistral_32k, '{"name": "x", "age": 1}')
    assert matcher.accept(ids[0])
    before = _mask(backend, matcher)
    refused = continuation_ids(mistral_32k, "}")[0]
    assert not is_allowed(before, refused)
    assert backend.batch_accept([matcher], [refused]) == [False]
    assert not matcher.accept(EOS)  # not accepting yet
    np.testing.assert_array_equal(_mask(backend, matcher), before)
    assert all(matcher.accept(t) for t in ids[1:])


@pytest.mark.parametrize("min_parallel_rows", [0, 1], ids=["row-by-row", "in-threads"])
def test_batch_advance_accepts_as_batch_accept_and_reports_refusals(backend, mistral_32k, monkeypatch,
                                                                    min_parallel_rows):
    """The loop's deferred advance, one row at a time and (llguidance) in the fill threads: rows of
    two grammars advanced together reach the states batch_accept gives them one by one, rows that
    take a stop token and rows that go on sharing a batch; refusals (a token the grammar refuses, a
    stop token before the grammar accepts, a token after the stop) reported False."""
    monkeypatch.setattr(backend, "min_parallel_advance_rows", min_parallel_rows)
    person = backend.compile(GrammarSpec("json_schema", json.dumps(PERSON)))
    choice = backend.compile(GrammarSpec("choice", choices=("red", "green")))
    docs = [(person, continuation_ids(mistral_32k, '{"name": "x", "age": 1}') + [EOS]),
            (person, continuation_ids(mistral_32k, '{"name": "Ada", "age": 36, "tags": ["a"]}') + [EOS]),
            (choice, continuation_ids(mistral_32k, "green") + [EOS])]
    advanced = [backend.new_matcher(compiled) for compiled, _ in docs]
    accepted = [backend.new_matcher(compiled) for compiled, _ in docs]
    for j in range(max(len(ids) for _, ids in docs)):
        rows = [r for r, (_, ids) in enumerate(docs) if j < len(ids)]
        tokens = [docs[r][1][j] for r in rows]
        assert backend.batch_advance([advanced[r] for r in rows], tokens) == [True] * len(rows)
        assert [backend.batch_accept([accepted[r]], [t]) for r, t in zip(rows, tokens)] == [[True]] * len(rows)
        for r, t in zip(rows, tokens):
            assert advanced[r].is_terminated() == accepted[r].is_terminated() == (t == EOS)
            if t != EOS:
                np.testing.assert_array_equal(_mask(backend, advanced[r]), _mask(backend, accepted[r]))
    going_on = backend.new_matcher(person)
    refused = continuation_ids(mistral_32k, "}")[0]
    batch = [backend.new_matcher(person), backend.new_matcher(person), advanced[0], going_on]
    assert backend.batch_advance(batch, [refused, EOS, docs[0][1][0], docs[0][1][0]]) == [False, False, False, True]
    reference = backend.new_matcher(person)
    assert reference.accept(docs[0][1][0])
    np.testing.assert_array_equal(_mask(backend, going_on), _mask(backend, reference))


def test_jump_forward_tokens_are_what_the_grammar_forces(backend, mistral_32k):
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"status": {"const": "shipped"}}, "required": ["status"]}),
        any_whitespace=False))
    matcher = backend.new_matcher(compiled)
    forced = matcher.jump_forward_tokens()
    assert forced, "the whole document is forced"
    assert matcher.jump_forward_tokens() == forced  # asking does not change state
    for token in forced:
        assert matcher.accept(token)
    assert mistral_32k.decode(forced).startswith('{"status"')


def test_jump_forward_tokens_are_spelled_as_the_tokenizer_spells(backend, mistral_32k):
    """The tokens a model writes (the grammar proposer drafts them): never byte-fallback
    tokens where the vocabulary has the text's own ("_" rather than "<0x5F>")."""
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"shipping_status_description": {"const": "returned_to_sender"}},
         "required": ["shipping_status_description"]}), any_whitespace=False))
    forced = backend.new_matcher(compiled).jump_forward_tokens()
    text = mistral_32k.decode(forced)
    assert len(text) > len('{"shipping_status_description"')
    assert forced == continuation_ids(mistral_32k, text)


def test_batch_fill_writes_each_matcher_into_its_own_row(backend, mistral_32k):
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(PERSON)))
    a, b = backend.new_matcher(compiled), backend.new_matcher(compiled)
    assert a.accept(continuation_ids(mistral_32k, '{"')[0])
    masks = np.zeros((4, backend.tokenizer.mask_words), np.int32)
    backend.batch_fill([a, b], masks, [3, 1])
    np.testing.assert_array_equal(masks[3], _mask(backend, a))
    np.testing.assert_array_equal(masks[1], _mask(backend, b))
    assert not masks[0].any() and not masks[2].any()


# --- through the real step loop ------------------------------------------------------------
GEOMETRY = Geometry(max_batch=4, max_positions=4, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def service(mistral_32k_dir):
    svc = GrammarService(GrammarServiceConfig(tokenizer_dir=mistral_32k_dir, vocab_size=VOCAB))
    yield svc
    svc.close()


@pytest.fixture
def driver(service, mistral_32k_dir):
    chan = StepChannel.create(GEOMETRY)
    service.open_channel(chan.name, GEOMETRY, max_slots=8, first_step=1, tokenizer_dir=mistral_32k_dir,
                         tokenizer_fingerprint=fingerprint_tokenizer_json(mistral_32k_dir, VOCAB))
    yield ChannelDriver(chan)
    service.close_channel(chan.name)
    chan.close()


@pytest.mark.parametrize("backend_name", available_backends())
def test_channel_draft_walk_release_and_reuse(service, driver, mistral_32k, backend_name):
    def compile_id(**kw):
        return service.compile(GrammarSpec(backend=backend_name, **kw)).result(30).entry.grammar_id

    person = compile_id(kind="json_schema", text=json.dumps(PERSON))
    choice = compile_id(kind="choice", choices=("red", "green"))
    ids = continuation_ids(mistral_32k, '{"name": "Ada", "age": 36}')
    # step 1: FRESH with 3 drafts (the proposals for positions 0-2); the verifier accepts two
    # and samples the third position itself
    view = driver.step([Row.fresh(2, person, drafts=ids[0:3])])
    assert view.mask_status == MASK_OK and view.valid_positions[0] == 4
    for p in range(3):
        assert is_allowed(view.masks[0, p], ids[p])
    assert is_allowed(view.masks[0, 3], ids[3])
    driver.finish([ids[0:3]])
    # then one token per step, from where the verifier left the matcher (not the walk)
    for token in ids[3:]:
        view = driver.step([Row(2, 1, FLAG_CONSTRAINED)])
        assert view.results.tolist() == [[-1, ERR_NONE]] and is_allowed(view.masks[0, 0], token)
        driver.finish([[token]])
    view = driver.step([Row(2, 1, FLAG_CONSTRAINED)])
    assert list(allowed_tokens(view.masks[0, 0])) == [EOS]
    driver.finish([[EOS]])
    # the request finished (terminated at its only token); the slot is released and handed
    # to a new request in the same step
    view = driver.step([Row.release_only(2), Row.fresh(2, choice)])
    assert view.results.tolist() == [[0, ERR_NONE]]
    red = continuation_ids(mistral_32k, "red")
    assert is_allowed(view.masks[1, 0], red[0]) and not is_allowed(view.masks[1, 0], ids[0])
    driver.finish([[], red])
    view = driver.step([Row(2, 1, FLAG_CONSTRAINED | FLAG_RELEASE)])
    assert list(allowed_tokens(view.masks[0, 0])) == [EOS]


def test_a_configured_threshold_sends_the_loops_advance_through_the_threads(mistral_32k_dir, mistral_32k,
                                                                            monkeypatch):
    """GrammarServiceConfig.min_parallel_advance_rows reaches the llguidance backend the loop uses:
    a 3-row step is advanced in one consume_token_par call, a 1-row step row by row, and the rows
    walk a document (results ERR_NONE, the stop token ends each row)."""
    from grammar_service.backends.llguidance import LLGuidanceBackend

    in_threads = []
    advance_in_threads = LLGuidanceBackend._advance_in_threads

    def spy(self, matchers, token_ids):
        in_threads.append(len(matchers))
        return advance_in_threads(self, matchers, token_ids)
    monkeypatch.setattr(LLGuidanceBackend, "_advance_in_threads", spy)
    config = GrammarServiceConfig(tokenizer_dir=mistral_32k_dir, vocab_size=VOCAB, min_parallel_advance_rows=2)
    svc = GrammarService(config)
    chan = StepChannel.create(GEOMETRY)
    try:
        svc.open_channel(chan.name, GEOMETRY, max_slots=8, first_step=1, tokenizer_dir=mistral_32k_dir,
                         tokenizer_fingerprint=fingerprint_tokenizer_json(mistral_32k_dir, VOCAB))
        driver = ChannelDriver(chan)
        grammar_id = svc.compile(GrammarSpec("json_schema", json.dumps(PERSON), backend="llguidance")).result(30) \
            .entry.grammar_id
        ids = continuation_ids(mistral_32k, '{"name": "Ada", "age": 36}') + [EOS]
        view = driver.step([Row.fresh(slot, grammar_id) for slot in range(3)])
        for j, token in enumerate(ids):
            assert all(is_allowed(view.masks[r, 0], token) for r in range(3))
            driver.finish([[token]] * 3)
            view = driver.step([Row(slot, 1, FLAG_CONSTRAINED) for slot in range(3)])
            assert view.results[:, 1].tolist() == [ERR_NONE] * 3
        assert view.results[:, 0].tolist() == [0] * 3  # each row ended at its only token, the stop token
        driver.finish([[], [], []])
        driver.step([Row.fresh(3, grammar_id)])
        driver.finish([ids[:1]])
        view = driver.step([Row(3, 1, FLAG_CONSTRAINED)])  # a 1-row advance: below the threshold
        assert view.results.tolist() == [[-1, ERR_NONE]]
        assert in_threads == [3] * len(ids)
        svc.close_channel(chan.name)
    finally:
        chan.close()
        svc.close()


def test_llguidance_bounded_whitespace_is_refused_because_its_mask_and_matcher_disagree(make_backend):
    """llguidance 1.9.1, whitespace_pattern {0,1}: after "[6 ,0,0 " (tokens "[" "6" " ," <0x30> "," <0x30> " ", the
    default model's greedy path) the mask admits " ]" and the
    matcher refuses it. Until that changes, llguidance refuses max_whitespace > 0 and `auto`
    takes xgrammar; this test fails loudly once llguidance is fixed."""
    import llguidance as llg

    from grammar_service.backend_choice import compile_with
    from grammar_service.backends.base import GrammarCompileError
    from grammar_service.backends.llguidance import json_options

    llguidance = make_backend("llguidance")
    schema = json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3})
    spec = GrammarSpec("json_schema", schema, any_whitespace=True, max_whitespace=1)
    with pytest.raises(GrammarCompileError, match="max_whitespace"):
        llguidance.compile(spec)
    assert compile_with(spec, "auto", make_backend).backend == "xgrammar"

    from grammar_service.backends.llguidance import LLGuidanceGrammar
    from grammar_service.tokenizer import load_tokenizer
    from generation_service.model.tiny_random_model import ensure_tiny_random_model

    data = load_tokenizer(str(ensure_tiny_random_model()), 32000)[0]  # the mismatch shows on its vocabulary
    llguidance = type(llguidance)(data, num_compile_threads=1, num_fill_threads=1)
    vocab = {str(piece): i for i, piece in enumerate(data.encoded_vocab)}
    grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=json_options(spec))  # what it would compile
    matcher = llguidance.new_matcher(LLGuidanceGrammar(grammar, (llg.LLMatcher(llguidance.lltokenizer, grammar),), ()))
    assert all(matcher.accept(vocab[p]) for p in ("[", "6", "\u2581,", "<0x30>", ",", "<0x30>", "\u2581"))
    masks = np.zeros((1, data.mask_words), np.int32)
    llguidance.batch_fill([matcher], masks, [0])
    space_bracket = vocab["\u2581]"]
    assert is_allowed(masks[0], space_bracket) and not matcher.accept(space_bracket), "llguidance fixed: lift the refusal"
