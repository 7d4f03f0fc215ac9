"""`structgen calibrate-self-spec`: choose the layers self-speculative drafts skip, once per model.

Measures on real text (teacher-forced, one forward per candidate set, 1.5 x num_layers
forwards; generation_service/model/layer_skip.py) which layers a draft can skip, and caches the
choice under the structgen cache folder, where a server reads it at the first request with
proposer "self". Texts: files given with --text-file (parts split at lines of "==="), else the
bundled generation_service/model/calibration/default.txt (prose and a JSON document).
"""
from __future__ import annotations

import pathlib
import sys

def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("calibrate-self-spec", help="choose the layers self-speculative drafts skip",
                                   description=__doc__)
    parser.add_argument("--model", default="default", help="checkpoint, built-in model or random:<preset>")
    parser.add_argument("--text-file", action="append", type=pathlib.Path, default=[],
                        help="real text to calibrate on (repeatable; default: the bundled text)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens of each text part (default 256)")
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="the k the choice is made for (default 4)")
    parser.add_argument("--dtype", default=None, help="weights dtype (default: the checkpoint's)")
    parser.add_argument("--seed", type=int, default=0, help="random-weight models")
    parser.set_defaults(run=run)


def read_texts(paths: list[pathlib.Path]) -> list[str]:
    from generation_service.model.layer_skip import DEFAULT_TEXT

    parts = []
    for path in paths or [DEFAULT_TEXT]:
        parts += [part.strip() for part in path.read_text(encoding="utf-8").split("\n===\n") if part.strip()]
    return parts


def run(args, _rest) -> int:
    import json
    import logging

    from generation_service.model.config import ModelLoadError
    from generation_service.model.layer_skip import calibrate, model_key, store_choice
    from generation_service.model.loader import load_model

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        loaded = load_model(args.model, dtype=args.dtype, seed=args.seed)
    except ModelLoadError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if loaded.tokenizer is None:
        print("error: calibration tokenizes text; this model has no tokenizer", file=sys.stderr)
        return 1
    texts = [loaded.tokenizer.encode(text)[:args.max_tokens] for text in read_texts(args.text_file)]
    choice = calibrate(loaded.model, texts, model_key(loaded.path, args.model, args.seed),
                       num_draft_tokens=args.num_draft_tokens)
    path = store_choice(choice)
    if choice.estimated_speedup < 1:
        print(f"note: even the best choice is estimated at x{choice.estimated_speedup:.2f} tokens/s: this model's "
              "layers are not redundant enough (or its LM head too large a share) for self-speculation to pay",
              file=sys.stderr)
    print(json.dumps({"path": str(path), "skip_layers": choice.skip_layers, "acceptance": round(choice.acceptance, 3),
                      "estimated_speedup": round(choice.estimated_speedup, 3), "num_tokens": choice.num_tokens,
                      "seconds": choice.seconds}))
    return 0
