"""What docs/operations.md's metric table is written from: each process's families, named as
a scrape shows them (tools/gen_docs_tables.py; the observability test compares a real scrape)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class FamilyDoc:
    name: str                  # as scraped: a counter's with _total, a histogram's without _bucket
    kind: str                  # counter, gauge, histogram, info
    labels: tuple[str, ...]
    help: str


def describe_metrics(metrics: Iterable) -> list[FamilyDoc]:
    """FamilyDocs of prometheus_client Counter / Gauge / Histogram objects."""
    # NOTE: prometheus_client has no public accessor of a metric's label names.
    return [FamilyDoc(m._name + ("_total" if m._type == "counter" else ""), m._type,
                      tuple(m._labelnames), m._documentation) for m in metrics]
