"""Real tokenizers for tests and benchmarks, converted once to tokenizer.json and cached.

The vocabularies ship inside the `mistral-common` package (no download):
- ``mistral_32k``: Mistral SentencePiece v3 (32768 tokens, byte fallback), converted by
  transformers' SentencePiece converter;
- ``tekken_131k``: Tekken (131072 tokens, byte-level BPE), converted by transformers'
  `convert_tekken_tokenizer`.
Each lands in ``~/.cache/structgen/tokenizers/<name>/`` (tokenizer.json +
tokenizer_config.json); conversion takes seconds and runs once per machine. Writing goes
through a temporary folder and a rename, so concurrent test processes never see half a
tokenizer. Benchmarks import this file too (benchmarks/grammar_step.py).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

CACHE_ROOT = pathlib.Path(os.path.expanduser("~")) / ".cache" / "structgen" / "tokenizers"
VOCAB_SIZES = {"mistral_32k": 32768, "tekken_131k": 131072}


def _mistral_common_data() -> pathlib.Path:
    import mistral_common

    return pathlib.Path(mistral_common.__file__).parent / "data"


def _convert_mistral_32k(out: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    src = _mistral_common_data() / "mistral_instruct_tokenizer_240323.model.v3"
    with tempfile.TemporaryDirectory() as spm_dir:
        shutil.copy(src, pathlib.Path(spm_dir) / "tokenizer.model")
        config = {"tokenizer_class": "LlamaTokenizer", "legacy": False, "bos_token": "<s>",
                  "eos_token": "</s>", "unk_token": "<unk>"}
        (pathlib.Path(spm_dir) / "tokenizer_config.json").write_text(json.dumps(config))
        AutoTokenizer.from_pretrained(spm_dir).save_pretrained(out)


def _convert_tekken_131k(out: pathlib.Path) -> None:
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    convert_tekken_tokenizer(str(_mistral_common_data() / "tekken_240911.json")).save_pretrained(out)


def tokenizer_dir(name: str) -> pathlib.Path:
    """Folder with tokenizer.json for `name` (one of VOCAB_SIZES), converting on first use."""
    convert = {"mistral_32k": _convert_mistral_32k, "tekken_131k": _convert_tekken_131k}[name]
    final = CACHE_ROOT / name
    if (final / "tokenizer.json").is_file():
        return final
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE_ROOT))
    try:
        convert(tmp)
        try:
            tmp.rename(final)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def continuation_ids(tokenizer, text: str) -> list[int]:
    """Ids of `text` as a model emits it mid-sequence (`tokenizer`: a tokenizers.Tokenizer).

    SentencePiece tokenizers prepend "▁" to the first word of an encoding; a model writing a
    JSON document after its prompt does not. Encode "\\n" + text and drop the ids of "\\n".
    """
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if ids and not tokenizer.id_to_token(ids[0]).startswith("\u2581") and tokenizer.decode(ids) == text:
        return ids  # no prefix space (byte-level BPE such as Tekken)
    prefix = tokenizer.encode("\n", add_special_tokens=False).ids
    full = tokenizer.encode("\n" + text, add_special_tokens=False).ids
    if full[:len(prefix)] != prefix:
        raise ValueError(f"cannot split {text[:20]!r} from its newline prefix")
    ids = full[len(prefix):]
    assert tokenizer.decode(ids) == text, (tokenizer.decode(ids), text)
    return ids
