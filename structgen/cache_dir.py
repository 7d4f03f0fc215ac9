"""structgen's cache folder and the one way folders appear in it: built aside, renamed in.

    $STRUCTGEN_CACHE, else $XDG_CACHE_HOME/structgen, else ~/.cache/structgen

It holds the built-in models and the tokenizers converted from GGUF files. No torch here:
both processes import it.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import tempfile
from typing import Callable

log = logging.getLogger(__name__)


def cache_root() -> pathlib.Path:
    """Read from the environment at each call, so tests and users can point it elsewhere."""
    root = os.environ.get("STRUCTGEN_CACHE")
    if root:
        return pathlib.Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(xdg) / "structgen"


def ensure_folder(folder: pathlib.Path, marker: str, write: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """``folder``, created by ``write(staging)`` unless ``folder/marker`` already exists.

    Atomic: files go to a temporary sibling that is renamed into place, so a reader never
    sees a half-written folder and two racing creators are harmless (the first rename wins,
    the other's staging folder is removed). A folder is never rewritten in place: a new
    version gets a new name.
    """
    if (folder / marker).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        write(staging)
        # mkdtemp makes the folder private; the cache is shared like any model folder.
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
        os.rename(staging, folder)
    except OSError:
        if not (folder / marker).is_file():  # not just a racing creator that won
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
