"""Do speculative verify graphs pay? The Engine with verify steps as graphs, eager, and off.

    python benchmarks/verify.py --out benchmarks/results/verify-h200.json

engine (per model shape and batch; the same prompts and lengths for every variant): the whole
Engine (runner "cuda_graph", overlap at its default), random weights, bf16, vocab 131072 with
the Tekken tokenizer (decode.py's `engine_model_spec`), greedy, EOS ignored. Variants:
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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from generation_service.engine.engine import Engine, EngineConfig  # noqa: E402
from generation_service.engine.kv_cache import num_pages_for  # noqa: E402
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams  # noqa: E402
from generation_service.engine.request import Request  # noqa: E402
from generation_service.engine.sampler import SampleRow  # noqa: E402
from generation_service.engine.scheduler import ScheduledBatch, ScheduledRow  # noqa: E402
from generation_service.engine.speculative import PROPOSERS, DraftProposer  # noqa: E402

from tests.integration.test_engine_support import wait_settled  # noqa: E402

from decode import PAGE_SIZE, engine_model_spec, log  # noqa: E402  (benchmarks/, the script's folder)

TINY = "tiny"  # tests/gpu/gpu_helpers.py's 2-layer random Llama: exercises the script on a CPU


@dataclass(frozen=True)
class Variant:
    name: str
    is_speculative: bool  # requests ask for --drafts draft tokens per step (else 0)
    verify_graphs: bool   # EngineConfig.verify_graphs of the engine that runs it


OFF = Variant("off", False, False)
SPECULATIVE = (Variant("eager", True, False), Variant("graph", True, True))
WORKLOADS = ("oracle", "ngram")  # the proposer of the speculative variants


class OracleProposer(DraftProposer):
    """Drafts a request's calibrated greedy continuation (`continuations[prompt_ids]`) from
    its position on; with accuracy < 1, draft token j at output position n is replaced by a
    wrong one when a hash of (prompt, n + j) falls above `accuracy`."""

    def __init__(self) -> None:
        self.continuations: dict[tuple[int, ...], list[int]] = {}
        self.accuracy = 1.0
        self.vocab_size = 1

    def propose(self, request: Request, k: int) -> list[int]:
        prompt = request.spec.prompt_ids
        n = request.num_generated
        drafts = list(self.continuations.get(prompt, [])[n:n + k])
        for j, token in enumerate(drafts):
            if hash((prompt, n + j)) % 1000 >= self.accuracy * 1000:
                drafts[j] = (token + 1) % self.vocab_size
        return drafts


ORACLE = OracleProposer()  # one instance, filled after calibration, for every engine


@dataclass(frozen=True)
class Counters:
    """Engine and runner counters at one moment; `minus` gives a window's counts."""

    steps: int
    graph_steps: int
    verify_graph_steps: int
    chained_steps: int
    draft_proposed: int
    draft_accepted: int

    @classmethod
    def of(cls, engine: Engine) -> "Counters":
        stats, runner = engine.stats(), engine.runner
        return cls(stats.steps, getattr(runner, "num_graph_steps", 0), getattr(runner, "num_verify_steps", 0),
                   getattr(runner, "num_chained_steps", 0), stats.draft_proposed, stats.draft_accepted)

    def minus(self, earlier: "Counters") -> "Counters":
        return Counters(*(getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)))


@dataclass
class Run:
    """One batch through the engine: outputs, and counters over the timed window."""

    outputs: list[list[int]]
    num_tokens_before: int  # tokens read before the window (each row's first, from prefill)
    finish_reasons: dict[str, int]
    errors: list[str]
    window_s: float      # every row's first token -> the last row's end
    submit_to_end_s: float
    window: Counters


