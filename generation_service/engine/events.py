"""What the engine streams back for a request."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from grammar_contract.report import GuaranteeReport


class FinishReason(enum.Enum):
    STOP_TOKEN = "stop_token"       # EOS or a stop token id
    STOP_STRING = "stop_string"
    MAX_TOKENS = "max_tokens"
    GRAMMAR_COMPLETE = "grammar_complete"  # the grammar accepts nothing more
    BUDGET_CLOSED = "budget_closed"        # the grammar completed, steered to close within max_tokens
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"                 # see OutputEvent.error


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    cached_prompt_tokens: int = 0   # prompt tokens whose K/V came from the prefix cache, not a prefill
    forced_tokens: int = 0          # drafts from the grammar's forced runs that were accepted
    grammar_rejected_draft_tokens: int = 0  # drafts past the first one the grammar refused


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) of the top-n alternatives


@dataclass(frozen=True)
class OutputEvent:
    """One streamed message. The last event of a request has `finish_reason` (and `usage`)."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    guarantee: GuaranteeReport | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: "EngineError | None" = None

    @classmethod
    def of_tokens(cls, token_ids: tuple[int, ...], text: str, logprobs: tuple[TokenLogprob, ...]) -> "OutputEvent":
        """``OutputEvent(token_ids, text, logprobs)``, built without the frozen __init__, which
        sets each of the seven fields through object.__setattr__: the engine builds one per
        row per step, inside the ~9 us a row's postprocess costs on 2 CPUs. The fields not
        given read their defaults from the class, as dataclass fields with a default do."""
        event = object.__new__(cls)
        fields = event.__dict__  # (item stores: no keyword dict built, no update call)
        fields["token_ids"], fields["text"], fields["logprobs"] = token_ids, text, logprobs
        return event

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


from generation_service.engine.errors import EngineError  # noqa: E402  (type used above)
