"""Prefix caching on the GPU (engine/prefix_cache.py) under the cuda_graph runner: rows that start
at a cached prefix run through the mixed forward (and its captured graphs), the decode graphs and
the verify graphs like any other row with num_cached > 0.

- Requests sharing a ~520-token prefix, the first alone and the rest in one batch, find its pages
  cached and give the cache-off engine's greedy tokens up to bf16 near ties (every token the
  argmax of an eager prefill).
- In a small pool, with n-gram drafts (verify graphs) and JSON-Schema rows beside them, requests are
  preempted and cached pages evicted; the outputs are unchanged and the constrained ones valid.
- A request cancelled mid-prefill leaves the pages it computed to a request with its prefix.
Afterwards no page is held by a request. CPU: tests/integration/test_engine_prefix_cache.py."""
from __future__ import annotations

import dataclasses
import json

import pytest

from gpu_helpers import SCHEMA, TOKENIZER_DIR, check_greedy_rows, check_settled, engine_config
from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams
from grammar_contract.spec import GrammarSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (TOKENIZER_DIR / "tokenizer.json").is_file(),
                                                  reason="no Tekken tokenizer")]
SYSTEM = " ".join(f"entry {i}: value {i * 7 % 13}, note {i % 5}." for i in range(40)) + "\n"  # ~520 tokens
TAILS = ["The quick brown fox jumps over", "1 2 3 4 1 2 3", "Hello, my name is",
         "def f(x): return x + 1\ndef g(x):", "Write letters:", "a b c a b c a"]
CHUNKS = dict(prefill_chunk_tokens=64, max_prefill_tokens=128, max_prompt_tokens=1024)


def request(engine, rid: str, prompt: str, *, drafts: int = 0, constrained: bool = False,
            new_tokens: int = 24) -> GenerationRequest:
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA), any_whitespace=False) if constrained else None
    sampling = SamplingParams(max_new_tokens=120 if constrained else new_tokens, ignore_eos=not constrained)
    return GenerationRequest(rid, tuple(engine.tokenizer.encode(prompt)), sampling, grammar=grammar,
                             speculative=SpeculativeParams(drafts))


def serve(config, grammar=None, *, first_alone: bool = True, options: dict[int, dict] | None = None):
    """(engine, results, settled stats) of one request per tail after SYSTEM (`options`: the
    `request` options of each by index): the first alone (its prefix gets cached), then the rest
    in one batch."""
    from generation_service.engine.engine import Engine
    from tests.integration.test_engine_support import collect, run_all, wait_settled
    options = options or {}
    engine = Engine(config, grammar)
    engine.start()
    try:
        specs = [request(engine, f"r{i}", SYSTEM + tail, **options.get(i, {})) for i, tail in enumerate(TAILS)]
        head = [collect(engine.submit(specs[0]))] if first_alone else []
        results = head + run_all(engine, specs[len(head):])
        return engine, results, wait_settled(engine)
    finally:
        engine.stop()


def test_shared_prefix_hits_and_gives_the_cache_off_greedy_tokens(model_spec):
    config = engine_config(model_spec, "cuda_graph", **CHUNKS)
    _, off, off_stats = serve(dataclasses.replace(config, prefix_caching=False))
    engine, on, stats = serve(config)
    for r in off + on:
        assert r.error is None and r.finish_reason is FinishReason.MAX_TOKENS, r.error
    num_shared = len(engine.tokenizer.encode(SYSTEM)) // 16 * 16 - 16
    assert all(r.usage.cached_prompt_tokens >= num_shared for r in on[1:]), [r.usage for r in on]
    assert all(r.usage.cached_prompt_tokens == 0 for r in off) and off_stats.prefix_cache_hit_tokens == 0
    assert stats.prefix_cache_hit_tokens == sum(r.usage.cached_prompt_tokens for r in on)
    assert stats.num_prefill_tokens < off_stats.num_prefill_tokens - 4 * num_shared  # prefilled once
    assert engine.runner.num_graph_steps > 0 and engine.runner.mixed_graphs.num_steps > 0
    num_identical = check_greedy_rows(engine, [SYSTEM + t for t in TAILS], off, on)
    print(f"cache on == off on {num_identical}/{len(TAILS)} requests; hit tokens {stats.prefix_cache_hit_tokens}")
    assert num_identical >= len(TAILS) - 1
    check_settled(stats)
    assert stats.num_kv_pages_cached > 0


