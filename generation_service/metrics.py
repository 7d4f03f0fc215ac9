"""Prometheus metrics of generation_service (served on `serve --metrics-port`, path /metrics).

The sources, none of them on the engine's step path:
- `observe(stream, request)` wraps the events of one engine request at either edge (a gRPC
  Generate, or one choice of an HTTP completion): time to first token, inter-token latency,
  request duration, prompt and generated tokens per request, finish reasons, grammar
  compile time and cache hits -- what a client experiences.
- `record_finished(request)`, an engine finish listener: time in queue, in prefill and in
  decode per request, from the engine's own stamps.
- `engine_metrics.EngineCollector` reads `Engine.stats()` at scrape time (queue depth, KV
  cache use, drafts, ...) and exports `structgen_model_info`.
- `StatusInterceptor` counts every rpc by method and final status code.
- `openai_http.observability.HttpObservability` counts every HTTP API request by route
  and status code (`http_requests`); its completions go through `observe` as Generate's do.

All families are prefixed `structgen_` and carry `model_name`; `get()` returns the process's
one set, registered in prometheus_client's default registry (which also has the process_*
and python_* ones). No counter exports a `_created` series. docs/operations.md's table of
families is written from `families()` (tools/gen_docs_tables.py).
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Iterable, Iterator

import grpc
import prometheus_client
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from generation_service import tracing
from generation_service.engine_metrics import EngineCollector, stats_family_docs
from generation_service.interceptors import rewrap_handler
from structgen.metrics_docs import FamilyDoc, describe_metrics

# The *_created series double every counter and histogram for a start time Prometheus
# does not use (it detects resets itself).
prometheus_client.disable_created_metrics()

# Seconds: a small CPU model answers in ms; a 70B model behind a long queue in tens of s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 5)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
MODEL = "model_name"


class GenerationMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self.registry = registry
        self.model_name = ""  # set by watch(engine)

        def histogram(name, doc, labels=(), buckets=LATENCY_BUCKETS):
            return Histogram(name, doc, [MODEL, *labels], buckets=buckets, registry=registry)

        def counter(name, doc, labels=()):
            return Counter(name, doc, [MODEL, *labels], registry=registry)

        self.time_to_first_token = histogram(
            "structgen_time_to_first_token_seconds",
            "Generate: request received -> first token sent (queueing, grammar compile, prefill)",
            ["constrained"])
        self.inter_token_latency = histogram(
            "structgen_inter_token_latency_seconds",
            "Generate: time between consecutive output tokens (a message of n tokens counts n "
            "times its gap / n)", ["constrained"], TOKEN_LATENCY_BUCKETS)
        self.request_duration = histogram(
            "structgen_request_duration_seconds", "Generate: request received -> final message",
            ["constrained"], DURATION_BUCKETS)
        self.queue_time = histogram(
            "structgen_request_queue_time_seconds", "Engine: request queued -> first admitted to a batch",
            buckets=DURATION_BUCKETS)
        self.prefill_time = histogram(
            "structgen_request_prefill_time_seconds", "Engine: admitted -> first token sampled",
            buckets=DURATION_BUCKETS)
        self.decode_time = histogram(
            "structgen_request_decode_time_seconds", "Engine: first token -> finished",
            buckets=DURATION_BUCKETS)
        self.request_prompt_tokens = histogram(
            "structgen_request_prompt_tokens", "Prompt tokens per finished Generate request",
            buckets=TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = histogram(
            "structgen_request_generation_tokens", "Generated tokens per finished Generate request",
            ["constrained"], TOKEN_COUNT_BUCKETS)
        self.generated_tokens = counter(
            "structgen_generated_tokens", "Output tokens sent (rate() = tokens/s)", ["constrained"])
        self.prompt_tokens = counter("structgen_prompt_tokens", "Prompt tokens of Generate requests")
        self.finished_requests = counter(
            "structgen_finished_requests", "Generate requests by finish reason", ["finish_reason"])
        self.grammar_compile_time = histogram(
            "structgen_request_grammar_compile_seconds",
            "Compile time grammar_service reported for a request's grammar (cache misses only)", ["kind"])
        self.grammar_compiles = counter(
            "structgen_constrained_requests", "Constrained requests, by kind and grammar cache result",
            ["kind", "cache"])
        self.output_validations = counter(
            "structgen_output_validations", "Final checks of constrained outputs against their full JSON "
            "Schema, by grammar backend, what was checked (json_schema: the output; tool_call: a call's "
            "arguments) and status (invalid: a keyword the grammar did not enforce, else a bug; truncated: "
            "max_tokens cut it short; not_run: jsonschema could not use the schema)",
            ["backend", "kind", "status"])
        self.grammar_forced_tokens = counter(
            "structgen_request_grammar_forced_tokens", "Output tokens the grammar forced (accepted drafts of the "
            "grammar proposer's forced runs) of finished constrained requests, by grammar backend", ["backend"])
        self.grammar_rejected_drafts = counter(
            "structgen_request_grammar_rejected_draft_tokens", "Draft tokens the grammar refused before "
            "verification, of finished constrained requests, by grammar backend", ["backend"])
        self.rpcs = counter("structgen_rpcs", "RPCs handled, by method and final status code "
                            "(errors: code!=\"OK\")", ["method", "code"])
        self.http_requests = counter(
            "structgen_http_requests", "HTTP API requests (--http-port), by route template and HTTP status "
            "code once the answer is over (499: the client left first; errors: code=~\"4..|5..\")",
            ["route", "code"])
        self._collector: EngineCollector | None = None

    def watch(self, engine, version: str = "") -> None:
        """Export `engine.stats()` at every scrape and label everything with its model
        (replacing an engine watched before); time its requests as they finish."""
        self.unwatch()
        self.model_name = engine.model_name
        config = engine.config
        self._collector = EngineCollector(engine, {
            "model_name": engine.model_name, "device": str(config.device),
            "dtype": config.dtype or "checkpoint", "version": version,
            "runner": engine.runner_name})
        self.registry.register(self._collector)
        engine.table.finish_listeners.append(self.record_finished)

    def unwatch(self) -> None:
        if self._collector is not None:
            self.registry.unregister(self._collector)
            self._collector = None

    def record_finished(self, request) -> None:
        """Engine finish listener (engine thread, lock held): where the request's time went."""
        end_s = time.monotonic()
        admitted_s, first_token_s = request.admitted_s, request.first_token_s
        if admitted_s is not None:
            self.queue_time.labels(self.model_name).observe(admitted_s - request.arrival_s)
            if first_token_s is not None:
                self.prefill_time.labels(self.model_name).observe(first_token_s - admitted_s)
        if first_token_s is not None:
            self.decode_time.labels(self.model_name).observe(end_s - first_token_s)

    def observe(self, events: Iterable, request) -> Iterator:
        """Pass the events of one Generate through, recording what the client experiences."""
        observer = self.observer(request)
        for event in events:
            observer.event(event)
            yield event

    def observer(self, request) -> "RequestObserver":
        """What `observe` records, one event at a time (`RequestObserver.event`)."""
        return RequestObserver(self, request)

    def interceptor(self) -> grpc.ServerInterceptor:
        return StatusInterceptor(self)

    def families(self) -> list[FamilyDoc]:
        """Every structgen_ family this process exports, edge and engine."""
        edge = [m for m in vars(self).values() if isinstance(m, (Counter, Histogram))]
        return describe_metrics(edge) + stats_family_docs()


