"""One step as rank 0 broadcasts it: a fixed int64 header, then one flat int64 payload.

    header  (kind, num_tokens T, num_rows B, page-table width W, num_logits L, a, b, 0)
    payload FORWARD: input_ids (T) | positions (T) | page_table (B*W) | seq_lens (B) |
            extend_lens (B) | logits_indices (L)

SETUP carries the KV cache's page count and page size in (a, b) before the first step;
STOP ends the workers' loop.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from generation_service.model.forward_batch import ForwardBatch
from generation_service.parallel.group import TensorParallelGroup

HEADER_LEN = 8


class StepKind(enum.IntEnum):
    SETUP = 1
    FORWARD = 2
    STOP = 3


@dataclass(frozen=True)
class StepHeader:
    kind: StepKind
    num_tokens: int = 0
    num_rows: int = 0
    width: int = 0
    num_logits: int = 0
    num_pages: int = 0   # SETUP
    page_size: int = 0   # SETUP

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([self.kind, self.num_tokens, self.num_rows, self.width, self.num_logits,
                             self.num_pages, self.page_size, 0], dtype=torch.int64)

    @classmethod
    def of(cls, values: torch.Tensor) -> "StepHeader":
        kind, t, b, w, n, a, p, _ = values.tolist()
        return cls(StepKind(kind), t, b, w, n, a, p)

    @property
    def payload_len(self) -> int:
        if self.kind is not StepKind.FORWARD:
            return 0
        return 2 * self.num_tokens + self.num_rows * self.width + 2 * self.num_rows + self.num_logits


def send(group: TensorParallelGroup, header: StepHeader, batch: ForwardBatch | None = None) -> None:
    """Rank 0: broadcast one step to the other ranks."""
    group.broadcast_from_first(header.to_tensor())
    if batch is not None:
        parts = (batch.input_ids, batch.positions, batch.page_table.reshape(-1), batch.seq_lens,
                 batch.extend_lens, batch.logits_indices)
        group.broadcast_from_first(torch.cat([p.to("cpu", torch.int64) for p in parts]))


def send_forward(group: TensorParallelGroup, batch: ForwardBatch) -> None:
    rows, width = batch.page_table.shape
    send(group, StepHeader(StepKind.FORWARD, batch.num_tokens, rows, width, batch.logits_indices.shape[0]), batch)


def receive(group: TensorParallelGroup) -> tuple[StepHeader, ForwardBatch | None]:
    """Ranks 1..N-1: the next step rank 0 sends; the batch on this rank's device (FORWARD only)."""
    header = StepHeader.of(group.broadcast_from_first(torch.zeros(HEADER_LEN, dtype=torch.int64)))
    if header.kind is not StepKind.FORWARD:
        return header, None
    payload = group.broadcast_from_first(torch.empty(header.payload_len, dtype=torch.int64))
    t, b, w, n = header.num_tokens, header.num_rows, header.width, header.num_logits
    input_ids, positions, table, seq_lens, extend_lens, logits_indices = payload.split((t, t, b * w, b, b, n))
    device = group.device
    return header, ForwardBatch(
        input_ids=input_ids.to(device), positions=positions.to(device),
        page_table=table.reshape(b, w).to(device, torch.int32),
        seq_lens=seq_lens.to(device, torch.int32), extend_lens=extend_lens.to(device, torch.int32),
        logits_indices=logits_indices.to(device))
