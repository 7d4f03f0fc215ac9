"""`structgen serve --tensor-parallel 2` (two gloo ranks on the CPU) as users run it, over gRPC:
the same greedy tokens as one process, free and constrained (every constrained output
validated); a model whose heads do not divide is refused before anything starts; a rank that
dies ends the server with a nonzero exit naming the rank and leaves no process behind. Both
servers dial one grammar_service (the supervised child and its standby are tested elsewhere)."""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import jsonschema
import pytest

from live_server import ROOT, start_serve, stop_serve
from structgen.supervisor import wait_healthy
from structgen_client import Client, StructgenError

ARGS = ["--model", "tiny-random", "--max-new-tokens-limit", "64", "--max-prompt-tokens", "256"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far"]
REGEX = r"[a-z]{2,8}-[0-9]{1,3}"
HF_CONFIG_6_HEADS = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 96,
    "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 2,
}
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["colour", "size"], "additionalProperties": False}


def _descendants(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        for task in pathlib.Path(f"/proc/{stack.pop()}/task").iterdir():
            children = [int(c) for c in (task / "children").read_text().split()]
            found += children
            stack += children
    return found


def _is_alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> str:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.fixture(scope="module")
def grammar_address(tmp_path_factory):
    """One grammar_service both servers dial (each would otherwise spawn two of its own)."""
    address = f"unix://{tmp_path_factory.mktemp('tp-grammar') / 'grammar.sock'}"
    process = subprocess.Popen([sys.executable, "-m", "structgen.cli", "grammar", "--listen", address],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_healthy(address, 120, process), f"grammar_service not healthy (exit code {process.poll()})"
    yield address
    process.terminate()
    process.wait(30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, grammar_address):
    """(TP=1, TP=2) servers of the tiny-random model, started side by side."""
    folder = tmp_path_factory.mktemp("tensor-parallel")
    started: dict[int, object] = {}

    def start(world_size: int) -> None:
        started[world_size] = start_serve([*ARGS, f"--grammar-address={grammar_address}",
                                           "--tensor-parallel", str(world_size)],
                                          folder / f"serve-tp{world_size}.log")

    threads = [threading.Thread(target=start, args=(n,)) for n in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(started) == {1, 2}, "a server did not start (see the failure above)"
    yield started[1], started[2]
    for server in started.values():
        if server.process.poll() is None:
            stop_serve(server)


def _both(servers, **options):
    completions = []
    for server in servers:
        with Client(server.address, timeout=120) as client:
            completions.append(client.generate_text(temperature=0, **options))
    return completions


def test_tp2_gives_the_greedy_tokens_of_one_process_free_and_constrained(servers):
    for prompt in PROMPTS:
        one, two = _both(servers, prompt=prompt, max_tokens=12)
        assert len(one.token_ids) == 12 and two.token_ids == one.token_ids, prompt
    one, two = _both(servers, prompt=PROMPTS[0], max_tokens=24, regex=REGEX)
    assert re.fullmatch(REGEX, two.text) and two.token_ids == one.token_ids
    one, two = _both(servers, prompt=PROMPTS[1], max_tokens=32, json_schema=SCHEMA, compact=True)
    jsonschema.validate(json.loads(two.text), SCHEMA)
    assert two.validation.valid and two.token_ids == one.token_ids
    with Client(servers[1].address, timeout=30) as client:
        stats = client.engine_stats()
    assert stats.num_kv_pages_used == 0 and stats.num_finished >= len(PROMPTS) + 2


def test_heads_that_do_not_divide_are_refused_before_anything_starts(tmp_path):
    config = dict(HF_CONFIG_6_HEADS)
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "structgen.cli", "serve", "--port", "0",
                           "--model", f"random:{tmp_path / 'config.json'}", "--tensor-parallel", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "--tensor-parallel 4: the model's 6 attention heads do not divide over 4 ranks" in proc.stderr
    assert "grammar_service" not in proc.stderr  # refused before any child started


def test_a_dead_rank_ends_the_server_naming_it_with_no_process_left(servers):
    """Runs last: it ends the module's TP=2 server."""
    server = servers[1]
    children = _descendants(server.process.pid)
    workers = [pid for pid in children if "generation_service.parallel.worker --rank 1 " in _cmdline(pid)]
    assert len(workers) == 1, [_cmdline(pid) for pid in children]
    worker = workers[0]
    with Client(server.address, timeout=120) as client:
        stream = client.generate(prompt=PROMPTS[2], max_tokens=64, temperature=0)
        next(iter(stream))  # the request is running on both ranks
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(StructgenError):
            for _ in stream:
                pass
    code = server.process.wait(60)
    log = server.log_text()
    assert code == 1, log[-3000:]
    assert f"tensor-parallel rank 1 (pid {worker}) exited with signal SIGKILL" in log
    deadline = time.monotonic() + 10
    while any(_is_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _is_alive(pid)], "processes outlived the server"
