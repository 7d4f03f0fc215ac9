"""Constrained and free load on a `structgen serve`, and kills of its serving grammar child
(tests/integration/test_ops_grammar_takeover.py; benchmarks/grammar_kills.py times the same).

`Load` runs a choice, a JSON-schema and a free request in a loop, one thread each, every output
checked; `kill_serving` SIGKILLs the process listening on the serving grammar socket and makes
constrained requests until one is served, timing its first token; `in_flight` tells whether a
failed request could have had its grammar in the killed process (made before the engine logged
the loss).
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import jsonschema

from structgen_client import Client, StructgenError

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
          "required": ["ok", "size"], "additionalProperties": False}  # always complete within max_tokens
CHOICES = ("alpha", "beta")


@dataclass
class Outcome:
    kind: str       # "choice", "schema" or "free"
    started: float  # time.time(): the server log's clock
    ended: float
    error: str = ""
    text: str = ""
    first_token_at: float = 0.0


@dataclass
class Load:
    """Constrained and free requests in a loop, one thread each, until `stop`."""
    address: str
    outcomes: list[Outcome] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._loop, args=(kind,), daemon=True) for kind in ("choice", "schema", "free")]
        for thread in threads:
            thread.start()
        return threads

    def _loop(self, kind: str) -> None:
        with Client(self.address, timeout=60) as client:
            while not self.stop.is_set():
                outcome = timed(kind, lambda: one_request(client, kind))
                self.outcomes.append(outcome)
                if not outcome.error:
                    self._check(kind, outcome.text)

    def _check(self, kind: str, text: str) -> None:
        try:
            if kind == "choice":
                assert text in CHOICES, text
            elif kind == "schema":
                jsonschema.validate(json.loads(text), SCHEMA)
        except (AssertionError, ValueError, jsonschema.ValidationError) as error:
            self.invalid.append(f"{kind}: {text!r} ({error})")


def timed(kind: str, request) -> Outcome:
    """`request()` -> (its text, time.time() of its first token) as an Outcome."""
    started = time.time()
    try:
        text, first_token_at = request()
    except StructgenError as error:
        return Outcome(kind, started, time.time(), f"{type(error).__name__}: {error}")
    return Outcome(kind, started, time.time(), text=text, first_token_at=first_token_at)


def one_request(client: Client, kind: str, timeout_s: float = 60) -> tuple[str, float]:
    if kind == "choice":
        stream = client.generate("Pick one:", choices=list(CHOICES), max_tokens=8, timeout=timeout_s)
    elif kind == "schema":
        stream = client.generate("A status:", json_schema=SCHEMA, compact=True, max_tokens=24, timeout=timeout_s)
    else:
        stream = client.generate("Tell me", max_tokens=8, timeout=timeout_s)
    text, first_token_at = [], 0.0
    for chunk in stream:
        if chunk.token_ids and not first_token_at:
            first_token_at = time.time()
        text.append(chunk.text)
    return "".join(text), first_token_at


def serving_pid(socket_path: pathlib.Path) -> int:
    """The process listening on the socket (the kernel's record of who called listen())."""
    with socket.socket(socket.AF_UNIX) as probe:
        probe.connect(str(socket_path))
        return struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for task in pathlib.Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found.update(children)
            todo.extend(children)
    return found


def is_alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@dataclass
class Kill:
    at: float  # time.time()
    pid: int
    workers: set[int]
    recovered_s: float = 0.0
    attempts: list[Outcome] = field(default_factory=list)


def kill_serving(folder: pathlib.Path, client: Client, kind: str = "choice", give_up_s: float = 30) -> Kill:
    """SIGKILL the serving grammar child; returns once a constrained request made after it is
    served (the first ones may have been bound to the killed process before the engine saw it
    go). Served again: its first token, sampled under a mask of the process that took over (the
    rest of it takes as long as any request on these busy CPUs)."""
    pid = serving_pid(folder / "grammar.sock")
    kill = Kill(time.time(), pid, descendants(pid))
    os.kill(pid, signal.SIGKILL)
    while not kill.attempts or kill.attempts[-1].error:
        assert time.time() - kill.at < give_up_s, kill.attempts[-3:]
        kill.attempts.append(timed(kind, lambda: one_request(client, kind, timeout_s=30)))
    kill.recovered_s = kill.attempts[-1].first_token_at - kill.at
    return kill


def losses(log: str) -> list[float]:
    """When the engine saw grammar_service go (its log's "lost at step" lines, time.time())."""
    found = []
    for line in log.splitlines():
        if "grammar_service lost at step" in line:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            found.append(stamp.timestamp())
    return found


def in_flight(outcome: Outcome, kills: list[Kill], lost: list[float]) -> bool:
    """Made before a kill's loss was seen by the engine (log times: ms) and not ended before the kill:
    its matcher may have been bound, or been being bound, in the killed process."""
    for kill in kills:
        seen = min((t for t in lost if t >= kill.at - 0.002), default=kill.at)
        if outcome.started <= seen + 0.002 and outcome.ended >= kill.at:
            return True
    return False