def run_batch(engine: Engine, tag: str, prompts, sampling: SamplingParams,
              speculative: SpeculativeParams = SpeculativeParams()) -> Run:
    """Submit every prompt at once; time from every row's first token to the last row's end."""
    started = time.perf_counter()
    streams = [engine.submit(GenerationRequest(f"{tag}-{i}", prompt, sampling, speculative=speculative))
               for i, prompt in enumerate(prompts)]
    outputs, finals = [[] for _ in streams], [None] * len(streams)

    def drain(i: int, until_first: bool) -> None:
        while finals[i] is None and not (until_first and outputs[i]):
            event = streams[i].get(timeout=120)
            outputs[i] += event.token_ids
            finals[i] = event if event.is_final else None

    for i in range(len(streams)):
        drain(i, until_first=True)
    t0, before, num_before = time.perf_counter(), Counters.of(engine), sum(len(out) for out in outputs)
    for i in range(len(streams)):
        drain(i, until_first=False)
    end, window = time.perf_counter(), Counters.of(engine).minus(before)
    reasons: dict[str, int] = {}
    for final in finals:
        reasons[final.finish_reason.name] = reasons.get(final.finish_reason.name, 0) + 1
    errors = [repr(f.error) for f in finals if f.error is not None][:3]
    return Run(outputs, num_before, reasons, errors, end - t0, end - started, window)


def engine_row(preset: str, batch: int, variant: Variant, workload: str, num_drafts: int, run: Run,
               continuations: list[list[int]]) -> dict:
    w = run.window
    decoded = sum(len(out) for out in run.outputs) - run.num_tokens_before
    eager_steps = w.steps - w.graph_steps  # after prefill: the verify steps not graphed
    verify_steps = w.verify_graph_steps + (eager_steps if num_drafts else 0)
    row = {"preset": preset, "batch": batch, "variant": variant.name, "workload": workload,
           "num_draft_tokens": num_drafts, "verify_graphs": variant.verify_graphs, "steps": w.steps,
           "graph_steps": w.graph_steps, "verify_graph_steps": w.verify_graph_steps, "eager_steps": eager_steps,
           "chained_steps": w.chained_steps, "verify_steps": verify_steps,
           "ms_per_step": run.window_s / max(1, w.steps) * 1e3, "tokens_per_s": decoded / run.window_s,
           "tokens_decoded": decoded, "tokens_per_step": decoded / max(1, w.steps),
           "drafts_proposed": w.draft_proposed, "drafts_accepted": w.draft_accepted,
           "acceptance": w.draft_accepted / w.draft_proposed if w.draft_proposed else None,
           "accepted_per_verify_step": w.draft_accepted / verify_steps if verify_steps else None,
           # rows of a batch have the same lengths and run together: a verify step holds ~batch rows
           "accepted_per_verify_row": w.draft_accepted / (verify_steps * batch) if verify_steps else None,
           "calibration_match": calibration_match(run.outputs, continuations), "window_s": run.window_s,
           "submit_to_end_s": run.submit_to_end_s, "finish_reasons": run.finish_reasons, "errors": run.errors}
    log(f"{preset} b={batch:3d} {variant.name:5s} {workload:6s} {row['ms_per_step']:8.3f} ms/step "
        f"{row['tokens_per_s']:9.1f} tok/s {row['tokens_per_step']:5.2f} tok/step, accepted "
        f"{w.draft_accepted}/{w.draft_proposed}, {w.verify_graph_steps} verify graph / {eager_steps} eager / "
        f"{w.steps} steps, {w.chained_steps} chained")
    return row


def num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def calibration_match(outputs: list[list[int]], continuations: list[list[int]]) -> float:
    """Mean share of its calibrated continuation each row reproduced before a difference."""
    shares = []
    for out, cont in zip(outputs, continuations):
        same = next((j for j, (a, b) in enumerate(zip(out, cont)) if a != b), min(len(out), len(cont)))
        shares.append(same / max(1, len(cont)))
    return sum(shares) / len(shares)


# ---- one verify step alone ---------------------------------------------------------------
def idle_rows(engine: Engine, batch: int, context: int, num_drafts: int, gen: torch.Generator):
    """(verify rows, the same rows without drafts, their pages): `batch` requests at `context`
    cached tokens (random ids; K/V whatever the pages hold), pages from the idle engine."""
    vocab, width = engine.model_config.vocab_size, 1 + num_drafts
    verify, decode, pages = [], [], []
    for i in range(batch):
        ids = torch.randint(0, vocab, (context + width,), generator=gen).tolist()
        request = Request(GenerationRequest(f"step-{i}", tuple(ids[:context + 1]),
                                            SamplingParams(max_new_tokens=width, ignore_eos=True),
                                            speculative=SpeculativeParams(num_drafts)), frozenset(), i)
        request.pages = engine.allocator.allocate(num_pages_for(context + width, engine.config.page_size))
        request.num_cached = context
        pages += request.pages
        verify.append(ScheduledRow(request, context, ids[context:], ids[context + 1:], is_sampling=True))
        decode.append(ScheduledRow(request, context, ids[context:context + 1], is_sampling=True))
    return ScheduledBatch(verify), ScheduledBatch(decode), pages


