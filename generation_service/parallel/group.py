"""The process groups of a tensor-parallel server and the three collectives its forward uses.

The model group carries the forward's collectives: NCCL when the ranks are CUDA devices,
gloo on the CPU. Step inputs always travel over a gloo group of their own (`steps`): rank 0
broadcasts a step's host-side metadata before the forward, and the workers wait on it while
the server is idle, which NCCL would do by spinning a kernel.

The group of this process is process-wide state, as torch.distributed's is: `init_group`
makes it and `current_group` returns it (the engine of rank 0 finds it there).
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# NVLink multicast (NVLS) can take a shared host's GPUs out of service; it stays off in every rank.
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)  # ranks load their shards before they join
# NOTE: the workers block in the step broadcast while the server is idle, so the step group's
# timeout is an idle limit, not a hang detector: a rank's death is seen by the launcher and as
# a closed connection in the next collective.
STEP_TIMEOUT = datetime.timedelta(days=365)

_current: "TensorParallelGroup | None" = None
_on_broken: list = []  # called with a message when rank 0 can no longer keep the ranks in step


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    device: torch.device
    model_group: object  # dist.ProcessGroup of the forward's collectives
    step_group: object   # dist.ProcessGroup (gloo) of the step broadcasts

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `tensor`, in place (the row-parallel projections' partial sums)."""
        dist.all_reduce(tensor, group=self.model_group)
        return tensor

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's (L, n) tensor side by side, (L, world_size * n); others: None."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(tensor, parts, dst=dist.get_global_rank(self.model_group, 0), group=self.model_group)
        return torch.cat(parts, dim=-1) if self.is_first else None

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU `tensor` on every rank, in place (over the step group)."""
        dist.broadcast(tensor, src=dist.get_global_rank(self.step_group, 0), group=self.step_group)
        return tensor


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r runs on cuda:r of the visible devices (CUDA_VISIBLE_DEVICES picks which), or the CPU."""
    return torch.device(f"cuda:{rank}") if device.startswith("cuda") else torch.device("cpu")


def init_group(rank: int, world_size: int, address: str, device: str) -> TensorParallelGroup:
    """Join the ranks at `address` (tcp://host:port, rank 0 hosts it); blocks until all have."""
    global _current
    for name, value in MULTICAST_OFF_ENV.items():
        os.environ[name] = value  # before NCCL initializes in this process
    torch_device = rank_device(device, rank)
    backend = "nccl" if torch_device.type == "cuda" else "gloo"
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    else:  # the ranks share the host's cores: each rank's forward runs at the same time
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world_size,
                            timeout=RENDEZVOUS_TIMEOUT)
    step_group = dist.new_group(backend="gloo", timeout=STEP_TIMEOUT)
    _current = TensorParallelGroup(rank, world_size, torch_device, dist.group.WORLD, step_group)
    log.info("tensor-parallel rank %d of %d joined on %s (%s)", rank, world_size, torch_device, backend)
    return _current


def on_broken(handler) -> None:
    """Call `handler(message)` when `report_broken` is (the launcher stops the server)."""
    _on_broken.append(handler)


def report_broken(message: str) -> None:
    """Rank 0 failed between collectives: the other ranks wait in a step it will not finish,
    so no later step can pair with theirs."""
    log.error("%s", message)
    for handler in _on_broken:
        handler(message)


def current_group() -> TensorParallelGroup:
    if _current is None:
        raise RuntimeError("tensor_parallel > 1 needs this process to be rank 0 of a started group "
                           "(structgen serve --tensor-parallel N starts the ranks)")
    return _current


def close_group() -> None:
    global _current
    if _current is not None and dist.is_initialized():
        dist.destroy_process_group()
    _current = None
