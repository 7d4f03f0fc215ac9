"""How long grammar_service takes to be ready to serve, for the built-in model's tokenizer (49k)
and Tekken (131k), and how long `structgen serve` takes to say it listens.

- `fresh`: `structgen grammar --tokenizer-dir ...` started from nothing, spawn to SERVING
  (compile workers up): with an empty tokenizer cache, then with the one that run filled;
- `forked` (`structgen.supervisor`, this tree only): the template's first child (imports and
  the cached tokenizer included), then each standby after a takeover, from the kill to the next
  standby's SERVING, with the CPU seconds that standby's processes spent starting;
- `steps` (this tree only): a fresh process's imports, tokenizer load from the files and from
  the cache, the fingerprint alone, and what the template derives beyond them;
- `serve`: `structgen serve` to `listening`, with the built-in model and with a two-layer
  random model over Tekken's vocabulary.
`--root` runs `fresh` and `serve` from another checkout (`forked` is skipped where the tree has
no template).

    .venv/bin/python benchmarks/grammar_startup.py --machine ci-2core \\
        --out benchmarks/results/grammar_startup-ci-2core.json [--root /old/checkout --measured-commit C]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from _harness import ServeProcess, code_commit, command_line, default_machine, log, serve_command, tekken_dir, \
    utc_now, write_result  # noqa: E402
from structgen.supervisor import wait_healthy  # noqa: E402

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 131072,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 1,
              "eos_token_id": 2, "dtype": "float32"}


def builtin_tokenizer_dir() -> str:
    """The built-in model's tokenizer folder (converted from its GGUF file once)."""
    from generation_service.model.gguf_reader import GgufFile, find_gguf_file
    from generation_service.model.gguf_tokenizer import ensure_gguf_tokenizer
    from structgen.builtin_models import resolve_builtin
    return str(ensure_gguf_tokenizer(GgufFile.open(find_gguf_file(pathlib.Path(resolve_builtin("default"))))))


def fresh_start_s(root: pathlib.Path, tokenizer: str, vocab: int, cache: pathlib.Path) -> float:
    folder = tempfile.mkdtemp(prefix="gstart-")
    argv = [sys.executable, "-m", "structgen.cli", "grammar", "--listen", f"unix://{folder}/g.sock",
            "--tokenizer-dir", tokenizer, "--vocab-size", str(vocab)]
    started = time.monotonic()
    process = subprocess.Popen(argv, cwd=root, env={**os.environ, "STRUCTGEN_CACHE": str(cache), "TMPDIR": folder},
                               stderr=subprocess.DEVNULL)
    try:
        assert wait_healthy(f"unix://{folder}/g.sock", 300, process), "grammar_service did not start"
        return round(time.monotonic() - started, 2)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


def steps(tokenizer: str, vocab: int, cache: str) -> dict:
    """In a fresh process (spawned): the parts of a start-up, one after the other."""
    os.environ["STRUCTGEN_CACHE"] = cache
    timed = {}
    started = time.monotonic()
    from grammar_service.server import preload_backends
    preload_backends()
    timed["imports_s"] = time.monotonic() - started
    from grammar_service import tokenizer as loader
    from structgen.tokenizer_identity import fingerprint_tokenizer_json
    for name, clear_cache in (("tokenizer_from_files_s", True), ("tokenizer_from_cache_s", False)):
        loader._last.clear()
        if clear_cache:
            import shutil
            shutil.rmtree(cache, ignore_errors=True)
        started = time.monotonic()
        data, _ = loader.load_tokenizer(tokenizer, vocab)  # from files: the xgrammar part derived too
        timed[name] = time.monotonic() - started
    started = time.monotonic()
    fingerprint_tokenizer_json(tokenizer, vocab)
    timed["of_which_fingerprint_s"] = time.monotonic() - started
    started = time.monotonic()
    loader.derive_all(data)
    timed["derive_text_and_llguidance_s"] = time.monotonic() - started
    return {key: round(value, 2) for key, value in timed.items()}


def _tree_cpu_s(pid: int) -> float:
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            fields = pathlib.Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
            for task in pathlib.Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return total / os.sysconf("SC_CLK_TCK")


def forked(tokenizer: str, vocab: int, repeats: int) -> dict:
    from structgen.supervisor import GrammarSupervisor
    started = time.monotonic()
    supervisor = GrammarSupervisor()
    supervisor.spawn()
    supervisor.use_tokenizer(tokenizer, vocab)
    supervisor.wait_ready()
    first_s = time.monotonic() - started
    standby_s, cpu_s = [], []
    try:
        for _ in range(repeats):
            while supervisor.standby_pid is None:
                time.sleep(0.005)
            cpu_s.append(_tree_cpu_s(supervisor.standby_pid))
            takeovers, killed = supervisor.num_takeovers, time.monotonic()
            os.kill(supervisor.pid, signal.SIGKILL)
            while supervisor.num_takeovers == takeovers or supervisor.standby_pid is None:
                time.sleep(0.005)
            standby_s.append(time.monotonic() - killed)
    finally:
        supervisor.stop()
    return {"template_first_child_s": round(first_s, 2), "kill_to_next_standby_s": _summary(standby_s),
            "standby_start_cpu_s": _summary(cpu_s)}


def _summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "max": round(max(values), 3), "n": len(values)}


def serve_start_s(root: pathlib.Path, model: str, folder: pathlib.Path) -> float:
    server = ServeProcess(serve_command("--host", "127.0.0.1", "--port", "0", "--model", model), folder / "serve.log",
                          cwd=root)
    server.stop()
    return round(server.startup_s, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=pathlib.Path, default=ROOT)
    parser.add_argument("--measured-commit", help="the commit of --root when it is no git checkout")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--machine", default=default_machine())
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    root = args.root.resolve()
    tokenizers = {"builtin-49k": (builtin_tokenizer_dir(), 49152), "tekken-131k": (tekken_dir(), 131072)}
    result = {"benchmark": "grammar_startup", "command": command_line("benchmarks/grammar_startup.py"),
              "machine": args.machine, "code_commit": code_commit(), "measured_commit": args.measured_commit or
              code_commit(), "utc": utc_now(), "load_average_at_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        for name, (tokenizer, vocab) in tokenizers.items():
            cache = tmp / f"cache-{name}"
            result[name] = {"fresh_empty_cache_s": fresh_start_s(root, tokenizer, vocab, cache),
                            "fresh_filled_cache_s": fresh_start_s(root, tokenizer, vocab, cache)}
            if (root / "grammar_service" / "template.py").is_file():
                result[name]["forked"] = forked(tokenizer, vocab, args.repeats)
                with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    result[name]["steps"] = pool.submit(steps, tokenizer, vocab, str(tmp / "steps")).result()
            log(f"{name}: {result[name]}")
        tiny = tmp / "tiny"
        tiny.mkdir()
        (tiny / "config.json").write_text(json.dumps(TINY_LLAMA))
        for file in ("tokenizer.json", "tokenizer_config.json"):
            (tiny / file).write_bytes((pathlib.Path(tekken_dir()) / file).read_bytes())
        result["serve_listening_s"] = {"default": serve_start_s(root, "default", tmp),
                                       "tiny-random-tekken-131k": serve_start_s(root, f"random:{tiny}/config.json", tmp)}
    result["load_average_at_end"] = os.getloadavg()
    log(json.dumps(result))
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
