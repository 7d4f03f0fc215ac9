"""Cross-cutting concerns of the public gRPC server: request decoding, exception -> status
mapping, authentication.

Request bytes are parsed inside the handler (`DecodeInHandlerInterceptor`), so malformed
protobuf and invalid UTF-8 are INVALID_ARGUMENT, not grpc's own INTERNAL "Exception
deserializing request!". Servicer code raises domain exceptions and never calls
`context.abort` itself:
- `EngineError` (and subclasses) -> the status it names (`.status`), with its message;
- `ValueError` from a domain dataclass's validation -> INVALID_ARGUMENT, message unchanged;
- anything else -> INTERNAL, logged with its traceback and an error id the client sees.
"""
from __future__ import annotations

import hmac
import logging
import uuid

import grpc

from generation_service.engine.errors import EngineError

log = logging.getLogger("structgen.server")


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, EngineError):
        return getattr(grpc.StatusCode, error.status, grpc.StatusCode.INTERNAL), error.message
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    return grpc.StatusCode.INTERNAL, ""


def rewrap_handler(handler, wrap_unary, wrap_stream):
    """The same rpc handler with its unary-unary or unary-stream behaviour wrapped (the two
    kinds the services here have); None and client-streaming kinds pass through unchanged.
    The one place the error, tracing and metrics interceptors rebuild a handler."""
    if handler is None:
        return None
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            wrap_unary(handler.unary_unary), handler.request_deserializer,
            handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            wrap_stream(handler.unary_stream), handler.request_deserializer,
            handler.response_serializer)
    return handler


def _abort(context: grpc.ServicerContext, method: str, request, error: Exception):
    code, message = status_of(error)
    if code is grpc.StatusCode.INTERNAL and not isinstance(error, EngineError):
        error_id = uuid.uuid4().hex[:12]
        request_id = getattr(request, "request_id", "")
        log.exception("internal error %s in %s (request id %r)", error_id, method, request_id)
        message = f"internal error {error_id} (request id {request_id!r}); see the server log"
    context.abort(code, message)


class DecodeInHandlerInterceptor(grpc.ServerInterceptor):
    """Hands grpc no deserializer, and parses the request bytes in the handler instead: grpc
    answers a request its deserializer refuses with INTERNAL and cannot be told otherwise."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            def unary(raw, context):
                return behavior(_parse(parse, raw, context), context)
            return grpc.unary_unary_rpc_method_handler(unary, None, handler.response_serializer)
        if handler.unary_stream is not None:
            stream = handler.unary_stream

            def streaming(raw, context):
                yield from stream(_parse(parse, raw, context), context)
            return grpc.unary_stream_rpc_method_handler(streaming, None, handler.response_serializer)
        return handler


def _parse(parse, raw: bytes, context: grpc.ServicerContext):
    try:
        return parse(raw)
    except Exception as error:  # noqa: BLE001 -- protobuf's DecodeError, or anything a parser raises
        detail = str(error).split(": ", 1)[-1] if str(error) else type(error).__name__
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"the request is not a valid protobuf message of this rpc ({detail}); string fields "
                      "must be valid UTF-8")


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    """Maps exceptions raised by unary and server-streaming handlers to gRPC statuses."""

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        return rewrap_handler(continuation(handler_call_details),
                              lambda behavior: _wrap_unary(behavior, method),
                              lambda behavior: _wrap_stream(behavior, method))


def _wrap_unary(behavior, method: str):
    def wrapped(request, context):
        try:
            return behavior(request, context)
        except Exception as error:  # noqa: BLE001 -- this is the mapping point
            if _already_aborted(context):
                raise
            _abort(context, method, request, error)
    return wrapped


def _wrap_stream(behavior, method: str):
    def wrapped(request, context):
        try:
            yield from behavior(request, context)
        except Exception as error:  # noqa: BLE001 -- this is the mapping point
            if _already_aborted(context):
                raise
            _abort(context, method, request, error)
    return wrapped


def _already_aborted(context: grpc.ServicerContext) -> bool:
    """True when grpc's own abort (health, reflection) is unwinding through us."""
    code = context.code() if hasattr(context, "code") else None
    return code not in (None, grpc.StatusCode.OK)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Requires "authorization: Bearer <token>" (scheme in any case) on every rpc but
    grpc.health.v1 (probes)."""

    _EXEMPT_PREFIX = "/grpc.health.v1.Health/"

    def __init__(self, token: str):
        self._expected = token.encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = deny

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        metadata = dict(handler_call_details.invocation_metadata or ())
        scheme, _, given = str(metadata.get("authorization", "")).strip().partition(" ")
        # the scheme is case-insensitive (RFC 9110 11.1); compare_digest: the time taken must
        # not tell how much of a guess was right
        is_bearer = scheme.lower() == "bearer"
        if method.startswith(self._EXEMPT_PREFIX) or (
                hmac.compare_digest(given.strip().encode(), self._expected) and is_bearer):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._deny)
        if handler is not None and handler.stream_stream is not None:  # reflection
            return grpc.stream_stream_rpc_method_handler(lambda it, ctx: self._deny(None, ctx))
        return grpc.unary_unary_rpc_method_handler(self._deny)
