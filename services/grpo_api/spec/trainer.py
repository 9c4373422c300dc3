"""The trainer of a run: what it tunes (LoRA or every weight), the GRPO loss, sampling, batching and processes."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from grpo_api.spec import cel
from grpo_api.spec.api import ApiModel
from grpo_api.spec.env import EnvVar
from grpo_api.spec.names import IMAGE_RULE, check_image
from grpo_api.spec.pods import PodSettings, pod_rules
from grpo_api.spec.resources import Resources, gpu_resources
from grpo_api.spec.server import RANKS_CEL, VLLM_LORA_RANKS

#: The image a run's trainer (and initializer) gets when neither its spec nor the operator names one.
DEFAULT_TRAINER_IMAGE = "ghcr.io/grpo-dev/grpo-trainer:0.1.0"


class Tuning(StrEnum):
    """What training changes: a LoRA adapter, or every weight of the policy."""

    LORA = "lora"
    FULL = "full"


class SyncPath(StrEnum):
    """How a LoRA run's policy reaches the server."""

    ADAPTER = "adapter"
    MERGED = "merged"


LORA_RULES: list[cel.Rule] = [
    cel.rule(f"self.r in {RANKS_CEL}", f"r must be one of {RANKS_CEL} (vLLM's supported LoRA ranks)",
             fieldPath=".r"),
    cel.rule(
        "!self.targetModules.exists(m, m == 'lm_head' || m == 'embed_tokens')",
        "targetModules may not include lm_head or embed_tokens: vLLM cannot serve such adapters",
        fieldPath=".targetModules",
    ),
]


class LoraSpec(ApiModel):
    """The LoRA adapter trained on the policy (full fine-tuning is out of scope)."""

    r: int = Field(default=16, description="LoRA rank; one of vLLM's supported ranks.")
    alpha: int = Field(default=32, ge=1, description="LoRA alpha (scaling = alpha / r).")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="LoRA dropout.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"],
        description="Modules to adapt; `all-linear` adapts every linear layer except lm_head.",
        min_length=1,
        max_length=64,
    )
    quantize_base: bool = Field(
        default=False, description="QLoRA: load the base model in 4 bits (needs bitsandbytes and a GPU)."
    )

    model_config = ConfigDict(json_schema_extra=cel.rules(*LORA_RULES))

    @model_validator(mode="after")
    def _adaptable(self) -> LoraSpec:
        if self.r not in VLLM_LORA_RANKS:
            raise ValueError(f"lora.r must be one of {list(VLLM_LORA_RANKS)}, got {self.r}")
        forbidden = {"lm_head", "embed_tokens"} & set(self.target_modules)
        if forbidden:
            raise ValueError(f"lora.targetModules may not include {sorted(forbidden)}: vLLM cannot serve them")
        return self


class LossType(StrEnum):
    GRPO = "grpo"
    BNPO = "bnpo"
    DR_GRPO = "dr_grpo"
    DAPO = "dapo"
    CISPO = "cispo"
    SAPO = "sapo"
    LUSPO = "luspo"


class Level(StrEnum):
    TOKEN = "token"
    SEQUENCE = "sequence"


class Strategy(StrEnum):
    """How several trainer processes share the policy (PyTorch Lightning's names)."""

    DDP = "ddp"
    FSDP = "fsdp"


class Tracker(StrEnum):
    """An experiment tracker the trainer reports to, through transformers' own integration (TRL's report_to)."""

    TENSORBOARD = "tensorboard"
    MLFLOW = "mlflow"
    WANDB = "wandb"
    TRACKIO = "trackio"


REPORT_TO_DUPLICATE_MESSAGE = "trainer.reportTo names a tracker twice"


class ImportanceSamplingMode(StrEnum):
    TRUNCATE = "truncate"
    MASK = "mask"


#: importanceSampling.maxDrift at its ceiling: every stale batch is trained on (the drift guard is off).
MAX_DRIFT_OFF = 100.0


