"""One worker thread that runs engine calls one at a time, adapter operations first.

The transformers engine mutates one model (PEFT's active adapter is model-wide),
so its calls must not overlap; they must also stay off the event loop. A plain
lock would let an adapter load wait behind every queued generation; a priority
queue lets a trigger run as soon as the current generation ends, while each
queued generation keeps the adapter it captured when it was admitted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Lower runs first.
PRIORITY_ADAPTER = 0
PRIORITY_GENERATE = 1

_STOP = object()


class SerialWorker:
    """Runs submitted callables on one daemon thread, by priority then arrival."""

    def __init__(self, name: str) -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, Any, concurrent.futures.Future[Any]]] = (
            queue.PriorityQueue()
        )
        self._order = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    async def call(self, fn: Callable[[], T], priority: int = PRIORITY_GENERATE) -> T:
        if self._closed:
            raise RuntimeError("engine worker is shut down")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((priority, next(self._order), fn, future))
        return await asyncio.wrap_future(future)

    def close(self, timeout: float) -> None:
        """Cancel queued work, let the running call finish (up to timeout), end the thread."""
        self._closed = True
        while True:
            try:
                _, _, _, future = self._queue.get_nowait()
            except queue.Empty:
                break
            future.cancel()
        stop: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((-1, next(self._order), _STOP, stop))
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            _, _, fn, future = self._queue.get()
            if fn is _STOP:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
