"""The transformers engine's side of vLLM's weight transfer, over a gloo process group.

vLLM's `nccl` backend joins a stateless process group with the trainer (rank 0, which hosts the
rendezvous) and receives each tensor of an update by broadcast, one at a time in `update_info`
order. This is the same exchange over gloo, which runs on CPU: the group is a `ProcessGroupGloo` on
a `TCPStore` at the trainer's `master_address:master_port`, this server is rank `rank_offset`.
Tensors are received into staging buffers on a thread of their own (generation goes on meanwhile)
and copied into the model on the engine's worker thread at `commit`, so a transfer that fails half
way leaves the served weights as they were. A tensor that arrives with NaN or inf values fails the
update (400 naming it): served, it would fail every sampled generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from grpo_api.weight_transfer import GLOO_STORE_PREFIX, WeightTransferInit, WeightUpdateInfo
from grpo_server.engines.base import WeightTransferError
from grpo_server.engines.serial import PRIORITY_ADAPTER, SerialWorker

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)
T = TypeVar("T")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Prefix of this transfer's keys in the trainer's store (other users of the store keep theirs).
STORE_PREFIX = GLOO_STORE_PREFIX
#: Seconds a rendezvous may run past `init_info.timeout_seconds` (torch's own deadlines) before it is given up.
RENDEZVOUS_GRACE_SECONDS = 5.0


async def on_daemon_thread(fn: Callable[[], T], name: str) -> T:
    """Run a blocking call on a daemon thread of its own: a transfer stuck in gloo (up to its timeout)
    must not hold up the process's exit, as a pool thread would."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]  # T when no error

    def run() -> None:
        outcome: tuple[T | None, BaseException | None]
        try:
            outcome = (fn(), None)
        except BaseException as exc:
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the server stopped): nobody waits
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


def checkpoint_parameters(model: PreTrainedModel) -> dict[str, torch.nn.Parameter]:
    """The model's parameters under their checkpoint names (PEFT's wrappers and LoRA tensors left out)."""
    params: dict[str, torch.nn.Parameter] = {}
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        params[name.replace(".base_layer.", ".")] = param
    return params


class GlooWeightReceiver:
    backend = "gloo"
    in_place = False  # received into staging, copied into the model at commit

    def __init__(self, model: Callable[[], PreTrainedModel], worker: Callable[[], SerialWorker]) -> None:
        self._model = model
        self._worker = worker
        self._group: torch.distributed.ProcessGroupGloo | None = None
        self._store: torch.distributed.TCPStore | None = None
        self._staged: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # one receive at a time

    def parameters(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {name: (tuple(p.shape), str(p.dtype).removeprefix("torch."))
                for name, p in checkpoint_parameters(self._model()).items()}

    def required(self) -> frozenset[str]:
        return frozenset()  # staged tensors are copied onto the model's own by name: any subset is whole

    async def join(self, init: WeightTransferInit, timeout: float) -> None:
        self.close()
        group = init.rendezvous()
        rank = group.rank_offset  # this engine is one worker

        def rendezvous() -> tuple[torch.distributed.TCPStore, torch.distributed.ProcessGroupGloo]:
            limit = dt.timedelta(seconds=timeout)
            store = torch.distributed.TCPStore(group.master_address, group.master_port, group.world_size,
                                               is_master=False, timeout=limit, wait_for_workers=False)
            prefixed = torch.distributed.PrefixStore(STORE_PREFIX, store)
            return store, torch.distributed.ProcessGroupGloo(prefixed, rank, group.world_size, limit)

        try:
            # torch's TCPStore client waits for the master's answer to its ping without a deadline: a host that
            # takes the connection and stays silent (a stopped trainer: its kernel still accepts) would hold this
            # call, and every weight-transfer route behind it, for ever. The thread ends with that connection.
            self._store, self._group = await asyncio.wait_for(
                on_daemon_thread(rendezvous, "weight-transfer-rendezvous"), timeout + RENDEZVOUS_GRACE_SECONDS)
        except Exception as exc:  # DistStoreError, RuntimeError, OSError, TimeoutError: all mean no group
            why = "no answer" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            raise WeightTransferError(
                f"init_info: could not join the trainer's group at {group.master_address}:{group.master_port} as "
                f"rank {rank} of {group.world_size} within {timeout:g}s: {why}"
            ) from exc
        log.info("joined the weight-transfer group at %s:%d as rank %d of %d (gloo)",
                 group.master_address, group.master_port, rank, group.world_size)

    async def start(self) -> None:
        """Nothing to prepare: tensors arrive into staging."""

    async def receive(self, update: WeightUpdateInfo, timeout: float) -> None:
        group = self._group
        if group is None:
            raise WeightTransferError("no weight-transfer group: POST /init_weight_transfer_engine first")
        limit = dt.timedelta(seconds=timeout)

        def run() -> list[int]:
            """Receive every tensor (the trainer's broadcasts stay in step); the indices of non-finite ones."""
            non_finite: list[int] = []
            with self._lock:
                for index, (name, dtype_name, shape) in enumerate(
                    zip(update.names, update.dtype_names, update.shapes, strict=True)
                ):
                    tensor = torch.empty(shape, dtype=DTYPES[dtype_name])
                    group.broadcast(tensor, 0, limit).wait()  # type: ignore[attr-defined]  # not in the stubs
                    if not bool(torch.isfinite(tensor).all()):
                        non_finite.append(index)
                    self._staged[name] = tensor
            return non_finite

        try:
            non_finite = await on_daemon_thread(run, "weight-transfer-receive")
        except Exception as exc:
            self.discard()
            self.close()  # a broken group cannot carry the next update: the trainer initialises again
            raise WeightTransferError(f"receiving the update's tensors failed: {type(exc).__name__}: {exc}") from exc
        if non_finite:
            # served, NaN or inf weights fail every sampled generation (as adapter_checks refuses them in adapters)
            self.discard()
            first = non_finite[0]
            more = f" (and {len(non_finite) - 1} more tensor(s))" if len(non_finite) > 1 else ""
            raise WeightTransferError(
                f"update_info.names[{first}]: {update.names[first][:200]!r} arrived with non-finite values (NaN or "
                f"inf){more}; the update is refused and the weights being served stay",
                status_code=400, error="weights_invalid",
            )

    async def commit(self) -> int:
        staged, self._staged = self._staged, {}

        def apply() -> int:
            params = checkpoint_parameters(self._model())
            with torch.no_grad():
                for name, tensor in staged.items():
                    params[name].copy_(tensor)
            return len(staged)

        return await self._worker().call(apply, PRIORITY_ADAPTER)

    async def restore(self) -> None:
        """Never needed: the served weights change only in `commit`."""

    def discard(self) -> None:
        self._staged = {}

    def close(self) -> None:
        self._group, self._store = None, None
