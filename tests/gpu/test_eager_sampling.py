"""Eager steps on CUDA sample like the decode graphs: the Sampler's device path draws the
token mask_sample draws for the same logits, seed and position, whatever the batch layout;
draft-verify rows and top-n logprobs keep the CPU rules; and through the Engine a seeded
request gets the same tokens whether its steps ran eagerly or as graph replays."""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import write_random_checkpoint
from generation_service.engine.params import SamplingParams
from generation_service.engine.sample_row import SampleRow
from generation_service.engine.sampler import Sampler

pytestmark = pytest.mark.gpu
VOCAB = 131072
WORDS = VOCAB // 32


def bitmask_allowing(tokens: torch.Tensor) -> torch.Tensor:
    """(W,) int32 words with exactly `tokens` allowed."""
    bits = torch.zeros(VOCAB, dtype=torch.bool)
    bits[tokens] = True
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    words = (bits.view(WORDS, 32).long() * weights).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def rows_and_logits():
    """A mixed batch: greedy, sampled, top-k, top-p, constrained, logprobs, one with drafts."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, VOCAB, generator=gen) * 3).cuda()
    allowed = torch.randperm(VOCAB, generator=gen)[:500]
    rows = [SampleRow(SamplingParams(), 11, 0, position=40),
            SampleRow(SamplingParams(temperature=1.0, seed=5), 5, 3, position=517),
            SampleRow(SamplingParams(temperature=0.7, top_k=20), 2**63 + 9, 0, position=9),
            SampleRow(SamplingParams(temperature=1.3, top_p=0.9), 77, 1, position=1000),
            SampleRow(SamplingParams(temperature=1.0), 8, 0, is_constrained=True, position=33),
            SampleRow(SamplingParams(temperature=1.0, num_logprobs=3), 3, 2, position=70),
            SampleRow(SamplingParams(temperature=1.0), 4, 2, drafts=[17], position=71)]
    bitmask = torch.full((8, WORDS), -1, dtype=torch.int32)
    bitmask[4] = bitmask_allowing(allowed)
    bitmask[0] = 0  # an unconstrained row's mask words are ignored, as on the CPU
    return logits, rows, bitmask, allowed


def mask_sample_tokens(logits, rows, bitmask):
    """Straight through mask_sample, as GpuDecodeRunner._sample calls it."""
    from generation_service.kernels.mask_sample import mask_sample
    dev = logits.device
    masks = torch.stack([bitmask[i] if row.is_constrained else torch.full((WORDS,), -1, dtype=torch.int32)
                         for i, row in enumerate(rows)]).to(dev)
    ids, _ = mask_sample(
        logits, masks, torch.tensor([r.params.temperature for r in rows], device=dev),
        torch.tensor([r.params.top_k for r in rows], dtype=torch.int32, device=dev),
        torch.tensor([r.params.top_p for r in rows], device=dev),
        torch.tensor([r.seed & ((1 << 63) - 1) for r in rows], device=dev),
        torch.tensor([r.position for r in rows], device=dev), mask_vocab_size=VOCAB,
        enable_filters=True)
    return ids.tolist()


def test_one_position_rows_draw_what_mask_sample_draws():
    logits, rows, bitmask, allowed = rows_and_logits()
    out = Sampler()(logits, rows, bitmask)
    one = [i for i, row in enumerate(rows) if not row.drafts]
    want = mask_sample_tokens(logits[one], [rows[i] for i in one], bitmask[one])
    assert [out[i].token_ids for i in one] == [[t] for t in want]
    assert out[0].token_ids == [int(logits[0].argmax())]
    assert out[4].token_ids[0] in set(allowed.tolist())
    # logprobs: the CPU numbers for the device's token
    cpu = Sampler()._sample_cpu(logits[5:6].cpu(), [rows[5]], None)[0]
    got = out[5].logprobs[0]
    assert got.token_id == out[5].token_ids[0] and len(got.top) == 3
    expected = float(torch.log_softmax(logits[5].cpu(), -1)[got.token_id])
    assert abs(got.logprob - expected) < 1e-5 and got.top == cpu.logprobs[0].top
    # the draft row keeps the CPU verify rule on its two logit rows
    assert out[6].token_ids == Sampler()._sample_cpu(logits[6:8].cpu(), [rows[6]], None)[0].token_ids


def test_device_draws_do_not_depend_on_the_batch():
    logits, rows, bitmask, _ = rows_and_logits()
    batched = Sampler()(logits, rows, bitmask)
    for i in (1, 2, 3, 4):
        alone = Sampler()(logits[i:i + 1], [rows[i]], bitmask[i:i + 1])
        assert alone[0].token_ids == batched[i].token_ids
    # the position is the Philox step: another position, another draw
    draws = {Sampler()(logits[1:2], [SampleRow(rows[1].params, rows[1].seed, 0, position=p)])[0].token_ids[0]
             for p in range(512, 530)}
    assert len(draws) > 1


def test_rows_without_a_position_take_the_cpu_path():
    """SampleRows built without `position` (an engine that does not pass it) sample exactly
    as the CPU sampler does on the same logits."""
    logits, rows, bitmask, _ = rows_and_logits()
    plain = [SampleRow(r.params, r.seed, r.first_index, r.drafts, r.is_constrained) for r in rows]
    got = Sampler()(logits, plain, bitmask)
    want = Sampler()(logits.cpu(), plain, bitmask)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


@pytest.fixture(scope="module")
def model_spec(tmp_path_factory) -> str:
    """A 2-layer random Llama (bf16, untied), no tokenizer: prompts are token ids."""
    return write_random_checkpoint(tmp_path_factory.mktemp("model"), with_tokenizer=False)


def run_seeded(model_spec: str, num_logprobs: int) -> tuple[list[list[int]], object]:
    """Six seeded temperature-1 requests in one batch through Engine(runner="auto")."""
    from generation_service.engine.config import EngineConfig
    from generation_service.engine.engine import Engine
    from generation_service.engine.params import GenerationRequest
    from tests.integration.test_engine_support import run_all
    engine = Engine(EngineConfig(model=model_spec, device="cuda", dtype="bfloat16", runner="auto",
                                 max_batch=8, num_pages=512, max_prompt_tokens=256,
                                 max_new_tokens_limit=256, seed=0))
    engine.start()
    try:
        requests = [GenerationRequest(f"r{i}", tuple(range(100 + 7 * i, 140 + 7 * i)), SamplingParams(
            temperature=1.0, seed=1000 + i, max_new_tokens=16, ignore_eos=True, num_logprobs=num_logprobs))
            for i in range(6)]
        results = run_all(engine, requests)
    finally:
        engine.stop()
    assert all(r.error is None and len(r.token_ids) == 16 for r in results)
    return [r.token_ids for r in results], engine.runner


def test_engine_seeded_tokens_match_between_eager_and_graph_steps(model_spec):
    """The same seeded requests, once with logprobs (every step eager: the device path) and
    once without (graph steps after the eager prefill). Same noise for the same (seed,
    position); the two forwards' logits differ by bf16 noise, so a rare Gumbel near-tie may
    still flip a token. With the CPU sampler on eager steps every sequence diverged by its
    second token. Needs the engine to build its rows with `SampleRow.of` (the position)."""
    eager, eager_runner = run_seeded(model_spec, num_logprobs=1)
    graph, graph_runner = run_seeded(model_spec, num_logprobs=0)
    assert graph_runner.num_graph_steps > 0 and eager_runner.num_graph_steps == 0
    for e, g in zip(eager, graph):
        diverged = next((j for j, (a, b) in enumerate(zip(e, g)) if a != b), None)
        print(f"eager {e[:4]}.. graph {g[:4]}.. first difference at {diverged}")
    assert all(e[0] == g[0] for e, g in zip(eager, graph))  # the prefill step: eager in both
    same = sum(e == g for e, g in zip(eager, graph))
    assert same >= len(eager) - 2, same
