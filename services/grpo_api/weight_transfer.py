"""vLLM's weight-transfer protocol, as this project's server and trainer speak it.

The trainer pushes whole weights (full fine-tuning, or merged LoRA weights) into a running server
with vLLM's routes: `POST /init_weight_transfer_engine {init_info}` once, then per update
`/start_weight_update`, `/update_weights {update_info}` and `/finish_weight_update`. These models are
the request bodies, checked field by field before any byte moves. Two transports:

- `nccl` (and the transformers engine's `gloo`): the trainer is rank 0 of a transfer group and hosts
  its rendezvous (`master_address:master_port`); the server's workers are ranks `rank_offset ..`, and
  the trainer broadcasts the tensors an update names, in order, while `/update_weights` runs;
- `ipc`: trainer and server share the GPU; `init_info` is `{}` and each update carries one CUDA IPC
  handle per tensor (`ipc_handles`). vLLM's own HTTP form of those handles is a base64 pickle
  (`ipc_handles_pickled`), and unpickling a request body runs whatever code it names, so this server
  refuses it: a handle here is `CudaIpcHandle`, the data of torch's `rebuild_cuda_tensor` arguments,
  every field typed and bounded; the server rebuilds vLLM's structure from it (classes and dtypes
  from its own allowlist).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StringConstraints,
    field_validator,
    model_validator,
)

from grpo_api.models import GRPORunSpec, Mode, WeightTransfer

#: What `server.weightTransfer: auto` becomes: `grpo run` sets ipc for its server and initializer (server and
#: trainer share the GPU); unset (a cluster: separate pods), nccl.
ENV_WEIGHT_TRANSFER = "GRPO_WEIGHT_TRANSFER"


def resolve_weight_transfer(spec: GRPORunSpec, auto: str | None) -> str | None:
    """The backend the vllm engine is configured with: none unless the trainer pushes weights (server
    mode, trainer.tuning full or sync merged); `auto` takes ${ENV_WEIGHT_TRANSFER} (ipc or nccl), else nccl."""
    if spec.mode != Mode.SERVER or not spec.trainer.pushes_weights:
        return None
    chosen = spec.effective_server.weight_transfer
    if chosen != WeightTransfer.AUTO:
        return str(chosen)
    value = (auto or "").strip().lower() or str(WeightTransfer.NCCL)
    if value not in (WeightTransfer.IPC, WeightTransfer.NCCL):
        raise ValueError(f"${ENV_WEIGHT_TRANSFER}={auto!r} must be ipc or nccl")
    return value


#: Store prefix of the gloo exchange (the transformers engine's transport), shared by trainer and server.
GLOO_STORE_PREFIX = "grpo-weight-transfer"
#: Response header of every generation: the weights version that produced it (0: the weights read from disk).
WEIGHTS_VERSION_HEADER = "X-GRPO-Weights-Version"

#: Tensor dtypes a weight update may carry (vLLM's `dtype_names`).
WeightDtype = Literal["float32", "bfloat16", "float16"]
#: Bytes per element of each WeightDtype (this package imports no torch).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

#: Most tensors in one update (a 70B model has about 1,000 parameters; MoE models a few tens of thousands).
MAX_TENSORS = 200_000
MAX_DIMS = 8
_HOST = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.:\-]{0,251}[A-Za-z0-9])?$")
#: The rendezvous fields of `init_info`: needed by nccl and gloo, meaningless to ipc.
RENDEZVOUS_FIELDS = ("master_address", "master_port", "rank_offset", "world_size")
#: GPUs one tensor may be offered from (a multi-GPU trainer offers a copy on each GPU a server worker uses).
MAX_IPC_DEVICES = 64
#: Decoded sizes of the handle bytes. torch's storage handle is a 64-byte `cudaIpcMemHandle_t` (larger,
#: a few handles, with expandable segments); the ref counter handle is a shared-memory file name; the
#: event handle a 64-byte `cudaIpcEventHandle_t`.
MAX_STORAGE_HANDLE_BYTES = 16_384
MAX_REF_COUNTER_HANDLE_BYTES = 1024
MAX_EVENT_HANDLE_BYTES = 256
#: Byte sizes and offsets inside a GPU allocation (2^48: 256 TiB, beyond any device).
MAX_BYTES = 2**48


class TransferModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


@dataclass(frozen=True)
class Rendezvous:
    """The transfer group an nccl or gloo server joins (the trainer is rank 0 and hosts it)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


