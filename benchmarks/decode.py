"""Decode throughput on the GPU: free vs JSON-Schema constrained, against the weight-read
floor and against transformers generate() + xgrammar's logits processor (issue 6, point 5).

    python benchmarks/decode.py --out benchmarks/results/decode-h200.json

What is measured (per model shape, per batch size), all graphs of one runner:
- free:        the `free` decode graph (no channel work), tokens/s and ms/step;
- constrained: the `wait_*` graphs (mask prefetch: wait + gather on a side stream while the
               forward runs, the serving default) with grammar_service (the real StepLoop,
               xgrammar, Tekken-131k tokenizer) in its own process filling every row's mask
               through the step channel; rows that finish their JSON document are re-bound
               (FRESH) so every row stays constrained;
- constrained_serial: the same with the `+serial` graphs (wait and gather after the forward,
               one stream: the step before mask prefetch);
- nowait:      the mask gather/apply and outputs writes (prefetched) without the wait and
               without the sequence words;
- prepublished: the whole channel mechanism of `constrained` (inputs_seq, wait node, gather,
               outputs, outputs_seq; grammar_service sees every step) with a wait that always
               passes and free rows in the descriptors: the step if masks were always ready.
               wait_fraction = 1 - prepublished / constrained = the GPU's time waiting for
               grammar_service; wait_plus_mechanism_fraction = 1 - nowait / constrained (an
               upper bound on the wait: it also holds the wait node and the seq writes);
- engine:      the whole Engine with runner "cuda_graph" (scheduler, streams, host loop),
               overlap off and on (`EngineConfig.overlap`), free greedy decode of random
               prompts and, with grammar_service over gRPC, the same batch constrained by
               SCHEMA; its ms/step against `free` is the host's share;
- floor:       weights read per step (every parameter but an untied input embedding, of
               which only B rows are read) / device copy bandwidth measured in this run;
               also weights + KV read.
Decode starts from a KV cache filled with random values at `--context` tokens per row (no
prefill is timed). Random weights, bf16, vocab 131072; greedy sampling (mask_sample).

This file holds the CLI, the run and the summary; the graph rows are _decode_graphs.py, the
engine rows _decode_engine.py, the transformers baseline hf_baseline.py.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._decode_engine import engine_rows  # noqa: E402
from benchmarks._decode_graphs import HOST_WAIT_SPIN_US, RUNNER_SETTINGS, graph_rows  # noqa: E402
from benchmarks._gpu_timing import copy_bandwidth_gbs  # noqa: E402
from benchmarks._harness import command_line, log, tekken_dir, utc_now, write_result  # noqa: E402
from generation_service.model.presets import PRESETS  # noqa: E402

from hf_baseline import hf_baseline  # noqa: E402  (benchmarks/, the script's folder)

SCHEMA = {  # a typical extraction schema: strings, numbers, enums, a nested array
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "email": {"type": "string"}, "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "email", "active", "role", "tags", "address"],
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["llama-3.1-8b", "llama-3.2-1b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64, 128])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--hf-batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--hf-new-tokens", type=int, default=24)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--engine-batches", nargs="*", type=int, default=[1, 32],
                    help="Engine(runner='cuda_graph') end to end, free; none: skip")
    ap.add_argument("--engine-new-tokens", type=int, default=64)
    ap.add_argument("--skip-engine-constrained", action="store_true",
                    help="engine rows free only (no grammar_service over gRPC)")
    ap.add_argument("--tokenizer-dir", default=tekken_dir())
    ap.add_argument("--grammar-fill-threads", type=int, default=0,
                    help="grammar_service's mask-fill threads for the graph rows (0: its default)")
    ap.add_argument("--grammar-config", type=json.loads, default={},
                    help="further GrammarServiceConfig fields for grammar_service, as a JSON object")
    ap.add_argument("--host-wait-spin-us", type=float, default=HOST_WAIT_SPIN_US,
                    help="how long the host spins on mask_seq before it writes a descriptor D steps "
                         "ahead, before sleeping up to 1 ms (50: a short spin, then sleeps)")
    for name, (kind, text) in RUNNER_SETTINGS.items():
        kwargs = dict(action=argparse.BooleanOptionalAction) if kind is bool else dict(type=kind)
        ap.add_argument("--" + name.replace("_", "-"), default=None,
                        help=f"GpuDecodeRunner.{name} (default: the runner's): {text}", **kwargs)
    ap.add_argument("--wait-stamps", action="store_true",
                    help="GPU timestamps around every channel step's mask wait (two kernels more a step): "
                         "per-step wait percentiles in each channel mode's row (wait_stamps_us)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/decode-h200.json"))
    args = ap.parse_args(argv)
    args.batches = sorted(args.batches)
    return args


def main() -> int:
    args = parse_args()
    torch.manual_seed(0)
    result = {"command": command_line(f"python {sys.argv[0]}"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), "started": utc_now(),
              "mask_source": "grammar_service StepLoop (xgrammar) in its own process, through the step channel",
              "schema": SCHEMA, "context_tokens": args.context}
    bw = copy_bandwidth_gbs()
    result["copy_bandwidth_gbs"] = bw
    log(f"device copy bandwidth {bw:.0f} GB/s (read + write)")
    graph_rows(args, SCHEMA, bw, result)
    if not args.skip_hf:
        result["hf_baseline"] = []
        for preset in args.presets:
            try:
                result["hf_baseline"] += hf_baseline(PRESETS[preset], preset, args.tokenizer_dir, SCHEMA,
                                                     args.hf_batches, args.hf_new_tokens, 128, log)
            except Exception as exc:  # the baseline must not lose the main numbers
                log(f"HF baseline {preset} failed: {exc!r}")
                result.setdefault("hf_errors", []).append(f"{preset}: {exc!r}")
    if args.engine_batches:
        engine_rows(args, SCHEMA, result)
    write_result(args.out, result)
    summary(result)
    return 0


def summary(result: dict) -> None:
    """c/f: constrained (prefetch) over free; serial: the same without prefetch; wait%: GPU time
    waiting for grammar_service (vs prepublished); +mech%: the wait plus the channel's own work (vs nowait)."""
    print(f"\ncopy bandwidth {result['copy_bandwidth_gbs']:.0f} GB/s; masks: {result['mask_source']}")
    print(f"{'model':14s} {'batch':>5s} {'free ms':>8s} {'nowait':>7s} {'prepub':>7s} {'constr':>7s} "
          f"{'serial':>7s} {'free tok/s':>10s} {'constr tok/s':>12s} {'c/f':>5s} {'serial':>6s} "
          f"{'wait%':>5s} {'+mech%':>6s} {'x floor':>7s}")
    for m in result["models"]:
        for batch in sorted({r["batch"] for r in m["rows"]}):
            by = {r["mode"]: r for r in m["rows"] if r["batch"] == batch}
            f, c = by["free"], by["constrained"]
            ms = [by[mode]["ms_per_step"] for mode in ("free", "nowait", "prepublished", "constrained",
                                                        "constrained_serial")]
            print(f"{m['preset']:14s} {batch:5d} {ms[0]:8.3f} {ms[1]:7.3f} {ms[2]:7.3f} {ms[3]:7.3f} {ms[4]:7.3f} "
                  f"{f['tokens_per_s']:10.1f} {c['tokens_per_s']:12.1f} {c['constrained_over_free']:5.3f} "
                  f"{c['constrained_serial_over_free']:6.3f} {100 * c['wait_fraction']:5.1f} "
                  f"{100 * c['wait_plus_mechanism_fraction']:6.1f} {f['over_weight_floor']:7.2f}")
    for e in result.get("engine", []):
        head = f"Engine {e['preset']:14s} b={e['batch']:3d} overlap={e['overlap']!s:5s} {e['mode']:11s}"
        if "error" in e:
            print(f"{head} error {e['error']}")
        else:
            print(f"{head} {e['ms_per_step']:8.3f} ms/step {e['tokens_per_s']:9.1f} tok/s "
                  f"({e['graph_steps']}/{e['steps']} graph, {e['chained_steps']} chained)")
    for h in result.get("hf_baseline", []):
        head = f"HF {h['preset']:14s} b={h['batch']:3d} {h['mode']:19s}"
        if "error" in h:
            print(f"{head} error {h['error'][:100]}")
        elif "min_processor_ms" in h:
            print(f"{head} transformers' min-length processors alone {h['min_processor_ms']:.2f} ms/step")
        else:
            print(f"{head} {h['tokens_per_s']:8.1f} tok/s {h['ms_per_step']:8.2f} ms/step")


if __name__ == "__main__":
    sys.exit(main())
