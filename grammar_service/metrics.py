"""Prometheus metrics of grammar_service (served on --metrics-port when set).

docs/operations.md's table of families is written from these objects (tools/gen_docs_tables.py).
"""
from __future__ import annotations

import prometheus_client
from prometheus_client import Counter, Histogram

# As in generation_service: no *_created series beside every counter and histogram.
prometheus_client.disable_created_metrics()

COMPILE_SECONDS = Histogram(
    "structgen_grammar_compile_seconds", "Wall time of grammar compiles (cache misses)", ["kind"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30))
COMPILE_REQUESTS = Counter(
    "structgen_grammar_compile_requests_total", "Compile requests by outcome (compiled, cache_hit, error, "
    "timeout: past the compile timeout, saturated: refused, the compile queue full) and the backend asked "
    "for (auto, xgrammar, llguidance)",
    ["outcome", "backend"])  # compiled, cache_hit, error, timeout, saturated
STEP_SECONDS = Histogram(
    "structgen_grammar_step_seconds", "Time of one grammar step: advance + mask fill",
    buckets=(50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1))
ROWS_REJECTED = Counter(
    "structgen_grammar_tokens_rejected_total", "Accepted tokens the matcher refused (request aborted)")
ROWS_LATE = Counter(
    "structgen_grammar_rows_late_total",
    "Rows whose mask was not ready by the step's deadline: skipped for that step (slow_filler.py)")
BACKEND_FALLBACKS = Counter(
    "structgen_grammar_backend_fallbacks_total", "Grammars `auto` compiled with another backend than its "
    "pick (the pick failed, ran past its time, or could not take the first token)",
    ["from_backend", "to_backend"])
STEP_PHASE_SECONDS = Counter(
    "structgen_grammar_step_phase_seconds", "Time of grammar steps by phase (loop.py: StepPhases)",
    ["phase"])  # advance, fill, bookkeeping; the three add up to the step time


def families():
    """Every structgen_ family grammar_service exports (docs/operations.md)."""
    from structgen.metrics_docs import describe_metrics
    return describe_metrics([COMPILE_SECONDS, COMPILE_REQUESTS, BACKEND_FALLBACKS, STEP_SECONDS, ROWS_REJECTED,
                             ROWS_LATE, STEP_PHASE_SECONDS])
