#!/usr/bin/env python3
"""Validate rendered Kubernetes manifests strictly; exit non-zero on any failure.

Built-in kinds go through `kubernetes-validate --strict` (unknown fields are errors) for
each Kubernetes version given. kubernetes-validate only knows built-in kinds and merely
warns about others, so a warning fails here too, except for the custom resources listed in
CUSTOM_SCHEMAS: those are checked against a strict schema of their own (the
prometheus-operator ServiceMonitor fields this chart may render).

Usage: validate_manifests.py [-k 1.27.0 -k 1.37.0] FILE.yaml [FILE.yaml ...]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import yaml

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
# (apiVersion, kind) -> strict JSON schema file under tools/schemas/.
CUSTOM_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
}
DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$")


def load_documents(path: Path) -> list[dict]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def seconds(duration: str) -> float:
    h, m, s, ms = (int(g or 0) for g in DURATION.match(duration).groups())
    return h * 3600 + m * 60 + s + ms / 1000


def check_custom(doc: dict, schema_file: str) -> list[str]:
    schema = json.loads((SCHEMA_DIR / schema_file).read_text())
    name = f"{doc['kind']}/{doc.get('metadata', {}).get('name')}"
    errors = [f"{name}: {'.'.join(map(str, e.path)) or '<root>'}: {e.message}"
              for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]
    if not errors and doc["kind"] == "ServiceMonitor":
        # Prometheus refuses a scrape timeout longer than the scrape interval.
        for ep in doc["spec"]["endpoints"]:
            if "interval" in ep and "scrapeTimeout" in ep and seconds(ep["scrapeTimeout"]) > seconds(ep["interval"]):
                errors.append(f"{name}: endpoint {ep.get('port')}: scrapeTimeout {ep['scrapeTimeout']} > interval {ep['interval']}")
    return errors


def kubernetes_validate() -> str:
    """The kubernetes-validate beside this interpreter (the venv), else the one on PATH."""
    beside = Path(sys.executable).parent / "kubernetes-validate"
    found = str(beside) if beside.exists() else shutil.which("kubernetes-validate")
    if not found:
        sys.exit("validate_manifests.py: kubernetes-validate not installed (pip install -e '.[dev]')")
    return found


def check_builtin(docs: list[dict], label: str, versions: list[str]) -> list[str]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="builtin-", delete=False) as f:
        yaml.safe_dump_all(docs, f, sort_keys=False)
    try:
        cmd = [kubernetes_validate(), "--strict", "--quiet"]
        for version in versions:
            cmd += ["-k", version]
        proc = subprocess.run(cmd + [f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    out = (proc.stdout + proc.stderr).replace(f.name, label).strip()
    problems = [line for line in out.splitlines() if line.startswith(("ERROR", "WARN", "FATAL"))]
    if proc.returncode != 0 and not problems:
        problems = [out or f"kubernetes-validate exited {proc.returncode}"]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", "--kubernetes-version", action="append", dest="versions")
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    versions = args.versions or ["1.37.0"]

    failures: list[str] = []
    for path in args.files:
        docs = load_documents(path)
        builtin = [d for d in docs if (d.get("apiVersion"), d.get("kind")) not in CUSTOM_SCHEMAS]
        custom = [d for d in docs if (d.get("apiVersion"), d.get("kind")) in CUSTOM_SCHEMAS]
        if not docs:
            failures.append(f"{path}: no manifests")
        if builtin:
            failures += [f"{path}: {p}" for p in check_builtin(builtin, str(path), versions)]
        for doc in custom:
            failures += [f"{path}: {e}" for e in check_custom(doc, CUSTOM_SCHEMAS[(doc["apiVersion"], doc["kind"])])]
        kinds = ", ".join(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
        print(f"{path}: {len(builtin)} built-in (kubernetes-validate --strict, k8s {' '.join(versions)}), "
              f"{len(custom)} custom (tools/schemas): {kinds}")

    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
