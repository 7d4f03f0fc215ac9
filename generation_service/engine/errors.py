"""Engine errors. Each carries the status the gRPC edge maps it to (no grpc import here)."""
from __future__ import annotations


class EngineError(Exception):
    status = "INTERNAL"  # name of a grpc.StatusCode

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequestError(EngineError):
    status = "INVALID_ARGUMENT"


class LimitExceededError(EngineError):
    """A configured limit (prompt tokens, max new tokens, grammar size); says which and its value."""
    status = "OUT_OF_RANGE"


class QueueFullError(EngineError):
    status = "RESOURCE_EXHAUSTED"


class GrammarError(EngineError):
    """The grammar does not compile, or strict mode refused unenforced keywords."""
    status = "INVALID_ARGUMENT"


class GrammarUnavailableError(EngineError):
    """grammar_service is down or stuck; constrained requests fail, free ones continue."""
    status = "UNAVAILABLE"


class DeadlineExceededError(EngineError):
    status = "DEADLINE_EXCEEDED"


class CancelledError(EngineError):
    status = "CANCELLED"


class ShuttingDownError(EngineError):
    status = "UNAVAILABLE"
