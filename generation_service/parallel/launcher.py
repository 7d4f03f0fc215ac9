"""RankSupervisor: starts the worker ranks of `structgen serve --tensor-parallel N` and watches them.

Rank 0 is the serve process itself; ranks 1..N-1 are `python -m generation_service.parallel.worker`
children, each in a session of its own (a terminal's Ctrl-C reaches serve, which stops them in
order) and with SIGTERM on serve's death (PR_SET_PDEATHSIG), so none outlives it. Every child
gets NVLink multicast turned off (group.MULTICAST_OFF_ENV).

A worker that exits while the server runs is a failure: the watcher logs which rank and how it
exited, keeps the message in `failure`, and calls `on_failure` (serve turns it into a stop:
drain, stop, exit nonzero with that message). Rank 0's next collective fails as well, so the
engine fails its open requests instead of waiting. A step that fails on rank 0 itself
(`group.report_broken`) is a failure too: the workers wait in a step rank 0 will not finish.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable

from generation_service.parallel.group import MULTICAST_OFF_ENV, TensorParallelGroup, init_group, on_broken
from generation_service.parallel.loading import model_source
from generation_service.parallel.plan import check_divisible

log = logging.getLogger("structgen.tensor_parallel")


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class RankSupervisor:
    def __init__(self, engine_config, on_failure: Callable[[str], None] = lambda message: None,
                 host: str = "127.0.0.1") -> None:
        self.world_size = engine_config.tensor_parallel
        self._config = engine_config
        self._on_failure = on_failure
        self.address = f"tcp://{host}:{_free_port(host)}"
        self._workers: dict[int, subprocess.Popen] = {}
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self.failure: str | None = None
        self._failure_lock = threading.Lock()

    def check_model(self) -> None:
        """TensorParallelError unless the model's heads and MLP divide over the ranks (reads
        config files only, before any process starts)."""
        check_divisible(model_source(self._config.model).config, self.world_size)

    def spawn(self) -> None:
        """Start ranks 1..N-1 (each loads its shard at once) and the watcher."""
        from structgen.supervisor import _die_with_parent
        model = {"model": self._config.model, "device": self._config.device, "dtype": self._config.dtype,
                 "seed": self._config.seed}
        env = {**os.environ, **MULTICAST_OFF_ENV}
        log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        for rank in range(1, self.world_size):
            argv = [sys.executable, "-m", "generation_service.parallel.worker", "--rank", str(rank),
                    "--world-size", str(self.world_size), "--address", self.address,
                    "--model-json", json.dumps(model), "--log-level", log_level]
            self._workers[rank] = subprocess.Popen(argv, env=env, start_new_session=True,
                                                   preexec_fn=_die_with_parent(os.getpid()))
        log.info("started tensor-parallel ranks 1..%d (pids %s), rendezvous at %s", self.world_size - 1,
                 ", ".join(str(p.pid) for p in self._workers.values()), self.address)
        self._watcher = threading.Thread(target=self._watch, name="tensor-parallel-watch", daemon=True)
        self._watcher.start()

    def join(self) -> TensorParallelGroup:
        """This process joins as rank 0; returns once every rank has (they load their shards first)."""
        on_broken(self._fail)
        return init_group(0, self.world_size, self.address, self._config.device)

    def _fail(self, message: str) -> None:
        """The first failure stops the server; a rank 0 step broken by a worker's death is
        reported as that death."""
        with self._failure_lock:  # the watcher and the engine thread may both see it
            if self.failure is not None:
                return
            self.failure = self._exited_worker() or message
        self._on_failure(self.failure)

    def _exited_worker(self) -> str | None:
        for rank, process in self._workers.items():
            code = process.poll()
            if code is not None:
                return (f"tensor-parallel rank {rank} (pid {process.pid}) exited with {describe_exit(code)}; "
                        "the server cannot run without it")
        return None

    def _watch(self) -> None:
        while not self._stopping.wait(0.1):
            message = self._exited_worker()
            if message is not None and not self._stopping.is_set():
                log.error("%s", message)
                self._fail(message)
                return

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the workers (the engine's runner sent STOP), then terminate what is left."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
        for process in self._workers.values():
            try:
                process.wait(timeout_s if self.failure is None else 1.0)
            except subprocess.TimeoutExpired:
                process.terminate()
                try:
                    process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            try:  # anything the worker started in its session
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
