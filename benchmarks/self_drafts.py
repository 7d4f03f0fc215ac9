"""Self-speculative drafts (issue 26 point 2): the model drafting with its calibrated draft
layers against no speculation and n-gram drafts, greedy, in the in-process Engine.

Workloads: chat answers (the chat template), code completion, and a JSON document continued as
free text. Variants: no speculation, "self" with the model's cached calibration (`structgen
calibrate-self-spec --model ...` first), n-gram drafts, and "self" skipping the calibration
ranking's first N layers (`--skip-counts`: what skipping more would give). Each runs the same
requests (`--repeats` rounds over the workload's prompts, `--batch` at a time, rounds of the
variants interleaved, after a warm-up request each); reported per workload and variant:
tokens/s, engine steps, draft acceptance (accepted / proposed), tokens per step, and how many
outputs equal the no-speculation ones (greedy in float32: all must; in bf16 a near tie may tip). Random weights accept nothing, so
only a trained model's figures mean anything (the default model on CPU).

    .venv/bin/python benchmarks/self_drafts.py --machine ci-2core
    python benchmarks/self_drafts.py --device cuda --machine h200   (the CUDA-graph runner; --runner eager)
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._harness import code_commit, command_line, default_machine, write_result  # noqa: E402
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams  # noqa: E402
from tests.integration.test_engine_support import make_engine, run_all  # noqa: E402

CHAT = ["Explain in a few sentences why the sky is blue.", "Give three tips for writing clear emails.",
        "What is the difference between a list and a tuple in Python?"]
WORKLOADS = {
    "chat": lambda tokenizer: [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT],
    "code": lambda tokenizer: [tokenizer.encode(p) for p in (
        "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    \"\"\"Merge two sorted lists.\"\"\"\n",
        "class Stack:\n    \"\"\"A last-in first-out stack.\"\"\"\n\n    def __init__(self):\n",
        "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return a dict.\"\"\"\n")],
    "json": lambda tokenizer: [tokenizer.encode(p) for p in (
        'A list of three users as JSON:\n[{"id": 1, "name": "Alice", "email": "alice@example.com"}, ',
        'The weather report as JSON: {"city": "Paris", "temperature_celsius": 21, "conditions": ',
        'Inventory records:\n{"sku": "A-100", "quantity": 12, "warehouse": "north"}\n{"sku": "A-101", ')],
}


def requests(prompts: list[list[int]], tag: str, variant: str, drafts: int, max_new: int) -> list[GenerationRequest]:
    proposer = "ngram" if variant in ("none", "ngram") else "self"
    speculative = SpeculativeParams(0 if variant == "none" else drafts, proposer)
    return [GenerationRequest(f"{tag}-{i}", tuple(prompt), SamplingParams(max_new_tokens=max_new, ignore_eos=True),
                              speculative=speculative) for i, prompt in enumerate(prompts)]


class Variant:
    """One row of the table: a proposer (and for "self" its skipped layers) and what it measured."""

    def __init__(self, name: str, skip_layers: tuple[int, ...] | None = None) -> None:
        self.name, self.skip_layers = name, skip_layers
        self.seconds, self.steps, self.proposed, self.accepted = 0.0, 0, 0, 0
        self.outputs: list[list[int]] = []

    def run(self, engine, prompts: list[list[int]], tag: str, args, timed: bool = True) -> None:
        """Every prompt once, args.batch at a time; skip_layers set on the proposer first."""
        if self.skip_layers is not None:
            proposer = engine.proposers["self"]
            proposer.use(dataclasses.replace(proposer.choice, skip_layers=self.skip_layers))
        before = engine.stats()
        for first in range(0, len(prompts), args.batch):
            start = time.perf_counter()
            results = run_all(engine, requests(prompts[first:first + args.batch], f"{tag}-{first}", self.name,
                                               args.drafts, args.max_new_tokens))
            if any(r.error is not None for r in results):
                raise RuntimeError(f"{tag}: {[str(r.error) for r in results if r.error is not None]}")
            if timed:
                self.seconds += time.perf_counter() - start
                self.outputs += [r.token_ids for r in results]
        after = engine.stats()
        if timed:
            self.steps += after.steps - before.steps
            self.proposed += after.draft_proposed - before.draft_proposed
            self.accepted += after.draft_accepted - before.draft_accepted

    def row(self, workload: str, baseline: "Variant", args) -> dict:
        tokens = sum(map(len, self.outputs))
        return {"workload": workload, "variant": self.name, "skip_layers": self.skip_layers, "batch": args.batch,
                "tokens": tokens, "seconds": round(self.seconds, 3), "tokens_per_s": round(tokens / self.seconds, 1),
                "speedup": round(baseline.seconds / self.seconds * tokens / sum(map(len, baseline.outputs)), 2),
                "steps": self.steps, "tokens_per_step": round(tokens / max(self.steps, 1), 2),
                "drafts_proposed": self.proposed, "drafts_accepted": self.accepted,
                "acceptance": round(self.accepted / self.proposed, 3) if self.proposed else None,
                "same_output": self.outputs == baseline.outputs,
                "identical_requests": sum(a == b for a, b in zip(self.outputs, baseline.outputs)),
                "requests": len(self.outputs)}


def measure(engine, workload: str, args) -> list[dict]:
    """The variants' rounds interleaved (none, self, ..., none, self, ...): the shared machine's
    load drifts, and each variant sees the same drift."""
    prompts = WORKLOADS[workload](engine.tokenizer)
    ranking = engine.proposers["self"].choice.ranking
    calibrated = engine.proposers["self"].choice.skip_layers
    variants = [Variant("none"), Variant("self", calibrated), Variant("ngram")]
    variants += [Variant(f"self-skip{n}", tuple(sorted(ranking[:n]))) for n in args.skip_counts]
    for variant in variants:
        variant.run(engine, prompts[:1], f"warm-{workload}-{variant.name}", args, timed=False)
    for round_no in range(args.repeats):
        for variant in variants:
            variant.run(engine, prompts, f"{workload}-{variant.name}-{round_no}", args)
    engine.proposers["self"].use(dataclasses.replace(engine.proposers["self"].choice, skip_layers=calibrated))
    return [variant.row(workload, variants[0], args) for variant in variants]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", default=default_machine())
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--runner", default="auto", help="auto (cuda_graph on cuda), eager or cuda_graph")
    parser.add_argument("--dtype", default=None, help="weights dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-counts", type=int, nargs="*", default=[4, 8],
                        help="also draft skipping the calibration ranking's first N layers (variants self-skipN)")
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else None)
    engine = make_engine(None, model=args.model, runner=args.runner, max_batch=max(args.batch, 2),
                         max_draft_tokens=args.drafts, device=args.device,
                         dtype=dtype)
    rows, runner = [], engine.runner_name
    try:
        proposer = engine.proposers["self"]
        proposer.check_ready()  # the cached calibration, or the command to run
        for workload in args.workloads:
            rows += measure(engine, workload, args)
    finally:
        engine.stop()
    print(f"{'workload':<8} {'variant':<11} {'tok/s':>7} {'x':>5} {'steps':>6} {'tok/step':>8} {'accept':>7} "
          "identical")
    for row in rows:
        accept = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        print(f"{row['workload']:<8} {row['variant']:<11} {row['tokens_per_s']:>7} {row['speedup']:>5} {row['steps']:>6} "
              f"{row['tokens_per_step']:>8} {accept:>7} {row['identical_requests']}/{row['requests']}")
    choice = proposer.choice  # the calibrated one again (measure restores it)
    out = write_result(args.out or ROOT / "benchmarks" / "results" / f"self_drafts-{args.machine}.json",
                       {"machine": args.machine, "model": args.model, "runner": runner, "args": vars(args),
                        "calibration": {"skip_layers": choice.skip_layers, "acceptance": choice.acceptance,
                                        "estimated_speedup": choice.estimated_speedup,
                                        "num_layers": engine.model_config.num_layers},
                        "results": rows, "command": command_line(f".venv/bin/python {sys.argv[0]}"),
                        "code_commit": code_commit()}, indent=2)
    print(f"wrote {out}")
    # bf16 (the GPU's default): a verify step's numbers differ from a decode step's, so a near tie
    # may go the other way and the rest of that output with it; tests/gpu/test_self_drafts_gpu.py
    # checks that every divergence is one
    return 0 if all(row["same_output"] for row in rows) or dtype not in (None, "float32") else 1


if __name__ == "__main__":
    sys.exit(main())
