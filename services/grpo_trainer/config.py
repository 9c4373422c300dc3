"""From the GRPORun spec to TRL's GRPOConfig and PEFT's LoraConfig (pure builders), and refusals.

The objective is TRL's: loss type, group advantages, clipping, KL, the vLLM
importance-sampling correction (token/sequence x truncate/mask, clip) and
off-policy sequence masking all map onto GRPOConfig fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from grpo_api.models import Engine, GRPORunSpec, LoraSpec, Mode, Strategy, Tracker, Tuning, WeightTransfer
from grpo_trainer.errors import InvalidSpec, UnsupportedSetting

#: Where a user finds an image that has what `vllm_needed_for` asks for.
VLLM_IMAGE_HINT = (
    "use a trainer image with vLLM (Dockerfile.trainer built with ENGINE=vllm, its default; the operator's "
    "default trainer image is one)"
)


#: The modules transformers' integration of each tracker needs (any one of them; its `is_<name>_available`): the
#: TensorBoard callback writes through torch.utils.tensorboard (the `tensorboard` package) or tensorboardX.
TRACKER_MODULES: dict[str, tuple[str, ...]] = {
    Tracker.TENSORBOARD: ("tensorboard", "tensorboardX"),
    Tracker.MLFLOW: ("mlflow",),
    Tracker.WANDB: ("wandb",),
    Tracker.TRACKIO: ("trackio",),
}


#: The MLflow client's HTTP limits unless the spec's env sets them: its defaults (7 retries with backoff factor 2, 120 s
#: a request, made for rate limits) keep a trainer whose tracking server is gone retrying one request for ~4 minutes,
#: at every step and again after the last one, where the run looks hung. These fail such a request within ~10 s
#: (refused) or ~2 minutes (no answer) and ride out a restart of a few seconds.
MLFLOW_CLIENT_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


def tracker_environment(spec: GRPORunSpec) -> dict[str, str]:
    """Environment defaults for the trackers (the trainer sets each unless already set, as by spec.trainer.env).

    Reporting to MLflow: the client's HTTP limits above. Not reporting to it: transformers' own switch
    DISABLE_MLFLOW_INTEGRATION, since TRL's profiling module imports mlflow whenever transformers finds it installed
    (1.7 s of a rank's start on a CPU core, a quarter of its imports). Nothing else reads that switch: the trackers are
    callbacks named by report_to, and image_capabilities looks for their packages itself.
    """
    if Tracker.MLFLOW in spec.trainer.report_to:
        return dict(MLFLOW_CLIENT_LIMITS)
    return {"DISABLE_MLFLOW_INTEGRATION": "TRUE"}


@dataclass(frozen=True)
class Platform:
    """What this machine offers."""

    cuda: bool
    bf16: bool
    vllm: bool
    bitsandbytes: bool
    #: The trackers (spec.trainer.reportTo) whose packages this image has.
    trackers: frozenset[str] = field(default_factory=frozenset)


#: "loss" (the default: sampler_ratio) or "forward" (TRL's own no-grad scoring forward).
ENV_OLD_LOGPS = "GRPO_TRAINER_OLD_LOGPS"
#: "off" (the default: adapter_casts) or "keep" (PEFT's cast of each adapted layer's input, as TRL trains).
ENV_ADAPTER_INPUT_CASTS = "GRPO_TRAINER_ADAPTER_INPUT_CASTS"


@dataclass(frozen=True)
class Savings:
    """The trainer's two savings over TRL's step, each on unless its environment variable keeps TRL's way (the
    benchmark's colocate baseline keeps both; each is also an A/B of its saving)."""

    #: the importance-sampling ratio from the training forward where that is sound (${ENV_OLD_LOGPS})
    ratio_in_loss: bool = True
    #: no float32 copy of each LoRA layer's input under autocast where that is sound (${ENV_ADAPTER_INPUT_CASTS})
    drop_adapter_input_casts: bool = True

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> Savings:
        return cls(ratio_in_loss=_switch(environ, ENV_OLD_LOGPS, on="loss", off="forward"),
                   drop_adapter_input_casts=_switch(environ, ENV_ADAPTER_INPUT_CASTS, on="off", off="keep"))


def _switch(environ: Mapping[str, str], name: str, *, on: str, off: str) -> bool:
    """${name} as `on` (also when unset or empty) or `off`, case and spaces aside; InvalidSpec naming it otherwise."""
    raw = environ.get(name, "")
    value = raw.strip().lower() or on
    if value not in (on, off):
        raise InvalidSpec(f"${name}={raw[:64]!r} must be {on!r} (the default) or {off!r}")
    return value == on


def trackers_missing(spec: GRPORunSpec, available: frozenset[str]) -> UnsupportedSetting | None:
    """The refusal of a spec.trainer.reportTo that names a tracker whose package this image lacks; None if none."""
    missing = [str(t) for t in spec.trainer.report_to if str(t) not in available]
    if not missing:
        return None
    packages = ", ".join(f"{t} needs {' or '.join(TRACKER_MODULES[t])}" for t in missing)
    return UnsupportedSetting(
        f"spec.trainer.reportTo names {', '.join(missing)}, whose package this trainer image lacks ({packages}); "
        "use an image that has it, or leave it out of reportTo"
    )


def _server_on_gpu(spec: GRPORunSpec) -> bool:
    """Whether the server runs the vllm engine: named, or `auto` with a GPU (an extended resource such as
    nvidia.com/gpu) in its resources; the transformers engine takes weights over gloo, which needs no vLLM."""
    server = spec.effective_server
    if server.engine != Engine.AUTO:
        return server.engine == Engine.VLLM
    asked = {**server.resources.requests, **server.resources.limits}
    return any(name.endswith("/gpu") and str(value).strip() not in ("0", "") for name, value in asked.items())


def vllm_needed_for(spec: GRPORunSpec, weight_transfer: str | None) -> str | None:
    """Why this run needs vLLM in the trainer's own image, naming the fields; None when it does not.
    `weight_transfer` is the resolved backend (`grpo_api.weight_transfer.resolve_weight_transfer`)."""
    if spec.mode == Mode.COLOCATE:
        return "spec.mode colocate runs vLLM inside the trainer"
    if weight_transfer == WeightTransfer.NCCL and _server_on_gpu(spec):
        what = "spec.trainer.tuning full" if spec.trainer.tuning == Tuning.FULL else "spec.trainer.sync merged"
        chosen = spec.effective_server.weight_transfer
        how = "nccl" if chosen == WeightTransfer.NCCL else "auto: nccl with server and trainer in separate pods"
        return (f"{what} sends the weights to the vllm server over nccl (spec.server.weightTransfer {how}), and the "
                "trainer's side of that is vLLM's (NCCLWeightTransferEngine)")
    return None


def image_lacks_vllm(need: str, error: str) -> UnsupportedSetting:
    """The refusal of a run that needs vLLM in a trainer image without it (`need`: `vllm_needed_for`'s reason)."""
    other = ("or mode server" if need.startswith("spec.mode colocate")
             else "or put the server on the trainer's GPU (spec.server.weightTransfer ipc), or use trainer.tuning lora "
                  "with sync adapter")
    return UnsupportedSetting(f"spec.trainer.image: {need}, but this image has no vLLM ({error}); "
                              f"{VLLM_IMAGE_HINT}, {other}")


def check_supported(spec: GRPORunSpec, platform: Platform, weight_transfer: str | None = None) -> None:
    """Refuse settings this trainer does not implement, naming the field. `weight_transfer`: the resolved
    backend the server takes weights over (None: the trainer pushes none)."""
    need = vllm_needed_for(spec, weight_transfer)
    if need is not None and not platform.vllm:
        raise image_lacks_vllm(need, "`import vllm` finds no module")
    if spec.mode == Mode.COLOCATE and not platform.cuda:
        raise UnsupportedSetting(
            "spec.mode colocate runs vLLM inside the trainer and needs a CUDA GPU, which this machine lacks; use "
            "mode server (the default) here"
        )
    if spec.trainer.strategy == Strategy.FSDP and not platform.cuda:
        raise UnsupportedSetting(
            "spec.trainer.strategy fsdp shards the policy over CUDA GPUs (Accelerate runs FSDP over NCCL only) "
            "and this machine has none; use strategy ddp here (gloo on CPU)"
        )
    if spec.trainer.lora.quantize_base and not (platform.cuda and platform.bitsandbytes):
        raise UnsupportedSetting(
            "spec.trainer.lora.quantizeBase (QLoRA) needs a CUDA GPU and bitsandbytes; set it to false"
        )
    lacking = trackers_missing(spec, platform.trackers)
    if lacking is not None:
        raise lacking


def importance_sampling_mode(spec: GRPORunSpec) -> str:
    """TRL's vllm_importance_sampling_mode: <token|sequence>_<truncate|mask>."""
    imp = spec.trainer.importance_sampling
    return f"{imp.level}_{imp.mode}"


def grpo_config_kwargs(
    spec: GRPORunSpec,
    *,
    output_dir: str,
    server_url: str,
    reward_weights: list[float],
    platform: Platform,
) -> dict[str, Any]:
    """Keyword arguments of trl.GRPOConfig for this run."""
    t = spec.trainer
    imp = t.importance_sampling
    colocate = spec.mode == Mode.COLOCATE
    dtype = str(spec.model.dtype)
    use_bf16 = platform.cuda and platform.bf16 and dtype in ("auto", "bfloat16")
    use_fp16 = platform.cuda and dtype == "float16"
    kwargs: dict[str, Any] = {
        "output_dir": output_dir,
        # Batching: one generation batch per optimizer step (steps_per_generation = grad accumulation).
        "per_device_train_batch_size": t.per_device_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "num_generations": t.num_generations,
        "max_completion_length": t.max_completion_length,
        "max_steps": t.max_steps,
        "learning_rate": t.learning_rate,
        "lr_scheduler_type": t.lr_scheduler,
        "warmup_steps": 0,
        "seed": t.seed,
        # Objective.
        "loss_type": str(t.loss_type),
        "beta": t.beta,
        "epsilon": t.epsilon,
        "importance_sampling_level": str(t.ratio_level),
        "reward_weights": reward_weights,
        "temperature": t.temperature,
        "top_p": t.top_p,
        "top_k": max(t.top_k, 0),  # -1 and 0 both mean "off"; TRL's convention is 0
        # Generation through vLLM semantics: sampler logprobs feed the IS correction.
        "use_vllm": True,
        "vllm_mode": "colocate" if colocate else "server",
        "vllm_server_base_url": None if colocate else server_url,
        "vllm_server_timeout": t.generation_timeout_seconds,
        "vllm_importance_sampling_correction": imp.enabled,
        "vllm_importance_sampling_mode": importance_sampling_mode(spec),
        "vllm_importance_sampling_clip_max": imp.clip_max,
        "off_policy_mask_threshold": t.off_policy_mask_threshold,
        # Checkpoints (resumable: optimizer, scheduler, RNG, state) and logging every step.
        "save_strategy": "steps",
        "save_steps": t.checkpoint_interval,
        "save_total_limit": 2,
        "logging_steps": 1,
        # Trackers through transformers' integrations, which report on the main process only; their settings come
        # from the environment (spec.trainer.env), TensorBoard's folder too (TENSORBOARD_LOGGING_DIR, on the volume).
        "report_to": [str(tracker) for tracker in t.report_to] or "none",
        "disable_tqdm": True,
        "log_completions": False,
        # Platform.
        "use_cpu": not platform.cuda,
        "bf16": use_bf16,
        "fp16": use_fp16,
        "gradient_checkpointing": t.gradient_checkpointing and t.strategy != Strategy.FSDP,
        "dataloader_num_workers": 0,
        # Several trainer processes (DDP): every LoRA parameter takes part in each forward pass.
        "ddp_find_unused_parameters": False,
    }
    if t.strategy == Strategy.FSDP:
        kwargs["fsdp"] = True
        kwargs["fsdp_config"] = fsdp_config(gradient_checkpointing=t.gradient_checkpointing)
    if colocate:
        kwargs["vllm_enable_sleep_mode"] = True
    if t.structured_outputs is not None:
        # TRL puts generation_kwargs into every server request and into colocate's SamplingParams
        kwargs["generation_kwargs"] = {"structured_outputs": t.structured_outputs.vllm_params()}
    return kwargs


def fsdp_config(*, gradient_checkpointing: bool) -> dict[str, Any]:
    """transformers' fsdp_config for strategy fsdp: FSDP2 (Accelerate's plugin), every decoder layer a shard
    unit (the model's _no_split_modules), parameters resharded after forward (ZeRO-3's layout), a
    checkpoint as full state (resumable with any world size). Gradient checkpointing is FSDP's
    activation checkpointing, which transformers recommends over its own under FSDP (one all-gather fewer)."""
    return {
        "version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "reshard_after_forward": True,
        "state_dict_type": "FULL_STATE_DICT",
        "activation_checkpointing": gradient_checkpointing,
    }


def lora_config_kwargs(lora: LoraSpec) -> dict[str, Any]:
    """Keyword arguments of peft.LoraConfig: plain LoRA that vLLM can serve (no bias, DoRA, extra modules)."""
    targets: str | list[str] = "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    return {
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "bias": "none",
        "use_dora": False,
        "task_type": "CAUSAL_LM",
    }
