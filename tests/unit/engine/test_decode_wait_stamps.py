"""benchmarks/decode.py --wait-stamps: the per-step wait summary read from the stamp ring
(benchmarks/_decode_graphs.py)."""
import pytest
import torch

from benchmarks._decode_graphs import wait_stamps_summary


def test_summary_reads_the_run_s_steps_from_the_ring_as_it_wrapped():
    """Steps 14..29 in a ring of 16 (slot = step % 16): one 50 us wait among 3 us ones, and the
    slots of older steps (overwritten) never counted."""
    stamps = torch.zeros(16, 2, dtype=torch.int64)
    for n in range(10, 30):
        stamps[n % 16] = torch.tensor([n * 10**6, n * 10**6 + (50_000 if n == 20 else 3_000)])
    got = wait_stamps_summary(stamps, 14, 30)
    assert got["p50"] == got["p90"] == 3.0 and got["max"] == 50.0
    assert got["mean"] == pytest.approx((15 * 3 + 50) / 16) and got["over_10us"] == 1 / 16
    with pytest.raises(AssertionError):
        wait_stamps_summary(stamps, 0, 17)  # more steps than the ring holds
