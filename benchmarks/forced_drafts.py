"""Grammar-forced drafts (issue 26 point 1): JSON-Schema requests whose documents are mostly fixed
structure, decoded greedily without speculation, with the grammar proposer and with the n-gram
proposer, in the in-process Engine beside a real grammar_service process.

Each variant runs the same requests (`--repeats` rounds of `--batch` requests submitted at once,
each round after a warm-up round); reported per variant: generated tokens/s, engine steps, draft
acceptance (accepted / proposed), tokens per step, and whether every output equals the
no-speculation one (greedy: it must). A trained model is needed for acceptance to mean anything:
the default model on CPU; on the GPU any real checkpoint (random weights spell forced text
their own way).

    .venv/bin/python benchmarks/forced_drafts.py --machine ci-2core
    .venv/bin/python benchmarks/forced_drafts.py --device cuda --batch 1 --machine h200 --out $OUT/forced_drafts-h200.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._harness import code_commit, command_line, default_machine, write_result  # noqa: E402
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams  # noqa: E402
from grammar_contract.spec import GrammarSpec  # noqa: E402
from tests.integration.test_engine_support import make_engine, run_all, start_grammar_service  # noqa: E402

# Long keys in a fixed order, enums, consts, booleans: the grammar forces most of each document.
SCHEMAS = {
    "shipment": {"type": "object", "properties": {
        "shipping_status_description": {"enum": ["delivered_to_the_front_door", "returned_to_the_warehouse"]},
        "schema_version": {"const": "structgen.forced-drafts.v1"},
        "is_priority_shipment": {"type": "boolean"},
        "carrier_service_level": {"enum": ["overnight_express_delivery", "standard_ground_shipping"]}},
        "required": ["shipping_status_description", "schema_version", "is_priority_shipment",
                     "carrier_service_level"], "additionalProperties": False},
    "feature_flags": {"type": "object", "properties": {
        name: {"type": "boolean"} for name in ("enable_experimental_dashboard_widgets",
                                                 "enable_two_factor_authentication_prompt",
                                                 "enable_dark_mode_for_all_users")},
        "required": ["enable_experimental_dashboard_widgets", "enable_two_factor_authentication_prompt",
                     "enable_dark_mode_for_all_users"], "additionalProperties": False},
}
PROMPTS = {"shipment": "Write the shipment record as JSON:", "feature_flags": "The feature flags as JSON:"}
VARIANTS = ("none", "grammar", "ngram")


def requests(engine, tag: str, batch: int, variant: str, drafts: int, max_new: int) -> list[GenerationRequest]:
    out = []
    for i in range(batch):
        name = list(SCHEMAS)[i % len(SCHEMAS)]
        grammar = GrammarSpec("json_schema", json.dumps(SCHEMAS[name]), any_whitespace=False)
        speculative = SpeculativeParams(0 if variant == "none" else drafts, "ngram" if variant == "none" else variant)
        out.append(GenerationRequest(f"{tag}-{i}", tuple(engine.tokenizer.encode(PROMPTS[name])),
                                     SamplingParams(max_new_tokens=max_new), grammar=grammar, speculative=speculative))
    return out


def measure(engine, variant: str, args) -> tuple[dict, list[list[int]]]:
    run_all(engine, requests(engine, f"warm-{variant}", args.batch, variant, args.drafts, args.max_new_tokens))
    before, seconds, outputs = engine.stats(), 0.0, []
    for round_no in range(args.repeats):
        start = time.perf_counter()
        results = run_all(engine, requests(engine, f"{variant}-{round_no}", args.batch, variant, args.drafts,
                                           args.max_new_tokens))
        seconds += time.perf_counter() - start
        outputs += [r.token_ids for r in results]
        if any(r.error is not None for r in results):
            raise RuntimeError(f"{variant}: {[str(r.error) for r in results if r.error is not None]}")
    after = engine.stats()
    tokens, steps = sum(map(len, outputs)), after.steps - before.steps
    proposed = after.draft_proposed - before.draft_proposed
    accepted = after.draft_accepted - before.draft_accepted
    return {"variant": variant, "batch": args.batch, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1), "steps": steps,
            "tokens_per_step": round(tokens / max(steps, 1), 2), "drafts_proposed": proposed,
            "drafts_accepted": accepted, "acceptance": round(accepted / proposed, 3) if proposed else None,
            "grammar_wait_ms_per_step": round(1000 * (after.grammar_wait_s_total - before.grammar_wait_s_total)
                                              / max(steps, 1), 2)}, outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", default=default_machine())
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        service = start_grammar_service(pathlib.Path(folder))
        engine = make_engine(service.address, model=args.model, device=args.device, max_batch=max(args.batch, 2),
                             max_draft_tokens=args.drafts)
        try:
            measured = {variant: measure(engine, variant, args) for variant in VARIANTS}
        finally:
            engine.stop()
            service.stop()
    baseline_outputs, rows = measured["none"][1], []
    for variant, (row, outputs) in measured.items():
        row["same_output"] = outputs == baseline_outputs
        row["speedup"] = round(row["tokens_per_s"] / measured["none"][0]["tokens_per_s"], 2)
        rows.append(row)
    print(f"{'variant':<8} {'tok/s':>8} {'x':>5} {'steps':>6} {'tok/step':>8} {'accept':>7} {'mask wait ms':>12} same")
    for row in rows:
        accept = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        print(f"{row['variant']:<8} {row['tokens_per_s']:>8} {row['speedup']:>5} {row['steps']:>6} "
              f"{row['tokens_per_step']:>8} {accept:>7} {row['grammar_wait_ms_per_step']:>12} {row['same_output']}")
    out = write_result(args.out or ROOT / "benchmarks" / "results" / f"forced_drafts-{args.machine}.json",
                       {"machine": args.machine, "model": args.model, "args": vars(args), "results": rows,
                        "command": command_line(f".venv/bin/python {sys.argv[0]}"), "code_commit": code_commit()},
                       indent=2)
    print(f"wrote {out}")
    return 0 if all(row["same_output"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
