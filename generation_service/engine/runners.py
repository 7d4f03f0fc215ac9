"""Runners by name (EngineConfig.runner): the registry the engine builds its runner from.

Every runner implements engine/runner.py's ModelRunner; its module imports that base, and
this registry imports the modules ("cuda_graph" and "tensor_parallel" lazily: CUDA and the
collectives only when asked for), so no runner module imports the registry back.
"""
from __future__ import annotations

import torch

from generation_service.engine.kv_cache import KVCache
from generation_service.engine.runner import ModelRunner

RUNNERS: dict[str, type[ModelRunner]] = {"eager": ModelRunner}
RUNNER_NAMES = ("auto", "eager", "cuda_graph")


def resolve_runner(name: str, device: str, tensor_parallel: int = 1) -> str:
    """"auto": cuda_graph on a CUDA device, eager otherwise; "tensor_parallel" (the eager
    forward, broadcast to the other ranks) when the model is sharded."""
    if tensor_parallel > 1:
        return "tensor_parallel"
    if name != "auto":
        return name
    return "cuda_graph" if str(device).startswith("cuda") and torch.cuda.is_available() else "eager"


def make_runner(name: str, model: torch.nn.Module, kv_cache: KVCache, vocab_size: int,
                **options) -> ModelRunner:
    """`options` go to runners that take them (cuda_graph: max_batch)."""
    if name == "cuda_graph" and name not in RUNNERS:
        from generation_service.engine.graph_runner import CudaGraphRunner
        RUNNERS[name] = CudaGraphRunner
    if name == "tensor_parallel" and name not in RUNNERS:
        from generation_service.parallel.runner import TensorParallelRunner
        RUNNERS[name] = TensorParallelRunner
    if name not in RUNNERS:
        raise ValueError(f"unknown runner {name!r}; available: {sorted(set(RUNNERS) | {'cuda_graph'})}")
    if name == "eager":
        return RUNNERS[name](model, kv_cache, vocab_size)
    return RUNNERS[name](model, kv_cache, vocab_size, **options)
