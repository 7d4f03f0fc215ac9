"""The default backend: xgrammar (GrammarCompiler per tokenizer, BatchGrammarMatcher fills)."""
from __future__ import annotations

import functools
import json
import re
import weakref
from typing import Callable, Sequence

import numpy as np
import xgrammar as xgr

from grammar_contract.spec import GrammarSpec, ReasoningSpan
from grammar_service.backends.base import GrammarBackend, GrammarCompileError, Matcher, TokenizerData
from grammar_service.backends.forced_spelling import ForcedSpelling
from grammar_service.backends.xgrammar_specials import SpecialTokenFilter, named_token_ids
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


def _schema_text(spec: GrammarSpec) -> str:
    return as_drafted(spec.text) if spec.kind == "json_schema" else '{"type": "object"}'


def _json_options(spec: GrammarSpec) -> dict:
    any_ws = spec.any_whitespace and spec.max_whitespace != 0
    # strict_mode=False: objects and arrays are as open as the schema says (xgrammar's
    # default closes every object without additionalProperties, refusing valid output).
    separators = None if any_ws else (", ", ": ") if spec.single_line else (",", ":")
    return dict(any_whitespace=any_ws, separators=separators,
                max_whitespace_cnt=spec.max_whitespace if any_ws else None, strict_mode=False)


def reasoning_format(span: ReasoningSpan, token_id: Callable[[str], int | None] = lambda text: None,
                     stop_ids: Sequence[int] = ()) -> list[dict]:
    """Structural-tag elements of a reasoning span: free text (at most `max_tokens` tokens,
    then only the end marker is allowed) closed by the end marker, then the separator.

    An end marker that is one added token (`token_id`: Qwen3's </think>) is matched as that
    token, with token-level free text before it (neither marker nor a stop token), so a spent
    budget forces the marker's own token rather than any spelling of its text; llguidance
    lexes added tokens apart the same way, and the server's parser ends the span there too.
    Any other marker is text: the span ends at its first occurrence."""
    end_id = token_id(span.end)
    begin_id = token_id(span.begin) if span.begin else None
    if end_id is not None:
        excluded = [end_id, *([] if begin_id is None else [begin_id]), *stop_ids]
        content: dict = {"type": "any_tokens", "exclude_tokens": sorted(set(excluded))}
        end: str | dict = {"type": "token", "token": end_id}
    else:
        content, end = {"type": "any_text"}, span.end
    if span.max_tokens is not None:
        content["max_tokens"] = span.max_tokens
    begin: str | dict = "" if span.starts_open else span.begin
    if begin and begin_id is not None:
        begin = {"type": "token", "token": begin_id}
    elements = [{"type": "tag", "begin": begin, "content": content, "end": end}]
    if span.separator:
        elements.append({"type": "const_string", "value": span.separator})
    return elements


try:  # the public batch_accept_token converts its result element by element (a call per row)
    _RAW_BATCH_ACCEPT = xgr.matcher._core.BatchGrammarMatcher.batch_accept_token
except AttributeError:  # another xgrammar layout: use the public API
    _RAW_BATCH_ACCEPT = None


