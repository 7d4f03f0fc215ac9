"""Helpers for the engine integration tests (no tests here): a real grammar_service process
on a unix socket, an Engine wired to it, and collecting a stream into one result."""
from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from generation_service.engine.engine import Engine, EngineConfig
from generation_service.engine.events import FinishReason, Usage
from generation_service.engine.stream import RequestStream
from grammar_contract.report import GuaranteeReport

ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclass
class GrammarServiceProcess:
    process: subprocess.Popen
    address: str
    log_path: pathlib.Path

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_grammar_service(folder: pathlib.Path, name: str = "grammar") -> GrammarServiceProcess:
    """`python -m grammar_service --listen unix://<folder>/<name>.sock`, waited until serving."""
    from structgen.supervisor import wait_healthy

    address = f"unix://{folder / (name + '.sock')}"
    log_path = folder / f"{name}.log"
    process = subprocess.Popen([sys.executable, "-m", "grammar_service", "--listen", address],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log_path, "a"),
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if not wait_healthy(address, 120, process):
        process.kill()  # (a no-op when it has exited)
        process.wait(10)
        raise RuntimeError(f"grammar_service did not start:\n{log_path.read_text()[-2000:]}")
    return GrammarServiceProcess(process, address, log_path)


def make_engine(grammar_address: str | None = None, **config) -> Engine:
    from grammar_contract.client import GrammarControlClient

    client = GrammarControlClient(grammar_address) if grammar_address else None
    engine = Engine(EngineConfig(**config), client)
    engine.start()
    return engine


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    error: Exception | None = None
    usage: Usage | None = None
    guarantee: GuaranteeReport | None = None
    is_guarantee_first: bool = False  # the guarantee came before any token
    logprobs: list = field(default_factory=list)
    num_events: int = 0


def collect(stream: RequestStream, timeout_s: float = 120) -> Result:
    result = Result()
    while True:
        event = stream.get(timeout=timeout_s)
        result.num_events += 1
        result.token_ids += event.token_ids
        result.text += event.text
        if event.guarantee is not None and result.guarantee is None:
            result.guarantee, result.is_guarantee_first = event.guarantee, not result.token_ids
        result.logprobs += event.logprobs
        if event.is_final:
            result.finish_reason, result.error, result.usage = event.finish_reason, event.error, event.usage
            return result


def run_all(engine: Engine, requests) -> list[Result]:
    """Submit all at once (one batch), then collect each."""
    streams = [engine.submit(r) for r in requests]
    return [collect(s) for s in streams]


def wait_settled(engine: Engine, timeout_s: float = 10):
    """Stats once nothing is in flight and every page, slot and matcher is back."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        idle = (stats.num_waiting == stats.num_running == stats.num_kv_pages_used == stats.num_slots_used
                == stats.num_grammar_matchers == 0)
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def small_untied_model(folder: pathlib.Path) -> str:
    """A 2-layer random Llama with untied embeddings and the tiny-random model's real 32k tokenizer.

    The tiny-random model ties its embeddings, and a random tied model greedily repeats its
    input token forever; an untied one produces varied text, so draft proposals are both
    accepted and rejected and stop strings have something to match."""
    import json
    import shutil

    from generation_service.model.tiny_random_model import ensure_tiny_random_model

    source = ensure_tiny_random_model()
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config.update(tie_word_embeddings=False, num_hidden_layers=2)
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return f"random:{folder / 'config.json'}"


_SHARED: dict[str, object] = {}


def _shared_folder() -> pathlib.Path:
    if "folder" not in _SHARED:
        folder = pathlib.Path(tempfile.mkdtemp(prefix="structgen-engine-tests-"))
        atexit.register(shutil.rmtree, folder, True)
        _SHARED["folder"] = folder
    return _SHARED["folder"]


def shared_grammar_service() -> GrammarServiceProcess:
    """One grammar_service for the test modules that do not kill theirs (it loads the
    tokenizer once: the slowest part of starting it)."""
    service = _SHARED.get("grammar")
    if service is None or service.process.poll() is not None:
        service = start_grammar_service(_shared_folder(), "shared-grammar")
        atexit.register(service.stop)
        _SHARED["grammar"] = service
    return service


def shared_model() -> str:
    """small_untied_model in one folder per test process (grammar_service keys its tokenizer by path)."""
    if "model" not in _SHARED:
        _SHARED["model"] = small_untied_model(_shared_folder() / "model")
    return _SHARED["model"]
