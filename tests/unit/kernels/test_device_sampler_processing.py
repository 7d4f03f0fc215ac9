"""The device sampler's logits processing (`sampler.sample_on_device`, the eager GPU steps'
path) run through Triton's interpreter on CPU tensors: greedy rows pick what the CPU sampler
picks, sampled rows stay inside what the processing allows."""
import math

import torch

from generation_service.engine.params import SamplingParams
from generation_service.engine.sample_row import SampleRow
from generation_service.engine.sampler import sample_on_device, Sampler
from tests.unit.engine.test_logit_processing import reference
from tests.unit.engine.test_sampler import bitmask_allowing

V = 320
EOS = 7


def row(params: SamplingParams, position: int, output=(), constrained: bool = False) -> SampleRow:
    return SampleRow(params, seed=position, first_index=len(output), is_constrained=constrained,
                     position=position, prompt_ids=(1, 2, 3), output_ids=list(output),
                     end_token_ids=frozenset({EOS}))


def test_device_path_processing_matches_the_cpu_sampler():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, V, generator=gen) * 3
    logits[:, EOS] = 30.0  # every row's favourite: the hold decides
    top = int(logits[1].topk(2).indices[1])  # the best after EOS
    rows = [row(SamplingParams(), 10),
            row(SamplingParams(logit_bias=((EOS, -100.0), (top, -100.0))), 11),
            row(SamplingParams(logit_bias=((222, 100.0),)), 12),
            row(SamplingParams(min_tokens=3), 13, output=[5, 6]),
            row(SamplingParams(min_tokens=3), 14, output=[5], constrained=True),  # the grammar allows only EOS
            row(SamplingParams(presence_penalty=2.0, repetition_penalty=1.5, frequency_penalty=1.0, min_tokens=9),
                15, output=[int(logits[5].topk(2).indices[1])]),
            row(SamplingParams(temperature=1.0, min_p=0.5, min_tokens=2), 16)]
    bitmask = torch.full((7, V // 32), -1, dtype=torch.int32)
    bitmask[4] = bitmask_allowing([EOS], V)[0]
    on_device = sample_on_device(logits, rows, bitmask)
    on_cpu = [r.token_ids[0] for r in Sampler()(logits, rows, bitmask)]
    assert on_device[:6] == on_cpu[:6]
    assert on_device[0] == EOS and on_device[1] not in (EOS, top) and on_device[2] == 222
    assert on_device[3] != EOS and on_device[4] == EOS and on_device[5] != EOS
    allowed = reference(logits[6].tolist(), rows[6].params, [1, 2, 3], [], {EOS}, 0)
    assert allowed[on_device[6]] > -math.inf and on_device[6] != EOS


def test_the_greedy_launch_picks_what_mask_sample_and_the_cpu_sampler_pick():
    """Sampler.launch_greedy (plain greedy rows, no work per row): NaN never picked, ties to the
    smallest id, as mask_sample's greedy draw (interpreted here) and the CPU sampler."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(5, V, generator=gen) * 3).to(torch.bfloat16)
    logits[1, 40] = logits[1, 9] = 50.0           # a tie: the smaller id wins
    logits[2, 3] = float("nan")                   # NaN is -inf, not a maximum
    logits[3] = float("-inf")
    logits[3, 300] = 0.0
    logits[4, :] = float("nan")
    logits[4, 17] = -5.0
    rows = [row(SamplingParams(), 20 + i) for i in range(5)]
    launched = Sampler().launch_greedy(logits)
    greedy = [r.token_ids[0] for r in launched.result()]
    assert greedy == launched.tokens.tolist() == sample_on_device(logits, rows, None) \
        == [r.token_ids[0] for r in Sampler()(logits, rows)]
    assert greedy[1] == 9 and greedy[3] == 300 and greedy[4] == 17
