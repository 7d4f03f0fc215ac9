"""What the benchmarks share, so that each script holds only what it measures.

- a run's record: `code_commit` (STRUCTGEN_CODE_COMMIT first: the device tool's copy of the tree
  may carry a stale .git), `command_line`, `default_machine`, `utc_now`, `versions`, and
  `write_result` (the JSON file, its folder made), `nearest_rank` (a percentile of few values);
- `log`: a progress line with the time of day;
- model specs: `VOCAB` and `PAGE_SIZE` of the GPU benchmarks' random models, `tekken_dir` (the
  Tekken tokenizer they pair with), `preset_config` and `random_model_folder` (a preset's shape
  with another vocabulary and a real tokenizer beside it, for `--model random:<folder>/config.json`)
  and `engine_model_spec` (that spec, or plain `random:<preset>` without the tokenizer);
- processes: `ServeProcess` (`structgen serve` in its own process, up once it says where it
  listens), `free_port`, `WorkerProcess` (a spawned worker fed over a pipe, restarted after a kill).

No torch at import: CPU-only benchmarks import this too.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---- a run's record ------------------------------------------------------------------------------
def code_commit() -> str:
    """The short commit the code is at: $STRUCTGEN_CODE_COMMIT where set, else git's HEAD ("" without git)."""
    if commit := os.environ.get("STRUCTGEN_CODE_COMMIT"):
        return commit
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip()


def command_line(program: str, argv: list[str] | None = None) -> str:
    """`program` and the arguments (`argv`, else this process's): how to run it again."""
    return " ".join([program, *(sys.argv[1:] if argv is None else argv)])


def default_machine() -> str:
    """The --machine label when none is given: host name and CPU count."""
    return f"{socket.gethostname()}-{os.cpu_count()}cpu"


def scrape(url: str, timeout_s: float = 30) -> str:
    """The Prometheus text a `/metrics` URL serves (a service's scrape)."""
    import urllib.request
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def host_python_ms(repeats: int = 5) -> float:
    """This host's speed at the engine loop's kind of work: the best of `repeats` runs of a fixed
    pure-Python loop (dicts, lists, attribute reads), in ms. Host-bound serving figures of
    different machines compare only next to it."""
    import time

    class Row:
        __slots__ = ("tokens", "pages")

        def __init__(self, index: int) -> None:
            self.tokens, self.pages = [index], list(range(index % 8))

    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        rows = [Row(i) for i in range(20_000)]
        by_id = {id(row): row for row in rows}
        total = sum(len(row.pages) + row.tokens[-1] for row in rows if id(row) in by_id)
        best = min(best, (time.perf_counter() - started) * 1e3)
        assert total > 0
    return round(best, 2)


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def versions(packages: tuple[str, ...]) -> dict[str, str]:
    """Installed version of each package ("" where it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in packages:
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = ""
    return out


def write_result(path: str | os.PathLike, result: dict, indent: int = 1) -> pathlib.Path:
    """The result as JSON at `path` (its folder made first)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent) + "\n")
    return path


