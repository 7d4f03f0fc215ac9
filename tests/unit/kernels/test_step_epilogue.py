"""step_epilogue.py (the decode step's bookkeeping after sampling) vs the torch ops it replaces."""
import pytest
import torch

pytest.importorskip("triton")
epilogue = pytest.importorskip("generation_service.kernels.step_epilogue")

MAX_BATCH, DEPTH, POSITIONS = 200, 3, 4


def buffers():
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(0, 50, (MAX_BATCH,), generator=gen, dtype=torch.int32)
    seq_lens[::7] = 0  # padding rows
    return dict(out_tokens=torch.full((MAX_BATCH,), -1), input_ids=torch.full((MAX_BATCH,), -1),
                positions=torch.randint(0, 50, (MAX_BATCH,), generator=gen), seq_lens=seq_lens)


@pytest.mark.parametrize("bucket", [1, 130])  # one program, two with a partial one
@pytest.mark.parametrize("sampled_dtype", [torch.int32, torch.int64])
def test_epilogue_equals_the_torch_ops(bucket, sampled_dtype):
    sampled = torch.randint(0, 131072, (bucket,), dtype=sampled_dtype)
    got, want = buffers(), buffers()
    # the channel's outputs area: tokens (depth, rows, positions)[:, :, 0], counts (depth, rows)
    area = torch.full((DEPTH, MAX_BATCH, POSITIONS), -1, dtype=torch.int32)
    counts = torch.zeros(DEPTH, MAX_BATCH, dtype=torch.int32)
    ring_slot = torch.tensor([2])
    want_area, want_counts = area.clone(), counts.clone()
    epilogue.step_epilogue(sampled, **got, channel=(ring_slot, area[:, :, 0], counts))
    epilogue.step_epilogue_torch(sampled, **want, channel=(ring_slot, want_area[:, :, 0], want_counts))

    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(area, want_area) and torch.equal(counts, want_counts)
    assert got["out_tokens"][:bucket].tolist() == sampled.tolist()
    assert torch.equal(area[2, :bucket, 0], sampled.int()) and (area[2, bucket:] == -1).all()
    assert (area[:2] == -1).all() and (area[2, :, 1:] == -1).all()
    assert (counts[2, :bucket] == 1).all() and counts.sum() == bucket


def test_free_step_touches_no_channel():
    got = buffers()
    before = {k: v.clone() for k, v in got.items()}
    epilogue.step_epilogue(torch.tensor([5, 6], dtype=torch.int32), **got)
    assert got["out_tokens"][:2].tolist() == [5, 6] and got["input_ids"][:2].tolist() == [5, 6]
    assert torch.equal(got["out_tokens"][2:], before["out_tokens"][2:])
