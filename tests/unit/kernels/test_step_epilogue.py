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


def test_publishing_step_writes_outputs_then_seq_and_advances_the_counter():
    """Folded tail, several channel steps in a row: each step's outputs land in entry N % D,
    outputs_seq = N, and the device counter and ring slot move to N + 1 as
    `advance_channel_step` does (the wrap of the ring included)."""
    bucket, first = 5, 7
    got, want = buffers(), buffers()
    area = torch.full((DEPTH, MAX_BATCH, POSITIONS), -1, dtype=torch.int32)
    counts = torch.zeros(DEPTH, MAX_BATCH, dtype=torch.int32)
    want_area, want_counts = area.clone(), counts.clone()
    step, seq = torch.tensor([first], dtype=torch.int32), torch.tensor([-1], dtype=torch.int32)
    ring_slot, want_slot = torch.tensor([first % DEPTH]), torch.tensor([first % DEPTH])
    for n in range(first, first + 2 * DEPTH):
        sampled = torch.randint(0, 131072, (bucket,), dtype=torch.int32)
        epilogue.step_epilogue(sampled, **got, channel=(ring_slot, area[:, :, 0], counts), publish=(step, seq))
        epilogue.step_epilogue_torch(sampled, **want, channel=(want_slot, want_area[:, :, 0], want_counts))
        assert seq.item() == n and step.item() == n + 1 and ring_slot.item() == (n + 1) % DEPTH
        assert ring_slot.dtype == torch.int64 and step.dtype == torch.int32
        assert torch.equal(area[n % DEPTH, :bucket, 0], sampled)
        want_slot.fill_((n + 1) % DEPTH)
        for name in want:
            assert torch.equal(got[name], want[name]), name
        assert torch.equal(area, want_area) and torch.equal(counts, want_counts)


def test_publishing_needs_one_program_and_the_channel():
    got = buffers()
    area = torch.zeros(DEPTH, MAX_BATCH, dtype=torch.int32)
    publish = (torch.tensor([3], dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    channel = (torch.tensor([0]), area, area.clone())
    with pytest.raises(ValueError, match="one program"):
        epilogue.step_epilogue(torch.zeros(epilogue.MAX_PUBLISH_ROWS + 1, dtype=torch.int32), **got,
                               channel=channel, publish=publish)
    with pytest.raises(AssertionError):
        epilogue.step_epilogue(torch.zeros(4, dtype=torch.int32), **got, publish=publish)
    assert publish[0].item() == 3 and publish[1].item() == 0  # nothing published
