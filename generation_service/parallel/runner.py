"""Rank 0's runner (`EngineConfig.tensor_parallel` > 1): the eager ModelRunner, with each
forward first broadcast to the worker ranks. The engine above it is unchanged: it schedules,
samples and talks to grammar_service on rank 0 only, over logits gathered here."""
from __future__ import annotations

import logging

import torch

from generation_service.engine.kv_cache import KVCache
from generation_service.engine.runner import ModelRunner
from generation_service.model.forward_batch import ForwardBatch
from generation_service.parallel import step_message
from generation_service.parallel.group import close_group, report_broken
from generation_service.parallel.step_message import StepHeader, StepKind

log = logging.getLogger(__name__)


class TensorParallelRunner(ModelRunner):
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, vocab_size: int, **_options) -> None:
        super().__init__(model, kv_cache, vocab_size)
        self.group = model.group
        self._is_closed = False
        self._broken: str | None = None  # a failed step: no later one can pair with the workers'
        # The workers size their KV shards only now: the page count is the engine's choice.
        step_message.send(self.group, StepHeader(StepKind.SETUP, num_pages=kv_cache.num_pages,
                                                 page_size=kv_cache.page_size))

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        if self._broken is not None:
            raise RuntimeError(self._broken)
        try:
            step_message.send_forward(self.group, forward_batch)
            return self.model(forward_batch, self.kv_cache)
        except Exception as error:
            self._broken = f"tensor-parallel step failed on rank 0 ({error!r}); the ranks are out of step"
            report_broken(self._broken)
            raise

    def close(self) -> None:
        """Tell the workers to exit, then leave the group (the engine stops)."""
        if self._is_closed:
            return
        self._is_closed = True
        if self._broken is not None:  # the workers wait in the failed step: the launcher ends them
            close_group()
            return
        try:
            step_message.send(self.group, StepHeader(StepKind.STOP))
        except RuntimeError as error:  # a rank has died: the launcher reports which
            log.warning("tensor-parallel stop was not delivered to every rank: %s", error)
        close_group()