class WeightTransferInit(TransferModel):
    """`init_info` of `/init_weight_transfer_engine`: vLLM's `NCCLWeightTransferInitInfo` or, for ipc, `{}`.

    The model cannot know the server's backend, so the rendezvous fields are optional here and
    `problems(backend)` says what that backend makes of them: nccl and gloo need all four; ipc has
    no group and refuses them, as vLLM does (its `IPCWeightTransferInitInfo` takes no field).
    """

    master_address: str | None = Field(
        default=None, min_length=1, max_length=253, description="Host of the trainer's rendezvous (nccl, gloo)."
    )
    master_port: int | None = Field(default=None, ge=1, le=65535, description="Port of the trainer's rendezvous.")
    rank_offset: int | None = Field(
        default=None, ge=1, le=4096, description="Rank of the server's first worker (the trainer is 0)."
    )
    world_size: int | None = Field(
        default=None, ge=2, le=8192, description="Trainer plus every worker of every server in the group."
    )
    timeout_seconds: float = Field(
        default=60.0, gt=0.0, le=3600.0,
        description="How long to wait for the trainer's rendezvous (this server's extension; vLLM has none).",
    )

    @field_validator("master_address")
    @classmethod
    def _host(cls, value: str | None) -> str | None:
        if value is not None and not _HOST.match(value):
            raise ValueError("must be a host name or an IP address")
        return value

    def problems(self, backend: str) -> list[str]:
        """What is wrong with this init_info for `backend`, each naming its field; empty when nothing is."""
        sent = [name for name in RENDEZVOUS_FIELDS if getattr(self, name) is not None]
        if backend == "ipc":
            return [f"init_info.{name}: the ipc backend has no transfer group (trainer and server share the GPU); "
                    "send init_info {}" for name in sent]
        missing = [f"init_info.{name}: required by the {backend} backend"
                   for name in RENDEZVOUS_FIELDS if name not in sent]
        if missing:
            return missing
        assert self.rank_offset is not None and self.world_size is not None
        if self.rank_offset >= self.world_size:
            return [f"init_info.rank_offset: {self.rank_offset} is not below world_size ({self.world_size})"]
        return []

    def rendezvous(self) -> Rendezvous:
        """The group to join; raises ValueError (naming the fields) unless nccl/gloo's fields are all here."""
        if problems := self.problems("nccl"):
            raise ValueError("; ".join(problems))
        assert self.master_address is not None and self.master_port is not None
        assert self.rank_offset is not None and self.world_size is not None
        return Rendezvous(self.master_address, self.master_port, self.rank_offset, self.world_size)


def _base64(max_bytes: int) -> Callable[[object], object]:
    """A before-validator: standard base64 text (checked strictly, length bounded before decoding) to bytes."""
    longest = 4 * ((max_bytes + 2) // 3)

    def decode(value: object) -> object:
        if isinstance(value, bytes):  # built in Python (the trainer's encoder), not sent
            return value
        if not isinstance(value, str):
            raise ValueError("must be a base64 string")
        if len(value) > longest:
            raise ValueError(f"must encode at most {max_bytes} bytes")
        try:
            return base64.b64decode(value.encode("ascii"), validate=True)
        except (binascii.Error, ValueError) as exc:  # UnicodeEncodeError is a ValueError
            raise ValueError(f"must be standard base64: {exc}") from None

    return decode


def _to_base64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


#: Handle bytes are base64 in JSON dumps too (the trainer's encoder dumps what it validated).
_AS_BASE64 = PlainSerializer(_to_base64, return_type=str, when_used="json")
StorageHandle = Annotated[bytes, BeforeValidator(_base64(MAX_STORAGE_HANDLE_BYTES)),
                          Field(min_length=1, max_length=MAX_STORAGE_HANDLE_BYTES), _AS_BASE64]
RefCounterHandle = Annotated[bytes, BeforeValidator(_base64(MAX_REF_COUNTER_HANDLE_BYTES)),
                             Field(min_length=1, max_length=MAX_REF_COUNTER_HANDLE_BYTES), _AS_BASE64]
EventHandle = Annotated[bytes, BeforeValidator(_base64(MAX_EVENT_HANDLE_BYTES)),
                        Field(min_length=1, max_length=MAX_EVENT_HANDLE_BYTES), _AS_BASE64]
#: A GPU's UUID as torch prints it (`str(torch.cuda.get_device_properties(i).uuid)`).
DeviceUuid = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9-]{1,64}$")]


