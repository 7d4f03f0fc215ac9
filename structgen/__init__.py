"""structgen: gRPC LLM serving with grammar-constrained decoding (the CLI and what both
processes share)."""
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("structgen")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
