"""ModelRunner: a ScheduledBatch -> ForwardBatch -> logits of the positions that sample.

The base class is the one interface the engine drives every runner through, and the eager
path (CPU, prefill and other non-graph batches on the GPU); its logits stay on the device for
the Sampler (`Sampler.__call__`: CUDA logits sample like the graphs). The CUDA-graph runner
(`graph_runner.CudaGraphRunner`, runner "cuda_graph") answers `can_graph` for decode-only
batches and replays a captured step for them (`launch` / `collect`, sampling inside); the rest
come to `run`. Runners are built by name in engine/runners.py.
"""
from __future__ import annotations

import numpy as np
import torch

from generation_service.engine.fed_back import FedBack
from generation_service.engine.kv_cache import KVCache
from generation_service.engine.pinned import PinnedStaging
from generation_service.engine.scheduler import ScheduledBatch
from generation_service.engine.step_time import MixedStepCost
from generation_service.engine.stream_channel import HostStreamChannel, StreamChannel
from generation_service.model.forward_batch import ForwardBatch, build_forward_batch


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
    """The eager runner, and the interface of every runner.

    Graphed steps: `can_graph(batch)` True means the engine calls `launch` then `collect` for
    that batch instead of `run`; False (always, here) means `run`. `supports_overlap`: a
    launched step may stay in flight while the engine launches the next (`collect` later);
    only a runner that graphs supports it. `channel` is the step channel the graphs are
    captured over (None: none), `max_pages_per_row` the page-table width they were captured
    with. `close` releases what the runner holds before the step channel is unmapped.
    """

    supports_overlap = False
    # Its graphed steps wait for every row's mask: a row whose mask came late sits out of steps
    # rather than keep them all on the host path (late_mask.py). Host steps let a row be late.
    waits_for_every_mask = False
    channel = None   # the StepChannel a graphed step reads its masks from (graph runners)
    # graphed steps so far; graph runners count them, the eager runner never has any
    num_graph_steps = 0
    num_chained_steps = 0
    num_verify_steps = 0

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, vocab_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.vocab_size = vocab_size
        self.device = kv_cache.device
        self._staging = PinnedStaging(self.device)
        self._stream_channel: StreamChannel | None = None

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, fed_back: FedBack | None = None) -> torch.Tensor:
        """(L, vocab_size) float32 logits on the runner's device, L = sum of sampling rows'
        num_positions. On a CUDA device they stay there: the Sampler draws one-position rows
        with the graphs' sampler (mask_sample) and copies to the host only what its CPU rules
        need (draft-verify rows, top-n logprobs). `fed_back`: rows whose input token the
        previous step samples (a chained mixed step), filled in before the forward."""
        forward_batch = prepare(batch, self.device)
        # Clamp so a bad id can never index outside the embedding table.
        forward_batch.input_ids.clamp_(0, self.vocab_size - 1)
        if fed_back is not None:
            starts = np.cumsum([0] + [len(row.input_ids) for row in batch.rows])
            fed_back.apply(forward_batch.input_ids, starts, self._staging)
        logits = self.forward(forward_batch)
        return logits.float()

    def token_bucket(self, num_tokens: int) -> int:
        """The token slots a mixed step of `num_tokens` tokens costs (graph runners pad to a
        bucket; the scheduler fills that padding with prefill when prompts wait)."""
        return num_tokens

    @property
    def max_step_tokens(self) -> int | None:
        """The most tokens a mixed step runs at its fast path (graph runners: the largest
        mixed graph); None: no limit."""
        return None

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.model(forward_batch, self.kv_cache)

    @torch.inference_mode()
    def draft_logits(self, pages: list[int], new_ids: list[int], num_cached: int,
                     layer_ids: tuple[int, ...]) -> torch.Tensor:
        """(vocab,) logits after one row's `new_ids` (written into its `pages` from position
        num_cached) through the decoder layers `layer_ids` only: a self-speculative draft
        (self_drafts.py). Here the model's own forward."""
        batch = build_forward_batch([new_ids], [num_cached], [pages], device=self.device)
        return self.model(batch, self.kv_cache, layer_ids)[-1]

    def measure_step_cost(self) -> MixedStepCost | None:
        """What decode and mixed steps cost on this runner's device (the prefill budget's
        measure); None: nothing to measure here (the engine takes its CPU default)."""
        return None

    def attach(self, link) -> None:
        """The engine started with a connected grammar link: prepare what its steps need
        (nothing here; the graph runner captures the channel's graphs)."""

    def stream_channel(self, link) -> StreamChannel | None:
        """Where a mixed step's grammar step runs in the step's own order (stream_channel.py): on a
        CPU device the host's writes, in program order; None (the eager runner on a CUDA device,
        whose steps the host reads one at a time): a host grammar step."""
        if self.device.type != "cpu":
            return None
        if self._stream_channel is None or self._stream_channel.channel is not link.channel:
            self._stream_channel = HostStreamChannel(link)
        return self._stream_channel

    def can_graph(self, batch: ScheduledBatch) -> bool:
        """Whether `batch` runs as a captured step (`launch` / `collect`); never here."""
        return False

    def launch(self, batch: ScheduledBatch, step: int | None, link=None, chained: bool = False):
        """Start a batch that `can_graph`; a handle for `collect`. Only graph runners."""
        raise NotImplementedError(f"{type(self).__name__} runs no captured steps (can_graph is False)")

    def collect(self, launched, link=None):
        """(samples, masks) of a launched step. Only graph runners."""
        raise NotImplementedError(f"{type(self).__name__} runs no captured steps (can_graph is False)")

    @property
    def max_pages_per_row(self) -> int:
        """Pages a row may hold in a captured step. Only graph runners."""
        raise NotImplementedError(f"{type(self).__name__} runs no captured steps (can_graph is False)")

    def close(self) -> None:
        """Release what the runner holds (graphs, registrations); nothing here."""