def nearest_rank(values: list[float], q: float) -> float | None:
    """The `q` quantile as the value at rank round(q (n - 1)) of the sorted values (None for none)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- model specs ---------------------------------------------------------------------------------
VOCAB = 131072   # the random models' vocabulary: Tekken's, so that grammars compile for them
PAGE_SIZE = 16   # KV cache page of the GPU benchmarks: EngineConfig's default


def tekken_dir() -> str:
    """The Tekken-131k tokenizer folder: $STRUCTGEN_TEKKEN_DIR, else where tests/real_tokenizers.py
    converts it to (a --tokenizer-dir default)."""
    return os.environ.get("STRUCTGEN_TEKKEN_DIR",
                          str(pathlib.Path.home() / ".cache/structgen/tokenizers/tekken_131k"))


def preset_config(shape: str, vocab_size: int, max_positions: int) -> dict:
    """config.json of a preset shape (generation_service/model/presets.py) with `vocab_size`
    and room for `max_positions` tokens, bf16."""
    from generation_service.model.presets import PRESETS

    c = PRESETS[shape]
    return {"architectures": [c.architecture], "model_type": "llama", "vocab_size": vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
            "max_position_embeddings": max_positions, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": 1, "eos_token_id": 2,
            "dtype": "bfloat16"}


def random_model_folder(shape: str, tokenizer_dir: str | os.PathLike, folder: pathlib.Path, vocab_size: int,
                        max_positions: int) -> pathlib.Path:
    """`folder` with the preset's config.json and the tokenizer's files beside it (those it
    has): random weights of that shape, `--model random:<folder>/config.json`."""
    tokenizer_dir = pathlib.Path(tokenizer_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(preset_config(shape, vocab_size, max_positions)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def engine_model_spec(preset: str, tokenizer_dir: str, folder: pathlib.Path) -> str:
    """random:<preset> with VOCAB and the Tekken tokenizer beside it (a constrained request needs
    the tokenizer grammar_service compiles for); random:<preset> (vocab 128256, no tokenizer: free
    only) without the tokenizer."""
    if not (pathlib.Path(tokenizer_dir) / "tokenizer.json").is_file():
        return f"random:{preset}"
    random_model_folder(preset, tokenizer_dir, folder, VOCAB, max_positions=4096)
    return f"random:{folder / 'config.json'}"


# ---- servers -------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(*flags: str) -> list[str]:
    """`structgen serve` with `flags`, run by this Python."""
    return [sys.executable, "-m", "structgen.cli", "serve", *flags]


class ServeProcess:
    """`structgen serve` started in its own process (stderr to `log_path`); up once its stdout
    says where it listens: `address` (host:port), `http_url` (when it serves the HTTP API too),
    `grammar_address` (its grammar child's), `startup_s`. Its later stdout is read away so that
    it never blocks on a full pipe. `cwd`: the checkout whose code runs (another commit's)."""

    def __init__(self, command: list[str], log_path: pathlib.Path, env: dict[str, str] | None = None,
                 cwd: pathlib.Path = ROOT) -> None:
        self.command, self.log_path = command, log_path
        started = time.monotonic()
        self.process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=open(log_path, "w"),
                                        text=True, env={**os.environ, **(env or {})})
        self.http_url: str | None = None
        self.address = self.grammar_address = ""
        for line in self.process.stdout:
            if found := re.search(r"HTTP API on (\S+)", line):
                self.http_url = found.group(1)
            elif found := re.search(r"listening on (\S+)", line):
                self.address = found.group(1)
                self.grammar_address = re.search(r"grammar_service at (\S+?)\)?$", line.strip()).group(1)
                break
        if not self.address:
            self.process.kill()
            raise RuntimeError(f"structgen serve did not start:\n{log_path.read_text()[-3000:]}")
        self.startup_s = time.monotonic() - started
        threading.Thread(target=lambda: [None for _ in self.process.stdout], daemon=True).start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_lines(self, pattern: str) -> list[str]:
        return [line.strip() for line in self.log_path.read_text().splitlines() if re.search(pattern, line)]

    def stop(self, timeout_s: float = 60) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; its exit code."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


class WorkerProcess:
    """A worker in a spawned process, fed jobs over a pipe (`conn`): started by the first
    `send` and again after `kill` (a job past its time). `target(conn, *args)` sends "ready"
    once it can take work, then answers jobs until it receives None."""

    def __init__(self, name: str, target, args: tuple, start_timeout_s: float) -> None:
        self.name, self.target, self.args, self.start_timeout_s = name, target, args, start_timeout_s
        self.proc = self.conn = None

    def send(self, job) -> None:
        if self.proc is None or not self.proc.is_alive():
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=self.target, args=(child, *self.args), daemon=True)
            self.proc.start()
            if not self.conn.poll(self.start_timeout_s) or self.conn.recv() != "ready":
                raise RuntimeError(f"{self.name} did not start")
        self.conn.send(job)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.proc = None

    def close(self) -> None:
        if self.proc is not None:
            self.conn.send(None)
            self.proc.join(10)
