"""Do speculative verify graphs pay? The Engine with verify steps as graphs, eager, and off.

    python benchmarks/verify.py --out benchmarks/results/verify-h200.json

engine (per model shape and batch; the same prompts and lengths for every variant): the whole
Engine (runner "cuda_graph", overlap at its default), random weights, bf16, vocab 131072 with
the Tekken tokenizer (_harness.py's `engine_model_spec`), greedy, EOS ignored. Variants:
- off:   no speculation (requests with num_draft_tokens 0: the scheduler proposes nothing, as
         with max_draft_tokens 0); decode steps replay graphs and chain under overlap, which
         speculative requests never do (engine.py `_chained_batch`);
- eager: `--drafts` drafts per row and step, verify_graphs False: verify steps run eagerly
         (ModelRunner forward, logits to the CPU sampler);
- graph: the same drafts, verify_graphs True: verify steps replay the captured verify graphs.
`off` and `eager` run on one engine, `graph` on a second with the same weights (seed 0); both
stay up, so the variants of a batch run back to back. Prompts: P (`--pattern-len` random ids)
repeated `--repeats` times. Drafts, per workload:
- ngram:  the engine's n-gram proposer. It drafts only once the output repeats the context;
          random weights rarely do (a 1B-shape CPU probe, 2 rows x 16 tokens: 4 drafts proposed,
          none accepted), so these rows may show few verify steps: they say what it gets here.
- oracle: the row's own greedy continuation C (an untimed speculation-off run at the largest
          batch, which also warms the engine up), drafted at the row's position by a proposer
          registered here (`OracleProposer`); with `--draft-accuracy` < 1 each draft token is
          replaced by a wrong one with that probability (a hash: a pure function, as proposers
          must be). Greedy accepts C up to bf16 near ties; a row that leaves C at such a tie
          gets rejected drafts from there on (`calibration_match`: share of C a row reproduced).
Timed from every row's first token (prefill done) to the last row's end: ms per engine step,
tokens/s, drafts accepted per verify step, verify steps as graphs (`runner.num_verify_steps`)
and eager steps (after prefill only verify batches run eagerly under "cuda_graph"; `off` 0).

step (per batch, on the graph engine while it is idle): one verify step of rows x (1 + drafts)
tokens at the prompts' context, alone: host wall time per step (median of `--step-reps`),
`graph_ms` (launch + collect of the verify graph), `eager_ms` (ModelRunner.run + the Sampler:
what Engine.step does for a batch it does not graph), `eager_forward_ms` (the forward alone),
`decode_graph_ms` (one decode graph step of the same rows without drafts: one plain token).

On a CPU, `--device cpu --runner eager --presets tiny` runs all of it but the graphs (there
`graph` is the eager path and the step rows have eager figures only).

This file holds the CLI, the engines per model shape, the engine comparison and the summary.
Next to it: `_verify_runs.py` (the variants, a batch run's row, the oracle proposer),
`_verify_step.py` (one verify step alone), `_verify_header.py` (what the run was); one batch
through the Engine is `_engine_batch.run_batch`, shared with decode.py's engine rows.
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._engine_batch import run_batch  # noqa: E402
from benchmarks._harness import PAGE_SIZE, engine_model_spec, log, tekken_dir, utc_now, write_result  # noqa: E402
from generation_service.engine.engine import Engine, EngineConfig  # noqa: E402
from generation_service.engine.kv_cache import num_pages_for  # noqa: E402
from generation_service.engine.params import SamplingParams, SpeculativeParams  # noqa: E402
from generation_service.engine.speculative import PROPOSERS  # noqa: E402

# benchmarks/, the script's folder: this script's helper modules
from _verify_runs import OFF, ORACLE, SPECULATIVE, Variant, engine_row  # noqa: E402  (the variants, a run's row)
from _verify_step import num, step_costs  # noqa: E402  (one verify step alone)
from _verify_header import header  # noqa: E402  (what the run was)

TINY = "tiny"  # tests/gpu/gpu_helpers.py's 2-layer random Llama: exercises the script on a CPU
WORKLOADS = ("oracle", "ngram")  # the proposer of the speculative variants


# ---- per model shape ---------------------------------------------------------------------
def model_spec(preset: str, args, folder: pathlib.Path) -> str:
    if preset != TINY:
        return engine_model_spec(preset, args.tokenizer_dir, folder)
    from tests.gpu.gpu_helpers import write_random_checkpoint
    folder.mkdir(parents=True, exist_ok=True)
    return write_random_checkpoint(folder, with_tokenizer=(pathlib.Path(args.tokenizer_dir) / "tokenizer.json").is_file())


def make_engine(args, spec: str, verify_graphs: bool) -> Engine:
    """Not started: its loop thread starts once every engine of the shape has captured its graphs."""
    max_batch, prompt_len = max(args.batches), args.pattern_len * args.repeats
    pages_per_row = num_pages_for(prompt_len + args.new_tokens + args.drafts + 1, PAGE_SIZE)
    engine = Engine(EngineConfig(
        model=spec, device=args.device, dtype=args.dtype, runner=args.runner, max_batch=max_batch,
        num_pages=1 + max_batch * pages_per_row, page_size=PAGE_SIZE, max_prompt_tokens=prompt_len,
        max_new_tokens_limit=args.new_tokens, prefill_chunk_tokens=prompt_len * max_batch,
        max_draft_tokens=args.drafts, verify_graphs=verify_graphs))
    return engine


def calibrate(engine: Engine, args) -> tuple[list[tuple[int, ...]], list[list[int]]]:
    """(prompts, their greedy continuations) for the largest batch, from one untimed
    speculation-off run; the oracle drafts those continuations from now on."""
    gen, vocab = torch.Generator().manual_seed(0), engine.model_config.vocab_size
    prompts = [tuple(torch.randint(0, vocab, (args.pattern_len,), generator=gen).tolist() * args.repeats)
               for _ in range(max(args.batches))]
    continuations = run_batch(engine, "calibrate", prompts,
                              SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)).outputs
    ORACLE.continuations = dict(zip(prompts, continuations))
    ORACLE.accuracy, ORACLE.vocab_size = args.draft_accuracy, vocab
    return prompts, continuations


def model_shape(preset: str, args, folder: pathlib.Path, out: dict) -> None:
    """Fill `out` as measured (an error: `out["error"]`, the rows so far kept)."""
    engines: dict[bool, Engine] = {}
    out.update(preset=preset, engine_start_s={}, engine=[], step=[])
    try:
        out["model_spec"] = spec = model_spec(preset, args, folder / preset)
        for verify_graphs in (False, True):
            started = time.perf_counter()
            engines[verify_graphs] = make_engine(args, spec, verify_graphs)
            out["engine_start_s"][f"verify_graphs_{verify_graphs}"] = up_s = time.perf_counter() - started
            log(f"{preset}: engine verify_graphs={verify_graphs} up in {up_s:.1f} s ({spec})")
        for engine in engines.values():  # NOTE: after every capture: no other thread runs during one
            engine.start()
        shape = Shape(preset, engines, *calibrate(engines[False], args), args)
        out.update(vocab_size=engines[False].model_config.vocab_size, prompt_tokens=len(shape.prompts[0]))
        shape.compare(out["engine"])
        if args.step_reps:
            out["step"] = step_costs(engines[True], preset, args.batches, len(shape.prompts[0]), args.drafts,
                                     args.step_reps)
    except Exception as exc:  # noqa: BLE001 -- keep what was measured; main reports the error
        log(f"{preset} failed: {exc!r}")
        out["error"] = repr(exc)
    finally:
        for engine in engines.values():
            engine.stop()
        engines.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@dataclass
class Shape:
    """One model shape's engines (by verify_graphs), prompts and calibrated continuations."""

    preset: str
    engines: dict[bool, Engine]
    prompts: list[tuple[int, ...]]
    continuations: list[list[int]]
    args: argparse.Namespace

    def compare(self, out: list[dict]) -> None:
        """Rows into `out` as measured. At each batch: off, then eager and graph per workload,
        back to back (after one untimed warm-up batch of each verify path: kernels, allocator)."""
        for variant in SPECULATIVE:
            run_batch(self.engines[variant.verify_graphs], f"warmup-{variant.name}", self.prompts,
                      SamplingParams(max_new_tokens=8, ignore_eos=True), SpeculativeParams(self.args.drafts, "oracle"))
        for batch in self.args.batches:
            off = self.measure(batch, OFF, "none")
            out.append(off)
            for workload in self.args.workloads:
                by = {}
                for variant in SPECULATIVE:
                    by[variant.name] = row = self.measure(batch, variant, workload)
                    row["over_off"] = row["tokens_per_s"] / off["tokens_per_s"]
                    out.append(row)
                by["graph"]["graph_over_eager"] = by["graph"]["tokens_per_s"] / by["eager"]["tokens_per_s"]

    def measure(self, batch: int, variant: Variant, workload: str) -> dict:
        args = self.args
        num_drafts = args.drafts if variant.is_speculative else 0
        sampling = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=args.temperature)
        run = run_batch(self.engines[variant.verify_graphs], f"{variant.name}-{workload}-{batch}",
                        self.prompts[:batch], sampling, SpeculativeParams(num_drafts, workload if num_drafts else "ngram"))
        return engine_row(self.preset, batch, variant, workload, num_drafts, run, self.continuations[:batch])