class RequestObserver:
    """The client-side figures of one request: made when it is received, then `event` for
    each event it is sent, in order."""

    def __init__(self, metrics: GenerationMetrics, request) -> None:
        self._metrics = metrics
        self._request = request
        self._model = metrics.model_name
        self._constrained = "true" if request.grammar is not None else "false"
        self._kind = request.grammar.kind if request.grammar is not None else ""
        metrics.prompt_tokens.labels(self._model).inc(len(request.prompt_ids))
        # the per-token families' children, looked up once (a labels() call takes a lock)
        self._inter_token = metrics.inter_token_latency.labels(self._model, self._constrained)
        self._generated = metrics.generated_tokens.labels(self._model, self._constrained)
        self._received_s = self._last_token_s = time.monotonic()
        self._num_tokens = 0
        self._backend = ""  # from the guarantee report

    def validated(self, kind: str, result) -> None:
        """A final validation (schema_validation.ValidationResult) of the output or of a tool call."""
        self._metrics.output_validations.labels(self._model, self._backend, kind, result.status).inc()

    def event(self, event) -> None:
        metrics, model, constrained = self._metrics, self._model, self._constrained
        now = time.monotonic()
        if event.guarantee is not None:
            self._backend = event.guarantee.backend
            hit = event.guarantee.cache_hit
            metrics.grammar_compiles.labels(model, self._kind, "hit" if hit else "miss").inc()
            if not hit:
                metrics.grammar_compile_time.labels(model, self._kind).observe(event.guarantee.compile_ms / 1e3)
        if event.token_ids:
            n = len(event.token_ids)
            if self._num_tokens == 0:
                metrics.time_to_first_token.labels(model, constrained).observe(now - self._received_s)
                n_gaps = n - 1  # the first token's wait is TTFT, not an inter-token gap
            else:
                n_gaps = n
            if n_gaps:
                gap = (now - self._last_token_s) / n
                for _ in range(n_gaps):  # speculative steps deliver several tokens at once
                    self._inter_token.observe(gap)
            self._num_tokens += n
            self._last_token_s = now
            self._generated.inc(n)
        if event.finish_reason is not None:
            metrics.finished_requests.labels(model, event.finish_reason.value).inc()
            metrics.request_duration.labels(model, constrained).observe(now - self._received_s)
            metrics.request_prompt_tokens.labels(model).observe(len(self._request.prompt_ids))
            metrics.request_generation_tokens.labels(model, constrained).observe(self._num_tokens)
            if event.usage is not None and self._backend:
                metrics.grammar_forced_tokens.labels(model, self._backend).inc(event.usage.forced_tokens)
                metrics.grammar_rejected_drafts.labels(model, self._backend).inc(
                    event.usage.grammar_rejected_draft_tokens)
            tracing.annotate_final(event)


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Counts each rpc once it ends, by method and status code (OK included)."""

    def __init__(self, metrics: GenerationMetrics):
        self._metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        counted = lambda behavior: self._counted(behavior, method)  # noqa: E731
        return rewrap_handler(await continuation(handler_call_details), counted, counted)

    def _count(self, method: str, context, failed: bool, cancelled: bool) -> None:
        code = context.code()
        if code is None:
            code = (grpc.StatusCode.CANCELLED if cancelled
                    else grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK)
        self._metrics.rpcs.labels(self._metrics.model_name, method, code.name).inc()

    def _counted(self, behavior, method):
        async def wrapped(request, context):
            failed = cancelled = False
            try:
                return await behavior(request, context)
            except asyncio.CancelledError:  # the client left (or the server stopped the rpc)
                cancelled = True
                raise
            except BaseException:
                failed = True
                raise
            finally:
                self._count(method, context, failed, cancelled)
        return wrapped


_metrics: GenerationMetrics | None = None
_lock = threading.Lock()


def get() -> GenerationMetrics:
    """The process's metrics, created (and registered) on first use."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = GenerationMetrics()
        return _metrics
