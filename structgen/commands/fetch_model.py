"""`structgen fetch-model`: make a built-in model local now (as `make setup` and image builds do).

Prints the model's local path. For a GGUF model the tokenizer converted from its metadata is
written too, so a server on a read-only filesystem finds everything it needs in the cache.
"""
from __future__ import annotations

import sys


def add_parser(subparsers) -> None:
    from structgen.builtin_models import BUILTIN_MODELS

    parser = subparsers.add_parser("fetch-model", help="fetch or build a built-in model into the cache",
                                   description=__doc__)
    parser.add_argument("name", nargs="?", default="default", choices=list(BUILTIN_MODELS),
                        help="built-in model (default: default)")
    parser.set_defaults(run=run)


def run(args, _rest) -> int:
    import logging

    from structgen.builtin_models import resolve_builtin
    from generation_service.model.config import ModelLoadError
    from generation_service.model.gguf_reader import GgufFile, find_gguf_file
    from generation_service.model.gguf_tokenizer import ensure_gguf_tokenizer

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = resolve_builtin(args.name)
        gguf_path = find_gguf_file(path)
        if gguf_path is not None:
            ensure_gguf_tokenizer(GgufFile.open(gguf_path))
    except ModelLoadError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0
