"""The step channel registered with CUDA: aliasing, stream waits/writes, graph parity waits,
a wait released by another process, and by the watchdog."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from step_channel import MASK_RELEASED_BY_WATCHDOG, Geometry, StepChannel
from step_channel.cuda import WAIT_AND, WAIT_GEQ, WAIT_NOR, MappedChannel

pytestmark = pytest.mark.gpu
GEOM = Geometry(max_batch=8, max_positions=1, vocab_size=1000, depth=4)


@pytest.fixture
def mapped():
    chan = StepChannel.create(GEOM)
    m = MappedChannel.register(chan)
    yield m
    torch.cuda.synchronize()
    m.close()
    chan.close()


def test_register_and_close_on_threads_that_made_no_cuda_call():
    """structgen serve builds the engine in a helper thread and registers the channel in the
    main one: the driver call there must find torch's context (CUDA_ERROR_INVALID_CONTEXT once)."""
    chan = StepChannel.create(GEOM)
    outcome = {}

    def on_a_new_thread(name, call):
        def run():
            try:
                outcome[name] = call()
            except Exception as error:  # noqa: BLE001 -- reported below
                outcome[name] = error
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert not isinstance(outcome[name], Exception), outcome[name]
    try:
        on_a_new_thread("register", lambda: MappedChannel.register(chan))
        assert outcome["register"].device_ptr
        on_a_new_thread("close", outcome["register"].close)
    finally:
        chan.close()


def test_device_views_alias_the_shared_region(mapped):
    chan = mapped.channel
    rng = np.random.default_rng(0)
    chan.entry(5).masks[:] = rng.integers(-2**31, 2**31 - 1, size=chan.entry(5).masks.shape, dtype=np.int32)
    on_gpu = mapped.mask_rows(5).clone()  # GPU reads host memory through the mapping
    assert np.array_equal(on_gpu.cpu().numpy(), chan.entry(5).masks)
    mapped.ring_view("out_tokens", (GEOM.max_batch, 1))[2, :, 0] = torch.arange(8, device="cuda", dtype=torch.int32) + 7
    torch.cuda.synchronize()
    assert chan.entry(2).out_tokens[:, 0].tolist() == list(range(7, 15))


def test_stream_write_and_geq_wait_eager(mapped):
    chan, s = mapped.channel, torch.cuda.Stream()
    x = torch.zeros(1, device="cuda")
    mapped.wait_value32(s, "mask_seq", 3, WAIT_GEQ)
    with torch.cuda.stream(s):
        x.add_(1)
    mapped.write_value32(s, "outputs_seq", 3)
    time.sleep(0.1)
    assert chan.load_seq("outputs_seq") == 0, "the stream ran past an unsatisfied wait"
    chan.publish_seq("mask_seq", 3)
    s.synchronize()
    assert chan.load_seq("outputs_seq") == 3 and x.item() == 1


