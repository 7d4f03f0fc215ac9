"""End-to-end throughput of the in-process Engine on CPU, with a real grammar_service process.

Workloads (each a batch of `--batch` requests submitted at once, `--max-new-tokens` each):
- `free`: unconstrained greedy decoding;
- `constrained`: every request under a JSON Schema (grammar steps through the channel);
- `speculative`: free, with n-gram drafts (`--drafts` per step);
- `mixed`: half constrained, half free.
Reported: generated tokens/s, engine steps, ms/step, draft acceptance, time waiting for masks.

    .venv/bin/python benchmarks/engine_cpu.py --machine ci-2core
writes benchmarks/results/engine_cpu-<machine>.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._harness import code_commit, command_line, write_result  # noqa: E402
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams
from grammar_contract.spec import GrammarSpec
from tests.integration.test_engine_support import make_engine, run_all, start_grammar_service  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "tags"]}


def requests(engine, tag: str, batch: int, max_new: int, constrained, drafts: int):
    out = []
    for i in range(batch):
        grammar = GrammarSpec("json_schema", json.dumps(SCHEMA)) if constrained(i) else None
        prompt = tuple(engine.tokenizer.encode(f"Request {i}: describe item {i} as JSON."))
        out.append(GenerationRequest(f"{tag}-{i}", prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=grammar is None),
                                     grammar=grammar, speculative=SpeculativeParams(drafts)))
    return out


def measure(engine, tag, batch, max_new, constrained, drafts) -> dict:
    before, start = engine.stats(), time.perf_counter()
    results = run_all(engine, requests(engine, tag, batch, max_new, constrained, drafts))
    elapsed, after = time.perf_counter() - start, engine.stats()
    tokens = sum(len(r.token_ids) for r in results)
    steps = after.steps - before.steps
    proposed = after.draft_proposed - before.draft_proposed
    return {"workload": tag, "batch": batch, "tokens": tokens, "seconds": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 1), "steps": steps,
            "ms_per_step": round(1000 * elapsed / max(steps, 1), 2),
            "draft_acceptance": round((after.draft_accepted - before.draft_accepted) / proposed, 3) if proposed else None,
            "grammar_wait_ms_per_step": round(1000 * (after.grammar_wait_s_total - before.grammar_wait_s_total)
                                              / max(steps, 1), 3),
            "errors": sum(r.error is not None for r in results)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", default=platform.node())
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--drafts", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        service = start_grammar_service(pathlib.Path(folder))
        engine = make_engine(service.address, model=args.model, max_batch=args.batch, max_draft_tokens=args.drafts)
        try:
            run_all(engine, requests(engine, "warmup", 2, 8, lambda i: i == 0, 0))
            rows = [measure(engine, "free", args.batch, args.max_new_tokens, lambda i: False, 0),
                    measure(engine, "constrained", args.batch, args.max_new_tokens, lambda i: True, 0),
                    measure(engine, "speculative", args.batch, args.max_new_tokens, lambda i: False, args.drafts),
                    measure(engine, "mixed", args.batch, args.max_new_tokens, lambda i: i % 2 == 0, 0)]
        finally:
            engine.stop()
            service.stop()
    print(f"{'workload':<12} {'tok/s':>8} {'steps':>6} {'ms/step':>8} {'accept':>7} {'mask wait ms':>12}")
    for row in rows:
        accept = "-" if row["draft_acceptance"] is None else f"{row['draft_acceptance']:.2f}"
        print(f"{row['workload']:<12} {row['tokens_per_s']:>8} {row['steps']:>6} {row['ms_per_step']:>8} "
              f"{accept:>7} {row['grammar_wait_ms_per_step']:>12}")
    out = write_result(ROOT / "benchmarks" / "results" / f"engine_cpu-{args.machine}.json",
                       {"machine": args.machine, "model": args.model, "args": vars(args), "results": rows,
                        "command": command_line(f".venv/bin/python {sys.argv[0]}"), "code_commit": code_commit()},
                       indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
