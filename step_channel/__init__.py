"""The step channel shared by generation_service and grammar_service (docs/step_channel.md)."""
from step_channel.layout import (
    ERR_INTERNAL, ERR_MASK, ERR_NO_MATCHER, ERR_NONE, ERR_TOKEN_REJECTED, ERR_UNKNOWN_GRAMMAR,
    FLAG_CONSTRAINED, FLAG_FORCED_DRAFTS, FLAG_FRESH, FLAG_RELEASE, MASK_OK, MASK_RELEASED_BY_WATCHDOG,
    NOTE_BUDGET_CLOSED, VALID_LATE, Geometry, seq_reached,
)
from step_channel.region import ChannelError, StepChannel, StepEntry

__all__ = [
    "ChannelError", "Geometry", "StepChannel", "StepEntry", "seq_reached",
    "FLAG_FRESH", "FLAG_RELEASE", "FLAG_CONSTRAINED", "FLAG_FORCED_DRAFTS",
    "MASK_OK", "MASK_RELEASED_BY_WATCHDOG", "VALID_LATE",
    "ERR_NONE", "ERR_TOKEN_REJECTED", "ERR_UNKNOWN_GRAMMAR", "ERR_NO_MATCHER", "ERR_INTERNAL",
    "ERR_MASK", "NOTE_BUDGET_CLOSED",
]
