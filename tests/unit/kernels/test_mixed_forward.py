"""The mixed step (engine/mixed_forward.py) on a tiny fp32 Llama in Triton's interpreter: one
forward over decode rows, prefill chunks (first, middle, last) and a verify row together gives
the reference forward's logits at every sampling position (the model's own modules with the
per-row reference attention, `ModelRunner`'s path) and writes the same K/V into the same slots.
The captured form (engine/mixed_graphs.py: padded token bucket, tile list) runs its body eagerly
here, step after step over the same persistent inputs, and gives the same.
bf16 on the real shapes: tests/gpu/test_mixed_steps.py."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from generation_service.engine.cuda_graphs import DecodeBuffers  # noqa: E402
from generation_service.engine.decode_forward import DecodeForward  # noqa: E402
from generation_service.engine.kv_cache import KVCache  # noqa: E402
from generation_service.engine.mixed_forward import MixedForward, pack_mixed  # noqa: E402
from generation_service.engine.mixed_graphs import MixedGraphs  # noqa: E402
from generation_service.engine.runner import prepare  # noqa: E402
from generation_service.engine.scheduler import ScheduledBatch, ScheduledRow  # noqa: E402
from generation_service.model.presets import PRESETS  # noqa: E402
from generation_service.model.random_init import build_random_model  # noqa: E402

PAGE, VOCAB = 4, 80


@pytest.fixture(scope="module")
def model():
    config = dataclasses.replace(PRESETS["llama-3.2-1b"], num_layers=2, hidden_size=64, intermediate_size=96,
                                 num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=VOCAB,
                                 tie_word_embeddings=False)
    model = build_random_model(config, torch.device("cpu"), torch.float32, seed=0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norm weights start at 1: make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
    return model


def make_rows(gen: torch.Generator) -> list[ScheduledRow]:
    """(num_cached, new tokens, drafts, sampling) per row, in an order that interleaves kinds."""
    shapes = [(0, 7, 0, True),    # a whole prompt in one chunk
              (9, 1, 0, True),    # a decode row
              (5, 4, 0, False),   # a middle chunk: no logits
              (13, 1, 0, True),   # another decode row, longer context
              (6, 1, 2, True),    # a verify row: one token and two drafts
              (3, 6, 0, True)]    # the last chunk of a prompt
    rows, next_page = [], 1
    for cached, new, drafts, sampling in shapes:
        total = cached + new + drafts
        pages = list(range(next_page, next_page + -(-total // PAGE)))
        next_page += len(pages)
        ids = torch.randint(0, VOCAB, (new + drafts,), generator=gen).tolist()
        rows.append(ScheduledRow(SimpleNamespace(pages=pages[::-1]), cached, ids, ids[new:], sampling))
    return rows


def random_cache(model, seed: int) -> KVCache:
    cfg = model.config
    kv = KVCache(cfg.num_layers, 40, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=gen))
    return kv


@pytest.mark.parametrize("fused_ops", [True, False], ids=["fused", "torch-layers"])
def test_mixed_step_gives_the_reference_logits_and_kv(model, rel_err, fused_ops):
    rows = make_rows(torch.Generator().manual_seed(3))
    batch = ScheduledBatch(rows)
    ref_kv, kv = random_cache(model, 1), random_cache(model, 1)
    with torch.inference_mode():
        want = model(prepare(batch, torch.device("cpu")), ref_kv).float()
    forward = DecodeForward(model, kv, DecodeBuffers.allocate(4, 8, "cpu"), fused_ops=fused_ops, gemv_max_batch=0)
    got = MixedForward(forward)(rows).float()
    assert got.shape == want.shape == (sum(row.num_positions for row in rows), VOCAB)
    assert rel_err(got, want) < 1e-4
    for layer in range(model.config.num_layers):
        assert rel_err(kv.k[layer], ref_kv.k[layer]) < 1e-5 and rel_err(kv.v[layer], ref_kv.v[layer]) < 1e-5


def test_pack_puts_decode_rows_first_and_indexes_logits_in_batch_order():
    rows = make_rows(torch.Generator().manual_seed(4))
    layout = pack_mixed(rows, PAGE, VOCAB)
    assert layout.num_decode_rows == 2
    assert layout.extend_lens.tolist() == [1, 1, 7, 4, 3, 6]  # decode rows, then the rest in order
    assert layout.num_tokens == sum(len(row.input_ids) for row in rows)
    # batch order: row 0's last token, row 1 (decode, packed first), row 3, row 4's three, row 5's last
    assert layout.logits_indices.tolist() == [8, 0, 1, 13, 14, 15, 21]
    assert layout.extend_start.tolist() == [0, 7, 11, 14]
    assert layout.max_extend_len == 7
    for t, (position, slot) in enumerate(zip(layout.positions.tolist(), layout.slot_ids.tolist())):
        row = int(torch.searchsorted(torch.tensor([0, 1, 2, 9, 13, 16]), t, right=True)) - 1
        pages = layout.page_table[row]
        assert slot == pages[position // PAGE] * PAGE + position % PAGE


def test_the_bucketed_body_gives_the_reference_step_after_step(model, rel_err):
    forward_kv = random_cache(model, 1)
    forward = DecodeForward(model, forward_kv, DecodeBuffers.allocate(4, 8, "cpu"), gemv_max_batch=0)
    graphs = MixedGraphs(forward, max_rows=8, max_pages=8, buckets=(16, 32))
    ref_kv = random_cache(model, 1)
    gen = torch.Generator().manual_seed(6)
    for step in range(3):  # a full step, then smaller ones over the stale buffers
        rows = [row for row in make_rows(gen) if not row.drafts][:6 - 2 * step]
        assert graphs.can_run(rows)
        with torch.inference_mode():
            want = model(prepare(ScheduledBatch(rows), torch.device("cpu")), ref_kv).float()
        got = graphs(rows, use_graph=False).float()
        assert got.shape == want.shape and rel_err(got, want) < 1e-4, step
    for layer in range(model.config.num_layers):
        assert rel_err(forward_kv.k[layer][1:], ref_kv.k[layer][1:]) < 1e-5
        assert rel_err(forward_kv.v[layer][1:], ref_kv.v[layer][1:]) < 1e-5


@pytest.mark.parametrize("layer_ids", [(0,), (1,)], ids=["first-layer", "second-layer"])
@pytest.mark.parametrize("fused_ops", [True, False], ids=["fused", "torch-layers"])
def test_a_draft_through_some_layers_gives_the_models_forward_of_them(model, rel_err, layer_ids, fused_ops):
    """A self-speculative draft on the graph runner (`CudaGraphRunner.draft_logits`): one row
    through the draft graph's body (one row, a bucket of 16 slots) and through the eager fused
    layers gives the model's own forward of those layers, and writes K/V in those layers only."""
    row = ScheduledRow(SimpleNamespace(pages=[3, 1, 2]), 9, [17], is_sampling=True)
    ref_kv, kv = random_cache(model, 1), random_cache(model, 1)
    with torch.inference_mode():
        want = model(prepare(ScheduledBatch([row]), torch.device("cpu")), ref_kv, layer_ids)[-1].float()
    forward = DecodeForward(model, kv, DecodeBuffers.allocate(4, 8, "cpu"), fused_ops=fused_ops, gemv_max_batch=0)
    graphs = MixedGraphs(forward, max_rows=1, max_pages=8, buckets=(16,), layer_ids=layer_ids)
    assert graphs.can_run([row])
    got = graphs([row], use_graph=False)[0].float()
    eager = MixedForward(forward)([row], layer_ids=layer_ids)[0].float()
    assert rel_err(got, want) < 1e-4 and rel_err(eager, want) < 1e-4
    untouched = random_cache(model, 1)
    for layer in range(model.config.num_layers):  # page 0 is the padding slots' dummy page
        assert rel_err(kv.k[layer][1:], ref_kv.k[layer][1:]) < 1e-5, layer
        assert rel_err(kv.v[layer][1:], ref_kv.v[layer][1:]) < 1e-5, layer
        assert torch.equal(kv.k[layer][1:], untouched.k[layer][1:]) == (layer not in layer_ids)