def median_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median host wall time of fn (which ends synchronized), after warmup calls."""
    times = []
    for _ in range(warmup + reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]) * 1e3


def step_costs(engine: Engine, preset: str, batches: list[int], context: int, num_drafts: int,
               reps: int) -> list[dict]:
    """One step alone per batch (module docstring); without graphs (runner "eager") the eager
    figures only."""
    wait_settled(engine)  # every page back: the rows below take theirs from the allocator
    runner, sampler = engine.runner, engine.sampler
    has_graphs = getattr(runner, "verify", None) is not None
    gen, out = torch.Generator().manual_seed(1), []

    def synchronize() -> None:
        if runner.device.type == "cuda":
            torch.cuda.synchronize()

    def eager_step(batch: ScheduledBatch, sample: bool = True) -> None:  # Engine.step's eager path (no masks)
        logits = runner.run(batch)
        if sample:
            sampler(logits, [SampleRow.of(row, False) for row in batch.rows])
        synchronize()

    def graph_step(batch: ScheduledBatch) -> None:  # verify rows: the verify graph; else a decode graph
        runner.collect(runner.launch(batch, None))

    for batch_size in batches:
        verify, decode, pages = idle_rows(engine, batch_size, context, num_drafts, gen)
        try:
            row = {"preset": preset, "batch": batch_size, "context": context, "num_draft_tokens": num_drafts,
                   "graph_ms": median_ms(lambda: graph_step(verify), reps) if has_graphs else None,
                   "eager_ms": median_ms(lambda: eager_step(verify), reps),
                   "eager_forward_ms": median_ms(lambda: eager_step(verify, sample=False), reps),
                   "decode_graph_ms": median_ms(lambda: graph_step(decode), reps) if has_graphs else None}
        finally:
            engine.allocator.free(pages)
        if has_graphs:
            row["eager_over_graph"] = row["eager_ms"] / row["graph_ms"]
            row["graph_over_decode"] = row["graph_ms"] / row["decode_graph_ms"]
        log(f"{preset} b={batch_size:3d} one verify step: graph {num(row['graph_ms'], '.3f')} ms, eager "
            f"{row['eager_ms']:.3f} ms (forward {row['eager_forward_ms']:.3f}), decode graph "
            f"{num(row['decode_graph_ms'], '.3f')} ms")
        out.append(row)
    return out


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
def code_version() -> dict:
    """The git commit and whether tracked files differ from it where there is a checkout (else
    $STRUCTGEN_COMMIT), and a digest of the engine's sources and this script, which identifies
    the code where there is no .git (a device copy of the working tree)."""
    def git(*words: str) -> str | None:
        try:
            done = subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    digest = hashlib.sha256()
    for path in sorted([*(ROOT / "generation_service").rglob("*.py"), pathlib.Path(__file__).resolve()]):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return {"code_commit": commit or os.environ.get("STRUCTGEN_COMMIT", "unknown"),
            "code_dirty": None if status is None else bool(status), "code_sha256": digest.hexdigest()[:16]}


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


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
    ap.add_argument("--tokenizer-dir", default=os.environ.get(
        "STRUCTGEN_TEKKEN_DIR", str(pathlib.Path.home() / ".cache/structgen/tokenizers/tekken_131k")))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/verify-h200.json"))
    args = ap.parse_args(argv)
    args.batches = sorted(args.batches)
    return args


def header(args) -> dict:
    """What the run was: command, device, versions, code, arguments."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"command": "python " + " ".join(sys.argv), "device": device_name(args.device),
            "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
            **code_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args),
            "workload": "prompt P x repeats (random ids); drafts: see workloads; greedy unless --temperature"}


def main() -> int:
    args = parse_args()
    result = {**header(args), "models": [], "errors": []}
    out_path = pathlib.Path(args.out)

    def write() -> None:
        result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1))

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
