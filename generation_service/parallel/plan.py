"""ShardPlan: how one rank's shard of a Llama-family checkpoint is cut.

Column-parallel tensors are split on dim 0 (their output features): q/k/v (whole heads per
rank), gate/up (the MLP intermediate), the embedding and LM head (the vocabulary, padded so
every rank holds the same number of rows). Row-parallel tensors (o_proj, down_proj weights)
are split on dim 1 (their input features). Everything else (norms, o/down biases, which are
added once after the all-reduce) is replicated.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from generation_service.model.config import ModelConfig

_COLUMN = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight",
           "v_proj.bias", "gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias",
           "embed_tokens.weight", "lm_head.weight")
_ROW = ("o_proj.weight", "down_proj.weight")


class TensorParallelError(ValueError):
    """A model, device or setting that cannot be served with the requested tensor parallelism."""


def check_divisible(config: ModelConfig, world_size: int) -> None:
    """Raise TensorParallelError unless every sharded dimension divides over `world_size` ranks.

    KV heads are split, never replicated: a model with fewer KV heads than ranks is refused."""
    for what, count in (("attention heads", config.num_heads), ("KV heads", config.num_kv_heads),
                        ("MLP intermediate features", config.intermediate_size)):
        if count % world_size:
            raise TensorParallelError(
                f"--tensor-parallel {world_size}: the model's {count} {what} do not divide over "
                f"{world_size} ranks (choose a divisor of {count})")


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world_size: int
    full: ModelConfig  # the whole model (what the engine, tokenizer and sampler see)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        check_divisible(self.full, self.world_size)

    @property
    def vocab_shard_size(self) -> int:
        """Rows of the embedding / LM head per rank; the last rank's tail past vocab_size is zero."""
        return -(-self.full.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard_size

    @property
    def local(self) -> ModelConfig:
        """The shard as a ModelConfig: the decoder blocks built from it have this rank's widths."""
        n = self.world_size
        return dataclasses.replace(self.full, num_heads=self.full.num_heads // n,
                                   num_kv_heads=self.full.num_kv_heads // n,
                                   intermediate_size=self.full.intermediate_size // n,
                                   vocab_size=self.vocab_shard_size)

    @staticmethod
    def split_dim(name: str) -> int | None:
        """The dimension of checkpoint tensor `name` that is split (None: replicated)."""
        if name.endswith(_COLUMN):
            return 0
        if name.endswith(_ROW):
            return 1
        return None

    def shard_range(self, name: str, full_shape: tuple[int, ...]) -> tuple[int, slice] | None:
        """(dim, this rank's slice of it) of tensor `name`, or None when it is replicated.
        Vocabulary slices may run past the tensor's end (the padded tail)."""
        dim = self.split_dim(name)
        if dim is None:
            return None
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return dim, slice(self.vocab_start, self.vocab_start + self.vocab_shard_size)
        size = full_shape[dim] // self.world_size
        return dim, slice(self.rank * size, (self.rank + 1) * size)
