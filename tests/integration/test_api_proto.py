"""The proto is the contract: buf lint (STANDARD + COMMENTS) passes, stubs regenerate."""
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _buf() -> str:
    local = pathlib.Path(sys.executable).parent / "buf"
    return str(local) if local.exists() else shutil.which("buf") or "buf"


def test_buf_lint_passes_with_comment_rules():
    result = subprocess.run([_buf(), "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "COMMENTS" in (ROOT / "buf.yaml").read_text()


def test_generated_stubs_match_the_proto():
    from structgen.v1 import generation_pb2 as pb
    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    assert {m.name for m in service.methods} == {"Generate", "Tokenize", "GetModelInfo", "GetEngineStats"}
    assert service.methods_by_name["Generate"].server_streaming
    request = pb.GenerateRequest.DESCRIPTOR
    assert [f.name for f in request.oneofs_by_name["constraint"].fields] == [
        "json_schema", "regex", "lark", "structural_tag", "json_object", "choice"]
    assert [f.name for f in request.oneofs_by_name["input"].fields] == ["prompt", "token_ids", "chat"]
    for enum in pb.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED")
