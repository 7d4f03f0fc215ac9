"""Opening a GGUF checkpoint (llama.cpp's single-file format) with the `gguf` package.

A GGUF file holds everything a checkpoint folder spreads over several files: the model's
hyperparameters and its tokenizer as typed metadata (``llama.block_count``,
``tokenizer.ggml.tokens``, ``tokenizer.chat_template``, ...), then the tensors, often
quantized in blocks. ``gguf_config``, ``gguf_weights`` and ``gguf_tokenizer`` each read
their part from the ``GgufFile`` opened here.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

from generation_service.model.config import ModelLoadError

SUFFIX = ".gguf"


def find_gguf_file(path: pathlib.Path) -> pathlib.Path | None:
    """The GGUF file ``path`` names: itself, or the one .gguf in a folder; None if neither.

    A folder with several .gguf files, or a split file (``-00001-of-00003.gguf``), is refused:
    which one to serve would be a guess.
    """
    if path.is_file():
        return path if path.suffix == SUFFIX else None
    if not path.is_dir():
        return None
    found = sorted(path.glob(f"*{SUFFIX}"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelLoadError(f"{path}: holds several GGUF files ({names}); pass the one to serve as --model")
    return found[0] if found else None


def _check_not_split(path: pathlib.Path) -> None:
    if "-of-" in path.stem and path.stem.rsplit("-of-", 1)[1].isdigit():
        raise ModelLoadError(f"{path}: split GGUF files are not supported; merge them first "
                             "(llama.cpp's gguf-split --merge)")


@dataclass
class GgufFile:
    """One opened GGUF file: metadata by key, tensors by name (memory-mapped, read on use)."""

    path: pathlib.Path
    reader: Any  # gguf.GGUFReader

    @classmethod
    def open(cls, path: pathlib.Path) -> "GgufFile":
        _check_not_split(path)
        try:
            import gguf
        except ImportError:
            raise ModelLoadError(f"{path}: reading GGUF needs the gguf package: pip install gguf") from None
        try:
            reader = gguf.GGUFReader(str(path), "r")
        except Exception as error:  # the reader raises ValueError, struct.error, OSError, ...
            raise ModelLoadError(f"{path}: cannot be read as GGUF ({type(error).__name__}: {error})") from None
        return cls(path, reader)

    @property
    def architecture(self) -> str:
        return str(self.value("general.architecture", ""))

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python (str, int, float, bool or list); ``default`` when absent."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if not self.has(key):
            raise ModelLoadError(f"{self.path}: missing GGUF metadata '{key}'")
        return self.value(key)

    def raw_bytes(self, key: str) -> bytes:
        """The field's bytes as stored (name, type and value): a cheap identity for hashing."""
        return b"".join(part.tobytes() for part in self.reader.fields[key].parts)

    @property
    def tensors(self) -> dict[str, Any]:
        """GGUF tensor name -> gguf.ReaderTensor (``.tensor_type``, ``.shape``, ``.data``)."""
        return {tensor.name: tensor for tensor in self.reader.tensors}
