"""What compiling each new grammar first in a worker process costs (grammar_service/sandbox.py).

For each schema of the real-world corpus (benchmarks/corpus.py) and a few other kinds, one
`GrammarService` compiles in-process only (`isolate_compiles=False`) and one through its compile
workers; each spec is compiled cold (wall time of the Compile future) and then once more (a
cache hit). Both services are warmed with one compile first, so backend construction is not
counted. Writes benchmarks/results/compile_isolation-<label>.json.

    .venv/bin/python -m benchmarks.compile_isolation --label ci-2core [--limit 12]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._harness import code_commit, command_line, write_result  # noqa: E402


def _specs(limit: int):
    from benchmarks.corpus import load_corpus
    from grammar_contract.spec import GrammarSpec

    schemas = sorted(load_corpus(), key=lambda s: s.size_bytes)[:limit]
    specs = [(s.name, GrammarSpec(kind="json_schema", text=s.text, backend="xgrammar")) for s in schemas]
    specs += [(f"{s.name}@auto", GrammarSpec(kind="json_schema", text=s.text)) for s in schemas[:4]]
    specs += [("regex-email", GrammarSpec(kind="regex", text=r"[a-z0-9._]+@[a-z0-9]+\.[a-z]{2,4}")),
              ("lark-expr", GrammarSpec(kind="lark", text='start: e\ne: e "+" t | t\nt: /[0-9]+/')),
              ("choice-100", GrammarSpec(kind="choice", choices=tuple(f"label-{i}" for i in range(100))))]
    return specs


def _timed(service, spec) -> tuple[float, str]:
    started = time.perf_counter()
    try:
        service.compile(spec).result(120)
        outcome = "ok"
    except Exception as exc:  # noqa: BLE001 -- a spec that fails fails the same way in both
        outcome = f"error: {getattr(exc, 'status', type(exc).__name__)}"
    return (time.perf_counter() - started) * 1e3, outcome


def _service(tokenizer_dir: str, isolate: bool):
    from grammar_contract.spec import GrammarSpec
    from grammar_service.config import GrammarServiceConfig
    from grammar_service.service import GrammarService

    service = GrammarService(GrammarServiceConfig(tokenizer_dir=tokenizer_dir, vocab_size=32768,
                                                  isolate_compiles=isolate, compile_timeout_s=60))
    for backend in ("xgrammar", "llguidance"):  # warm both backends (and the workers, when isolated)
        deadline = time.monotonic() + 120
        while True:
            _, outcome = _timed(service, GrammarSpec(kind="regex", text=f"warm-{backend}-{time.time_ns()}",
                                                     backend=backend))
            if outcome == "ok" or time.monotonic() > deadline:
                break
    return service


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="local")
    parser.add_argument("--limit", type=int, default=12, help="corpus schemas, smallest first")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from real_tokenizers import tokenizer_dir

    tok = str(tokenizer_dir("mistral_32k"))
    specs = _specs(args.limit)
    rows = {name: {} for name, _ in specs}
    for mode, isolate in (("in_process", False), ("isolated", True)):
        service = _service(tok, isolate)
        for name, spec in specs:
            cold_ms, outcome = _timed(service, spec)
            hit_ms, _ = _timed(service, spec)
            rows[name][mode] = {"cold_ms": round(cold_ms, 2), "cache_hit_ms": round(hit_ms, 3), "outcome": outcome}
            print(f"{mode:10s} {name:40s} cold {cold_ms:9.1f} ms  hit {hit_ms:7.3f} ms  {outcome}", flush=True)
        service.close()
    ratios = [r["isolated"]["cold_ms"] / r["in_process"]["cold_ms"] for r in rows.values()
              if r["in_process"]["outcome"] == "ok" and r["in_process"]["cold_ms"] > 0]
    extra = [r["isolated"]["cold_ms"] - r["in_process"]["cold_ms"] for r in rows.values()
             if r["in_process"]["outcome"] == "ok"]
    hits = {mode: statistics.median(r[mode]["cache_hit_ms"] for r in rows.values()) for mode in ("in_process", "isolated")}
    summary = {"cold_ratio_median": round(statistics.median(ratios), 2), "cold_ratio_max": round(max(ratios), 2),
               "cold_extra_ms_median": round(statistics.median(extra), 1),
               "cache_hit_ms_median": {k: round(v, 3) for k, v in hits.items()}}
    print(json.dumps(summary))
    out = write_result(ROOT / "benchmarks" / "results" / f"compile_isolation-{args.label}.json", {
        "benchmark": "compile_isolation",
        "command": command_line("python -m benchmarks.compile_isolation", argv or None),
        "commit": code_commit(), "machine": {"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version()},
        "tokenizer": "mistral_32k", "summary": summary, "specs": rows})
    print(f"wrote {out}")
    os._exit(0)  # skip finalizing xgrammar objects (seconds)


if __name__ == "__main__":
    sys.exit(main())
