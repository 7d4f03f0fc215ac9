"""A slow grammar slows only its own request (issue 19 point 6), through the session server.

The session server's grammar_service makes every mask fill of a grammar containing
SLOW_FILL_MARKER take SLOW_FILL_MS longer (GrammarServiceConfig.slow_fill_ms, live_server.py),
many CPU decode steps. Were every step to wait for its slowest row, the two requests below
would move in lockstep, one token each per step; isolated, the ordinary one runs at its own pace
while the slow one is late, and the slow one's output is what it is alone.
"""
from __future__ import annotations

import json
import threading

import jsonschema

from live_server import SLOW_FILL_MARKER

PROMPT = "One JSON object:"
SLOW = {"type": "object", "description": SLOW_FILL_MARKER,
        "properties": {"word": {"type": "string", "minLength": 5, "maxLength": 5}},
        "required": ["word"], "additionalProperties": False}
ORDINARY = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 8, "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
GREEDY = {"compact": True, "temperature": 0.0, "max_tokens": 48}


def _check(completion, schema: dict) -> None:
    """A whole completion: finished by its grammar, valid against `schema`."""
    assert completion.finish_reason == "grammar_complete", completion.text
    jsonschema.validate(json.loads(completion.text), schema)
    assert completion.validation.valid


def test_a_slow_grammar_does_not_hold_another_requests_tokens(client, wait_idle):
    # the marker sits in a description, which no grammar enforces: alone and unmarked, the same
    # grammar gives the output the slow request must give
    alone = client.generate_text(PROMPT, json_schema=dict(SLOW, description="plain"), **GREEDY)
    _check(alone, SLOW)

    events, first_token = [], threading.Event()  # (who, chunk), in arrival order

    def stream_slow() -> None:
        for chunk in client.generate(PROMPT, json_schema=SLOW, **GREEDY):
            events.append(("slow", chunk))
            if chunk.token_ids:
                first_token.set()
        first_token.set()

    slow = threading.Thread(target=stream_slow)
    slow.start()
    assert first_token.wait(120)  # its first fill (timed alone) is behind it: it is known slow
    for chunk in client.generate(PROMPT, json_schema=ORDINARY, **GREEDY):
        events.append(("ordinary", chunk))
    slow.join(120)

    def text_of(who: str) -> str:
        return "".join(chunk.text for w, chunk in events if w == who)
    slow_final = next(chunk for w, chunk in events if w == "slow" and chunk.finish_reason)
    assert slow_final.finish_reason == "grammar_complete" and slow_final.validation.valid
    assert text_of("slow") == alone.text, "being late changed the slow request's output"
    jsonschema.validate(json.loads(text_of("ordinary")), ORDINARY)
    # While both ran: in lockstep they would get a token each per step; isolated, the ordinary
    # one gets one per step and the slow one one per SLOW_FILL_MS (many CPU steps).
    start = next(k for k, (w, _) in enumerate(events) if w == "ordinary")
    end = next(k for k, (_, chunk) in enumerate(events) if chunk.finish_reason)
    window = events[start:end + 1]
    num_slow = sum(len(chunk.token_ids) for w, chunk in window if w == "slow")
    num_ordinary = sum(len(chunk.token_ids) for w, chunk in window if w == "ordinary")
    assert num_ordinary >= 4 and num_slow * 2 < num_ordinary, \
        f"the slow request kept pace: {num_slow} tokens while the ordinary one streamed {num_ordinary}"
    assert client.engine_stats().num_late_rows > 0  # what an operator sees of it (GetEngineStats)
    wait_idle()
