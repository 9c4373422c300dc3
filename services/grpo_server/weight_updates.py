"""Weight updates through vLLM's weight-transfer routes: the rules, whatever the engine's transport.

An update is `start`, one or more `update` calls (each names its tensors; the trainer broadcasts
them while the call runs) and `finish`. The rules:

- every tensor an update names must be a parameter of the served model, with its shape, and be
  named once; otherwise the call is refused (400, the field named) before a byte moves;
- staged tensors serve nothing until `finish`, which applies them while no generation runs (new
  ones wait, running ones finish first), so every completion comes from one set of weights, and
  its response names that set's version (`X-GRPO-Weights-Version`);
- an update whose transfer failed never serves: `finish` refuses it (409), the weights stay as
  they were, and the trainer initialises the group again;
- versions only move forward, like adapters: 0 is the checkpoint read from disk, each finish is
  the next version (or the one the trainer names, if higher);
- adapters and replaced base weights do not mix: no update while an adapter is loaded, and no
  adapter load once the base weights were replaced (they were trained on the checkpoint's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from grpo_api.weight_transfer import WeightTransferInit, WeightTransferResponse, WeightUpdateInfo
from grpo_server.engines.base import WeightReceiver
from grpo_server.errors import ApiError

log = logging.getLogger(__name__)

#: Seconds allowed for each update's transfer (the rendezvous has `init_info.timeout_seconds`).
TRANSFER_TIMEOUT_SECONDS = 600.0


class WeightUpdates:
    def __init__(self, exclusive: Callable[[], AbstractAsyncContextManager[None]],
                 adapters_loaded: Callable[[], int]) -> None:
        #: Runs its body while no generation runs and none starts (the service's gate).
        self._exclusive = exclusive
        self._adapters_loaded = adapters_loaded
        self.version = 0
        self._joined = False
        self._updating = False
        self._failed: str | None = None
        self._staged = 0
        self._lock = asyncio.Lock()

    @property
    def updating(self) -> bool:
        return self._updating

    async def join(self, receiver: WeightReceiver, init: WeightTransferInit) -> WeightTransferResponse:
        started = time.perf_counter()
        async with self._lock:
            self._reset(receiver)
            self._joined = False
            await receiver.join(init, init.timeout_seconds)
            self._joined = True
        return self._answer(f"joined the transfer group as rank {init.rank_offset} of {init.world_size}", started)

    async def start(self, receiver: WeightReceiver) -> WeightTransferResponse:
        started = time.perf_counter()
        async with self._lock:
            if not self._joined:
                raise ApiError(409, "weight_transfer_not_initialized",
                               "no transfer group: POST /init_weight_transfer_engine first")
            loaded = self._adapters_loaded()
            if loaded:
                raise ApiError(409, "adapters_loaded",
                               f"{loaded} adapter version(s) are loaded; adapters and replaced base weights do not "
                               "mix: clear and unload them, or use a fresh server")
            self._reset(receiver)  # a start during an update begins it again
            self._updating = True
        return self._answer("weight update started", started)

    async def update(self, receiver: WeightReceiver, update: WeightUpdateInfo) -> WeightTransferResponse:
        started = time.perf_counter()
        async with self._lock:
            self._require_updating()
            check_update(update, receiver.parameters())
            try:
                await receiver.receive(update, TRANSFER_TIMEOUT_SECONDS)
            except Exception as exc:
                self._failed = str(exc)
                self._joined = False
                log.warning("weight update failed; version %d still serves: %s", self.version, exc)
                raise
            self._staged += len(update.names)
            return self._answer(f"received {len(update.names)} tensor(s)", started, tensors=len(update.names))

    async def finish(self, receiver: WeightReceiver, version: int | None) -> WeightTransferResponse:
        started = time.perf_counter()
        async with self._lock:
            self._require_updating()
            if self._failed is not None:
                failure = self._failed
                self._reset(receiver)
                raise ApiError(409, "weight_update_failed",
                               f"this update's transfer failed ({failure[:300]}); the weights of version "
                               f"{self.version} still serve. Initialise the group again and resend the update")
            if self._staged == 0:
                raise ApiError(409, "weight_update_empty", "no tensor was received since /start_weight_update")
            if version is not None and version <= self.version:
                raise ApiError(409, "weights_version_stale",
                               f"version {version} is not above the weights version serving now ({self.version})")
            async with self._exclusive():
                tensors = await receiver.commit()
                self.version = version if version is not None else self.version + 1
            self._updating, self._staged = False, 0
            log.info("weights version %d serving: %d tensor(s) replaced in %.3fs", self.version, tensors,
                     time.perf_counter() - started)
            return self._answer(f"weights version {self.version} serving ({tensors} tensor(s) replaced)", started,
                                tensors=tensors)

    def _require_updating(self) -> None:
        if not self._updating:
            raise ApiError(409, "weight_update_not_started", "POST /start_weight_update first")

    def _reset(self, receiver: WeightReceiver) -> None:
        receiver.discard()
        self._updating, self._failed, self._staged = False, None, 0

    def _answer(self, message: str, started: float, *, tensors: int = 0) -> WeightTransferResponse:
        return WeightTransferResponse(message=message, weights_version=self.version, tensors=tensors,
                                      seconds=round(time.perf_counter() - started, 6))


def check_update(update: WeightUpdateInfo, params: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """Refuse (400, the field named) a tensor the model does not have, or of another shape."""
    if update.packed:
        raise ApiError(400, "invalid_request",
                       "update_info.packed: this engine receives tensors one by one; send packed: false")
    for index, (name, shape) in enumerate(zip(update.names, update.shapes, strict=True)):
        if name not in params:
            raise ApiError(400, "invalid_request",
                           f"update_info.names[{index}]: {name[:200]!r} is not a parameter of the served model")
        expected = params[name][0]
        if tuple(shape) != expected:
            raise ApiError(400, "invalid_request",
                           f"update_info.shapes[{index}]: {shape} for {name[:200]!r}, whose shape is {list(expected)}")
