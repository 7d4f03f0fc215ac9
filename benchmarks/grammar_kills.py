"""The serving grammar child killed under constrained and free load: how soon constrained requests
are served again, and what fails.

Starts `structgen serve` (default model, CPU) from `--root` (this tree, or a checkout of an
older commit: the load, the kills and the timing are this tree's), runs the load of
tests/integration/grammar_kills.py and SIGKILLs the process listening on the serving grammar
socket 1 s after serve says it listens, right after the takeover that follows, and right after
that one. Per kill: seconds to the first token of a constrained request made right after it,
and to its end; then every request's outcome counted by kind, and serve's start-up time.

    .venv/bin/python benchmarks/grammar_kills.py --machine ci-2core \\
        --out benchmarks/results/grammar_kills-ci-2core.json [--root /path/to/old/checkout]
"""
from __future__ import annotations

import argparse
import collections
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "integration"), str(ROOT / "benchmarks")]

from _harness import ServeProcess, code_commit, command_line, default_machine, log, serve_command, utc_now, \
    write_result  # noqa: E402
from grammar_kills import Load, in_flight, kill_serving, losses  # noqa: E402
from structgen_client import Client  # noqa: E402


def commit_of(root: pathlib.Path) -> str:
    """git's HEAD at `root` ("" outside git: then say it with --measured-commit)."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def run(root: pathlib.Path, log_path: pathlib.Path) -> dict:
    server = ServeProcess(serve_command("--host", "127.0.0.1", "--port", "0"), log_path,
                          env={"PYTHONUNBUFFERED": "1"}, cwd=root)
    listening_at = time.monotonic()
    folder = pathlib.Path(server.grammar_address.removeprefix("unix://")).parent
    load = Load(server.address)
    threads = load.run()
    kills = []
    try:
        with Client(server.address, timeout=120) as client:
            time.sleep(max(0.0, listening_at + 1.0 - time.monotonic()))  # the first moment measured
            for _ in range(3):  # then right after each takeover
                kills.append(kill_serving(folder, client, give_up_s=300))
                log(f"kill of pid {kills[-1].pid}: constrained first token after {kills[-1].recovered_s:.2f} s")
    finally:
        load.stop.set()
        for thread in threads:
            thread.join(120)
        server.stop()
    lost = losses(log_path.read_text())
    outcomes = load.outcomes + [attempt for kill in kills for attempt in kill.attempts]
    failed = [o for o in outcomes if o.error]
    return {
        "serve_startup_s": round(server.startup_s, 2),
        "kills": [{"moment": moment, "first_token_s": round(kill.recovered_s, 3),
                   "done_s": round(kill.attempts[-1].ended - kill.at, 3), "attempts": len(kill.attempts)}
                  for moment, kill in zip(("1 s after listening", "right after the takeover", "right after that"),
                                          kills)],
        "requests": dict(collections.Counter(o.kind for o in outcomes)),
        "failed": dict(collections.Counter(f"{o.kind}: {o.error.split(':')[0]}" for o in failed)),
        "failed_not_in_flight": sum(1 for o in failed if not in_flight(o, kills, lost)),
        "invalid_outputs": len(load.invalid),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=pathlib.Path, default=ROOT, help="the checkout whose serve is measured")
    parser.add_argument("--measured-commit", help="the commit of --root when it is no git checkout (git archive)")
    parser.add_argument("--machine", default=default_machine())
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.root.resolve(), pathlib.Path(tmp) / "serve.log")
    result = {"benchmark": "grammar_kills", "command": command_line("benchmarks/grammar_kills.py"),
              "machine": args.machine, "code_commit": code_commit(), "measured_commit": args.measured_commit or commit_of(args.root),
              "load_average": os.getloadavg(), "utc": utc_now(), **result}
    log(str(result))
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
