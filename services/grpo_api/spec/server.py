"""The generation server of a run: engine, replicas, serving limits and the path of the policy's weights."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from grpo_api.spec import cel
from grpo_api.spec.env import EnvVar
from grpo_api.spec.names import IMAGE_RULE, check_image
from grpo_api.spec.pods import PodSettings, pod_rules
from grpo_api.spec.resources import NONNEGATIVE_QUANTITY_PATTERN, Resources, gpu_resources
from grpo_api.spec.sources import ModelDType

#: The image a run's server gets when neither its spec nor the operator names one (the chart sets the operator's).
DEFAULT_SERVER_IMAGE = "ghcr.io/grpo-dev/grpo-server:0.1.0"

#: LoRA ranks vLLM can serve (`vllm/config/lora.py`).
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
RANKS_CEL = "[" + ", ".join(str(r) for r in VLLM_LORA_RANKS) + "]"


class Engine(StrEnum):
    AUTO = "auto"
    VLLM = "vllm"
    TRANSFORMERS = "transformers"


class WeightTransfer(StrEnum):
    """How a full fine-tuning run's weights reach the vllm engine (vLLM's weight-transfer backends)."""

    AUTO = "auto"
    IPC = "ipc"
    NCCL = "nccl"


class LogprobsSource(StrEnum):
    AUTO = "auto"
    SAMPLER = "sampler"


#: The server's health path: an absolute URL path (no query, fragment or space).
HEALTH_PATH_PATTERN = r"^/[-A-Za-z0-9._~!$&()*+,;=:@%/]*$"


#: Most server replicas of one run.
MAX_SERVER_REPLICAS = 16
SERVER_RULES: list[cel.Rule] = [
    cel.rule(f"self.maxLoraRank in {RANKS_CEL}", f"maxLoraRank must be one of {RANKS_CEL}",
             fieldPath=".maxLoraRank"),
]


class ServerSpec(PodSettings):
    """The generation server: vLLM serving the base model plus the policy's current LoRA adapter."""

    section: ClassVar[str] = "server"

    image: str | None = Field(
        default=None,
        description="Server container image; default: the operator's (the chart's runImages.server).",
        max_length=512,
        json_schema_extra=cel.schema(IMAGE_RULE),
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy."
    )
    engine: Engine = Field(
        default=Engine.AUTO,
        description="Inference engine: vllm (GPU), transformers (CPU/GPU, slow but real), or auto "
        "(vllm when importable and a GPU is present).",
    )
    resources: Resources = Field(default_factory=gpu_resources, description="Server container resources.")
    port: int = Field(default=8000, ge=1, le=65535, description="HTTP port of the server.")
    replicas: int = Field(
        default=1, ge=1, le=MAX_SERVER_REPLICAS,
        description="Server pods of an attempt, fed and synced as one. The trainer starts once every replica "
        "passed the fresh-boot health gate; each adapter version is loaded on every replica before a batch "
        "is generated on it (a replica that missed one gets no work until it caught up); each batch is "
        "spread over the replicas, all completions of a prompt on one replica; the work of a lost replica "
        "is sent to another. The trainer finds them through a headless Service (`<run>-replicas`).",
    )
    tensor_parallel_size: int = Field(default=1, ge=1, le=64, description="vLLM tensor parallel size.")
    data_parallel_size: int = Field(default=1, ge=1, le=64, description="vLLM data parallel size.")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="Share of GPU memory vLLM may use."
    )
    dtype: ModelDType = Field(default=ModelDType.AUTO, description="Serving dtype.")
    max_model_len: int | None = Field(
        default=None, ge=16, description="Maximum prompt + completion length; default is the model's."
    )
    enable_prefix_caching: bool = Field(default=True, description="Enable vLLM prefix caching.")
    enforce_eager: bool = Field(default=False, description="Disable CUDA graphs and torch.compile in vLLM.")
    max_loras: int = Field(
        default=4, ge=1, le=64, description="Adapters resident at once (at least the staleness window + 1)."
    )
    max_lora_rank: int = Field(default=64, description="Largest LoRA rank the server accepts.")
    weight_transfer: WeightTransfer = Field(
        default=WeightTransfer.AUTO,
        description="With trainer.tuning full: how the trainer's weights reach the vllm engine. ipc: CUDA IPC "
        "handles, trainer and server on the same GPU (no copy over a network). nccl: a NCCL broadcast from "
        "the trainer (rank 0, hosting the rendezvous) to the server's workers, across GPUs and pods. auto: "
        "ipc under `grpo run`, nccl on a cluster. The transformers engine receives over gloo whatever this "
        "says. Unused with tuning lora.",
    )
    logprobs_source: LogprobsSource = Field(
        default=LogprobsSource.SAMPLER,
        description="Where the vllm engine takes the sampled tokens' logprobs from. sampler: vLLM's "
        "sampler, streamed with every decoding step (costly in vLLM 0.26). auto: when the processed "
        "logprobs equal the model's own (temperature 1, no top-k/top-p/min-p, no penalties, no "
        "alternatives asked), generate without logprobs and score the completions in one prefill pass; "
        "otherwise the sampler. On vLLM 0.26 auto measured slower (the prefill pass costs more than the "
        "transport it saves; BENCHMARKS.md), so sampler is the default.",
    )
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra vLLM engine arguments (AsyncEngineArgs field names).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    health_path: str = Field(
        default="/health/", description="Health endpoint path used by probes and gates; the server answers its "
        "health check there and at /health/, and refuses to start (exit code 2) when it is another endpoint's "
        "path.", max_length=256,
        pattern=HEALTH_PATH_PATTERN,
    )
    authenticate_generation: bool = Field(
        default=False, description="Require the run's bearer token on generation endpoints too."
    )
    shm_size: str = Field(
        default="8Gi", description="Size of the /dev/shm memory volume.", max_length=64,
        pattern=NONNEGATIVE_QUANTITY_PATTERN,
    )
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables.", max_length=64)

    _check_image = field_validator("image")(check_image)

    # _rank_supported and PodSettings._pod_settings, for the API server.
    model_config = ConfigDict(json_schema_extra=cel.rules(*SERVER_RULES, *pod_rules("server")))

    @model_validator(mode="after")
    def _rank_supported(self) -> ServerSpec:
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"maxLoraRank must be one of {list(VLLM_LORA_RANKS)}, got {self.max_lora_rank}")
        return self
