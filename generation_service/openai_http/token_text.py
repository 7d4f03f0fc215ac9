"""The text and bytes of one token, as OpenAI's logprobs show it (`token`, `bytes`).

Decoding a lone token is wrong for SentencePiece (its leading "▁" space is dropped) and for a
token that is part of a character, so the bytes come from the vocabulary entry itself:
`<0xNN>` byte-fallback tokens are that byte, "▁" is a space (SentencePiece), and byte-level
BPE vocabularies (GPT-2's printable alphabet, "Ġ" for a space) map back through the
inverse of that alphabet. A token's `token` string is its bytes as UTF-8 where they are
valid, else `bytes:\\xNN...` (OpenAI's spelling for part of a character).
"""
from __future__ import annotations

from functools import lru_cache

_SENTENCEPIECE_SPACE = "\u2581"


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted: printable Latin-1 bytes stand for
    themselves and the others are shifted to 256 upwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shift)] = byte
            shift += 1
    return table


class TokenTexts:
    """Bytes and display text per token id of one tokenizer, memoised."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_ids = tokenizer.byte_fallback_ids
        self._special_ids = tokenizer.special_token_ids
        self._is_byte_level = tokenizer.is_byte_level
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        """(token, bytes) of `token_id`."""
        cached = self._cache.get(token_id)
        if cached is None:
            data = self._bytes(token_id)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
            cached = self._cache[token_id] = (text, list(data))
        return cached

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._byte_ids:
            return bytes([int(piece[3:5], 16)])
        if token_id in self._special_ids:
            return piece.encode()
        if self._is_byte_level:
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            return piece.encode()
        return piece.replace(_SENTENCEPIECE_SPACE, " ").encode()
