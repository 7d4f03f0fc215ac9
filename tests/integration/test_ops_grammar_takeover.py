"""The serving grammar child killed at its worst moments, under constrained and free load.

A `structgen serve` of its own (default model) serves two constrained streams (a choice and a
JSON schema, every output validated) and a free one while the test SIGKILLs the process that
listens on the serving grammar socket: 1 s after serve says it listens, right after the takeover
that follows, and again right after that one (two kills within 5 s). Each time a constrained
request made after the kill is served within 2 s. Only requests in flight at a kill may fail,
and only constrained ones. Then, once the standby holds the grammars in use, a fourth kill: the
schema's first request after the takeover is a cache hit. Nothing leaks: the killed children's
compile workers are gone, the engine and the grammar child hold no slot or matcher once idle,
serve keeps one step-channel segment and no more file descriptors than after the first
takeover, and after SIGTERM no process, socket folder or segment of the run is left.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import signal
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field

import jsonschema
import pytest

from grammar_contract.client import GrammarControlClient
from live_server import start_serve, stop_serve, wait_idle
from structgen_client import Client, StructgenError

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
          "required": ["ok", "size"], "additionalProperties": False}  # always complete within max_tokens
CHOICES = ("alpha", "beta")
RECOVERY_S = 2.0
SEGMENT = re.compile(r"created step channel /dev/shm/(structgen-[0-9a-f]+)")


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


def marked_pids(marker: str) -> set[int]:
    found = set()
    for entry in pathlib.Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "environ").read_bytes() and is_alive(int(entry.name)):
                found.add(int(entry.name))
        except OSError:
            pass
    return found


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


@dataclass
class Kill:
    at: float  # time.time()
    pid: int
    workers: set[int]
    recovered_s: float = 0.0
    attempts: list[Outcome] = field(default_factory=list)


def kill_serving(folder: pathlib.Path, client: Client, kind: str = "choice") -> Kill:
    """SIGKILL the serving grammar child; returns once a constrained request made after it is
    served (the first ones may have been bound to the killed process before the engine saw it
    go). Served again: its first token, sampled under a mask of the process that took over (the
    rest of it takes as long as any request on these busy CPUs)."""
    pid = serving_pid(folder / "grammar.sock")
    kill = Kill(time.time(), pid, descendants(pid))
    os.kill(pid, signal.SIGKILL)
    while not kill.attempts or kill.attempts[-1].error:
        assert len(kill.attempts) < 20, kill.attempts
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("takeover")
    marker = f"takeover-{uuid.uuid4().hex}"
    server = start_serve([], folder / "serve.log", env={"STRUCTGEN_TEST_RUN": marker})
    server.listening_at = time.monotonic()
    server.marker = marker
    line = next(line for line in server.stdout_lines if "grammar_service at unix://" in line)
    server.grammar_folder = pathlib.Path(line.split("grammar_service at unix://", 1)[1].split(")")[0]).parent
    yield server
    if server.process.poll() is None:
        stop_serve(server)


def test_kills_at_the_worst_moments_are_served_again_within_2_s(server):
    folder = server.grammar_folder
    load = Load(server.address)
    threads = load.run()
    kills: list[Kill] = []
    with Client(server.address, timeout=60) as client:
        # the moment the issue names; not a wait for anything to happen
        time.sleep(max(0.0, server.listening_at + 1.0 - time.monotonic()))
        kills.append(kill_serving(folder, client))                          # 1 s after `listening`
        fds_after_first = len(os.listdir(f"/proc/{server.process.pid}/fd"))
        kills.append(kill_serving(folder, client))                          # right after a takeover
        kills.append(kill_serving(folder, client))                          # a second one within 5 s
        load.stop.set()
        for thread in threads:
            thread.join(120)
        stats = wait_idle(client, timeout_s=30)
    log = server.log_text()
    assert [k.recovered_s < RECOVERY_S for k in kills] == [True] * 3, ([k.recovered_s for k in kills], log[-4000:])
    assert kills[2].at - kills[1].at < 5.0
    outcomes = load.outcomes + [attempt for kill in kills for attempt in kill.attempts]
    for outcome in outcomes[len(load.outcomes):]:
        if not outcome.error:
            load._check(outcome.kind, outcome.text)
    assert not load.invalid, load.invalid
    failed = [o for o in outcomes if o.error]
    assert all("grammar_service is unavailable" in o.error for o in failed), failed
    assert not [o for o in failed if not in_flight(o, kills, losses(log))], (failed, losses(log), log[-3000:])
    assert not [o for o in failed if o.kind == "free"]
    assert {o.kind for o in load.outcomes if not o.error} == {"choice", "schema", "free"}
    assert (stats.num_slots_used, stats.num_grammar_matchers) == (0, 0)
    # nothing leaks: the killed children's workers, matchers, segments, descriptors
    wait_until(lambda: not any(is_alive(p) for k in kills for p in k.workers | {k.pid}), 10, "killed children's workers exit")
    grammar = GrammarControlClient(f"unix://{folder / 'grammar.sock'}")
    try:
        assert (grammar.stats()["num_channels"], grammar.stats()["num_bound_matchers"]) == (1, 0)
    finally:
        grammar.close()
    segments = [name for name in SEGMENT.findall(log) if os.path.exists(f"/dev/shm/{name}")]
    assert len(segments) == 1, segments
    assert len(os.listdir(f"/proc/{server.process.pid}/fd")) <= fds_after_first
    assert sorted(p.name for p in folder.iterdir() if p.is_socket()) == ["grammar.sock", "standby.sock"]


def test_the_standby_that_takes_over_holds_the_grammars_in_use(server):
    folder = server.grammar_folder
    serving = GrammarControlClient(f"unix://{folder / 'grammar.sock'}")
    standby = GrammarControlClient(f"unix://{folder / 'standby.sock'}")
    try:
        with Client(server.address, timeout=60) as client:
            for _ in range(2):  # a grammar used twice is recorded for the others
                one_request(client, "schema")
            recorded = lambda: len(list((folder / "grammars").glob("*.json")))  # noqa: E731
            wait_until(lambda: recorded() >= 2 and standby.stats()["num_cached_grammars"] >= recorded(), 30,
                       "the standby compiles the grammars the serving child recorded")
            kill = kill_serving(folder, client, kind="schema")
            after = client.generate_text("A status:", json_schema=SCHEMA, compact=True, max_tokens=24, timeout=60)
        assert kill.recovered_s < RECOVERY_S
        assert after.guarantee is not None and after.guarantee.cache_hit
        jsonschema.validate(json.loads(after.text), SCHEMA)
    finally:
        serving.close()
        standby.close()


def test_sigterm_after_the_kills_leaves_nothing(server):
    log_before = server.log_text()
    assert stop_serve(server) == 0
    segments = set(SEGMENT.findall(log_before + server.log_text()))
    assert not [name for name in segments if os.path.exists(f"/dev/shm/{name}")]
    wait_until(lambda: not marked_pids(server.marker), 10, "every process of the run exits")
    assert not server.grammar_folder.exists()
