#!/usr/bin/env python3
"""Validate rendered Kubernetes manifests strictly; exit non-zero on any failure.

Built-in kinds go through `kubernetes-validate --strict` (unknown fields are errors) for
each Kubernetes version given; its CLI entry point runs in this interpreter, once for all
files (importing jsonschema costs seconds here). kubernetes-validate only knows built-in kinds and merely
warns about others, so a warning fails here too, except for the custom resources listed in
CUSTOM_SCHEMAS: those are checked against a strict schema of their own (the
prometheus-operator ServiceMonitor fields this chart may render).

Usage: validate_manifests.py [-k 1.27.0 -k 1.37.0] FILE.yaml [FILE.yaml ...]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
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


def check_builtin(docs_by_label: dict[str, list[dict]], versions: list[str]) -> list[str]:
    """`kubernetes-validate --strict` over all files in one go, run in this interpreter:
    the CLI's own main(), so that jsonschema and the schemas load once, not per file."""
    try:
        from kubernetes_validate.__main__ import main as kubernetes_validate_main
    except ImportError:
        sys.exit("validate_manifests.py: kubernetes-validate not installed (pip install -e '.[dev]')")
    tmp = tempfile.mkdtemp(prefix="validate-manifests-")
    names = {}
    out = io.StringIO()
    argv = sys.argv
    try:
        for n, (label, docs) in enumerate(docs_by_label.items()):
            names[os.path.join(tmp, f"{n}.yaml")] = label
            with open(os.path.join(tmp, f"{n}.yaml"), "w") as f:
                yaml.safe_dump_all(docs, f, sort_keys=False)
        sys.argv = ["kubernetes-validate", "--strict", "--quiet"]
        for version in versions:
            sys.argv += ["-k", version]
        sys.argv += list(names)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = kubernetes_validate_main()
            except SystemExit as exc:  # it exits on unreadable YAML
                rc = exc.code if isinstance(exc.code, int) else 2
                print(exc.code)
    finally:
        sys.argv = argv
        shutil.rmtree(tmp)
    text = out.getvalue().strip()
    for name, label in names.items():
        text = text.replace(name, label)
    problems = [line for line in text.splitlines() if line.startswith(("ERROR", "WARN", "FATAL"))]
    if rc != 0 and not problems:
        problems = [text or f"kubernetes-validate returned {rc}"]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", "--kubernetes-version", action="append", dest="versions")
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    versions = args.versions or ["1.37.0"]

    failures: list[str] = []
    builtin_by_file: dict[str, list[dict]] = {}
    for path in args.files:
        docs = load_documents(path)
        if not docs:
            failures.append(f"{path}: no manifests")
        builtin = [d for d in docs if (d.get("apiVersion"), d.get("kind")) not in CUSTOM_SCHEMAS]
        custom = [d for d in docs if (d.get("apiVersion"), d.get("kind")) in CUSTOM_SCHEMAS]
        if builtin:
            builtin_by_file[str(path)] = builtin
        for doc in custom:
            failures += [f"{path}: {e}" for e in check_custom(doc, CUSTOM_SCHEMAS[(doc["apiVersion"], doc["kind"])])]
        kinds = ", ".join(f"{d.get('kind')}/{d.get('metadata', {}).get('name')}" for d in docs)
        print(f"{path}: {len(builtin)} built-in (kubernetes-validate --strict, k8s {' '.join(versions)}), "
              f"{len(custom)} custom (tools/schemas): {kinds}")
    if builtin_by_file:
        failures += check_builtin(builtin_by_file, versions)

    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
