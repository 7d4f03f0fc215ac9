"""`POST /v1/responses`, OpenAI's Responses API, served through the chat path: schemas.py
(the request), convert.py (request -> chat completion request), render.py (the response
object and its stream of events)."""
