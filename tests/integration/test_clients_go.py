"""The Go example client (clients/go) against the live server. Optional: built from Debian's
Go packages (see clients/go/build.sh), so the test is skipped where they are not installed."""
import json
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NEEDED = ("go", "protoc-gen-go", "protoc-gen-go-grpc")


@pytest.fixture(scope="module")
def go_client() -> str:
    missing = [tool for tool in NEEDED if shutil.which(tool) is None]
    if missing or not pathlib.Path("/usr/share/gocode/src/google.golang.org/grpc").is_dir():
        pytest.skip(f"Debian Go packages not installed ({', '.join(missing) or 'golang-google-grpc-dev'}); "
                    "see clients/go/build.sh")
    result = subprocess.run([str(ROOT / "clients" / "go" / "build.sh")], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_go_client_streams_a_constrained_completion(live_server, go_client, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    result = subprocess.run([go_client, "-server", live_server.address, "-json-schema", str(path),
                             "-compact", "-max-tokens", "32", "Answer:"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert isinstance(json.loads(result.stdout)["ok"], bool)
    assert "FINISH_REASON_GRAMMAR_COMPLETE" in result.stderr and "valid:true" in result.stderr


def test_go_client_reports_the_error_status(live_server, go_client):
    result = subprocess.run([go_client, "-server", live_server.address, "-regex", "(", "x"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "error: INVALID_ARGUMENT:" in result.stderr
