"""The vllm engine's side of vLLM's weight transfer: AsyncLLM's own engine, over nccl or ipc.

vLLM 0.26 does the transfer in its workers (`vllm.distributed.weight_transfer`): AsyncLLM's
`init_weight_transfer_engine`, `start_weight_update`, `update_weights` and `finish_weight_update` are
collective RPCs to every worker, which joins the trainer's group (nccl: the trainer is rank 0 and hosts
the rendezvous, a worker is rank `rank_offset + its rank`) or opens the trainer's CUDA IPC handles (ipc:
the same GPU, no group), and loads each tensor straight into the live model with the model's
`load_weights`, in checkpoint names. Nothing is staged: `start_weight_update` moves every layer onto the
meta device and `finish_weight_update` puts them back (layerwise reload), so this receiver is
`in_place` and `WeightUpdates` keeps generation out from an update's first tensor to its end.

IPC without pickle from the request: vLLM's HTTP form of the handles is `ipc_handles_pickled`, a base64
pickle its worker unpickles. Here the request carries `CudaIpcHandle` JSON (validated, bounded); this
module rebuilds vLLM's structure from it, `[{gpu_uuid: rebuild_cuda_tensor args}]` with the classes and
dtype taken from its own allowlist, and pickles that itself: the worker unpickles only what this server
built. The worker accepts a pickle only with `VLLM_ALLOW_INSECURE_SERIALIZATION=1`, which the engine sets
for the ipc backend; that flag also lets vLLM's own sockets between this process and its engine core
carry pickle (only this process writes to them).

In place over ipc: vLLM's layerwise reload rebuilds every layer on fresh memory and copies it back, which
is what quantized or repacked weights need, and it cost ~0.13 s of a 0.17 s push of the 1.5B shape on the
H100 (BENCHMARKS.md). An unquantized model's `load_weights` copies each tensor straight into the live
parameter instead (its weight loaders narrow and copy, as TRL's colocate mode loads): the push took 0.080 s
against 0.154 s layerwise. So unless `GRPO_SERVER_WEIGHT_LOADS=layerwise`, when the workers run this
server's extension (`WeightsInPlace`, mixed in through vLLM's `worker_extension_cls`) and report that the
model is not quantized, an ipc update skips `start_weight_update`/`finish_weight_update` and calls
`grpo_load_weights_in_place` on every worker, with the handles as plain values (no pickle); the parameters
keep their storage, so CUDA graphs stay valid.
Otherwise vLLM's own path runs.

A failed or abandoned update is undone from disk (`restore`): vLLM's worker `reload_weights` reads the
checkpoint again, after the half-done layerwise reload is closed (see `restore`).

The engine runs without LoRA when it has a backend (`vllm_engine.engine_args`): vLLM's LoRA wrappers
rename each linear layer's weight (`.base_layer.weight`) and its checkpoint-name loaders then find
nothing to load into.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import pickle
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from grpo_api.weight_transfer import CudaIpcHandle, WeightTransferInit, WeightUpdateInfo
from grpo_server.engines.base import InvalidRequestError, WeightTransferError

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The backends this server forwards to vLLM (vLLM also has `sparse_nccl`, which it does not).
BACKENDS = ("nccl", "ipc")
#: The only torch dtypes a rebuilt handle may name (the request's dtype picks one of them).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: safetensors' dtype names, for `parameters()`.
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
#: Checkpoint tensors vLLM's `load_weights` skips (Llama, Qwen2 and their kin): rotary buffers that older
#: checkpoints (HF conversions, ColossalAI) saved. No update needs them, and a trainer never sends them
#: (they are buffers, not parameters).
NOT_LOADED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
#: vLLM calls that touch no tensor data (start, finish, prefix-cache reset) get this long.
CALL_TIMEOUT_SECONDS = 600.0
#: Reading the whole checkpoint again from disk gets this long.
RESTORE_TIMEOUT_SECONDS = 1800.0


def checkpoint_tensors(model_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the model's safetensors files, by checkpoint name: its shape and dtype, from the headers.

    vLLM's `load_weights` takes checkpoint names (it fuses q/k/v and gate/up itself), so these are the
    names an update may carry. Empty when the model has no safetensors files: every update is refused.
    """
    from safetensors import safe_open

    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                sliced = handle.get_slice(key)
                dtype = sliced.get_dtype()
                tensors[key] = (tuple(int(d) for d in sliced.get_shape()), SAFETENSORS_DTYPES.get(dtype, dtype.lower()))
    return tensors


