"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP
status that matches the gRPC status the same failure gets on the gRPC port.

Domain code raises `EngineError` subclasses (their `.status` names a gRPC status) or
`ValueError` (a domain dataclass refused a value: INVALID_ARGUMENT); `ApiError` is for what
only the HTTP edge knows (an unknown route, model or parameter). Anything else is a 500
logged with an error id, as the gRPC interceptor does.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from generation_service.engine.errors import EngineError
from generation_service.openai_http.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("structgen.http")

# gRPC status name -> (HTTP status, OpenAI error type)
STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "INTERNAL": (500, "server_error"),
}
# OpenAI parameters this server does not serve, and why (a 400 names them).
UNSUPPORTED_PARAMETERS = {
    "audio": "audio output is not supported (text models only)",
    "modalities": "only text output exists here; leave modalities unset",
    "prediction": "predicted outputs are not supported",
    "functions": "the deprecated functions API is not supported; use tools",
    "function_call": "the deprecated functions API is not supported; use tool_choice",
    "reasoning_effort": "reasoning models are not supported yet",
    "web_search_options": "web search is not supported",
    "verbosity": "verbosity is not supported",
    "prompt_cache_key": "prompt caching keys are not supported",
    "safety_identifier": "safety identifiers are not supported",
}

PARAMETERS = frozenset(ChatCompletionRequest.model_fields) | frozenset(CompletionRequest.model_fields)
_DOMAIN_NAMES = {"stop_strings": "stop", "max_new_tokens": "max_tokens", "num_logprobs": "logprobs"}


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, error: BaseException, param: str | None = None) -> "ApiError":
        """The OpenAI error of a domain exception (EngineError, ValueError, ApiError)."""
        if isinstance(error, ApiError):
            return error
        if isinstance(error, EngineError):
            status, kind = STATUS.get(error.status, STATUS["INTERNAL"])
            return cls(status, error.message, kind, param or _leading_name(error.message), error.status.lower())
        if isinstance(error, ValueError):
            return cls(400, str(error), param=param or _leading_name(str(error)))
        error_id = uuid.uuid4().hex[:12]
        log.error("internal error %s", error_id, exc_info=error)
        return cls(500, f"internal error {error_id}; see the server log", "server_error", None, "internal")

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _leading_name(message: str) -> str | None:
    """'top_p must be in (0, 1]' -> 'top_p': domain checks start with the field's name, which
    is the request parameter's (or one of _DOMAIN_NAMES)."""
    head = message.split(" ", 1)[0]
    head = _DOMAIN_NAMES.get(head, head)
    return head if head in PARAMETERS else None


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's first complaint about the body, with the parameter it concerns."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":  # loc holds the character position, not a parameter
        position = first.get("loc", ("body", "?"))[-1]
        reason = (first.get("ctx") or {}).get("error") or first.get("msg")
        return ApiError(400, f"the request body is not valid JSON (character {position}): {reason}",
                        code="invalid_value").response()
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "extra_forbidden":
        name = location[-1] if location else ""
        reason = UNSUPPORTED_PARAMETERS.get(name) if len(location) == 1 else None
        message = (f"{name} is not supported by this server: {reason}" if reason
                   else f"Unrecognized request argument supplied: {param}")
    elif first.get("type") == "model_attributes_type" or not location:
        message = f"the request body is not a valid JSON object: {first.get('msg')}"
    else:
        message = f"{param}: {first.get('msg')}"
    return ApiError(400, message, param=param, code="invalid_value").response()


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return ApiError(exc.status_code, message, kind).response()


def install(app) -> None:
    app.add_exception_handler(ApiError, lambda request, exc: exc.response())
    app.add_exception_handler(EngineError, lambda request, exc: ApiError.of(exc).response())
    app.add_exception_handler(ValueError, lambda request, exc: ApiError.of(exc).response())
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, lambda request, exc: ApiError.of(exc).response())
