"""Errors with the right status for every failure the API can meet: in Anthropic's JSON
shape on Anthropic's paths, in OpenAI's everywhere else."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from appliance.engine.engine import EngineClosed, QueueFull
from appliance.runtime import ModelUnavailable, UnknownModel
from appliance.server.json import JSONResponse

log = logging.getLogger("omlx.server")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def to_data(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return JSONResponse(self.to_data(), status_code=self.status, headers=self.headers)

    def to_anthropic_data(self) -> dict:
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def anthropic_response(self) -> Response:
        return JSONResponse(self.to_anthropic_data(), status_code=self.status, headers=self.headers)


# Anthropic names its errors by status.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def render(request: Request, error: ApiError) -> Response:
    """Returns the error in the shape of the API whose path was asked."""
    path = request.url.path
    while path.startswith("/v1/"):  # /messages, /v1/messages and /v1/v1/messages are all served
        path = path.removeprefix("/v1")
    if path == "/messages" or path.startswith("/messages/"):
        return error.anthropic_response()
    return error.response()


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_exception(exc: Exception) -> ApiError:
    """Returns the ApiError that answers a domain exception raised under a route."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, UnknownModel):
        return ApiError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": "1"})
    if isinstance(exc, ModelUnavailable):
        retry = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
        return ApiError(503, str(exc), type="server_error", code="model_unavailable", headers=retry)
    if isinstance(exc, EngineClosed):
        return ApiError(503, str(exc), type="server_error", code="shutting_down",
                        headers={"Retry-After": "5"})
    log.exception("unhandled error", exc_info=exc)
    return ApiError(500, "internal server error", type="server_error")


async def handle_exception(request: Request, exc: Exception) -> Response:
    return render(request, from_exception(exc))


async def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return render(request, ApiError(exc.status_code, message, type=kind, headers=exc.headers))


# Domain exceptions are answered where they are raised; anything else is a 500 (and logged).
EXCEPTION_HANDLERS = {
    HTTPException: handle_http_exception,
    ApiError: handle_exception,
    UnknownModel: handle_exception,
    ModelUnavailable: handle_exception,
    QueueFull: handle_exception,
    EngineClosed: handle_exception,
    Exception: handle_exception,
}