class CudaIpcHandle(TransferModel):
    """One CUDA tensor shared by CUDA IPC: the data among torch's `rebuild_cuda_tensor` arguments.

    `torch.multiprocessing.reductions.reduce_tensor` gives (tensor class, size, stride, offset,
    storage class, dtype, device, storage handle, storage size, storage offset, requires_grad, ref
    counter handle, ref counter offset, event handle, event sync required). The classes are not data:
    the server picks them (a plain tensor on a typed storage, what `reduce_tensor` gives for a
    detached tensor), as it picks the torch dtype for `dtype` and requires_grad=False (weights are
    copied into the model). The view must lie inside its storage; the rest only a GPU can check.
    """

    dtype: WeightDtype = Field(description="The tensor's dtype (the same as the update's dtype_names entry).")
    size: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(
        max_length=MAX_DIMS, description="The tensor's shape (the same as the update's shapes entry)."
    )
    stride: list[Annotated[int, Field(ge=0, lt=2**40)]] = Field(
        max_length=MAX_DIMS, description="Elements between neighbours along each dimension."
    )
    tensor_offset: int = Field(ge=0, lt=2**40, description="The tensor's first element within its storage.")
    device_index: int = Field(ge=0, le=1023, description="The trainer's device index (the server uses its own).")
    storage_handle: StorageHandle = Field(description="The CUDA allocation holding the storage (base64).")
    storage_size_bytes: int = Field(ge=1, lt=MAX_BYTES, description="The storage's size.")
    storage_offset_bytes: int = Field(ge=0, lt=MAX_BYTES, description="The storage's offset in its allocation.")
    ref_counter_handle: RefCounterHandle = Field(description="torch's shared reference counter (base64).")
    ref_counter_offset: int = Field(ge=0, lt=MAX_BYTES, description="The counter's slot.")
    event_handle: EventHandle | None = Field(
        default=None, description="The CUDA event to wait on before reading (base64), when event_sync_required."
    )
    event_sync_required: bool = Field(default=False, description="Whether the reader waits on event_handle.")

    @model_validator(mode="after")
    def _inside_storage(self) -> CudaIpcHandle:
        if len(self.stride) != len(self.size):
            raise ValueError(f"stride: {len(self.stride)} dimensions for a size of {len(self.size)}")
        if self.event_sync_required and self.event_handle is None:
            raise ValueError("event_handle: required when event_sync_required")
        if all(self.size):  # no element: nothing is read
            last = self.tensor_offset + sum((n - 1) * step for n, step in zip(self.size, self.stride, strict=True))
            needed = (last + 1) * DTYPE_BYTES[self.dtype]
            if needed > self.storage_size_bytes:
                raise ValueError(f"size, stride, tensor_offset: the tensor reaches byte {needed} of a storage of "
                                 f"storage_size_bytes={self.storage_size_bytes}")
        return self


