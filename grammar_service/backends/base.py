"""The grammar backend interface: what the compiler and the step loop need from a backend.

A backend is built once per tokenizer. It compiles `GrammarSpec`s into opaque compiled
grammars, makes matchers from them and does the per-step work *in batches*: the loop
calls `batch_accept`, `batch_fill` and `batch_rollback` once per position of a step,
never once per row, so a backend can spread rows over native threads.

Invariants every backend keeps:
- `batch_fill` writes row `indices[i]` of `masks` (int32, shape [rows, ceil(vocab/32)],
  bit t of a row set <=> token t allowed) from `matchers[i]` and does not change state;
  rows it is not given are left untouched. Matchers given to it are not terminated.
- `batch_accept` advances each matcher by one token and reports, per matcher, whether
  the token was allowed; a matcher that refused a token is left where it was.
- `batch_advance` is `batch_accept` for the deferred advance by the tokens the GPU sampled
  under these matchers' own masks, where the loop drops every matcher that refuses: such a
  matcher may be left unusable, so a backend may skip its "left where it was" bookkeeping.
  Its results and states do not depend on how it runs (one row at a time or rows in native
  threads from `min_parallel_advance_rows` rows on).
- `batch_rollback` undoes the last n accepted tokens of each matcher, including the stop
  token that terminated it.
- A matcher terminates only by accepting one of `stop_token_ids` (the loop asks
  `is_terminated` only after those).
- Compile errors raise `GrammarCompileError` with a message fit for the user.
"""
from __future__ import annotations

import abc
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
from tokenizers import Tokenizer

from grammar_contract.spec import GrammarSpec


class GrammarCompileError(ValueError):
    """The grammar does not compile (malformed JSON, bad regex, bad Lark...)."""


@dataclass(frozen=True)
class TokenizerData:
    """What a backend needs to know about the served tokenizer."""

    encoded_vocab: tuple[str, ...]  # token strings by id, as in tokenizer.json; "" for holes
    vocab_size: int                 # mask width (the model's logits width)
    stop_token_ids: tuple[int, ...]
    tokenizer_json: str             # the raw tokenizer.json (decoder and pre-tokenizer info)
    # tokens tokenizer.json marks special: the served text leaves them out (skip_special_tokens)
    special_token_ids: tuple[int, ...] = ()
    # objects made from the fields above once per process, shared by every user of this
    # tokenizer there and by processes forked after they were made (grammar_service/template.py):
    # "text" (the tokenizers.Tokenizer forced runs are spelled with) and, per backend name, what
    # `GrammarBackend.derive_tokenizer` makes
    derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def derive(self, name: str, make: Callable[[], Any]) -> Any:
        """`derived[name]`, made by `make()` on first use."""
        found = self.derived.get(name)
        if found is None:
            found = self.derived.setdefault(name, make())
        return found

    @property
    def text_tokenizer(self) -> Tokenizer:
        return self.derive("text", lambda: Tokenizer.from_str(self.tokenizer_json))


class Matcher(abc.ABC):
    """One request's grammar state. Single-token operations; batches go through the backend."""

    @abc.abstractmethod
    def accept(self, token_id: int) -> bool: ...

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """True once the matcher accepted a stop token; it accepts nothing more."""

    @abc.abstractmethod
    def jump_forward_tokens(self) -> list[int]:
        """Tokens the grammar forces from here (may be empty); does not change state."""


class GrammarBackend(abc.ABC):
    """Compiles grammars for one tokenizer and runs matchers in batches."""

    name: str = ""

    def __init__(self, tokenizer: TokenizerData, *, num_compile_threads: int, num_fill_threads: int,
                 min_parallel_advance_rows: int = 0, num_llguidance_lanes: int = 1):
        """Builds what holds threads (fill and compile pools) here; the tokenizer-level data
        comes from `tokenizer.derive(self.name, ...)`, made once per process."""
        self.tokenizer = tokenizer
        # from this many rows a backend that can advance rows in native threads does so (0: never);
        # backends without such a path ignore it. num_llguidance_lanes: llguidance's alone
        # (backends/llguidance.py, lanes); the others take it to share one constructor call.
        self.min_parallel_advance_rows = min_parallel_advance_rows

    @classmethod
    def derive_tokenizer(cls, tokenizer: TokenizerData) -> Any:
        """What this backend makes from the tokenizer alone (the slow part of building it). It
        must hold no thread and no lock, so that a process forked after it was made can use it."""
        return None

    @classmethod
    def tokenizer_codec(cls) -> tuple[Callable[[Any], bytes], Callable[[bytes], Any]] | None:
        """(dump, load) of `derive_tokenizer`'s result for the on-disk tokenizer cache
        (grammar_service/tokenizer_cache.py), where loading beats deriving; None: derived anew."""
        return None

    @abc.abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """Compile `spec` (slow; called from the compile pool). Raises GrammarCompileError."""

    @abc.abstractmethod
    def new_matcher(self, compiled: Any) -> Matcher: ...

    @abc.abstractmethod
    def batch_accept(self, matchers: Sequence[Matcher], token_ids: Sequence[int]) -> list[bool]: ...

    def batch_advance(self, matchers: Sequence[Matcher], token_ids: Sequence[int]) -> list[bool]:
        """`batch_accept`, except that a matcher that refused its token may be left unusable."""
        return self.batch_accept(matchers, token_ids)

    @abc.abstractmethod
    def batch_fill(self, matchers: Sequence[Matcher], masks: np.ndarray, indices: Sequence[int]) -> None: ...

    def fill_alone(self, matcher: Matcher, masks: np.ndarray, index: int) -> None:
        """`batch_fill` of one row, safe beside a `batch_fill` running in another thread (the
        slow filler, grammar_service/slow_filler.py); it should release the GIL while it fills."""
        self.batch_fill([matcher], masks, [index])

    @abc.abstractmethod
    def batch_rollback(self, matchers: Sequence[Matcher], num_tokens: Sequence[int]) -> None: ...

    @functools.cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """Tokens whose acceptance can terminate a matcher (read once per row and token)."""
        return frozenset(self.tokenizer.stop_token_ids)

    def unenforced_keywords(self, spec: GrammarSpec) -> tuple:
        """JSON Schema keywords in `spec` this backend does not enforce (UnenforcedKeyword)."""
        return ()
