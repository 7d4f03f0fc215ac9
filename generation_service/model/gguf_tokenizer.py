"""A GGUF file's tokenizer, written once as an ordinary tokenizer folder.

Both processes read a tokenizer as tokenizer.json (+ tokenizer_config.json,
generation_config.json): the engine through ``tokenizer.Tokenizer``, grammar_service for
its masks, and both fingerprint those files. So the tokenizer a GGUF file describes in its
metadata is converted to them once, into ``<cache>/gguf-tokenizers/<digest>/``; the digest
covers every metadata field the conversion reads, so an edited file gets a new folder.

Two vocabularies are read, as llama.cpp runs them:

- ``gpt2``: byte-level BPE with the file's merges; ``tokenizer.ggml.pre`` names how text is
  split into words first (the split the merges were learned with).
- ``llama``: SentencePiece BPE (byte fallback, "▁" for spaces); merges follow the pieces'
  scores, the higher score merging first, as SentencePiece does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import tempfile

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from generation_service.model.config import ModelLoadError
from generation_service.model.gguf_reader import GgufFile
from structgen.cache_dir import cache_root, ensure_folder

log = logging.getLogger(__name__)

CONVERTER_VERSION = "1"  # part of the digest: bump when the conversion's output changes
TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 1, 2, 3, 4
_SPECIAL_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                 "pad_token": "padding_token_id"}
_STOP_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")

# The regex splits of the tokenizer.json files these vocabularies come from (llama.cpp
# spells the same splits in its own regex dialect, keyed by tokenizer.ggml.pre).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_words():
    return [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]


def _digits_then_gpt2_words():
    return [pre_tokenizers.Digits(individual_digits=True), *_gpt2_words()]


def _split(pattern: str):
    return lambda: [pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]


# tokenizer.ggml.pre -> the pre-tokenizer steps; names as llama.cpp's converter writes them.
PRE_TOKENIZERS = {
    "gpt2": _gpt2_words, "mpt": _gpt2_words, "olmo": _gpt2_words,
    "smollm": _digits_then_gpt2_words, "starcoder": _digits_then_gpt2_words,
    "refact": _digits_then_gpt2_words, "codeshell": _digits_then_gpt2_words,
    "llama-bpe": _split(_LLAMA3_SPLIT), "llama3": _split(_LLAMA3_SPLIT), "llama-v3": _split(_LLAMA3_SPLIT),
    "dbrx": _split(_LLAMA3_SPLIT), "smaug-bpe": _split(_LLAMA3_SPLIT),
    "qwen2": _split(_QWEN2_SPLIT), "stablelm2": _split(_QWEN2_SPLIT), "deepseek-r1-qwen": _split(_QWEN2_SPLIT),
}
# Llama 3 looks a whole word up in the vocabulary before merging (llama.cpp: ignore_merges).
_IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3")


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    """Control and unknown tokens as special, user-defined ones as plain added tokens:
    either way matched whole in the text, never cut into pieces."""
    added = []
    for token, kind in zip(tokens, types):
        if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            added.append(AddedToken(token, special=True, normalized=False))
        elif kind == TOKEN_TYPE_USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    return added


def _byte_level_bpe(file: GgufFile, tokens: list[str]) -> Tokenizer:
    pre = str(file.value("tokenizer.ggml.pre", "gpt2"))
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(f"{file.path}: GGUF pre-tokenizer '{pre}' is not supported "
                             f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    merges = [tuple(merge.split(" ", 1)) for merge in file.require("tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(PRE_TOKENIZERS[pre]())
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's rule (merge the adjacent pair whose joined
    piece scores highest): every split of a piece into two pieces, ordered by its score."""
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked = []
    for piece, score, kind in zip(tokens, scores, types):
        if kind not in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(file: GgufFile, tokens: list[str], types: list[int]) -> Tokenizer:
    scores = [float(s) for s in file.require("tokenizer.ggml.scores")]
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = file.value("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE(vocab, sentencepiece_merges(tokens, scores, types),
                                     unk_token=None if unk_id is None else tokens[int(unk_id)],
                                     fuse_unk=True, byte_fallback=True))
    space_prefix = bool(file.value("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if space_prefix else [])])
    return tokenizer


def build_tokenizer(file: GgufFile) -> Tokenizer:
    """The `tokenizers` tokenizer the file's ``tokenizer.ggml.*`` metadata describes."""
    kind = str(file.require("tokenizer.ggml.model"))
    tokens = [str(t) for t in file.require("tokenizer.ggml.tokens")]
    types = [int(t) for t in file.value("tokenizer.ggml.token_type", [TOKEN_TYPE_NORMAL] * len(tokens))]
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(file, tokens)
        default_add_bos = False
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(file, tokens, types)
        default_add_bos = True  # llama.cpp's default for SentencePiece vocabularies
    else:
        raise ModelLoadError(f"{file.path}: GGUF tokenizer model '{kind}' is not supported (supported: gpt2, llama)")
    tokenizer.add_special_tokens(_added_tokens(tokens, types))
    bos_id = file.value("tokenizer.ggml.bos_token_id")
    if bos_id is not None and file.value("tokenizer.ggml.add_bos_token", default_add_bos):
        bos = tokens[int(bos_id)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))])
    return tokenizer


