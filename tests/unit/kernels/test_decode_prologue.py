"""decode_prologue.py (embedding, cos/sin and cache slots in one launch) vs the torch ops it
replaces: the model's embedding and rotary, and the decode forward's slot arithmetic."""
import dataclasses

import pytest
import torch

pytest.importorskip("triton")
prologue = pytest.importorskip("generation_service.kernels.decode_prologue")

from generation_service.model.layers import RotaryEmbedding  # noqa: E402
from generation_service.model.presets import PRESETS  # noqa: E402

PAGE, MAX_PAGES = 4, 5


@pytest.fixture
def tables():
    config = dataclasses.replace(PRESETS["llama-3.1-8b"], head_dim=32)  # llama3 rope scaling
    rotary = RotaryEmbedding(config)
    return rotary, rotary(torch.arange(PAGE * MAX_PAGES), torch.bfloat16)


def test_prologue_equals_the_torch_ops(tables):
    rotary, (cos_table, sin_table) = tables
    vocab, hidden = 50, 1536  # two hidden blocks, the second partial
    embed = torch.randn(vocab, hidden).to(torch.bfloat16)
    ids = torch.tensor([3, -2, 49, 77, 0])  # out-of-range ids are clamped, as the engine does
    positions = torch.tensor([0, 7, 19, 4, 0])
    page_table = torch.randint(1, 30, (5, MAX_PAGES), dtype=torch.int32)
    page_table[4] = 0  # a padding row: position 0 on the dummy page
    got_hidden, got_cos, got_sin, got_slots = prologue.decode_prologue(
        ids, positions, embed, cos_table, sin_table, page_table, PAGE)
    want_cos, want_sin = rotary(positions, torch.bfloat16)
    pages = page_table.gather(1, (positions // PAGE).unsqueeze(1)).squeeze(1).long()
    assert torch.equal(got_hidden, embed[ids.clamp(0, vocab - 1)])
    assert torch.equal(got_cos, want_cos) and torch.equal(got_sin, want_sin)
    assert torch.equal(got_slots, pages * PAGE + positions % PAGE)
    assert got_slots[4] == 0


def test_prologue_without_pages_and_out_of_table_positions(tables):
    _, (cos_table, sin_table) = tables
    embed = torch.randn(10, 64)
    positions = torch.tensor([2, 10_000])  # past the table: its last row, never a wild read
    hidden, cos, sin, slots = prologue.decode_prologue(torch.tensor([1, 9]), positions, embed,
                                                       cos_table, sin_table)
    assert slots is None and torch.equal(hidden, embed[[1, 9]])
    assert torch.equal(cos[0], cos_table[2]) and torch.equal(sin[1], sin_table[-1])


def test_publishing_prologue_stores_the_step_counter_and_the_same_outputs(tables):
    """A captured channel step's prologue also stores inputs_seq = N (the device step counter)."""
    _, (cos_table, sin_table) = tables
    embed = torch.randn(40, 1100).to(torch.bfloat16)  # two programs a token
    ids, positions = torch.tensor([5, 9, 39]), torch.tensor([3, 0, 11])
    page_table = torch.randint(1, 30, (3, MAX_PAGES), dtype=torch.int32)
    step, seq = torch.tensor([41], dtype=torch.int32), torch.tensor([40], dtype=torch.int32)
    got = prologue.decode_prologue(ids, positions, embed, cos_table, sin_table, page_table, PAGE,
                                   publish=(step, seq))
    want = prologue.decode_prologue(ids, positions, embed, cos_table, sin_table, page_table, PAGE)
    assert seq.item() == 41 and step.item() == 41  # the counter is the epilogue's to advance
    for g, w in zip(got, want):
        assert torch.equal(g, w)
