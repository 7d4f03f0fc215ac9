"""Fused decode input preparation vs its host-loop reference."""
import pytest
import torch

pytest.importorskip("triton")

from generation_service.kernels.prepare_inputs import (  # noqa: E402
    PreparedInputs, prepare_decode_inputs, prepare_decode_inputs_torch)

PAGE_SIZE, VOCAB = 16, 100


def _case(max_rows, width, num_real, seed):
    gen = torch.Generator().manual_seed(seed)
    page_table = torch.randint(1, 60, (max_rows, 8), dtype=torch.int32, generator=gen)
    before = torch.randint(0, 100, (max_rows,), dtype=torch.int32, generator=gen)
    num_new = torch.randint(0, width + 1, (max_rows,), dtype=torch.int32, generator=gen)
    ids = torch.randint(-50, 2 * VOCAB, (max_rows * width,), generator=gen)
    return page_table, before, num_new, ids, torch.tensor([num_real], dtype=torch.int32)


@pytest.mark.parametrize("max_rows,width,num_real", [(6, 1, 4), (6, 4, 6), (5, 3, 0)])
def test_prepare_matches_reference(max_rows, width, num_real):
    page_table, before, num_new, ids, num_rows = _case(max_rows, width, num_real, seed=width)
    got = PreparedInputs.allocate(max_rows, max_rows * width, "cpu")  # poisoned with -7
    want = PreparedInputs.allocate(max_rows, max_rows * width, "cpu")
    got_ids, want_ids = ids.clone(), ids.clone()
    prepare_decode_inputs(got_ids, before, num_new, page_table, num_rows, got, PAGE_SIZE,
                          VOCAB, width)
    prepare_decode_inputs_torch(want_ids, before, num_new, page_table, num_rows, want,
                                PAGE_SIZE, VOCAB, width)
    assert torch.equal(got_ids, want_ids)
    for name in ("positions", "slot_ids", "seq_lens", "extend_lens", "last_token_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert int(got_ids.min()) >= 0 and int(got_ids.max()) < VOCAB


def test_padding_rows_go_to_dummy_page_and_tail_is_scrubbed():
    max_rows, width = 4, 2
    page_table, before, _, ids, _ = _case(max_rows, width, 4, seed=1)
    bufs = PreparedInputs.allocate(max_rows, max_rows * width, "cpu")
    # Step 1: a full batch leaves every slot and id non-zero.
    full = torch.full((max_rows,), width, dtype=torch.int32)
    prepare_decode_inputs(ids, before, full, page_table, torch.tensor([4], dtype=torch.int32),
                          bufs, PAGE_SIZE, VOCAB, width)
    assert (bufs.slot_ids >= PAGE_SIZE).all()  # real pages only (ids >= 1)
    # Step 2: only one real row with one token; everything after it must be scrubbed.
    ids.random_(1, VOCAB)
    one = torch.ones(max_rows, dtype=torch.int32)
    prepare_decode_inputs(ids, before, one, page_table, torch.tensor([1], dtype=torch.int32),
                          bufs, PAGE_SIZE, VOCAB, width)
    assert int(bufs.slot_ids[0]) == int(page_table[0, before[0] // PAGE_SIZE]) * PAGE_SIZE \
        + int(before[0]) % PAGE_SIZE
    assert not bufs.slot_ids[1:].any() and not bufs.positions[1:].any() and not ids[1:].any()
    assert bufs.seq_lens.tolist() == [int(before[0]) + 1, 0, 0, 0]
    assert bufs.extend_lens.tolist() == [1, 0, 0, 0]
