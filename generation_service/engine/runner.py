"""ModelRunner: a ScheduledBatch -> ForwardBatch -> logits of the positions that sample.

This is the eager path (CPU, prefill and other non-graph batches on the GPU); its logits
stay on the device for the Sampler (`Sampler.__call__`: CUDA logits sample like the graphs). The CUDA-graph
runner (`graph_runner.CudaGraphRunner`, runner "cuda_graph") adds `can_graph` / `decode`:
decode-only batches replay a captured step (sampling inside), the rest come here.
"""
from __future__ import annotations

import torch

from generation_service.engine.kv_cache import KVCache
from generation_service.engine.scheduler import ScheduledBatch
from generation_service.model.forward_batch import ForwardBatch


def prepare(batch: ScheduledBatch, device: torch.device) -> ForwardBatch:
    """Flatten the rows' new tokens; logits at every position of the sampling rows
    (1 + drafts per row, in row order), none for prefill chunks that do not finish a prompt."""
    input_ids, positions, logits_indices, seq_lens, extend_lens = [], [], [], [], []
    width = max(len(row.request.pages) for row in batch.rows)
    page_table = torch.zeros((len(batch.rows), width), dtype=torch.int32)
    for b, row in enumerate(batch.rows):
        start = len(input_ids)
        input_ids.extend(row.input_ids)
        positions.extend(range(row.num_cached, row.seq_len))
        end = len(input_ids)
        logits_indices.extend(range(end - row.num_positions, end))
        seq_lens.append(row.seq_len)
        extend_lens.append(end - start)
        page_table[b, :len(row.request.pages)] = torch.tensor(row.request.pages, dtype=torch.int32)

    def tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return ForwardBatch(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        page_table=page_table.to(device),
        seq_lens=tensor(seq_lens, torch.int32),
        extend_lens=tensor(extend_lens, torch.int32),
        logits_indices=tensor(logits_indices, torch.int64),
    )


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, vocab_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.vocab_size = vocab_size
        self.device = kv_cache.device

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """(L, vocab_size) float32 logits on the runner's device, L = sum of sampling rows'
        num_positions. On a CUDA device they stay there: the Sampler draws one-position rows
        with the graphs' sampler (mask_sample) and copies to the host only what its CPU rules
        need (draft-verify rows, top-n logprobs)."""
        forward_batch = prepare(batch, self.device)
        # Clamp so a bad id can never index outside the embedding table.
        forward_batch.input_ids.clamp_(0, self.vocab_size - 1)
        logits = self.forward(forward_batch)
        return logits.float()

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.model(forward_batch, self.kv_cache)

    def measure_prefill_chunk(self, max_batch: int, max_tokens: int) -> int | None:
        """Prefill tokens per step beside decode rows, measured on this runner's device; None:
        nothing to measure here (the engine takes its CPU default)."""
        return None

    def attach(self, link) -> None:
        """The engine started with a connected grammar link: prepare what its steps need
        (nothing here; the graph runner captures the channel's graphs)."""


# Runners by name (EngineConfig.runner). "cuda_graph" imports its module (and CUDA) lazily.
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