def tied_embeddings(model_dir: Path) -> bool:
    """Whether the model's config ties the output embedding to the input one (then it is not sent)."""
    try:
        return bool(json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings", False))
    except (OSError, ValueError):
        return False


def plain_args(handle: CudaIpcHandle) -> list[Any]:
    """The data of `rebuild_args` as plain values (lists, ints, bytes, a dtype name): what msgpack carries to
    vLLM's workers in `collective_rpc`, where `rebuild_from_plain` adds torch's classes back."""
    return [list(handle.size), list(handle.stride), handle.tensor_offset, handle.dtype, handle.device_index,
            handle.storage_handle, handle.storage_size_bytes, handle.storage_offset_bytes,
            handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle, handle.event_sync_required]


def rebuild_from_plain(plain: list[Any], device_index: int | None = None) -> tuple[Any, ...]:
    """torch's `rebuild_cuda_tensor` arguments, in `reduce_tensor`'s order, from `plain_args`.

    The classes are this module's: a plain tensor on a `TypedStorage` (what `reduce_tensor` gives for
    a detached tensor), the dtype comes from `DTYPES`, requires_grad is False; the request gives data
    only. `device_index` replaces the trainer's (a receiver opens the handle on its own device)."""
    (size, stride, tensor_offset, dtype, trainer_device, storage_handle, storage_size_bytes, storage_offset_bytes,
     ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = plain
    return (
        torch.Tensor,
        tuple(size),
        tuple(stride),
        tensor_offset,
        torch.storage.TypedStorage,
        DTYPES[dtype],
        trainer_device if device_index is None else device_index,
        bytes(storage_handle),  # bytes again whatever buffer type a transport decoded them to
        storage_size_bytes,
        storage_offset_bytes,
        False,
        bytes(ref_counter_handle),
        ref_counter_offset,
        None if event_handle is None else bytes(event_handle),
        event_sync_required,
    )


def rebuild_args(handle: CudaIpcHandle) -> tuple[Any, ...]:
    """torch's `rebuild_cuda_tensor` arguments for one handle (vLLM's receiver puts its own device index at
    position 6)."""
    return rebuild_from_plain(plain_args(handle))


def vllm_ipc_handles(update: WeightUpdateInfo) -> list[dict[str, tuple[Any, ...]]]:
    """vLLM's `IPCWeightTransferUpdateInfo.ipc_handles` (unpacked form): per tensor, GPU UUID -> rebuild args."""
    if update.ipc_handles is None:
        raise ValueError("update_info.ipc_handles: required by the ipc backend")
    return [{uuid: rebuild_args(handle) for uuid, handle in offers.items()} for offers in update.ipc_handles]


def in_place_payload(update: WeightUpdateInfo) -> tuple[list[str], list[dict[str, list[Any]]]]:
    """`grpo_load_weights_in_place`'s arguments: the names, and per tensor GPU UUID -> `plain_args`."""
    if update.ipc_handles is None:
        raise ValueError("update_info.ipc_handles: required by the ipc backend")
    return list(update.names), [{uuid: plain_args(handle) for uuid, handle in offers.items()}
                                for offers in update.ipc_handles]


def vllm_update_info(update: WeightUpdateInfo, backend: str) -> dict[str, Any]:
    """The `update_info` dict vLLM's worker parses into its backend's update info (only the fields it takes)."""
    info: dict[str, Any] = {"names": list(update.names), "dtype_names": list(update.dtype_names),
                            "shapes": [list(shape) for shape in update.shapes], "packed": False}
    if backend == "ipc":
        # built here from validated fields and allowlisted classes; the worker unpickles it
        # (IPCWeightTransferEngine.parse_update_info), never anything a client sent
        pickled = pickle.dumps(vllm_ipc_handles(update), protocol=pickle.HIGHEST_PROTOCOL)
        info["ipc_handles_pickled"] = base64.b64encode(pickled).decode("ascii")
    return info


def in_place_surface_problems() -> list[str]:
    """What of vLLM's and torch's surface `WeightsInPlace` relies on is missing (empty: all of it is there).

    Checked by the GPU server image's smoke test (hack/gpu-image-smoke.sh), where vLLM imports without a GPU."""
    import inspect

    from torch.multiprocessing import reductions
    from vllm.v1.worker.gpu_worker import Worker

    problems = []
    if not callable(getattr(reductions, "rebuild_cuda_tensor", None)):
        problems.append("torch.multiprocessing.reductions has no rebuild_cuda_tensor")
    elif list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)[6] != "storage_device":
        problems.append("rebuild_cuda_tensor's seventh argument is no longer the storage's device")
    if not callable(getattr(Worker, "get_model", None)):
        problems.append("vLLM's GPU worker has no get_model")
    return problems


#: The `WeightsInPlace` methods the server calls on every worker through `collective_rpc`.
IN_PLACE_SUPPORTED = "grpo_weights_in_place_supported"
LOAD_IN_PLACE = "grpo_load_weights_in_place"


class WeightsInPlace:
    """Mixed into vLLM's worker class (so `self` is the worker): ipc tensors loaded straight into the live model."""

    def grpo_weights_in_place_supported(self) -> bool:
        """Whether the model's `load_weights` may copy into the live parameters: not for a quantized model,
        whose layers vLLM processes after loading (its layerwise reload does that)."""
        worker: Any = self
        return getattr(worker.model_config, "quantization", None) is None

    def grpo_load_weights_in_place(self, names: list[str], handles: list[dict[str, list[Any]]]) -> int:
        """Open each tensor's CUDA IPC handle on this worker's GPU and load them all through the model's
        `load_weights`; returns how many. Waits for the copies to end: once every worker answered, the
        trainer may free or reuse its memory."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        worker: Any = self
        device = worker.device
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        weights = []
        for name, offers in zip(names, handles, strict=True):
            if uuid not in offers:
                raise ValueError(f"update_info.ipc_handles: {name} is not offered from this worker's GPU {uuid} "
                                 f"(offered: {', '.join(sorted(offers))})")
            weights.append((name, rebuild_cuda_tensor(*rebuild_from_plain(offers[uuid], device.index))))
        with torch.no_grad():
            worker.get_model().load_weights(weights)
        torch.cuda.current_stream(device).synchronize()
        return len(weights)


class VllmWeightReceiver:
    """Forwards the weight-transfer calls to AsyncLLM; in place (see the module doc)."""

    in_place = True

    def __init__(self, backend: str, llm: Callable[[], AsyncLLM], model_dir: Path,
                 workers: Callable[[], int]) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"weight_transfer: {backend!r} is not one this server forwards ({', '.join(BACKENDS)})")
        self.backend = backend
        self._llm = llm
        self._model_dir = model_dir
        self._workers = workers
        self._params: dict[str, tuple[tuple[int, ...], str]] | None = None
        self._received = 0
        #: ipc updates load in place (`WeightsInPlace`); the engine sets it once its workers said they can
        self.loads_in_place = False

    def parameters(self) -> dict[str, tuple[tuple[int, ...], str]]:
        if self._params is None:
            self._params = checkpoint_tensors(self._model_dir)
        return self._params

    def required(self) -> frozenset[str]:
        """Every tensor of the checkpoint (a tied `lm_head.weight` is the embedding's).

        vLLM 0.26 reloads in place layer by layer (`model_loader/reload/layerwise.py`): a layer given part
        of its tensors is rebuilt on fresh memory, loaded, and copied over the live one, so the tensors it
        was not given (q/k/v biases beside their weights, k of a fused qkv given only q and v) become
        uninitialised memory. Found on the H200: a merged sync that pushed the LoRA target modules' weights
        alone made the rewards swing between 0.02 and 0.39 from step to step. Tensors vLLM never loads
        (`NOT_LOADED`) are not required."""
        names = {name for name in self.parameters() if not any(part in name for part in NOT_LOADED)}
        if "lm_head.weight" in names and tied_embeddings(self._model_dir):
            names.discard("lm_head.weight")
        return frozenset(names)

    async def join(self, init: WeightTransferInit, timeout: float) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info: dict[str, Any] = {}
        where = "ipc (no group)"
        if self.backend == "nccl":
            group = init.rendezvous()
            workers = self._workers()
            if group.rank_offset + workers > group.world_size:
                raise InvalidRequestError(
                    f"init_info.world_size: {group.world_size} leaves no rank for this server's {workers} worker(s) "
                    f"from rank_offset {group.rank_offset}")
            # exactly NCCLWeightTransferInitInfo's fields: vLLM refuses any other
            info = {"master_address": group.master_address, "master_port": group.master_port,
                    "rank_offset": group.rank_offset, "world_size": group.world_size}
            where = f"{group.master_address}:{group.master_port} as ranks {group.rank_offset}.. of {group.world_size}"
        # nccl: vLLM's own rendezvous timeout (its store's, 300 s) still holds the engine core when ours passes
        await self._call(self._llm().init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)),
                         timeout, f"init_info: vLLM could not set up the {self.backend} transfer ({where})")
        log.info("weight transfer ready: %s, %s", self.backend, where)

    async def start(self) -> None:
        self._received = 0
        if self.loads_in_place:
            return  # no layerwise reload to open
        await self._call(self._llm().start_weight_update(), CALL_TIMEOUT_SECONDS, "vLLM's start_weight_update failed")

    async def receive(self, update: WeightUpdateInfo, timeout: float) -> None:
        if self.loads_in_place:
            names, handles = in_place_payload(update)
            await self._call(self._llm().collective_rpc(LOAD_IN_PLACE, args=(names, handles)), timeout,
                             f"loading the update's {len(names)} tensor(s) in place (ipc) failed")
            self._received += len(names)
            return
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        request = WeightTransferUpdateRequest(update_info=vllm_update_info(update, self.backend))
        await self._call(self._llm().update_weights(request), timeout,
                         f"receiving the update's {len(update.names)} tensor(s) ({self.backend}) failed")
        self._received += len(update.names)

    async def commit(self) -> int:
        if not self.loads_in_place:
            await self._call(self._llm().finish_weight_update(), CALL_TIMEOUT_SECONDS,
                             "vLLM's finish_weight_update failed")
        await self._reset_prefix_cache()
        received, self._received = self._received, 0
        return received

    async def restore(self) -> None:
        """Read the checkpoint from disk again, over whatever an unfinished update left.

        vLLM's `reload_weights` alone is not enough after a half-done layerwise reload: its own
        `initialize_layerwise_reload` skips layers still mid-load, whose buffered tensors would then
        count towards their completion and process them before every disk weight arrived. So the
        update's layerwise reload is closed first: `finish_weight_update` when vLLM's session is still
        open, else (a failed `update_weights` closes the session without finalising) a
        `start_weight_update` + `finish_weight_update` pair. Then every layer is whole, `reload_weights`
        (no arguments: the checkpoint the engine was started from) overwrites them all, and the prefix
        cache, computed with other weights, is dropped. In place (`loads_in_place`) no layerwise reload was
        opened: every layer is whole, if half-loaded, and `reload_weights` alone overwrites them.
        """
        self._received = 0
        llm = self._llm()
        if not self.loads_in_place:
            try:
                await self._call(llm.finish_weight_update(), CALL_TIMEOUT_SECONDS, "finish")
            except WeightTransferError as exc:
                log.info("no open vLLM weight update to finish (%s): opening and closing one", exc)
                await self._call(llm.start_weight_update(), CALL_TIMEOUT_SECONDS,
                                 "restore: start_weight_update failed")
                await self._call(llm.finish_weight_update(), CALL_TIMEOUT_SECONDS,
                                 "restore: finish_weight_update failed")
        await self._call(llm.collective_rpc("reload_weights"), RESTORE_TIMEOUT_SECONDS,
                         "restore: reloading the checkpoint from disk failed")
        await self._reset_prefix_cache()
        log.warning("the checkpoint's weights were loaded from disk again")

    def discard(self) -> None:
        """Nothing is staged (vLLM loads in place)."""

    def close(self) -> None:
        """vLLM has no call to leave a group; the next init replaces it."""

    async def _reset_prefix_cache(self) -> None:
        """Cached prefixes hold KV computed with the weights before: drop them (nothing runs now; vLLM
        raises if it cannot reset)."""
        await self._call(self._llm().reset_prefix_cache(reset_running_requests=True), CALL_TIMEOUT_SECONDS,
                         "resetting vLLM's prefix cache after the weights changed failed")

    @staticmethod
    async def _call(work: Awaitable[T], timeout: float, what: str) -> T:
        """Await a vLLM call within `timeout`; any failure is a WeightTransferError (503) saying what failed.

        On a timeout the call may still run in the engine core, which does one utility call at a time:
        later calls queue behind it (a restore then times out too, and the server stops serving).
        """
        try:
            return await asyncio.wait_for(work, timeout)
        except TimeoutError as exc:
            raise WeightTransferError(f"{what}: no answer within {timeout:g}s") from exc
        except Exception as exc:  # vLLM's utility failures are plain Exceptions; EngineDeadError too
            raise WeightTransferError(f"{what}: {type(exc).__name__}: {str(exc)[:1000]}") from exc
