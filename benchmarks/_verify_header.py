"""What a benchmarks/verify.py run was, for the head of its JSON result.

`header` gives the command line, the device (`device_name`), the torch, triton and Python
versions, the code (`code_version`: the git commit and whether tracked files differ from it,
or $STRUCTGEN_CODE_COMMIT where there is no checkout, and a digest of the engine's sources,
verify.py and its _verify_* modules that identifies a device copy of the working tree), the
start time, the arguments and a one-line description of the workload.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import subprocess
import sys

import torch

from benchmarks._harness import ROOT, command_line, utc_now


def code_version() -> dict:
    """The git commit and whether tracked files differ from it where there is a checkout (else
    $STRUCTGEN_CODE_COMMIT), and a digest of the engine's sources, benchmarks/verify.py and its
    _verify_* modules, which identifies the code where there is no .git (a device copy of the
    working tree)."""
    def git(*words: str) -> str | None:
        try:
            done = subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    digest = hashlib.sha256()
    here = pathlib.Path(__file__).resolve().parent  # benchmarks/
    for path in sorted([*(ROOT / "generation_service").rglob("*.py"), here / "verify.py", *here.glob("_verify_*.py")]):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return {"code_commit": commit or os.environ.get("STRUCTGEN_CODE_COMMIT", "unknown"),
            "code_dirty": None if status is None else bool(status), "code_sha256": digest.hexdigest()[:16]}


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def header(args) -> dict:
    """What the run was: command, device, versions, code, arguments."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"command": command_line(f"python {sys.argv[0]}"), "device": device_name(args.device),
            "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
            **code_version(), "started": utc_now(), "args": vars(args),
            "workload": "prompt P x repeats (random ids); drafts: see workloads; greedy unless --temperature"}
