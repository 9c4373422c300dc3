"""Weight updates through vLLM's weight-transfer routes: the rules, whatever the engine's transport.

An update is `start`, one or more `update` calls (each names its tensors; the trainer sends them
while the call runs) and `finish`. The rules:

- every tensor an update names must be a parameter of the served model, with its shape, and be
  named once, and carry what the backend needs (`ipc_handles` for ipc, nothing of the kind for the
  others); otherwise the call is refused (400, the field named) before a byte moves;
- an update carries every tensor its receiver requires (`WeightReceiver.required`: in place, the whole
  checkpoint) before `finish` commits it; one that lacks some is undone and refused (409);
- an update serves nothing until `finish`, and a completion comes from one set of weights, named
  in its response (`X-GRPO-Weights-Version`);
- an update whose transfer failed never serves: `finish` refuses it (409) and the trainer
  initialises the group again (ipc has no group: `/init_weight_transfer_engine` is optional there);
- versions only move forward, like adapters: 0 is the checkpoint read from disk, each finish is
  the next version above every earlier one (or the one the trainer names, if higher);
- adapters and replaced base weights do not mix: no update while an adapter is loaded, and no
  adapter load once the base weights were replaced (they were trained on the checkpoint's). An
  adapter load checks this before it waits for the engine, so one under way at `start` may land
  during the update: `finish` runs after every such load (`GenerationService.finish_weight_update`
  holds the adapter lock) and drops the update if one left an adapter loaded (409 `adapters_loaded`).

How the rules hold depends on the receiver (`WeightReceiver.in_place`):

- staging (gloo): tensors are received into staging while generation goes on, and `finish` copies
  them into the model while no generation runs (new ones wait, running ones finish first). A failed
  transfer leaves the weights being served as they were.
- in place (vLLM's engine, nccl or ipc): vLLM loads each tensor straight into the live model, and
  its `start_weight_update` moves every layer onto the meta device until `finish_weight_update`
  puts them back (layerwise reload), so no generation can run between the two. The update holds
  the service's exclusive section (the one staging commits use) from its first tensor until it
  ends: generations wait, none runs on half-replaced weights. An update that ends any other way
  than a successful `finish` (a failed transfer, a start or init over it, no call for
  `idle_timeout` seconds: a trainer that died) has the checkpoint loaded from disk again (`restore`)
  and weights version 0 serves, which is honest; a stale version at `finish` leaves the update
  open for a `finish` with a good version. If even the restore fails, the weights are unknown:
  `broken` says why, the service stops serving (/health/ fails, so the pod is restarted) and no
  generation runs on them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack

from grpo_api.weight_transfer import WeightTransferInit, WeightTransferResponse, WeightUpdateInfo
from grpo_server.engines.base import WeightReceiver
from grpo_server.errors import ApiError, ServerError

log = logging.getLogger(__name__)

#: Seconds allowed for each update's transfer (the rendezvous has `init_info.timeout_seconds`).
TRANSFER_TIMEOUT_SECONDS = 600.0
#: In place: seconds without a call after which an open update is abandoned and the checkpoint restored.
IDLE_TIMEOUT_SECONDS = 600.0


class WeightUpdates:
    def __init__(self, exclusive: Callable[[], AbstractAsyncContextManager[None]],
                 adapters_loaded: Callable[[], int], *, idle_timeout: float = IDLE_TIMEOUT_SECONDS) -> None:
        #: Runs its body while no generation runs and none starts (the service's gate).
        self._exclusive = exclusive
        self._adapters_loaded = adapters_loaded
        self._idle_timeout = idle_timeout
        self.version = 0
        #: The highest version ever served: a new one is above it, also after a restore to 0.
        self._highest = 0
        #: Why the served weights are unknown (an in-place restore failed); the service stops serving.
        self.broken: str | None = None
        self._joined = False
        self._updating = False
        self._failed: str | None = None
        #: Names received by the open update (`finish` needs one, and all its receiver `required`).
        self._received: set[str] = set()
        #: In place: the exclusive section the open update holds, from its first tensor to its end.
        self._held: AsyncExitStack | None = None
        #: In place: the served model may hold part of an unfinished update.
        self._dirty = False
        self._watchdog: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def updating(self) -> bool:
        return self._updating

    async def join(self, receiver: WeightReceiver, init: WeightTransferInit) -> WeightTransferResponse:
        started = time.perf_counter()
        if problems := init.problems(receiver.backend):
            raise ApiError(400, "invalid_request", "; ".join(problems))
        async with self._lock:
            await self._reset(receiver)
            self._joined = False
            await receiver.join(init, init.timeout_seconds)
            self._joined = True
        if not has_group(receiver):
            return self._answer(f"{receiver.backend}: no group to join; each update carries CUDA IPC handles of "
                                "the trainer's tensors on this GPU", started)
        group = init.rendezvous()
        return self._answer(f"joined the transfer group as rank {group.rank_offset} of {group.world_size}", started)

    async def start(self, receiver: WeightReceiver) -> WeightTransferResponse:
        """Open an update (a start during an update begins it again). In place, the model is touched, and
        generation held, only from the first tensor on."""
        started = time.perf_counter()
        async with self._lock:
            if not self._joined and has_group(receiver):
                raise ApiError(409, "weight_transfer_not_initialized",
                               "no transfer group: POST /init_weight_transfer_engine first")
            loaded = self._adapters_loaded()
            if loaded:
                raise ApiError(409, "adapters_loaded",
                               f"{loaded} adapter version(s) are loaded; adapters and replaced base weights do not "
                               "mix: clear and unload them, or use a fresh server")
            await self._reset(receiver)
            self._updating = True
        return self._answer("weight update started", started)

    async def update(self, receiver: WeightReceiver, update: WeightUpdateInfo) -> WeightTransferResponse:
        started = time.perf_counter()
        async with self._lock:
            self._require_updating()
            if self._failed is not None:
                raise ApiError(409, "weight_update_failed",
                               f"this update already failed ({self._failed[:300]}); {self._serving_now()}. "
                               f"{self._again(receiver)}")
            check_update(update, receiver.parameters(), receiver.backend)
            try:
                if receiver.in_place:
                    await self._hold(receiver)
                await receiver.receive(update, TRANSFER_TIMEOUT_SECONDS)
            except BaseException as exc:
                self._failed = str(exc) or type(exc).__name__
                self._joined = False
                if not isinstance(exc, Exception):  # cancelled: the idle watchdog ends the update
                    raise
                await self._end_in_place(receiver)
                log.warning("weight update failed; %s: %s", self._serving_now(), exc)
                if not receiver.in_place:
                    raise
                status = exc.status_code if isinstance(exc, ServerError) else 503
                raise ApiError(status, "weight_transfer_failed",
                               f"{self._failed[:1000]}; {self._serving_now()}") from exc
            finally:
                if self._held is not None:
                    self._arm(receiver)
            self._received.update(update.names)
            return self._answer(f"received {len(update.names)} tensor(s)", started, tensors=len(update.names))

    async def finish(self, receiver: WeightReceiver, version: int | None) -> WeightTransferResponse:
        started = time.perf_counter()
        async with self._lock:
            self._require_updating()
            if self._failed is not None:
                failure = self._failed
                await self._reset(receiver)
                raise ApiError(409, "weight_update_failed",
                               f"this update's transfer failed ({failure[:300]}); {self._serving_now()}. "
                               f"{self._again(receiver)}")
            if loaded := self._adapters_loaded():  # a load under way at `start` (checked before it) landed since
                await self._reset(receiver)
                raise ApiError(409, "adapters_loaded",
                               f"{loaded} adapter version(s) were loaded during this update; adapters and replaced "
                               f"base weights do not mix, so the update is dropped ({self._serving_now()}): clear "
                               "and unload them, or use a fresh server")
            if not self._received:
                raise ApiError(409, "weight_update_empty", "no tensor was received since /start_weight_update")
            if missing := receiver.required() - self._received:
                await self._reset(receiver)
                shown = ", ".join(sorted(missing)[:3]) + (", ..." if len(missing) > 3 else "")
                raise ApiError(409, "weight_update_incomplete",
                               f"this server loads updates into the live model and needs every tensor of the model "
                               f"in each one: {len(missing)} were not sent ({shown}); {self._serving_now()}. "
                               f"{self._again(receiver)} with every tensor")
            if version is not None and version <= self._highest:
                if self._held is not None:
                    self._arm(receiver)  # the update stays open for a finish with a good version
                raise ApiError(409, "weights_version_stale",
                               f"version {version} is not above {self._highest}, the highest weights version served "
                               f"so far (versions only move forward; {self.version} serves now)")
            if receiver.in_place:
                try:
                    tensors = await receiver.commit()
                except Exception as exc:
                    self._joined = False
                    await self._reset(receiver)
                    log.warning("finishing the weight update failed; %s: %s", self._serving_now(), exc)
                    raise ApiError(503, "weight_transfer_failed",
                                   f"finishing the update failed ({str(exc)[:1000]}); {self._serving_now()}") from exc
                self._advance(version)
                self._dirty = False
                await self._end_in_place(receiver)
            else:
                async with self._exclusive():
                    tensors = await receiver.commit()
                    self._advance(version)
            self._updating = False
            self._received.clear()
            log.info("weights version %d serving: %d tensor(s) replaced in %.3fs", self.version, tensors,
                     time.perf_counter() - started)
            return self._answer(f"weights version {self.version} serving ({tensors} tensor(s) replaced)", started,
                                tensors=tensors)

    # ------------------------------------------------------------------ in place

    async def _hold(self, receiver: WeightReceiver) -> None:
        """Enter the exclusive section (running generations finish, new ones wait) and open the engine's update."""
        if self._held is not None:
            return
        stack = AsyncExitStack()
        await stack.enter_async_context(self._exclusive())
        self._held = stack
        self._dirty = True  # from here on the model may change
        await receiver.start()

    async def _end_in_place(self, receiver: WeightReceiver) -> None:
        """End an in-place update's hold: the checkpoint restored if the model may hold part of it, then
        generation resumes. A restore that fails, or is interrupted, leaves the weights unknown: `broken`."""
        self._disarm()
        held, self._held = self._held, None
        try:
            if self._dirty:
                self._dirty = False
                try:
                    await receiver.restore()
                except BaseException as exc:
                    self.broken = (f"restoring the checkpoint's weights after an unfinished update failed "
                                   f"({type(exc).__name__}: {str(exc)[:500]})")
                    log.error("%s: this server no longer serves and must be restarted", self.broken)
                    if not isinstance(exc, Exception):
                        raise
                else:
                    self.version = 0
                    log.warning("an unfinished weight update was undone: the checkpoint's weights (version 0) serve")
        finally:
            if held is not None:
                await held.aclose()

    def _arm(self, receiver: WeightReceiver) -> None:
        """(Re)start the idle watchdog of an open in-place update."""
        self._disarm()
        self._watchdog = asyncio.get_running_loop().create_task(self._expire(receiver))

    def _disarm(self) -> None:
        task, self._watchdog = self._watchdog, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _expire(self, receiver: WeightReceiver) -> None:
        await asyncio.sleep(self._idle_timeout)
        async with self._lock:
            if self._watchdog is not asyncio.current_task():
                return  # a later call re-armed it, or the update ended
            self._watchdog = None
            self._failed = f"no call for {self._idle_timeout:g}s: the update was abandoned"
            self._joined = False
            log.warning("weight update abandoned (%s)", self._failed)
            await self._end_in_place(receiver)

    # ------------------------------------------------------------------ helpers

    def _require_updating(self) -> None:
        if not self._updating:
            raise ApiError(409, "weight_update_not_started", "POST /start_weight_update first")

    async def _reset(self, receiver: WeightReceiver) -> None:
        await self._end_in_place(receiver)
        receiver.discard()
        self._updating, self._failed = False, None
        self._received.clear()

    def _advance(self, version: int | None) -> None:
        self.version = version if version is not None else self._highest + 1
        self._highest = self.version

    @staticmethod
    def _again(receiver: WeightReceiver) -> str:
        if has_group(receiver):
            return "Initialise the group again and resend the update"
        return "Start the update again and resend it"

    def _serving_now(self) -> str:
        if self.broken is not None:
            return f"{self.broken}: this server no longer serves (/health/ fails) and must be restarted"
        if self.version == 0:
            return "the weights read from disk (version 0) serve"
        return f"the weights of version {self.version} still serve"

    def _answer(self, message: str, started: float, *, tensors: int = 0) -> WeightTransferResponse:
        return WeightTransferResponse(message=message, weights_version=self.version, tensors=tensors,
                                      seconds=round(time.perf_counter() - started, 6))