def _captured_parity_wait(mapped, parity: int):
    """A graph: wait for the parity of mask_seq, then echo the step counter into outputs_seq."""
    s = torch.cuda.Stream()
    step = torch.zeros(1, dtype=torch.int32, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        if parity:
            mapped.wait_value32(None, "mask_seq", 1, WAIT_AND)
        else:
            mapped.wait_value32(None, "mask_seq", 0xFFFFFFFE, WAIT_NOR)
        torch.add(step, 0, out=mapped.seq_view("outputs_seq"))
    return g, step


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_graph_parity_wait_released_by_another_process(mapped, n):
    chan = mapped.channel
    chan.publish_seq("mask_seq", n - 1)  # the invariant while step n waits: mask_seq in {n-1, n}
    g, step = _captured_parity_wait(mapped, n & 1)
    step.fill_(n)
    torch.cuda.synchronize()
    writer = textwrap.dedent(f"""
        import sys, time; sys.path.insert(0, '.')
        from step_channel import StepChannel
        c = StepChannel.attach({chan.name!r}); time.sleep(0.3); c.publish_seq('mask_seq', {n}); c.close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer])
    try:
        start = time.perf_counter()
        g.replay()
        time.sleep(0.1)
        assert chan.load_seq("outputs_seq") != (n), "graph ran past the wait"
        assert chan.wait_seq("outputs_seq", n, timeout_s=10), "graph never released"
        assert time.perf_counter() - start >= 0.25
    finally:
        chan.publish_seq("mask_seq", n)  # never leave the GPU waiting
        torch.cuda.synchronize()
        proc.wait(10)
    assert proc.returncode == 0


def test_watchdog_releases_a_stalled_graph(mapped):
    """Nobody fills masks: the host watchdog writes mask_status and mask_seq itself."""
    chan, n, deadline_s = mapped.channel, 5, 0.2
    chan.publish_seq("mask_seq", n - 1)
    g, step = _captured_parity_wait(mapped, n & 1)
    step.fill_(n)
    torch.cuda.synchronize()

    def watchdog():
        if not chan.wait_seq("mask_seq", n, timeout_s=deadline_s):
            chan.entry(n).mask_status[0] = MASK_RELEASED_BY_WATCHDOG
            chan.publish_seq("mask_seq", n)

    t = threading.Thread(target=watchdog)
    start = time.perf_counter()
    g.replay()
    t.start()
    released = chan.wait_seq("outputs_seq", n, timeout_s=10)
    elapsed = time.perf_counter() - start
    t.join()
    chan.publish_seq("mask_seq", n)
    torch.cuda.synchronize()
    assert released and deadline_s <= elapsed < deadline_s + 1.0
    assert chan.entry(n).mask_status[0] == MASK_RELEASED_BY_WATCHDOG


def test_graph_wait_latency(mapped):
    """Round trip host write -> GPU wait released -> GPU write seen by the host, in a graph."""
    chan = mapped.channel
    graphs = {parity: _captured_parity_wait(mapped, parity) for parity in (0, 1)}
    times = []
    for n in range(1, 41):
        g, step = graphs[n & 1]
        step.fill_(n)
        g.replay()
        time.sleep(0.002)
        t0 = time.perf_counter()
        chan.publish_seq("mask_seq", n)
        assert chan.wait_seq("outputs_seq", n, timeout_s=5, spin_s=1.0)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    median_us = sorted(times)[len(times) // 2] * 1e6
    print(f"graph wait round trip: median {median_us:.1f} us")
    assert median_us < 1000


def test_graph_of_the_folded_epilogue_publishes_outputs_before_outputs_seq(mapped):
    """kernels/step_epilogue.py with `publish` (the decode graph's folded tail), replayed
    step after step: the host spins on outputs_seq and reads the outputs of entry N % D the
    moment it sees N. Every step's tokens encode N, and the host clears the entry before each
    step, so a seq store that overtook the output stores would show -1 or another step's
    tokens; the device counter and ring slot advance as `advance_channel_step` did."""
    from generation_service.kernels.step_epilogue import step_epilogue
    chan, rows, first, num_steps = mapped.channel, GEOM.max_batch, 1000, 300
    depth = GEOM.depth
    step = torch.tensor([first], dtype=torch.int32, device="cuda")
    ring_slot = torch.tensor([first % depth], dtype=torch.int64, device="cuda")
    out_tokens, input_ids = (torch.zeros(rows, dtype=torch.int64, device="cuda") for _ in range(2))
    positions = torch.zeros(rows, dtype=torch.int64, device="cuda")
    seq_lens = torch.ones(rows, dtype=torch.int32, device="cuda")
    channel = (ring_slot, mapped.ring_view("out_tokens", (rows, 1))[:, :, 0], mapped.ring_view("out_counts", (rows,)))
    offsets = torch.arange(rows, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()

    def body():
        sampled = step * 100 + offsets  # (rows,) int32: step N's tokens, 100 N + r
        step_epilogue(sampled, out_tokens, input_ids, positions, seq_lens, channel,
                      publish=(step, mapped.seq_view("outputs_seq")))
    with torch.cuda.stream(s):  # compile outside the capture, then restore the counter
        body()
    s.synchronize()
    step.fill_(first)
    ring_slot.fill_(first % depth)
    chan.publish_seq("outputs_seq", first - 1)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        body()
    for n in range(first, first + num_steps):
        e = chan.entry(n)
        e.out_tokens[:] = -1
        e.out_counts[:] = 0
        g.replay()
        assert chan.wait_seq("outputs_seq", n, timeout_s=5, spin_s=1.0), f"step {n} never published"
        got = e.out_tokens[:, 0].tolist()  # read at once: the GPU may still run the kernel's tail
        assert got == [100 * n + r for r in range(rows)], (n, got)
        assert e.out_counts.tolist() == [1] * rows
        assert chan.load_seq("outputs_seq") == n
    torch.cuda.synchronize()
    n = first + num_steps
    assert step.item() == n and ring_slot.item() == n % depth
    assert positions.tolist() == [num_steps + 1] * rows  # one compile run + num_steps replays
