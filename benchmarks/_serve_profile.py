"""serve.py --profile: py-spy on the server's processes through a workload, and a summary of its
stacks small enough for the result."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

from benchmarks._harness import ServeProcess, log
from benchmarks._serve_load import Workload


def profile_server(args, server: ServeProcess, shape: str, workload: Workload) -> dict[str, subprocess.Popen]:
    """`--profile TEXT`: py-spy samples the server through a workload whose name holds TEXT, one
    recorder per process ("serving", and "engine" when the engine runs in a process of its own):
    the GIL holder (`--profile-mode gil`) or every thread, idle or not (`wall`); the stacks (py-spy's
    raw format) go beside --out."""
    if not args.profile or args.profile not in workload.name:
        return {}
    places = [pathlib.Path(sys.prefix), *map(pathlib.Path, sys.path)]  # a venv's bin/, pip --target's bin/
    spy = shutil.which("py-spy") or next((str(p / "bin" / "py-spy") for p in places if (p / "bin" / "py-spy").is_file()),
                                         None)
    if spy is None:
        log("--profile: no py-spy found")
        return {}
    name = re.sub(r"[^A-Za-z0-9]+", "-", f"{shape} {workload.name}").strip("-")
    seconds = int(workload.warmup_s + workload.duration_s + 3)
    mode = ["--gil"] if args.profile_mode == "gil" else ["--idle"]
    pids = {"serving": server.process.pid}
    engine = engine_process_pid(server.process.pid)
    if engine is not None:
        pids["engine"] = engine
    recorders = {}
    for process, pid in pids.items():
        out = pathlib.Path(args.out).with_name(f"{pathlib.Path(args.out).stem}-profile-{name}-{process}.txt")
        recorders[process] = subprocess.Popen(
            [spy, "record", "--pid", str(pid), *mode, "--threads", "--nonblocking", "--rate", "200",
             "--duration", str(seconds), "--format", "raw", "--output", str(out)],
            stdout=subprocess.DEVNULL, stderr=open(str(out) + ".log", "w"))
    return recorders


def engine_process_pid(server_pid: int) -> int | None:
    """The engine process under `structgen serve` (--engine-process: a multiprocessing spawn child)."""
    for entry in pathlib.Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == server_pid \
                    and b"multiprocessing.spawn" in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except OSError:
            continue
    return None


def profile_summary(raw: pathlib.Path, seconds: float, rate: int = 200, top: int = 25) -> dict:
    """What py-spy's raw stacks say, small enough for the result: the share of the window each
    thread was sampled (under `--gil`: held the GIL), and the functions (inclusive) with the
    largest shares, overall and per thread. Shares are of rate x seconds samples."""
    if not raw.is_file():
        return {"error": f"no profile at {raw.name}"}
    threads, functions, total = {}, {}, 0
    per_thread: dict[str, dict[str, int]] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, n = stack.split(";"), int(count)
        total += n
        thread = re.sub(r"^thread \(\w+\):\s*|\s*\(idle\)", "", frames[0]).strip() or frames[0]
        threads[thread] = threads.get(thread, 0) + n
        mine = per_thread.setdefault(thread, {})
        for frame in set(re.sub(r" \(.*?:\d+\)$", "", f) for f in frames[1:]):  # a function once per stack
            functions[frame] = functions.get(frame, 0) + n
            mine[frame] = mine.get(frame, 0) + n
    window = rate * seconds
    share = lambda n: round(n / window, 4)  # noqa: E731
    return {"samples": total, "window_samples": int(window), "sampled_share": share(total),
            "threads": {t: share(n) for t, n in sorted(threads.items(), key=lambda kv: -kv[1])},
            "top_functions": {f: share(n) for f, n in sorted(functions.items(), key=lambda kv: -kv[1])[:top]},
            "thread_functions": {t: {f: share(n) for f, n in sorted(fs.items(), key=lambda kv: -kv[1])[:top]}
                                 for t, fs in per_thread.items()}}
