"""Tool-call formats of the supported families' chat templates: the grammar of a call and
the parser of a call region, one class per format.

- `hermes`: Qwen2/2.5/3 and other ChatML templates,
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, calls one per tag;
- `llama3_json`: Llama 3.1/3.2/3.3 JSON tool calling, `{"name": "f", "parameters": {...}}`,
  several calls separated by "; ";
- `mistral`: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`, where [TOOL_CALLS] is a
  control token of the tokenizer.

Grammars are xgrammar structural tags (JSON objects): each tool is a tag whose begin text
fixes its name and whose content is its `parameters` schema, so a call names a listed tool
with arguments valid for it. tool_choice auto: free text until the format's trigger, then a
call (triggered tags; token-triggered when the trigger is one added token, as Qwen's
`<tool_call>`: free text may then spell it in ordinary tokens, and the parser, too, starts a
call at the token only); required and named: calls only, at least one, the turn's end allowed
after each (and, Hermes, after the newline that follows one). Because the grammar fixes
the syntax, a region's parser needs no heuristics: what the grammar let through parses.
"""
from __future__ import annotations

import abc
import json
import re
from typing import Callable

from generation_service.assistant.tools import Tool, ToolChoice

ParsedCall = tuple[str, str]  # (name, arguments JSON text)
# strict=False: control characters in strings, as a grammar backend may let a byte-level
# tokenizer spell them; arguments are re-serialised (escaped) once parsed
_DECODER = json.JSONDecoder(strict=False)


def _arguments_content(tool: Tool, max_whitespace: int | None) -> dict:
    content = {"type": "json_schema", "json_schema": tool.schema}
    if max_whitespace is not None:
        content["max_whitespace_cnt"] = max_whitespace
    return content


