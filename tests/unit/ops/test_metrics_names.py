"""The exposition of both processes passes `promtool check metrics` (Debian's promtool,
tools/install_promtool.sh), has no *_created series, labels every generation family with
the model, and matches the families docs/operations.md lists. A live scrape is checked the
same way in tests/integration/test_ops_observability.py."""
from __future__ import annotations

import dataclasses
import pathlib
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from generation_service.engine.config import WAIT_BUCKETS_S, EngineConfig, EngineStats
from generation_service.metrics import GenerationMetrics

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def promtool() -> str:
    proc = subprocess.run([str(ROOT / "tools" / "install_promtool.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, f"tools/install_promtool.sh failed:\n{proc.stderr}"
    return proc.stdout.strip().splitlines()[-1]


def promtool_problems(promtool: str, text: bytes) -> str:
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
    return (proc.stdout + proc.stderr).decode() if proc.returncode else ""


class StatsOnly:
    """What EngineCollector reads of an engine: its stats (all fields set, none zero)."""
    model_name = "tiny-model"
    runner_name = "eager"
    config = EngineConfig()
    table = type("Table", (), {"finish_listeners": []})()

    def stats(self) -> EngineStats:
        fields = {f.name: 3 for f in dataclasses.fields(EngineStats)}
        return EngineStats(**{**fields, "num_kv_pages_total": 8, "grammar_available": True,
                              "grammar_wait_counts": (3,) * (len(WAIT_BUCKETS_S) + 1)})


@pytest.fixture()
def exposition() -> bytes:
    registry = CollectorRegistry()
    metrics = GenerationMetrics(registry)
    metrics.watch(StatsOnly(), "1.2.3")
    model = metrics.model_name
    metrics.rpcs.labels(model, "/structgen.v1.GenerationService/Generate", "OK").inc()
    metrics.time_to_first_token.labels(model, "true").observe(0.1)
    metrics.request_prompt_tokens.labels(model).observe(12)
    metrics.generated_tokens.labels(model, "false").inc(4)
    return generate_latest(registry)


def test_generation_exposition_passes_promtool(promtool, exposition):
    assert promtool_problems(promtool, exposition) == ""


def test_grammar_exposition_passes_promtool(promtool):
    import grammar_service.metrics as grammar_metrics
    registry = CollectorRegistry()
    for metric in (grammar_metrics.COMPILE_SECONDS, grammar_metrics.COMPILE_REQUESTS, grammar_metrics.STEP_SECONDS,
                   grammar_metrics.ROWS_REJECTED, grammar_metrics.STEP_PHASE_SECONDS):
        registry.register(metric)
    grammar_metrics.COMPILE_REQUESTS.labels("compiled", "auto").inc()
    text = generate_latest(registry)
    assert promtool_problems(promtool, text) == ""
    assert b"_created" not in text


def test_promtool_refuses_what_the_metrics_used_to_export(promtool):
    """The check can fail: a gauge named *_total, as structgen_kv_pages_total was."""
    bad = b"# HELP structgen_kv_pages_total Allocatable pages\n# TYPE structgen_kv_pages_total gauge\n" \
          b"structgen_kv_pages_total 3\n"
    assert "should not have \"_total\" suffix" in promtool_problems(promtool, bad)


def test_no_created_series_and_every_family_names_the_model(exposition):
    families = list(text_string_to_metric_families(exposition.decode()))
    assert not [f.name for f in families if f.name.endswith("_created")]
    samples = [s for f in families for s in f.samples]
    assert samples and all(s.labels.get("model_name") == "tiny-model" for s in samples)


def test_model_info_kv_usage_and_no_rpc_errors_family(exposition):
    samples = {s.name: s for f in text_string_to_metric_families(exposition.decode()) for s in f.samples}
    info = samples["structgen_model_info"]
    assert info.value == 1 and info.labels["version"] == "1.2.3" and info.labels["device"] == "cpu"
    assert samples["structgen_kv_cache_usage_ratio"].value == 3 / 8
    assert samples["structgen_kv_pages_capacity"].value == 8
    assert not any(name.startswith("structgen_rpc_errors") for name in samples)


def test_scraped_families_are_the_documented_ones(exposition):
    documented = {f.name for f in GenerationMetrics(CollectorRegistry()).families()}
    scraped = set()
    for family in text_string_to_metric_families(exposition.decode()):
        scraped.add(family.name + ("_total" if family.type == "counter" else "")
                    + ("_info" if family.type == "info" else ""))
    assert scraped == documented
