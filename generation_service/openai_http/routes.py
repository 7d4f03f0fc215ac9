"""The FastAPI app: routes, bearer-token auth, and one handler per endpoint.

Each handler checks the body, converts it to domain requests (convert.py) and hands them to
an Exchange with the chat or text-completion Format (render.py). The engine and ServeConfig
come from `create_app`'s FrontState.
"""
from __future__ import annotations

import hmac
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from generation_service.config import ServeConfig
from generation_service.openai_http import convert, errors, observability
from generation_service.openai_http import responses as r
from generation_service.openai_http.choices import ChoiceStreams
from generation_service.openai_http.errors import ApiError
from generation_service.openai_http.exchange import Exchange
from generation_service.openai_http.outputs import ChoiceOutput
from generation_service.openai_http.render import ChatFormat, CompletionFormat, ResponseMeta
from generation_service.openai_http.responses_api import convert as responses_convert
from generation_service.openai_http.responses_api.render import ResponsesFormat
from generation_service.openai_http.responses_api.schemas import ResponsesRequest
from generation_service.openai_http.schemas import ChatCompletionRequest, CompletionRequest, SamplingBody
from generation_service.openai_http.token_text import TokenTexts


@dataclass
class FrontState:
    engine: object
    config: ServeConfig
    auth_header: bytes | None   # b"Bearer <token>", or None: no auth
    created: int                # the model card's `created`: when this server started
    is_draining: bool = False
    token_texts: TokenTexts | None = None

    def texts(self) -> TokenTexts:
        if self.token_texts is None:
            self.token_texts = TokenTexts(self.engine.tokenizer)
        return self.token_texts


def _state(request: Request) -> FrontState:
    return request.app.state.front


class BearerTokenAuth:
    """ASGI middleware: "Authorization: Bearer <token>" on every path but /health (probes), as
    the gRPC port's interceptor; checked before the body is read."""

    def __init__(self, app, expected: bytes) -> None:
        self.app = app
        self._expected = expected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            # compare_digest: the time taken must not tell how much of a guess was right
            if not hmac.compare_digest(given, self._expected):
                error = ApiError(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')",
                                 "authentication_error", None, "invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class JsonBodies:
    """ASGI middleware: every body this API takes is JSON, so a POST that says otherwise (`curl
    -d` sends application/x-www-form-urlencoded) is read as JSON all the same."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(name, value) for name, value in scope["headers"] if name != b"content-type"]
            given = next((value for name, value in scope["headers"] if name == b"content-type"), b"")
            if b"json" not in given.lower():
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def _accepting(state: FrontState, body: SamplingBody) -> None:
    if state.is_draining:
        raise ApiError(503, "the server is shutting down", "service_unavailable", None, "unavailable")
    convert.check_model(body, state.engine.model_name, state.engine.config.model)
    convert.refuse_unsupported(body)


def _meta(state: FrontState, response_id: str, body: SamplingBody) -> ResponseMeta:
    wants_logprobs = body.num_logprobs > 0
    if wants_logprobs and state.engine.tokenizer is None:
        raise ApiError(400, "logprobs need the model's tokenizer (to spell the tokens); this model has none",
                       param="logprobs")
    top = (body.top_logprobs or 0) if isinstance(body, ChatCompletionRequest) else (body.logprobs or 0)
    return ResponseMeta(id=response_id, created=int(time.time()), model=state.engine.model_name, n=body.n,
                        num_top_logprobs=top if wants_logprobs else None,
                        token_texts=state.texts() if wants_logprobs else None)


async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = _state(request)
    _accepting(state, body)
    response_id = convert.new_id("chatcmpl")
    specs, turn = convert.chat_requests(body, response_id, state.engine, state.config)
    meta = _meta(state, response_id, body)
    return await _respond(request, state, body, "chat", specs, turn, meta, ChatFormat(body.includes_usage))


async def completions(body: CompletionRequest, request: Request):
    state = _state(request)
    _accepting(state, body)
    response_id = convert.new_id("cmpl")
    specs = convert.completion_requests(body, response_id, state.engine, state.config)
    meta = _meta(state, response_id, body)
    return await _respond(request, state, body, "text_completion", specs, None, meta,
                          CompletionFormat(body.includes_usage, {}))


async def responses(body: ResponsesRequest, request: Request):
    """The Responses API: the chat completion it stands for, answered as a response object."""
    state = _state(request)
    chat = responses_convert.chat_request(body)
    _accepting(state, chat)
    response_id = f"resp_{uuid.uuid4().hex}"
    specs, turn = convert.chat_requests(chat, response_id, state.engine, state.config)
    meta = _meta(state, response_id, chat)
    return await _respond(request, state, chat, "chat", specs, turn, meta, ResponsesFormat(body), stream=body.stream)


async def _respond(request: Request, state: FrontState, body: SamplingBody, operation: str, specs, turn,
                   meta: ResponseMeta, format_, stream: bool | None = None):
    """Submit the choices and answer; the server span becomes `{operation} {model}` (as on
    gRPC) and the engine's spans join its trace."""
    specs = observability.start_choices(specs, operation, state.engine.model_name, meta.id)
    try:
        outputs = [ChoiceOutput(i, spec, turn, body.structgen.return_token_ids) for i, spec in enumerate(specs)]
        exchange = Exchange(request, ChoiceStreams(state.engine, specs, turn), outputs, meta, format_,
                            body.includes_usage)
    except BaseException:
        observability.end_choices(specs)
        raise
    return await exchange.respond(body.stream if stream is None else stream)


def _model_card(state: FrontState) -> r.ModelCard:
    engine = state.engine
    return r.ModelCard(id=engine.model_name, created=state.created, owned_by="structgen",
                       max_model_len=engine.model_config.max_position_embeddings)


async def list_models(request: Request):
    return JSONResponse(r.ModelList(data=[_model_card(_state(request))]).dump())


async def get_model(model: str, request: Request):
    state = _state(request)
    if model not in (state.engine.model_name, state.engine.config.model):
        raise ApiError(404, f"The model {model!r} does not exist", "invalid_request_error", "model", "model_not_found")
    return JSONResponse(_model_card(state).dump())


async def health(request: Request):
    """Unauthenticated, like grpc.health.v1: 200 while serving, 503 while draining."""
    if _state(request).is_draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


def create_app(state: FrontState) -> FastAPI:
    app = FastAPI(title="structgen OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry=observability.TELEMETRY)
    app.state.front = state
    errors.install(app)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/responses", responses, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", get_model, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_middleware(JsonBodies)
    if state.auth_header is not None:
        app.add_middleware(BearerTokenAuth, expected=state.auth_header)
    # added last, so outermost of ours: auth refusals are counted (and their spans ERROR) too
    app.add_middleware(observability.HttpObservability)
    return app
