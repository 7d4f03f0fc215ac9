"""The proto is the contract: buf lint (STANDARD + COMMENTS) passes, stubs regenerate, and
`buf breaking` finds nothing against the last release tag (or the merge base with main)."""
import pathlib
import shutil
import subprocess
import sys

import pytest

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


def _git(*args: str) -> str | None:
    result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else None


def baseline_ref() -> str:
    """What the proto must stay compatible with: the last release tag (v*), else the merge
    base with main; on main itself (merge base = HEAD), the committed protos."""
    tag = _git("describe", "--tags", "--abbrev=0", "--match", "v*")
    if tag:
        return tag
    for branch in ("main", "origin/main"):
        base = _git("merge-base", "HEAD", branch)
        if base:
            return base
    return "HEAD"


def _export(ref: str, folder: pathlib.Path) -> None:
    archive = subprocess.run(["git", "archive", ref, "protos", "buf.yaml"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)


def test_buf_breaking_against_the_last_release_or_merge_base(tmp_path):
    if _git("rev-parse", "--git-dir") is None:
        pytest.skip("not a git checkout: no earlier proto to compare with")
    ref = baseline_ref()
    _export(ref, tmp_path)
    result = subprocess.run([_buf(), "breaking", "--against", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"protos/ breaks compatibility with {ref}:\n{result.stdout}{result.stderr}"


def test_buf_breaking_catches_a_removed_field(tmp_path):
    """The check can fail: the same protos with one field deleted do not pass."""
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    proto = tmp_path / "protos" / "structgen" / "v1" / "generation.proto"
    text = proto.read_text()
    assert "  uint32 num_logprobs = 15;\n" in text
    proto.write_text(text.replace("  uint32 num_logprobs = 15;\n", ""))
    result = subprocess.run([_buf(), "breaking", "--against", str(ROOT)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "num_logprobs" in result.stdout + result.stderr
