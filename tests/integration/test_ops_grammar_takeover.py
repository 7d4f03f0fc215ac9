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
takeover, and after SIGTERM no process, socket folder or segment of the run is left. The grammar
metrics port (STRUCTGEN_GRAMMAR_METRICS_PORT) serves the child that serves after the takeovers.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import time
import urllib.request
import uuid

import jsonschema
import pytest

from grammar_contract.client import GrammarControlClient
from grammar_kills import SCHEMA, Kill, Load, in_flight, is_alive, kill_serving, losses, one_request
from live_server import start_serve, stop_serve, wait_idle
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families
from structgen_client import Client

pytestmark = pytest.mark.slow
RECOVERY_S = 2.0  # the target; 0.4-0.5 s on the 2-core machine when nothing else runs
SEGMENT = re.compile(r"created step channel /dev/shm/(structgen-[0-9a-f]+)")


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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("takeover")
    marker = f"takeover-{uuid.uuid4().hex}"
    metrics_port = free_port()
    server = start_serve([], folder / "serve.log", env={"STRUCTGEN_TEST_RUN": marker,
                                                        "STRUCTGEN_GRAMMAR_METRICS_PORT": str(metrics_port)})
    server.grammar_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
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


def recorded_grammars(folder: pathlib.Path) -> set[str]:
    """The grammars recorded for the others: one entry per grammar and max_tokens (its budget
    binding), one compiled grammar for all its budgets."""
    specs = set()
    for path in (folder / "grammars").glob("*.json"):
        try:
            spec = json.loads(path.read_text())["spec"]
        except (OSError, ValueError):  # being replaced
            continue
        spec.pop("max_tokens", None)
        specs.add(json.dumps(spec, sort_keys=True))
    return specs


def test_the_standby_that_takes_over_holds_the_grammars_in_use(server):
    folder = server.grammar_folder
    serving = GrammarControlClient(f"unix://{folder / 'grammar.sock'}")
    standby = GrammarControlClient(f"unix://{folder / 'standby.sock'}")
    try:
        with Client(server.address, timeout=60) as client:
            for _ in range(2):  # a grammar used twice is recorded for the others
                one_request(client, "schema")
            wait_until(lambda: 0 < len(recorded_grammars(folder)) <= standby.stats()["num_cached_grammars"], 30,
                       "the standby compiles the grammars the serving child recorded")
            kill = kill_serving(folder, client, kind="schema")
            after = client.generate_text("A status:", json_schema=SCHEMA, compact=True, max_tokens=24, timeout=60)
        assert kill.recovered_s < RECOVERY_S
        assert after.guarantee is not None and after.guarantee.cache_hit
        jsonschema.validate(json.loads(after.text), SCHEMA)
        # the port is the serving child's: it ran the steps of `after` (a standby runs none)
        wait_until(lambda: _grammar_steps(server) > 0, 10, "the child that took over serves /metrics")
    finally:
        serving.close()
        standby.close()


def _grammar_steps(server) -> float:
    try:
        text = urllib.request.urlopen(server.grammar_metrics_url, timeout=5).read().decode()
    except OSError:  # not bound yet
        return 0.0
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "structgen_grammar_step_seconds_count")


def test_sigterm_after_the_kills_leaves_nothing(server):
    log_before = server.log_text()
    assert stop_serve(server) == 0
    segments = set(SEGMENT.findall(log_before + server.log_text()))
    assert not [name for name in segments if os.path.exists(f"/dev/shm/{name}")]
    wait_until(lambda: not marked_pids(server.marker), 10, "every process of the run exits")
    assert not server.grammar_folder.exists()