class ImportanceSamplingSpec(ApiModel):
    """Correction for the gap between the server's sampling policy and the trainer's policy."""

    enabled: bool = Field(default=True, description="Weight the loss by the trainer/server probability ratio.")
    level: Level = Field(default=Level.TOKEN, description="Ratio per token or per sequence.")
    mode: ImportanceSamplingMode = Field(
        default=ImportanceSamplingMode.MASK,
        description="truncate clips large ratios to clipMax; mask drops tokens or sequences beyond it.",
    )
    clip_max: float = Field(default=3.0, gt=1.0, description="Upper bound C of the ratio.")
    max_drift: float = Field(
        default=0.3,
        gt=0.0,
        le=MAX_DRIFT_OFF,
        description="Most mean |log-ratio| a token, between the policy that trains on a stale batch and the one "
        "that sampled it (TRL's sampling/sampling_logp_difference/mean), for the batch to be trained on; a "
        "stale batch beyond it is generated again from the current policy "
        "(grpo_trainer_discarded_batches{reason=\"policy_drift\"}) and prefetching backs off, so at a rate that "
        "moves the policy that far in a step, asyncPrefetch trains as the synchronous loop does instead of "
        "collapsing. Needs enabled; 100 trains on every stale batch.",
    )


STRUCTURED_OUTPUTS_RULES: list[cel.Rule] = [
    cel.rule(
        "(has(self.regex) ? 1 : 0) + (has(self.jsonSchema) ? 1 : 0) + (has(self.choice) ? 1 : 0) == 1",
        "structuredOutputs needs exactly one of regex, jsonSchema or choice",
    ),
]


class StructuredOutputsSpec(ApiModel):
    """Guided decoding of every rollout: exactly one of regex, jsonSchema or choice.

    TRL's `vllm_structured_outputs_regex` and Axolotl's guided decoding, and vLLM's
    `StructuredOutputsParams` (json, regex, choice) on the server.
    """

    model_config = ConfigDict(json_schema_extra=cel.schema(*STRUCTURED_OUTPUTS_RULES))  # CEL beside the type it checks

    regex: str | None = Field(
        default=None, description="A regular expression every completion matches.", min_length=1, max_length=4096
    )
    json_schema: dict[str, Any] | None = Field(
        default=None,
        description="A JSON schema (an object) every completion follows.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    choice: list[Annotated[str, Field(min_length=1, max_length=1024)]] | None = Field(
        default=None, description="Every completion is exactly one of these strings.", min_length=1, max_length=256
    )

    @model_validator(mode="after")
    def _one_valid_kind(self) -> StructuredOutputsSpec:
        kinds = [k for k in ("regex", "json_schema", "choice") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("structuredOutputs needs exactly one of regex, jsonSchema or choice")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"structuredOutputs.regex does not compile: {exc}") from exc
        return self

    def vllm_params(self) -> dict[str, Any]:
        """The constraint as vLLM's `StructuredOutputsParams` fields: a generation request's `structured_outputs`."""
        if self.regex is not None:
            return {"regex": self.regex}
        if self.json_schema is not None:
            return {"json": self.json_schema}
        return {"choice": list(self.choice or ())}


#: Most trainer pods, and processes per pod, of one run.
MAX_TRAINER_NODES = 64
MAX_TRAINER_PROCS_PER_NODE = 16
#: The torch.distributed rendezvous port of a trainer of several pods (on the pod of completion index 0).
TRAINER_RENDEZVOUS_PORT = 29500
METRICS_PORT_MESSAGE = (
    f"trainer.metricsPort may not be {TRAINER_RENDEZVOUS_PORT} with numNodes > 1: the trainer pods meet there"
)

FULL_TUNING_QLORA_MESSAGE = (
    "trainer.lora.quantizeBase (QLoRA) trains an adapter over a 4-bit base: it cannot be combined with "
    "trainer.tuning full"
)
FULL_TUNING_FSDP_MESSAGE = (
    "trainer.tuning full with strategy fsdp is not supported yet (the pushed weights would be gathered from "
    "the shards); use strategy ddp"
)

MERGED_SYNC_MESSAGE = (
    "trainer.sync merged merges a LoRA adapter into full-precision base weights: it needs trainer.tuning lora "
    "without lora.quantizeBase"
)
MERGED_SYNC_FSDP_MESSAGE = (
    "trainer.sync merged with strategy fsdp is not supported yet (the merged weights would be gathered from the "
    "shards); use strategy ddp or sync adapter"
)

MAX_STALENESS_MESSAGE = (
    "trainer.maxStaleness must be at least trainer.prefetchDepth with asyncPrefetch: a prefetched batch is "
    "that many versions behind by construction"
)


