"""`structgen serve --engine-process true`: the engine in a process of its own, over real gRPC.

What a user relies on beyond the API suite (which runs the same way under
STRUCTGEN_ENGINE_PROCESS=true): outputs are the in-process engine's (greedy, same request);
the engine's refusals keep their status; a cancel frees everything in the engine process;
the engine process dying ends open streams UNAVAILABLE and stops serve with a nonzero exit
and a message; SIGTERM leaves no process behind.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import jsonschema
import pytest

from live_server import start_serve, stop_serve, wait_idle
from ports import free_port
from structgen_client import Client, InvalidArgumentError, OutOfRangeError, UnavailableError

MODEL = ["--model", "tiny-random", "--max-new-tokens-limit", "64", "--max-prompt-tokens", "256"]
SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["happy", "calm", "tired"]},
                                           "level": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["mood", "level"], "additionalProperties": False}


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    fields = file.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _engine_pid(server) -> int:
    for pid in _children(server.process.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            if b"multiprocessing.spawn" in file.read():
                return pid
    raise AssertionError("no engine process under structgen serve")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The same model served in-process and with --engine-process."""
    folder = tmp_path_factory.mktemp("engine-process")
    inside = start_serve(MODEL, folder / "inside.log")
    apart = start_serve(MODEL + ["--engine-process", "true", f"--http-port={free_port()}",
                                 f"--metrics-port={free_port()}"], folder / "apart.log")
    yield inside, apart
    for server in (inside, apart):
        assert stop_serve(server) == 0, server.log_text()[-3000:]


def test_outputs_match_the_in_process_engine_and_constrained_ones_are_valid(pair):
    inside, apart = pair
    with Client(inside.address, timeout=60) as a, Client(apart.address, timeout=60) as b:
        for options in ({"max_tokens": 24, "ignore_eos": True},
                        {"max_tokens": 48, "json_schema": SCHEMA, "compact": True},
                        {"max_tokens": 20, "num_logprobs": 2, "stop": ["e"]}):
            want = a.generate_text("Say something:", **options)
            got = b.generate_text("Say something:", **options)
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
            assert [lp.token_id for lp in got.logprobs] == [lp.token_id for lp in want.logprobs]
            if "json_schema" in options:
                assert got.validation.status == "valid"
                jsonschema.validate(json.loads(got.text), SCHEMA)
        wait_idle(b)


def _metric(server, name: str) -> float:
    import urllib.request
    port = next(arg.split("=", 1)[1] for arg in server.process.args if str(arg).startswith("--metrics-port="))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_engine_metrics_and_the_http_api_work_over_the_engine_process(pair):
    import openai
    _, apart = pair
    finished = _metric(apart, "structgen_request_decode_time_seconds_count")
    with openai.OpenAI(base_url=apart.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as api:
        model = api.models.list().data[0].id
        reply = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Mood?"}],
                                            max_tokens=48, response_format={"type": "json_schema", "json_schema": {
                                                "name": "mood", "schema": SCHEMA}},
                                            extra_body={"structgen": {"compact": True}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    # the request's times were recorded from the engine process's finish snapshot
    assert _metric(apart, "structgen_request_decode_time_seconds_count") == finished + 1
    assert _metric(apart, "structgen_engine_steps_total") > 0  # engine gauges: a stats call per scrape


def test_refusals_keep_their_status_and_the_engine_keeps_serving(pair):
    _, apart = pair
    with Client(apart.address, timeout=60) as client:
        with pytest.raises(OutOfRangeError, match="prompt"):  # checked in the serving process
            client.generate_text(token_ids=[5] * 300, max_tokens=4)
        running = iter(client.generate("Keep going:", max_tokens=64, ignore_eos=True, request_id="same-id"))
        next(running)
        with pytest.raises(InvalidArgumentError, match="already in use"):  # refused by the engine process
            client.generate_text("Again:", max_tokens=4, request_id="same-id")
        assert len([c for c in running]) >= 1
        assert client.generate_text("Still there?", max_tokens=4, ignore_eos=True).finish_reason == "max_tokens"
        wait_idle(client)


def test_cancel_mid_stream_frees_everything_in_the_engine_process(pair):
    _, apart = pair
    with Client(apart.address, timeout=60) as client:
        stream = client.generate("Tell a long story:", max_tokens=64, ignore_eos=True,  # (room to finish)
                                 json_schema={"type": "array", "items": {"type": "string"}, "minItems": 12})
        received = 0
        for chunk in stream:
            received += len(chunk.token_ids)
            if received >= 3:
                busy = client.engine_stats()
                assert busy.num_running + busy.num_waiting >= 1 and busy.num_grammar_matchers >= 1
                stream.cancel()
        assert received < 64
        wait_idle(client)


def test_engine_process_death_ends_streams_unavailable_and_stops_serve(tmp_path):
    server = start_serve(MODEL + ["--engine-process", "true"], tmp_path / "serve.log")
    try:
        engine = _engine_pid(server)
        with Client(server.address, timeout=60) as client:
            stream = iter(client.generate("Keep going:", max_tokens=64, ignore_eos=True))
            next(stream)
            threading.Timer(0.1, os.kill, (engine, signal.SIGKILL)).start()
            with pytest.raises(UnavailableError):
                for _ in stream:
                    time.sleep(0.01)
        code = server.process.wait(60)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    assert code == 1
    assert "engine process exited unexpectedly" in server.log_text()


def test_sigterm_stops_serve_and_its_engine_process(tmp_path):
    server = start_serve(MODEL + ["--engine-process", "true"], tmp_path / "serve.log")
    engine = _engine_pid(server)
    with Client(server.address, timeout=60) as client:
        assert client.generate_text("Hi", max_tokens=4, ignore_eos=True).finish_reason == "max_tokens"
    assert stop_serve(server) == 0
    deadline = time.monotonic() + 10
    while _alive(engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(engine)


def test_engine_process_with_tensor_parallel_is_refused_before_anything_starts(tmp_path):
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "structgen.cli", "serve", *MODEL, "--engine-process", "true",
                             "--tensor-parallel", "2", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--engine-process does not go with --tensor-parallel" in result.stderr
