"""Mixed steps on the GPU (engine/mixed_forward.py): prefill chunks of several requests and decode
rows in one fused bf16 forward with varlen attention over the paged cache.

- Staggered requests whose prompts are prefilled in chunks beside other rows' decode steps give the
  greedy tokens of the eager reference engine (prefill, then decode; per-row fp32 attention) up to
  bf16 near ties, and the graphs still run the pure decode steps; a step chained after one in
  flight (a mixed step after a decode graph, a decode graph after either) takes its tokens on
  the device.
- Prompts up to 8k tokens, in one step or in chunks over the cache, match the reference forward
  (the model's own modules, fp32 reference attention) within bf16 bounds: logits of the sampling
  positions and every K/V written.
- JSON-Schema rows decoding beside prefill chunks stay valid (grammar_service in its own process).
- The prefill budget measured at start is a whole number of 64-token blocks inside its bounds."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from gpu_helpers import (
    PROMPTS, SCHEMA, TOKENIZER_DIR, check_greedy_rows, check_settled, engine_config, greedy, run_engine,
)
from generation_service.engine.events import FinishReason
from generation_service.engine.params import GenerationRequest, SamplingParams
from grammar_contract.spec import GrammarSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (TOKENIZER_DIR / "tokenizer.json").is_file(),
                                                  reason="no Tekken tokenizer")]
LONG = " ".join(f"entry {i}: value {i * 7 % 13}, note {i % 5}." for i in range(40))  # ~400 tokens


class StepLog:
    """What each mixed step of the (real) runner computed: (new tokens, is decode) per row."""

    def __init__(self, engine) -> None:
        self.steps: list[list[tuple[int, bool]]] = []
        self._run, engine.runner.run = engine.runner.run, self

    def __call__(self, batch, fed_back=None):
        self.steps.append([(len(row.input_ids), row.is_decode) for row in batch.rows])
        return self._run(batch, fed_back)

    @property
    def num_mixed(self) -> int:
        return sum(1 for s in self.steps if any(d for _, d in s) and any(n > 1 for n, _ in s))


def staggered(engine_cfg, grammar=None, *, json_rows: int = 0):
    """Two short requests first; once they decode, long prompts arrive beside them."""
    from generation_service.engine.engine import Engine
    from tests.integration.test_engine_support import collect, wait_settled
    engine = Engine(engine_cfg, grammar)
    engine.start()
    try:
        log = StepLog(engine) if engine.runner_name == "cuda_graph" else None
        spec = SamplingParams(max_new_tokens=60, ignore_eos=True)
        first = [engine.submit(GenerationRequest(f"s{i}", tuple(engine.tokenizer.encode(p)), spec))
                 for i, p in enumerate(PROMPTS[:2])]
        heads = [s.get(timeout=120) for s in first]
        later = [greedy(10 + i, p)(engine) for i, p in enumerate([LONG, PROMPTS[2], LONG[::-1], PROMPTS[3]])]
        grammar_spec = GrammarSpec("json_schema", json.dumps(SCHEMA), any_whitespace=False)
        later += [GenerationRequest(f"j{i}", tuple(engine.tokenizer.encode(PROMPTS[4])),
                                    SamplingParams(max_new_tokens=200), grammar=grammar_spec) for i in range(json_rows)]
        streams = [engine.submit(r) for r in later]
        results = [collect(s) for s in first + streams]
        for head, result in zip(heads, results):
            result.token_ids = list(head.token_ids) + result.token_ids
        return engine, results, wait_settled(engine), log
    finally:
        engine.stop()


def test_staggered_mixed_steps_give_the_eager_engines_greedy_tokens(model_spec):
    extra = dict(prefill_chunk_tokens=32, max_prefill_tokens=64, max_prompt_tokens=1024)
    _, eager, _, _ = staggered(engine_config(model_spec, "eager", **extra))
    engine, graph, stats, log = staggered(engine_config(model_spec, "cuda_graph", **extra))
    assert log.num_mixed >= 10, log.steps  # the long prompts' chunks shared steps with decode rows
    runner = engine.runner
    assert runner.num_graph_steps > 0 and runner.num_mixed_steps == stats.num_mixed_steps
    assert runner.mixed_graphs.num_steps >= log.num_mixed  # the mixed steps replayed captured graphs
    # the long prompts arrived while the short ones' decode graphs ran: a mixed step chained after one;
    # once prefilled, and as rows ended, decode graphs were launched fed the step in flight's tokens
    assert engine.mixed.num_after_graph >= 1 and engine.mixed.num_into_graph >= 1, (
        engine.mixed.num_after_graph, engine.mixed.num_into_graph, log.steps)
    for r in eager + graph:
        assert r.error is None and r.finish_reason is FinishReason.MAX_TOKENS, r.error
    prompts = PROMPTS[:2] + [LONG, PROMPTS[2], LONG[::-1], PROMPTS[3]]
    num_identical = check_greedy_rows(engine, prompts, eager, graph)
    print(f"mixed == eager on {num_identical}/{len(prompts)} requests; {log.num_mixed} mixed steps with decode"
          f" rows of {len(log.steps)}; graph steps {engine.runner.num_graph_steps}")
    check_settled(stats)


def test_pipelined_mixed_steps_give_the_serial_tokens(model_spec, grammar_service):
    """Mixed steps launched before the previous step's text is streamed and, chained, before its
    tokens are read (the default under the graphs; constrained rows too: their grammar step on the
    device, engine/stream_channel.py) give the tokens of mixed steps run one at a time, and
    constrained rows stay valid."""
    import jsonschema
    from gpu_helpers import same_or_near_tie, teacher_forced_logits
    from grammar_contract.client import GrammarControlClient
    extra = dict(prefill_chunk_tokens=32, max_prefill_tokens=64, max_prompt_tokens=1024)
    runs = {}
    for pipelined in (False, True):
        config = engine_config(model_spec, "cuda_graph", pipeline_mixed=pipelined, **extra)
        engine, results, stats, log = staggered(config, GrammarControlClient(grammar_service.address), json_rows=2)
        assert engine._pipeline_mixed is pipelined and log.num_mixed >= 5, log.steps
        for r in results[-2:]:
            assert r.error is None and r.finish_reason is FinishReason.GRAMMAR_COMPLETE, (r.error, r.text)
            jsonschema.validate(json.loads(r.text), SCHEMA)
        check_settled(stats)
        print(f"pipelined {pipelined}: {stats.num_chained_grammar_steps} of {stats.num_mixed_steps} mixed steps "
              f"chained with their grammar step on the device")
        assert (stats.num_chained_grammar_steps >= 5) is pipelined, stats
        runs[pipelined] = engine, results
    prompts = PROMPTS[:2] + [LONG, PROMPTS[2], LONG[::-1], PROMPTS[3]]
    num_identical = check_greedy_rows(runs[True][0], prompts, runs[False][1][:-2], runs[True][1][:-2])
    print(f"pipelined == serial on {num_identical}/{len(prompts)} requests")
    for serial, chained in zip(runs[False][1][-2:], runs[True][1][-2:]):  # masked argmax: the near-tie check
        prompt_ids = list(runs[True][0].tokenizer.encode(PROMPTS[4]))
        logits = teacher_forced_logits(runs[True][0], prompt_ids + chained.token_ids)
        same_or_near_tie(logits, len(prompt_ids), serial.token_ids, chained.token_ids, chained.text)


def test_constrained_rows_stay_valid_beside_prefill_chunks(model_spec, grammar_service):
    import jsonschema
    from grammar_contract.client import GrammarControlClient
    config = engine_config(model_spec, "cuda_graph", prefill_chunk_tokens=32, max_prefill_tokens=64,
                           max_prompt_tokens=1024)
    engine, results, stats, log = staggered(config, GrammarControlClient(grammar_service.address), json_rows=3)
    assert log.num_mixed >= 5, log.steps
    for r in results[-3:]:
        assert r.error is None and r.finish_reason is FinishReason.GRAMMAR_COMPLETE, (r.error, r.text)
        jsonschema.validate(json.loads(r.text), SCHEMA)
    check_settled(stats)


def _long_model(layers: int = 2):
    from gpu_helpers import small_config
    from generation_service.model.random_init import build_random_model
    config = dataclasses.replace(small_config(layers), max_position_embeddings=16384)
    return build_random_model(config, torch.device("cuda"), torch.bfloat16, seed=3)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("chunk", [None, 2048], ids=["one-step", "chunks-of-2048"])
def test_prompts_up_to_8k_match_the_reference_attention(chunk):
    from generation_service.engine.cuda_graphs import DecodeBuffers
    from generation_service.engine.decode_forward import DecodeForward
    from generation_service.engine.kv_cache import KVCache
    from generation_service.engine.mixed_forward import MixedForward
    from generation_service.engine.runner import prepare
    from generation_service.engine.scheduler import ScheduledBatch, ScheduledRow
    model = _long_model()
    cfg = model.config
    lengths, page = [8192, 4100, 1000], 16
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    tables, next_page = [], 1
    for n in lengths:
        tables.append(list(range(next_page, next_page + -(-n // page))))
        next_page += len(tables[-1])

    def cache():
        kv = KVCache(cfg.num_layers, next_page + 1, page, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
        for t in kv.k + kv.v:
            t.normal_(0.0, 1.0, generator=torch.Generator(device="cuda").manual_seed(9))
        return kv
    ref_kv, kv = cache(), cache()
    rows = [ScheduledRow(SimpleNamespace(pages=t), 0, p, [], True) for p, t in zip(prompts, tables)]
    with torch.inference_mode():
        want = model(prepare(ScheduledBatch(rows), torch.device("cuda")), ref_kv).float()
    mixed = MixedForward(DecodeForward(model, kv, DecodeBuffers.allocate(1, 1024, "cuda"), gemv_max_batch=0))
    if chunk is None:
        got = mixed(rows).float()
    else:  # the 8k prompt in chunks over its own cached prefix, the others beside its last chunk
        for start in range(0, lengths[0] - chunk, chunk):
            mixed([ScheduledRow(rows[0].request, start, prompts[0][start:start + chunk], [], False)])
        last = lengths[0] - chunk
        got = mixed([ScheduledRow(rows[0].request, last, prompts[0][last:], [], True)] + rows[1:]).float()
    assert got.shape == want.shape == (3, cfg.vocab_size)
    errors = [_rel(got[i], want[i]) for i in range(3)]
    kv_errors = [max(_rel(kv.k[layer][1:next_page], ref_kv.k[layer][1:next_page]),
                     _rel(kv.v[layer][1:next_page], ref_kv.v[layer][1:next_page])) for layer in range(cfg.num_layers)]
    print(f"chunk {chunk}: logits rel err {['%.4f' % e for e in errors]}, K/V rel err {['%.4f' % e for e in kv_errors]}")
    assert max(errors) < 3e-2 and max(kv_errors) < 2e-2, (errors, kv_errors)


def test_the_measured_prefill_budget_is_whole_blocks_within_bounds(model_spec):
    from generation_service.engine.engine import Engine
    engine = Engine(engine_config(model_spec, "cuda_graph", max_prompt_tokens=1024))
    try:
        budget = engine.token_budget
        print(f"measured prefill chunk: {budget.with_decode} tokens beside decode rows, {budget.alone} alone")
        assert budget.with_decode % 64 == 0 and 64 <= budget.with_decode <= budget.alone == 8192
        assert engine.config.prefill_chunk_tokens == budget.with_decode
    finally:
        engine.stop()
