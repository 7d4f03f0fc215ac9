"""structgen.telemetry without a collector: when tracing is on, W3C carriers, trace ids in logs."""
from __future__ import annotations

import io
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from structgen import telemetry
from structgen.telemetry import TelemetrySettings


@pytest.mark.parametrize("environ,enabled", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://jaeger:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
    ({"OTEL_SDK_DISABLED": "false", "OTEL_SERVICE_NAME": "x"}, False),  # the chart's "off": no endpoint
])
def test_tracing_is_on_only_with_an_endpoint(environ, enabled):
    assert TelemetrySettings.from_env(environ).is_enabled is enabled


def test_setup_without_endpoint_installs_nothing():
    assert telemetry.setup("structgen", environ={}) is False
    assert not telemetry.is_enabled()


def test_carrier_round_trip_keeps_trace_and_parent():
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("parent") as span:
        carrier = telemetry.inject()
    assert carrier["traceparent"].split("-")[1] == format(span.get_span_context().trace_id, "032x")
    with tracer.start_as_current_span("child", context=telemetry.extract(carrier)) as child:
        assert child.get_span_context().trace_id == span.get_span_context().trace_id
        assert child.parent.span_id == span.get_span_context().span_id
    assert telemetry.inject() == {}  # outside any span
    assert telemetry.extract({}) is not None


def test_log_lines_inside_a_span_carry_its_trace_id():
    stream = io.StringIO()
    logger = logging.getLogger("test_telemetry")
    logger.propagate = False
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    telemetry.install_log_correlation(logger)
    tracer = TracerProvider().get_tracer("test")
    logger.warning("outside")
    with tracer.start_as_current_span("rpc") as span:
        logger.error("inside")
    lines = stream.getvalue().splitlines()
    context = span.get_span_context()
    assert lines[0] == "WARNING outside"
    assert lines[1] == (f"ERROR inside trace_id={context.trace_id:032x} span_id={context.span_id:016x}")


def test_epoch_ns_maps_monotonic_to_wall_clock():
    import time
    now_mono, now_ns = time.monotonic(), time.time_ns()
    assert abs(telemetry.epoch_ns(now_mono - 1.0) - (now_ns - 1_000_000_000)) < 50_000_000