# ---- the run -----------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["llama-3.1-8b", "llama-3.2-1b"],
                    help=f"model shapes (generation_service/model/presets.py), or {TINY!r}: a 2-layer model")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--pattern-len", type=int, default=128, help="P: random ids; the prompt is P x repeats")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per row")
    ap.add_argument("--drafts", type=int, default=4, help="max_draft_tokens and each request's num_draft_tokens")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS,
                    help="draft proposers of the speculative variants")
    ap.add_argument("--draft-accuracy", type=float, default=1.0,
                    help="oracle: share of draft tokens that are the calibrated continuation's")
    ap.add_argument("--temperature", type=float, default=0.0, help="timed runs (calibration is greedy)")
    ap.add_argument("--step-reps", type=int, default=20, help="verify steps timed alone per batch; 0: skip")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runner", default="cuda_graph", choices=("cuda_graph", "eager"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokenizer-dir", default=tekken_dir())
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/verify-h200.json"))
    args = ap.parse_args(argv)
    args.batches = sorted(args.batches)
    return args


def main() -> int:
    args = parse_args()
    result = {**header(args), "models": [], "errors": []}
    out_path = pathlib.Path(args.out)

    def write() -> None:
        result["finished"] = utc_now()
        write_result(out_path, result)

    def on_sigterm(*_) -> None:  # NOTE: `timeout` ends an overlong run: keep what was measured first
        result["errors"].append("SIGTERM (timeout?) before the end")
        write()
        sys.exit(124)

    signal.signal(signal.SIGTERM, on_sigterm)
    PROPOSERS["oracle"] = lambda: ORACLE  # before any engine: it builds its proposers from the registry
    with tempfile.TemporaryDirectory(prefix="structgen-verify-") as folder:
        try:
            for preset in args.presets:  # a shape's failure is recorded there and in `errors`
                result["models"].append(shape := {})
                model_shape(preset, args, pathlib.Path(folder), shape)
                if "error" in shape:
                    result["errors"].append(f"{preset}: {shape['error']}")
        finally:
            write()
    summary(result)
    return 1 if result["errors"] else 0


