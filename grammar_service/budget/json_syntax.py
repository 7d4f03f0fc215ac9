"""How many characters JSON text needs at least to close, from its syntax alone.

The closing walk (closing.py) ranks its steps by this: a lower bound on the characters
that finish a JSON document from a prefix (close the open string or literal, give the
expected value, close every open container). A schema can only ask for more (required
properties, minLength, ...), never less, so the bound steers the search to the short ways
out without ruling any out. `JsonState` is immutable and advanced one character at a time;
text that is not JSON gives `None` (the walk then goes by the grammar alone).
"""
from __future__ import annotations

from dataclasses import dataclass

_WHITESPACE = " \t\n\r"
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_DIGITS = "0123456789"

# Modes: what the text expects next.
VALUE = "value"            # a value (after ":", "[", "," in an array, or at the start)
FIRST_VALUE = "first"      # a value or "]" (right after "[")
STRING = "string"          # inside a string value
KEY = "key"                # inside a key
ESCAPE = "escape"          # after a backslash in a string value
KEY_ESCAPE = "key_escape"  # after a backslash in a key
COLON = "colon"            # a key ended: ":" next
FIRST_KEY = "first_key"    # a key or "}" (right after "{")
NEXT_KEY = "next_key"      # a key (after "," in an object)
AFTER = "after"            # a value ended: ",", a closing bracket, or the end
NUMBER = "number"          # inside a number that may end here
NUMBER_NEEDS_DIGIT = "number_digit"  # after "-", "." or "e": a digit next
EXPONENT_SIGN = "exponent"  # after "e": a sign or a digit

# Characters each mode needs at least to finish its value (and the key's ":" and value).
_MODE_COST = {VALUE: 1, FIRST_VALUE: 1, STRING: 1, ESCAPE: 2, KEY: 3, KEY_ESCAPE: 4, COLON: 2,
              FIRST_KEY: 0, NEXT_KEY: 4, AFTER: 0, NUMBER: 0, NUMBER_NEEDS_DIGIT: 1, EXPONENT_SIGN: 1}


@dataclass(frozen=True, slots=True)
class JsonState:
    stack: str = ""        # open containers, innermost last: "{" or "["
    mode: str = VALUE
    literal: str = ""      # the rest of a literal being written (true/false/null)

    @property
    def min_chars_to_close(self) -> int:
        """A lower bound on the characters that finish the document from here."""
        return len(self.literal) + _MODE_COST[self.mode] + len(self.stack)

    def push(self, text: str) -> "JsonState | None":
        state: JsonState | None = self
        for char in text:
            state = state._push_char(char)
            if state is None:
                return None
        return state

    def _push_char(self, c: str) -> "JsonState | None":
        mode, stack = self.mode, self.stack
        if self.literal:
            return JsonState(stack, AFTER if len(self.literal) == 1 else mode, self.literal[1:]) \
                if c == self.literal[0] else None
        if mode == STRING or mode == KEY:
            if c == '"':
                return JsonState(stack, AFTER if mode == STRING else COLON)
            if c == "\\":
                return JsonState(stack, ESCAPE if mode == STRING else KEY_ESCAPE)
            return self
        if mode == ESCAPE or mode == KEY_ESCAPE:  # (\uXXXX's digits read as string characters)
            return JsonState(stack, STRING if mode == ESCAPE else KEY)
        if c in _WHITESPACE:
            return self if mode not in (NUMBER, NUMBER_NEEDS_DIGIT, EXPONENT_SIGN) else \
                (JsonState(stack, AFTER) if mode == NUMBER else None)
        if mode in (VALUE, FIRST_VALUE):
            if c == "]" and mode == FIRST_VALUE:
                return self._close("[")
            return self._value(c)
        if mode in (NUMBER, NUMBER_NEEDS_DIGIT, EXPONENT_SIGN):
            return self._number(c)
        if mode == COLON:
            return JsonState(stack, VALUE) if c == ":" else None
        if mode in (FIRST_KEY, NEXT_KEY):
            if c == '"':
                return JsonState(stack, KEY)
            return self._close("{") if c == "}" and mode == FIRST_KEY else None
        if mode == AFTER:
            if c == ",":
                if not stack:
                    return None
                return JsonState(stack, NEXT_KEY if stack[-1] == "{" else VALUE)
            if c in "}]":
                return self._close("{" if c == "}" else "[")
        return None

    def _value(self, c: str) -> "JsonState | None":
        stack = self.stack
        if c == '"':
            return JsonState(stack, STRING)
        if c == "{":
            return JsonState(stack + "{", FIRST_KEY)
        if c == "[":
            return JsonState(stack + "[", FIRST_VALUE)
        if c in _LITERALS:
            return JsonState(stack, VALUE, _LITERALS[c])
        if c == "-":
            return JsonState(stack, NUMBER_NEEDS_DIGIT)
        if c in _DIGITS:
            return JsonState(stack, NUMBER)
        return None

    def _number(self, c: str) -> "JsonState | None":
        stack, mode = self.stack, self.mode
        if c in _DIGITS:
            return JsonState(stack, NUMBER)
        if mode == EXPONENT_SIGN and c in "+-":
            return JsonState(stack, NUMBER_NEEDS_DIGIT)
        if mode != NUMBER:
            return None
        if c == ".":
            return JsonState(stack, NUMBER_NEEDS_DIGIT)
        if c in "eE":
            return JsonState(stack, EXPONENT_SIGN)
        return JsonState(stack, AFTER)._push_char(c)

    def _close(self, opener: str) -> "JsonState | None":
        if not self.stack or self.stack[-1] != opener:
            return None
        return JsonState(self.stack[:-1], AFTER)
