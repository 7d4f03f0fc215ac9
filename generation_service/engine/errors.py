"""Engine errors. Each carries the status the gRPC edge maps it to (no grpc import here).

The errors a grammar compile ends in are the grammar contract's (grammar_contract/errors.py):
the control client raises them and the engine raises QueueFullError and DeadlineExceededError
for its own limits, so they are named here with the rest of what the edge maps.
"""
from __future__ import annotations

from grammar_contract.errors import (DeadlineExceededError, GrammarError, GrammarUnavailableError, QueueFullError,
                                     StatusError)

EngineError = StatusError  # one base: the edge maps every error of either process by its `status`

__all__ = ["EngineError", "InvalidRequestError", "LimitExceededError", "QueueFullError", "GrammarError",
           "GrammarUnavailableError", "DeadlineExceededError", "CancelledError", "ShuttingDownError"]


class InvalidRequestError(EngineError):
    status = "INVALID_ARGUMENT"


class LimitExceededError(EngineError):
    """A configured limit (prompt tokens, max new tokens, grammar size); says which and its value."""
    status = "OUT_OF_RANGE"


class CancelledError(EngineError):
    status = "CANCELLED"


class ShuttingDownError(EngineError):
    status = "UNAVAILABLE"
