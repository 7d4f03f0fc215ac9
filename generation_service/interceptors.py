"""Cross-cutting concerns of the public gRPC server (grpc.aio): request decoding, exception ->
status mapping, authentication, the open-RPC limit.

Request bytes are parsed inside the handler (`DecodeInHandlerInterceptor`), so malformed
protobuf and invalid UTF-8 are INVALID_ARGUMENT, not grpc's own INTERNAL "Exception
deserializing request!". Servicer code raises domain exceptions and never calls
`context.abort` itself:
- `EngineError` (and subclasses) -> the status it names (`.status`), with its message;
- `ValueError` from a domain dataclass's validation -> INVALID_ARGUMENT, message unchanged;
- anything else -> INTERNAL, logged with its traceback and an error id the client sees.

Every handler the interceptors hand on is a coroutine: unary ones return the response,
server-streaming ones write each message (`context.write`), so a wrapper costs the stream
one call, not one generator step per message.
"""
from __future__ import annotations

import hmac
import inspect
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


def as_writer(behavior):
    """A server-streaming behaviour as a coroutine that writes its messages: an async
    generator's messages are written here, a coroutine (write API) is returned as it is."""
    if not inspect.isasyncgenfunction(behavior):
        return behavior

    async def write_all(request, context):
        async for response in behavior(request, context):
            await context.write(response)
    return write_all


def rewrap_handler(handler, wrap_unary, wrap_stream, deserializer=...):
    """The same rpc handler with its unary-unary or unary-stream behaviour wrapped (the two
    kinds the services here have; the stream one as a writer coroutine, `as_writer`); None
    and client-streaming kinds pass through unchanged. `deserializer`: a replacement for
    the handler's. The one place the interceptors rebuild a handler."""
    if handler is None:
        return None
    parse = handler.request_deserializer if deserializer is ... else deserializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            wrap_unary(handler.unary_unary), parse, handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            wrap_stream(as_writer(handler.unary_stream)), parse, handler.response_serializer)
    return handler


async def _abort(context: grpc.aio.ServicerContext, method: str, request, error: Exception):
    code, message = status_of(error)
    if code is grpc.StatusCode.INTERNAL and not isinstance(error, EngineError):
        error_id = uuid.uuid4().hex[:12]
        request_id = getattr(request, "request_id", "")
        log.error("internal error %s in %s (request id %r)", error_id, method, request_id, exc_info=error)
        message = f"internal error {error_id} (request id {request_id!r}); see the server log"
    await context.abort(code, message)


class DecodeInHandlerInterceptor(grpc.aio.ServerInterceptor):
    """Hands grpc no deserializer, and parses the request bytes in the handler instead: grpc
    answers a request its deserializer refuses with INTERNAL and cannot be told otherwise."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def wrap_unary(behavior):
            async def unary(raw, context):
                return await behavior(await _parse(parse, raw, context), context)
            return unary

        def wrap_stream(behavior):
            async def streaming(raw, context):
                await behavior(await _parse(parse, raw, context), context)
            return streaming
        return rewrap_handler(handler, wrap_unary, wrap_stream, deserializer=None)


async def _parse(parse, raw: bytes, context: grpc.aio.ServicerContext):
    try:
        return parse(raw)
    except Exception as error:  # noqa: BLE001 -- protobuf's DecodeError, or anything a parser raises
        detail = str(error).split(": ", 1)[-1] if str(error) else type(error).__name__
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request is not a valid protobuf message of this rpc ({detail}); string fields "
                            "must be valid UTF-8")


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by unary and server-streaming handlers to gRPC statuses."""

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        return rewrap_handler(await continuation(handler_call_details),
                              lambda behavior: _mapped(behavior, method),
                              lambda behavior: _mapped(behavior, method))


def _mapped(behavior, method: str):
    async def wrapped(request, context):
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 -- this is the mapping point
            if _already_aborted(context):
                raise
            await _abort(context, method, request, error)
    return wrapped


def _already_aborted(context: grpc.aio.ServicerContext) -> bool:
    """True when grpc's own abort (health, reflection) is unwinding through us."""
    code = context.code()
    return code not in (None, grpc.StatusCode.OK)


class OpenRpcLimitInterceptor(grpc.aio.ServerInterceptor):
    """--max-concurrent-rpcs: unary and server-streaming RPCs open at once on the API port, over
    all its listeners (one instance shared by their servers; grpc's own limit counts per server).
    Beyond it a call gets RESOURCE_EXHAUSTED at once. Runs on the servers' one event loop."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_open = 0

    async def intercept_service(self, continuation, handler_call_details):
        return rewrap_handler(await continuation(handler_call_details), self._counted, self._counted)

    def _counted(self, behavior):
        async def counted(request, context):
            if self.num_open >= self.limit:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"the server has {self.num_open} open RPCs, its limit (--max-concurrent-rpcs); "
                                    "retry later or send the request to another replica")
            self.num_open += 1
            try:
                return await behavior(request, context)
            finally:
                self.num_open -= 1
        return counted


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires "authorization: Bearer <token>" (scheme in any case) on every rpc but
    grpc.health.v1 (probes)."""

    _EXEMPT_PREFIX = "/grpc.health.v1.Health/"

    def __init__(self, token: str):
        self._expected = token.encode()

    @staticmethod
    async def _deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def _deny_stream(self, request_iterator, context):
        await self._deny(None, context)
        yield  # never reached: an async generator, as stream-stream handlers are

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        metadata = dict(handler_call_details.invocation_metadata or ())
        scheme, _, given = str(metadata.get("authorization", "")).strip().partition(" ")
        # the scheme is case-insensitive (RFC 9110 11.1); compare_digest: the time taken must
        # not tell how much of a guess was right
        is_bearer = scheme.lower() == "bearer"
        if method.startswith(self._EXEMPT_PREFIX) or (
                hmac.compare_digest(given.strip().encode(), self._expected) and is_bearer):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._deny)
        if handler is not None and handler.stream_stream is not None:  # reflection
            return grpc.stream_stream_rpc_method_handler(self._deny_stream)
        return grpc.unary_unary_rpc_method_handler(self._deny)
