"""Errors raised by the client: one `StructgenError` subclass per gRPC status the API documents."""
from __future__ import annotations

import grpc


class StructgenError(Exception):
    """A failed call. `code` is the grpc.StatusCode, `details` the server's message."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None):
        super().__init__(f"{(code or self.code).name}: {details}")
        self.details = details
        if code is not None:
            self.code = code


class InvalidArgumentError(StructgenError):
    """Bad field, empty prompt, grammar that does not compile, strict refusal."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class OutOfRangeError(StructgenError):
    """A configured server limit; the message names it and its value."""
    code = grpc.StatusCode.OUT_OF_RANGE


class ResourceExhaustedError(StructgenError):
    """Queue full, or the request message is over the size limit."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceededError(StructgenError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(StructgenError):
    code = grpc.StatusCode.CANCELLED


class UnavailableError(StructgenError):
    """The server (or, for constrained requests, its grammar service) is not reachable."""
    code = grpc.StatusCode.UNAVAILABLE


class InternalError(StructgenError):
    code = grpc.StatusCode.INTERNAL


class UnauthenticatedError(StructgenError):
    """The server requires a bearer token (Client(token=...)) and got none or a wrong one."""
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {cls.code: cls for cls in (InvalidArgumentError, OutOfRangeError, ResourceExhaustedError,
                                      DeadlineExceededError, CancelledError, UnavailableError,
                                      InternalError, UnauthenticatedError)}


def from_rpc_error(error: grpc.RpcError) -> StructgenError:
    """The StructgenError subclass for a grpc error (sync or asyncio)."""
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    cls = _BY_CODE.get(code, StructgenError)
    return cls(details or "", code)