def summary(result: dict) -> None:
    """accept: drafts accepted / proposed; acc/vstep: accepted per verify step; vgraph/eager:
    verify steps as graphs / eager steps; calib: calibration_match; xeager, xoff: tokens/s over
    the same batch's `eager` row of the workload and its `off` row."""
    print(f"\n{result['device']}, torch {result['torch']}, code {result['code_commit']} ({result['code_sha256']})")
    print(f"{'model':14s} {'B':>3s} {'variant':7s} {'drafts':6s} {'ms/step':>8s} {'tok/s':>9s} {'tok/step':>8s} {'accept':>6s} "
          f"{'acc/vstep':>9s} {'vgraph/eager':>12s} {'chained':>7s} {'calib':>5s} {'xeager':>6s} {'xoff':>5s}")
    for m in result["models"]:
        for r in m["engine"]:
            steps = f"{r['verify_graph_steps']}/{r['eager_steps']}"
            print(f"{m['preset']:14s} {r['batch']:3d} {r['variant']:7s} {r['workload']:6s} {r['ms_per_step']:8.3f} {r['tokens_per_s']:9.1f} "
                  f"{r['tokens_per_step']:8.2f} {num(r['acceptance'], '.2f'):>6s} "
                  f"{num(r['accepted_per_verify_step'], '.2f'):>9s} {steps:>12s} {r['chained_steps']:7d} "
                  f"{r['calibration_match']:5.2f} {num(r.get('graph_over_eager'), '.3f'):>6s} "
                  f"{num(r.get('over_off'), '.3f'):>5s}")
    for m in result["models"]:
        for s in m["step"]:
            print(f"{m['preset']:14s} {s['batch']:3d} one verify step of 1+{s['num_draft_tokens']} tokens at "
                  f"{s['context']}: graph {num(s['graph_ms'], '.3f')} ms, eager {s['eager_ms']:.3f} ms (forward "
                  f"{s['eager_forward_ms']:.3f}), decode graph {num(s['decode_graph_ms'], '.3f')} ms, "
                  f"eager/graph {num(s.get('eager_over_graph'), '.2f')}")
    for error in result["errors"]:
        print(f"error: {error}")


if __name__ == "__main__":
    sys.exit(main())
