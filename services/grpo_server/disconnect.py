"""Abort a generation whose client went away.

A client that times out or gives up closes its connection; without this its
generation would keep the engine busy until it finished, starving the requests
behind it. `cancel_on_disconnect` runs the handler beside a listener for the
ASGI `http.disconnect` message (the body was read already, so the next message
is the disconnect) and cancels the handler when the client leaves first. The
cancellation reaches the engine: vLLM aborts the request, the transformers
engine stops at its next decoding step (vLLM's entrypoints do the same with
`with_cancellation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec

from fastapi import Request
from fastapi.responses import Response

from grpo_server import metrics

log = logging.getLogger(__name__)

P = ParamSpec("P")

#: Status recorded for a request whose client left (nginx's "client closed request"); nobody receives it.
CLIENT_CLOSED = 499


async def _client_gone(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def cancel_on_disconnect(handler: Callable[P, Awaitable[Response]]) -> Callable[P, Awaitable[Response]]:
    """Wrap a route handler that takes `raw_request: Request`; FastAPI sees the handler's own signature."""

    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> Response:
        request = kwargs["raw_request"]
        assert isinstance(request, Request)
        work: asyncio.Task[Response] = asyncio.ensure_future(handler(*args, **kwargs))
        gone: asyncio.Task[Any] = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this wrapper is cancelled (server shutdown)
            gone.cancel()
            if not work.done():
                work.cancel()
        if not work.cancelled() and work.done():
            return work.result()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await work
        metrics.REQUESTS_ABORTED.labels(request.url.path).inc()
        log.info("%s %s: the client disconnected; its generation was aborted", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED)

    return wrapper
