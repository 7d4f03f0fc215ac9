"""Structural tags (xgrammar's JSON format) as llguidance grammars: Lark with inline JSON
Schemas, lazy lexemes for text triggers and token syntax for special tokens.

llguidance lexes every added token of the tokenizer as a special token, apart from text: a
string literal "<tool_call>" could only be spelled from sub-tokens, never by the token a model
writes. So literals are split around the texts of special tokens, which become `<[id]>`.

Formats: const_string, json_schema, regex, grammar (Lark), any_text (excludes, max_chars),
any_tokens, token, sequence, or, tag, triggered_tags, token_triggered_tags,
tags_with_separator, optional, star, plus, repeat. Refused with a message that names the
format: token budgets (`max_tokens`: llguidance cannot roll back such a lexeme), bounded
whitespace in JSON (`max_whitespace_cnt`: backends/llguidance.py, `unsupported`), EBNF
grammars, non-JSON argument styles and the legacy "structures" form.
"""
from __future__ import annotations

import json
from typing import Callable

from grammar_service.backends.base import GrammarCompileError

_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")
_JSON_OPTIONS = {"lenient": True, "coerce_one_of": True}  # as backends/llguidance.json_options


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


class LarkBuilder:
    """Rules of one grammar, named r0, r1, ... in the order they are made."""

    def __init__(self, special_id: Callable[[str], int | None], token_id: Callable[[str], int | None]) -> None:
        self._special_id = special_id   # id of a special token spelled `text`, else None
        self._token_id = token_id       # id of any token spelled `text`, else None
        self.rules: list[str] = []
        self.grammars: list[dict] = []

    def rule(self, body: str, attributes: str = "") -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{attributes}: {body}")
        return name

    # ---- leaves ----------------------------------------------------------------------------
    def literal(self, text: str) -> str:
        """A string as Lark: literals, with special tokens' texts as their tokens."""
        specials = sorted({t for t in self._specials_in(text)}, key=len, reverse=True)
        parts, rest = [], text
        while rest:
            hits = [(rest.find(t), t) for t in specials if t in rest]
            if not hits:
                parts.append(json.dumps(rest, ensure_ascii=False))
                break
            index, special = min(hits)
            if index:
                parts.append(json.dumps(rest[:index], ensure_ascii=False))
            parts.append(f"<[{self._special_id(special)}]>")
            rest = rest[index + len(special):]
        return " ".join(parts) if parts else self.rule("")

    def _specials_in(self, text: str):
        """Substrings of `text` that are special tokens: those between < > or [ ] (where
        added tokens' texts live) looked up whole."""
        for opening, closing in (("<", ">"), ("[", "]")):
            start = text.find(opening)
            while start >= 0:
                end = text.find(closing, start)
                if end < 0:
                    break
                candidate = text[start:end + 1]
                if self._special_id(candidate) is not None:
                    yield candidate
                start = text.find(opening, start + 1)

    def token(self, token) -> str:
        token_id = token if isinstance(token, int) else self._token_id(token)
        if token_id is None:
            raise GrammarCompileError(f"structural_tag: {token!r} is not a token of this tokenizer")
        return f"<[{token_id}]>"

    def token_ids(self, tokens) -> list[int]:
        return [int(self.token(t)[2:-2]) for t in tokens]

    # ---- formats ---------------------------------------------------------------------------
    def format(self, fmt: dict) -> str:
        kind = fmt.get("type")
        method = getattr(self, "_" + str(kind), None)
        if method is None:
            raise GrammarCompileError(f"structural_tag: format {kind!r} is not supported by llguidance; use xgrammar")
        return method(fmt)

    def _const_string(self, fmt: dict) -> str:
        return self.literal(fmt["value"])

    def _json_schema(self, fmt: dict) -> str:
        if fmt.get("style", "json") != "json" or fmt.get("any_order"):
            raise GrammarCompileError("structural_tag: llguidance takes JSON arguments in the plain json style only")
        if fmt.get("max_whitespace_cnt") is not None:
            raise GrammarCompileError("structural_tag: llguidance does not support max_whitespace > 0 (its masks "
                                      "admit whitespace its matcher refuses); use xgrammar")
        schema = fmt["json_schema"]
        schema = {} if schema is True else schema
        if not isinstance(schema, dict):
            raise GrammarCompileError("structural_tag: json_schema must be an object or true")
        options = {**_JSON_OPTIONS, **schema.get("x-guidance", {})}
        return self.rule("%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False))

    def _regex(self, fmt: dict) -> str:
        return self.rule("/" + fmt["pattern"].replace("/", "\\/") + "/")

    def _grammar(self, fmt: dict) -> str:
        if fmt.get("syntax", "ebnf") != "lark":
            raise GrammarCompileError("structural_tag: llguidance takes Lark grammars only (syntax \"lark\")")
        name = f"g{len(self.grammars)}"
        self.grammars.append({"name": name, "lark_grammar": fmt["grammar"]})
        return f"@{name}"

    def _text_rule(self, excludes, max_chars=None) -> str:
        """Any text (at most `max_chars`), containing none of `excludes`."""
        body = f"/(?s:.{{0,{max_chars}}})/" if max_chars is not None else "/(?s:.*)/"
        for text in excludes:
            body += f" & ~/(?s:.*){_escape(text)}(?s:.*)/"
        name = f"TEXT{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def _any_text(self, fmt: dict) -> str:
        if fmt.get("max_tokens") is not None:
            raise GrammarCompileError("structural_tag: llguidance cannot roll back a token budget (any_text "
                                      "max_tokens); use xgrammar")
        return self._text_rule(fmt.get("excludes", ()), fmt.get("max_chars"))

    def _any_tokens(self, fmt: dict) -> str:
        if fmt.get("max_tokens") is not None:
            raise GrammarCompileError("structural_tag: llguidance cannot roll back a token budget (any_tokens "
                                      "max_tokens); use xgrammar")
        excluded = self.token_ids(fmt.get("exclude_tokens", ()))
        return self.rule(f"<[^{','.join(map(str, excluded))}]>*" if excluded else "<[*]>*")

    def _token(self, fmt: dict) -> str:
        return self.token(fmt["token"])

    def _sequence(self, fmt: dict) -> str:
        return self.rule(" ".join(self.format(e) for e in fmt["elements"]))

    def _or(self, fmt: dict) -> str:
        return self.rule(" | ".join(self.format(e) for e in fmt["elements"]))

    def _optional(self, fmt: dict) -> str:
        return self.rule(f"({self.format(fmt['content'])})?")

    def _star(self, fmt: dict) -> str:
        return self.rule(f"({self.format(fmt['content'])})*")

    def _plus(self, fmt: dict) -> str:
        return self.rule(f"({self.format(fmt['content'])})+")

    def _repeat(self, fmt: dict) -> str:
        low, high = fmt.get("min", 0), fmt.get("max")
        return self.rule(f"({self.format(fmt['content'])}){{{low},{'' if high in (None, -1) else high}}}")

    def _edge(self, value) -> str:
        if isinstance(value, dict):
            return self.format(value)
        if isinstance(value, list):
            return self.rule(" | ".join(self.literal(v) for v in value))
        return self.literal(value) if value else ""

    def _tag(self, fmt: dict, after_trigger: str | int | None = None) -> str:
        """begin content end; `after_trigger`: the trigger (text, or a token id) that starts
        begin, matched already."""
        begin = fmt["begin"]
        if after_trigger is not None:
            begin = begin[len(after_trigger):] if isinstance(begin, str) else ""
        content, end = fmt["content"], fmt["end"]
        if content.get("type") == "any_text" and isinstance(end, str) and end and self._special_id(end) is None \
                and not content.get("excludes") and content.get("max_chars") is None and content.get("max_tokens") is None:
            # text up to the end marker's first occurrence: one lazy lexeme holding the marker
            inner = self.rule(f"/(?s:.*){_escape(end)}/", "[lazy]")
            return self.rule(" ".join(p for p in (self._edge(begin), inner) if p))
        return self.rule(" ".join(p for p in (self._edge(begin), self.format(content), self._edge(end)) if p))

    def _tags_with_separator(self, fmt: dict) -> str:
        one = self.rule(" | ".join(self._tag(t) for t in fmt["tags"]))
        separator = self.literal(fmt["separator"]) if fmt.get("separator") else ""
        many = one if fmt.get("stop_after_first") else self.rule(f"{one} ({separator} {one})*")
        return many if fmt.get("at_least_one") else self.rule(f"({many})?")

    def _triggered(self, fmt: dict, triggers: list, begins_with: Callable[[dict, object], bool], free: str,
                   end_text: str) -> str:
        """Free text; at a trigger one of the tags that begin with it; free text again after
        each tag unless stop_after_first (then the output ends with the tag)."""
        calls = []
        for trigger in triggers:
            rests = [self._tag(t, trigger) for t in fmt["tags"] if begins_with(t, trigger)]
            if not rests:
                raise GrammarCompileError(f"structural_tag: no tag begins with the trigger {trigger!r}")
            if isinstance(trigger, str) and self._special_id(trigger) is None and not fmt.get("excludes"):
                head = self.rule(f"/(?s:.*){_escape(trigger)}/", "[lazy]")  # up to the first trigger
            else:
                head = self.rule(f"{free} {self.literal(trigger) if isinstance(trigger, str) else self.token(trigger)}")
            calls.append(self.rule(f"{head} ({' | '.join(rests)})"))
        call = self.rule(" | ".join(calls))
        at_least_one = fmt.get("at_least_one", False)
        if fmt.get("stop_after_first", False):
            return self.rule(call if at_least_one else f"{call} | {end_text}")
        return self.rule(f"{call}{'+' if at_least_one else '*'} {end_text}")

    def _triggered_tags(self, fmt: dict) -> str:
        banned = [*fmt.get("excludes", ()), *(t for t in fmt["triggers"] if self._special_id(t) is None)]
        free = self._text_rule(banned)
        return self._triggered(fmt, fmt["triggers"],
                               lambda tag, trigger: isinstance(tag["begin"], str) and tag["begin"].startswith(trigger),
                               free, free)

    def _token_triggered_tags(self, fmt: dict) -> str:
        triggers = [self.token(t) for t in fmt["trigger_tokens"]]
        excluded = self.token_ids([*fmt.get("exclude_tokens", ()), *fmt["trigger_tokens"]])
        free = self.rule(f"<[^{','.join(map(str, excluded))}]>*")
        token_ids = [int(t[2:-2]) for t in triggers]
        return self._triggered(fmt, token_ids,
                               lambda tag, trigger: isinstance(tag["begin"], dict)
                               and self.token(tag["begin"]["token"]) == f"<[{trigger}]>", free, free)


def structural_tag_grammar(text: str, special_id: Callable[[str], int | None],
                           token_id: Callable[[str], int | None]) -> str:
    """The llguidance top-level grammar (JSON) of a structural tag; raises GrammarCompileError."""
    try:
        tag = json.loads(text)
    except ValueError as error:
        raise GrammarCompileError(f"structural_tag: not valid JSON: {error}") from None
    if not isinstance(tag, dict) or "format" not in tag:
        raise GrammarCompileError("structural_tag: llguidance takes the {\"type\": \"structural_tag\", \"format\": ...} "
                                  "form only (not the legacy structures/triggers); use xgrammar")
    builder = LarkBuilder(special_id, token_id)
    try:
        start = builder.format(tag["format"])
    except (KeyError, TypeError) as error:
        raise GrammarCompileError(f"structural_tag: malformed format ({error!r})") from None
    lark = "\n".join([f"start: {start}", *builder.rules]) + "\n"
    return json.dumps({"grammars": [{"lark_grammar": lark}, *builder.grammars]})
