"""Traces of generation_service: a server span per rpc, and queue/prefill/decode per request.

The trace of one constrained Generate:

    structgen.v1.GenerationService/Generate   (server span; parent: the caller's traceparent)
    ├── structgen.queue      arrival -> admitted by the scheduler
    ├── grammar.compile      in grammar_service (context sent in CompileRequest.trace_context)
    ├── structgen.prefill    admitted -> first token sampled
    └── structgen.decode     first token -> finish (tokens, drafts, finish reason)

The engine knows nothing of OpenTelemetry: it stamps `admitted_s` / `first_token_s` on the
Request and calls its finish listeners; `RequestSpans` turns those stamps into spans with
explicit timestamps. Everything here is a no-op while `structgen.telemetry` is off.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from generation_service.interceptors import rewrap_handler
from structgen import telemetry

log = logging.getLogger(__name__)
_UNTRACED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")  # probes would flood the traces


class TracingInterceptor(grpc.ServerInterceptor):
    """Outermost interceptor: the server span is current while the handler (and the auth and
    error-mapping interceptors inside it) run, so their log lines carry its trace id."""

    def __init__(self) -> None:
        self._tracer = telemetry.tracer("structgen.server")

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_UNTRACED_PREFIXES):
            return handler
        carrier = {k: v for k, v in handler_call_details.invocation_metadata or ()
                   if k in ("traceparent", "tracestate")}
        start = self._start_span_factory(method, carrier)
        return rewrap_handler(handler, lambda behavior: _traced_unary(behavior, start),
                              lambda behavior: _traced_stream(behavior, start))

    def _start_span_factory(self, method: str, carrier: dict[str, str]):
        service, _, name = method.lstrip("/").partition("/")

        def start() -> trace.Span:
            return self._tracer.start_span(
                method.lstrip("/"), context=telemetry.extract(carrier), kind=SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
        return start


def _end(span: trace.Span, context: grpc.ServicerContext, error: BaseException | None) -> None:
    code = context.code() if hasattr(context, "code") else None
    if code is None and error is not None:
        code = grpc.StatusCode.UNKNOWN
    if code is None and not context.is_active():
        code = grpc.StatusCode.CANCELLED  # the client left before the stream ended
    code = code or grpc.StatusCode.OK
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


def _traced_unary(behavior, start):
    def wrapped(request, context):
        span = start()
        token = otel_context.attach(trace.set_span_in_context(span))
        error = None
        try:
            return behavior(request, context)
        except BaseException as exc:
            error = exc
            raise
        finally:
            otel_context.detach(token)
            _end(span, context, error)
    return wrapped


def _traced_stream(behavior, start):
    def wrapped(request, context):
        span = start()
        ctx = trace.set_span_in_context(span)
        error = None
        try:
            responses = iter(behavior(request, context))
            while True:
                # NOTE: the span is current around each step of the handler, never across a
                # yield: grpc may close this generator from another thread.
                token = otel_context.attach(ctx)
                try:
                    response = next(responses)
                except StopIteration:
                    return
                finally:
                    otel_context.detach(token)
                yield response
        except GeneratorExit:
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            _end(span, context, error)
    return wrapped


def with_trace_context(request):
    """The domain GenerationRequest carrying the current span's W3C context (for the compile
    span in grammar_service and the request spans); unchanged when nothing is traced."""
    if not telemetry.is_enabled():
        return request
    carrier = telemetry.inject()
    if not carrier:
        return request
    span = trace.get_current_span()
    span.set_attribute("structgen.request_id", request.request_id)
    span.set_attribute("gen_ai.usage.input_tokens", len(request.prompt_ids))
    if request.grammar is not None:
        span.set_attribute("structgen.grammar.kind", request.grammar.kind)
    return dataclasses.replace(request, trace_context=carrier)


def annotate_final(event) -> None:
    """Finish reason and usage of a request on the current (server) span."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attribute("gen_ai.response.finish_reasons", [event.finish_reason.value])
    if event.usage is not None:
        span.set_attribute("gen_ai.usage.output_tokens", event.usage.completion_tokens)
        span.set_attribute("structgen.drafts.proposed", event.usage.draft_tokens_proposed)
        span.set_attribute("structgen.drafts.accepted", event.usage.draft_tokens_accepted)


class RequestSpans:
    """Engine finish listener: queue, prefill and decode spans of a finished request.

    Runs on the engine thread under its lock, so it only creates spans (the batch processor
    exports them elsewhere) and never raises into the engine."""

    def __init__(self) -> None:
        self._tracer = telemetry.tracer("structgen.engine")

    def __call__(self, request) -> None:
        try:
            if telemetry.is_enabled() and request.spec.trace_context:
                self._record(request)
        except Exception:  # noqa: BLE001 -- telemetry must never fail a request
            log.exception("could not record the spans of request %s", request.request_id)

    def _record(self, request) -> None:
        parent = telemetry.extract(request.spec.trace_context)
        end_s = time.monotonic()
        admitted_s = getattr(request, "admitted_s", None)
        first_token_s = getattr(request, "first_token_s", None)
        common = {"structgen.request_id": request.request_id}
        self._span("structgen.queue", parent, request.arrival_s, admitted_s or end_s,
                   {**common, "structgen.admitted": admitted_s is not None})
        if admitted_s is not None:
            prefill = {**common, "gen_ai.usage.input_tokens": request.num_prompt_tokens}
            if request.guarantee is not None:
                prefill["structgen.grammar.cache_hit"] = request.guarantee.cache_hit
                prefill["structgen.grammar.backend"] = request.guarantee.backend
            self._span("structgen.prefill", parent, admitted_s, first_token_s or end_s, prefill)
        if first_token_s is not None:
            reason = request.finish_reason.value if request.finish_reason else "unknown"
            self._span("structgen.decode", parent, first_token_s, end_s, {
                **common, "gen_ai.usage.output_tokens": request.num_generated,
                "structgen.drafts.proposed": request.num_drafts_proposed,
                "structgen.drafts.accepted": request.num_drafts_accepted,
                "gen_ai.response.finish_reasons": [reason]},
                is_error=request.error is not None)

    def _span(self, name, parent, start_s, end_s, attributes, is_error: bool = False) -> None:
        span = self._tracer.start_span(name, context=parent, kind=SpanKind.INTERNAL,
                                       attributes=attributes, start_time=telemetry.epoch_ns(start_s))
        if is_error:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=telemetry.epoch_ns(max(end_s, start_s)))
