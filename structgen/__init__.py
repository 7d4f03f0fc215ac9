"""structgen: gRPC LLM serving with grammar-constrained decoding (the CLI and what both
processes share)."""


def __getattr__(name: str):
    # __version__ on first use: importlib.metadata costs ~0.1 s of every command's start-up,
    # a window where Ctrl-C would meet no handler of ours
    if name != "__version__":
        raise AttributeError(f"module 'structgen' has no attribute {name!r}")
    from importlib import metadata
    try:
        return metadata.version("structgen")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"
