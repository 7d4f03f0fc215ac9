"""grpcurl (installed by `make setup` into .tools/bin) against the live server, via reflection.
The commands are the README's examples."""
import json
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GRPCURL = ROOT / ".tools" / "bin" / "grpcurl"


def _grpcurl(*args, check=True):
    if not GRPCURL.exists():
        pytest.fail("grpcurl is missing: run `make setup` (tools/install_grpcurl.py)")
    result = subprocess.run([str(GRPCURL), "-plaintext", *args], capture_output=True, text=True,
                            timeout=60)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def test_grpcurl_lists_and_describes_services_by_reflection(live_server):
    services = _grpcurl(live_server.address, "list").stdout.split()
    assert "structgen.v1.GenerationService" in services
    described = _grpcurl(live_server.address, "describe", "structgen.v1.GenerateRequest").stdout
    assert "oneof constraint" in described and "json_schema" in described


def test_grpcurl_generate_streams_json_messages(live_server):
    request = {"prompt": "Color:", "choice": {"choices": ["red", "blue"]}, "stop": {"max_tokens": 8}}
    out = _grpcurl("-d", json.dumps(request), live_server.address,
                   "structgen.v1.GenerationService/Generate").stdout
    messages = [json.loads(part) for part in _split_json_stream(out)]
    assert "guarantee" in messages[0]
    assert messages[-1]["finish_reason"] == "FINISH_REASON_GRAMMAR_COMPLETE"
    assert "".join(m.get("text", "") for m in messages) in ("red", "blue")


def test_grpcurl_health_and_model_info(live_server):
    health = json.loads(_grpcurl(live_server.address, "grpc.health.v1.Health/Check").stdout)
    assert health["status"] == "SERVING"
    info = json.loads(_grpcurl(live_server.address, "structgen.v1.GenerationService/GetModelInfo").stdout)
    assert info["max_new_tokens_limit"] == 64


def test_grpcurl_sees_the_error_status(live_server):
    result = _grpcurl("-d", '{"prompt": "x", "regex": "("}', live_server.address,
                      "structgen.v1.GenerationService/Generate", check=False)
    assert result.returncode != 0 and "InvalidArgument" in result.stderr


def _split_json_stream(text: str) -> list[str]:
    decoder, parts, index = json.JSONDecoder(), [], 0
    while index < len(text):
        if text[index].isspace():
            index += 1
            continue
        _, end = decoder.raw_decode(text, index)
        parts.append(text[index:end])
        index = end
    return parts
