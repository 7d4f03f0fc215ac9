"""Session fixtures: one real `structgen serve` (see live_server.py) and a client to it."""
from __future__ import annotations

import pytest

from live_server import LIMITS, SLOW_FILL_MARKER, SLOW_FILL_MS, LiveServer, start_serve, stop_serve
from ports import free_port
from live_server import wait_idle as wait_until_idle


@pytest.fixture(scope="session")
def live_server(tmp_path_factory) -> LiveServer:
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    args = [f"--{name.replace('_', '-')}={value}" for name, value in LIMITS.items()]
    slow_fill = {"STRUCTGEN_GRAMMAR_SLOW_FILL_MS": str(SLOW_FILL_MS),
                 "STRUCTGEN_GRAMMAR_SLOW_FILL_MARKER": SLOW_FILL_MARKER}
    server = start_serve(args + [f"--http-port={free_port()}"], log_path, env=slow_fill)
    yield server
    code = stop_serve(server)
    assert code == 0, f"structgen serve exited with {code} on SIGTERM:\n{server.log_text()[-4000:]}"


@pytest.fixture(scope="session")
def client(live_server):
    from structgen_client import Client
    with Client(live_server.address, timeout=120) as c:
        yield c


@pytest.fixture
def wait_idle(client):
    """wait_idle(timeout_s=10) -> engine stats once no request holds anything (else fails)."""
    return lambda timeout_s=10.0: wait_until_idle(client, timeout_s)
