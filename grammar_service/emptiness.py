"""Does a grammar accept any string? Productive-rule analysis of xgrammar's EBNF.

A rule is productive when some alternative of it is a sequence of terminals and productive
rules (the textbook fixed point). A grammar whose root, or a rule the root can reach, is not
productive either accepts nothing or lets generation walk into a rule that can never finish
(Lark `start: a` / `a: a`): the masks then allow no token and the request would fail in the
middle of decoding. Such grammars are refused at compile instead.

The EBNF is xgrammar's printed form (`str(Grammar)`): `name ::= body`, bodies of string
literals, character classes, rule names, `( | )`, `* + ?`, `{m, n}`, an optional trailing
lookahead `(= ...)`. Anything this reader does not know counts as productive, and text it
cannot read makes no claim, so a grammar is never refused for the reader's sake. JSON
Schemas are not read (see `_ebnf_of`).
"""
from __future__ import annotations

import re
from typing import Any

_TOKEN = re.compile(r'''
    (?P<ws>\s+)
  | (?P<lit>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<look>\(=)
  | (?P<call>[A-Za-z_][A-Za-z0-9_.\-]*\()
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
  | (?P<rep>\{\s*-?\d+\s*(?:,\s*-?\d+\s*)?\})
  | (?P<op>[()|*+?])
''', re.VERBOSE)

# An expression: ("alt", [seq...]) | ("seq", [(atom, min_count)...]) | ("term",) | ("ref", name)
Expr = tuple


class _Unreadable(Exception):
    pass


