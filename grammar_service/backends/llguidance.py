"""The llguidance backend: Earley parser + lazy lexer, compiles real-world schemas in ms.

Compared with xgrammar (see docs/guarantees.md, "Backends and `auto`"): compile is 10-1000x faster
because llguidance builds token masks lazily per step instead of precomputing them per
grammar rule; mask fill costs a little more per token. It compiles JSON Schemas in
`lenient` mode and reports every keyword it weakened as a grammar warning, which
`grammar_service.guarantees` turns into UnenforcedKeyword entries with pointers.

Stop tokens are kept out of llguidance's token history: llguidance does not always count
an EOS it accepted in a stopped state, so `rollback` over it would undo one token too many.
A matcher here accepts a stop token iff the grammar is accepting, remembers it, and rolls it
back itself (base.py: batch_rollback undoes the stop token too).

Lanes: `LLMatcher.deep_copy` shares the original's lexer (llguidance's Parser.shared, an
Arc<Mutex>) and every mask fill and consume holds that lock, so copies of one matcher fill and
advance one at a time whatever the thread count. A compiled grammar therefore holds several
templates built apart ("lanes", each with its own lexer and lock) and hands new matchers out
round robin over them; rows of one grammar then spread over as many locks as lanes.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import llguidance as llg
import numpy as np

from grammar_contract.spec import GrammarSpec, ReasoningSpan
from grammar_service.backends.base import GrammarBackend, GrammarCompileError, Matcher, TokenizerData
from grammar_service.backends.llguidance_schema import for_llguidance
from grammar_service.backends.llguidance_tags import structural_tag_grammar
from grammar_service.config import llguidance_lanes
from grammar_service.guarantees import llguidance_unenforced
from grammar_service.schema_drafts import as_drafted

WHITESPACE = r"[\x20\x0A\x0D\x09]"


@dataclass(frozen=True)
class LLGuidanceGrammar:
    """A compiled grammar: validated matchers in their start state (lanes), copied per request.

    Every lane was built apart from the same grammar (module doc: its own lexer lock); they
    give the same masks and accept the same tokens. `next_lane` hands lanes out round robin.
    """

    grammar: str                  # llguidance's serialized grammar (JSON)
    lanes: tuple[llg.LLMatcher, ...]
    warnings: tuple[str, ...]     # what llguidance weakened (lenient JSON Schema)
    _counter: Iterator[int] = field(default_factory=itertools.count, compare=False, repr=False)

    def next_lane(self) -> int:
        # next() on itertools.count is atomic under the GIL: loops of several channels may
        # bind rows of one grammar at once
        return next(self._counter) % len(self.lanes)


def schema_text(spec: GrammarSpec) -> str:
    """The JSON Schema text llguidance compiles for a json_schema spec: as its draft means it,
    references and patterns in forms llguidance takes (backends/llguidance_schema.py)."""
    return for_llguidance(as_drafted(spec.text))


def json_options(spec: GrammarSpec) -> dict:
    """llguidance JsonCompileOptions for a spec: lenient, oneOf as anyOf, whitespace policy."""
    options: dict = {"lenient": True, "coerce_one_of": True}
    if spec.single_line and not spec.any_whitespace:
        options.update(whitespace_flexible=False, item_separator=", ", key_separator=": ")
    elif not spec.any_whitespace or spec.max_whitespace == 0:
        options.update(whitespace_flexible=False, item_separator=",", key_separator=":")
    elif spec.max_whitespace is not None:
        options.update(whitespace_flexible=True, whitespace_pattern=f"{WHITESPACE}{{0,{spec.max_whitespace}}}")
    else:
        options.update(whitespace_flexible=True)
    return options


def unsupported(spec: GrammarSpec) -> str:
    """Why llguidance must not serve this spec ("" when it may).

    Measured on llguidance 1.9.1: with a bounded whitespace_pattern, once the run is at its
    limit the mask admits " ]" (space + bracket) and not "]", and the matcher then refuses
    the token the mask allowed (tests/unit/schemas/test_backend_slots.py). So a JSON grammar
    with 0 < max_whitespace is refused here; `auto` uses xgrammar for it.
    """
    if spec.kind in ("json_schema", "json_object") and spec.any_whitespace and spec.max_whitespace:
        return (f"{spec.kind}: llguidance does not support max_whitespace > 0 (its masks admit "
                "whitespace its matcher refuses); use compact, max_whitespace 0 or xgrammar")
    if spec.reasoning is not None and spec.reasoning.max_tokens is not None:
        return ("llguidance cannot roll back a lexeme with max_tokens, which the reasoning budget "
                "needs and speculative decoding relies on; use xgrammar for a reasoning max_tokens")
    return ""


def _none(text: str) -> int | None:
    return None


def grammar_for(spec: GrammarSpec, special_id: Callable[[str], int | None] = _none,
                token_id: Callable[[str], int | None] = _none) -> str:
    """The llguidance grammar (serialized) for a spec; raises GrammarCompileError.
    `special_id(text)` / `token_id(text)`: the id of the special token / of any token spelled
    `text` (markers and tokens of reasoning spans and structural tags)."""
    if unsupported(spec):
        raise GrammarCompileError(unsupported(spec))
    if spec.reasoning is not None:
        inner = grammar_for(dataclasses.replace(spec, reasoning=None), special_id, token_id)
        return after_reasoning(spec.reasoning, inner, lambda text: special_id(text) is not None)
    if spec.kind == "structural_tag":
        return structural_tag_grammar(spec.text, special_id, token_id)
    try:
        if spec.kind in ("json_schema", "json_object"):
            text = schema_text(spec) if spec.kind == "json_schema" else '{"type": "object"}'
            return llg.LLMatcher.grammar_from_json_schema(text, defaults=json_options(spec))
        if spec.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "lark":
            return llg.LLMatcher.grammar_from_lark(spec.text)
        if spec.kind == "choice":
            # JSON string literals are valid Lark literals (same escapes).
            return llg.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choices))
    except ValueError as exc:  # malformed JSON Schema text
        raise GrammarCompileError(f"{spec.kind}: {exc}") from None
    raise GrammarCompileError(f"{spec.kind}: not supported by the llguidance backend "
                              "(use backend \"xgrammar\")")


_CONSTRAINT = "structgen_constraint"
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")


def _marker(text: str, is_special: Callable[[str], bool]) -> str:
    """A marker in Lark: `<name>` for a special token (llguidance lexes those apart from
    text, so a string literal would never match one), else a string literal."""
    return text if is_special(text) else json.dumps(text, ensure_ascii=False)


def after_reasoning(span: ReasoningSpan, constraint: str, is_special: Callable[[str], bool]) -> str:
    """A top-level grammar: the reasoning span in Lark, then the constraint as a sub-grammar.

    Free text before a special end token is any text (it cannot hold special tokens); before
    a textual end marker it is a lazy lexeme that stops at the marker's first occurrence.
    """
    grammars = json.loads(constraint)["grammars"] if constraint.lstrip().startswith("{") else \
        [{"lark_grammar": constraint}]
    grammars[0] = {**grammars[0], "name": _CONSTRAINT}
    parts, rules = [], []
    if not span.starts_open:
        parts.append(_marker(span.begin, is_special))
    if is_special(span.end):
        parts += ["REASONING", span.end]
        rules.append("REASONING: /(?s:.*)/")
    else:
        escaped = "".join("\\" + c if c in _REGEX_META else c for c in span.end)
        parts.append("reasoning")
        rules.append(f"reasoning[lazy]: /(?s:.*){escaped}/")
    if span.separator:
        parts.append(json.dumps(span.separator, ensure_ascii=False))
    lark = "\n".join([f"start: {' '.join(parts)} @{_CONSTRAINT}", *rules]) + "\n"
    return json.dumps({"grammars": [{"lark_grammar": lark}, *grammars]})


class LLGuidanceMatcher(Matcher):
    __slots__ = ("inner", "stop_ids", "lane", "stopped_by_token")

    def __init__(self, inner: llg.LLMatcher, stop_ids: frozenset[int], lane: int = 0):
        self.inner = inner
        self.stop_ids = stop_ids
        self.lane = lane  # the lane of its compiled grammar it was copied from (its lexer lock)
        self.stopped_by_token = False  # accepted a stop token (kept out of llguidance's history)

    def accept(self, token_id: int) -> bool:
        if self.stopped_by_token:
            return False
        if token_id in self.stop_ids:
            if self.inner.is_accepting():
                self.stopped_by_token = True
                return True
            return False
        # try_consume_tokens leaves the matcher where it was on a refused token
        # (consume_token would put it into a permanent error state).
        return self.inner.try_consume_tokens([token_id]) == 1

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self.stopped_by_token:
            self.stopped_by_token = False
            num_tokens -= 1
        if num_tokens > 0 and not self.inner.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self.inner.get_error()}")

    def is_terminated(self) -> bool:
        return self.stopped_by_token

    def jump_forward_tokens(self) -> list[int]:
        return [] if self.stopped_by_token else list(self.inner.compute_ff_tokens())


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer: TokenizerData, *, num_compile_threads: int, num_fill_threads: int,
                 min_parallel_advance_rows: int = 0, num_llguidance_lanes: int = 1):
        super().__init__(tokenizer, num_compile_threads=num_compile_threads, num_fill_threads=num_fill_threads,
                         min_parallel_advance_rows=min_parallel_advance_rows,
                         num_llguidance_lanes=num_llguidance_lanes)
        self._stop_ids = frozenset(tokenizer.stop_token_ids)
        self.lltokenizer: llg.LLTokenizer = tokenizer.derive(self.name, lambda: self.derive_tokenizer(tokenizer))
        self._executor = llg.LLExecutor(num_fill_threads or None)
        self._mask_bytes = tokenizer.mask_words * 4
        self.num_lanes = llguidance_lanes(num_llguidance_lanes, num_fill_threads)

    @classmethod
    def derive_tokenizer(cls, tokenizer: TokenizerData) -> llg.LLTokenizer:
        # LLTokenizer takes the tokenizer.json text; n_vocab = mask width (logits width). It has
        # no serialized form: each tokenizer load derives it (forked processes inherit it).
        return llg.LLTokenizer(tokenizer.tokenizer_json, n_vocab=tokenizer.vocab_size,
                               eos_token=list(tokenizer.stop_token_ids) or None)

    # ---- compile -------------------------------------------------------------------------
    def compile(self, spec: GrammarSpec) -> LLGuidanceGrammar:
        """Builds every lane here, in the compile pool (its cost: docs/architecture.md step 4):
        the compile's answer waits for them once per grammar, and the rows of a burst of
        requests on a new grammar, bound together right after it, already spread over all lanes
        (lanes built later, in the background, would leave that burst on lane 0 for its whole
        generation). A row is never bound before its grammar's compile finished, so no mask
        waits for a lane."""
        grammar = grammar_for(spec, self._special_id, self._token_ids.get)
        first = llg.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if first.is_error():
            raise GrammarCompileError(f"{spec.kind}: {first.get_error()}")
        lanes = [first, *(llg.LLMatcher(self.lltokenizer, grammar, log_level=0) for _ in range(self.num_lanes - 1))]
        return LLGuidanceGrammar(grammar, tuple(lanes), tuple(first.get_grammar_warnings()))

    def unenforced_keywords(self, spec: GrammarSpec) -> tuple:
        if spec.kind != "json_schema":
            return ()
        return llguidance_unenforced(as_drafted(spec.text), json_options(spec))

    @functools.cached_property
    def _token_ids(self) -> dict[str, int]:
        return {text: token_id for token_id, text in enumerate(self.tokenizer.encoded_vocab) if text}

    def _special_id(self, text: str) -> int | None:
        token_id = self._token_ids.get(text)
        return token_id if token_id is not None and self.lltokenizer.is_special_token(token_id) else None

    # ---- matchers ------------------------------------------------------------------------
    def new_matcher(self, compiled: LLGuidanceGrammar) -> LLGuidanceMatcher:
        # NOTE: deep_copy shares the lane's lexer (llguidance's Parser.shared, an Arc<Mutex>)
        # and every compute_mask / consume_token holds that lock, so the rows of one lane fill
        # and advance one at a time whatever the thread count (hence lanes: 8 halve the fill of
        # one schema's rows on 16 CPUs; docs/architecture.md step 4).
        # Round robin rather than least loaded: rows of one grammar live about as long.
        lane = compiled.next_lane()
        return LLGuidanceMatcher(compiled.lanes[lane].deep_copy(), self._stop_ids, lane)

    def batch_accept(self, matchers: Sequence[LLGuidanceMatcher], token_ids: Sequence[int]) -> list[bool]:
        # One token per matcher costs microseconds; the mask fill is where threads pay off.
        return [m.accept(t) for m, t in zip(matchers, token_ids)]

    def batch_advance(self, matchers: Sequence[LLGuidanceMatcher], token_ids: Sequence[int]) -> list[bool]:
        # consume_token skips try_consume_tokens' undo-on-refusal, work the advance does not
        # need: a refused token leaves llguidance's matcher in its error state, which base.py
        # allows here.
        if 0 < self.min_parallel_advance_rows <= len(matchers):
            return self._advance_in_threads(matchers, token_ids)
        stop_ids = self._stop_ids
        return [m.accept(t) if m.stopped_by_token or t in stop_ids else m.inner.consume_token(t)
                for m, t in zip(matchers, token_ids)]

    def _advance_in_threads(self, matchers: Sequence[LLGuidanceMatcher], token_ids: Sequence[int]) -> list[bool]:
        """batch_advance in one LLExecutor.consume_token_par call: the GIL released, the rows'
        consume_token spread over the fill threads (rows of one grammar still one at a time, see
        new_matcher). Stop tokens and stopped rows go through `accept` (kept out of llguidance's
        history, module doc)."""
        stop_ids = self._stop_ids
        accepted = [False] * len(matchers)
        by_lane = self._lane_lists()  # (position, llguidance matcher, token) of the other rows
        for k, (m, t) in enumerate(zip(matchers, token_ids)):
            if m.stopped_by_token or t in stop_ids:
                accepted[k] = m.accept(t)
            else:
                by_lane[m.lane].append((k, m.inner, t))
        plain = list(itertools.chain.from_iterable(by_lane))
        if plain:  # consume_token_par raises ValueError("No matchers") on an empty list (1.9.1)
            for (k, _, _), ok in zip(plain, self._executor.consume_token_par([(m, t) for _, m, t in plain])):
                accepted[k] = ok
        return accepted

    def _lane_lists(self) -> list[list]:
        """One list per lane, for the rows of a batch call, which is then given to the executor
        lane after lane. It splits its list into contiguous chunks, one a thread: rows of one
        lane side by side keep threads off each other's lexer locks, where rows in slot order
        (lanes round robin) put every lane in every chunk. Cheaper than a sort, and as cheap as
        the plain list comprehension."""
        return [[] for _ in range(self.num_lanes)]

    def batch_fill(self, matchers: Sequence[LLGuidanceMatcher], masks: np.ndarray, indices: Sequence[int]) -> None:
        if masks.dtype != np.int32 or masks.shape[1] * 4 != self._mask_bytes:
            raise ValueError(f"masks must be int32 [rows, {self._mask_bytes // 4}], got {masks.dtype} {masks.shape}")
        by_lane = self._lane_lists()
        for m, i in zip(matchers, indices):
            if not m.stopped_by_token:
                by_lane[m.lane].append((m.inner, int(i)))
        live = list(itertools.chain.from_iterable(by_lane))
        if live:
            if not masks.flags["C_CONTIGUOUS"]:
                raise ValueError("masks must be C-contiguous (a view of whole channel rows)")
            # Rows are written in native threads straight into the (shared) array.
            self._executor.unsafe_compute_mask_ptr(live, masks.ctypes.data, self._mask_bytes, masks.shape[0])
        for m, i in zip(matchers, indices):
            if m.stopped_by_token:  # base.py says callers never pass these; stay safe anyway
                masks[i] = 0

    def batch_rollback(self, matchers: Sequence[LLGuidanceMatcher], num_tokens: Sequence[int]) -> None:
        for m, n in zip(matchers, num_tokens):
            m.rollback(n)
