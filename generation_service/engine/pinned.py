"""PinnedStaging: host -> device copies that never wait for the stream.

A copy from pageable host memory synchronises the host with the whole stream before it starts
(CUDA's documented behaviour for pageable H2D copies), so a step whose inputs went that way
could not be launched behind a running one: the host would wait for it. Here every copy goes
through pinned buffers, asynchronously. `slots` buffers per dtype are used in turn, each
rewritten only once its previous copy has completed (an event), so a small copy launched while
an earlier one is still queued neither waits nor overwrites it.
"""
from __future__ import annotations

import numpy as np
import torch


class PinnedStaging:
    def __init__(self, device: torch.device, slots: int = 2) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self._slots = slots
        self._buffers: dict[torch.dtype, list[torch.Tensor | None]] = {}
        self._ready: dict[torch.dtype, list[torch.cuda.Event | None]] = {}
        self._next: dict[torch.dtype, int] = {}

    def upload(self, dtype: torch.dtype, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors holding `arrays` (each flattened), copied through one pinned buffer.
        On the CPU: tensors of them (no copy to make)."""
        sizes = [a.size for a in arrays]
        if not self.is_cuda:
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=_NUMPY[dtype]).ravel()) for a in arrays]
        total = sum(sizes)
        buffers = self._buffers.setdefault(dtype, [None] * self._slots)
        ready = self._ready.setdefault(dtype, [None] * self._slots)
        k = self._next.get(dtype, 0)
        self._next[dtype] = (k + 1) % self._slots
        if ready[k] is not None:
            ready[k].synchronize()
        host = buffers[k]
        if host is None or host.numel() < total:
            host = buffers[k] = torch.empty(max(total, 2 * (host.numel() if host is not None else 4096)),
                                            dtype=dtype, pin_memory=True)
        view = host[:total].numpy()
        offset = 0
        for array, size in zip(arrays, sizes):
            view[offset:offset + size] = array.ravel()
            offset += size
        flat = host[:total].to(self.device, non_blocking=True)
        ready[k] = torch.cuda.Event()
        ready[k].record()
        return list(flat.split(sizes))

    def tensor(self, dtype: torch.dtype, values) -> torch.Tensor:
        """One device tensor of `values` (a list or an array; its shape is kept)."""
        array = np.asarray(values, dtype=_NUMPY[dtype])
        return self.upload(dtype, [array])[0].view(array.shape)


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
