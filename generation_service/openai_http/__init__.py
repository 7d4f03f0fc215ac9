"""The OpenAI-compatible HTTP front door (`structgen serve --http-port`): /v1/chat/completions,
/v1/completions, /v1/models and /health on FastAPI + uvicorn, in the serving process.

Transport at the edge, as the gRPC servicer: requests (`schemas.py`) become the engine's
domain requests (`convert.py`, `tools.py`), go to the same in-process `Engine.submit`, and
their events come back as OpenAI responses or server-sent-event chunks (`choices.py`,
`responses.py`, `routes.py`). Errors take OpenAI's shape with the HTTP status of the gRPC
status the engine names (`errors.py`). `front.py` runs uvicorn on its own thread.
"""
