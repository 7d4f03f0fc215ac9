"""mask_gather.py (the step's masks from the step channel's mapped ring) vs indexing the ring."""
import pytest
import torch

pytest.importorskip("triton")
gather = pytest.importorskip("generation_service.kernels.mask_gather")

DEPTH, MAX_BATCH, POSITIONS = 3, 20, 2


def ring(words: int) -> torch.Tensor:
    """(D, rows, W) row-0-of-each-position view of a (D, rows, P, W) region, as gpu_runner maps it."""
    region = torch.randint(-2**31, 2**31 - 1, (DEPTH, MAX_BATCH, POSITIONS, words), dtype=torch.int32)
    return region[:, :, 0, :]


@pytest.mark.parametrize("bucket, words, programs", [
    (1, 40, None),     # one partial tile
    (13, 1100, None),  # partial row and column tiles, one program per tile
    (13, 1100, 1),     # one program walks every tile
    (20, 2100, 3),     # programs that do not divide the tiles
])
def test_gather_copies_rows_of_the_slot_entry_only(bucket, words, programs):
    masks = ring(words)
    slot = torch.tensor([1])
    out = torch.full((MAX_BATCH, words), 7, dtype=torch.int32)
    gather.mask_gather(masks[:, :bucket], slot, out, programs)
    assert torch.equal(out[:bucket], masks[1, :bucket])
    assert (out[bucket:] == 7).all()  # rows past the bucket untouched


def test_slot_is_read_on_the_device_each_launch():
    masks, out = ring(64), torch.zeros(MAX_BATCH, 64, dtype=torch.int32)
    slot = torch.tensor([0])
    for s in (2, 0, 1):
        slot.fill_(s)
        gather.mask_gather(masks[:, :5], slot, out, 2)
        assert torch.equal(out[:5], masks[s, :5])