def _call(value, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    """{"name": ..., "<arguments key>": {...}} as (name, arguments JSON), else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in arguments_keys if k in value), None)
    if key is None:
        return None
    return value["name"], json.dumps(value[key], ensure_ascii=False)


def _decode(text: str):
    """(value, end) of the JSON value at the start of `text` (after whitespace); None while
    it is incomplete (or not JSON: a region that never completes stays text at the end)."""
    start = len(text) - len(text.lstrip())
    try:
        value, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return None
    return value, end


class ToolCallFormat(abc.ABC):
    name: str = ""
    trigger: str = ""    # the text that starts a call region
    separator: str = ""  # between calls when the output is calls only
    # one call's text: {call_prefix}{"name": "NAME", "{arguments_key}": ARGUMENTS{call_end}
    call_prefix: str = ""
    arguments_key: str = "arguments"
    call_end: str = "}"

    def __init__(self, is_token: Callable[[str], bool] = lambda text: False) -> None:
        """`is_token(text)`: the text is one added token of the served tokenizer."""
        self._is_token = is_token

    def _call_tag(self, tool: Tool, max_whitespace: int | None) -> dict:
        return {"type": "tag", "begin": f'{self.call_prefix}{{"name": "{tool.name}", "{self.arguments_key}": ',
                "content": _arguments_content(tool, max_whitespace), "end": self.call_end}

    def grammar(self, tools: tuple[Tool, ...], choice: ToolChoice, single: bool,
                max_whitespace: int | None) -> dict:
        """The structural tag that enforces calls to `tools` under `choice` (not "none")."""
        if choice.mode == "auto":
            tags = [self._call_tag(t, max_whitespace) for t in tools]
            return {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags,
                    "at_least_one": False, "stop_after_first": single}
        chosen = [t for t in tools if choice.mode != "named" or t.name == choice.name]
        return {"type": "tags_with_separator", "tags": [self._call_tag(t, max_whitespace) for t in chosen],
                "separator": self.separator, "at_least_one": True,
                "stop_after_first": single or choice.mode == "named"}

    @abc.abstractmethod
    def parse_region(self, text: str) -> tuple[int, list[ParsedCall] | None] | None:
        """`text` starts with the trigger. None while the region is incomplete; else (its
        length, its calls), calls None when it holds no calls after all (it stays text)."""


class HermesFormat(ToolCallFormat):
    name = "hermes"
    trigger = "<tool_call>"
    separator = "\n"
    _END = "</tool_call>"
    # a JSON string (an unterminated one runs to the text's end), or the end tag
    _STRING_OR_END = re.compile(r'"(?:\\.|[^"\\])*(?:"|\\?\Z)|' + re.escape(_END), re.DOTALL)
    call_prefix = trigger + "\n"
    call_end = "}\n" + _END

    def grammar(self, tools, choice, single, max_whitespace) -> dict:
        if choice.mode != "auto":
            # a newline after a call need not start another: ChatML models end a turn with one too
            calls = super().grammar(tools, choice, single, max_whitespace)
            return {"type": "sequence", "elements": [calls, {"type": "optional", "content": {
                "type": "const_string", "value": self.separator}}]}
        if not self._is_token(self.trigger):
            return super().grammar(tools, choice, single, max_whitespace)
        return {"type": "token_triggered_tags", "trigger_tokens": [self.trigger],
                "tags": [self._token_call_tag(t, max_whitespace) for t in tools],
                "at_least_one": False, "stop_after_first": single}

    def _token_call_tag(self, tool: Tool, max_whitespace: int | None) -> dict:
        """The call tag begun by the trigger's token, the same text after it."""
        head = f'{self.call_prefix.removeprefix(self.trigger)}{{"name": "{tool.name}", "{self.arguments_key}": '
        content = [{"type": "const_string", "value": head}, _arguments_content(tool, max_whitespace),
                   {"type": "const_string", "value": self.call_end.removesuffix(self._END)}]
        return {"type": "tag", "begin": {"type": "token", "token": self.trigger},
                "content": {"type": "sequence", "elements": content}, "end": self._END}

    def parse_region(self, text: str):
        """The call ends at the first end tag after its JSON: a string argument may hold the
        tag's text (the grammar constrains the JSON, then the tag), so the tag counts only
        outside JSON strings; while a string is open (an incomplete call) the region is too."""
        end = next((m.start() for m in self._STRING_OR_END.finditer(text, len(self.trigger))
                    if m.group() == self._END), -1)
        if end < 0:
            return None
        decoded = _decode(text[len(self.trigger):end])
        call = _call(decoded[0], ("arguments",)) if decoded is not None else None
        return end + len(self._END), None if call is None else [call]


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    trigger = '{"name": '
    separator = "; "
    arguments_key = "parameters"

    def parse_region(self, text: str):
        decoded = _decode(text)
        if decoded is None:
            return None
        call = _call(decoded[0], ("parameters", "arguments"))
        return decoded[1], None if call is None else [call]


class MistralFormat(ToolCallFormat):
    """All calls in one JSON array after the [TOOL_CALLS] token (matched as that token when
    the tokenizer has it, so the text keeps it: GenerationRequest.skip_special_tokens)."""

    name = "mistral"
    trigger = "[TOOL_CALLS]"
    separator = ", "

    def grammar(self, tools, choice, single, max_whitespace) -> dict:
        chosen = [t for t in tools if choice.mode != "named" or t.name == choice.name]
        calls = {"type": "tags_with_separator", "tags": [self._call_tag(t, max_whitespace) for t in chosen],
                 "separator": self.separator, "at_least_one": True,
                 "stop_after_first": single or choice.mode == "named"}
        as_token = self._is_token(self.trigger)
        block = {"type": "tag", "begin": {"type": "token", "token": self.trigger} if as_token else self.trigger,
                 "content": {"type": "sequence", "elements": [{"type": "const_string", "value": "["}, calls]},
                 "end": "]"}
        if choice.mode != "auto":
            return block
        if as_token:
            return {"type": "token_triggered_tags", "trigger_tokens": [self.trigger], "tags": [block],
                    "at_least_one": False, "stop_after_first": True}
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": [block],
                "at_least_one": False, "stop_after_first": True}

    def parse_region(self, text: str):
        decoded = _decode(text[len(self.trigger):])
        if decoded is None:
            return None
        value, end = decoded
        calls = [_call(item, ("arguments", "parameters")) for item in value] if isinstance(value, list) else [None]
        return len(self.trigger) + end, None if not calls or None in calls else calls


FORMATS: dict[str, type[ToolCallFormat]] = {f.name: f for f in (HermesFormat, Llama3JsonFormat, MistralFormat)}


def detect_format(chat_template: str | None) -> str:
    """The format a chat template prompts for; Hermes (the ChatML convention) when it names none."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MistralFormat.name
    if "<tool_call>" in template:
        return HermesFormat.name
    if "<|start_header_id|>" in template and ('"parameters"' in template or "<|python_tag|>" in template):
        return Llama3JsonFormat.name
    return HermesFormat.name
