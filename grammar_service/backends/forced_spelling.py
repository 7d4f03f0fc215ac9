"""ForcedSpelling: a forced run spelled with the tokens the tokenizer itself would use.

xgrammar's `find_jump_forward_tokens` covers the forced bytes with any tokens that spell them,
byte-fallback tokens included (Mistral's "<0x5F>" for "_", where the tokenizer, and a model
trained on it, writes "_"). As drafts those are rejected by the model at once. Here the run's
text is encoded again with the served tokenizer, as a model writes it mid-sequence (no prefix
space); xgrammar's run still decides where the run ends (no longer token extends its last one).
llguidance's `compute_ff_tokens` already tokenizes canonically and needs none of this.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

from tokenizers import Tokenizer

from grammar_service.backends.base import TokenizerData


class ForcedSpelling:
    """Built with the backend; what it needs is made on the first run it spells (a few tens
    of ms, once: only requests with the grammar proposer ask for runs)."""

    def __init__(self, tokenizer: TokenizerData, decoded_vocab: Callable[[], Sequence[bytes]]):
        self._data = tokenizer
        self._decoded_vocab = decoded_vocab  # () -> token id -> its bytes

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return self._data.text_tokenizer or Tokenizer.from_str(self._data.tokenizer_json)

    @functools.cached_property
    def decoded_vocab(self) -> Sequence[bytes]:
        return self._decoded_vocab()

    @functools.cached_property
    def _newline_ids(self) -> list[int]:
        return self.tokenizer.encode("\n", add_special_tokens=False).ids

    def respell(self, token_ids: list[int]) -> list[int]:
        """The tokenizer's ids for the text of `token_ids`; `token_ids` themselves when that
        text is not whole UTF-8 or the tokenizer does not give it back exactly."""
        if not token_ids:
            return token_ids
        try:
            text = b"".join(self.decoded_vocab[t] for t in token_ids).decode("utf-8")
        except (UnicodeDecodeError, IndexError):
            return token_ids
        ids = self.continuation_ids(text)
        return ids if ids else token_ids

    def continuation_ids(self, text: str) -> list[int]:
        """`text` encoded as it continues a sequence: SentencePiece-style tokenizers put "▁"
        before the first word of an encoding, which a model mid-document does not write; so
        encode "\\n" + text and drop the newline's ids. [] when no exact spelling is found."""
        encode, decode = self.tokenizer.encode, self.tokenizer.decode
        ids = encode(text, add_special_tokens=False).ids
        if ids and not self.tokenizer.id_to_token(ids[0]).startswith("\u2581") and decode(ids) == text:
            return ids  # no prefix space (byte-level BPE)
        full = encode("\n" + text, add_special_tokens=False).ids
        if full[:len(self._newline_ids)] != self._newline_ids:
            return []
        ids = full[len(self._newline_ids):]
        return ids if decode(ids) == text else []
