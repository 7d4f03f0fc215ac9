"""Fused grammar mask + sampling kernel vs its torch reference (same uniforms)."""
import pytest
import torch

pytest.importorskip("triton")

from generation_service.kernels.mask_sample import mask_sample  # noqa: E402
from generation_service.kernels.philox import (  # noqa: E402
    philox_uniform_rows, philox_uniform_torch)
from generation_service.kernels.sample_reference import (  # noqa: E402
    _keep_threshold, _key_torch, apply_mask_torch, mask_sample_torch)

VOCAB = 300  # logits width; the mask covers fewer tokens in some tests


def _params(rows, temps, top_ks, top_ps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(temperature=torch.tensor(temps, dtype=torch.float32),
                top_k=torch.tensor(top_ks, dtype=torch.int32),
                top_p=torch.tensor(top_ps, dtype=torch.float32),
                seeds=torch.randint(-2 ** 62, 2 ** 62, (rows,), generator=gen),
                steps=torch.randint(0, 2 ** 40, (rows,), generator=gen))


def _random_mask(rows, words, density=0.3):
    bits = torch.rand(rows, words * 32) < density
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    packed = (bits.view(rows, words, 32).long() * weights).sum(-1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def test_philox_triton_equals_torch():
    seeds = torch.tensor([0, 12345, -1, 2 ** 62 + 7], dtype=torch.int64)
    steps = torch.tensor([0, 3, 2 ** 40 + 5, 1], dtype=torch.int64)
    got = philox_uniform_rows(seeds, steps, 1500)
    for r in range(4):
        want = philox_uniform_torch(int(seeds[r]), int(steps[r]), torch.arange(1500))
        assert torch.equal(got[r], want)
    assert 0.0 <= float(got.min()) and float(got.max()) < 1.0
    assert abs(float(got.mean()) - 0.5) < 0.02


def test_greedy_masked_argmax_and_logprobs():
    rows = 4
    logits = torch.randn(rows, VOCAB) * 3
    logits[0, :50] = float("nan")
    mask = _random_mask(rows, 12)  # 384 bits >= VOCAB
    mask[3] = -1  # unconstrained row
    params = _params(rows, [0.0] * rows, [0] * rows, [1.0] * rows)
    ids = torch.full((rows,), -5, dtype=torch.int32)
    logprobs = torch.full((rows,), float("nan"))
    mask_sample(logits, mask, **params, out_ids=ids, out_logprobs=logprobs, num_splits=2)
    masked = apply_mask_torch(logits, mask)
    assert torch.equal(ids.long(), masked.argmax(-1))
    want = torch.log_softmax(masked, -1).gather(1, ids.long()[:, None]).squeeze(1)
    assert torch.allclose(logprobs, want, atol=1e-5)


def test_tokens_past_the_mask_vocab_only_for_unconstrained_rows():
    rows, mask_vocab = 3, 200
    logits = torch.randn(rows, VOCAB)
    logits[:, 250] = 50.0  # the best token lies beyond the mask's vocab
    mask = torch.full((rows, 8), -1, dtype=torch.int32)  # 256 bits, words past 200 ignored
    mask[1, 2] = 0  # row 1 constrained: tokens 64..95 disallowed
    mask[2, 6] = 0x0000FF00  # row 2: bits of the last (partial) word below 200 cleared
    ids, _ = mask_sample(logits, mask, **_params(rows, [0.0, 0.0, 0.0], [0] * 3, [1.0] * 3),
                         mask_vocab_size=mask_vocab)
    assert ids[0] == 250
    assert ids[1] != 250 and not 64 <= ids[1] < 96 and ids[1] < mask_vocab
    assert ids[2] != 250 and ids[2] < mask_vocab
    ref, _ = mask_sample_torch(logits, mask, **_params(rows, [0.0] * 3, [0] * 3, [1.0] * 3),
                               mask_vocab_size=mask_vocab)
    assert torch.equal(ids, ref)


@pytest.mark.parametrize("num_splits,probes", [(1, 1), (3, 8), (2, 16)])
def test_sampling_equals_reference(num_splits, probes):
    rows = 6
    logits = torch.randn(rows, VOCAB) * 2
    mask = _random_mask(rows, 10, density=0.6)
    mask[0] = -1
    temps = [1.0, 0.7, 1.3, 1.0, 2.0, 0.5]
    top_ks = [0, 5, 0, 40, 3, 400]
    top_ps = [1.0, 1.0, 0.8, 0.9, 0.5, 1.0]
    params = _params(rows, temps, top_ks, top_ps, seed=num_splits)
    ids, logprobs = mask_sample(logits.half(), mask, **params, num_splits=num_splits,
                                search_probes=probes)
    ref_ids, ref_logprobs = mask_sample_torch(logits.half(), mask, **params)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(logprobs, ref_logprobs, atol=1e-5)
    assert apply_mask_torch(logits, mask).gather(1, ids.long()[:, None]).isfinite().all()


def test_same_seed_and_step_give_the_same_token_in_any_batch():
    logits = torch.randn(4, VOCAB)
    params = _params(4, [1.0] * 4, [0, 20, 0, 0], [1.0, 1.0, 0.9, 1.0])
    ids, _ = mask_sample(logits, None, **params, enable_filters=True)
    perm = torch.tensor([2, 0, 3, 1])
    shuffled = {k: v[perm] for k, v in params.items()}
    ids_perm, _ = mask_sample(logits[perm], None, **shuffled)
    assert torch.equal(ids_perm, ids[perm])
    alone, _ = mask_sample(logits[2:3], None, **{k: v[2:3] for k, v in params.items()})
    assert alone[0] == ids[2]


def test_filters_compiled_out_variant_ignores_top_k_top_p():
    logits = torch.randn(2, VOCAB)
    with_filters = _params(2, [1.0, 1.0], [3, 0], [1.0, 0.5])
    no_filters = dict(with_filters, top_k=torch.zeros(2, dtype=torch.int32),
                      top_p=torch.ones(2))
    ids, _ = mask_sample(logits, None, **with_filters, enable_filters=False)
    ref, _ = mask_sample_torch(logits, None, **no_filters)
    assert torch.equal(ids, ref)


def test_reference_thresholds_match_sort_based_top_k_top_p():
    # Tie-free logits: the kept set is the HF/vLLM one (top-k, then top-p renormalised).
    for trial in range(20):
        s = torch.randn(50) * 2
        top_k, top_p = [(0, 0.7), (10, 1.0), (10, 0.6), (1, 0.3), (0, 0.05)][trial % 5]
        order = s.argsort(descending=True)
        keep = torch.zeros(50, dtype=torch.bool)
        kept = order[:top_k] if top_k else order
        probs = torch.softmax(s[kept].double(), 0)
        before = probs.cumsum(0) - probs  # mass strictly above each kept token
        keep[kept[before < top_p]] = True
        tau = _keep_threshold(s, top_k, top_p)
        assert torch.equal(_key_torch(s) >= tau, keep)


def test_gumbel_samples_follow_the_filtered_distribution():
    # Many steps of one row through the reference (equal to the kernel, tested above).
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2, 1.5]])
    draws = 3000
    params = {k: v.expand(draws) for k, v in _params(1, [0.8], [4], [1.0]).items()}
    params["steps"] = torch.arange(draws)  # one request, 3000 consecutive steps
    ids, _ = mask_sample_torch(logits.expand(draws, -1), None, **params)
    counts = torch.bincount(ids.long(), minlength=8).float()
    expect = torch.zeros(8)
    top4 = logits[0].argsort(descending=True)[:4]
    expect[top4] = torch.softmax(logits[0, top4] / 0.8, 0)
    assert counts[expect == 0].sum() == 0
    assert torch.allclose(counts / draws, expect, atol=0.03)


