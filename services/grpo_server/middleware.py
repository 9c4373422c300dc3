"""ASGI middleware: request head and body size limits, per-endpoint request metrics, and the last-resort 500."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from grpo_server import metrics
from grpo_server.errors import BodyTooLarge, error_response
from grpo_server.settings import MAX_HEADER_BYTES

log = logging.getLogger(__name__)


class BodyLimitMiddleware:
    """Refuse a header block over `max_header_bytes` with 431, and bodies over `max_bytes` with 413:
    by Content-Length up front, else while reading."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_header_bytes: int = MAX_HEADER_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = sum(len(name) + len(value) for name, value in scope.get("headers", []))
        if header_bytes > self.max_header_bytes:
            response = error_response(
                431,
                "headers_too_large",
                f"request headers of {header_bytes} bytes exceed {self.max_header_bytes} bytes",
            )
            await response(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    response = error_response(
                        413, "body_too_large", f"request body of {declared} bytes exceeds {self.max_bytes} bytes"
                    )
                    await response(scope, receive, send)
                    return
        received = 0
        exceeded = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    exceeded = True
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def guarded_send(message: Message) -> None:
            if not exceeded:  # the app's own answer to the aborted read is replaced by the 413 below
                await send(message)

        with contextlib.suppress(BodyTooLarge):
            await self.app(scope, limited_receive, guarded_send)
        if exceeded:
            response = error_response(413, "body_too_large", f"request body exceeds {self.max_bytes} bytes")
            await response(scope, receive, send)


class RequestMetricsMiddleware:
    """Count requests by route template and status, and time them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            endpoint = _endpoint(scope)
            metrics.REQUESTS.labels(endpoint, str(status["code"])).inc()
            metrics.REQUEST_DURATION.labels(endpoint).observe(time.perf_counter() - started)


def _endpoint(scope: Scope) -> str:
    """The matched route's path template; unmatched paths share one label (no label explosion)."""
    route: Any = scope.get("route")
    path = getattr(route, "path", None)
    return str(path) if path else "unmatched"


class UnexpectedErrorMiddleware:
    """Anything a handler did not expect becomes a JSON 500 `internal_error` (traceback in the log only).

    Starlette's own last-resort handler answers and then re-raises, which makes the server close the
    connection; this answers and keeps the connection, so one bad request costs the client nothing else.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:  # too late for another answer: let the server close the connection
                raise
            method, path = scope.get("method", ""), scope.get("path", "")
            log.exception("%s %s failed", method, path)
            response = error_response(
                500, "internal_error", f"{method} {path}: internal error ({type(exc).__name__}); see the server log"
            )
            await response(scope, receive, send)
