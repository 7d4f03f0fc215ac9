"""Prometheus families read from `Engine.stats()` at scrape time, and the model info metric.

The families are a static table, so `describe()` (what the registry checks names against,
and what the docs' metric table is generated from) never calls into the engine; `collect()`
takes one stats snapshot per scrape. Every family carries the `model_name` label.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily

from generation_service.engine.config import WAIT_BUCKETS_S
from structgen.metrics_docs import FamilyDoc


@dataclass(frozen=True)
class StatsFamily:
    name: str                  # without structgen_ and without a counter's _total
    kind: str                  # "gauge" or "counter"
    help: str
    value: Callable            # EngineStats -> number


def _usage_ratio(stats) -> float:
    return stats.num_kv_pages_used / stats.num_kv_pages_total if stats.num_kv_pages_total else 0.0


STATS_FAMILIES = (
    StatsFamily("queue_depth", "gauge", "Requests waiting to be admitted (new and preempted)",
                lambda s: s.num_waiting),
    StatsFamily("running_requests", "gauge", "Requests admitted: prefilling or decoding", lambda s: s.num_running),
    StatsFamily("preempted_requests", "gauge", "Requests preempted, waiting to resume", lambda s: s.num_preempted),
    StatsFamily("kv_pages_used", "gauge", "KV-cache pages held by requests", lambda s: s.num_kv_pages_used),
    StatsFamily("kv_pages_capacity", "gauge", "Allocatable KV-cache pages", lambda s: s.num_kv_pages_total),
    StatsFamily("kv_cache_usage_ratio", "gauge", "Fraction of the KV cache held by requests, 0 to 1 "
                "(the Gateway API Inference Extension's KV-cache utilization)", _usage_ratio),
    StatsFamily("grammar_matchers", "gauge", "Grammar matchers bound in grammar_service",
                lambda s: s.num_grammar_matchers),
    StatsFamily("grammar_available", "gauge", "1 while the step channel to grammar_service is open",
                lambda s: int(s.grammar_available)),
    StatsFamily("draft_tokens_proposed", "counter", "Speculative draft tokens proposed", lambda s: s.draft_proposed),
    StatsFamily("draft_tokens_accepted", "counter", "Speculative draft tokens accepted by verification",
                lambda s: s.draft_accepted),
    StatsFamily("grammar_forced_tokens", "counter", "Output tokens the grammar forced: draft tokens of the "
                "grammar proposer's forced runs that verification accepted (by backend: the edge's "
                "structgen_request_grammar_forced_tokens)", lambda s: s.num_forced_tokens),
    StatsFamily("grammar_rejected_draft_tokens", "counter", "Speculative draft tokens the grammar refused "
                "(the first it could not accept and those after it), never verified",
                lambda s: s.num_grammar_rejected_drafts),
    StatsFamily("engine_steps", "counter", "Engine steps (forwards or grammar-only steps)", lambda s: s.steps),
    StatsFamily("grammar_steps", "counter", "Engine steps that waited on grammar masks", lambda s: s.grammar_steps),
    StatsFamily("grammar_mask_wait_seconds", "counter",
                "Time the engine (GPU stream or host) waited for grammar masks after its forward",
                lambda s: s.grammar_wait_s_total),
    StatsFamily("grammar_disconnects", "counter", "Times the watchdog found grammar_service gone or stuck",
                lambda s: s.grammar_disconnects),
    StatsFamily("grammar_late_rows", "counter", "Sampling rows skipped for a step because their grammar mask "
                "was not ready by the step's deadline (the request samples next step)",
                lambda s: s.num_late_rows),
    StatsFamily("preemptions", "counter", "Requests preempted for lack of KV pages", lambda s: s.num_preemptions),
    StatsFamily("kv_pages_cached", "gauge", "KV-cache pages the prefix cache keeps that no request holds "
                "(reused by requests with the same prefix, evicted when pages are needed)",
                lambda s: s.num_kv_pages_cached),
    StatsFamily("prefix_cache_query_tokens", "counter", "Tokens of admitted requests looked up in the prefix cache",
                lambda s: s.prefix_cache_query_tokens),
    StatsFamily("prefix_cache_hit_tokens", "counter", "Looked-up tokens found in the prefix cache (not prefilled)",
                lambda s: s.prefix_cache_hit_tokens),
    StatsFamily("prefix_cache_hit_ratio", "gauge", "Prefix-cache hit tokens over looked-up tokens since start, "
                "0 to 1 (over a window: rate of hit tokens / rate of query tokens)",
                lambda s: s.prefix_cache_hit_rate),
    StatsFamily("prefix_cache_evictions", "counter", "Cached KV pages evicted to make room",
                lambda s: s.prefix_cache_evictions),
)
INFO_LABELS = ("model_name", "device", "dtype", "runner", "version")
STEP_WAIT = FamilyDoc(
    "structgen_grammar_step_wait_seconds", "histogram", ("model_name",),
    "Per engine step that went through the step channel: how long the engine's host waited for its "
    "grammar masks once it needed them (after the forward on the host path; on the GPU, after "
    "launching the steps that follow it)")


def step_wait_buckets(counts: tuple[int, ...]) -> list[tuple[str, int]]:
    """Cumulative (le, count) buckets of `EngineStats.grammar_wait_counts`."""
    counts = counts or (0,) * (len(WAIT_BUCKETS_S) + 1)
    return list(zip([*map(repr, WAIT_BUCKETS_S), "+Inf"], itertools.accumulate(counts)))


class EngineCollector:
    """The STATS_FAMILIES of one engine, and `structgen_model_info` (value 1, labels INFO_LABELS)."""

    def __init__(self, engine, info: dict[str, str]):
        self._engine = engine
        self._info = info
        self._model_name = info["model_name"]

    def describe(self):
        return list(self._families(None))

    def collect(self):
        return list(self._families(self._engine.stats()))

    def _families(self, stats):
        info = InfoMetricFamily("structgen_model", "The served model and how it runs", labels=INFO_LABELS)
        if stats is not None:
            info.add_metric([self._info[k] for k in INFO_LABELS], {})
        yield info
        for family in STATS_FAMILIES:
            kind = GaugeMetricFamily if family.kind == "gauge" else CounterMetricFamily
            metric = kind(f"structgen_{family.name}", family.help, labels=["model_name"])
            if stats is not None:
                metric.add_metric([self._model_name], family.value(stats))
            yield metric
        wait = HistogramMetricFamily(STEP_WAIT.name, STEP_WAIT.help, labels=list(STEP_WAIT.labels))
        if stats is not None:
            wait.add_metric([self._model_name], step_wait_buckets(stats.grammar_wait_counts),
                            stats.grammar_wait_s_total)
        yield wait


def stats_family_docs() -> list[FamilyDoc]:
    info = FamilyDoc("structgen_model_info", "info", INFO_LABELS, "The served model and how it runs (value 1)")
    return [info] + [FamilyDoc(f"structgen_{f.name}" + ("_total" if f.kind == "counter" else ""), f.kind,
                               ("model_name",), f.help) for f in STATS_FAMILIES] + [STEP_WAIT]
