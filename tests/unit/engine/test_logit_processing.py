"""Logits processing (engine/logit_processing.py) against a plain reference of vLLM's /
OpenAI's semantics, and the sampler picking tokens with it on every CPU path."""
from __future__ import annotations

import math
import random

import pytest
import torch

from generation_service.engine.logit_processing import LogitProcessing
from generation_service.engine.params import SamplingParams
from generation_service.engine.sample_row import SampleRow
from generation_service.engine.sampler import Sampler
from tests.unit.engine.test_sampler import bitmask_allowing

V = 64
EOS = 2


def reference(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int],
              end_ids: set[int], generated_index: int) -> list[float]:
    """One position, token by token, as vLLM's sampler defines each step."""
    x = list(logits)
    if generated_index < params.min_tokens and any(
            v > -math.inf for t, v in enumerate(x) if t not in end_ids):
        for t in end_ids:
            x[t] = -math.inf
    for t, bias in params.logit_bias:
        x[t] += bias
    for t in set(prompt) | set(output):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    if params.min_p > 0 and params.temperature > 0:
        probs = torch.softmax(torch.tensor(x) / params.temperature, dim=0)
        x = [-math.inf if p < params.min_p * float(probs.max()) else v for v, p in zip(x, probs.tolist())]
    return x


def row_with(params: SamplingParams, output: list[int], drafts=(), prompt=(5, 6, 7, 5)) -> SampleRow:
    return SampleRow(params, seed=1, first_index=len(output), drafts=list(drafts), prompt_ids=tuple(prompt),
                     output_ids=list(output), end_token_ids=frozenset({EOS, 9}))


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.8]), frequency_penalty=rng.uniform(-2, 2),
        presence_penalty=rng.uniform(-2, 2), repetition_penalty=rng.choice([1.0, 0.7, 1.3]),
        logit_bias=tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(V), 3)),
        min_p=rng.choice([0.0, 0.05, 0.3]), min_tokens=rng.choice([0, 2, 5]), max_new_tokens=8)


def test_every_step_matches_the_reference_per_position_with_drafts_and_neutral_rows():
    rng = random.Random(0)
    torch.manual_seed(0)
    rows = [row_with(random_params(rng), [rng.randrange(V) for _ in range(n)], drafts=d)
            for n, d in [(0, ()), (3, (EOS, 4, 4)), (4, ()), (1, (9,))]]
    rows.insert(1, row_with(SamplingParams(), [1, 1]))  # neutral: left as it is
    logits = torch.randn(sum(r.num_positions for r in rows), V) * 4
    logits[0, 11] = -math.inf  # a grammar-masked token stays masked
    processed = logits.clone()
    LogitProcessing.of(rows, V).apply(processed)
    start = 0
    for row in rows:
        for p in range(row.num_positions):
            output = row.output_ids + row.drafts[:p]
            want = reference(logits[start + p].tolist(), row.params, list(row.prompt_ids), output,
                             set(row.end_token_ids), row.first_index + p)
            torch.testing.assert_close(processed[start + p], torch.tensor(want), rtol=1e-5, atol=1e-4)
        start += row.num_positions
    assert torch.equal(processed[1], logits[1])
    assert processed[0, 11] == -math.inf


def test_rows_that_use_nothing_build_nothing():
    rows = [row_with(SamplingParams(temperature=0.5, top_k=3), [1]), row_with(SamplingParams(min_p=0.5), [])]
    assert LogitProcessing.of(rows, V) is None  # greedy min_p changes no pick


def greedy(params: SamplingParams, logits: torch.Tensor, output=(), mask=None) -> int:
    row = row_with(params, list(output))
    row.is_constrained = mask is not None
    return Sampler()(logits, [row], mask)[0].token_ids[0]


def test_logit_bias_bans_and_forces_a_token():
    torch.manual_seed(1)
    logits = torch.randn(1, V)
    top = int(logits.argmax())
    assert greedy(SamplingParams(logit_bias=((top, -100.0),)), logits) != top
    assert greedy(SamplingParams(logit_bias=((30, 100.0),)), logits) == 30
    # a grammar-disallowed token stays disallowed whatever its bias
    assert greedy(SamplingParams(logit_bias=((30, 100.0),)), logits, mask=bitmask_allowing([top, 31])) == top