TRAINER_RULES: list[cel.Rule] = [
    cel.rule(
        f"!has(self.numNodes) || self.numNodes <= 1 || !has(self.metricsPort) || "
        f"self.metricsPort != {TRAINER_RENDEZVOUS_PORT}",
        METRICS_PORT_MESSAGE,
        fieldPath=".metricsPort",
    ),
    cel.rule(
        "(self.perDeviceBatchSize * self.gradientAccumulationSteps) % self.numGenerations == 0",
        "perDeviceBatchSize × gradientAccumulationSteps must be divisible by numGenerations",
        fieldPath=".numGenerations",
    ),
    cel.rule(
        "!has(self.maxStaleness) || !has(self.asyncPrefetch) || !self.asyncPrefetch || "
        "self.maxStaleness >= (has(self.prefetchDepth) ? self.prefetchDepth : 1)",
        MAX_STALENESS_MESSAGE,
        fieldPath=".maxStaleness",
    ),
    cel.rule(
        "!has(self.tuning) || self.tuning != 'full' || !has(self.lora) || !has(self.lora.quantizeBase) || "
        "!self.lora.quantizeBase",
        FULL_TUNING_QLORA_MESSAGE,
        fieldPath=".tuning",
    ),
    cel.rule(
        "!has(self.tuning) || self.tuning != 'full' || !has(self.strategy) || self.strategy != 'fsdp'",
        FULL_TUNING_FSDP_MESSAGE,
        fieldPath=".tuning",
    ),
    cel.rule(
        "!has(self.sync) || self.sync != 'merged' || ((!has(self.tuning) || self.tuning == 'lora') && "
        "(!has(self.lora) || !has(self.lora.quantizeBase) || !self.lora.quantizeBase))",
        MERGED_SYNC_MESSAGE,
        fieldPath=".sync",
    ),
    cel.rule(
        "!has(self.sync) || self.sync != 'merged' || !has(self.strategy) || self.strategy != 'fsdp'",
        MERGED_SYNC_FSDP_MESSAGE,
        fieldPath=".sync",
    ),
]


