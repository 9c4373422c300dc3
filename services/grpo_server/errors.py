"""HTTP errors: every 4xx/5xx body is `grpo_api.protocol.ErrorResponse{error, message}`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from grpo_api.protocol import ErrorResponse
from grpo_server.adapter_checks import AdapterRefusal
from grpo_server.engines.base import EngineError, InvalidRequestError
from grpo_server.registry import ModelNotFound
from grpo_server.sampling import BadRequest


class ApiError(Exception):
    def __init__(self, status_code: int, error: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.error = error
        self.message = message
        self.headers = headers


class BodyTooLarge(Exception):
    """The request body exceeded the server's limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")
        self.limit = limit


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
        loc = [p for p in loc if not p.startswith(("list[", "str", "int", "function-"))]
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    unique = list(dict.fromkeys(parts))
    return "invalid_request", "; ".join(unique[:5])


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status_code, exc.error, exc.message, exc.headers)

    @app.exception_handler(AdapterRefusal)
    async def _refusal(request: Request, exc: AdapterRefusal) -> JSONResponse:
        return error_response(exc.status_code, exc.reason, exc.message)

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return error_response(400, exc.error, str(exc))

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, "invalid_request", str(exc))

    @app.exception_handler(ModelNotFound)
    async def _not_found(request: Request, exc: ModelNotFound) -> JSONResponse:
        return error_response(404, "model_not_found", str(exc))

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        return error_response(503, "engine_error", str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        error, message = describe_validation_error(exc)
        return error_response(400, error, message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, error, f"{request.method} {request.url.path}: {exc.detail}")
