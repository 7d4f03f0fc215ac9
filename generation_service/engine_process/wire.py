"""What the serving process and the engine process say over their pipe.

Serving -> engine, one message each: `(SUBMIT, GenerationRequest)`, `(CANCEL, request_id)`,
`(CALL, call_id, method)` (the engine's `start` and `stats`), `(STOP, grace_s)`.
Engine -> serving: `(LOADED, EngineInfo)` or `(FAILED, error)` once the model is loaded,
then `(ITEMS, [item, ...])`, each item one of
    (TOKENS, request_id, token_ids, text)   a plain token event (most of the traffic)
    (EVENT, request_id, OutputEvent)        any other event (the final one, a guarantee, ...)
    (FINISHED, request_id, FinishedRequest) before the request's final event, for the
                                            serving process's finish listeners
    (REPLY, call_id, result, error)         a CALL's answer
and `(STOPPED,)` last.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from generation_service.engine.config import EngineConfig
from generation_service.engine.events import FinishReason, OutputEvent
from generation_service.engine.stream import is_plain_tokens
from generation_service.engine.validation import RequestLimits
from grammar_contract.report import GuaranteeReport

SUBMIT, CANCEL, CALL, STOP = "submit", "cancel", "call", "stop"
LOADED, FAILED, ITEMS, STOPPED = "loaded", "failed", "items", "stopped"
TOKENS, EVENT, FINISHED, REPLY = 0, 1, 2, 3


@dataclass(frozen=True)
class EngineInfo:
    """What the edges read of the engine besides its methods, sent once it is loaded."""

    config: EngineConfig          # as the engine resolved it (measured budgets)
    model_config: object          # generation_service.model.config.ModelConfig
    tokenizer: object             # generation_service.model.tokenizer.Tokenizer, or None
    model_name: str
    runner_name: str
    limits: RequestLimits


@dataclass(frozen=True)
class FinishedRequest:
    """What the finish listeners (metrics, tracing) read of a finished engine Request."""

    request_id: str
    trace_context: dict[str, str] | None
    arrival_s: float              # time.monotonic(): one clock for both processes on Linux
    admitted_s: float | None
    first_token_s: float | None
    error: Exception | None
    num_cached: int
    num_prompt_tokens: int
    guarantee: GuaranteeReport | None
    finish_reason: FinishReason | None
    num_generated: int
    num_drafts_proposed: int
    num_drafts_accepted: int

    @classmethod
    def of(cls, request) -> "FinishedRequest":
        return cls(request.request_id, request.spec.trace_context, request.arrival_s, request.admitted_s,
                   request.first_token_s, request.error, request.num_cached, request.num_prompt_tokens,
                   request.guarantee, request.finish_reason, request.num_generated,
                   request.num_drafts_proposed, request.num_drafts_accepted)

    @property
    def spec(self) -> "FinishedRequest":
        """`spec.trace_context`, as on a Request."""
        return self


def item_of(request_id: str, event: OutputEvent) -> tuple:
    """The wire item of one event: plain tokens as a tuple (cheaper to pickle), else the event."""
    if is_plain_tokens(event) and not event.logprobs:
        return (TOKENS, request_id, event.token_ids, event.text)
    return (EVENT, request_id, event)


class Sender:
    """One connection's sending side: `send` from any thread, one message at a time."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple) -> None:
        with self._lock:
            self.conn.send(message)
