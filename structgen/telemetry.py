"""OpenTelemetry tracing for both processes, configured by the standard OTEL_* variables.

Tracing is on only when an OTLP endpoint is set (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
`OTEL_EXPORTER_OTLP_ENDPOINT`) and neither `OTEL_SDK_DISABLED=true` nor
`OTEL_TRACES_EXPORTER=none` says otherwise. The SDK itself reads the rest: the sampler
(`OTEL_TRACES_SAMPLER[_ARG]`), the resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`),
the exporter (`OTEL_EXPORTER_OTLP_INSECURE`, `_HEADERS`, `_CERTIFICATE`, ...) and the batch
processor (`OTEL_BSP_*`). Spans go over OTLP/gRPC, which Jaeger ingests natively.

Trace context crosses process boundaries as W3C `traceparent`/`tracestate` carriers:
`inject()` gives one for the current span, `extract()` turns one back into a parent. The
resource carries `service.version` (the structgen package's) unless the variables set one.
`install_log_correlation()` appends `trace_id=… span_id=…` to log lines written inside a
span, so an INTERNAL error in the log can be found in Jaeger and vice versa.
"""
from __future__ import annotations

import atexit
import logging
import os
import time
from dataclasses import dataclass
from typing import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("structgen.telemetry")
_PROPAGATOR = TraceContextTextMapPropagator()
_provider = None  # the SDK TracerProvider once setup() turned tracing on


@dataclass(frozen=True)
class TelemetrySettings:
    endpoint: str | None       # OTLP/gRPC endpoint of the traces; None = tracing off
    protocol: str = "grpc"

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "TelemetrySettings":
        endpoint = (environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                    or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)
        disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
        exporters = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
        if disabled or exporters in ("none", ""):
            endpoint = None
        protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
        return cls(endpoint, protocol)

    @property
    def is_enabled(self) -> bool:
        return self.endpoint is not None


def setup(default_service_name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Install the global TracerProvider when an endpoint is configured; True if tracing is on.

    `default_service_name` is used when OTEL_SERVICE_NAME (or service.name in
    OTEL_RESOURCE_ATTRIBUTES) does not name the service."""
    global _provider
    settings = TelemetrySettings.from_env(os.environ if environ is None else environ)
    if not settings.is_enabled or _provider is not None:
        return _provider is not None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource

    from structgen import __version__
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if settings.protocol != "grpc":
        log.warning("OTLP protocol %r is not supported; exporting over grpc", settings.protocol)
    resource = Resource.create({})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    if SERVICE_VERSION not in resource.attributes:  # OTEL_RESOURCE_ATTRIBUTES may name another
        resource = resource.merge(Resource({SERVICE_VERSION: __version__}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    # The exporter reads endpoint, insecure, headers, certificate and timeout from OTEL_*.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    atexit.register(shutdown)  # a no-op after an explicit shutdown()
    log.info("tracing on: OTLP/gRPC to %s as %s", settings.endpoint, resource.attributes[SERVICE_NAME])
    return True


def is_enabled() -> bool:
    return _provider is not None


def shutdown(timeout_s: float = 5.0) -> None:
    """Flush queued spans and stop the exporter (call once, at process exit)."""
    global _provider
    provider, _provider = _provider, None
    if provider is not None:
        provider.force_flush(int(timeout_s * 1000))
        provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """W3C carrier (traceparent, tracestate) of `ctx` (default: the current context);
    empty when no span is recording there."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> otel_context.Context:
    """The context a W3C carrier names (an empty context for an empty carrier)."""
    return _PROPAGATOR.extract(dict(carrier or {}), context=otel_context.Context())


def epoch_ns(monotonic_s: float) -> int:
    """Wall-clock ns of a time.monotonic() reading (span timestamps are wall clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class TraceIdFilter(logging.Filter):
    """Puts `trace_id`/`span_id` (hex, "" outside a span) on every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            record.trace_id = format(span_context.trace_id, "032x")
            record.span_id = format(span_context.span_id, "016x")
        else:
            record.trace_id = record.span_id = ""
        return True


class TraceIdFormatter(logging.Formatter):
    """Wraps a formatter: lines written inside a span end with `trace_id=… span_id=…`."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self._inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        text = self._inner.format(record)
        trace_id = getattr(record, "trace_id", "")
        return f"{text} trace_id={trace_id} span_id={record.span_id}" if trace_id else text


def install_log_correlation(logger: logging.Logger | None = None) -> None:
    """Add the trace id to every line the handlers of `logger` (default: root) write."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, TraceIdFilter) for f in handler.filters):
            handler.addFilter(TraceIdFilter())
            handler.setFormatter(TraceIdFormatter(handler.formatter))
