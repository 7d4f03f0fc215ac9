#!/usr/bin/env python3
"""Writes the generated tables of docs/operations.md: the settings of both processes (from
generation_service/settings.py and grammar_service/settings.py) and the Prometheus families
(from the metrics objects themselves). Each table sits between `<!-- BEGIN name -->` and
`<!-- END name -->`; tests/unit/ops/test_docs_tables.py fails when one is stale.

Usage: .venv/bin/python tools/gen_docs_tables.py
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DOC = ROOT / "docs" / "operations.md"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def settings_table(table) -> str:
    from structgen.settings import format_value
    rows = ["| flag | variable | default | chart value | meaning |", "|---|---|---|---|---|"]
    for b in table:
        s = b.setting
        default = s.none_word if b.default is None and s.none_word else b.default
        flags = ", ".join([f"`--{s.flag}`", *(f"`--{old}` (deprecated)" for old in s.deprecated_flags)])
        env = ", ".join([f"`{b.env}`", *(f"`{old}` (deprecated)" for old in s.deprecated_env)])
        chart = f"`config.{b.chart_group}.{s.chart_key}`" if b.chart_group else "derived"
        shown = "" if default is None or default == "" else f"`{format_value(default)}`"
        rows.append(f"| {flags} | {env} | {shown} | {chart} | {_cell(s.help)} |")
    return "\n".join(rows)


def metrics_table() -> str:
    from prometheus_client import CollectorRegistry

    import grammar_service.metrics as grammar_metrics
    from generation_service.metrics import GenerationMetrics
    rows = ["| family | type | labels | process | meaning |", "|---|---|---|---|---|"]
    for process, families in (("generation", GenerationMetrics(CollectorRegistry()).families()),
                              ("grammar", grammar_metrics.families())):
        for f in families:
            labels = ", ".join(f"`{label}`" for label in f.labels)
            rows.append(f"| `{f.name}` | {f.kind} | {labels} | {process} | {_cell(f.help)} |")
    return "\n".join(rows)


def tables() -> dict[str, str]:
    from generation_service.settings import SERVE_SETTINGS
    from grammar_service.settings import GRAMMAR_SETTINGS
    return {"serve-settings": settings_table(SERVE_SETTINGS),
            "grammar-settings": settings_table(GRAMMAR_SETTINGS),
            "metrics": metrics_table()}


def render(text: str) -> str:
    for name, table in tables().items():
        pattern = re.compile(rf"(<!-- BEGIN {name} [^>]*-->\n).*?(<!-- END {name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{DOC}: no <!-- BEGIN {name} ... --> / <!-- END {name} --> markers")
        text = pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), text)
    return text


if __name__ == "__main__":
    DOC.write_text(render(DOC.read_text()))
    print(f"wrote the generated tables of {DOC}")
