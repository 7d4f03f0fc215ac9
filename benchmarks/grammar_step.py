"""Per-step time of grammar_service's loop (advance + fill), measured through the step channel.

A real grammar_service process (python -m grammar_service) serves each vocabulary; this
process plays the engine: it writes descriptors and outputs, publishes `inputs_seq = N` and
waits for `mask_seq >= N`. Reported per (vocabulary, workload, batch):
- `step_us_p50/p90/p99`: publish inputs -> masks seen, as the engine experiences it
  (includes the loop's wake-up latency);
- `service_step_us`: the loop's own time per step (advance + fill), from GetStats;
- `service_advance_us` / `service_fill_us` / `service_bookkeeping_us`: its phases per step
  (they add up to service_step_us; loop.py `StepPhases`), from the service's Prometheus
  counter structgen_grammar_step_phase_seconds_total on --metrics-port. These are means over
  every step, the `--warmup` ones included (the engine-side percentiles leave those out).
Each (backend, workload, batch) runs `--repeats` times; `summary` holds the medians over
the repeats and their ranges (`range_*`: [min, max]).
`--advance` picks how llguidance's deferred advance runs (grammar_service
--min-parallel-advance-rows): `serial` (a Python list of consume_token), `parallel`
(LLExecutor.consume_token_par at every batch size), `configured` (the service's default
threshold), or `both`: serial and parallel services side by side, every llguidance
configuration run on each in turn (order reversed every other repeat), rows tagged `advance` and
`advance_ab` giving parallel/serial medians. `--lanes 1 8` does the same for llguidance's lanes
per compiled grammar (grammar_service --num-llguidance-lanes, capped at its fill threads; 1 =
one lane, the behaviour before lanes): one service per lanes x advance variant, `lanes_ab`
giving each lanes value's medians over the first one's. Other backends run once, on the first service, tagged `serial`
(xgrammar's batch_accept_token is a C++ loop in the calling thread).
Workloads:
- `replay`: realistic JSON documents, each constrained by its schema, tokenized with the
  real tokenizer; the rows of one document start together (lockstep) and restart (FRESH)
  when done;
- `replay_drafts3`: the same with 3 draft tokens per row (4 mask rows per row per step);
- `random`: adversarial random walks: each row samples a uniformly random allowed token from
  its own mask (EOS only when nothing else is allowed), restarting after 256 tokens.
Rows use the schemas of benchmarks/_documents.py round-robin; `--num-schemas 1` puts every
row on the first one (one compiled grammar, the single-schema case).

    .venv/bin/python benchmarks/grammar_step.py --machine ci-2core
    .venv/bin/python benchmarks/grammar_step.py --backends llguidance --vocabs tekken_131k \
        --workloads random replay --batches 64 128 --repeats 5 --advance both --out /tmp/grammar_step.json
    .venv/bin/python benchmarks/grammar_step.py --backends llguidance --vocabs tekken_131k --workloads random \
        --batches 64 128 --num-schemas 1 --lanes 1 8 --advance both --repeats 3 --out /tmp/lanes.json
writes benchmarks/results/grammar_step-<machine>.json and prints a table. The engine side of the
channel and the workloads are in _grammar_workloads.py.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/: the real tokenizers and the channel driver

from benchmarks._harness import (  # noqa: E402
    command_line, default_machine, free_port, scrape, utc_now, versions, write_result,
)
from grammar_contract.client import GrammarControlClient  # noqa: E402
from grammar_contract.spec import GrammarSpec  # noqa: E402
from grammar_service.config import GrammarServiceConfig, llguidance_fill_threads, llguidance_lanes  # noqa: E402
from real_tokenizers import VOCAB_SIZES, continuation_ids, tokenizer_dir  # noqa: E402
from step_channel import Geometry, StepChannel  # noqa: E402
from structgen.supervisor import wait_healthy  # noqa: E402
from structgen.tokenizer_identity import fingerprint_tokenizer_json  # noqa: E402

from _documents import DOCUMENTS  # noqa: E402  (benchmarks/_documents.py: schema + document pairs)
from _grammar_workloads import EOS, MAX_POSITIONS, Engine, run_random, run_replay  # noqa: E402

MAX_BATCH = 128
PHASES = ("advance", "fill", "bookkeeping")


# --advance variant -> grammar_service --min-parallel-advance-rows (None: the service's default)
ADVANCE_MIN_ROWS = {"serial": 0, "parallel": 1, "configured": None}
ADVANCE_CHOICES = {"serial": ("serial",), "parallel": ("parallel",), "configured": ("configured",),
                   "both": ("serial", "parallel")}


def start_service(sock: str, tok_dir: str, vocab: int, fill_threads: int, metrics_port: int,
                  min_parallel_advance_rows: int | None, lanes: int | None) -> subprocess.Popen:
    """A grammar_service process; None for either knob leaves the service's default."""
    advance = ([] if min_parallel_advance_rows is None
               else ["--min-parallel-advance-rows", str(min_parallel_advance_rows)])
    lanes_flag = [] if lanes is None else ["--num-llguidance-lanes", str(lanes)]
    return subprocess.Popen([sys.executable, "-m", "grammar_service", "--listen", f"unix://{sock}",
                             "--tokenizer-dir", tok_dir, "--vocab-size", str(vocab),
                             "--num-fill-threads", str(fill_threads), "--metrics-port", str(metrics_port),
                             *advance, *lanes_flag, "--log-level", "WARNING"], cwd=ROOT)


