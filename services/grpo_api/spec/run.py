"""The run as a whole: the spec of its sections and their cross-field rules, its metadata, and GRPORun itself."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from grpo_api.spec import cel
from grpo_api.spec.api import ApiModel
from grpo_api.spec.output import OutputSpec
from grpo_api.spec.policy import InitializerSpec, RunPolicy
from grpo_api.spec.scheduling import SchedulingSpec
from grpo_api.spec.server import ServerSpec
from grpo_api.spec.sources import DatasetSpec, ModelSpec, RewardCodeSpec, RewardSpec
from grpo_api.spec.status import GRPORunStatus
from grpo_api.spec.storage import StorageSpec
from grpo_api.spec.trainer import TrainerSpec

#: A run's children are named after it: "<run>-trainer-<attempt>" (a Job, whose name the Job controller
#: also puts in a label value of at most 63 characters) and "<run>-server" (a Service: a DNS-1035 label).
MAX_RUN_NAME = 48
#: DNS-1035 label: what a Service name must be (lowercase alphanumerics and '-', starting with a letter).
RUN_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
RUN_NAME_MESSAGE = (
    f"metadata.name must start with a letter, hold only a-z, 0-9 and '-', end with a letter or digit and be "
    f"at most {MAX_RUN_NAME} characters: the server Service and trainer Jobs are named after it"
)


class Mode(StrEnum):
    SERVER = "server"
    COLOCATE = "colocate"


ADAPTER_NEEDS_LORA = (
    "spec.model.adapter is a LoRA adapter to train on from: it needs trainer.tuning lora, not full (merge it "
    "into the model's weights for full fine-tuning)"
)
OUTPUT_NEEDS_LORA = "spec.output needs trainer.tuning lora (exporting a fully tuned model is not supported yet)"
STORAGE_MOUNTS_TAKEN = "a mountPath may not be that of spec.storage or spec.storage.modelCache"
IMMUTABLE = "spec.{field} cannot change after the run is created"
PRESENCE = "spec.{field} cannot be added or removed after the run is created"
#: The spec sections that cannot change after the run is created (in value, and in presence).
IMMUTABLE_FIELDS: list[str] = []


def _immutable(field: str) -> dict[str, Any]:
    """json_schema_extra of a spec section that cannot change: its transition rule, and a presence rule."""
    IMMUTABLE_FIELDS.append(field)
    return cel.schema(cel.rule("self == oldSelf", IMMUTABLE.format(field=field)))


def _default_storage() -> StorageSpec:
    return StorageSpec(size="20Gi")


def _spec_rules() -> list[cel.Rule]:
    """CEL of GRPORunSpec._mode_matches_sections, and the presence rules of the sections marked _immutable
    (which a transition rule on a section cannot hold: it does not run when the section is added or removed)."""
    return [
        cel.rule(
            "self.mode != 'colocate' || !has(self.server)",
            "mode colocate runs vLLM inside the trainer: remove spec.server",
            fieldPath=".server",
            reason="FieldValueForbidden",
        ),
        # Server mode without a server section runs the default server: its maxLoraRank still applies.
        cel.rule(
            "self.mode == 'colocate' || !has(self.trainer) || !has(self.trainer.lora) || !has(self.trainer.lora.r) "
            "|| (has(self.trainer.tuning) && self.trainer.tuning == 'full') "
            "|| (has(self.trainer.sync) && self.trainer.sync == 'merged') "
            "|| self.trainer.lora.r <= ((has(self.server) && has(self.server.maxLoraRank)) "
            f"? self.server.maxLoraRank : {ServerSpec.model_fields['max_lora_rank'].default})",
            "spec.trainer.lora.r must not exceed spec.server.maxLoraRank "
            f"({ServerSpec.model_fields['max_lora_rank'].default} when spec.server is omitted)",
            fieldPath=".trainer.lora.r",
        ),
        cel.rule(
            "!has(self.model.adapter) || !has(self.trainer) || !has(self.trainer.tuning) || "
            "self.trainer.tuning != 'full'",
            ADAPTER_NEEDS_LORA,
            fieldPath=".model.adapter",
            reason="FieldValueForbidden",
        ),
        cel.rule(
            "self.mode == 'colocate' || !has(self.storage) || !has(self.storage.accessModes) || "
            "!self.storage.accessModes.exists(m, m == 'ReadWriteOncePod')",
            "spec.storage.accessModes: ReadWriteOncePod lets one pod mount the volume, but server mode runs a "
            "server and a trainer on it; use ReadWriteOnce (same node) or ReadWriteMany",
            fieldPath=".storage.accessModes",
        ),
        *(
            cel.rule(
                f"!has(self.{section}) || !has(self.{section}.volumeMounts) || !has(self.storage) || "
                f"self.{section}.volumeMounts.all(m, (!has(self.storage.mountPath) || m.mountPath != "
                "self.storage.mountPath) && (!has(self.storage.modelCache) || !has(self.storage.modelCache.mountPath) "
                "|| m.mountPath != self.storage.modelCache.mountPath))",
                f"spec.{section}.volumeMounts: {STORAGE_MOUNTS_TAKEN}",
                fieldPath=f".{section}.volumeMounts",
            )
            for section in ("server", "trainer")
        ),
        cel.rule(
            "!has(self.output) || !has(self.trainer) || !has(self.trainer.tuning) || self.trainer.tuning != 'full'",
            OUTPUT_NEEDS_LORA,
            fieldPath=".output",
        ),
        *(
            cel.rule(f"has(self.{field}) == has(oldSelf.{field})", PRESENCE.format(field=field), fieldPath=f".{field}")
            for field in IMMUTABLE_FIELDS
        ),
    ]


class GRPORunSpec(ApiModel):
    """What to train, on what, and how: one GRPO post-training run."""

    model: ModelSpec = Field(description="The base model.", json_schema_extra=_immutable("model"))
    dataset: DatasetSpec = Field(description="The prompt dataset.", json_schema_extra=_immutable("dataset"))
    rewards: list[RewardSpec] = Field(
        description="Reward functions; the total reward is their weighted sum.",
        min_length=1,
        max_length=16,
        json_schema_extra=_immutable("rewards"),
    )
    mode: Mode = Field(
        default=Mode.SERVER,
        description="server: a vLLM server Deployment plus a trainer Job; colocate: vLLM inside the trainer.",
        json_schema_extra=_immutable("mode"),
    )
    server: ServerSpec | None = Field(
        default=None,
        description="The generation server (server mode only; defaults apply when omitted).",
        json_schema_extra=_immutable("server"),
    )
    trainer: TrainerSpec = Field(
        default_factory=TrainerSpec, description="The trainer.", json_schema_extra=_immutable("trainer")
    )
    storage: StorageSpec = Field(
        default_factory=_default_storage,
        description="Shared volume for adapters and checkpoints.",
        json_schema_extra=_immutable("storage"),
    )
    run_policy: RunPolicy = Field(default_factory=RunPolicy, description="Retries, deadlines, suspend, cleanup.")
    scheduling: SchedulingSpec = Field(
        default_factory=SchedulingSpec,
        description="Node placement of the pods.",
        json_schema_extra=_immutable("scheduling"),
    )
    reward_code: RewardCodeSpec | None = Field(
        default=None,
        description="User reward modules (a ConfigMap, an image, a claim directory, or inline source), "
        "importable by the trainer from a read-only mount.",
        json_schema_extra=_immutable("rewardCode"),
    )
    initializer: InitializerSpec = Field(
        default_factory=InitializerSpec,
        description="The initializer that fetches and checks the sources once per run.",
        json_schema_extra=_immutable("initializer"),
    )
    output: OutputSpec | None = Field(
        default=None,
        description="Where the result goes after the trainer's last step, and in which form (unset: it stays "
        "on the run's volume).",
        json_schema_extra=_immutable("output"),
    )

    # After the fields, whose _immutable marks the presence rules name.
    model_config = ConfigDict(json_schema_extra=cel.rules(*_spec_rules()))

    @model_validator(mode="after")
    def _mode_matches_sections(self) -> GRPORunSpec:
        if self.mode == Mode.COLOCATE and self.server is not None:
            raise ValueError("mode colocate runs vLLM inside the trainer: remove the server section")
        if self.mode == Mode.SERVER and "ReadWriteOncePod" in self.storage.access_modes:
            raise ValueError(
                "storage.accessModes: ReadWriteOncePod lets one pod mount the volume, but server mode runs a "
                "server and a trainer on it; use ReadWriteOnce (same node) or ReadWriteMany"
            )
        if self.model.adapter is not None and self.trainer.full:
            raise ValueError(ADAPTER_NEEDS_LORA)
        taken = {self.storage.mount_path, *([self.storage.model_cache.mount_path] if self.storage.model_cache else [])}
        sections: list[ServerSpec | TrainerSpec] = [s for s in (self.server, self.trainer) if s is not None]
        for section in sections:
            for index, mount in enumerate(section.volume_mounts):
                if mount.mount_path in taken:
                    raise ValueError(f"{section.section}.volumeMounts[{index}].mountPath {mount.mount_path!r}: "
                                     f"{STORAGE_MOUNTS_TAKEN}")
        if self.output is not None and self.trainer.full:
            raise ValueError(OUTPUT_NEEDS_LORA)
        if self.mode == Mode.SERVER:
            server = self.effective_server
            if not self.trainer.pushes_weights and self.trainer.lora.r > server.max_lora_rank:
                raise ValueError(
                    f"trainer.lora.r ({self.trainer.lora.r}) exceeds server.maxLoraRank ({server.max_lora_rank})"
                )
        return self

    @property
    def effective_server(self) -> ServerSpec:
        """The server section with defaults applied (server mode)."""
        return self.server if self.server is not None else ServerSpec()


#: CEL rules on the spec object: cross-field checks the API server enforces at admission.
SPEC_RULES: list[cel.Rule] = _spec_rules()


class ObjectMeta(ApiModel):
    """The subset of metadata the tools read."""

    model_config = ConfigDict(extra="ignore", alias_generator=to_camel, populate_by_name=True)

    name: str = Field(default="run", description="Run name.")
    namespace: str | None = Field(default=None, description="Namespace.")

    @field_validator("name")
    @classmethod
    def _names_children(cls, value: str) -> str:
        if len(value) > MAX_RUN_NAME or not re.fullmatch(RUN_NAME_PATTERN, value):
            raise ValueError(f"{value!r}: {RUN_NAME_MESSAGE}")
        return value

    uid: str | None = Field(default=None, description="UID.")
    generation: int | None = Field(default=None, description="Generation.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations.")


class GRPORun(ApiModel):
    """A GRPO post-training run: a vLLM server and a TRL trainer kept in step by the operator."""

    api_version: Literal["grpo.dev/v1alpha1"] = Field(default="grpo.dev/v1alpha1", description="API version.")
    kind: Literal["GRPORun"] = Field(default="GRPORun", description="Kind.")
    metadata: ObjectMeta = Field(default_factory=ObjectMeta, description="Object metadata.")
    spec: GRPORunSpec = Field(description="Desired run.")
    status: GRPORunStatus | None = Field(default=None, description="Observed state.")
