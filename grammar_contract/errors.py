"""The errors a grammar compile ends in, as both processes name them (no grpc import here).

Each carries the name of the gRPC status the edge maps it to. The control client turns
grammar_service's statuses back into these; the engine raises QueueFullError and
DeadlineExceededError for its own limits too, so generation_service/engine/errors.py builds
its error vocabulary on this base.
"""
from __future__ import annotations


class StatusError(Exception):
    status = "INTERNAL"  # name of a grpc.StatusCode

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class QueueFullError(StatusError):
    status = "RESOURCE_EXHAUSTED"


class GrammarError(StatusError):
    """The grammar does not compile, or strict mode refused unenforced keywords."""
    status = "INVALID_ARGUMENT"


class GrammarUnavailableError(StatusError):
    """grammar_service is down or stuck; constrained requests fail, free ones continue."""
    status = "UNAVAILABLE"


class DeadlineExceededError(StatusError):
    status = "DEADLINE_EXCEEDED"
