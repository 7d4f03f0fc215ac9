"""Prometheus metrics of generation_service (served on `serve --metrics-port`, path /metrics).

Three sources, none of them on the engine's step path:
- `observe(stream, request)` wraps the events of one Generate at the gRPC edge: time to
  first token, inter-token latency, tokens, request duration and finish reasons, grammar
  compile time and cache hits (from the guarantee event) -- what a client experiences.
- `EngineCollector` reads `Engine.stats()` at scrape time: queue depth, running requests,
  KV pages, draft tokens proposed/accepted, time the engine waited on grammar masks.
- `StatusInterceptor` counts every rpc by method and final status code.

All families are prefixed `structgen_`; `get()` returns the process's one set, registered
in prometheus_client's default registry (which also has the process_* and python_* ones).
"""
from __future__ import annotations

import threading
import time
from typing import Iterable, Iterator

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from generation_service import tracing
from generation_service.interceptors import rewrap_handler

# Seconds: a small CPU model answers in ms; a 70B model behind a long queue in tens of s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 5)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GenerationMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self.registry = registry
        self.time_to_first_token = Histogram(
            "structgen_time_to_first_token_seconds",
            "Generate: request received -> first token sent (queueing, grammar compile, prefill)",
            ["constrained"], buckets=LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram(
            "structgen_inter_token_latency_seconds",
            "Generate: time between consecutive output tokens (a message of n tokens counts n "
            "times its gap / n)", ["constrained"], buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
        self.request_duration = Histogram(
            "structgen_request_duration_seconds", "Generate: request received -> final message",
            ["constrained"], buckets=DURATION_BUCKETS, registry=registry)
        self.generated_tokens = Counter(
            "structgen_generated_tokens", "Output tokens sent (rate() = tokens/s)",
            ["constrained"], registry=registry)
        self.prompt_tokens = Counter(
            "structgen_prompt_tokens", "Prompt tokens of Generate requests", registry=registry)
        self.finished_requests = Counter(
            "structgen_finished_requests", "Generate requests by finish reason",
            ["finish_reason"], registry=registry)
        self.grammar_compile_time = Histogram(
            "structgen_request_grammar_compile_seconds",
            "Compile time grammar_service reported for a request's grammar (cache misses only)",
            ["kind"], buckets=LATENCY_BUCKETS, registry=registry)
        self.grammar_compiles = Counter(
            "structgen_constrained_requests", "Constrained requests, by kind and grammar cache result",
            ["kind", "cache"], registry=registry)
        self.rpcs = Counter(
            "structgen_rpcs", "RPCs handled, by method and final status code",
            ["method", "code"], registry=registry)
        self.rpc_errors = Counter(
            "structgen_rpc_errors", "RPCs that ended with a status other than OK",
            ["method", "code"], registry=registry)
        self._collector: EngineCollector | None = None

    def watch(self, engine) -> None:
        """Export `engine.stats()` at every scrape (replacing an engine watched before)."""
        self.unwatch()
        self._collector = EngineCollector(engine)
        self.registry.register(self._collector)

    def unwatch(self) -> None:
        if self._collector is not None:
            self.registry.unregister(self._collector)
            self._collector = None

    def observe(self, events: Iterable, request) -> Iterator:
        """Pass the events of one Generate through, recording what the client experiences."""
        constrained = "true" if request.grammar is not None else "false"
        kind = request.grammar.kind if request.grammar is not None else ""
        self.prompt_tokens.inc(len(request.prompt_ids))
        received_s = last_token_s = time.monotonic()
        num_tokens = 0
        for event in events:
            now = time.monotonic()
            if event.guarantee is not None:
                hit = event.guarantee.cache_hit
                self.grammar_compiles.labels(kind, "hit" if hit else "miss").inc()
                if not hit:
                    self.grammar_compile_time.labels(kind).observe(event.guarantee.compile_ms / 1e3)
            if event.token_ids:
                n = len(event.token_ids)
                if num_tokens == 0:
                    self.time_to_first_token.labels(constrained).observe(now - received_s)
                    n_gaps = n - 1  # the first token's wait is TTFT, not an inter-token gap
                else:
                    n_gaps = n
                if n_gaps:
                    gap = (now - last_token_s) / n
                    histogram = self.inter_token_latency.labels(constrained)
                    for _ in range(n_gaps):  # speculative steps deliver several tokens at once
                        histogram.observe(gap)
                num_tokens += n
                last_token_s = now
                self.generated_tokens.labels(constrained).inc(n)
            if event.finish_reason is not None:
                self.finished_requests.labels(event.finish_reason.value).inc()
                self.request_duration.labels(constrained).observe(now - received_s)
                tracing.annotate_final(event)
            yield event

    def interceptor(self) -> grpc.ServerInterceptor:
        return StatusInterceptor(self)


class EngineCollector:
    """Engine gauges and counters, read from one `Engine.stats()` snapshot per scrape."""

    def __init__(self, engine):
        self._engine = engine

    def describe(self):
        return []  # collected lazily: registering must not call into the engine

    def collect(self):
        stats = self._engine.stats()
        gauges = (
            ("structgen_queue_depth", "Requests waiting to be admitted (new and preempted)", stats.num_waiting),
            ("structgen_running_requests", "Requests admitted: prefilling or decoding", stats.num_running),
            ("structgen_preempted_requests", "Requests preempted, waiting to resume", stats.num_preempted),
            ("structgen_kv_pages_used", "KV-cache pages held by requests", stats.num_kv_pages_used),
            ("structgen_kv_pages_total", "Allocatable KV-cache pages", stats.num_kv_pages_total),
            ("structgen_grammar_matchers", "Grammar matchers bound in grammar_service", stats.num_grammar_matchers),
            ("structgen_grammar_available", "1 while the step channel to grammar_service is open",
             int(stats.grammar_available)),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = (
            ("structgen_draft_tokens_proposed", "Speculative draft tokens proposed", stats.draft_proposed),
            ("structgen_draft_tokens_accepted", "Speculative draft tokens accepted by verification",
             stats.draft_accepted),
            ("structgen_engine_steps", "Engine steps (forwards or grammar-only steps)", stats.steps),
            ("structgen_grammar_steps", "Engine steps that waited on grammar masks", stats.grammar_steps),
            ("structgen_grammar_mask_wait_seconds",
             "Time the engine (GPU stream or host) waited for grammar masks after its forward",
             stats.grammar_wait_s_total),
            ("structgen_grammar_disconnects", "Times the watchdog found grammar_service gone or stuck",
             stats.grammar_disconnects),
            ("structgen_preemptions", "Requests preempted for lack of KV pages", stats.num_preemptions),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class StatusInterceptor(grpc.ServerInterceptor):
    """Counts each rpc once it ends, by method and status code (OK included)."""

    def __init__(self, metrics: GenerationMetrics):
        self._metrics = metrics

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        return rewrap_handler(continuation(handler_call_details),
                              lambda behavior: self._unary(behavior, method),
                              lambda behavior: self._stream(behavior, method))

    def _count(self, method: str, context, failed: bool) -> None:
        code = context.code() if hasattr(context, "code") else None
        if code is None:
            code = (grpc.StatusCode.UNKNOWN if failed
                    else grpc.StatusCode.OK if context.is_active() else grpc.StatusCode.CANCELLED)
        self._metrics.rpcs.labels(method, code.name).inc()
        if code is not grpc.StatusCode.OK:
            self._metrics.rpc_errors.labels(method, code.name).inc()

    def _unary(self, behavior, method):
        def wrapped(request, context):
            failed = True
            try:
                response = behavior(request, context)
                failed = False
                return response
            finally:
                self._count(method, context, failed)
        return wrapped

    def _stream(self, behavior, method):
        def wrapped(request, context):
            failed = False
            try:
                yield from behavior(request, context)
            except GeneratorExit:
                raise
            except BaseException:
                failed = True
                raise
            finally:
                self._count(method, context, failed)
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