def test_min_tokens_holds_end_tokens_back_unless_nothing_else_is_allowed():
    logits = torch.zeros(1, V)
    logits[0, EOS] = 50.0
    hold = SamplingParams(min_tokens=3)
    assert greedy(hold, logits, output=[4, 4]) != EOS       # index 2 < 3: held
    assert greedy(hold, logits, output=[4, 4, 4]) == EOS    # index 3: free
    assert greedy(hold, logits, output=[4], mask=bitmask_allowing([EOS])) == EOS  # grammar complete


def test_presence_penalty_changes_the_greedy_pick_as_the_reference_predicts():
    logits = torch.zeros(1, V)
    logits[0, 8], logits[0, 12] = 3.0, 2.5
    assert greedy(SamplingParams(presence_penalty=0.4), logits, output=[8]) == 8   # 2.6 > 2.5
    assert greedy(SamplingParams(presence_penalty=0.6), logits, output=[8]) == 12  # 2.4 < 2.5
    assert greedy(SamplingParams(frequency_penalty=0.3), logits, output=[8, 8]) == 12  # 3 - 0.6
    assert greedy(SamplingParams(repetition_penalty=1.3), logits, output=[], ) == 8  # 8 not seen
    assert greedy(SamplingParams(repetition_penalty=1.3), logits, output=[8]) == 12  # 3 / 1.3


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, 1.5, 0.5  # the rest: e^-2 = 0.14 of the top
    params = SamplingParams(temperature=1.0, min_p=0.2)
    drawn = {Sampler()(logits, [SampleRow(params, seed, 0)])[0].token_ids[0] for seed in range(300)}
    assert drawn == {3, 4, 5}
    hotter = SamplingParams(temperature=2.0, min_p=0.2)  # tempered: e^-1 = 0.37 of the top, kept
    assert len({Sampler()(logits, [SampleRow(hotter, seed, 0)])[0].token_ids[0] for seed in range(300)}) > 3


def test_verifying_drafts_picks_what_single_steps_pick():
    """Position p of a verify row sees drafts[:p] as generated: its drafts taken from the
    greedy single-step walk are all accepted and give the same tokens, EOS held alike."""
    torch.manual_seed(3)
    steps = torch.randn(5, V)
    steps[:, EOS] += 4.0  # EOS is the model's favourite: the hold decides
    params = SamplingParams(presence_penalty=1.5, repetition_penalty=1.2, min_tokens=4, max_new_tokens=8)
    walked = []
    for index in range(5):
        walked += Sampler()(steps[index:index + 1], [row_with(params, walked)])[0].token_ids
    assert EOS not in walked[:4] and walked[4] == EOS
    assert Sampler()(steps, [row_with(params, [], drafts=walked[:4])])[0].token_ids == walked


def test_a_held_end_token_draft_is_never_accepted_when_sampling():
    steps = torch.zeros(4, V)
    steps[:, EOS] = 6.0
    params = SamplingParams(temperature=1.0, min_tokens=3, max_new_tokens=8)
    for seed in range(40):
        row = row_with(params, [], drafts=[EOS, EOS, EOS])
        row.seed = seed
        tokens = Sampler()(steps, [row])[0].token_ids
        assert EOS not in tokens[:3] and len(tokens) == 1  # the first draft is rejected


def test_the_token_right_after_prefill_is_held_too():
    logits = torch.zeros(1, V)
    logits[0, 9] = 20.0  # a stop token id
    assert greedy(SamplingParams(min_tokens=1), logits) != 9


@pytest.mark.parametrize("kwargs,match", [
    ({"frequency_penalty": 2.5}, "frequency_penalty must be in \\[-2, 2\\]"),
    ({"presence_penalty": -3.0}, "presence_penalty must be in \\[-2, 2\\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in \\(0, 10\\]"),
    ({"min_p": 1.5}, "min_p must be in \\[0, 1\\]"),
    ({"logit_bias": ((3, 101.0),)}, "logit_bias\\[3\\] must be in \\[-100, 100\\]"),
    ({"logit_bias": ((3, 1.0), (3, 2.0))}, "twice"),
    ({"min_tokens": 9, "max_new_tokens": 8}, "min_tokens must be in \\[0, max_new_tokens = 8\\]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
])
def test_out_of_range_values_are_refused_saying_the_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_tiny_repetition_penalty_keeps_sampling_finite():
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6] = 3.0, 2.0
    row = row_with(SamplingParams(temperature=1.0, repetition_penalty=1e-30), [6], prompt=())
    assert Sampler()(logits, [row])[0].token_ids == [6]  # 2 / 1e-30: certain, and no NaN
