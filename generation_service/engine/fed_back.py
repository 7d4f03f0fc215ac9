"""FedBack: input tokens of a step that the step before it samples, handed over on the device.

A chained mixed step (mixed_steps.py, `MixedSteps.step`) is launched before the host has read
the previous step's tokens: each row that goes on decoding carries `FED_BACK_TOKEN` in its
input ids, and the runner copies the previous step's sampled token into that slot on the
device, after uploading the step's inputs and before its forward. Stream order makes the copy
read the tokens once the sampler that writes them has run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from generation_service.engine.pinned import PinnedStaging

FED_BACK_TOKEN = -1  # a row's input id that the previous step's token replaces on the device


@dataclass(frozen=True)
class FedBack:
    tokens: torch.Tensor      # (R,) int64 on the runner's device: the previous step's samples
    sources: dict[int, int]   # batch row index -> index into `tokens`

    def apply(self, input_ids: torch.Tensor, row_starts: Sequence[int], staging: PinnedStaging) -> None:
        """input_ids[first token of row b] = tokens[sources[b]] for every fed row b."""
        count = len(self.sources)
        rows = np.fromiter(self.sources.keys(), dtype=np.int64, count=count)
        sources = np.fromiter(self.sources.values(), dtype=np.int64, count=count)
        index = staging.tensor(torch.int64, np.stack([np.asarray(row_starts, dtype=np.int64)[rows], sources]))
        input_ids.index_copy_(0, index[0], self.tokens.index_select(0, index[1]).to(input_ids.dtype))