def tokenizer_files(file: GgufFile) -> dict[str, str]:
    """File name -> text of the tokenizer folder for ``file``."""
    tokens = file.require("tokenizer.ggml.tokens")
    config = {name: str(tokens[int(file.value(f"tokenizer.ggml.{key}"))])
              for name, key in _SPECIAL_KEYS.items() if file.has(f"tokenizer.ggml.{key}")}
    config.update(tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False)
    if file.has("tokenizer.chat_template"):
        config["chat_template"] = str(file.value("tokenizer.chat_template"))
    stop_ids = [int(file.value(f"tokenizer.ggml.{key}")) for key in _STOP_KEYS if file.has(f"tokenizer.ggml.{key}")]
    generation = {"eos_token_id": list(dict.fromkeys(stop_ids))}
    if file.has("tokenizer.ggml.bos_token_id"):
        generation["bos_token_id"] = int(file.value("tokenizer.ggml.bos_token_id"))
    return {"tokenizer.json": build_tokenizer(file).to_str(),
            "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
            "generation_config.json": json.dumps(generation, indent=2)}


def tokenizer_digest(file: GgufFile) -> str:
    digest = hashlib.sha256(CONVERTER_VERSION.encode())
    for key in sorted(k for k in file.reader.fields if k.startswith("tokenizer.")):
        digest.update(file.raw_bytes(key))
    return digest.hexdigest()[:32]


def ensure_gguf_tokenizer(file: GgufFile) -> pathlib.Path:
    """The tokenizer folder converted from ``file``'s metadata (created on first use).

    In the cache; where the cache cannot be written (a read-only root filesystem) and holds
    no conversion yet, in the temporary folder instead, for this process's lifetime and
    its grammar_service child's."""
    if not file.has("tokenizer.ggml.tokens"):
        raise ModelLoadError(f"{file.path}: the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    digest = tokenizer_digest(file)

    def write(staging: pathlib.Path) -> None:
        log.info("converting the tokenizer of %s (once)", file.path)
        for name, text in tokenizer_files(file).items():
            (staging / name).write_text(text, encoding="utf-8")

    try:
        return ensure_folder(cache_root() / "gguf-tokenizers" / digest, "tokenizer.json", write)
    except OSError as error:
        fallback = pathlib.Path(tempfile.gettempdir()) / f"structgen-{os.getuid()}" / "gguf-tokenizers" / digest
        log.warning("cannot write the tokenizer cache (%s); converting into %s", error, fallback)
        return ensure_folder(fallback, "tokenizer.json", write)
