"""The default backend: xgrammar (GrammarCompiler per tokenizer, BatchGrammarMatcher fills)."""
from __future__ import annotations

import functools
import json
import re
from typing import Sequence

import numpy as np
import xgrammar as xgr

from generation_service.engine.params import GrammarSpec
from grammar_service.backends.base import GrammarBackend, GrammarCompileError, Matcher, TokenizerData
from grammar_service.backends.xgrammar_unenforced import find_unenforced
from grammar_service.schema_drafts import as_drafted

# xgrammar prefixes messages with "[hh:mm:ss] /project/cpp/file.cc:123: " and sometimes
# "Check failed: (...) is false: "; the user needs neither.
_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def _clean_message(exc: Exception) -> str:
    return _LOG_PREFIX.sub("", str(exc)).strip() or type(exc).__name__


def _choice_ebnf(choices: Sequence[str]) -> str:
    # json.dumps gives a double-quoted literal with \" \\ \n \uXXXX escapes, which is the
    # escape syntax of xgrammar's EBNF string literals.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


try:  # the public batch_accept_token converts its result element by element (~1.6 us each)
    _RAW_BATCH_ACCEPT = xgr.matcher._core.BatchGrammarMatcher.batch_accept_token
except AttributeError:  # another xgrammar layout: use the public API
    _RAW_BATCH_ACCEPT = None


class XGrammarMatcher(Matcher):
    __slots__ = ("inner", "handle")

    def __init__(self, inner: xgr.GrammarMatcher):
        self.inner = inner
        self.handle = inner._handle

    def accept(self, token_id: int) -> bool:
        return self.inner.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def jump_forward_tokens(self) -> list[int]:
        return self.inner.find_jump_forward_tokens()


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: TokenizerData, *, num_compile_threads: int, num_fill_threads: int,
                 min_parallel_advance_rows: int = 0, num_llguidance_lanes: int = 1):
        # min_parallel_advance_rows is ignored: batch_accept_token is a static C++ loop over the
        # rows in the calling thread (xgrammar 0.2.9), never BatchGrammarMatcher's fill threads.
        super().__init__(tokenizer, num_compile_threads=num_compile_threads,
                         num_fill_threads=num_fill_threads, min_parallel_advance_rows=min_parallel_advance_rows,
                         num_llguidance_lanes=num_llguidance_lanes)
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.tokenizer_json)
        self.tokenizer_info = xgr.TokenizerInfo(
            list(tokenizer.encoded_vocab), meta["vocab_type"], vocab_size=tokenizer.vocab_size,
            stop_token_ids=list(tokenizer.stop_token_ids) or None,
            add_prefix_space=meta["add_prefix_space"])
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=num_compile_threads)
        # 0 = xgrammar's "auto" (hardware threads / 2).
        self._batch = xgr.BatchGrammarMatcher(num_fill_threads or "auto")

    # ---- compile -------------------------------------------------------------------------
    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            return self._compile(spec)
        except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError,
                xgr.InvalidStructuralTagError) as exc:
            raise GrammarCompileError(f"{spec.kind}: {_clean_message(exc)}") from None

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind in ("json_schema", "json_object"):
            text = as_drafted(spec.text) if spec.kind == "json_schema" else '{"type": "object"}'
            any_ws = spec.any_whitespace and spec.max_whitespace != 0
            # strict_mode=False: objects and arrays are as open as the schema says (xgrammar's
            # default closes every object without additionalProperties, refusing valid output).
            return self._compiler.compile_json_schema(
                text, any_whitespace=any_ws, separators=None if any_ws else (",", ":"),
                max_whitespace_cnt=spec.max_whitespace if any_ws else None, strict_mode=False)
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.text)
        if spec.kind == "lark":
            return self._compiler.compile_lark(spec.text)
        if spec.kind == "structural_tag":
            return self._compiler.compile_structural_tag(spec.text)
        if spec.kind == "choice":
            return self._compiler.compile_grammar(_choice_ebnf(spec.choices))
        raise GrammarCompileError(f"unsupported grammar kind {spec.kind!r}")

    def unenforced_keywords(self, spec: GrammarSpec) -> tuple:
        if spec.kind != "json_schema":
            return ()
        try:
            schema = json.loads(as_drafted(spec.text))
        except ValueError:
            return ()  # the compile reports the malformed JSON
        return tuple(find_unenforced(schema))

    # ---- matchers ------------------------------------------------------------------------
    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    @functools.cached_property
    def stop_token_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer_info.stop_token_ids)  # those xgrammar detected included

    def batch_accept(self, matchers: Sequence[XGrammarMatcher], token_ids: Sequence[int]) -> list[bool]:
        if _RAW_BATCH_ACCEPT is None:
            return xgr.BatchGrammarMatcher.batch_accept_token([m.inner for m in matchers], list(token_ids))
        # slicing the returned array converts it in one call
        return [bool(ok) for ok in _RAW_BATCH_ACCEPT([m.handle for m in matchers], list(token_ids), False)[:]]

    def batch_fill(self, matchers: Sequence[XGrammarMatcher], masks: np.ndarray, indices: Sequence[int]) -> None:
        # masks is a view of the shared region: xgrammar writes into it through DLPack.
        self._batch.batch_fill_next_token_bitmask([m.inner for m in matchers], masks, list(indices))

    def batch_rollback(self, matchers: Sequence[XGrammarMatcher], num_tokens: Sequence[int]) -> None:
        xgr.BatchGrammarMatcher.batch_rollback([m.inner for m in matchers], list(num_tokens))
