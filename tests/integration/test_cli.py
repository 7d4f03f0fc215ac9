"""The `structgen` command line as a user runs it: generate against the live server, demo."""
import json
import pathlib
import re
import subprocess
import sys

import jsonschema

ROOT = pathlib.Path(__file__).resolve().parents[2]


def structgen(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "structgen.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_generate_streams_text_to_stdout(live_server):
    result = structgen("generate", "--server", live_server.address, "--choice", "yes", "--choice", "no",
                       "Agree?")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("yes", "no")


def test_generate_with_a_schema_file_prints_valid_json(live_server, tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    result = structgen("generate", "--server", live_server.address, "--json-schema", str(path),
                       "--compact", "--max-tokens", "24", "-v", "Number:")
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), schema)
    assert "[validation]" in result.stderr and "valid=True" in result.stderr


def test_generate_regex_and_lark(live_server, tmp_path):
    result = structgen("generate", "--server", live_server.address, "--regex", "[0-9]{4}", "Year:")
    assert result.returncode == 0 and re.fullmatch(r"[0-9]{4}", result.stdout.strip()), result.stderr
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "up" | "down"\n')
    result = structgen("generate", "--server", live_server.address, "--lark", str(grammar), "Dir:")
    assert result.returncode == 0 and result.stdout.strip() in ("up", "down"), result.stderr


def test_generate_error_prints_status_and_exits_non_zero(live_server):
    result = structgen("generate", "--server", live_server.address, "--max-tokens", "100000", "hi")
    assert result.returncode == 1
    assert "error: OUT_OF_RANGE:" in result.stderr and "max_new_tokens_limit" in result.stderr
    result = structgen("generate", "--server", live_server.address, "--regex", "(", "hi")
    assert result.returncode == 1 and "error: INVALID_ARGUMENT:" in result.stderr


def test_generate_without_a_server_is_unavailable(tmp_path):
    result = structgen("generate", "--server", "127.0.0.1:1", "--timeout", "5", "hi")
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr


def test_demo_exits_zero_and_its_output_validates():
    from structgen.commands.demo import SCHEMA
    result = structgen("demo", timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(l for l in result.stdout.splitlines() if l.startswith("demo: VALID"))
    document = json.loads(line.split(": ", 2)[2])
    jsonschema.validate(document, SCHEMA)
    assert re.search(r"[A-Za-z]{3,}", document["name"]), document  # words, not noise


def test_a_max_tokens_no_output_fits_is_refused_naming_the_minimum(live_server, tmp_path):
    """A JSON document or a tool call that cannot finish within --max-tokens: the server refuses the
    request at once, naming the max_tokens that fits (the grammar closes an output within its
    budget, so none is cut short); exit 1 as for any failed call."""
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string"}},
                                  "required": ["name"], "additionalProperties": False}))
    result = structgen("generate", "--server", live_server.address, "--chat", "--json-schema", str(schema),
                       "--max-tokens", "3", "Name a person as JSON.")
    assert result.returncode == 1 and result.stdout == "", result.stderr
    assert "error: INVALID_ARGUMENT: max_tokens 3 is below the shortest output" in result.stderr
    assert "set max_tokens to at least" in result.stderr
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}]))
    result = structgen("generate", "--server", live_server.address, "--tools", str(tools), "--tool-choice",
                       "required", "--max-tokens", "8", "What time is it in Berlin?")
    assert result.returncode == 1 and result.stdout == "", result.stderr
    assert "set max_tokens to at least" in result.stderr