@pytest.mark.parametrize("filters", [False, True])
def test_ring_read_equals_the_gathered_rows(filters):
    """mask_slot: the rows of ring entry mask_slot[0] read in place (the step channel's
    (D, max_batch, P, W)[:, :, 0, :] layout: strided rows) == those rows gathered first.
    The mask covers fewer tokens than the logits, so the unconstrained test runs too."""
    rows, depth, words, mask_vocab = 5, 3, 8, 250  # 256 mask bits, VOCAB 300 logits
    logits = torch.randn(rows, VOCAB) * 2
    logits[:, 280] = 40.0  # past the mask vocab: only unconstrained rows may take it
    area = torch.stack([_random_mask(rows + 2, words * 2, density=0.5).view(rows + 2, 2, words)
                        for _ in range(depth)])  # (D, max_batch, P, W)
    ring = area[:, :, 0, :]  # (D, rows + 2, W), entry and row strides of the area
    slot = 2
    ring[slot, 1] = -1  # an unconstrained row
    params = _params(rows, [0.0, 1.0, 0.7, 1.0, 0.0], [0, 5, 0, 40, 0], [1.0, 1.0, 0.8, 0.9, 1.0])
    want_ids, want_logprobs = mask_sample(logits, ring[slot, :rows].contiguous(), **params,
                                          mask_vocab_size=mask_vocab, enable_filters=filters,
                                          num_splits=2)
    ids, logprobs = mask_sample(logits, ring, **params, mask_vocab_size=mask_vocab,
                                enable_filters=filters, num_splits=2, mask_slot=torch.tensor([slot]))
    assert torch.equal(ids, want_ids) and torch.equal(logprobs, want_logprobs)
    assert ids[1] == 280 and (ids[[0, 2, 3, 4]] < mask_vocab).all()
    other, _ = mask_sample(logits, ring, **params, mask_vocab_size=mask_vocab, enable_filters=filters,
                           num_splits=2, mask_slot=torch.tensor([0]))
    ref, _ = mask_sample(logits, ring[0, :rows].contiguous(), **params, mask_vocab_size=mask_vocab,
                         enable_filters=filters, num_splits=2)
    assert torch.equal(other, ref) and not torch.equal(other, ids)
