"""Traces of generation_service: a server span per rpc, and queue/prefill/decode per request.

The trace of one constrained Generate, in the OpenTelemetry GenAI semantic conventions:

    text_completion <model>   (the rpc's server span, renamed; parent: the caller's traceparent;
    │                          gen_ai.* request, response, usage and latency attributes)
    ├── structgen.queue      arrival -> admitted by the scheduler
    ├── grammar.compile      in grammar_service (context sent in CompileRequest.trace_context)
    ├── structgen.prefill    admitted -> first token sampled (none if it failed before one)
    └── structgen.decode     first token -> finish (tokens, drafts, finish reason)

The operation is `chat` for chat input, `text_completion` for a prompt or token ids. The
engine knows nothing of OpenTelemetry: it stamps `admitted_s` / `first_token_s` on the
Request and calls its finish listeners before the final event; `RequestSpans` turns those
stamps into spans with explicit timestamps and puts the latencies on the rpc span, which
the servicer registered (`start_request`). Everything here is a no-op while
`structgen.telemetry` is off.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from generation_service.interceptors import rewrap_handler
from structgen import telemetry

log = logging.getLogger(__name__)
_UNTRACED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")  # probes would flood the traces


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Outermost interceptor: the server span is current while the handler (and the auth and
    error-mapping interceptors inside it) run, so their log lines carry its trace id. Each rpc
    runs in a task of its own, so the span is current in that task alone."""

    def __init__(self) -> None:
        self._tracer = telemetry.tracer("structgen.server")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_UNTRACED_PREFIXES):
            return handler
        carrier = {k: v for k, v in handler_call_details.invocation_metadata or ()
                   if k in ("traceparent", "tracestate")}
        start = self._start_span_factory(method, carrier)
        traced = lambda behavior: _traced(behavior, start)  # noqa: E731
        return rewrap_handler(handler, traced, traced)

    def _start_span_factory(self, method: str, carrier: dict[str, str]):
        service, _, name = method.lstrip("/").partition("/")

        def start() -> trace.Span:
            return self._tracer.start_span(
                method.lstrip("/"), context=telemetry.extract(carrier), kind=SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
        return start


def _end(span: trace.Span, context: grpc.aio.ServicerContext, error: BaseException | None) -> None:
    code = context.code()
    if code is None and isinstance(error, asyncio.CancelledError):
        code = grpc.StatusCode.CANCELLED  # the client left before the stream ended
    elif code is None and error is not None:
        code = grpc.StatusCode.UNKNOWN
    code = code or grpc.StatusCode.OK
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


def _traced(behavior, start):
    async def wrapped(request, context):
        span = start()
        token = otel_context.attach(trace.set_span_in_context(span))
        error = None
        try:
            return await behavior(request, context)
        except BaseException as exc:
            error = exc
            raise
        finally:
            otel_context.detach(token)
            _end(span, context, error)
    return wrapped


PROVIDER = "structgen"   # gen_ai.provider.name: who serves the model
_open_spans: dict[str, trace.Span] = {}  # request_id -> its rpc span, until the request finishes
_open_lock = threading.Lock()


def start_request(request, operation: str, model: str):
    """Name the current (rpc) span `{operation} {model}`, put the GenAI request attributes on
    it, register it for the engine's finish listener and return the domain GenerationRequest
    carrying its W3C context (for the compile span and the request spans). Unchanged when
    nothing is traced; `end_request` must follow either way."""
    if not telemetry.is_enabled():
        return request
    span = trace.get_current_span()
    carrier = telemetry.inject()
    if not carrier or not span.is_recording():
        return request
    sampling = request.sampling
    span.update_name(f"{operation} {model}")
    attributes = {
        "gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": model, "gen_ai.response.model": model,
        "gen_ai.response.id": request.request_id, "structgen.request_id": request.request_id,
        "gen_ai.request.max_tokens": sampling.max_new_tokens,
        "gen_ai.request.temperature": sampling.temperature, "gen_ai.request.top_p": sampling.top_p,
        "gen_ai.request.top_k": sampling.top_k, "gen_ai.usage.input_tokens": len(request.prompt_ids)}
    if sampling.seed is not None:
        attributes["gen_ai.request.seed"] = sampling.seed
    if request.grammar is not None:
        attributes["structgen.grammar.kind"] = request.grammar.kind
    span.set_attributes(attributes)
    with _open_lock:
        _open_spans[request.request_id] = span
    return dataclasses.replace(request, trace_context=carrier)


def end_request(request_id: str) -> None:
    """The servicer is done with the request (finished, failed or refused)."""
    with _open_lock:
        _open_spans.pop(request_id, None)


def annotate_final(event) -> None:
    """Finish reason and usage of a request on the current (rpc) span."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attribute("gen_ai.response.finish_reasons", [event.finish_reason.value])
    if event.usage is not None:
        span.set_attribute("gen_ai.usage.output_tokens", event.usage.completion_tokens)
        span.set_attribute("gen_ai.usage.cache_read.input_tokens", event.usage.cached_prompt_tokens)
        span.set_attribute("structgen.drafts.proposed", event.usage.draft_tokens_proposed)
        span.set_attribute("structgen.drafts.accepted", event.usage.draft_tokens_accepted)
        span.set_attribute("structgen.grammar.forced_tokens", event.usage.forced_tokens)
        span.set_attribute("structgen.grammar.rejected_drafts", event.usage.grammar_rejected_draft_tokens)


class RequestSpans:
    """Engine finish listener: queue, prefill and decode spans of a finished request, and its
    latencies on the rpc span (`gen_ai.latency.*`, seconds, as vLLM names them).

    Runs on the engine thread under its lock, before the final event reaches the servicer, so
    it only creates spans (the batch processor exports them elsewhere) and never raises into
    the engine."""

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
        admitted_s, first_token_s = request.admitted_s, request.first_token_s
        # A prefill span only for a prefill that produced a token, or was cut short by the client
        # (cancel, deadline) after K/V was computed: a request that failed before its first
        # token (a grammar that did not compile, ...) shows the error on the rpc span alone.
        prefilled = admitted_s is not None and (
            first_token_s is not None or (request.error is None and request.num_cached > 0))
        common = {"structgen.request_id": request.request_id}
        self._span("structgen.queue", parent, request.arrival_s, admitted_s or end_s,
                   {**common, "structgen.admitted": admitted_s is not None})
        if prefilled:
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
        self._annotate_rpc_span(request, end_s)

    def _annotate_rpc_span(self, request, end_s: float) -> None:
        with _open_lock:
            span = _open_spans.pop(request.request_id, None)
        if span is None or not span.is_recording():  # not traced, or the client left already
            return
        latency = {"gen_ai.latency.e2e": end_s - request.arrival_s}
        if request.admitted_s is not None:
            latency["gen_ai.latency.time_in_queue"] = request.admitted_s - request.arrival_s
        if request.first_token_s is not None:
            latency["gen_ai.latency.time_to_first_token"] = request.first_token_s - request.arrival_s
            latency["gen_ai.latency.time_in_model_decode"] = end_s - request.first_token_s
            if request.admitted_s is not None:
                latency["gen_ai.latency.time_in_model_prefill"] = request.first_token_s - request.admitted_s
        span.set_attributes(latency)

    def _span(self, name, parent, start_s, end_s, attributes, is_error: bool = False) -> None:
        span = self._tracer.start_span(name, context=parent, kind=SpanKind.INTERNAL,
                                       attributes=attributes, start_time=telemetry.epoch_ns(start_s))
        if is_error:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=telemetry.epoch_ns(max(end_s, start_s)))
