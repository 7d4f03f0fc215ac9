"""Every `sh` and `python` block of README.md, run as printed against a real default server.

The blocks are read from the README itself, so an example cannot drift from what works.
The server is the README's own `structgen serve ... &` line, started with its flags as
printed, its ports (50051, and 8000 for the OpenAI-compatible API) moved to free ones so that
the test runs beside anything else; `localhost:50051` and `localhost:8000` in the examples
become those addresses, and so does the clients' default server (through $STRUCTGEN_SERVER,
which both clients read). Each command must exit 0, and every constrained JSON output is
validated here as well.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import jsonschema
import pytest

from live_server import start_serve, stop_serve
from ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
README_ADDRESS = "localhost:50051"
README_HTTP_ADDRESS = "localhost:8000"  # the OpenAI-compatible API's examples
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def readme_blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall((ROOT / "README.md").read_text()) if lang == language]


def shell_commands(block: str) -> list[str]:
    """The block's commands: continuation lines and multi-line quotes joined, comments dropped."""
    commands, pending = [], ""
    for line in block.splitlines():
        pending += line + "\n"
        try:
            complete = not pending.rstrip().endswith("\\") and shlex.split(pending, comments=True) is not None
        except ValueError:  # an open quote: the command goes on
            complete = False
        if complete:
            if shlex.split(pending, comments=True):
                commands.append(pending.strip())
            pending = ""
    assert not pending, f"unterminated command in README: {pending!r}"
    return commands


def readme_serve_args() -> list[str]:
    """The flags of the README's `structgen serve ... &` line, its ports moved to free ones."""
    [line] = [c for block in readme_blocks("sh") for c in shell_commands(block)
              if c.startswith("structgen serve") and c.endswith("&")]
    ports = {README_ADDRESS.rsplit(":", 1)[1]: str(free_port()), README_HTTP_ADDRESS.rsplit(":", 1)[1]: str(free_port())}
    return [ports.get(arg, arg) for arg in shlex.split(line.removesuffix("&"))[2:]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = start_serve(readme_serve_args(), tmp_path_factory.mktemp("readme") / "serve.log")
    yield started
    assert stop_serve(started) == 0


@pytest.fixture(scope="module")
def shell_env():
    bins = [ROOT / ".venv" / "bin", ROOT / ".tools" / "bin", pathlib.Path(sys.executable).parent]
    for tool in ("structgen", "grpcurl", "node"):
        assert any((folder / tool).exists() for folder in bins), f"{tool} missing: run `make setup`"
    path = os.pathsep.join(str(folder) for folder in bins)
    return {**os.environ, "PATH": f"{path}{os.pathsep}{os.environ['PATH']}", "NODE_NO_WARNINGS": "1"}


@pytest.fixture
def env(shell_env, server):
    return {**shell_env, "STRUCTGEN_SERVER": server.address}


@pytest.fixture(scope="module")
def schema_file_cleanup():
    """The examples write s.json and tools.json at the repository root, as a user's would (the
    Node block reads the one the command-line block wrote, so blocks run in README order):
    removed afterwards."""
    existed = {name: (ROOT / name).exists() for name in ("s.json", "tools.json")}
    yield
    for name, was_there in existed.items():
        if not was_there:
            (ROOT / name).unlink(missing_ok=True)


def _http(server) -> str:
    return server.http_url.removeprefix("http://")


def json_messages(text: str) -> list[dict]:
    decoder, messages, index = json.JSONDecoder(), [], 0
    while index < len(text):
        if text[index].isspace():
            index += 1
            continue
        message, index = decoder.raw_decode(text, index)
        messages.append(message)
    return messages


def check_output(command: str, cwd: pathlib.Path, result: subprocess.CompletedProcess) -> None:
    """Beyond exit 0: constrained outputs are what their constraint says."""
    argv = shlex.split(command)
    if "--json-schema" in argv:
        schema = json.loads((cwd / argv[argv.index("--json-schema") + 1]).read_text())
        jsonschema.validate(json.loads(result.stdout), schema)
    elif "--tools" in argv:  # one JSON line per call, arguments valid for the tool
        tools = {t["name"]: t["parameters"] for t in json.loads((cwd / argv[argv.index("--tools") + 1]).read_text())}
        calls = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
        assert calls, result.stdout
        for call in calls:
            jsonschema.validate(call["arguments"], tools[call["name"]])
    elif "--choice" in argv:
        choices = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--choice"]
        assert result.stdout.strip() in choices, result.stdout
    elif argv[0] == "grpcurl" and argv[-1].endswith("/Generate"):
        request = json.loads(argv[argv.index("-d") + 1])
        messages = json_messages(result.stdout)
        text = "".join(m.get("text", "") for m in messages)
        assert messages[-1]["finish_reason"] == "FINISH_REASON_GRAMMAR_COMPLETE", messages[-1]
        if "json_schema" in request:
            assert messages[-1]["validation"]["status"] == "VALIDATION_STATUS_VALID", messages[-1]
            jsonschema.validate(json.loads(text), json.loads(request["json_schema"]))
        else:
            assert text in request["choice"]["choices"]


def test_every_client_is_in_the_readme():
    commands = [c for block in readme_blocks("sh") for c in shell_commands(block)]
    for start in ("structgen generate", "grpcurl", "node client.js"):
        assert any(c.startswith(start) for c in commands), start
    python = readme_blocks("python")
    assert any("Client(" in b for b in python) and any("AsyncClient(" in b for b in python)


@pytest.mark.parametrize("index", range(len(readme_blocks("sh"))))
def test_shell_block_runs_as_printed(index, server, env, schema_file_cleanup):
    cwd = ROOT
    for command in shell_commands(readme_blocks("sh")[index]):
        if command.startswith("structgen serve") and command.endswith("&"):
            continue  # the server fixture started it
        command = command.replace(README_ADDRESS, server.address).replace(README_HTTP_ADDRESS, _http(server))
        if command.startswith("cd "):
            folder, _, command = command[3:].partition(" && ")
            cwd = (cwd / folder).resolve()
            if not command:
                continue
        result = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True,
                                timeout=300, executable="/bin/bash")
        assert result.returncode == 0, f"{command}\nexit {result.returncode}\n{result.stdout}\n{result.stderr}"
        check_output(command, cwd, result)


@pytest.mark.parametrize("index", range(len(readme_blocks("python"))))
def test_python_block_runs_as_printed(index, server):
    code = readme_blocks("python")[index].replace(README_ADDRESS, server.address).replace(
        README_HTTP_ADDRESS, _http(server))
    namespace: dict = {"__name__": "__main__"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"README.md python block {index}", "exec"), namespace)
    text = printed.getvalue()
    assert text.strip(), "the example printed nothing"
    if "weather" in namespace:  # the tools example: a valid call, then a reasoned choice
        assert text.splitlines()[0].endswith(" valid") and text.rstrip().endswith((" yes", " no")), text
    if "schema" in namespace:  # the constrained example prints its JSON document first
        document, _ = json.JSONDecoder().raw_decode(text.lstrip())
        jsonschema.validate(document, namespace["schema"])
        assert "grammar_complete True" in text.splitlines()
