"""`structgen serve` process management, on a server of its own: the grammar_service child is
restarted after a crash (free requests keep working meanwhile, constrained ones recover), and
SIGTERM drains open streams, exits 0 and takes the child down."""
import os
import pathlib
import signal
import threading
import time

import pytest

from conftest import start_serve, stop_serve
from structgen_client import Client, StructgenError, UnavailableError


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


@pytest.fixture(scope="module")
def own_server(tmp_path_factory):
    server = start_serve(["--max-new-tokens-limit=256", "--drain-seconds=30"],
                         tmp_path_factory.mktemp("serve2") / "serve.log")
    yield server
    if server.process.poll() is None:
        stop_serve(server)


def _constrained_ok(client) -> bool:
    try:
        return client.generate_text("Pick:", choices=["a", "b"], max_tokens=8, timeout=20).text in ("a", "b")
    except (UnavailableError, StructgenError):
        return False


def test_grammar_child_is_restarted_after_a_crash(own_server):
    (child,) = _children(own_server.process.pid)
    with Client(own_server.address, timeout=60) as client:
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


def test_sigterm_drains_open_streams_then_exits_zero(own_server):
    (child,) = _children(own_server.process.pid)
    with Client(own_server.address, timeout=120) as client:
        stream = iter(client.generate("A long answer:", max_tokens=200, ignore_eos=True))
        first = next(stream)
        result = {}
        reader = threading.Thread(target=lambda: result.update(rest=list(stream)))
        reader.start()
        own_server.process.send_signal(signal.SIGTERM)
        reader.join(120)
    chunks = [first, *result["rest"]]
    assert chunks[-1].finish_reason == "max_tokens"
    assert sum(len(c.token_ids) for c in chunks) == 200, "the open stream finished during the drain"
    assert own_server.process.wait(60) == 0
    deadline = time.monotonic() + 10
    while _is_alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _is_alive(child), "the grammar_service child outlived serve"
