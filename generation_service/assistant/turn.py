"""AssistantTurn: one request's reasoning span and tools, as both API fronts plan them.

`plan_turn` takes the front-neutral options (tools, tool choice, reasoning) and the served
tokenizer; the turn then gives the grammar (`grammar`), whether special tokens must stay in
the text (`skip_special_tokens`), the parser of the output (`parser`, which ends the span at
the end marker's token where the grammar does) and the validation of each call (`validate`).
A request without reasoning and tools has no turn (`plan_turn` returns None) and nothing on
its path changes.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Mapping

from generation_service.assistant.formats import FORMATS, ToolCallFormat, detect_format
from generation_service.assistant.parser import CallExtractor, EndToken, TriggerToken, TurnParser
from generation_service.assistant.reasoning import ReasoningRequest, model_markers, reasoning_span
from generation_service.assistant.tools import Tool, ToolCall, ToolChoice, check_tools, validate_call
from grammar_contract.spec import GrammarSpec, ReasoningSpan
from structgen.schema_validation import ValidationResult

# Tool-call arguments' whitespace runs by default: a newline and seven spaces of indentation
# (pretty-printed arguments pass; a model stuck on blanks stops). llguidance takes no cap.
ARGUMENTS_MAX_WHITESPACE = 8
# Free text after the span: what a reasoning budget without a constraint is enforced over.
_ANY_TEXT = json.dumps({"type": "structural_tag", "format": {"type": "any_text"}})
_PROMPT_TAIL_TOKENS = 8


@dataclass(frozen=True)
class AssistantTurn:
    tools: tuple[Tool, ...] = ()
    choice: ToolChoice = ToolChoice("none")
    single_call: bool = False
    tool_format: ToolCallFormat | None = None   # with tools
    reasoning: ReasoningSpan | None = None
    skip_special_tokens: bool = True            # False: a marker is a special token
    end_token_id: int | None = None             # the span's end marker when it is one added token
    trigger_token_id: int | None = None         # tool_choice auto's trigger when it is one added token

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def tools_by_name(self) -> Mapping[str, Tool]:
        return {tool.name: tool for tool in self.tools}

    def grammar(self, constraint: GrammarSpec | None, *, max_whitespace: int | None = None,
                any_whitespace: bool = False, backend: str = "auto") -> GrammarSpec | None:
        """The request's grammar: the tool calls' structural tag (instead of a constraint) or the
        constraint, after the reasoning span. A span without a constraint or budget needs no
        grammar (the stream is split all the same). The calls' arguments take whitespace runs of
        at most `max_whitespace` characters (ARGUMENTS_MAX_WHITESPACE when unset, uncapped with
        `any_whitespace` or on llguidance)."""
        spec = constraint
        if max_whitespace is None and not any_whitespace and backend != "llguidance":
            max_whitespace = ARGUMENTS_MAX_WHITESPACE
        if self.uses_tools:
            if constraint is not None:
                raise ValueError("a constraint together with tools is not supported: use tool_choice none for a "
                                 "constrained answer, or drop the constraint")
            tag = self.tool_format.grammar(self.tools, self.choice, self.single_call, max_whitespace)
            spec = GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": tag}),
                               max_whitespace=max_whitespace, backend=backend)
        if self.reasoning is None:
            return spec
        if spec is None:
            if self.reasoning.max_tokens is None:
                return None
            spec = GrammarSpec("structural_tag", _ANY_TEXT, backend=backend)
        return dataclasses.replace(spec, reasoning=self.reasoning)

    def parser(self, tokenizer=None, prompt_ids: tuple[int, ...] = ()) -> TurnParser:
        """The parser of one output of `prompt_ids`; `tokenizer` (the engine's) places the end
        marker's token and the trigger's tokens in the text, where they are one token."""
        end_token = trigger_token = None
        if self.end_token_id is not None and tokenizer is not None:
            end_token = EndToken(self.end_token_id, tokenizer, prompt_ids, self.skip_special_tokens)
        if self.trigger_token_id is not None and tokenizer is not None:
            trigger_token = TriggerToken(self.trigger_token_id, self.tool_format.trigger, tokenizer, prompt_ids,
                                         self.skip_special_tokens)
        calls = CallExtractor(self.tool_format, self.choice.forces_calls, trigger_token) if self.uses_tools else None
        return TurnParser(self.reasoning, calls, end_token)

    def validate(self, call: ToolCall) -> ValidationResult:
        return validate_call(call, self.tools_by_name)


def tool_format(tokenizer) -> ToolCallFormat:
    """The served model's tool-call format (from its chat template)."""
    is_token = lambda text: _added_token_id(tokenizer, text) is not None  # noqa: E731
    return FORMATS[detect_format(tokenizer.chat_template)](is_token)


def _is_special(tokenizer, text: str) -> bool:
    return tokenizer.token_id(text) in tokenizer.special_token_ids


def _added_token_id(tokenizer, text: str) -> int | None:
    """The id of the added token spelled `text`: both grammar backends take such a marker as
    that token alone (llguidance lexes added tokens apart from text), not as its text."""
    token_id = tokenizer.token_id(text)
    return token_id if token_id is not None and token_id in tokenizer.added_token_ids else None


def _end_token_id(tokenizer, span: ReasoningSpan | None) -> int | None:
    """The end marker's token when it is one added token: the span ends at that token."""
    return _added_token_id(tokenizer, span.end) if span is not None else None


def _trigger_token_id(tokenizer, format_: ToolCallFormat | None, choice: ToolChoice) -> int | None:
    """tool_choice auto's trigger when it is one added token: free text may spell its text in
    ordinary tokens, and only the token starts a call (formats.py, token_triggered_tags)."""
    if format_ is None or choice.mode != "auto":
        return None
    return _added_token_id(tokenizer, format_.trigger)


def plan_turn(tokenizer, prompt_ids: tuple[int, ...], *, tools: tuple[Tool, ...] = (),
              choice: ToolChoice | None = None, single_call: bool = False,
              reasoning: ReasoningRequest | None = None) -> AssistantTurn | None:
    """The turn of a request, None when it uses neither tools nor a reasoning span.
    Raises ValueError for options that do not fit together or this model."""
    choice = choice or ToolChoice("auto" if tools else "none")
    check_tools(tools, choice)
    span = None
    if reasoning is not None and reasoning.mode == "enabled":
        if tokenizer is None:
            raise ValueError("reasoning needs the model's tokenizer; this model has none")
        tail = tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        span = reasoning_span(reasoning, model_markers(tokenizer), tail)
    if span is None and not (tools and choice.mode != "none"):
        return None
    if tokenizer is None:
        raise ValueError("tools need the model's tokenizer and chat template; this model has none")
    format_ = tool_format(tokenizer) if tools else None
    markers = [format_.trigger] if format_ is not None and choice.mode != "none" else []
    markers += [span.begin, span.end] if span is not None else []
    return AssistantTurn(tools=tools, choice=choice, single_call=single_call, tool_format=format_,
                         reasoning=span, skip_special_tokens=not any(_is_special(tokenizer, m) for m in markers if m),
                         end_token_id=_end_token_id(tokenizer, span),
                         trigger_token_id=_trigger_token_id(tokenizer, format_, choice))