class XGrammarMatcher(Matcher):
    __slots__ = ("inner", "handle", "specials", "keep", "spelling")

    def __init__(self, inner: xgr.GrammarMatcher, specials: SpecialTokenFilter, keep: np.ndarray,
                 spelling: ForcedSpelling):
        self.inner = inner
        self.handle = inner._handle
        self.specials, self.keep = specials, keep  # keep: the special tokens this grammar names
        self.spelling = spelling

    def accept(self, token_id: int) -> bool:
        return self.specials.allows(self.keep, token_id) and self.inner.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def jump_forward_tokens(self) -> list[int]:
        # xgrammar spells with byte tokens too; a model writes the tokenizer's own spelling
        return self.spelling.respell(self.inner.find_jump_forward_tokens())


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: TokenizerData, *, num_compile_threads: int, num_fill_threads: int,
                 min_parallel_advance_rows: int = 0, num_llguidance_lanes: int = 1):
        # min_parallel_advance_rows is ignored: batch_accept_token is a static C++ loop over the
        # rows in the calling thread (xgrammar 0.2.9), never BatchGrammarMatcher's fill threads.
        super().__init__(tokenizer, num_compile_threads=num_compile_threads,
                         num_fill_threads=num_fill_threads, min_parallel_advance_rows=min_parallel_advance_rows,
                         num_llguidance_lanes=num_llguidance_lanes)
        self.tokenizer_info: xgr.TokenizerInfo = tokenizer.derive(self.name, lambda: self.derive_tokenizer(tokenizer))
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=num_compile_threads)
        # xgrammar would match special tokens as text, which the served text leaves out
        self._specials = SpecialTokenFilter(tokenizer.special_token_ids, self.stop_token_ids, tokenizer.vocab_size)
        self._named_specials: dict[int, np.ndarray] = {}  # id(compiled) -> its keep, when it names any
        # 0 = xgrammar's "auto" (hardware threads / 2).
        self._batch = xgr.BatchGrammarMatcher(num_fill_threads or "auto")
        self._spelling = ForcedSpelling(tokenizer, lambda: self.tokenizer_info.decoded_vocab)

    @classmethod
    def derive_tokenizer(cls, tokenizer: TokenizerData) -> xgr.TokenizerInfo:
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.tokenizer_json)
        return xgr.TokenizerInfo(
            list(tokenizer.encoded_vocab), meta["vocab_type"], vocab_size=tokenizer.vocab_size,
            stop_token_ids=list(tokenizer.stop_token_ids) or None,
            add_prefix_space=meta["add_prefix_space"])

    @classmethod
    def tokenizer_codec(cls):
        # the JSON form loads several times faster than the vocabulary type is detected and the
        # TokenizerInfo built (docs/grammar_service.md, "Start-up")
        return (lambda info: info.serialize_json().encode("utf-8"),
                lambda blob: xgr.TokenizerInfo.deserialize_json(blob.decode("utf-8")))

    # ---- compile -------------------------------------------------------------------------
    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError,
                xgr.InvalidStructuralTagError) as exc:
            raise GrammarCompileError(f"{spec.kind}: {_clean_message(exc)}") from None
        keep = self._specials.keep_for(named_token_ids(spec, lambda text: self._token_ids.get(text)))
        if keep is not self._specials.keep:
            key = id(compiled)
            self._named_specials[key] = keep
            weakref.finalize(compiled, self._named_specials.pop, key, None)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.reasoning is not None:
            return self._compile_after_reasoning(spec)
        if spec.kind in ("json_schema", "json_object"):
            return self._compiler.compile_json_schema(_schema_text(spec), **_json_options(spec))
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.text)
        if spec.kind == "lark":
            return self._compiler.compile_lark(spec.text)
        if spec.kind == "structural_tag":
            return self._compiler.compile_structural_tag(spec.text)
        if spec.kind == "choice":
            return self._compiler.compile_grammar(_choice_ebnf(spec.choices))
        raise GrammarCompileError(f"unsupported grammar kind {spec.kind!r}")

    def _compile_after_reasoning(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The span (a structural tag: its token budget is xgrammar's any_text max_tokens), then
        the constraint compiled as it would be alone. A structural tag constraint is spliced
        into one tag, so that token formats in it resolve against this tokenizer."""
        prefix = reasoning_format(spec.reasoning, self._added_token_ids.get, self.tokenizer.stop_token_ids)
        if spec.kind == "structural_tag":
            tag = json.loads(spec.text)
            if isinstance(tag, dict) and "format" in tag:
                return self._compiler.compile_structural_tag(json.dumps(
                    {**tag, "format": {"type": "sequence", "elements": [*prefix, tag["format"]]}}))
        head = xgr.Grammar.from_structural_tag(json.dumps(
            {"type": "structural_tag", "format": {"type": "sequence", "elements": prefix}}))
        return self._compiler.compile_grammar(xgr.Grammar.concat(head, self._grammar(spec)))

    @functools.cached_property
    def _token_ids(self) -> dict[str, int]:
        return {text: token_id for token_id, text in enumerate(self.tokenizer.encoded_vocab) if text}

    @functools.cached_property
    def _added_token_ids(self) -> dict[str, int]:
        """The added tokens (special or not) by their text: the reasoning markers taken as tokens."""
        added = json.loads(self.tokenizer.tokenizer_json).get("added_tokens") or []
        return {token["content"]: token["id"] for token in added if token["id"] < self.tokenizer.vocab_size}

    def _grammar(self, spec: GrammarSpec) -> xgr.Grammar:
        """The constraint alone as an uncompiled Grammar (with the options `_compile` uses)."""
        if spec.kind in ("json_schema", "json_object"):
            return xgr.Grammar.from_json_schema(_schema_text(spec), **_json_options(spec))
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "lark":
            return xgr.Grammar.from_lark(spec.text)
        if spec.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec.text)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(spec.choices))
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
        keep = self._named_specials.get(id(compiled), self._specials.keep)
        return XGrammarMatcher(xgr.GrammarMatcher(compiled), self._specials, keep, self._spelling)

    @functools.cached_property
    def stop_token_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer_info.stop_token_ids)  # those xgrammar detected included

    def batch_accept(self, matchers: Sequence[XGrammarMatcher], token_ids: Sequence[int]) -> list[bool]:
        if not self._specials.special_ids.isdisjoint(token_ids):  # refused where the masks refuse them
            return [m.accept(t) for m, t in zip(matchers, token_ids)]
        if _RAW_BATCH_ACCEPT is None:
            return xgr.BatchGrammarMatcher.batch_accept_token([m.inner for m in matchers], list(token_ids))
        # slicing the returned array converts it in one call
        return [bool(ok) for ok in _RAW_BATCH_ACCEPT([m.handle for m in matchers], list(token_ids), False)[:]]

    def batch_fill(self, matchers: Sequence[XGrammarMatcher], masks: np.ndarray, indices: Sequence[int]) -> None:
        # masks is a view of the shared region: xgrammar writes into it through DLPack.
        self._batch.batch_fill_next_token_bitmask([m.inner for m in matchers], masks, list(indices))
        self._specials.apply(masks, indices, [m.keep for m in matchers])

    def fill_alone(self, matcher: XGrammarMatcher, masks: np.ndarray, index: int) -> None:
        # The matcher's own fill: the shared BatchGrammarMatcher may be filling other rows.
        matcher.inner.fill_next_token_bitmask(masks, index)
        self._specials.apply(masks, [index], [matcher.keep])

    def batch_rollback(self, matchers: Sequence[XGrammarMatcher], num_tokens: Sequence[int]) -> None:
        xgr.BatchGrammarMatcher.batch_rollback([m.inner for m in matchers], list(num_tokens))
