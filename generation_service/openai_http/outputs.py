"""ChoiceOutput: what one choice has produced so far, fed event by event.

Each engine event becomes a `Piece` (the content text, reasoning text, completed tool calls and
logprobs it adds; with a turn the choice task split them, choices.py), which a stream sends
as one chunk; the whole response is the sum of the pieces.
The engine's finish reasons map onto OpenAI's: max tokens is "length", a tool call that
ended the output is "tool_calls", every other end is "stop" (the engine's own reason stays
in the `structgen` extension, with the text of a call max tokens cut short:
`incomplete_tool_call`; it is never content). Errors are raised as the engine's exceptions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf.json_format import MessageToDict

from generation_service import proto_convert
from generation_service.engine.errors import DeadlineExceededError, EngineError
from generation_service.engine.events import FinishReason, TokenLogprob, Usage
from generation_service.engine.params import GenerationRequest
from generation_service.openai_http.choices import ChoiceEvent
from generation_service.assistant.tools import ToolCall
from generation_service.assistant.turn import AssistantTurn
from grammar_contract.report import GuaranteeReport
from structgen.schema_validation import ValidationResult


@dataclass
class Piece:
    text: str = ""
    reasoning: str = ""              # reasoning text (a turn with a reasoning span)
    token_ids: tuple[int, ...] = ()  # only when the request asked for them (return_token_ids)
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: tuple[TokenLogprob, ...] = ()
    guarantee: GuaranteeReport | None = None
    is_final: bool = False

    @property
    def is_empty(self) -> bool:
        return not (self.text or self.reasoning or self.token_ids or self.tool_calls or self.logprobs
                    or self.guarantee or self.is_final)


class ChoiceOutput:
    def __init__(self, index: int, spec: GenerationRequest, turn: AssistantTurn | None = None,
                 return_token_ids: bool = False) -> None:
        self.index = index
        self.spec = spec
        self._turn = turn
        self._returns_token_ids = return_token_ids
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.reasonings: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self.incomplete_tool_call = ""  # a call max_tokens cut short
        self.logprobs: list[TokenLogprob] = []
        self.guarantee: GuaranteeReport | None = None
        self.validation: ValidationResult | None = None
        self.engine_reason: FinishReason | None = None
        self.usage: Usage | None = None

    def add(self, item: ChoiceEvent) -> Piece:
        """Take one event; raises the engine's error for a failed request."""
        event = item.event
        if event.error is not None:
            raise event.error
        if event.finish_reason is FinishReason.DEADLINE:
            raise DeadlineExceededError(f"request {self.spec.request_id}: deadline exceeded")
        if event.finish_reason is FinishReason.ERROR:
            raise EngineError(f"request {self.spec.request_id} failed")
        piece = Piece(text=event.text, logprobs=event.logprobs, guarantee=event.guarantee, is_final=event.is_final)
        if item.piece is not None:  # split by the turn's parser in the choice task (choices.py)
            piece.text, piece.reasoning, piece.tool_calls = item.piece.content, item.piece.reasoning, item.piece.calls
            self.incomplete_tool_call += item.piece.incomplete_call
        if self._returns_token_ids:
            piece.token_ids = event.token_ids
        self.token_ids += event.token_ids
        self.texts.append(piece.text)
        self.reasonings.append(piece.reasoning)
        self.tool_calls += piece.tool_calls
        self.logprobs += event.logprobs
        self.guarantee = self.guarantee or event.guarantee
        if event.is_final:
            self.engine_reason, self.usage, self.validation = event.finish_reason, event.usage, item.validation
        return piece

    @property
    def is_finished(self) -> bool:
        return self.engine_reason is not None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def reasoning(self) -> str | None:
        """The reasoning text; None when the turn has no reasoning span."""
        return "".join(self.reasonings) if self._turn is not None and self._turn.reasoning is not None else None

    @property
    def finish_reason(self) -> str | None:
        if self.engine_reason is None:
            return None
        if self.engine_reason is FinishReason.MAX_TOKENS:
            return "length"
        return "tool_calls" if self.tool_calls else "stop"

    def extension(self, piece: Piece | None = None) -> dict | None:
        """The `structgen` field of a choice: the guarantee report with the first piece that has
        it, validation and engine finish reason with the final one, each piece's token ids when
        asked for (all of them without `piece`)."""
        guarantee = self.guarantee if piece is None else piece.guarantee
        is_final = piece is None or piece.is_final
        token_ids = (self.token_ids if piece is None else piece.token_ids) if self._returns_token_ids else ()
        if guarantee is None and not token_ids and not (is_final and self.spec.is_constrained):
            return None
        extension = {}
        if token_ids:
            extension["token_ids"] = list(token_ids)
        if guarantee is not None:
            extension["guarantee"] = _message_dict(proto_convert.guarantee_to_proto(guarantee))
        if is_final and self.engine_reason is not None:
            extension["finish_reason"] = self.engine_reason.value
            if self.spec.grammar is not None and self.spec.grammar.kind == "json_schema":
                validation = _message_dict(proto_convert.validation_to_proto(self.validation))
                validation["status"] = validation["status"].removeprefix("VALIDATION_STATUS_").lower()
                extension["validation"] = validation
            if self.tool_calls:
                extension["tool_call_validations"] = [self._validate_call(call) for call in self.tool_calls]
            if self.incomplete_tool_call:
                extension["incomplete_tool_call"] = self.incomplete_tool_call
        return extension

    def _validate_call(self, call: ToolCall) -> dict:
        """The call's arguments against its tool's full `parameters` schema."""
        validation = _message_dict(proto_convert.validation_to_proto(self._turn.validate(call)))
        validation["status"] = validation["status"].removeprefix("VALIDATION_STATUS_").lower()
        return {"id": call.id, **validation}


def _message_dict(message) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