def has_group(receiver: WeightReceiver) -> bool:
    """Whether the backend has a transfer group to join before an update (all but ipc). An ipc server needs
    no `/init_weight_transfer_engine` (vLLM's does not either); a call with `init_info {}` is accepted."""
    return receiver.backend != "ipc"


def check_update(update: WeightUpdateInfo, params: dict[str, tuple[tuple[int, ...], str]], backend: str) -> None:
    """Refuse (400, the field named) a tensor the model does not have, or of another shape, and handles
    the backend does not take (ipc needs one per tensor, the broadcast backends none)."""
    if update.packed:
        raise ApiError(400, "invalid_request",
                       "update_info.packed: this server receives tensors one by one; send packed: false")
    if backend == "ipc" and update.ipc_handles is None:
        raise ApiError(400, "invalid_request",
                       "update_info.ipc_handles: the ipc backend needs one CUDA IPC handle per tensor")
    if backend != "ipc" and update.ipc_handles is not None:
        raise ApiError(400, "invalid_request",
                       f"update_info.ipc_handles: the {backend} backend receives tensors by broadcast; IPC handles "
                       "are for the ipc backend")
    for index, (name, shape) in enumerate(zip(update.names, update.shapes, strict=True)):
        if name not in params:
            raise ApiError(400, "invalid_request",
                           f"update_info.names[{index}]: {name[:200]!r} is not a parameter of the served model")
        expected = params[name][0]
        if tuple(shape) != expected:
            raise ApiError(400, "invalid_request",
                           f"update_info.shapes[{index}]: {shape} for {name[:200]!r}, whose shape is {list(expected)}")
