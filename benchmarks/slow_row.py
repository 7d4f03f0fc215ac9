"""One slow grammar among ordinary requests (issue 19 point 6): do the others wait for it?

    python benchmarks/slow_row.py --label cpu-2core --out benchmarks/results/slow_row-cpu-2core.json
    python benchmarks/slow_row.py --device cuda --model <8B or 1B shape> --label h200 ...   # on the GPU host

The real `structgen serve`, whose grammar_service makes every mask fill of a grammar containing
MARKER take --slow-fill-ms longer (GrammarServiceConfig.slow_fill_ms: an adversarial grammar on
demand, as slow as asked). Workloads, each --repeats times, alternating:
- baseline: --num-ordinary constrained requests at once (a JSON Schema, greedy);
- slow: the same, started once a marked request (the slow row) streams its first token.
Both on a server with isolate_slow_rows on, then `slow` again on a server with it off
(`lockstep`: every step waits for the slow row). Per workload: the ordinary requests'
inter-token p50 / p90 (gap between streamed messages over their tokens, from each request's
second message on; for `slow` only gaps that ended while the slow row was running), and the slow
row's tokens, time and validation, and the engine's steps over it (GetEngineStats: all, mixed,
and the loop's seconds in each kind). The figure: ordinary p50 slow / baseline (target <= 1.05).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from benchmarks._harness import ServeProcess, code_commit, command_line, serve_command, write_result  # noqa: E402

MARKER = "structgen-benchmark-slow-fill"
ORDINARY = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 8, "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 4}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
SLOW = {"type": "object", "description": MARKER,
        "properties": {"motto": {"type": "string", "minLength": 40, "maxLength": 60}},
        "required": ["motto"], "additionalProperties": False}
STANDBY_READY = "is ready to take over"  # structgen/supervisor.py, once the standby child is up


def start_server(args, isolate: bool, log_path: pathlib.Path) -> ServeProcess:
    """`structgen serve` with the slow-fill setting, once its standby grammar child is up."""
    flags = ["--port", "0", "--device", args.device,
             "--max-batch", str(args.num_ordinary + 1), "--num-workers", str(args.num_ordinary + 16)]
    if args.model:
        flags += ["--model", args.model]
    server = ServeProcess(serve_command(*flags), log_path, env={
        "PYTHONUNBUFFERED": "1", "STRUCTGEN_GRAMMAR_SLOW_FILL_MS": str(args.slow_fill_ms),
        "STRUCTGEN_GRAMMAR_SLOW_FILL_MARKER": MARKER,
        "STRUCTGEN_GRAMMAR_ISOLATE_SLOW_ROWS": "true" if isolate else "false"})
    # NOTE: the standby grammar child loads its tokenizer after the server is up; on a small
    # machine that load would be measured as the workload's.
    deadline = time.monotonic() + 600
    while STANDBY_READY not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(1)
    return server


def _stream(client, prompt: str, schema: dict, max_tokens: int, out: dict, first: threading.Event | None = None):
    """Streams one request into `out`: (arrival time, tokens) per message, text, final chunk."""
    out["messages"], text = [], []
    for chunk in client.generate(prompt, json_schema=schema, compact=True, temperature=0.0, max_tokens=max_tokens):
        out["messages"].append((time.monotonic(), len(chunk.token_ids)))
        text.append(chunk.text)
        if chunk.token_ids and first is not None:
            first.set()
        if chunk.finish_reason:
            out["final"] = chunk
    out["text"] = "".join(text)
    if first is not None:
        first.set()


def _gaps(messages: list[tuple[float, int]], until: float | None) -> list[float]:
    """Per-token inter-token gaps from the second token-bearing message on, ending before `until`."""
    timed = [(t, n) for t, n in messages if n]
    gaps = []
    for (t0, _), (t1, n) in zip(timed, timed[1:]):
        if until is None or t1 <= until:
            gaps += [(t1 - t0) / n] * n
    return gaps


def _step_counts(address: str) -> dict:
    """The engine's step counters (GetEngineStats): what kind of steps a workload ran."""
    import grpc
    from structgen.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
    with grpc.insecure_channel(address) as channel:
        r = pb_grpc.GenerationServiceStub(channel).GetEngineStats(pb.GetEngineStatsRequest(), timeout=30)
    return {"steps": r.num_steps, "mixed_steps": r.num_mixed_steps,
            "graph_step_s": r.graph_step_seconds, "mixed_step_s": r.mixed_step_seconds,
            "late_rows": r.num_late_rows, "held_graph_host_steps": r.num_held_graph_host_steps}


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run_workload(client, args, with_slow: bool, repeat: int) -> dict:
    slow, first = {}, threading.Event()
    slow_thread = None
    started = time.monotonic()
    if with_slow:
        slow_thread = threading.Thread(target=_stream, args=(client, f"A motto ({repeat}):", SLOW,
                                                             args.slow_max_tokens, slow, first))
        slow_thread.start()
        first.wait(600)  # its first fill, timed alone, is behind it: it is known slow
    ordinary = [{} for _ in range(args.num_ordinary)]
    threads = [threading.Thread(target=_stream, args=(client, f"Person {repeat}-{i}:", ORDINARY,
                                                      args.max_tokens, ordinary[i]))
               for i in range(args.num_ordinary)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ordinary_done = time.monotonic()
    if slow_thread is not None:
        slow_thread.join()
    slow_end = slow["messages"][-1][0] if with_slow else None
    gaps = [g for o in ordinary for g in _gaps(o["messages"], slow_end)]
    valid = sum(1 for o in ordinary if o.get("final") is not None and o["final"].validation is not None
                and o["final"].validation.valid)
    result = {"ordinary_inter_token_ms": {"p50": round(1e3 * _percentile(gaps, 0.5), 2),
                                          "p90": round(1e3 * _percentile(gaps, 0.9), 2), "num_gaps": len(gaps)},
              "ordinary_valid": f"{valid}/{args.num_ordinary}",
              "ordinary_s": round(ordinary_done - started, 2)}
    if with_slow:
        final = slow.get("final")
        result["slow_row"] = {
            "tokens": sum(n for _, n in slow["messages"]), "s": round(slow_end - started, 2),
            "finish_reason": final.finish_reason if final else None,
            "valid": bool(final and final.validation and final.validation.valid), "text": slow["text"]}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="the machine, e.g. cpu-2core or h200")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="structgen serve --model (default: the built-in model)")
    parser.add_argument("--num-ordinary", type=int, default=63)
    parser.add_argument("--max-tokens", type=int, default=48, help="of each ordinary request")
    parser.add_argument("--slow-max-tokens", type=int, default=64)
    parser.add_argument("--slow-fill-ms", type=float, default=2000.0,
                        help="extra time of each of the slow row's mask fills (several of the batch's steps)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-lockstep", dest="lockstep", action="store_false",
                        help="skip the server with isolate_slow_rows off (its figures are then absent)")
    args = parser.parse_args(argv)
    from structgen_client import Client

    runs: dict[str, list[dict]] = {"baseline": [], "slow": [], "lockstep": []}
    load_before = os.getloadavg()[0]  # a shared machine's other work is noise in every figure
    log_dir = args.out.parent
    for isolate in (True, False) if args.lockstep else (True,):
        log_path = log_dir / f"{args.out.stem}-{'isolated' if isolate else 'lockstep'}.log"
        print(f"starting structgen serve (isolate_slow_rows={isolate}); log {log_path}", flush=True)
        server = start_server(args, isolate, log_path)
        try:
            with Client(server.address, timeout=1200) as client:
                run_workload(client, args, with_slow=False, repeat=-1)  # warm: compiles, first shapes
                for repeat in range(args.repeats):
                    kinds = (("baseline", False), ("slow", True)) if isolate else (("lockstep", True),)
                    for name, with_slow in kinds:
                        before = _step_counts(server.address)
                        result = run_workload(client, args, with_slow, repeat)
                        after = _step_counts(server.address)
                        result["engine_steps"] = {k: round(after[k] - before[k], 3) for k in after}
                        print(f"{name} #{repeat}: {json.dumps(result)}", flush=True)
                        runs[name].append(result)
        finally:
            server.stop(timeout_s=120)
            log_path.unlink(missing_ok=True)  # the log is only for a failed start

    def p50(name: str) -> float | None:
        values = [r["ordinary_inter_token_ms"]["p50"] for r in runs[name]]
        return round(statistics.median(values), 2) if values else None
    summary = {"ordinary_p50_ms": {name: p50(name) for name in runs},
               "slow_over_baseline_p50": round(p50("slow") / p50("baseline"), 3),
               "lockstep_over_baseline_p50": round(p50("lockstep") / p50("baseline"), 3) if runs["lockstep"] else None,
               "slow_rows_valid": all(r["slow_row"]["valid"] for r in runs["slow"] + runs["lockstep"])}
    result = {"benchmark": "slow_row", "label": args.label,
              "command": command_line("python benchmarks/slow_row.py", argv),
              "commit": code_commit(),
              "machine": {"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                          "device": args.device,
                          "load_average_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)]},
              "settings": {"num_ordinary": args.num_ordinary, "max_tokens": args.max_tokens,
                           "slow_fill_ms": args.slow_fill_ms, "repeats": args.repeats},
              "summary": summary, "runs": runs}
    write_result(args.out, result)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
