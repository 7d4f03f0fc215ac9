"""Sidecar mode, as the Helm chart runs it: `structgen grammar` alone on a Unix socket, then
`structgen serve --grammar-address` using it (spawning no child of its own)."""
import pathlib
import subprocess
import sys
import tempfile

import pytest

from live_server import ROOT, start_serve, stop_serve
from structgen_client import Client


@pytest.fixture(scope="module")
def grammar_sidecar():
    folder = pathlib.Path(tempfile.mkdtemp(prefix="structgen-sidecar-"))
    address = f"unix://{folder / 'grammar.sock'}"
    process = subprocess.Popen([sys.executable, "-m", "structgen.cli", "grammar", "--listen", address],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = [sys.executable, "-m", "structgen.cli", "grammar-health", "--address", address, "--timeout-s", "60"]
    assert subprocess.run(probe, cwd=ROOT, timeout=120).returncode == 0, "grammar sidecar not healthy"
    yield address
    process.terminate()
    assert process.wait(30) == 0


def test_serve_uses_a_running_grammar_service(grammar_sidecar, tmp_path):
    server = start_serve([f"--grammar-address={grammar_sidecar}"], tmp_path / "serve.log")
    try:
        tasks = pathlib.Path(f"/proc/{server.process.pid}/task").iterdir()
        children = [pid for task in tasks for pid in (task / "children").read_text().split()]
        assert not children, "serve spawned a grammar child despite --grammar-address"
        assert grammar_sidecar in "".join(server.stdout_lines)
        with Client(server.address, timeout=60) as client:
            completion = client.generate_text("Pick:", choices=["up", "down"], max_tokens=8)
        assert completion.text in ("up", "down")
    finally:
        assert stop_serve(server) == 0


def test_grammar_health_fails_without_a_service(tmp_path):
    probe = [sys.executable, "-m", "structgen.cli", "grammar-health",
             "--address", f"unix://{tmp_path / 'none.sock'}", "--timeout-s", "1"]
    assert subprocess.run(probe, cwd=ROOT, timeout=60).returncode == 1
