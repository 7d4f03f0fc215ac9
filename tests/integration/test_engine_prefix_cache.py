"""Prefix caching on CPU with a real grammar_service: requests that share a prompt prefix reuse
its KV pages, and every output is the one the engine gives with the cache off -- with
speculative drafts rolled back, preemption and eviction in a small pool, cancellation
mid-prefill and a cancelled request whose pages another one shares. Afterwards no page is
held by a request; the cached ones stay for the next request. The same on the GPU:
tests/gpu/test_prefix_cache_on_gpu.py."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams
from grammar_contract.spec import GrammarSpec
from tests.integration.test_engine_support import (
    collect, make_engine, run_all, shared_grammar_service, shared_model, wait_settled,
)

# The shared "system prompt" (76 tokens): code, after which the random model's greedy output
# varies enough for n-gram drafts to be both accepted and rejected.
SYSTEM = "def f(x): return x + 1\ndef g(x): return f(x) + 2\n" * 3
TAILS = ["Hello, my name is", "1 2 3 4 1 2 3 4", "def f(x): return x +", "The quick brown fox",
         "a b c d e f g a b c", "Once upon a time there was"]
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["word", "n"], "additionalProperties": False}
COMMON = dict(model=shared_model(), max_batch=6, page_size=4, max_draft_tokens=3, prefill_chunk_tokens=16,
              max_prefill_tokens=16)


@pytest.fixture(scope="module")
def engines():
    address = shared_grammar_service().address
    off = make_engine(address, prefix_caching=False, **COMMON)
    on = make_engine(address, **COMMON)
    yield off, on
    off.stop()
    on.stop()


def make(engine, rid: str, tail: str, i: int, *, system: str = SYSTEM, new_tokens: int = 24,
         constrained: bool | None = None, drafts: int | None = None) -> GenerationRequest:
    """Greedy or seeded sampling, some with n-gram drafts, some JSON-Schema constrained."""
    constrained = i % 3 == 1 if constrained is None else constrained
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA), any_whitespace=False) if constrained else None
    sampling = SamplingParams(max_new_tokens=50 if grammar else new_tokens, temperature=0.8 if i % 2 else 0.0,
                              seed=i, ignore_eos=grammar is None)
    return GenerationRequest(rid, tuple(engine.tokenizer.encode(system + tail)), sampling, grammar=grammar,
                             speculative=SpeculativeParams(3 if drafts is None and i % 4 != 1 else drafts or 0))


def check(result, request: GenerationRequest) -> None:
    assert result.error is None, result.error
    if request.grammar is not None:
        assert result.finish_reason is FinishReason.GRAMMAR_COMPLETE, result.text
        jsonschema.validate(json.loads(result.text), SCHEMA)
    else:
        assert result.finish_reason is FinishReason.MAX_TOKENS


def check_settled(engine) -> None:
    """No page held by a request; every page free or kept by the cache."""
    stats = wait_settled(engine)
    assert (stats.num_kv_pages_used, stats.num_slots_used, stats.num_grammar_matchers) == (0, 0, 0), stats
    cache = engine.prefix_cache
    assert cache.allocator.num_free_pages + cache.num_cached_pages == stats.num_kv_pages_total


def first_then_rest(engine, tag: str) -> list:
    """The first request alone (its prefix gets cached), then the others in one batch."""
    specs = [make(engine, f"{tag}{i}", tail, i) for i, tail in enumerate(TAILS)]
    return specs, [collect(engine.submit(specs[0]))] + run_all(engine, specs[1:])


def test_shared_prefix_is_prefilled_once_and_outputs_are_unchanged(engines):
    off, on = engines
    before = on.stats()
    specs, expected = first_then_rest(off, "off")
    _, got = first_then_rest(on, "on")
    stats = on.stats()
    num_shared = len(on.tokenizer.encode(SYSTEM)) // 4 * 4 - 4  # whole pages, the boundary's aside
    for i, (spec, e, g) in enumerate(zip(specs, expected, got)):
        check(e, spec)
        assert g.token_ids == e.token_ids and g.text == e.text, f"request {i}"
        assert e.usage.cached_prompt_tokens == 0
        assert g.usage.cached_prompt_tokens >= (num_shared if i else 0), (i, g.usage)
    assert sum(r.usage.cached_prompt_tokens for r in got) == stats.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    assert off.stats().prefix_cache_query_tokens == 0 and off.stats().num_kv_pages_cached == 0
    assert stats.draft_proposed > stats.draft_accepted  # drafts were rolled back beside shared pages
    check_settled(on)
    assert on.stats().num_kv_pages_cached > 0  # kept for the next request


def test_a_small_pool_preempts_and_evicts_and_outputs_are_unchanged(engines):
    off, _ = engines
    tiny = make_engine(shared_grammar_service().address, num_pages=1 + 48, **COMMON)
    try:
        rounds = [[make(off, f"t{n}-{i}", tail, i) for i, tail in enumerate(TAILS)] for n in range(2)]
        expected = [run_all(off, specs) for specs in rounds]
        got = [run_all(tiny, [make(tiny, spec.request_id, TAILS[i], i) for i, spec in enumerate(specs)])
               for specs in rounds]
        stats = tiny.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_evictions > 0 and stats.prefix_cache_hit_tokens > 0
        for specs, es, gs in zip(rounds, expected, got):
            for spec, e, g in zip(specs, es, gs):
                check(e, spec)
                assert g.token_ids == e.token_ids, spec.request_id
        check_settled(tiny)
    finally:
        tiny.stop()


class CancelAt:
    """Wraps the engine's (real) runner: calls `when(batch)` before each forward."""

    def __init__(self, engine, when) -> None:
        self._run, self.when = engine.runner.run, when
        engine.runner.run = self
        self.engine = engine

    def __call__(self, batch, fed_back=None):
        self.when(batch)
        return self._run(batch, fed_back)

    def remove(self) -> None:
        self.engine.runner.run = self._run