class TrainerSpec(PodSettings):
    """The GRPO trainer (TRL GRPOTrainer + PEFT LoRA) and its settings."""

    section: ClassVar[str] = "trainer"

    image: str | None = Field(
        default=None,
        description="Trainer (and initializer) container image; default: the operator's (the chart's "
        "runImages.trainer).",
        max_length=512,
        json_schema_extra=cel.schema(IMAGE_RULE),
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy."
    )
    resources: Resources = Field(default_factory=gpu_resources, description="Trainer container resources.")
    tuning: Tuning = Field(
        default=Tuning.LORA,
        description="lora: train a LoRA adapter (trainer.lora); the server loads each published version "
        "from the shared volume. full: train every weight; each sync pushes the whole policy into the "
        "server with vLLM's weight transfer (server.weightTransfer) and the server reports the weights "
        "version behind each completion (X-GRPO-Weights-Version); checkpoints hold the full model.",
    )
    lora: LoraSpec = Field(default_factory=LoraSpec, description="LoRA adapter settings (tuning lora).")
    sync: SyncPath = Field(
        default=SyncPath.ADAPTER,
        description="With tuning lora in server mode, what each sync sends. adapter: the adapter, published to "
        "the shared volume and loaded by the server (vLLM's LoRA kernels at generation). merged: every weight, "
        "the target modules' with the adapter merged in (W + scale·BA), pushed like full fine-tuning's "
        "(server.weightTransfer), so the server generates on plain weights; checkpoints keep the adapter and "
        "the last one is published to the volume at the end. On one GPU (ipc) merged measured faster than adapter "
        "(BENCHMARKS.md); across GPUs it needs nccl, which needs vLLM in the trainer image.",
    )
    num_generations: int = Field(default=8, ge=2, le=1024, description="Completions per prompt (the group).")
    max_completion_length: int = Field(default=256, ge=1, description="Maximum generated tokens per completion.")
    max_prompt_length: int | None = Field(
        default=None, ge=1, description="Prompts longer than this (in tokens) are dropped from the dataset."
    )
    learning_rate: float = Field(default=1e-5, gt=0.0, le=1.0, description="Peak learning rate.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        default="constant", description="Learning-rate schedule."
    )
    max_steps: int = Field(default=100, ge=1, description="Optimizer steps to train.")
    per_device_batch_size: int = Field(
        default=8, ge=1, description="Completions per device per micro-batch (prompts × generations)."
    )
    gradient_accumulation_steps: int = Field(default=1, ge=1, description="Micro-batches per optimizer step.")
    beta: float = Field(default=0.0, ge=0.0, description="KL coefficient against the base model (0 disables).")
    epsilon: float = Field(default=0.2, gt=0.0, lt=1.0, description="PPO clipping range.")
    loss_type: LossType = Field(default=LossType.DAPO, description="Loss aggregation (TRL loss_type).")
    ratio_level: Level = Field(
        default=Level.TOKEN, description="PPO ratio per token (GRPO) or per sequence (GSPO)."
    )
    temperature: float = Field(default=1.0, gt=0.0, le=10.0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    top_k: int = Field(default=0, ge=-1, description="Top-k sampling; 0 or -1 disables.")
    structured_outputs: StructuredOutputsSpec | None = Field(
        default=None,
        description="Guided decoding of every rollout (regex, jsonSchema or choice), as TRL's "
        "vllm_structured_outputs_regex; unset: free generation.",
    )
    importance_sampling: ImportanceSamplingSpec = Field(
        default_factory=ImportanceSamplingSpec, description="Server/trainer importance-sampling correction."
    )
    off_policy_mask_threshold: float | None = Field(
        default=None,
        gt=0.0,
        description="Drop negative-advantage sequences whose mean log-ratio to the sampler exceeds this "
        "(0.5 is a good start); unset disables.",
    )
    sync_interval: int = Field(default=1, ge=1, description="Publish the adapter every N optimizer steps.")
    async_prefetch: bool = Field(
        default=False, description="Generate the next batch while the current one trains."
    )
    prefetch_depth: int = Field(
        default=1, ge=1, le=8,
        description="Batches generated ahead with asyncPrefetch, requested concurrently so the server decodes "
        "them together; each adds one step to the staleness bound (a batch may be generated that many "
        "versions behind the step that trains on it; importanceSampling corrects for it and its maxDrift bounds "
        "it). It pays when server and trainer have GPUs of their own: on one shared GPU the two processes take "
        "turns, so overlap gains little (BENCHMARKS.md has the measurements).",
    )
    num_nodes: int = Field(
        default=1, ge=1, le=MAX_TRAINER_NODES,
        description="Trainer pods. Several are an indexed Job with a headless Service (`<run>-trainer`) for "
        "the rendezvous of torch.distributed, as Kubeflow Trainer lays it out; a lost pod fails the attempt "
        "and the next one resumes from the last checkpoint. `grpo run` starts numNodes × numProcPerNode "
        "processes on the one machine.",
    )
    num_proc_per_node: int = Field(
        default=1, ge=1, le=MAX_TRAINER_PROCS_PER_NODE,
        description="Trainer processes per pod, launched with torchrun (one per GPU on a GPU node: set "
        "resources.limits nvidia.com/gpu to at least this, or the attempt fails as InvalidSpec before any "
        "process starts; gloo on CPU; see strategy). Rank 0 alone talks to the server: it gathers every "
        "process's prompts, generates them, gives each its share, and publishes the adapter.",
    )
    strategy: Strategy = Field(
        default=Strategy.DDP,
        description="How the numNodes × numProcPerNode processes hold the policy. ddp: every process holds all "
        "of it and gradients are averaged (fastest while the model, its gradients and optimizer state fit one "
        "device). fsdp: PyTorch FSDP2 through Accelerate, as TRL users select it: parameters, gradients and "
        "optimizer state sharded over every process by decoder layer (the layout of DeepSpeed ZeRO-3), for a "
        "policy that does not fit one device; gradientCheckpointing becomes FSDP activation checkpointing, and "
        "each published adapter is gathered from the shards first.",
    )
    max_staleness: int | None = Field(
        default=None, ge=0, le=64,
        description="Most policy versions a batch's policy may lag behind the step that trains on it (a version "
        "is published every syncInterval steps); an older batch is generated again "
        "(grpo_trainer_discarded_batches{reason=\"stale_adapter\"}), and the age of every batch is in "
        "grpo_trainer_staleness_versions. The importance-sampling correction always uses the per-token "
        "logprobs of the version that generated the batch. Unset: the staleness the pipeline produces by "
        "construction, syncInterval - 1 + prefetchDepth steps (prefetchDepth counts with asyncPrefetch only). "
        "With asyncPrefetch it must be at least prefetchDepth.",
    )
    checkpoint_interval: int = Field(default=10, ge=1, description="Write a resumable checkpoint every N steps.")
    seed: int = Field(
        default=42, ge=0, le=2**32 - 1,
        description="Random seed (data order, sampling, initialisation); at most 2^32 - 1, as numpy takes it.",
    )
    gradient_checkpointing: bool = Field(default=False, description="Trade compute for activation memory.")
    generation_timeout_seconds: float = Field(
        default=600.0, gt=0.0, description="Timeout of one generation request to the server."
    )
    reward_timeout_seconds: float = Field(
        default=600.0, gt=0.0, le=86400.0,
        description="Longest one call of a reward function may take: past it the attempt ends (exit code 1, the "
        "function named) and the next one tries again, so a hung function (a judge that never answers) costs "
        "this long, not the run.",
    )
    metrics_port: int = Field(
        default=9400, ge=1, le=65535,
        description=f"Port of the trainer's /metrics; with numNodes > 1 not {TRAINER_RENDEZVOUS_PORT} (the "
        "rendezvous of the trainer pods).",
    )
    report_to: list[Tracker] = Field(
        default_factory=list,
        max_length=len(Tracker),
        description="Experiment trackers the trainer reports every step's metrics (reward, loss, step and sync time, "
        "staleness, ...) and its settings to, through transformers' own integrations (TRL's report_to); empty: "
        "none. tensorboard writes event files on the run's volume (<mountPath>/tracking/<run>/tensorboard); "
        "mlflow, wandb and trackio take their settings and credentials from env (MLFLOW_TRACKING_URI, "
        "MLFLOW_EXPERIMENT_NAME, WANDB_PROJECT, WANDB_MODE, ...; WANDB_API_KEY, MLFLOW_TRACKING_TOKEN from a "
        "Secret). A tracker whose package the trainer image lacks fails the run as InvalidSpec.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables.", max_length=64)

    _check_image = field_validator("image")(check_image)

    @field_validator("report_to")
    @classmethod
    def _report_to_once(cls, value: list[Tracker]) -> list[Tracker]:
        if len(set(value)) != len(value):
            raise ValueError(f"{REPORT_TO_DUPLICATE_MESSAGE}: {[str(t) for t in value]}")
        return value

    @property
    def generation_batch_size(self) -> int:
        return self.per_device_batch_size * self.gradient_accumulation_steps

    # _batch_divisible and PodSettings._pod_settings, for the API server.
    model_config = ConfigDict(json_schema_extra=cel.rules(*TRAINER_RULES, *pod_rules("trainer")))

    @model_validator(mode="after")
    def _batch_divisible(self) -> TrainerSpec:
        if self.generation_batch_size % self.num_generations != 0:
            raise ValueError(
                "perDeviceBatchSize × gradientAccumulationSteps "
                f"({self.generation_batch_size}) must be divisible by numGenerations ({self.num_generations})"
            )
        if self.async_prefetch and self.max_staleness is not None and self.max_staleness < self.prefetch_depth:
            raise ValueError(f"{MAX_STALENESS_MESSAGE} (maxStaleness {self.max_staleness}, prefetchDepth "
                             f"{self.prefetch_depth})")
        if self.tuning == Tuning.FULL and self.lora.quantize_base:
            raise ValueError(FULL_TUNING_QLORA_MESSAGE)
        if self.sync == SyncPath.MERGED and (self.tuning == Tuning.FULL or self.lora.quantize_base):
            raise ValueError(MERGED_SYNC_MESSAGE)
        if self.sync == SyncPath.MERGED and self.strategy == Strategy.FSDP:
            raise ValueError(MERGED_SYNC_FSDP_MESSAGE)
        if self.tuning == Tuning.FULL and self.strategy == Strategy.FSDP:
            raise ValueError(FULL_TUNING_FSDP_MESSAGE)
        if self.num_nodes > 1 and self.metrics_port == TRAINER_RENDEZVOUS_PORT:
            raise ValueError(METRICS_PORT_MESSAGE)
        return self

    @property
    def full(self) -> bool:
        """Every weight trains and moves to the server by weight transfer."""
        return self.tuning == Tuning.FULL

    @property
    def pushes_weights(self) -> bool:
        """Each sync pushes weights into the server (full tuning, or LoRA merged into the target modules)."""
        return self.full or self.sync == SyncPath.MERGED
