"""`structgen serve` as operators run it, on a server of its own with a bearer token, a
plaintext health-only port and a metrics port: unauthenticated calls are refused (health
exempt); SIGTERM drains open streams while health answers NOT_SERVING on the open port, exits 0
and takes the children down (grammar child crashes: test_ops_grammar_takeover.py)."""
import json
import os
import pathlib
import re
import signal
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grammar_kills import descendants
from live_server import start_serve, stop_serve
from ports import free_port
from structgen_client import Client, UnauthenticatedError, UnavailableError

TOKEN = "s3cret-token"


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False



@pytest.fixture(scope="module")
def own_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve2")
    (folder / "token").write_text(TOKEN + "\n")
    health_port, metrics_port = free_port(), free_port()
    # 120 s of drain: the open streams' 200 tokens end well before it (the drain stops when they do)
    server = start_serve(["--max-new-tokens-limit=256", "--drain-seconds=120",
                          f"--auth-token-file={folder / 'token'}", f"--health-port={health_port}",
                          f"--metrics-port={metrics_port}", f"--http-port={free_port()}"], folder / "serve.log")
    server.health_port, server.metrics_port = health_port, metrics_port
    yield server
    if server.process.poll() is None:
        stop_serve(server)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_bearer_token_is_required_except_for_health(own_server):
    with Client(own_server.address, timeout=30) as anonymous:
        with pytest.raises(UnauthenticatedError):
            anonymous.generate_text("hi", max_tokens=2)
        with pytest.raises(UnauthenticatedError):
            anonymous.model_info()
    with Client(own_server.address, timeout=30, token="wrong") as wrong:
        with pytest.raises(UnauthenticatedError):
            wrong.model_info()
    with Client(own_server.address, timeout=30, token=TOKEN) as client:
        assert len(client.generate_text("hi", max_tokens=2).token_ids) == 2
    assert _health(own_server.address) == health_pb2.HealthCheckResponse.SERVING
    assert _health(f"127.0.0.1:{own_server.health_port}") == health_pb2.HealthCheckResponse.SERVING


def test_the_heap_is_frozen_once_serving(own_server):
    """A full garbage collection over the model's, tokenizer's and imports' objects would stall
    every stream (structgen/heap.py): serve freezes them once it is up."""
    frozen = re.search(r"heap frozen: (\d+) objects", own_server.log_text())
    assert frozen and int(frozen.group(1)) > 50_000, own_server.log_text()[-2000:]


def test_metrics_port_serves_prometheus_text(own_server):
    with urllib.request.urlopen(f"http://127.0.0.1:{own_server.metrics_port}/metrics", timeout=10) as reply:
        assert reply.status == 200 and b"# TYPE" in reply.read()


def test_node_client_sends_the_bearer_token(own_server):
    from test_clients_node import CLIENT, _node
    argv = [_node(), str(CLIENT), "--server", own_server.address, "--choice", "a", "--choice", "b"]
    ok = subprocess.run(argv + ["--token", TOKEN, "Pick"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.strip() in ("a", "b"), ok.stderr
    refused = subprocess.run(argv + ["Pick"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr


# NOTE: last in this file: it stops the module's server.
def _http_stream(url: str):
    """An open SSE stream of the HTTP API: 200 tokens, token ids in each chunk."""
    headers = {"content-type": "application/json", "authorization": f"Bearer {TOKEN}"}
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers=headers), timeout=30) as reply:
        model = json.load(reply)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "A long answer:", "max_tokens": 200, "stream": True,
                       "structgen": {"ignore_eos": True, "return_token_ids": True}}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, headers)
    return urllib.request.urlopen(request, timeout=120)


def _http_tokens(lines) -> tuple[int, str | None]:
    chunks = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    tokens = sum(len((c["choices"][0].get("structgen") or {}).get("token_ids", [])) for c in chunks)
    return tokens, chunks[-1]["choices"][0]["finish_reason"]


def test_sigterm_drains_open_streams_with_health_not_serving_then_exits_zero(own_server):
    children = descendants(own_server.process.pid)  # the grammar template, its children, their workers
    main_port = own_server.address
    with Client(own_server.address, timeout=120, token=TOKEN) as client:
        assert _health(main_port) == health_pb2.HealthCheckResponse.SERVING
        stream = iter(client.generate("A long answer:", max_tokens=200, ignore_eos=True))
        first = next(stream)
        http = _http_stream(own_server.http_url)
        http_first = [http.readline()]
        result = {}
        readers = [threading.Thread(target=lambda: result.update(rest=list(stream))),
                   threading.Thread(target=lambda: result.update(http=http_first + http.readlines()))]
        for reader in readers:
            reader.start()
        own_server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        during = []
        with grpc.insecure_channel(main_port) as channel:  # the port the clients use stays open
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "structgen.v1.GenerationService"):
                during.append(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status)
        with pytest.raises(UnavailableError, match="draining"):
            client.generate_text("a new request", max_tokens=2)
        stream_open_at_checks = readers[0].is_alive()
        for reader in readers:
            reader.join(120)
    assert stream_open_at_checks, "the stream should still have been open while health was checked"
    assert during == [health_pb2.HealthCheckResponse.NOT_SERVING] * 2
    chunks = [first, *result["rest"]]
    assert chunks[-1].finish_reason == "max_tokens"
    assert sum(len(c.token_ids) for c in chunks) == 200, "the open stream finished during the drain"
    assert _http_tokens(result["http"]) == (200, "length"), "the open HTTP stream finished during the drain"
    assert result["http"][-2:] == [b"data: [DONE]\n", b"\n"]
    assert own_server.process.wait(60) == 0
    deadline = time.monotonic() + 10
    while any(_is_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_is_alive(c) for c in children), "a grammar_service process outlived serve"
