"""Soak: many streams against a real `structgen serve` for minutes; errors and memory growth.

Starts `structgen serve` (default model unless --model), then keeps --streams concurrent
clients busy for --minutes with a mix of free, JSON-Schema, regex and choice requests (a schema from a
pool of 256 now and then, with the grammar child's cache at 64, so compiles and evictions
keep happening and memory can settle). Samples the RSS of serve and of every
grammar_service process below it (serving child, standby, compile workers) every
--sample-s. Pass: 0 errors, and after --warmup-minutes the RSS of serve and of the serving
grammar child grows by less than 5 %. Writes benchmarks/results/soak-<label>.json.

    .venv/bin/python -m benchmarks.soak --label ci-2core                 # 32 streams, 10 minutes
    .venv/bin/python -m benchmarks.soak --label quick --minutes 2 --warmup-minutes 0.5
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._harness import ServeProcess, code_commit, command_line, serve_command, write_result  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
NUM_SCHEMAS = 256         # distinct "new" schemas, beyond...
MAX_CACHED_GRAMMARS = 64  # ...the grammar child's cache, so memory reaches a steady state


def _rss_mib(pid: int) -> float | None:
    try:
        return int(pathlib.Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / (1 << 20)
    except (OSError, IndexError):
        return None


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in pathlib.Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _serving_grammar_pid(serve_pid: int) -> int | None:
    """The child listening on grammar.sock: the one whose socket inode the folder's file has."""
    for pid in pathlib.Path(f"/proc/{serve_pid}/task").glob("*/children"):
        for child in pid.read_text().split():
            cmdline = pathlib.Path(f"/proc/{child}/cmdline").read_bytes()
            if b"grammar.sock" in cmdline:
                return int(child)
    return None


def _start(model: str | None, log_path: pathlib.Path) -> ServeProcess:
    flags = ["--port", "0", "--max-batch", "64"]
    if model:
        flags += ["--model", model]
    return ServeProcess(serve_command(*flags), log_path,
                        env={"STRUCTGEN_GRAMMAR_MAX_CACHED_GRAMMARS": str(MAX_CACHED_GRAMMARS)})


def _requests(rng: random.Random) -> dict:
    kind = rng.choice(["free", "schema", "new-schema", "regex", "choice"])
    if kind == "free":
        return {"max_tokens": rng.randint(8, 48)}
    if kind == "schema":
        return {"max_tokens": 48, "json_schema": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}, "required": ["name", "age"]}}
    if kind == "new-schema":  # from a pool larger than the grammar cache: compiles and evictions go on
        field = f"f{rng.randrange(NUM_SCHEMAS)}"
        return {"max_tokens": 32, "json_schema": {"type": "object", "properties": {field: {"type": "boolean"}},
                                                  "required": [field]}}
    if kind == "regex":
        return {"max_tokens": 24, "regex": r"[A-Z][a-z]{2,8} [0-9]{1,3}"}
    return {"max_tokens": 8, "choices": ["red", "green", "blue", "yellow"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="local")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-minutes", type=float, default=1.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "clients" / "python"))
    from structgen_client import Client

    log_path = pathlib.Path(f"/tmp/structgen-soak-{os.getpid()}.log")
    server = _start(args.model, log_path)
    process, address = server.process, server.address
    print(f"serve pid {process.pid} at {address}; log {log_path}", flush=True)
    stop_at = time.monotonic() + args.minutes * 60
    counts = {"ok": 0, "errors": 0, "tokens": 0}
    errors: list[str] = []
    lock = threading.Lock()

    def client_loop(index: int) -> None:
        rng = random.Random(index)
        with Client(address, timeout=120) as client:
            while time.monotonic() < stop_at:
                kwargs = _requests(rng)
                try:
                    result = client.generate_text(f"Request {index}:", **kwargs)
                    with lock:
                        counts["ok"] += 1
                        counts["tokens"] += len(result.token_ids)
                except Exception as error:  # noqa: BLE001 -- every error counts
                    with lock:
                        counts["errors"] += 1
                        errors.append(f"{type(error).__name__}: {error}"[:300])
                        if counts["errors"] <= 5:
                            print(f"error: {errors[-1]}", flush=True)

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(args.streams)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    samples = []
    while time.monotonic() < stop_at:
        time.sleep(args.sample_s)
        grammar_pid = _serving_grammar_pid(process.pid)
        sample = {"t_s": round(time.monotonic() - started, 1), "serve_mib": _rss_mib(process.pid),
                  "grammar_pid": grammar_pid, "grammar_mib": _rss_mib(grammar_pid) if grammar_pid else None,
                  "all_grammar_mib": round(sum(_rss_mib(p) or 0 for p in _descendants(process.pid)), 1),
                  **counts}
        samples.append(sample)
        print(json.dumps(sample), flush=True)
    for thread in threads:
        thread.join(180)
    exit_code = server.stop(timeout_s=120)

    warm = [s for s in samples if s["t_s"] >= args.warmup_minutes * 60]
    growth = {}
    for key in ("serve_mib", "grammar_mib"):
        values = [s[key] for s in warm if s[key] is not None]
        growth[key] = round((values[-1] - values[0]) / values[0] * 100, 2) if len(values) >= 2 else None
    same_grammar = len({s["grammar_pid"] for s in warm}) == 1
    passed = (counts["errors"] == 0 and same_grammar and all(g is not None and g < 5 for g in growth.values()))
    summary = {"passed": passed, "requests_ok": counts["ok"], "errors": counts["errors"], "tokens": counts["tokens"],
               "rss_growth_after_warmup_pct": growth, "grammar_child_restarted": not same_grammar,
               "serve_exit_code": exit_code, "first_errors": errors[:10]}
    print(json.dumps(summary, indent=1))
    out = write_result(ROOT / "benchmarks" / "results" / f"soak-{args.label}.json", {
        "benchmark": "soak", "command": command_line("python -m benchmarks.soak", argv or None),
        "commit": code_commit(), "cpus": len(os.sched_getaffinity(0)), "streams": args.streams,
        "minutes": args.minutes, "warmup_minutes": args.warmup_minutes, "summary": summary, "samples": samples})
    print(f"wrote {out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
