"""HTTP errors: every 4xx/5xx body is `grpo_api.protocol.ErrorResponse{error, message}`.

Everything the server refuses or fails with is a `ServerError` (bad request, unknown
model, adapter refusal, engine failure...), answered by one handler. FastAPI's own
validation and routing errors get the same body, and so does anything unexpected
(500 `internal_error`, `grpo_server.middleware.UnexpectedErrorMiddleware`).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from grpo_api.protocol import ErrorResponse


class ServerError(Exception):
    """Base of every error the server answers on purpose: an HTTP status, a reason and a message."""

    default_status: ClassVar[int] = 500
    default_error: ClassVar[str] = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        error: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code if status_code is not None else self.default_status
        self.error = error or self.default_error
        self.headers = headers


class ApiError(ServerError):
    """Any status and reason (authentication, engine not ready...)."""

    def __init__(self, status_code: int, error: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message, status_code=status_code, error=error, headers=headers)


class BadRequest(ServerError):
    """A request that cannot be served as asked; the message names the field."""

    default_status = 400
    default_error = "invalid_request"

    def __init__(self, message: str, error: str = "invalid_request") -> None:
        super().__init__(message, error=error)


class BodyTooLarge(ServerError):
    """The request body exceeded the server's limit."""

    default_status = 413
    default_error = "body_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")
        self.limit = limit


#: A pydantic location segment that names a union member's type, not a field (`list[int]`, `str`,
#: `function-after[...]`, `json-or-python[...]`).
UNION_MEMBER = re.compile(r"(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[a-z]+(-[a-z]+)+\[.*\])")


def error_response(status_code: int, error: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=error, message=message).model_dump()
    return JSONResponse(status_code=status_code, content=body, headers=headers)


def describe_validation_error(exc: RequestValidationError) -> tuple[str, str]:
    """(error, message): malformed JSON is its own reason; otherwise every bad field by its path."""
    errors: list[Any] = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        return "invalid_json", f"request body is not valid JSON: {detail.get('ctx', {}).get('error', detail['msg'])}"
    parts = []
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        # union members show up as extra path segments (e.g. prompt.list[int].0): keep the field path
        loc = [p for p in loc if not UNION_MEMBER.fullmatch(p)]
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    unique = list(dict.fromkeys(parts))
    return "invalid_request", "; ".join(unique[:5])


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServerError)
    async def _server_error(request: Request, exc: ServerError) -> JSONResponse:
        return error_response(exc.status_code, exc.error, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        error, message = describe_validation_error(exc)
        return error_response(400, error, message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, error, f"{request.method} {request.url.path}: {exc.detail}")
