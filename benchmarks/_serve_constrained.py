"""serve.py's `--plan constrained`: constrained traffic as users send it, each workload beside
free requests of the same prompts and output lengths in one run (constrained / free-matched):
- per-request schemas drawn from the project's real-world corpus (`corpus_schemas`, written here
  from benchmarks/corpus.py and carried to the GPU machine as a file): first cold (each schema's
  first request compiles it: the compile times and TTFT of those requests), then, every schema
  compiled, warm, beside the single-schema workload of the same concurrency;
- tool calls (tool_choice auto and required) and a reasoning span followed by a JSON Schema.

    python -m benchmarks._serve_constrained .bench/corpus-schemas.json   # the corpus file serve.py reads
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from benchmarks._harness import log
from benchmarks._serve_groups import TOOLS
from benchmarks._serve_load import Workload
from benchmarks._serve_summary import fmt_ratio

ROOT = pathlib.Path(__file__).resolve().parents[1]
# schemas that `auto` compiled within this on the CI machine (schema_truth's record of each), no larger
MAX_COMPILE_MS, MAX_SCHEMA_BYTES, NUM_CORPUS_SCHEMAS = 500, 64 << 10, 128


@dataclass(frozen=True)
class ConstrainedPlan:
    prompt_len: int
    new_tokens: int
    concurrency: int
    reasoning_budget: int
    corpus_max_tokens: int  # room for a real-world schema's shortest document (a smaller budget is refused)


CONSTRAINED_PLAN = ConstrainedPlan(512, 128, 64, 32, 512)


def corpus_schemas(truth: pathlib.Path = ROOT / "benchmarks" / "results" / "schema_truth-dev-2core.json") -> list[str]:
    """NUM_CORPUS_SCHEMAS schemas of the wide corpus that `auto` compiled fast, by name."""
    from benchmarks.corpus import load_wide_corpus
    record = json.loads(truth.read_text())["schemas"]

    def fast(name: str) -> bool:
        auto = record.get(name, {}).get("auto", {})
        return "compile_error" not in auto and not auto.get("timeout") and (auto.get("compile_ms") or 1e9) < MAX_COMPILE_MS
    chosen = sorted((s for s in load_wide_corpus() if s.size_bytes <= MAX_SCHEMA_BYTES and fast(s.name)),
                    key=lambda s: s.name)
    return [s.text for s in chosen[:NUM_CORPUS_SCHEMAS]]


def _pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def constrained_workloads(plan: ConstrainedPlan, prompts: list[list[int]], texts: list[str], schema: str,
                          corpus: list[str], common: dict, run, lengths: dict[str, list[int]], server,
                          single: dict | None) -> dict[str, dict]:
    """Each kind's constrained workload, then free requests at its output lengths; the ratios.
    `run(workload, prompts)` -> summary; `single`: the single-schema constrained workload of the
    same concurrency (the corpus' warm figure is read against it)."""
    c, tag = plan.concurrency, f"{plan.prompt_len}/{plan.new_tokens} c={plan.concurrency}"

    def pair(name: str, prompt_set: list, max_tokens: int = plan.new_tokens, **kw) -> dict:
        workload = Workload(f"{name} {tag}", plan.prompt_len, max_tokens, concurrency=c, ignore_eos=False,
                            **kw, **common)
        constrained = run(workload, prompt_set)
        matched = run(dataclasses.replace(workload, name=f"free-matched ({workload.name})", json_schema=None,
                                          json_schemas=(), tool_choice="none", reasoning_budget=None, ignore_eos=True,
                                          max_tokens_list=lengths[workload.name] or [workload.max_tokens]), prompt_set)
        ratio = (constrained["output_tokens_per_s"] / matched["output_tokens_per_s"]
                 if matched["output_tokens_per_s"] else None)
        matched["constrained_over_matched_free"] = ratio
        log(f"  {name}: constrained / free at matched lengths {fmt_ratio(ratio)}")
        return {"constrained_over_matched_free": ratio, "output_tokens_per_s": constrained["output_tokens_per_s"],
                "itl_p50_ms": (constrained["itl_p50_ms"], matched["itl_p50_ms"]),
                "validation": constrained["validation"], "errors": constrained["errors"]}

    out = {}
    if corpus:
        cold = run(Workload(f"corpus-cold {tag}", plan.prompt_len, plan.corpus_max_tokens, concurrency=c,
                            ignore_eos=False, json_schemas=tuple(corpus), **common), prompts)
        compiled = [ms for ms in cold.get("compile_ms", []) if ms is not None]
        step_ms = cold["itl_p50_ms"] or 0.0
        cold_ttft = cold.get("cold_ttft_s", [])
        log(f"  corpus: compiling the rest of {len(corpus)} schemas: {server.compile_all(corpus):.1f} s")
        warm = pair("corpus-warm", prompts, plan.corpus_max_tokens, json_schemas=tuple(corpus))
        warm_tok_s = warm["output_tokens_per_s"]
        out["corpus"] = warm | {
            "num_schemas": len(corpus), "cold_compiles": len(compiled),
            "cold_compile_ms_p50": _pct(compiled, 0.5), "cold_compile_ms_p99": _pct(compiled, 0.99),
            "cold_ttft_p99_s": _pct(cold_ttft, 0.99),
            "cold_ttft_p99_over_compile_p99_plus_two_steps": (
                _pct(cold_ttft, 0.99) * 1e3 / (_pct(compiled, 0.99) + 2 * step_ms) if compiled and cold_ttft else None),
            "warm_over_single_schema": (warm_tok_s / single["output_tokens_per_s"]
                                        if single and single["output_tokens_per_s"] else None)}
        log(f"  corpus: warm / single schema {fmt_ratio(out['corpus']['warm_over_single_schema'])}, cold compile p99 "
            f"{out['corpus']['cold_compile_ms_p99']} ms, cold TTFT p99 {out['corpus']['cold_ttft_p99_s']} s")
    out["tools-auto"] = pair("tools-auto", texts, tools=TOOLS, tool_choice="auto")
    out["tools-required"] = pair("tools-required", texts, tools=TOOLS, tool_choice="required")
    out[f"reasoning-{plan.reasoning_budget}+schema"] = pair(
        f"reasoning-{plan.reasoning_budget}+schema", prompts, json_schema=schema, reasoning_budget=plan.reasoning_budget)
    return out


def compile_all(stub, pb, schemas: list[str], threads: int = 16) -> None:
    """One one-token request per schema (compiles the ones not cached yet), `threads` at a time:
    the server compiles a grammar before it refuses a budget below its shortest document."""
    import grpc

    def one(schema: str) -> None:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), json_schema=schema,
                                     stop=pb.StopConditions(max_tokens=1))
        request.constraint_options.compact = True
        for attempt in itertools.count():
            try:
                for _ in stub.Generate(request, timeout=600):
                    pass
                return
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and attempt < 100:
                    time.sleep(0.1)  # the compile queue is full: as its message says, retry later
                    continue
                if "shortest output" not in (error.details() or ""):
                    raise
                return
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, schemas))


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    schemas = corpus_schemas()
    out.write_text(json.dumps(schemas))
    print(f"{len(schemas)} schemas, {sum(map(len, schemas))} bytes -> {out}; median "
          f"{statistics.median(map(len, schemas))} bytes")
