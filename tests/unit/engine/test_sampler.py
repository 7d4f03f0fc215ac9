import math

import pytest
import torch

from generation_service.engine.params import SamplingParams
from generation_service.engine.sample_row import SampleRow
from generation_service.engine.sampler import mix_seed, Sampler, unpack_bitmask
from generation_service.engine.speculative import accept_rejection

V = 64


def bitmask_allowing(tokens: list[int], vocab: int = V) -> torch.Tensor:
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for t in tokens:
        words[t // 32] |= 1 << (t % 32)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).unsqueeze(0)


def test_unpack_bitmask_bits_and_tokens_beyond_the_mask_are_disallowed():
    mask = bitmask_allowing([0, 31, 33], vocab=64)
    allowed = unpack_bitmask(mask, 70)
    assert allowed.shape == (1, 70)
    assert allowed[0].nonzero().flatten().tolist() == [0, 31, 33]


def test_nan_logits_are_never_sampled_and_mask_applies_before_greedy():
    logits = torch.randn(2, V)
    logits[0, 3] = float("nan")
    logits[0, 7] = 100.0
    logits[1, 7] = 100.0
    rows = [SampleRow(SamplingParams(), 0, 0), SampleRow(SamplingParams(), 0, 0, is_constrained=True)]
    mask = torch.cat([bitmask_allowing(list(range(V))), bitmask_allowing([10, 11])])
    out = Sampler()(logits, rows, mask)
    assert out[0].token_ids == [7]
    assert out[1].token_ids[0] in (10, 11)


def test_unconstrained_rows_ignore_the_mask_rows():
    logits = torch.zeros(1, V)
    logits[0, 5] = 10
    out = Sampler()(logits, [SampleRow(SamplingParams(), 0, 0)], bitmask_allowing([1]))
    assert out[0].token_ids == [5]


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_sampling_respects_the_mask_top_k_and_top_p(temperature):
    torch.manual_seed(0)
    logits = torch.randn(1, V)
    allowed = [2, 9, 20, 40, 41]
    seen = set()
    for seed in range(200):
        row = SampleRow(SamplingParams(temperature=temperature, top_k=3), seed, 0, is_constrained=True)
        seen.update(Sampler()(logits, [row], bitmask_allowing(allowed))[0].token_ids)
    top3 = sorted(allowed, key=lambda t: -float(logits[0, t]))[:3]
    assert seen == set(top3)
    tiny_p = SampleRow(SamplingParams(temperature=1.0, top_p=1e-6), 5, 0)
    assert Sampler()(logits, [tiny_p])[0].token_ids == [int(logits.argmax())]


def test_seeded_sampling_does_not_depend_on_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    params = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler()(logits[1:2], [SampleRow(params, 42, 5)])
    other = SamplingParams(temperature=0.9)
    batched = Sampler()(logits, [SampleRow(other, 7, 0), SampleRow(params, 42, 5), SampleRow(other, 9, 3)])
    assert alone[0].token_ids == batched[1].token_ids
    # a different generated index draws different noise
    assert {tuple(Sampler()(logits[1:2], [SampleRow(params, 42, i)])[0].token_ids) for i in range(30)} != {
        tuple(alone[0].token_ids)}
    assert mix_seed(1, 2) != mix_seed(2, 1)


def test_rejection_sampling_keeps_the_target_distribution():
    """First emitted token over many seeds ~ p, whatever the (deterministic) draft."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    n, draft = 20000, 1
    counts = torch.zeros(4)
    accepted = 0
    for seed in range(n):
        gen = torch.Generator().manual_seed(seed)
        u = [float(torch.rand((), generator=gen)) for _ in range(2)]
        noise = [torch.empty(4).exponential_(generator=gen) for _ in range(2)]
        out = accept_rejection(p, [draft], u, noise)
        counts[out[0]] += 1
        accepted += len(out) == 2
    freq = counts / n
    assert torch.allclose(freq, p[0], atol=0.015), freq
    assert abs(accepted / n - 0.3) < 0.015  # accepted with prob p(d)


def test_speculative_greedy_rows_and_logprobs():
    logits = torch.full((3, V), -5.0)
    logits[0, 4] = 5
    logits[1, 8] = 5
    logits[2, 9] = 5
    row = SampleRow(SamplingParams(num_logprobs=2), 0, 0, drafts=[4, 1])
    out = Sampler()(logits, [row])[0]
    assert out.token_ids == [4, 8]  # draft 4 accepted, draft 1 rejected -> 8
    assert out.num_accepted_drafts == 1
    assert len(out.logprobs) == 2 and out.logprobs[1].token_id == 8
    expected = float(torch.log_softmax(logits[0], dim=-1)[4])
    assert math.isclose(out.logprobs[0].logprob, expected, rel_tol=1e-5)
    assert [t for t, _ in out.logprobs[0].top][0] == 4 and len(out.logprobs[0].top) == 2


def test_mask_backends_agree():
    from generation_service.engine.sampler import MASK_BACKENDS

    torch.manual_seed(3)
    logits = torch.randn(4, 70)  # wider than the 64-token mask: the tail is disallowed
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 2), dtype=torch.int32)
    rows = torch.tensor([1, 3])
    results = []
    for apply in MASK_BACKENDS.values():
        out = logits.clone()
        apply(out, bitmask, rows)
        results.append(out)
    assert torch.equal(results[0], results[1])
    assert torch.isinf(results[0][1, 64:]).all() and torch.equal(results[0][0], logits[0])


def test_sample_row_of_a_scheduled_row_carries_the_position_the_graphs_sample_at():
    from generation_service.engine.params import GenerationRequest
    from generation_service.engine.request import Request
    from generation_service.engine.scheduler import ScheduledRow

    prompt = tuple(range(10, 20))
    request = Request(GenerationRequest("r", prompt, SamplingParams(temperature=1.0, seed=3)), frozenset(), 3)
    prefill = SampleRow.of(ScheduledRow(request, 6, list(prompt[6:]), is_sampling=True), False)
    assert (prefill.position, prefill.first_index, prefill.seed) == (9, 0, 3)  # the last prompt token
    request.token_ids += [7, 8, 9]
    decode = SampleRow.of(ScheduledRow(request, 12, [9], is_sampling=True), True)
    assert (decode.position, decode.first_index, decode.is_constrained) == (12, 3, True)  # = num_cached
    verify = SampleRow.of(ScheduledRow(request, 12, [9, 4, 5], drafts=[4, 5], is_sampling=True), False)
    assert (verify.position, verify.drafts, verify.can_sample_on_device) == (12, [4, 5], False)
    assert decode.can_sample_on_device and not SampleRow(SamplingParams(), 0, 0).can_sample_on_device


def test_only_plain_greedy_unconstrained_rows_without_drafts_take_the_greedy_launch():
    from generation_service.engine.params import GenerationRequest
    from generation_service.engine.request import Request
    from generation_service.engine.sample_row import all_plain_greedy
    from generation_service.engine.scheduler import ScheduledRow
    from grammar_contract.spec import GrammarSpec

    def row(sampling=SamplingParams(), drafts=(), grammar=None):
        request = Request(GenerationRequest("r", (1, 2, 3), sampling, grammar=grammar), frozenset(), 0)
        return ScheduledRow(request, 3, [4, *drafts], list(drafts), is_sampling=True)
    plain = row()
    assert all_plain_greedy([plain, row(SamplingParams(top_k=5, max_new_tokens=9))])  # top-k: no effect when greedy
    for other in (row(SamplingParams(temperature=0.7)), row(SamplingParams(num_logprobs=1)),
                  row(SamplingParams(min_tokens=2)), row(SamplingParams(logit_bias=((5, 1.0),))),
                  row(SamplingParams(repetition_penalty=1.2)), row(drafts=(7, 8)),
                  row(grammar=GrammarSpec("regex", "[0-9]+"))):
        assert not all_plain_greedy([plain, other])


_DEVICE_PATH_SCRIPT = """
import torch
from generation_service.engine.params import SamplingParams
from generation_service.engine.sampler import Sampler, SampleRow
from generation_service.kernels.sample_reference import mask_sample_torch
torch.manual_seed(0)
V = 200
logits = torch.randn(5, V) * 3
bitmask = torch.full((5, (V + 31) // 32), -1, dtype=torch.int32)
bitmask[3, :] = 0
bitmask[3, 1] = 0b1011  # tokens 32, 33, 35
bitmask[0, :] = 0       # an unconstrained row: its words are ignored
rows = [SampleRow(SamplingParams(), 1, 0, position=4),
        SampleRow(SamplingParams(temperature=1.0), 2**63 + 5, 2, position=17),
        SampleRow(SamplingParams(temperature=0.8, top_k=5), 9, 0, position=3),
        SampleRow(SamplingParams(temperature=1.0), 4, 1, is_constrained=True, position=8),
        SampleRow(SamplingParams(temperature=1.2, top_p=0.5, num_logprobs=2), 6, 0, position=30)]
out = Sampler()._sample_one_position(logits, rows, bitmask)
masks = bitmask.clone()
masks[0] = -1
ids, _ = mask_sample_torch(logits, masks, torch.tensor([r.params.temperature for r in rows]),
                           torch.tensor([r.params.top_k for r in rows], dtype=torch.int32),
                           torch.tensor([r.params.top_p for r in rows]),
                           torch.tensor([r.seed & (2**63 - 1) for r in rows]),
                           torch.tensor([r.position for r in rows]), mask_vocab_size=V)
assert [o.token_ids for o in out] == [[t] for t in ids.tolist()], (out, ids)
assert out[3].token_ids[0] in (32, 33, 35)
assert [len(o.logprobs) for o in out] == [0, 0, 0, 0, 1] and len(out[4].logprobs[0].top) == 2
print("ok")
"""


def test_device_path_draws_what_the_mask_sample_reference_draws():
    """The one-position path (CUDA on the device) run through Triton's interpreter on the
    CPU in a subprocess (the interpreter is chosen at kernel import): the same tokens as
    the torch reference of mask_sample for the same seeds, positions and masks."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _DEVICE_PATH_SCRIPT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]