def test_cancel_mid_prefill_leaves_its_computed_pages_to_a_request_with_the_same_prefix(engines):
    off, on = engines
    system = "# cancel\n" + SYSTEM  # a prefix no earlier test cached
    a = make(on, "a", TAILS[1], 2, system=system)
    b = make(on, "b", TAILS[0], 0, system=system, drafts=0)
    expected = collect(off.submit(make(off, "b-off2", TAILS[0], 0, system=system, drafts=0)))
    streams = {}
    chunks = []

    def cancel_a_after_two_chunks(batch):
        chunks.extend(row.num_cached for row in batch.rows if row.request.request_id == "a")
        if len(chunks) == 2:
            streams["a"].cancel()
    hook = CancelAt(on, cancel_a_after_two_chunks)
    try:
        streams["a"] = on.submit(a)
        streams["b"] = on.submit(b)  # waits: a's chunks take each step's whole budget
        result_a, result_b = collect(streams["a"]), collect(streams["b"])
    finally:
        hook.remove()
    assert result_a.finish_reason is FinishReason.CANCELLED and not result_a.token_ids
    assert chunks[:2] == [0, 16]
    assert result_b.token_ids == expected.token_ids
    assert result_b.usage.cached_prompt_tokens == 32  # a's two computed chunks
    check_settled(on)


def test_a_request_keeps_its_shared_pages_when_the_other_is_cancelled(engines):
    off, on = engines
    system = "# share\n" + SYSTEM
    expected = collect(off.submit(make(off, "y-off", TAILS[2], 0, system=system, new_tokens=40)))
    x = on.submit(make(on, "x", TAILS[3], 2, system=system, new_tokens=200))
    x.get(timeout=60)  # x decodes: its prompt's pages are cached
    y = on.submit(make(on, "y", TAILS[2], 0, system=system, new_tokens=40))
    head = y.get(timeout=60)
    with on.lock:  # (the engine thread's state)
        pages = next(r for r in on.scheduler.running if r.request_id == "y").pages
        assert [p for p in pages if on.prefix_cache.refs(p) == 2]  # y holds x's prefix pages
    x.cancel()
    result = collect(y)
    assert list(head.token_ids) + result.token_ids == expected.token_ids
    assert result.usage.cached_prompt_tokens > 0
    check_settled(on)


@pytest.mark.parametrize("seed", [0, 1])
def test_no_page_leaks_after_a_random_mix(engines, seed):
    """Shared prefixes, drafts, constrained rows, preemption and eviction in a small pool,
    cancellations at random steps; the requests not cancelled give the cache-off outputs."""
    off, _ = engines
    rng = random.Random(seed)
    systems = [SYSTEM, SYSTEM[: len(SYSTEM) // 2], "Reply briefly. "]
    plan = [(rng.choice(systems), rng.choice(TAILS), i, rng.random() < 0.3) for i in range(10)]
    cancel_at = {i: rng.randrange(1, 30) for _, _, i, cancelled in plan if cancelled}
    tiny = make_engine(shared_grammar_service().address, num_pages=1 + 48, **COMMON)
    try:
        steps = []
        streams = {}

        def cancel_some(batch):
            steps.append(batch)
            for i, at in cancel_at.items():
                if len(steps) == at and i in streams:
                    streams[i].cancel()
        hook = CancelAt(tiny, cancel_some)
        for system, tail, i, _ in plan:
            streams[i] = tiny.submit(make(tiny, f"m{i}", tail, i, system=system))
        got = {i: collect(stream) for i, stream in streams.items()}
        hook.remove()
        check_settled(tiny)
        stats = tiny.stats()
        assert stats.prefix_cache_hit_tokens and stats.num_preemptions and stats.prefix_cache_evictions
    finally:
        tiny.stop()
    kept = [(system, tail, i) for system, tail, i, _ in plan if i not in cancel_at]
    expected = run_all(off, [make(off, f"e{seed}-{i}", tail, i, system=system) for system, tail, i in kept])
    for (system, tail, i), e in zip(kept, expected):
        assert got[i].token_ids == e.token_ids, i
    for i in cancel_at:
        assert got[i].finish_reason in (FinishReason.CANCELLED, FinishReason.MAX_TOKENS,
                                        FinishReason.GRAMMAR_COMPLETE)
