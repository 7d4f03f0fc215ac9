"""A name pattern that excludes listed words by look-ahead, written without the look-ahead.

Schemas give "every other property" a schema with `patternProperties` such as
`^(?!interactive|name|style).+$` (vega) or `^(?!python$)[a-zA-Z-_.0-9]+$` (pyproject): a
negative look-ahead over literal words, then one repeated character class. llguidance's regex
engine refuses look-around, and dropping the assertion would make the pattern match the declared
properties it excluded (look_around.py keeps those). The language is regular, though: the
strings over the class's characters that start with none of the words (or, for a word written
with `$`, are not that word). `without_exclusion` spells it with alternations over the words'
prefix tree: after each prefix, either the end, a character that leaves the tree (then any
characters), or the next character of a word not yet excluded. The result is checked against
Python's `re` on the words, their prefixes and extensions; anything it cannot spell or check
stays as it was.
"""
from __future__ import annotations

import re

# ^(?!word|word$|...)R$ with R one repeated class: .*  .+  [..]*  [..]+  ([..]+)
_FORM = re.compile(r"^\^\(\?!(?P<words>[^()\[\]]+)\)(?P<open>\(?)(?P<cls>\.|\[[^\]]+\])(?P<rep>[*+])(?P<close>\)?)\$$")
_WORD = re.compile(r"^(?:[A-Za-z0-9_\-]|\\.)+\$?$")
_ASCII = [chr(c) for c in range(32, 127)]
_PROBES = ("é", "中", "\n")
_META = set(".^$*+?()[]{}|\\/")


def without_exclusion(pattern: str) -> str | None:
    """`pattern` without its look-ahead, the same language (module doc); None when not of the form."""
    found = _FORM.match(pattern)
    if found is None or bool(found["open"]) != bool(found["close"]):
        return None
    words = found["words"].split("|")
    if not all(_WORD.match(w) for w in words):
        return None
    excluded = [(re.sub(r"\\(.)", r"\1", w.rstrip("$")), w.endswith("$")) for w in words]
    alphabet = _alphabet(found["cls"])
    if alphabet is None or any(not set(word) <= alphabet[0] for word, _ in excluded if alphabet[1] is None):
        return None
    min_len = 1 if found["rep"] == "+" else 0
    spelled = "^(?:" + _spell("", excluded, alphabet, min_len) + ")$"
    return spelled if _agrees(pattern, spelled, excluded) else None


def _alphabet(cls: str) -> tuple[set[str], str | None] | None:
    """(the class's printable ASCII characters, None) for a class of only such characters, or
    (set(), "\\n") for `.` (every character but a line break)."""
    if cls == ".":
        return set(), "\n"
    try:
        compiled = re.compile(cls)
    except re.error:
        return None
    if any(compiled.fullmatch(c) for c in _PROBES):
        return None  # it holds more than we can list
    return {c for c in _ASCII if compiled.fullmatch(c)}, None


def _spell(prefix: str, excluded: list[tuple[str, bool]], alphabet, min_len: int) -> str:
    below = [(w, exact) for w, exact in excluded if w.startswith(prefix) and len(w) > len(prefix)]
    nexts = sorted({w[len(prefix)] for w, _ in below})
    options = []
    if len(prefix) >= min_len and (prefix, True) not in excluded:
        options.append("")
    for char in nexts:
        if (prefix + char, False) not in excluded:  # a word without "$" excludes all below it
            options.append(_literal(char) + "(?:" + _spell(prefix + char, excluded, alphabet, min_len) + ")")
    others = _other(alphabet, nexts)
    if others:
        options.append(others + _any(alphabet))
    return "|".join(options) if options else "(?!)"


def _other(alphabet, taken: list[str]) -> str:
    chars, negated = alphabet
    if negated is not None:
        return "[^" + "".join(map(_in_class, [*taken, negated])) + "]"
    rest = sorted(chars - set(taken))
    return "[" + "".join(map(_in_class, rest)) + "]" if rest else ""


def _any(alphabet) -> str:
    chars, negated = alphabet
    return ("[^" + _in_class(negated) + "]*") if negated is not None else \
        ("[" + "".join(map(_in_class, sorted(chars))) + "]*")


def _literal(char: str) -> str:
    return "\\" + char if char in _META else char


def _in_class(char: str) -> str:
    return "\\n" if char == "\n" else "\\" + char if char in "\\]^-[" else char


def _agrees(original: str, spelled: str, excluded: list[tuple[str, bool]]) -> bool:
    try:
        a, b = re.compile(original), re.compile(spelled)
    except re.error:
        return False
    probes = {""}
    for word, _ in excluded:
        probes |= {word[:k] for k in range(len(word) + 1)} | {word + "x", word + "-1", "x" + word, word.upper()}
    return all(bool(a.search(p)) == bool(b.search(p)) for p in probes)
