"""Traces and request counts of the HTTP port, as the gRPC port's interceptors give them.

The SERVER span of a request is FastAPI's own (its OpenTelemetry support, on while
structgen.telemetry has installed a tracer provider; `TELEMETRY` below): the child of the
caller's `traceparent`, HTTP semantic-convention attributes, current while the app runs,
ended once the answer is over. /health (probes, like grpc.health.v1) is not traced. A
completion handler then makes that span the one the gRPC `Generate` span is
(`start_choices`: named `{operation} {model}`, gen_ai.* attributes, the engine's
queue/prefill/decode spans and the grammar compile span as its children) and puts the
response's usage on it at the end (`annotate_response`).

`HttpObservability`, an ASGI middleware inside that span, counts every request in
`structgen_http_requests_total{route, code}` once its answer is over, and marks the span
ERROR for any answer of 400 or more: a refused or failed generation, as gRPC marks every
status but OK (FastAPI alone marks 5xx only). A stream that reported an `error` event is
ERROR too (`mark_failed`), and a client that left first is 499 (gRPC's CANCELLED).
"""
from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from generation_service import metrics, tracing

CLIENT_CLOSED = 499   # what nginx logs for a client that left before the answer
UNMATCHED_ROUTE = "unmatched"   # the route label of a path no route serves (bounded cardinality)
# FastAPI(telemetry=...): one server span per request, no spans per dependency or endpoint
# call (the handler's current span must be the server span, which it renames)
TELEMETRY = {"operation_spans": False, "logs": False, "exclude": lambda scope: scope.get("path") == "/health"}


class HttpObservability:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        answer = _Answer()

        async def observed_receive():
            message = await receive()
            answer.saw(message)
            return message

        async def observed_send(message) -> None:
            answer.saw(message)
            await send(message)

        failed = True
        try:
            await self.app(scope, observed_receive, observed_send)
            failed = False
        finally:
            observed = metrics.get()
            observed.http_requests.labels(observed.model_name, _route(scope), str(answer.code(failed))).inc()


class _Answer:
    """What the app sent: its status, and whether the body reached its end before the
    client left."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.is_complete = False
        self.client_left = False

    def saw(self, message) -> None:
        if message["type"] == "http.disconnect":
            self.client_left = not self.is_complete
        elif message["type"] == "http.response.start":
            self.status = message["status"]
            if self.status >= 400:  # the server span is current here, and still open
                mark_failed(f"HTTP {self.status}")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.is_complete = True

    def code(self, failed: bool) -> int:
        """The request's outcome as an HTTP status; a stream cut short is the client's leaving."""
        if self.is_complete and self.status is not None:
            return self.status
        if self.client_left:
            return CLIENT_CLOSED
        return 500 if failed or self.status is None else self.status


def _route(scope) -> str:
    route = scope.get("route")  # the router puts the matched route in the scope
    return getattr(route, "path", None) or UNMATCHED_ROUTE


def start_choices(specs: list, operation: str, model: str, response_id: str) -> list:
    """The current (server) span as the gRPC Generate span: `{operation} {model}`, the GenAI
    request attributes, and each choice's engine request in its trace; the response id is
    the one the client sees. Returns the specs carrying the trace context."""
    traced = [tracing.start_request(spec, operation, model) for spec in specs]
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("gen_ai.response.id", response_id)
        if len(specs) > 1:
            span.set_attribute("gen_ai.request.choice.count", len(specs))
    return traced


def end_choices(specs: list) -> None:
    for spec in specs:
        tracing.end_request(spec.request_id)


def annotate_response(usage, finish_reasons: list[str]) -> None:
    """The response's usage (all choices) and finish reasons on the current span."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attribute("gen_ai.response.finish_reasons", finish_reasons)
    span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
    span.set_attribute("gen_ai.usage.cache_read.input_tokens", usage.prompt_tokens_details.cached_tokens)


def mark_failed(message: str) -> None:
    """The current (server) span failed: an answer of 400 or more, or a stream that had
    answered 200 and failed later (its `error` event)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_status(Status(StatusCode.ERROR, message))
