"""Self-speculative drafts: the model drafts with a subset of its own layers (proposer "self").

The layers skipped are a calibration's choice (model/layer_skip.py, `structgen
calibrate-self-spec`), read from the cache at the first request that asks for it. A row's k
drafts are k greedy forwards of the draft layers, each of one more token, over the row's own
pages: draft i sees the request's cached K/V at positions < num_cached (written by full
forwards) and, in each draft layer, the K/V the earlier drafts wrote at num_cached.. .

KV invariant: the drafts write only positions num_cached .. num_tokens + k - 2, of the draft
layers; the verify step that follows feeds [uncached tokens, d_0 .. d_{k-1}] at positions
num_cached .. num_tokens + k - 1 and writes every layer's K/V there before any attention
reads it, so nothing a draft wrote is ever read by the verify. Rolled-back positions are past
num_cached, where a later forward writes before it reads, as after any rejected draft. The
pages are reserved before the first draft forward (the verify needs them anyway).

NOTE: drafting runs inside Scheduler.schedule (the proposer interface), so under the engine
lock: submit, cancel and stats wait for a step's draft forwards (k one-token forwards of the
draft layers per row, one row at a time).

The draft forward is the runner's (`ModelRunner.draft_logits`): the model's own eager forward
on the eager runner; on the CUDA-graph runner a one-row mixed-step graph of the draft layers,
captured at the first draft with them (graph_runner.py), on the stream its steps run on. A
step with drafts is scheduled only once every earlier step's tokens are read (engine.py and
mixed_steps.py never chain one), so a draft reads final tokens and K/V. The verify is the
runner's own (verify graphs or a mixed step). Under tensor parallelism the forward must run on
every rank at once, which a draft does not: there a request for "self" is INVALID_ARGUMENT
(`check_ready`).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from generation_service.engine.errors import InvalidRequestError
from generation_service.engine.request import Request
from generation_service.engine.speculative import DraftProposer
from generation_service.model.layer_skip import LayerSkipChoice, load_choice

log = logging.getLogger(__name__)
DRAFTING_RUNNERS = ("eager", "cuda_graph")


class SelfDraftProposer(DraftProposer):
    """k greedy drafts from the model's calibrated draft layers (module docstring).

    `draft_logits(pages, new_ids, num_cached, layer_ids)`: the runner's draft forward
    (ModelRunner.draft_logits); `reserve(request, num_tokens)` makes the request's pages hold
    num_tokens tokens (Scheduler.reserve); `runner` is the engine's runner name.
    """

    def __init__(self, model: torch.nn.Module, draft_logits: Callable[..., torch.Tensor],
                 reserve: Callable[[Request, int], bool], model_key: str, model_source: str, runner: str) -> None:
        self.model = model
        self.draft_logits = draft_logits
        self.reserve = reserve
        self.model_key = model_key
        self.model_source = model_source
        self.runner = runner
        self.choice: LayerSkipChoice | None = None
        self.layer_ids: tuple[int, ...] = ()

    def use(self, choice: LayerSkipChoice) -> None:
        """Draft with `choice`'s layers (the cached calibration is read only while none is set)."""
        self.choice = choice
        self.layer_ids = choice.draft_layers(self.model.config.num_layers)
        log.info("self-speculative drafts skip layers %s of %d (calibrated acceptance %.2f)",
                 list(choice.skip_layers), self.model.config.num_layers, choice.acceptance)

    def check_ready(self) -> None:
        if self.runner not in DRAFTING_RUNNERS:
            raise InvalidRequestError(
                f"draft proposer 'self' drafts with one process's forward; this server's runner is {self.runner!r} "
                "(a sharded model forwards on every rank at once): serve the model without tensor parallelism, "
                "or use proposer ngram or grammar")
        if self.choice is None:
            choice = load_choice(self.model_key)
            if choice is None:
                raise InvalidRequestError(
                    "draft proposer 'self' needs this model's draft layers, chosen by a calibration that was not "
                    f"run: run `structgen calibrate-self-spec --model {self.model_source}` once")
            self.use(choice)

    @torch.inference_mode()
    def propose(self, request: Request, k: int) -> list[int]:
        if k <= 0 or not self.layer_ids or not self.reserve(request, request.num_tokens + k):
            return []
        new_ids, num_cached = request.token_ids[request.num_cached:], request.num_cached
        drafts: list[int] = []
        for _ in range(k):
            token = int(self.draft_logits(request.pages, new_ids, num_cached, self.layer_ids).argmax())
            drafts.append(token)
            if token in request.eos_token_ids:  # nothing the model says after its end is worth a draft
                break
            num_cached, new_ids = num_cached + len(new_ids), [token]
        return drafts
