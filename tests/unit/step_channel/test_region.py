"""The step channel between two real processes: geometry checks, ordering, wrap-safe seqs."""
import multiprocessing as mp
import os
import stat

import numpy as np
import pytest

from step_channel import ChannelError, Geometry, StepChannel, seq_reached

GEOM = Geometry(max_batch=4, max_positions=3, vocab_size=1000, depth=3)
NUM_STEPS = 50


def _peer(name: str, num_steps: int, q) -> None:
    """A stand-in grammar loop: for each step, read the drafts, write a mask that echoes them."""
    chan = StepChannel.attach(name, GEOM)
    last_seen = 0
    try:
        for n in range(1, num_steps + 1):
            assert chan.wait_seq("inputs_seq", n, timeout_s=10), f"no inputs for step {n}"
            seen = chan.load_seq("inputs_seq")
            assert seq_reached(seen, last_seen), "inputs_seq went backwards"
            last_seen = seen
            e = chan.entry(n)
            assert e.step == n
            e.masks[: e.batch_size, 0] = e.drafts[: e.batch_size, 0] * 10 + n
            chan.beat()
            chan.publish_seq("mask_seq", n)
        q.put("ok")
    except AssertionError as exc:
        q.put(str(exc))
    finally:
        chan.close()


def test_two_processes_exchange_steps():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with StepChannel.create(GEOM) as chan:
        peer = ctx.Process(target=_peer, args=(chan.name, NUM_STEPS, q))
        peer.start()
        for n in range(1, NUM_STEPS + 1):
            e = chan.entry(n)
            e.desc_header[:] = (n, 3)
            e.drafts[:3, 0] = np.arange(3) + n
            chan.publish_seq("inputs_seq", n)
            assert chan.wait_seq("mask_seq", n, timeout_s=10)
            assert list(e.masks[:3, 0]) == [(i + n) * 10 + n for i in range(3)]
        peer.join(10)
        assert q.get(timeout=5) == "ok"
        assert chan.heartbeat_age_s() < 10


def test_region_is_owner_only_and_unlinked_on_close():
    chan = StepChannel.create(GEOM)
    path = f"/dev/shm/{chan.name}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    chan.close()
    assert not os.path.exists(path)


def test_attach_refuses_geometry_mismatch_with_what_differs():
    with StepChannel.create(GEOM) as chan:
        other = Geometry(max_batch=8, max_positions=3, vocab_size=1001, depth=3)
        with pytest.raises(ChannelError, match=r"max_batch: region has 4, expected 8.*vocab_size"):
            StepChannel.attach(chan.name, other)


def test_attach_refuses_missing_and_foreign_regions(tmp_path):
    with pytest.raises(ChannelError, match="does not exist"):
        StepChannel.attach("structgen-does-not-exist")
    name = f"structgen-test-foreign-{os.getpid()}"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"\x01" * 8192)
    try:
        with pytest.raises(ChannelError, match="not a step channel"):
            StepChannel.attach(name)
    finally:
        os.unlink(f"/dev/shm/{name}")


def test_seq_compare_is_wrap_safe():
    assert seq_reached(5, 5) and seq_reached(6, 5) and not seq_reached(4, 5)
    assert seq_reached(2, 0xFFFFFFFE)  # 2 comes after the wrap
    assert not seq_reached(0xFFFFFFFE, 2)


def test_wait_times_out():
    with StepChannel.create(GEOM) as chan:
        assert not chan.wait_seq("mask_seq", 1, timeout_s=0.01)