class WeightUpdateInfo(TransferModel):
    """`update_info` of `/update_weights`: the tensors, in send order.

    vLLM's `NCCLWeightTransferUpdateInfo`, or its `IPCWeightTransferUpdateInfo` with `ipc_handles`
    in JSON (never `ipc_handles_pickled`). Whether `ipc_handles` must or must not be here depends on
    the server's backend, which the server checks (400 naming the field).
    """

    names: list[str] = Field(max_length=MAX_TENSORS, description="Parameter names, as the checkpoint names them.")
    dtype_names: list[WeightDtype] = Field(max_length=MAX_TENSORS, description="Dtype of each tensor as sent.")
    shapes: list[list[int]] = Field(max_length=MAX_TENSORS, description="Shape of each tensor.")
    packed: bool = Field(default=False, description="vLLM's packed broadcast (several tensors per buffer).")
    ipc_handles: (
        list[Annotated[dict[DeviceUuid, CudaIpcHandle], Field(min_length=1, max_length=MAX_IPC_DEVICES)]] | None
    ) = Field(
        default=None, max_length=MAX_TENSORS,
        description="ipc backend: per tensor, its CUDA IPC handle on each GPU it is offered from (by GPU UUID), "
                    "vLLM's `ipc_handles` as JSON. Required by ipc, refused by the other backends.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_pickle(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("ipc_handles_pickled") is not None:
            raise ValueError("ipc_handles_pickled: pickled handles are refused (unpickling a request runs the code it "
                             "names); send ipc_handles, the JSON form")
        return data

    @field_validator("names")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        for index, name in enumerate(names):
            if not 0 < len(name) <= 512:
                raise ValueError(f"names[{index}] must be 1 to 512 characters")
        return names

    @field_validator("shapes")
    @classmethod
    def _shapes(cls, shapes: list[list[int]]) -> list[list[int]]:
        for index, shape in enumerate(shapes):
            if len(shape) > MAX_DIMS or any(not 0 <= d < 2**31 for d in shape):
                raise ValueError(f"shapes[{index}] must have at most {MAX_DIMS} dimensions of 0 to 2^31-1")
        return shapes

    @model_validator(mode="after")
    def _aligned(self) -> WeightUpdateInfo:
        count = len(self.names)
        if len(self.dtype_names) != count or len(self.shapes) != count:
            raise ValueError(f"names, dtype_names and shapes must have one entry per tensor: got {count}, "
                             f"{len(self.dtype_names)} and {len(self.shapes)}")
        seen: set[str] = set()
        for index, name in enumerate(self.names):
            if name in seen:
                raise ValueError(f"names[{index}] ({name[:80]!r}) appears twice")
            seen.add(name)
        if self.ipc_handles is not None:
            if len(self.ipc_handles) != count:
                raise ValueError(f"ipc_handles must have one entry per tensor: got {len(self.ipc_handles)} for "
                                 f"{count} names")
            for index, (offers, dtype, shape) in enumerate(
                zip(self.ipc_handles, self.dtype_names, self.shapes, strict=True)
            ):
                for handle in offers.values():
                    if handle.dtype != dtype:
                        raise ValueError(f"ipc_handles[{index}]: dtype {handle.dtype} is not dtype_names[{index}] "
                                         f"({dtype})")
                    if handle.size != shape:
                        raise ValueError(f"ipc_handles[{index}]: size {handle.size} is not shapes[{index}] ({shape})")
        return self


class InitWeightTransferRequest(TransferModel):
    init_info: WeightTransferInit


class StartWeightUpdateRequest(TransferModel):
    is_checkpoint_format: bool = Field(default=True, description="Weights named as in the checkpoint (the only kind).")


class UpdateWeightsRequest(TransferModel):
    update_info: WeightUpdateInfo


class FinishWeightUpdateRequest(TransferModel):
    version: int | None = Field(
        default=None, ge=1, lt=2**63,
        description="The weights version this update becomes (above the current one); omitted: the next one.",
    )


class WeightTransferResponse(TransferModel):
    status: str = Field(default="ok")
    message: str
    weights_version: int = Field(description="The weights version serving now (0: the weights read from disk).")
    tensors: int = Field(default=0, description="Tensors received by this call, or staged for this update.")
    seconds: float = Field(default=0.0, description="Time the call took.")