def test_a_small_pool_with_drafts_and_json_rows_preempts_evicts_and_stays_correct(model_spec, grammar_service):
    import jsonschema
    from grammar_contract.client import GrammarControlClient
    options = {0: dict(drafts=3, new_tokens=96), 1: dict(constrained=True), 2: dict(new_tokens=96),
               3: dict(drafts=3, new_tokens=96), 4: dict(constrained=True, drafts=2), 5: dict(drafts=3, new_tokens=96)}
    config = engine_config(model_spec, "cuda_graph", max_draft_tokens=3, **CHUNKS)
    _, off, _ = serve(dataclasses.replace(config, prefix_caching=False),
                      GrammarControlClient(grammar_service.address), first_alone=False, options=options)
    # 48 pages of 16: the shared prefix (~33 pages) and the own pages of a few requests at a time
    engine, on, stats = serve(dataclasses.replace(config, num_pages=1 + 48),
                              GrammarControlClient(grammar_service.address), first_alone=False, options=options)
    assert stats.num_preemptions > 0 and stats.prefix_cache_evictions > 0 and stats.prefix_cache_hit_tokens > 0
    assert stats.draft_proposed > stats.draft_accepted > 0  # verify steps accepted and rolled back drafts
    for i, r in enumerate(on):
        assert r.error is None, (i, r.error)
        if options.get(i, {}).get("constrained"):
            assert r.finish_reason is FinishReason.GRAMMAR_COMPLETE, r.text
            jsonschema.validate(json.loads(r.text), SCHEMA)
    free = [i for i in range(len(TAILS)) if not options.get(i, {}).get("constrained")]
    num_identical = check_greedy_rows(engine, [SYSTEM + TAILS[i] for i in free], [off[i] for i in free],
                                      [on[i] for i in free])
    assert num_identical >= len(free) - 1
    check_settled(stats)


def test_a_cancel_mid_prefill_leaves_its_pages_to_a_request_with_the_same_prefix(model_spec):
    from generation_service.engine.engine import Engine
    from tests.integration.test_engine_support import collect, wait_settled
    config = engine_config(model_spec, "cuda_graph", **CHUNKS)
    _, off, _ = serve(dataclasses.replace(config, prefix_caching=False), first_alone=False)
    engine = Engine(dataclasses.replace(config, max_prefill_tokens=64))  # a's chunks fill every step
    engine.start()
    try:
        chunks, streams = [], {}
        run = engine.runner.run

        def cancel_a_after_two_chunks(batch, fed_back=None):
            chunks.extend(row.num_cached for row in batch.rows if row.request.request_id == "a")
            if len(chunks) == 2:
                streams["a"].cancel()
            return run(batch, fed_back)
        engine.runner.run = cancel_a_after_two_chunks
        streams["a"] = engine.submit(request(engine, "a", SYSTEM + TAILS[1]))
        streams["b"] = engine.submit(request(engine, "r0", SYSTEM + TAILS[0]))
        a, b = collect(streams["a"]), collect(streams["b"])
        stats = wait_settled(engine)
    finally:
        engine.stop()
    assert a.finish_reason is FinishReason.CANCELLED and not a.token_ids
    assert chunks[:2] == [0, 64] and b.usage.cached_prompt_tokens == 128
    assert check_greedy_rows(engine, [SYSTEM + TAILS[0]], off[:1], [b]) == 1
    check_settled(stats)