def _tokens(body: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(body):
        match = _TOKEN.match(body, pos)
        if match is None:
            raise _Unreadable(body[pos:pos + 20])
        if match.lastgroup == "call":  # Regex("...", json_string=true), TagDispatch(...)
            out.append(("term", match.group()))
            pos = _after_call(body, match.end())
            continue
        if match.lastgroup != "ws":
            out.append((match.lastgroup, match.group()))
        pos = match.end()
    return out


def _after_call(body: str, pos: int) -> int:
    """The index after the `)` closing a call whose `(` ends before `pos` (strings skipped)."""
    depth = 1
    while pos < len(body):
        char = body[pos]
        if char == '"':
            string = _TOKEN.match(body, pos)
            if string is None or string.lastgroup != "lit":
                raise _Unreadable("unterminated string")
            pos = string.end()
            continue
        depth += {"(": 1, ")": -1}.get(char, 0)
        pos += 1
        if depth == 0:
            return pos
    raise _Unreadable("unbalanced call")


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.pos = tokens, 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def alternatives(self) -> Expr:
        seqs = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.pos += 1
            seqs.append(self.sequence())
        return ("alt", seqs)

    def sequence(self) -> Expr:
        items = []
        while (tok := self.peek()) is not None and tok not in (("op", "|"), ("op", ")")):
            if tok[0] == "look":  # a lookahead consumes nothing: skip it
                self.skip_group()
                continue
            atom = self.atom()
            items.append((atom, self.min_count()))
        return ("seq", items)

    def atom(self) -> Expr:
        kind, text = self.tokens[self.pos]
        self.pos += 1
        if kind in ("lit", "cls", "term"):  # a call is not read: counted as productive
            return ("term",)
        if kind == "name":
            return ("ref", text)
        if (kind, text) == ("op", "("):
            inner = self.alternatives()
            if self.peek() != ("op", ")"):
                raise _Unreadable("unbalanced parenthesis")
            self.pos += 1
            return inner
        raise _Unreadable(text)

    def min_count(self) -> int:
        tok = self.peek()
        if tok is None:
            return 1
        if tok in (("op", "*"), ("op", "?")):
            self.pos += 1
            return 0
        if tok == ("op", "+"):
            self.pos += 1
            return 1
        if tok[0] == "rep":
            self.pos += 1
            return int(tok[1].strip("{}").split(",")[0])
        return 1

    def skip_group(self) -> None:
        depth = 0
        while (tok := self.peek()) is not None:
            self.pos += 1
            if tok[0] == "look" or tok == ("op", "("):
                depth += 1
            elif tok == ("op", ")"):
                depth -= 1
                if depth == 0:
                    return
        raise _Unreadable("unbalanced group")


def parse_ebnf(text: str) -> dict[str, Expr]:
    rules: dict[str, Expr] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, sep, body = line.partition(" ::= ")
        if not sep:
            raise _Unreadable(line[:40])
        parser = _Parser(_tokens(body))
        # a rule's attributes follow its name: `any_tokens[max_tokens=3] ::= ...` (a token budget)
        rules[name.strip().partition("[")[0]] = parser.alternatives()
        if parser.peek() is not None:
            raise _Unreadable(body[:40])
    return rules


def _is_productive(expr: Expr, productive: set[str]) -> bool:
    kind = expr[0]
    if kind == "term":
        return True
    if kind == "ref":
        return expr[1] in productive
    if kind == "alt":
        return any(_is_productive(seq, productive) for seq in expr[1])
    return all(count == 0 or _is_productive(atom, productive) for atom, count in expr[1])


def _refs(expr: Expr, out: set[str]) -> set[str]:
    kind = expr[0]
    if kind == "ref":
        out.add(expr[1])
    elif kind == "alt":
        for seq in expr[1]:
            _refs(seq, out)
    elif kind == "seq":
        for atom, _ in expr[1]:
            _refs(atom, out)
    return out


def unproductive_rules(text: str, root: str = "root") -> list[str] | None:
    """Rules reachable from `root` that can never finish, root first; None if unreadable."""
    try:
        rules = parse_ebnf(text)
    except (_Unreadable, ValueError, RecursionError):
        return None
    if root not in rules:
        return None
    refs = {name: _refs(expr, set()) for name, expr in rules.items()}
    users: dict[str, list[str]] = {}
    for name, used in refs.items():
        for ref in used:
            users.setdefault(ref, []).append(name)
    # worklist: a rule is checked again only when one of the rules it names became productive
    productive: set[str] = set()
    todo = list(rules)
    while todo:
        name = todo.pop()
        if name not in productive and _is_productive(rules[name], productive):
            productive.add(name)
            todo.extend(u for u in users.get(name, ()) if u not in productive)
    reachable, todo = {root}, [root]
    while todo:
        for ref in refs[todo.pop()]:
            if ref in rules and ref not in reachable:
                reachable.add(ref)
                todo.append(ref)
    dead = [name for name in rules if name in reachable and name not in productive]
    return sorted(dead, key=lambda n: (n != root, n))


def empty_language_reason(spec: Any, backend: str, compiled: Any) -> str:
    """Why the compiled grammar can never finish a string ("" when it can, or when unknown)."""
    text = _ebnf_of(spec, backend, compiled)
    dead = unproductive_rules(text) if text else None
    if not dead:
        return ""
    listed = ", ".join(dead[:5]) + (" ..." if len(dead) > 5 else "")
    if dead[0] == "root":
        return f"the grammar accepts no string: its start rule can never finish (rules that never reach a terminal: {listed})"
    return f"the grammar can walk into rules that never finish (they never reach a terminal): {listed}"


def _ebnf_of(spec: Any, backend: str, compiled: Any) -> str:
    if spec.kind in ("json_schema", "json_object"):
        # xgrammar's schema converter writes a terminal for every rule it makes; reading the EBNF
        # of a large schema costs seconds of Python (azure-pipelines' 12,836 rules)
        return ""
    if backend == "xgrammar":
        return str(compiled.grammar)
    if spec.kind == "lark":  # llguidance keeps no EBNF; xgrammar's reading of the same Lark
        import xgrammar as xgr
        try:
            return str(xgr.Grammar.from_lark(spec.text))
        except Exception:  # noqa: BLE001 -- llguidance accepted what xgrammar cannot read
            return ""
    return ""
