"""GPU timing primitives of the decode benchmarks (decode.py, profile_step.py, kernels.py,
_roofline.py): the median CUDA-event time of a call, the device copy bandwidth, a CUDA graph's
median replay time, each call's CUDA-event time, the weight bytes a decode step reads."""
from __future__ import annotations

import torch


def median_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median CUDA-event time of `reps` calls of fn, each waited for, after `warmup` such calls."""
    times = []
    for _ in range(reps + warmup):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times[warmup:])[reps // 2]


def copy_bandwidth_gbs(nbytes: int = 4 << 30, reps: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (median of reps)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), reps, warmup=2)
    del src, dst
    return 2 * nbytes / (ms / 1e3) / 1e9


def graph_ms(fn, reps: int = 30) -> float:
    """Median replay time of fn captured as one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    ms = median_ms(graph.replay, reps)
    graph.reset()
    return ms


def event_times_ms(fn, reps: int) -> list[float]:
    """CUDA-event time of each of reps calls of fn."""
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(reps)]
    for a, b in pairs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in pairs]


def weight_bytes_read(model) -> int:
    """Bytes of the weights one decode step reads: every parameter but an untied input embedding."""
    cfg = model.config
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.tie_word_embeddings:  # the input embedding is gathered, not read whole
        total -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    return total