def phase_seconds(metrics_port: int) -> dict[str, float]:
    """The service's structgen_grammar_step_phase_seconds_total by phase."""
    from prometheus_client.parser import text_string_to_metric_families
    text = scrape(f"http://127.0.0.1:{metrics_port}/metrics", timeout_s=5)
    out = dict.fromkeys(PHASES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "structgen_grammar_step_phase_seconds_total":
                out[sample.labels["phase"]] = sample.value
    return out


class Service:
    """One grammar_service process, its control client and its metrics port."""

    def __init__(self, tok_dir: str, vocab: int, fill_threads: int, advance: str, lanes: int | None):
        self.advance = advance  # an ADVANCE_MIN_ROWS key
        self.lanes = lanes      # --num-llguidance-lanes (None: the service's default)
        self.sock = os.path.join(tempfile.mkdtemp(prefix="grammar-bench-"), "grammar.sock")
        self.metrics_port = free_port()
        self.proc = start_service(self.sock, tok_dir, vocab, fill_threads, self.metrics_port,
                                  ADVANCE_MIN_ROWS[advance], lanes)
        self.client = GrammarControlClient(f"unix://{self.sock}")
        self.grammar_ids: dict[str, list[int]] = {}  # backend -> ids of DOCUMENTS' schemas

    def wait_healthy(self) -> None:
        if not wait_healthy(f"unix://{self.sock}", 180, self.proc):
            raise RuntimeError("grammar_service did not start")

    def grammars(self, backend: str) -> list[int]:
        if backend not in self.grammar_ids:
            self.grammar_ids[backend] = [
                self.client.compile(GrammarSpec("json_schema", json.dumps(schema), backend=backend)).result(120)
                .grammar_id for schema, _ in DOCUMENTS]
        return self.grammar_ids[backend]

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(30)


def bench_one(service: Service, backend: str, tok_dir: str, fingerprint: str, geometry: Geometry, docs_ids,
              workload: str, batch: int, args) -> tuple[np.ndarray, float, dict[str, float]]:
    """(engine-side step times in us, the service's own mean step time in us, its phases in us
    per step) for one configuration."""
    num_steps = max(args.min_steps, args.steps // batch)
    # the first --num-schemas documents and their grammars (1: every row on one compiled grammar)
    client, grammar_ids = service.client, service.grammars(backend)[:args.num_schemas]
    docs_ids = docs_ids[:args.num_schemas]
    with StepChannel.create(geometry) as chan:
        client.open_channel(chan.name, geometry, max_slots=MAX_BATCH, first_step=1, tokenizer_dir=tok_dir,
                            tokenizer_fingerprint=fingerprint)
        engine = Engine(chan)
        before, phases_before = client.stats(), phase_seconds(service.metrics_port)
        if workload == "random":
            times = run_random(engine, grammar_ids, batch, num_steps)
        else:
            drafts = 3 if workload == "replay_drafts3" else 0
            times = run_replay(engine, grammar_ids, docs_ids, batch, num_steps, drafts)
        client.close_channel(chan.name)
        after, phases_after = client.stats(), phase_seconds(service.metrics_port)
    num = max(1, after["num_steps"] - before["num_steps"])
    service_us = (after["total_step_us"] - before["total_step_us"]) / num
    phases = {p: (phases_after[p] - phases_before[p]) * 1e6 / num for p in PHASES}
    return np.array(times[args.warmup:] or times), service_us, phases


def services_for(backend: str, services: list[Service], repeat: int) -> list[Service]:
    """The services a configuration runs on, in this repeat's order: llguidance on each (the
    lanes x advance variants, in order on even repeats and reversed on odd ones, so that over
    an even number of repeats every service has the same mean place), other backends on the
    first only."""
    if backend != "llguidance":
        return services[:1]
    return services if repeat % 2 == 0 else services[::-1]


def bench_vocab(name: str, args) -> list[dict]:
    from tokenizers import Tokenizer

    vocab = VOCAB_SIZES[name]
    tok_dir = str(tokenizer_dir(name))
    tok = Tokenizer.from_file(f"{tok_dir}/tokenizer.json")
    # documents as a model writes them: UTF-8, no \u escapes
    docs_ids = [continuation_ids(tok, json.dumps(doc, ensure_ascii=False)) + [EOS] for _, doc in DOCUMENTS]
    fingerprint = fingerprint_tokenizer_json(tok_dir, vocab)
    geometry = Geometry(max_batch=MAX_BATCH, max_positions=MAX_POSITIONS, vocab_size=vocab)
    services = [Service(tok_dir, vocab, args.fill_threads, advance, lanes)
                for lanes, advance in itertools.product(args.lanes, ADVANCE_CHOICES[args.advance])]
    rows_out = []
    try:
        for service in services:  # they start side by side
            service.wait_healthy()
        for repeat, (backend, workload, batch) in itertools.product(
                range(args.repeats), itertools.product(args.backends, args.workloads, args.batches)):
            for service in services_for(backend, services, repeat):
                t, service_us, phases = bench_one(service, backend, tok_dir, fingerprint, geometry, docs_ids,
                                                  workload, batch, args)
                advance = service.advance if backend == "llguidance" else "serial"
                lanes = service.lanes if backend == "llguidance" else None
                row = {"vocab": name, "vocab_size": vocab, "backend": backend, "workload": workload, "batch": batch,
                       "advance": advance, "lanes": lanes, "repeat": repeat,
                       "num_steps": len(t), "step_us_p50": float(np.percentile(t, 50)),
                       "step_us_p90": float(np.percentile(t, 90)), "step_us_p99": float(np.percentile(t, 99)),
                       "step_us_mean": float(t.mean()), "service_step_us": service_us,
                       "service_us_per_row": service_us / batch,
                       **{f"service_{p}_us": phases[p] for p in PHASES}}
                rows_out.append(row)
                print(f"{name:12s} {backend:10s} {workload:15s} {batch:5d} {advance:10s} {_lanes(lanes):>5s} "
                      f"{row['num_steps']:6d} "
                      f"{row['step_us_p50']:10.0f} {row['step_us_p90']:10.0f} {row['step_us_p99']:10.0f} "
                      f"{service_us:12.0f} {service_us / batch:10.1f} "
                      + " ".join(f"{phases[p]:8.0f}" for p in PHASES), flush=True)
    finally:
        for service in services:
            service.close()
    return rows_out


SUMMARY_KEYS = ("step_us_p50", "step_us_p90", "service_step_us", *(f"service_{p}_us" for p in PHASES))
GROUP_KEYS = ("vocab", "backend", "workload", "batch", "advance", "lanes")
AB_KEYS = ("service_step_us", "service_advance_us", "service_fill_us", "step_us_p50")


def _lanes(lanes: int | None) -> str:
    return "dflt" if lanes is None else str(lanes)


def summarize(results: list[dict], lanes_order: list[int | None]) -> list[dict]:
    """Medians and [min, max] over the repeats per (vocab, backend, workload, batch, advance,
    lanes). With both advance variants the parallel rows carry `advance_ab` (parallel / serial
    medians at the same lanes); with several lanes values the others carry `lanes_ab` (their
    medians over those of the first value in `lanes_order`, same advance)."""
    groups: dict[tuple, list[dict]] = {}
    for row in results:
        groups.setdefault(tuple(row[k] for k in GROUP_KEYS), []).append(row)
    summary = [{**dict(zip(GROUP_KEYS, key)), "repeats": len(rows),
                **{f"median_{k}": statistics.median(r[k] for r in rows) for k in SUMMARY_KEYS},
                **{f"range_{k}": [min(r[k] for r in rows), max(r[k] for r in rows)] for k in SUMMARY_KEYS}}
               for key, rows in groups.items()]
    by_key = {tuple(s[k] for k in GROUP_KEYS): s for s in summary}
    for s in summary:
        v, b, w, n, a, lanes = (s[k] for k in GROUP_KEYS)
        serial = by_key.get((v, b, w, n, "serial", lanes))
        if a == "parallel" and serial is not None:
            s["advance_ab"] = {f"{k}_parallel_over_serial": s[f"median_{k}"] / serial[f"median_{k}"] for k in AB_KEYS}
        base = by_key.get((v, b, w, n, a, lanes_order[0]))
        if b == "llguidance" and lanes != lanes_order[0] and base is not None:
            s["lanes_ab"] = {"over_lanes": lanes_order[0],
                             **{f"{k}_over_base": s[f"median_{k}"] / base[f"median_{k}"] for k in AB_KEYS}}
    return summary


def _median_range(s: dict, key: str) -> str:
    low, high = s[f"range_{key}"]
    return f"{s[f'median_{key}']:.0f} [{low:.0f}-{high:.0f}]"


def print_summary(summary: list[dict]) -> None:
    for s in summary:
        print(f"median [min-max] {s['vocab']:12s} {s['backend']:10s} {s['workload']:8s} {s['batch']:4d} "
              f"{s['advance']:8s} lanes {_lanes(s['lanes']):4s} p50 {_median_range(s, 'step_us_p50')} us  service "
              f"{_median_range(s, 'service_step_us')} us (advance {_median_range(s, 'service_advance_us')}, "
              f"fill {_median_range(s, 'service_fill_us')}, bookkeeping {_median_range(s, 'service_bookkeeping_us')})")
    for s in summary:
        if "advance_ab" in s:
            print(f"parallel/serial {s['vocab']:12s} {s['backend']:10s} {s['workload']:8s} {s['batch']:4d} "
                  f"lanes {_lanes(s['lanes']):4s}: {_ratios(s['advance_ab'], 'parallel_over_serial')}")
    for s in summary:
        if "lanes_ab" in s:
            print(f"lanes {_lanes(s['lanes'])}/{_lanes(s['lanes_ab']['over_lanes'])} {s['vocab']:12s} "
                  f"{s['workload']:8s} {s['batch']:4d} {s['advance']:8s}: {_ratios(s['lanes_ab'], 'over_base')}")


def _ratios(ab: dict, suffix: str) -> str:
    """An A/B's ratios of medians (`<key>_<suffix>`) as text: fill x0.46, advance x1.02, ..."""
    names = (("service_fill_us", "fill"), ("service_advance_us", "advance"),
             ("service_step_us", "service step"), ("step_us_p50", "engine p50"))
    return ", ".join(f"{label} x{ab[f'{key}_{suffix}']:.2f}" for key, label in names)


def run_info(args) -> dict:
    """What a result file says about the run besides its figures."""
    num_cpus = len(os.sched_getaffinity(0))
    default_lanes = GrammarServiceConfig().num_llguidance_lanes
    return {
        "benchmark": "grammar_step", "machine": args.machine, "cpu_count": os.cpu_count(), "cpus_available": num_cpus,
        "platform": platform.platform(), "processor": platform.processor(),
        **versions(("xgrammar", "llguidance")), "command": command_line(f"python {sys.argv[0]}"),
        "repeats": args.repeats, "advance": args.advance, "lanes": args.lanes, "num_schemas": args.num_schemas,
        "fill_threads": args.fill_threads,
        # 0 = each library's default: xgrammar hardware_concurrency / 2, llguidance's LLExecutor
        # 80% of available_parallelism clamped to [1, 32]
        "fill_threads_effective": {"xgrammar": args.fill_threads or max(1, (os.cpu_count() or 2) // 2),
                                   "llguidance": llguidance_fill_threads(args.fill_threads)},
        # grammar_service caps the lanes at llguidance's fill threads (0 counts as 1)
        "lanes_effective": {_lanes(lanes): llguidance_lanes(default_lanes if lanes is None else lanes, args.fill_threads)
                            for lanes in args.lanes},
        "load_average_at_end": os.getloadavg(), "max_positions": MAX_POSITIONS,
        "created": utc_now()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--machine", default=default_machine())
    parser.add_argument("--vocabs", nargs="+", default=list(VOCAB_SIZES), choices=list(VOCAB_SIZES))
    parser.add_argument("--workloads", nargs="+", default=["replay", "replay_drafts3", "random"],
                        choices=["replay", "replay_drafts3", "random"])
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 128])
    parser.add_argument("--steps", type=int, default=3200, help="steps x batch budget per configuration")
    parser.add_argument("--min-steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--fill-threads", type=int, default=0,
                        help="fill threads per backend; 0 = each library's default (fill_threads_effective)")
    parser.add_argument("--advance", default="configured", choices=list(ADVANCE_CHOICES),
                        help="llguidance's deferred advance: a Python list (serial), consume_token_par (parallel), "
                             "the service's threshold (configured), or serial and parallel interleaved (both)")
    parser.add_argument("--lanes", nargs="+", type=int, default=[None],
                        help="llguidance lanes per compiled grammar, one service per value (default: the service's "
                             "own; grammar_service caps them at its fill threads)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every configuration (summary: medians)")
    parser.add_argument("--num-schemas", type=int, default=len(DOCUMENTS), choices=range(1, len(DOCUMENTS) + 1),
                        metavar=f"1..{len(DOCUMENTS)}",
                        help="rows spread over this many schemas (llguidance: copies of one compiled grammar "
                             "share its lexer lock, so 1 is the worst case for its threads)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    print(f"{'vocab':12s} {'backend':10s} {'workload':15s} {'batch':>5s} {'variant':10s} {'lanes':>5s} {'steps':>6s} "
          f"{'p50 us':>10s} {'p90 us':>10s} {'p99 us':>10s} {'service us':>12s} {'us/row':>10s} {'advance':>8s} "
          f"{'fill':>8s} {'bookkeep':>8s}")
    started, load_at_start = time.time(), os.getloadavg()
    results = [row for name in args.vocabs for row in bench_vocab(name, args)]
    summary = summarize(results, args.lanes)
    out = write_result(args.out or ROOT / "benchmarks" / "results" / f"grammar_step-{args.machine}.json",
                       {**run_info(args), "load_average_at_start": load_at_start,
                        "wall_s": time.time() - started, "summary": summary, "results": results})
    print_summary(summary)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
