"""Every result file and doc that the docs, the READMEs and the code's comments cite exists.

A figure in a comment or a doc points to the file in benchmarks/results/ that holds it; when
a result is superseded and deleted, its citations must move to the latest one. The index
benchmarks/results/README.md names every file there (and only those).
"""
from __future__ import annotations

import glob
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results"
CODE_ROOTS = ("generation_service", "grammar_service", "step_channel", "structgen", "benchmarks", "tools")
SKIP_PARTS = {".venv", "node_modules", "v1", "__pycache__"}

_NAME = r"[A-Za-z0-9_.*{},-]*"
_EXT = r"\.(?:json|log|txt)"
# benchmarks/results/<file>, or a bare result name (<benchmark>-h200..., <benchmark>-ci-2core...)
RESULT_REF = re.compile(
    rf"(?:benchmarks/results/({_NAME}{_EXT}|README\.md))|(?<![\w./-])([a-z][a-z_-]*-(?:h200|ci-2core){_NAME}{_EXT})\b")
DOC_REF = re.compile(r"\bdocs/([A-Za-z0-9_/-]+\.md)\b")
# an output path in a command line (what a run writes), not a citation
OUTPUT_PREFIX = re.compile(r"(?:\$OUT/|--out[ =]|/root/out/)$")


def _citing_files() -> list[pathlib.Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for top in CODE_ROOTS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".py", ".md") and not SKIP_PARTS & set(path.relative_to(ROOT).parts):
                files.append(path)
    return files


def _expand_braces(name: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [n for alt in m.group(1).split(",")
            for n in _expand_braces(name[:m.start()] + alt + name[m.end():])]


def _missing(text: str) -> list[str]:
    missing = []
    for m in RESULT_REF.finditer(text):
        if OUTPUT_PREFIX.search(text[max(0, m.start() - 12):m.start()]):
            continue
        for name in _expand_braces((m.group(1) or m.group(2)).rstrip(".,")):
            if not glob.glob(str(RESULTS / name)):
                missing.append(f"benchmarks/results/{name}")
    for m in DOC_REF.finditer(text):
        if not (ROOT / "docs" / m.group(1)).is_file():
            missing.append(f"docs/{m.group(1)}")
    return missing


@pytest.mark.parametrize("path", _citing_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_results_and_docs_exist(path):
    missing = _missing(path.read_text(encoding="utf-8"))
    assert not missing, f"{path.relative_to(ROOT)} cites files that do not exist: {sorted(set(missing))}"


def test_the_checker_sees_a_missing_result_and_skips_output_paths():
    assert _missing("see benchmarks/results/decode-h200-v99.json") == ["benchmarks/results/decode-h200-v99.json"]
    assert _missing("(profile-h200-nothing.json)") == ["benchmarks/results/profile-h200-nothing.json"]
    assert _missing("docs/no-such-doc.md") == ["docs/no-such-doc.md"]
    assert _missing("python decode.py --out $OUT/decode-h200-new.json") == []


def test_the_results_index_names_every_file_there():
    index = (RESULTS / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([^`/ ]+\.(?:json|log|txt))`", index))
    present = {p.name for p in RESULTS.iterdir() if p.name != "README.md"}
    assert present - named == set(), "add these to benchmarks/results/README.md"
    assert named - present == set(), "the index names files that are not there"
