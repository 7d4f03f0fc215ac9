"""The assistant turn beyond its constraint, shared by the gRPC and the HTTP API.

A turn may open with a reasoning span (`reasoning.py`) and may call tools (`tools.py`) in the
chat template's tool-call format (`formats.py`). `turn.py` holds one request's plan: it builds
the grammar that enforces both (a structural tag for the calls, a `ReasoningSpan` on the
`GrammarSpec` for the span, compiled by grammar_service) and the parser (`parser.py`) that
splits the streamed text back into reasoning, content and parsed, validated calls. A request
with neither gets no plan and takes the path it always took.
"""
