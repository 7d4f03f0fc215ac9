"""Logits processing on CUDA (engine/logit_processing.py): the eager device sampler picks what
the CPU sampler picks for the same processed logits, and through the Engine with
runner="cuda_graph" every token of a penalized, biased or EOS-held request follows the
reference definitions, while batches without such rows keep their decode graphs."""
from __future__ import annotations

import math

import pytest
import torch

from gpu_helpers import (NEW_TOKENS, PROMPTS, TOKENIZER_DIR, engine_config, greedy, run_engine, same_or_near_tie,
                         teacher_forced_logits)
from generation_service.engine.events import FinishReason
from generation_service.engine.params import SamplingParams
from generation_service.engine.sample_row import SampleRow
from generation_service.engine.sampler import Sampler
from tests.unit.engine.test_logit_processing import reference

pytestmark = pytest.mark.gpu
VOCAB = 131072
EOS = 7


def allowing(tokens: list[int]) -> torch.Tensor:
    bits = torch.zeros(VOCAB, dtype=torch.bool)
    bits[tokens] = True
    words = (bits.view(VOCAB // 32, 32).long() * 2 ** torch.arange(32, dtype=torch.int64)).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def processed_row(params: SamplingParams, position: int, output=(), constrained: bool = False) -> SampleRow:
    return SampleRow(params, seed=position, first_index=len(output), is_constrained=constrained,
                     position=position, prompt_ids=(1, 2, 3), output_ids=list(output),
                     end_token_ids=frozenset({EOS}))


def test_device_sampler_applies_the_processing_as_the_cpu_sampler_does():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, VOCAB, generator=gen) * 3
    logits[:, EOS] = 30.0  # EOS is every row's favourite: the hold decides
    top = int(logits[1].topk(2).indices[1])  # the best after EOS
    rows = [processed_row(SamplingParams(), 10),  # neutral: EOS
            processed_row(SamplingParams(logit_bias=((EOS, -100.0), (top, -100.0))), 11),
            processed_row(SamplingParams(logit_bias=((4242, 100.0),)), 12),
            processed_row(SamplingParams(min_tokens=3), 13, output=[5, 6]),
            processed_row(SamplingParams(min_tokens=3), 14, output=[5], constrained=True),  # only EOS allowed
            processed_row(SamplingParams(presence_penalty=2.0, repetition_penalty=1.5, min_tokens=9,
                                         frequency_penalty=1.0), 15, output=[int(logits[5].topk(2).indices[1])]),
            processed_row(SamplingParams(temperature=1.0, min_p=0.5, min_tokens=2), 16),
            processed_row(SamplingParams(temperature=0.8, logit_bias=((99, 100.0),)), 17)]
    bitmask = torch.full((8, VOCAB // 32), -1, dtype=torch.int32)
    bitmask[4] = allowing([EOS])
    on_device = [r.token_ids[0] for r in Sampler()(logits.cuda(), rows, bitmask)]
    on_cpu = [r.token_ids[0] for r in Sampler()(logits, rows, bitmask)]
    assert on_device[:6] == on_cpu[:6]  # greedy rows: the same processed argmax
    assert on_device[0] == EOS and on_device[1] not in (EOS, top) and on_device[2] == 4242
    assert on_device[3] != EOS and on_device[4] == EOS and on_device[5] != EOS
    want6 = reference(logits[6].tolist(), rows[6].params, [1, 2, 3], [], {EOS}, 0)
    assert want6[on_device[6]] > -math.inf and on_device[6] != EOS  # within min_p's set, EOS held
    assert on_device[7] == 99


def reference_greedy(engine, prompt: str, params: SamplingParams, token_ids: list[int]) -> None:
    """Each token is the argmax of the reference-processed teacher-forced logits (up to bf16
    noise: the same tolerance as the graph-vs-eager checks)."""
    prompt_ids = list(engine.tokenizer.encode(prompt))
    logits = teacher_forced_logits(engine, prompt_ids + token_ids)
    ends = set(engine.eos_token_ids)
    for j, token in enumerate(token_ids):
        row = logits[len(prompt_ids) + j - 1].cpu()
        want = torch.tensor(reference(row.tolist(), params, prompt_ids, token_ids[:j], ends, j))
        gap = (want.max() - want[token]).item()
        assert gap <= 0.1 * row.std().item() + 1e-3, (prompt, j, gap)


@pytest.mark.skipif(not (TOKENIZER_DIR / "tokenizer.json").is_file(), reason="no Tekken tokenizer")
def test_graph_engine_follows_the_reference_and_only_processed_batches_leave_the_graphs(model_spec):
    eos_hold = dict(min_tokens=5, ignore_eos=False)
    penalized = [dict(presence_penalty=1.5), dict(frequency_penalty=1.0, repetition_penalty=1.3)]
    free_engine, free, _ = run_engine(engine_config(model_spec, "cuda_graph"),
                                      [greedy(i, p) for i, p in enumerate(PROMPTS[:3])])
    assert free_engine.runner.num_graph_steps >= NEW_TOKENS - 1  # no processing: decode graphs
    requests = [greedy(10 + i, PROMPTS[i], **options) for i, options in enumerate(penalized)]
    requests.append(lambda engine: greedy(20, PROMPTS[2], logit_bias=((engine.eos_token_ids[0], 100.0),),
                                          **eos_hold)(engine))
    requests.append(greedy(21, PROMPTS[3], logit_bias=((4242, 100.0),)))
    requests.append(greedy(22, PROMPTS[0]))  # a neutral row beside them
    engine, results, _ = run_engine(engine_config(model_spec, "cuda_graph"), requests)
    for i, options in enumerate(penalized):
        reference_greedy(engine, PROMPTS[i], SamplingParams(max_new_tokens=NEW_TOKENS, **options),
                         results[i].token_ids)
    held = results[2]
    assert held.finish_reason is FinishReason.STOP_TOKEN and len(held.token_ids) == 6
    assert not set(engine.eos_token_ids) & set(held.token_ids[:5])
    assert results[3].token_ids == [4242] * NEW_TOKENS
    neutral_ids = list(engine.tokenizer.encode(PROMPTS[0]))  # graph steps before, mixed steps now
    same_or_near_tie(teacher_forced_logits(engine, neutral_ids + results[4].token_ids), len(neutral_ids),
                     free[0].token_ids, results[4].token_ids, PROMPTS[0])
    runner = engine.runner
    print(f"with processed rows: graph steps {runner.num_graph_steps}, mixed steps {runner.num_mixed_steps}")
    assert runner.num_mixed_steps >= NEW_TOKENS - 1
