"""How benchmarks/kernels.py times a kernel and records it: medians of triton's do_bench (CUDA
events, L2 flushed between runs), a CUDA graph of launches timed so, the device copy bandwidth
timed so, and a record with the floor its bytes give at that bandwidth ("x floor").
"""
from __future__ import annotations

import torch
import triton
import triton.testing

DEV = "cuda"


def bench(fn, rep_ms: int = 100) -> float:
    fn()  # compile / warm up outside the timed region
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(2 ** 28, device=DEV)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


def record(kernel, case, triton_ms, torch_ms, nbytes, bw, **extra):
    floor_ms = nbytes / bw / 1e6 if nbytes else None
    rec = dict(kernel=kernel, case=case, triton_ms=triton_ms, torch_ms=torch_ms,
               speedup=(torch_ms / triton_ms) if torch_ms else None, bytes=nbytes,
               floor_ms=floor_ms, x_floor=(triton_ms / floor_ms) if floor_ms else None)
    rec.update(extra)
    return rec


def graph_ms(fns, rep_ms: int = 40) -> float:
    """ms of one replay of a CUDA graph that launches fns in order (compiled/warmed first)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    ms = bench(graph.replay, rep_ms)
    del graph
    return ms
