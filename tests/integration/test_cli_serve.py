"""`structgen serve` as operators run it, on a server of its own with a bearer token, a
plaintext health-only port and a metrics port: unauthenticated calls are refused (health
exempt); the grammar_service child is restarted after a crash (free requests keep working
meanwhile, constrained ones recover); SIGTERM drains open streams, exits 0 and takes the
child down."""
import json
import os
import pathlib
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from live_server import start_serve, stop_serve
from structgen_client import Client, StructgenError, UnauthenticatedError, UnavailableError

TOKEN = "s3cret-token"


def _children(pid: int) -> list[int]:
    children = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def own_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve2")
    (folder / "token").write_text(TOKEN + "\n")
    health_port, metrics_port = _free_port(), _free_port()
    server = start_serve(["--max-new-tokens-limit=256", "--drain-seconds=30",
                          f"--auth-token-file={folder / 'token'}", f"--health-port={health_port}",
                          f"--metrics-port={metrics_port}", f"--http-port={_free_port()}"], folder / "serve.log")
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


def _constrained_ok(client) -> bool:
    try:
        return client.generate_text("Pick:", choices=["a", "b"], max_tokens=8, timeout=20).text in ("a", "b")
    except (UnavailableError, StructgenError):
        return False


def test_grammar_child_is_restarted_after_a_crash(own_server):
    (child,) = _children(own_server.process.pid)
    with Client(own_server.address, timeout=60, token=TOKEN) as client:
        assert _constrained_ok(client)
        os.kill(child, signal.SIGKILL)
        free = client.generate_text("Free text still works", max_tokens=4)
        assert len(free.token_ids) == 4
        deadline = time.monotonic() + 120
        while not _constrained_ok(client):
            assert time.monotonic() < deadline, own_server.log_text()[-3000:]
            time.sleep(1)
        (new_child,) = _children(own_server.process.pid)
        assert new_child != child and _is_alive(new_child)


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


def test_sigterm_drains_open_streams_then_exits_zero(own_server):
    (child,) = _children(own_server.process.pid)
    with Client(own_server.address, timeout=120, token=TOKEN) as client:
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
        for reader in readers:
            reader.join(120)
    chunks = [first, *result["rest"]]
    assert chunks[-1].finish_reason == "max_tokens"
    assert sum(len(c.token_ids) for c in chunks) == 200, "the open stream finished during the drain"
    assert _http_tokens(result["http"]) == (200, "length"), "the open HTTP stream finished during the drain"
    assert result["http"][-2:] == [b"data: [DONE]\n", b"\n"]
    assert own_server.process.wait(60) == 0
    deadline = time.monotonic() + 10
    while _is_alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _is_alive(child), "the grammar_service child outlived serve"

