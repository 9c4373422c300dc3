"""vLLM's weight-transfer protocol, as this project's server and trainer speak it.

The trainer pushes whole weights (full fine-tuning, or merged LoRA weights) into a running server
with vLLM's routes: `POST /init_weight_transfer_engine {init_info}` once, then per update
`/start_weight_update`, `/update_weights {update_info}` (the trainer broadcasts the tensors in that
order while the request runs) and `/finish_weight_update`. The trainer is rank 0 of the transfer
group and hosts its rendezvous (`master_address:master_port`); the server's workers are ranks
`rank_offset ..`. These models are the request bodies, checked field by field before any byte moves.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Response header of every generation: the weights version that produced it (0: the weights read from disk).
WEIGHTS_VERSION_HEADER = "X-GRPO-Weights-Version"

#: Tensor dtypes a weight update may carry (vLLM's `dtype_names`).
WeightDtype = Literal["float32", "bfloat16", "float16"]

#: Most tensors in one update (a 70B model has about 1,000 parameters; MoE models a few tens of thousands).
MAX_TENSORS = 200_000
MAX_DIMS = 8
_HOST = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.:\-]{0,251}[A-Za-z0-9])?$")


class TransferModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class WeightTransferInit(TransferModel):
    """`init_info` of `/init_weight_transfer_engine` (vLLM's `NCCLWeightTransferInitInfo`)."""

    master_address: str = Field(min_length=1, max_length=253, description="Host of the trainer's rendezvous.")
    master_port: int = Field(ge=1, le=65535, description="Port of the trainer's rendezvous.")
    rank_offset: int = Field(ge=1, le=4096, description="Rank of the server's first worker (the trainer is 0).")
    world_size: int = Field(ge=2, le=8192, description="Trainer plus every worker of every server in the group.")
    timeout_seconds: float = Field(
        default=60.0, gt=0.0, le=3600.0,
        description="How long to wait for the trainer's rendezvous (this server's extension; vLLM has none).",
    )

    @field_validator("master_address")
    @classmethod
    def _host(cls, value: str) -> str:
        if not _HOST.match(value):
            raise ValueError("must be a host name or an IP address")
        return value


class WeightUpdateInfo(TransferModel):
    """`update_info` of `/update_weights` (vLLM's `NCCLWeightTransferUpdateInfo`): the tensors, in send order."""

    names: list[str] = Field(max_length=MAX_TENSORS, description="Parameter names, as the checkpoint names them.")
    dtype_names: list[WeightDtype] = Field(max_length=MAX_TENSORS, description="Dtype of each tensor as sent.")
    shapes: list[list[int]] = Field(max_length=MAX_TENSORS, description="Shape of each tensor.")
    packed: bool = Field(default=False, description="vLLM's packed broadcast (several tensors per buffer).")

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
